"""A peer process dies mid-dispatch: every survivor must raise EpTimeoutError within timeout_s + 1 s, never hang.

torchrun --nproc-per-node N tests/gpu/fault_peer_death.py     (exit 0 = the survivors raised in time)

Any world size; the last rank dies. With more ranks than GPUs the ranks share GPUs (tests/gpu/dist_util).
"""

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from runtime import EpDispatchCombineConfig, EpDispatchCombineOp  # noqa: E402
from runtime.errors import EpTimeoutError  # noqa: E402
from tests.gpu.dist_util import init_dist  # noqa: E402

TIMEOUT = 3.0


def main() -> int:
    init_dist()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = EpDispatchCombineConfig(rank=rank, world_size=world, hidden_dim=2048, max_num_inp_token_per_rank=128,
                                  num_experts_per_rank=8, num_experts_per_token=4, kernel_backend="native",
                                  timeout_s=TIMEOUT)
    op = EpDispatchCombineOp(cfg)
    x = torch.randn(128, 2048, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, 8 * world, (128, 4), device="cuda", dtype=torch.int32)
    out, _, _, _, _, h = op.dispatch(x, None, None, idx, return_routing=True)
    op.combine(out, routing=h)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == world - 1:
        op.dispatch(x, None, None, idx)  # launched, then the process dies without a word
        os._exit(0)
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        for _ in range(3):  # dispatch may still complete if the peer's kernel signalled before dying
            out, _, _, _, _, h = op.dispatch(x, None, None, idx, return_routing=True)
            op.combine(out, routing=h)
            torch.cuda.synchronize()
            op.check()
        print("survivor: no error raised", flush=True)
        rc = 1
    except EpTimeoutError as e:
        elapsed = time.monotonic() - t0
        print(f"survivor rank {rank} of {world} raised {type(e).__name__} after {elapsed:.2f}s "
              f"(timeout_s={TIMEOUT}): {e}", flush=True)
        rc = 0 if elapsed <= TIMEOUT + 1 else 1
    os._exit(rc)  # the group is broken: no collective teardown


if __name__ == "__main__":
    sys.exit(main())
