"""The measurement loops: legs timed in a CUDA-graph replay (``graph_time``) or eagerly (``eager_time``), a
callable captured L times in one graph (``loop_time``), kernels by torch.profiler (``profile_legs``), and the
collective plumbing every timed point shares: the slowest rank's median and p99 (``stats``), a failure on any
rank made every rank's (``collective_try``). bench/sweep.py's module docstring, step 4, says how each loop times."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

EAGER_WARMUP = 2
PROFILE_ROUNDS = 5


def on_gpu() -> bool:
    """Does the default process group run on GPUs (NCCL)? Decides events vs host clock and where stats reduces."""
    return dist.is_initialized() and "nccl" in str(dist.get_backend()).lower()


def warm_on_side_stream(fn) -> None:
    """Run fn once on a side stream and wait for it (before a graph capture: lazy setup stays out of the graph)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def graph_time(legs, inner: int, reps: int) -> list[list[float]]:
    """Per-leg milliseconds of `legs` (callables run in order), captured `inner` times in one graph.

    Each leg is bracketed by timing events recorded inside the graph (external events), so every leg
    is timed on its own, without launch gaps. Returns one list of samples per leg.
    """
    warm_on_side_stream(lambda: [leg() for leg in legs])
    marks = [[torch.cuda.Event(enable_timing=True, external=True) for _ in range(len(legs) + 1)] for _ in range(inner)]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for ev in marks:
            ev[0].record()
            for leg, end in zip(legs, ev[1:]):
                leg()
                end.record()
    out: list[list[float]] = [[] for _ in legs]
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        for ev in marks[1:]:  # the first iteration absorbs the ranks' start skew
            for i in range(len(legs)):
                out[i].append(ev[i].elapsed_time(ev[i + 1]))
    return out


def eager_time(legs, iters: int, warmup: int = EAGER_WARMUP, host: list | None = None) -> list[list[float]]:
    """Per-leg milliseconds of `legs` run eagerly in order, `iters` times after `warmup` untimed rounds.

    Every round starts after a dist.barrier and a device synchronize; on GPUs a one-element all_reduce
    on the stream then lines the GPUs up, and each leg is bracketed by device events (host launch work
    included: this is the eager cost), on a CPU process group by the host clock. Returns one list of samples per leg.
    `host`, if given, receives per leg the host milliseconds each call took to return (GPU runs): an eager
    leg slower than its graph replay and its host time is waiting on the peer (the ranks' host skew).
    """
    gpu = on_gpu()
    out: list[list[float]] = [[] for _ in legs]
    if host is not None and gpu:
        host[:] = [[] for _ in legs]
    align = torch.zeros(1, device="cuda") if gpu else None
    for it in range(warmup + iters):
        dist.barrier()
        if gpu:
            torch.cuda.synchronize()
            # the ranks leave the host barrier at different times; a device-side collective right before
            # the first event starts every GPU's timed region together (else the first leg absorbs the skew)
            dist.all_reduce(align)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(legs) + 1)]
            ev[0].record()
            hs = []
            for leg, end in zip(legs, ev[1:]):
                h0 = time.perf_counter()
                leg()
                hs.append((time.perf_counter() - h0) * 1e3)
                end.record()
            torch.cuda.synchronize()
            ms = [ev[i].elapsed_time(ev[i + 1]) for i in range(len(legs))]
            if host is not None and it >= warmup:
                for i, v in enumerate(hs):
                    host[i].append(v)
        else:
            stamps = [time.perf_counter()]
            for leg in legs:
                leg()
                stamps.append(time.perf_counter())
            ms = [(stamps[i + 1] - stamps[i]) * 1e3 for i in range(len(legs))]
        if it >= warmup:
            for i, v in enumerate(ms):
                out[i].append(v)
    return out


def profile_legs(legs, rounds: int = PROFILE_ROUNDS) -> list[dict]:
    """Device time per kernel / collective over `rounds` eager rounds of `legs` (torch.profiler), largest
    first: [{"name", "calls", "us_per_round"}]. This rank's view."""
    from torch.profiler import ProfilerActivity, profile
    for leg in legs:  # warm
        leg()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(rounds):
            for leg in legs:
                leg()
        torch.cuda.synchronize()
    rows = []
    for e in p.key_averages():
        dev_us = getattr(e, "device_time_total", None)
        if dev_us is None:
            dev_us = e.cuda_time_total
        if dev_us > 0:
            rows.append({"name": e.key[:90], "calls": e.count // rounds, "us_per_round": dev_us / rounds})
    return sorted(rows, key=lambda r: -r["us_per_round"])


def stats(ms: list[float]) -> tuple[float, float]:
    """(median, p99) of these samples, each the maximum over ranks (the slowest rank). Collective."""
    t = torch.tensor(ms, dtype=torch.float32, device="cuda" if on_gpu() else "cpu")
    med, p99 = t.median(), t.quantile(0.99)
    both = torch.stack([med, p99])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)  # slowest rank
    return float(both[0]), float(both[1])


def loop_time(fn, layers: int, reps: int) -> tuple[list[float], bool]:
    """(per-layer milliseconds, graph?): `fn` captured `layers` times in one CUDA graph, `reps` replays
    timed like bench's eager legs (host barrier, device all_reduce lining the GPUs up, events), after one
    warm-up replay; replay time / layers. On a CPU process group: `layers` eager calls in a row timed by
    the host clock, `reps` times."""
    if not on_gpu():
        ms = eager_time([lambda: [fn() for _ in range(layers)]], reps)[0]
        return [m / layers for m in ms], False
    warm_on_side_stream(fn)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(layers):
            fn()
    ms = eager_time([g.replay], reps, warmup=1)[0]
    del g
    return [m / layers for m in ms], True


def median_us(ms: list[float]) -> tuple[float, float]:
    med, p99 = stats(ms)
    return med * 1e3, p99 * 1e3


def collective_try(fn):
    """(fn(), None) on every rank, or (None, reason) on every rank when fn raised on any rank (the
    first failing rank's exception, named)."""
    try:
        value, reason = fn(), None
    except Exception as e:  # noqa: BLE001 - recorded, never hidden
        value, reason = None, f"{type(e).__name__}: {e}"[:600]
    reasons: list = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    bad = [(r, m) for r, m in enumerate(reasons) if m]
    return (value, None) if not bad else (None, f"rank {bad[0][0]}: {bad[0][1]}")
