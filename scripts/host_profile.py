"""Where the host time of an eager dispatch / combine goes (GPU machine, 2+ ranks).

    torchrun --nproc-per-node 2 scripts/host_profile.py [--tokens 128] [--hidden 7168] [--iters 300]
                                                        [--internode v2|v2_ll] [--top 18]

Builds one native op (bf16, top-8 of 256 experts), then on every rank times the host side of each
call (perf_counter around dispatch / combine, the GPU work runs asynchronously behind it) and runs the
same loop under cProfile. Rank 0 prints the host microseconds per call (median) and the functions that
took the most host time of their own. EPGEN_CHECK_EXPERT_IDS=sync shows the cost of the eager
expert-id check made on the host (a device sync; the default "async" check costs nothing here).
--internode profiles the native internode backend instead, as 2 emulated nodes (EPGEN_EMULATE_NODES=1).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime import EpDispatchCombineConfig, EpDispatchCombineOp  # noqa: E402
from runtime.backends.native import id_check_mode  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--internode", choices=["v2", "v2_ll"], default=None)
    args = p.parse_args()
    topo = {}
    if args.internode:
        os.environ["EPGEN_EMULATE_NODES"] = "1"
        topo = {"internode_kernel": args.internode}
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank, world = dist.get_rank(), dist.get_world_size()
    T, H, k, E = args.tokens, args.hidden, 8, 256
    if topo:
        topo["gpu_per_node"] = max(1, world // 2)
    cfg = EpDispatchCombineConfig(rank=rank, world_size=world, hidden_dim=H, max_num_inp_token_per_rank=T,
                                  num_experts_per_rank=E // world, num_experts_per_token=k, data_type=torch.bfloat16,
                                  kernel_backend="native", **topo)
    gen = torch.Generator(device="cuda").manual_seed(7 + rank)
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.rand(T, k, device="cuda", generator=gen)
    idx = torch.rand(T, E, device="cuda", generator=gen).argsort(1)[:, :k].to(torch.int32).contiguous()
    host = {"dispatch": [], "combine": []}
    with EpDispatchCombineOp(cfg) as op:
        view = op.combine_in_view()
        b = op._backend
        first = b.kern[cfg.internode_kernel]["pack"] if topo else b.k["dispatch"]
        launch_path = getattr(first, "launch_path", "?")

        def round_(record: bool) -> None:
            t0 = time.perf_counter()
            out, *_, handle = op.dispatch(x, w, None, idx, return_routing=True)
            t1 = time.perf_counter()
            view[: out.shape[0]].copy_(out)
            t2 = time.perf_counter()
            op.combine(view, routing=handle)
            t3 = time.perf_counter()
            if record:
                host["dispatch"].append((t1 - t0) * 1e6)
                host["combine"].append((t3 - t2) * 1e6)

        for _ in range(20):
            round_(False)
        torch.cuda.synchronize()
        for _ in range(args.iters):
            round_(True)
        torch.cuda.synchronize()
        dist.barrier()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.iters):
            round_(False)
        torch.cuda.synchronize()
        prof.disable()
        dist.barrier()
    if rank == 0:
        where = f"internode {args.internode}, " if args.internode else ""
        print(f"host us per call ({where}median of {args.iters}, T={T}, H={H}, expert-id check {id_check_mode()}): "
              f"dispatch {statistics.median(host['dispatch']):.1f}, combine {statistics.median(host['combine']):.1f}; "
              f"launches through {launch_path}")
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:6000])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
