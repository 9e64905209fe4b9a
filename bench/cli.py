"""The benchmark's command line: ``python -m bench`` (the sweep, bench/sweep.py's module docstring), its
layer modes (--layer-loop / --layer / --ceiling: bench/layer.py, docs/LAYER.md), the floor (--floor:
bench/floor.py) and kernel durations inside graph replays (--profile-graph: bench/profile_graph.py); and
``require_gpus``, the GPU tools' first check (this command's and ``python -m bench.tune``'s)."""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import torch.distributed as dist

from generator.abi import LL_MAX_TOKENS
from runtime.config import EMULATE_NODES_ENV

from . import floor as bench_floor, layer as bench_layer, profile_graph as bench_profile, sweep, tables
from .inputs import MAX_INPUT_SETS, ROUTINGS, dtype_name
from .measure import collective_try
from .records import commit, write_records
from .sweep import run_lowprec, run_point


def require_gpus(prog: str) -> None:
    """Exit with one line, not a traceback, where the GPU tools cannot run: no GPU, or not started by torchrun."""
    module = prog.removeprefix("python -m ")  # "bench", "bench.tune", or "epgen bench" / "epgen tune"
    launch = f"launch one process per GPU: torchrun --nproc-per-node N -m {module} ... (README: Performance)"
    if not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None and torch.version.hip is None
               else "this torch sees no GPU")
        raise SystemExit(f"{prog}: needs GPUs (NVIDIA sm_90; the torch backend alone runs on CPU, in the tests), but "
                         f"{why}; {launch}")
    missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR") if v not in os.environ]
    if missing:
        raise SystemExit(f"{prog}: not started by torchrun (no {', '.join(missing)} in the environment); {launch}")


def build_parser(prog: str = "python -m bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=sweep.__doc__.splitlines()[0] + " Needs GPUs, one process "
                                "per GPU: torchrun --nproc-per-node N -m bench ... (or -m epgen bench ...).")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="tokens per rank (default: 128 4096; --layer / --layer-loop: their own lists)")
    p.add_argument("--hidden", type=int, nargs="+", default=[7168])
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--inner", type=int, default=20, help="iterations captured per graph (at least the input sets)")
    p.add_argument("--reps", type=int, default=30, help="graph replays")
    p.add_argument("--eager-iters", type=int, default=50, help="timed eager iterations (after 2 warm-up ones)")
    p.add_argument("--input-sets", type=int, default=0,
                   help=f"input sets used in turn (0: enough to exceed twice the L2, 2..{MAX_INPUT_SETS})")
    p.add_argument("--torch-baseline", action="store_true", help="also time the torch reference backend (eager)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float8_e4m3fn"],
                   help="payload dtypes of the sweep (float8_e4m3fn: pre-quantized payload, per-128 fp32 scales)")
    p.add_argument("--lowprec", action="store_true", help="also compare fp8 dispatch / fp8 scatter combine with bf16")
    p.add_argument("--lowprec-tokens", type=int, nargs="+", default=[128, 4096])
    p.add_argument("--internode", nargs="+", default=[], choices=["v2", "v2_ll", "auto"],
                   help="also run every point internode with these kernels (gpu_per_node below)")
    p.add_argument("--gpu-per-node", type=int, default=0,
                   help="internode points: GPUs per node (0: half the world, at least 1)")
    p.add_argument("--emulate-nodes", action="store_true",
                   help="set EPGEN_EMULATE_NODES=1: internode points on one host (emulated nodes)")
    p.add_argument("--launch-blocks", type=int, nargs="+", default=[0],
                   help="grid override for every point (0: tuning table); several: each in turn")
    p.add_argument("--launch-threads", type=int, nargs="+", default=[0],
                   help="threads per block override for every point (0: tuning table); several: each in turn")
    p.add_argument("--combine-threads", type=int, nargs="+", default=[0],
                   help="threads per block of the combine alone (0: as --launch-threads); several: each in turn")
    p.add_argument("--combine-mode", nargs="+", default=["gather"], choices=["gather", "scatter"],
                   help="combines to run every intranode point with (config combine_mode; record field combine_mode)")
    p.add_argument("--profile", action="store_true", help="device time per kernel of each point (torch.profiler)")
    p.add_argument("--routing", choices=ROUTINGS, default="uniform",
                   help="uniform: top-k of all experts; remote: of the other ranks' experts only (no local rows)")
    p.add_argument("--protocol", nargs="+", default=["bw"], choices=["auto", "ll", "bw"],
                   help="intranode wire protocols to run every intranode point with (config intranode_protocol; "
                        "records say which one ran: field protocol); also --layer-loop's and --layer's epgen points")
    layer = p.add_argument_group("layer modes (bench/layer.py, docs/LAYER.md); any of them replaces the sweep")
    layer.add_argument("--layer-loop", action="store_true",
                       help="L layers of dispatch -> identity copy -> combine in one graph, vs NCCL (bf16)")
    layer.add_argument("--layers", type=int, default=16, help="--layer-loop: layers per graph")
    layer.add_argument("--layer", action="store_true", help="the MoE layer on each of --layer-paths")
    layer.add_argument("--layer-paths", nargs="+", default=["epgen", "a2a"], choices=["epgen", "a2a", "vdev2d"],
                       help="vdev2d needs the NVSHMEM backend: a process without epgen (and without --ceiling/--layer-loop)")
    layer.add_argument("--layer-dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    layer.add_argument("--intermediate", type=int, default=2048, help="--layer: expert intermediate size")
    layer.add_argument("--graph-layers", type=int, default=4, help="--layer: layers per captured graph")
    layer.add_argument("--layer-iters", type=int, default=20, help="--layer: eager iterations (a quarter at >= 2048 tokens)")
    layer.add_argument("--ceiling", action="store_true", help="copy-kernel push / pull, copy engine and NCCL GB/s")
    layer.add_argument("--ceiling-sms", type=int, nargs="+", default=[8, 16, 32, 64, 132])
    layer.add_argument("--ceiling-mib", type=int, default=64, help="--ceiling: MiB moved per copy")
    fl = p.add_argument_group("the floor (bench/floor.py); replaces the sweep")
    fl.add_argument("--floor", action="store_true",
                    help="flag ping-pong in one kernel, L one-signal kernels and L empty kernels in a graph (kind floor)")
    fl.add_argument("--floor-rounds", type=int, default=1000, help="--floor: timed ping-pong round trips per launch")
    fl.add_argument("--floor-blocks", type=int, nargs="+", default=[1, 0],
                    help="--floor: grids of the graph methods (0: one block per SM)")
    fl.add_argument("--floor-timeout-s", type=float, default=10.0, help="--floor: bound of every wait in the kernels")
    p.add_argument("--profile-graph", action="store_true",
                   help="per-kernel durations inside a graph replay of --layers layers of dispatch -> copy -> combine "
                        "(kineto), per --tokens (default 1 8 32 128) and --protocol (kind kernel_profile); replaces the sweep")
    p.add_argument("--out")
    return p


def check_graph_args(args) -> None:
    """--floor's and --profile-graph's numbers, validated where they enter (one clear message, no traceback)."""
    if args.layers < 1 or args.reps < 1:
        raise SystemExit(f"--layers and --reps must be >= 1, got {args.layers} and {args.reps}")
    if not args.floor:
        return
    if args.floor_rounds < 1:
        raise SystemExit(f"--floor-rounds must be >= 1, got {args.floor_rounds}")
    if any(b < 0 for b in args.floor_blocks):
        raise SystemExit(f"--floor-blocks must be >= 0 (0: one block per SM), got {args.floor_blocks}")
    if not 0 < args.floor_timeout_s <= 600:
        raise SystemExit(f"--floor-timeout-s must be in (0, 600], got {args.floor_timeout_s}")


def _emitter(args):
    """A function writing records to --out (rank 0), each as soon as it exists."""
    def emit(recs):
        if dist.get_rank() == 0 and args.out:
            write_records(args.out, recs)
    return emit


def floor_main(args) -> int:
    """--floor: records to --out, the table printed by rank 0; exit 1 when a method failed."""
    records = bench_floor.run(args, _emitter(args))
    if dist.get_rank() == 0:
        print("\n".join(bench_floor.floor_table(records)) + "\n")
    return 1 if any(r.get("error") for r in records) else 0


def profile_graph_main(args) -> int:
    """--profile-graph: records to --out, the table printed by rank 0; exit 1 when a point failed."""
    records = bench_profile.run(args, _emitter(args))
    if dist.get_rank() == 0:
        print("\n".join(bench_profile.profile_table(records)) + "\n")
    return 1 if any(r.get("error") for r in records) else 0


def layer_main(args) -> int:
    """--layer-loop / --layer / --ceiling: records to --out, tables printed by rank 0."""
    if "vdev2d" in args.layer_paths and args.layer:
        if "epgen" in args.layer_paths or args.layer_loop or args.ceiling:
            raise SystemExit("--layer-paths vdev2d runs in a process of its own: without epgen, --layer-loop, --ceiling "
                             "(the NVSHMEM backend must be chosen before any symmetric allocation)")
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "12G")
        try:
            import torch.distributed._symmetric_memory as symm_mem
            symm_mem.set_backend("NVSHMEM")
        except Exception as e:  # noqa: BLE001 - the vdev2d records say why
            print(f"NVSHMEM backend not set: {type(e).__name__}: {e}", file=sys.stderr)
    records = bench_layer.run(args, _emitter(args))
    if dist.get_rank() == 0:
        for table in (tables.loop_table, tables.layer_table, tables.ceiling_table):
            lines = table(records)
            if len(lines) > 2:
                print("\n".join(lines) + "\n")
    return 0


def plan_points(args, dtypes: list, topologies: list) -> tuple[list[dict], list[str]]:
    """The points of a sweep run in order (hidden, tokens, dtype, topology, launch geometry, protocol, combine
    mode: every combination), and why each left-out combination cannot run."""
    points, skipped = [], []
    for hidden, T, dt, topo, blocks, threads, cthreads in itertools.product(
            args.hidden, args.tokens, dtypes, topologies, args.launch_blocks, args.launch_threads, args.combine_threads):
        for protocol, mode in itertools.product(args.protocol if topo is None else ["bw"],
                                                args.combine_mode if topo is None else ["gather"]):
            why = (f"T={T} with protocol ll (at most {LL_MAX_TOKENS} tokens per rank)"
                   if protocol == "ll" and T > LL_MAX_TOKENS else
                   f"T={T} protocol ll with the scatter combine (the low-latency protocol combines by gather)"
                   if protocol == "ll" and mode == "scatter" else None)
            if why:
                skipped.append(why)
                continue
            points.append({"hidden": hidden, "T": T, "dtype": dt, "topology": topo, "protocol": protocol,
                           "combine_mode": mode, "geometry": {"launch_blocks": blocks, "launch_threads": threads,
                                                              "combine_threads": cthreads}})
    return points, skipped


def run_planned(pt: dict, args) -> dict:
    """One planned point; collective. A point that fails on any rank (a launch geometry the kernels cannot
    take, a failed gate, a timeout) gives, on every rank, a record with its reason (field error) and the run
    goes on to the next point; main exits 1 at the end."""
    rec, why = collective_try(lambda: run_point(
        pt["T"], pt["hidden"], args.topk, args.experts, pt["dtype"], args.inner, args.reps,
        args.torch_baseline and pt["topology"] is None, eager_iters=args.eager_iters, input_sets=args.input_sets,
        topology=pt["topology"], geometry=pt["geometry"], profile=args.profile, routing=args.routing,
        protocol=pt["protocol"], combine_mode=pt["combine_mode"]))
    if why is None:
        return rec
    return {"commit": commit(), "date": time.strftime("%Y-%m-%d", time.gmtime()), "kind": "point_failed",
            "error": why, "dtype": dtype_name(pt["dtype"]), "tokens_per_rank": pt["T"], "hidden": pt["hidden"],
            "topology": "intranode" if pt["topology"] is None else "internode", **(pt["topology"] or {}),
            "intranode_protocol": pt["protocol"], "combine_mode": pt["combine_mode"],
            "launch_override": {k: v for k, v in pt["geometry"].items() if v} or None,
            "world_size": dist.get_world_size()}


def main(argv=None, prog: str = "python -m bench") -> int:
    args = build_parser(prog).parse_args(argv)
    dtypes = [getattr(torch, dt) for dt in args.dtypes]
    if args.floor or args.profile_graph:
        check_graph_args(args)  # a wrong flag is named before anything else is asked of the machine
    if not 1 <= args.topk <= args.experts:
        raise SystemExit(f"--topk must be in [1, --experts={args.experts}] (a token picks k of the experts), "
                         f"got {args.topk}")
    require_gpus(prog)
    if args.emulate_nodes:
        os.environ[EMULATE_NODES_ENV] = "1"
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if args.floor or args.profile_graph:
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
        try:
            return max(floor_main(args) if args.floor else 0, profile_graph_main(args) if args.profile_graph else 0)
        finally:
            dist.destroy_process_group()
    if args.layer or args.layer_loop or args.ceiling:
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
        try:
            return layer_main(args)
        finally:
            dist.destroy_process_group()
    args.tokens = args.tokens or [128, 4096]
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    gpn = args.gpu_per_node or max(1, dist.get_world_size() // 2)
    topologies = [None] + [{"gpu_per_node": gpn, "internode_kernel": kind} for kind in args.internode]
    points, skipped = plan_points(args, dtypes, topologies)
    if dist.get_rank() == 0:
        for why in skipped:
            print(f"skipped: {why}")
    write = _emitter(args)

    def emit(r):  # each record as soon as it exists: a run cut short keeps what it measured
        write([r])
        return r

    rows = [emit(run_planned(pt, args)) for pt in points]
    failed = [r for r in rows if r.get("error")]
    low = [emit(run_lowprec(T, hidden, args.topk, args.experts, args.inner, args.reps))
           for hidden in args.hidden[:1] for T in args.lowprec_tokens] if args.lowprec else []
    if dist.get_rank() == 0:
        for r in rows:
            if r.get("profile"):
                print("\n".join(tables.format_profile(r)))
        print("\n".join(tables.format_table(rows)))
        for r in low:
            m = r["modes"]
            print(f"T={r['tokens_per_rank']} H={r['hidden']}: dispatch bf16 {m['bf16_gather']['dispatch_us']:.1f} us, "
                  f"fp8 payload {m['fp8_payload_gather']['dispatch_us']:.1f} us (x{r['fp8_dispatch_over_bf16']:.2f}); "
                  f"combine bf16 gather {m['bf16_gather']['combine_us']:.1f} us, fp8_blockwise scatter "
                  f"{m['bf16_fp8_scatter']['combine_us']:.1f} us (x{r['fp8_scatter_combine_over_bf16_gather']:.2f}), "
                  f"bf16 scatter {m['bf16_scatter']['combine_us']:.1f} us")
        if failed:
            print(f"{len(failed)} of {len(rows)} points failed (records with field error)")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
