"""A peer process dies mid-dispatch: the survivor must raise EpTimeoutError, never hang.

torchrun --nproc-per-node 2 tests/gpu/fault_peer_death.py     (exit 0 = the survivor raised in time)
"""

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from runtime import EpDispatchCombineConfig, EpDispatchCombineOp  # noqa: E402
from runtime.errors import EpTimeoutError  # noqa: E402

TIMEOUT = 3.0


def main() -> int:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    cfg = EpDispatchCombineConfig(rank=rank, world_size=2, hidden_dim=2048, max_num_inp_token_per_rank=128,
                                  num_experts_per_rank=8, num_experts_per_token=4, kernel_backend="native",
                                  timeout_s=TIMEOUT)
    op = EpDispatchCombineOp(cfg)
    x = torch.randn(128, 2048, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, 16, (128, 4), device="cuda", dtype=torch.int32)
    out, _, _, _, _, h = op.dispatch(x, None, None, idx, return_routing=True)
    op.combine(out, routing=h)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
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
        print(f"survivor raised {type(e).__name__} after {elapsed:.2f}s (timeout_s={TIMEOUT}): {e}", flush=True)
        rc = 0 if elapsed <= 2 * TIMEOUT + 1 else 1
    os._exit(rc)  # the group is broken: no collective teardown


if __name__ == "__main__":
    sys.exit(main())
