"""Where the grouped layer's communication time goes: every device kernel of dispatch_grouped ->
(identity expert) -> combine_grouped, inside a CUDA-graph replay, by kernel name.

  torchrun --nproc-per-node 1 scripts/grouped_profile.py [--tokens 1 128 4096]
                                                         [--legs auto one separate] [--protocol auto ll bw]
                                                         [--launch-blocks 0 8] [--launch-threads 0 128]
                                                         [--hidden 7168] [--topk 8] [--experts 256] [--out F]

Per (tokens, legs, launch geometry, direct, protocol): L = --layers layers of dispatch_grouped -> expert_out.copy_(layout.x) (the identity
expert: bf16) -> combine_grouped, captured in one graph; --reps replays timed (per layer: replay / L), then
profiled by kineto (bench/graphprof.py). The identity copy is the expert GEMMs' stand-in (what it costs is
printed on its own row, "copy"); everything else is what the layer's communication runs on the device.
Prints one table per point (kernel, calls per layer, median µs) and writes the records (jsonl) to --out.
Each record also holds the eager layer's wall time ("eager_us": the same layer called --eager-iters times
without a graph, synchronized at the ends: at small token counts the host's Python and launch work), and
with --host-profile the functions that take the eager layer's host time (cProfile, "host_top") and what the
host's building blocks cost ("host_primitives_us": a launch, a stream query, an allocation). Every record also
holds the two legs alone, eager, with no expert ("eager_legs_us", "host_dispatch_us", "host_combine_us").
At one rank (W = 1) this is the glue with no link in the way, never a 2-GPU figure.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import graphprof, hostprof  # noqa: E402
from bench.inputs import make_input_sets, point_config  # noqa: E402
from bench.measure import warm_on_side_stream  # noqa: E402
from bench.records import emit_point, meta as record_meta  # noqa: E402
from runtime import EpDispatchCombineConfig, EpDispatchCombineOp  # noqa: E402
from runtime.errors import EpgenError, EpTimeoutError  # noqa: E402


def _name(kernel: str) -> str:
    """A kernel's short name: epgen's symbols as they are, torch's up to its template arguments."""
    if "copy" in kernel.lower() or "memcpy" in kernel.lower():
        return "copy"
    return kernel.split("<")[0].split("(")[0].strip()[:60]


LEGS = {"auto": "auto", "one": "always", "separate": "never"}  # --legs -> the native backend's one_kernel
#: eager calls made before an eager figure is timed: with 10, the run's first token count's host time per call came out
#: ~1.4x the later ones' on one host (42.1 / 35.5 µs per dispatch_grouped / combine_grouped at one token, then 22.2 /
#: 18.5 at 1024 tokens, results/2026-12-06-1xH100-W1-host-objects-be95392f/): the process, not the call, was warming up
EAGER_WARMUP = 500


def point(T: int, args, meta: dict, keep: list, legs: str = "auto", blocks: int = 0,
          threads: int = 0, direct: str = "auto", protocol: str = "auto") -> dict:
    """One (tokens, legs, geometry, direct, protocol) point. The op stays open (in `keep`) until every point is
    taken: a closed op's kernels unload, and a later op's module loaded at the same address would be reported under
    the old kernel's name by the profiler."""
    rank, world = dist.get_rank(), dist.get_world_size()
    geometry = {key: v for key, v in (("launch_blocks", blocks), ("launch_threads", threads)) if v}
    base = point_config(rank, world, T, args.hidden, args.topk, args.experts, torch.bfloat16, geometry=geometry)
    cfg = EpDispatchCombineConfig(**base, enable_grouped_layout=True, expert_alignment=16, intranode_protocol=protocol)
    op = EpDispatchCombineOp(cfg)
    keep.append(op)
    op._backend.one_kernel = LEGS[legs]  # the grouped legs as one kernel each, or the EP kernels and the passes
    op._backend.direct = direct  # dispatch_grouped's direct kernel where the op allows it (plan.direct), or "never"
    s = make_input_sets(cfg, 1, seed=777 + 7919 * rank, device=op.device)[0]
    x, w, idx = s["x"], s["w"], s["idx"]
    y = torch.empty(cfg.resolved_grouped_capacity, args.hidden, dtype=torch.bfloat16, device=op.device)

    def layer():
        layout, h = op.dispatch_grouped(x, w, None, idx)
        y.copy_(layout.x)
        op.combine_grouped(y, h)

    warm_on_side_stream(layer)
    gate(op, x, w, idx, y)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(args.layers):
            layer()
    per_layer = statistics.median(ms / args.layers for ms in graphprof.replay_ms(g, args.reps)) * 1e3
    profiled = max(3, args.reps // 3)
    events = graphprof.graph_kernel_events(g, profiled, sync=dist.barrier)
    op.check()
    del g
    for _ in range(EAGER_WARMUP):
        layer()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.eager_iters):
        layer()
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - t0) / args.eager_iters * 1e6
    host_top = host_profile(layer, args.eager_iters) if args.host_profile else None
    alone = eager_legs(op, x, w, idx, args.eager_iters)
    replays = graphprof.split_replays(events, len(events) // profiled)
    summary = graphprof.summarize(replays, _name)
    rows = {r: {"per_layer": v["calls"] / args.layers, "median_us": v["median_us"]} for r, v in summary["roles"].items()}
    return {**meta, "kind": "grouped_profile", "tokens_per_rank": T, "legs": legs,
            "launch_blocks": blocks, "launch_threads": threads,
            "direct": "always" if any("dispatch_direct" in k for k in rows) else "never", "world_size": world,
            "protocol_choice": protocol, "protocol": op._backend.last_protocol,
            "dtype": "bfloat16", "mode": "graph", "expert": "identity copy",
            "hidden": args.hidden, "topk": args.topk, "experts": args.experts, "layers": args.layers,
            "per_layer_us": per_layer, "gap_us": summary["gap_us"], "kernels": rows, "eager_us": eager_us,
            "eager_iters": args.eager_iters, **alone, **({"host_top": host_top} if host_top else {})}


def gate(op, x, w, idx, y) -> None:
    """The layer's output before anything is timed: with the identity expert every token comes back as the sum of
    its kept pairs' weights times its row (float32 sums, one bf16 rounding: within 2 % of x * sum(w) where no pair
    was dropped). A kernel that loses part of a row fails here, not silently in a fast table."""
    layout, h = op.dispatch_grouped(x, w, None, idx)
    y.copy_(layout.x)
    out = op.combine_grouped(y, h)[0].float()
    want = x.float() * w.float().sum(1, keepdim=True)
    if dist.get_world_size() == 1 and int(layout.dropped) == 0 and not torch.allclose(out, want, rtol=2e-2, atol=1e-2):
        bad = (out - want).abs().max().item()
        raise SystemExit(f"grouped_profile: the layer's output is wrong at {x.shape[0]} tokens (largest error {bad:.3g} "
                         f"against x * sum(w)): no timing taken")


def eager_legs(op, x, w, idx, iters: int) -> dict:
    """The two grouped legs alone, eager, with no stand-in expert (combine_grouped takes layout.x as the expert
    rows): "eager_legs_us", the wall per dispatch_grouped + combine_grouped (synchronized at the ends: the host's
    work where it is the longer), and each call's host time on its own ("host_dispatch_us", "host_combine_us":
    medians of perf_counter around the call, the device running behind)."""
    def legs():
        layout, h = op.dispatch_grouped(x, w, None, idx)
        op.combine_grouped(layout.x, h)
    for _ in range(EAGER_WARMUP):
        legs()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        legs()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters * 1e6
    d_us, c_us = [], []
    for i in range(iters):
        t0 = time.perf_counter()
        layout, h = op.dispatch_grouped(x, w, None, idx)
        t1 = time.perf_counter()
        op.combine_grouped(layout.x, h)
        t2 = time.perf_counter()
        d_us.append((t1 - t0) * 1e6)
        c_us.append((t2 - t1) * 1e6)
        if i % 16 == 15:
            torch.cuda.synchronize()  # the device keeps up: the launch queue never fills
    torch.cuda.synchronize()
    return {"eager_legs_us": wall, "host_dispatch_us": statistics.median(d_us),
            "host_combine_us": statistics.median(c_us)}


def host_primitives(iters: int = 2000) -> dict:
    """What the host's building blocks cost here, µs per call (median of batches of 100): an empty kernel's launch
    through the runtime's launcher (libcuda via ctypes), torch.cuda.current_stream, is_current_stream_capturing,
    the raw current stream handle, a small torch.empty on the device."""
    from bench.floor import Kernels
    from runtime import kernels

    dev = torch.device("cuda", torch.cuda.current_device())
    k = Kernels(dev)
    try:
        calls = {"launch_empty": lambda: k.empty.launch(1, 32),
                 "current_stream": lambda: torch.cuda.current_stream(dev),
                 "is_capturing": torch.cuda.is_current_stream_capturing,
                 "raw_stream": kernels.current_raw_stream,
                 "torch_empty": lambda: torch.empty((1, 7168), dtype=torch.bfloat16, device=dev)}
        out = {}
        for name, fn in calls.items():
            batches = []
            for _ in range(iters // 100):
                t0 = time.perf_counter()
                for _ in range(100):
                    fn()
                batches.append((time.perf_counter() - t0) / 100 * 1e6)
                torch.cuda.synchronize()
            out[name] = statistics.median(batches)
        return out
    finally:
        torch.cuda.synchronize()
        k.close()


def host_profile(layer, iters: int, top: int = 25) -> list[dict]:
    """The functions that take an eager layer's host time: cProfile over `iters` layers, the `top` by own time
    (µs per layer, own and cumulative)."""
    return hostprof.top_functions(layer, iters, top=top, sort="own", per="layer", sync=torch.cuda.synchronize)


def table(rec: dict) -> list[str]:
    geo = "".join(f", {name} {rec[key]}" for key, name in (("launch_blocks", "blocks"), ("launch_threads", "threads"))
                  if rec.get(key))
    legs = f", legs {rec['legs']}" if isinstance(rec.get("legs"), str) else ""
    legs += f", {rec['protocol']} protocol" if rec.get("protocol") else ""
    form = f" {rec['grouped_combine']}" if rec.get("grouped_combine") else ""  # records before the fused form went
    out = [f"T={rec['tokens_per_rank']}{form}{legs}{geo}: {rec['per_layer_us']:.1f} µs per layer "
           f"(graph, W={rec['world_size']}); median gap between kernels {rec['gap_us'] or 0:.1f} µs",
           "| kernel | per layer | median µs | µs per layer |", "|---|---|---|---|"]
    ks = sorted(rec["kernels"].items(), key=lambda kv: -kv[1]["per_layer"] * kv[1]["median_us"])
    out += [f"| {k} | {v['per_layer']:g} | {v['median_us']:.1f} | {v['per_layer'] * v['median_us']:.1f} |" for k, v in ks]
    if "eager_us" in rec:  # records before 2026-12-02's eager timing have none
        out.append(f"eager (no graph): {rec['eager_us']:.1f} µs per layer wall ({rec['eager_iters']} layers)")
    if "eager_legs_us" in rec:  # records before 2026-12-03's leg timing have none
        out.append(f"eager legs alone (no expert): {rec['eager_legs_us']:.1f} µs wall; host per call: "
                   f"dispatch_grouped {rec['host_dispatch_us']:.1f}, combine_grouped {rec['host_combine_us']:.1f} µs")
    for h in rec.get("host_top", [])[:12]:
        out.append(f"  host {h['own_us']:7.2f} µs own {h['cum_us']:7.2f} µs cum  {h['calls_per_layer']:g}x  {h['function']}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 4096])
    p.add_argument("--legs", nargs="+", default=["auto"], choices=list(LEGS),
                   help="the grouped legs: the op's own choice, one kernel each, or the EP kernels and separate passes")
    p.add_argument("--launch-blocks", type=int, nargs="+", default=[0],
                   help="the EP kernels' grid (config launch_blocks; 0: the tuning table); several: each in turn")
    p.add_argument("--launch-threads", type=int, nargs="+", default=[0],
                   help="the EP kernels' threads per block (config launch_threads; 0: the tuning table)")
    p.add_argument("--direct", nargs="+", default=["auto"], choices=["auto", "never", "always"],
                   help="dispatch_grouped's direct kernel (NativeBackend.direct: auto and always take it where the op "
                        "allows it; the record's \"direct\" says whether it ran); several: each in turn")
    p.add_argument("--protocol", nargs="+", default=["auto"], choices=["auto", "ll", "bw"],
                   help="the config's intranode_protocol (auto: the op's choice by tokens; the record's \"protocol\" "
                        "says which ran); several: each in turn")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--eager-iters", type=int, default=200)
    p.add_argument("--host-profile", action="store_true", help="cProfile the eager layer's host time")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    meta = record_meta(torch.device("cuda", torch.cuda.current_device()))
    if args.host_profile:  # the building blocks' costs on this host, once per run
        meta = {**meta, "host_primitives_us": host_primitives()}
        if dist.get_rank() == 0:
            print("host primitives, µs per call: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                              meta["host_primitives_us"].items()), flush=True)
    keep: list = []
    for T in args.tokens:
        for legs, blocks, threads, direct, protocol in itertools.product(
                args.legs, args.launch_blocks, args.launch_threads, args.direct, args.protocol):
            try:
                rec = point(T, args, meta, keep, legs, blocks, threads, direct, protocol)
            except EpgenError as e:  # a config or geometry the op refuses (the same on every rank): the next point
                if isinstance(e, EpTimeoutError):
                    raise
                if dist.get_rank() == 0:
                    print(f"skipped: {T} tokens, legs {legs}, blocks {blocks}, threads {threads}, "
                          f"protocol {protocol}: {e}", flush=True)
                continue
            emit_point(rec, table(rec), args.out)
    for op in keep:
        op.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
