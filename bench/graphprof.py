"""Kernel durations inside CUDA-graph replays (torch.profiler / kineto): what `bench --floor` and
`bench --profile-graph` read per kernel.

``graph_kernel_events`` replays a captured graph under the profiler and returns the device-side events
(kernels, memcpy, memset) of each replay in start order; ``summarize`` (pure) turns them into per-name
medians and the median idle gap between consecutive device events. A graph's kernels run back to back on
one stream, so a kernel's duration here is its own time (its launch overhead is the gap before it).
"""

from __future__ import annotations

import statistics

import torch

# kineto activity types of the device side of a replay
DEVICE_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")


def summarize(replays: list[list[tuple[str, float, float]]], role=lambda name: name) -> dict:
    """Per-kernel statistics of profiled replays. replays: per replay, its device events (name, start_us,
    duration_us) in any order. role(name) names what an event is (events of one role are pooled: e.g. every
    dispatch kernel of the graph's L layers). Returns {"roles": {role: {"calls" (per replay), "median_us",
    "min_us", "max_us", "names"}}, "gap_us": the median idle time between the end of one event and the start of
    the next within a replay (None with fewer than two events), "busy_us": the median over replays of the
    summed event durations, "span_us": the median first-start to last-end}."""
    pooled: dict[str, list[float]] = {}
    names: dict[str, set] = {}
    gaps, busy, span, calls = [], [], [], {}
    for events in replays:
        evs = sorted(events, key=lambda e: e[1])
        per: dict[str, int] = {}
        for name, start, dur in evs:
            r = role(name)
            pooled.setdefault(r, []).append(dur)
            names.setdefault(r, set()).add(name)
            per[r] = per.get(r, 0) + 1
        for r, n in per.items():
            calls.setdefault(r, []).append(n)
        gaps += [max(0.0, b[1] - (a[1] + a[2])) for a, b in zip(evs, evs[1:])]
        if evs:
            busy.append(sum(e[2] for e in evs))
            span.append(max(e[1] + e[2] for e in evs) - evs[0][1])
    roles = {r: {"calls": int(statistics.median(calls[r])), "median_us": statistics.median(d), "min_us": min(d),
                 "max_us": max(d), "names": sorted(names[r])} for r, d in pooled.items()}
    return {"roles": roles, "gap_us": statistics.median(gaps) if gaps else None,
            "busy_us": statistics.median(busy) if busy else None,
            "span_us": statistics.median(span) if span else None}


def split_replays(events: list[tuple[str, float, float]], per_replay: int) -> list[list[tuple[str, float, float]]]:
    """Device events of consecutive replays (start order) cut into replays of `per_replay` events each; a
    trailing incomplete replay is dropped. ValueError for per_replay < 1."""
    if per_replay < 1:
        raise ValueError(f"per_replay must be >= 1, got {per_replay}")
    evs = sorted(events, key=lambda e: e[1])
    return [evs[i:i + per_replay] for i in range(0, len(evs) - per_replay + 1, per_replay)]


def _call(e, name: str, default=None):
    fn = getattr(e, name, None)
    return fn() if callable(fn) else default


def device_events(raw) -> list[tuple[str, float, float]]:
    """(name, start_us, duration_us) of the device-side events among kineto's (torch.autograd's _KinetoEvent:
    kernels, memcpy, memset), in start order; NCCL's kernels left out. Works with the event API of several torch
    releases: activity_type() where it exists (else every CUDA-device event that is not a user annotation),
    start_ns() / duration_ns() or start_us() / duration_us()."""
    out = []
    for e in raw:
        if not str(_call(e, "device_type", "")).endswith("CUDA") or "nccl" in e.name().lower():
            continue
        kind = _call(e, "activity_type")
        if kind is not None and str(kind) not in DEVICE_ACTIVITIES:
            continue
        if kind is None and _call(e, "is_user_annotation", False):
            continue
        start = _call(e, "start_ns")
        start = start / 1e3 if start is not None else float(_call(e, "start_us", 0))
        dur = _call(e, "duration_ns")
        dur = dur / 1e3 if dur is not None else float(_call(e, "duration_us", 0))
        out.append((e.name(), start, dur))
    return sorted(out, key=lambda e: e[1])


def graph_kernel_events(graph: "torch.cuda.CUDAGraph", replays: int, sync=lambda: None) -> list[tuple[str, float, float]]:
    """Device events (name, start_us, duration_us) of `replays` replays of `graph`, profiled by kineto (CUPTI),
    in start order. sync(): called before each replay (e.g. a barrier lining the ranks up); the replays are
    separated by a device synchronize so that none overlaps the next. NCCL's kernels (an NCCL barrier's
    between replays) are left out: they are no part of the graph."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(replays):
            sync()
            graph.replay()
            torch.cuda.synchronize()
    out = device_events(p.profiler.kineto_results.events())
    return out


def replay_ms(graph: "torch.cuda.CUDAGraph", reps: int, warmup: int = 1) -> list[float]:
    """Milliseconds of each of `reps` replays (after `warmup` untimed ones), device events around each; every
    replay after a barrier and a synchronize, then (NCCL groups) a one-element device all_reduce lining the
    GPUs up, as bench's eager legs. Works on a gloo group too (ranks sharing a GPU: correctness only)."""
    import torch.distributed as dist

    nccl = "nccl" in str(dist.get_backend()).lower()
    align = torch.zeros(1, device="cuda")
    out = []
    for it in range(warmup + reps):
        dist.barrier()
        torch.cuda.synchronize()
        if nccl:
            dist.all_reduce(align)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        if it >= warmup:
            out.append(a.elapsed_time(b))
    return out


def graph_us(fn, launches: int, reps: int) -> float:
    """Median µs per launch of a CUDA graph of `launches` calls of fn, over `reps` replays (fn warmed outside the
    capture first: bench.measure; each replay timed by device events: replay_ms)."""
    from bench.measure import warm_on_side_stream

    warm_on_side_stream(fn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return statistics.median(replay_ms(graph, reps, warmup=5)) * 1000.0 / launches


def add_graph_args(p) -> None:
    """The options of a script that times kernels as graphs of launches (graph_us) and appends records: --launches,
    --reps, --out; check_graph_args holds them to their ranges."""
    from pathlib import Path

    p.add_argument("--launches", type=int, default=16, help="launches per graph")
    p.add_argument("--reps", type=int, default=50, help="graph replays timed")
    p.add_argument("--out", type=Path, default=None, help="append the records to this jsonl file")


def check_graph_args(p, args) -> None:
    """p.error (exit 2, one line) where add_graph_args' options are out of range."""
    if not 1 <= args.launches <= 1024 or not 1 <= args.reps <= 100000:
        p.error("--launches must be in [1, 1024] and --reps in [1, 100000]")
