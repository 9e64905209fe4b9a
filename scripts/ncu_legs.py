"""The grouped layer's kernels as Nsight Compute sees them, at one rank (W = 1): why a small batch's steps cost what
they cost, from the hardware's own counters (the warps' stall reasons, per kernel and per SASS instruction).

    ncu --clock-control none --kernel-name regex:epg_ --launch-skip S --launch-count C --section ... \
        torchrun --nproc-per-node 1 scripts/ncu_legs.py [--tokens 1] [--calls 40]

The workload: one op (bf16, hidden 7168, top-8 of 256 experts, grouped layout, alignment 16, the auto protocol: the
shape of scripts/grouped_profile.py), then per token count `--calls` layers of dispatch_grouped -> identity copy ->
combine_grouped: replays of a graph of one layer (`--mode graph`, the default: the kernels a graph runs, which ncu
profiles node by node) or eager calls (`--mode eager`: the eager forms, e.g. the low-latency dispatch with its
placing tail), synchronized at the end.

Why at W = 1 only: ncu replays a kernel to collect its sections, restoring the memory of the GPU it runs on; at one
rank the kernel's flags and counters are all on that GPU, so each replay sees the state the first pass saw (across
two GPUs a replay would wait for a peer's signal that came already, docs/PERF.md). What it cannot say: the
launch's skew against a peer. scripts/device_run.sh NCU=1 runs it (NCU_TOKENS, NCU_ARGS, NCU_SKIP, NCU_COUNT) and
exports the report's details, raw metrics and per-instruction source page as CSV into $OUT/ncu_t<T>/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.inputs import make_input_sets, point_config  # noqa: E402
from bench.measure import warm_on_side_stream  # noqa: E402
from runtime import EpDispatchCombineConfig, EpDispatchCombineOp  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1])
    p.add_argument("--calls", type=int, default=40, help="layers per token count (graph replays or eager calls; ncu's --launch-skip picks among them)")
    p.add_argument("--protocol", choices=["auto", "ll", "bw"], default="auto")
    p.add_argument("--mode", choices=["graph", "eager"], default="graph")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    args = p.parse_args(argv)
    if any(t < 1 for t in args.tokens) or args.calls < 1:
        p.error("--tokens and --calls must be >= 1")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 1:
        p.error("one rank only (torchrun --nproc-per-node 1): see the module docstring")
    torch.cuda.set_device(0)
    for T in args.tokens:
        base = point_config(rank, world, T, args.hidden, args.topk, args.experts, torch.bfloat16)
        cfg = EpDispatchCombineConfig(**base, enable_grouped_layout=True, expert_alignment=16,
                                      intranode_protocol=args.protocol)
        op = EpDispatchCombineOp(cfg)
        s = make_input_sets(cfg, 1, seed=777, device=op.device)[0]
        y = torch.empty(cfg.resolved_grouped_capacity, args.hidden, dtype=torch.bfloat16, device=op.device)
        def layer():
            layout, h = op.dispatch_grouped(s["x"], s["w"], None, s["idx"])
            y.copy_(layout.x)
            op.combine_grouped(y, h)
        if args.mode == "graph":
            warm_on_side_stream(layer)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                layer()
            for _ in range(args.calls):
                g.replay()
        else:
            for _ in range(args.calls):
                layer()
        torch.cuda.synchronize()
        op.check()
        print(f"tokens {T}: {args.calls} layers ({args.mode}), protocol {op._backend.last_protocol}", flush=True)
        op.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
