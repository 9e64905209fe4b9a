"""The eager grouped layer's host cost on a CPU, no GPU: the native backend's own Python between the user's call and
the launch, counted and timed over stand-ins for the device (tests/support/host_standin.py).

    python scripts/host_cost.py [--tokens 1 128] [--protocol auto] [--iters 3000] [--profile 20] [--out F]

Per token count: one native op (bf16, hidden 7168, top-8 of 256 experts, grouped layout, alignment 16; the shape of
scripts/grouped_profile.py), then dispatch_grouped, combine_grouped, dispatch_grouped(fresh=True), dispatch and combine
called eagerly, each alone: µs per call (median of batches of 100, perf_counter), Python function calls per call
(sys.setprofile: Python-level calls and calls into builtins / C methods, counted separately), launches per call.
--profile N adds the N functions with the most own time (cProfile). A record of kind "host_cost" per point (jsonl,
--out) with its metadata.

What it measures is the Python: the stand-in launch returns at once and its tensors are CPU tensors, so the driver's
launch (~10 µs through ctypes on the lent H200 host, results/…-e0ee158 host_primitives_us) and the CUDA
allocator's allocations (~6 µs each there) are not in these figures. The function counts do not depend on the CPU:
they are the figures a change to the host path moves (tests/runtime/test_host_cost.py holds them); the times are
this CPU's (the fresh layout's mostly its allocator's: rows of [grouped capacity, hidden] malloc'd and freed per call,
where the GPU's caching allocator hands them out).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.inputs import make_input_sets, point_config  # noqa: E402
from bench.records import commit  # noqa: E402
from runtime import EpDispatchCombineConfig, EpDispatchCombineOp  # noqa: E402
from runtime.op import steady_path_enabled  # noqa: E402
from tests.support.host_standin import standin_device  # noqa: E402


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(T: int, protocol: str = "auto", hidden: int = 7168, topk: int = 8, experts: int = 256):
    """(op, x, weights, ids) of one point; call inside standin_device()."""
    base = point_config(0, 1, T, hidden, topk, experts, torch.bfloat16)
    cfg = EpDispatchCombineConfig(**base, enable_grouped_layout=True, expert_alignment=16, intranode_protocol=protocol)
    op = EpDispatchCombineOp(cfg)
    s = make_input_sets(cfg, 1, seed=777, device=op.device)[0]
    return op, s["x"], s["w"], s["idx"]


def legs(op, x, w, idx) -> dict:
    """The legs as zero-argument calls: dispatch_grouped, combine_grouped of its rows, dispatch_grouped with a
    layout of the call's own (fresh=True: the training forward's call, runtime/autograd.py), and the plain legs
    (dispatch with a routing handle, combine of its received rows: the seed API's eager calls)."""
    state = {}

    def dispatch():
        state["layout"], state["h"] = op.dispatch_grouped(x, w, None, idx)

    def combine():
        op.combine_grouped(state["layout"].x, state["h"])

    def fresh():
        op.dispatch_grouped(x, w, None, idx, fresh=True)

    def plain_dispatch():
        state["out"], _, _, _, _, state["hp"] = op.dispatch(x, w, None, idx, return_routing=True)

    def plain_combine():
        op.combine(state["out"], routing=state["hp"])
    dispatch()
    plain_dispatch()
    return {"dispatch_grouped": dispatch, "combine_grouped": combine, "dispatch_grouped_fresh": fresh,
            "dispatch": plain_dispatch, "combine": plain_combine}


def profiled(hook, fn) -> None:
    """fn() under sys.setprofile(hook), with the garbage collector held off: a collection inside the call runs the
    finalizers and weakref callbacks of whatever earlier code left in cycles, and their calls are not the call's (a
    test suite's earlier tests made a count vary). A plain call, not a context manager: the hook then sees no frame
    of the profiling's own."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
        if was:
            gc.enable()


def calls_of(fn) -> dict:
    """Python-level calls and builtin / C calls one fn() makes (profiled)."""
    n = collections.Counter()

    def hook(frame, event, arg):
        n[event] += 1
    profiled(hook, fn)
    return {"py_calls": n["call"], "c_calls": n["c_call"]}


def time_of(fn, iters: int) -> float:
    """Median µs per call over batches of 100."""
    for _ in range(200):
        fn()
    batches = []
    for _ in range(max(1, iters // 100)):
        t0 = time.perf_counter()
        for _ in range(100):
            fn()
        batches.append((time.perf_counter() - t0) / 100 * 1e6)
    return statistics.median(batches)


def profile_of(fn, iters: int, top: int) -> list[dict]:
    from bench import hostprof
    return hostprof.top_functions(fn, iters, top=top, sort="own", per="call")


def point(T: int, protocol: str, iters: int, top: int, log: list) -> dict:
    op, x, w, idx = build(T, protocol)
    try:
        rec = {"kind": "host_cost", "tokens_per_rank": T, "protocol_choice": protocol,
               "protocol": op._backend.protocol, "world_size": 1, "hidden": x.shape[1], "topk": idx.shape[1],
               "experts": op.config.num_experts, "dtype": "bfloat16", "mode": "eager", "legs": {}}
        for name, fn in legs(op, x, w, idx).items():
            fn()
            before = len(log)
            fn()
            launched = [entry[0] for entry in log[before:]]
            leg = {"launches": len(launched), "kernels": launched, **calls_of(fn), "us": time_of(fn, iters)}
            if top:
                leg["host_top"] = profile_of(fn, max(200, iters // 4), top)
            rec["legs"][name] = leg
        return rec
    finally:
        op.close()


def table(recs: list[dict]) -> list[str]:
    out = ["| tokens | protocol | leg | launches | Python calls | builtin / C calls | µs per call (this CPU) |",
           "|---|---|---|---|---|---|---|"]
    for r in recs:
        for name, leg in r["legs"].items():
            out.append(f"| {r['tokens_per_rank']} | {r['protocol']} | {name} | {leg['launches']} | {leg['py_calls']} "
                       f"| {leg['c_calls']} | {leg['us']:.1f} |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    p.add_argument("--protocol", choices=["auto", "ll", "bw"], default="auto")
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="the N functions with the most own time")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if any(t < 1 for t in args.tokens) or args.iters < 100 or args.profile < 0:
        p.error("--tokens must be >= 1, --iters >= 100, --profile >= 0")
    meta = {"commit": commit(), "date": time.strftime("%Y-%m-%d", time.gmtime()), "gpu": "none (stand-in)",
            "host_cpu": cpu_model(), "python": platform.python_version(), "torch": torch.__version__,
            "steady_path": steady_path_enabled()}
    recs = []
    with standin_device(record_args=False) as log:
        for T in args.tokens:
            rec = {**meta, **point(T, args.protocol, args.iters, args.profile, log)}
            recs.append(rec)
            for name, leg in rec["legs"].items():
                for h in leg.get("host_top", []):
                    print(f"  {name} T={T}: {h['own_us']:6.2f} µs own {h['cum_us']:6.2f} cum "
                          f"{h['calls_per_call']:g}x {h['function']}")
    if args.out:
        with open(args.out, "a") as f:
            for r in recs:
                f.write(json.dumps(r, sort_keys=True) + "\n")
    print("\n".join(table(recs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
