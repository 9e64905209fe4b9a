"""The floor of the benchmark's graph timing: what a leg costs when it does (almost) nothing.

    torchrun --nproc-per-node 2 scripts/graph_floor.py

Times, with bench's graph harness (events recorded inside one CUDA graph, slowest rank's
median), a one-element add, a one-element NCCL all_reduce, and the native dispatch and combine of one
token: how much of a small-batch leg is the harness and a kernel launch inside a graph.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime import EpDispatchCombineConfig, EpDispatchCombineOp  # noqa: E402
from bench.measure import graph_time, stats  # noqa: E402


def main() -> int:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank, world = dist.get_rank(), dist.get_world_size()
    one = torch.zeros(1, device="cuda")
    rows = {"add, 1 element": graph_time([lambda: one.add_(1.0)], 20, 20)[0],
            "NCCL all_reduce, 1 element": graph_time([lambda: dist.all_reduce(one)], 20, 20)[0]}
    cfg = EpDispatchCombineConfig(rank=rank, world_size=world, hidden_dim=7168, max_num_inp_token_per_rank=1,
                                  num_experts_per_rank=256 // world, num_experts_per_token=8, data_type=torch.bfloat16)
    x = torch.randn(1, 7168, device="cuda").to(torch.bfloat16)
    idx = torch.randperm(256, device="cuda")[:8].to(torch.int32).view(1, 8)
    with EpDispatchCombineOp(cfg) as op:
        view, held = op.combine_in_view(), {}

        def disp():
            held["h"] = op.dispatch(x, None, None, idx, return_routing=True)[-1]

        d, c = graph_time([disp, lambda: op.combine(view, routing=held["h"])], 20, 20)
        rows["native dispatch, 1 token"], rows["native combine, 1 token"] = d, c
    out = {name: stats(ms)[0] * 1e3 for name, ms in rows.items()}
    if rank == 0:
        for name, us in out.items():
            print(f"{us:7.1f} us  {name}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
