"""Where an eager step's host time goes: cProfile over repeated calls, the top functions as record rows
(scripts/grouped_profile.py --host-profile, scripts/train_layer.py --host-profile). The profiler's own cost
inflates every figure: read them against each other, not as wall time."""

from __future__ import annotations

import cProfile
import pstats
from pathlib import Path
from typing import Callable

_SORT = {"own": 2, "cum": 3}  # pstats' row: (calls, primitive calls, own s, cumulative s, callers)


def top_functions(step: Callable[[], object], iters: int, *, top: int, sort: str, per: str,
                  sync: Callable[[], None] = lambda: None) -> list[dict]:
    """Run step() `iters` times under cProfile (sync() before and after: a device's queued work stays out);
    -> the `top` functions by own or cumulative time (`sort`), each {"function": "file:line:name",
    "calls_per_<per>", "own_us", "cum_us"} per call of step."""
    if sort not in _SORT:
        raise ValueError(f"sort must be one of {sorted(_SORT)}, got {sort!r}")
    if iters < 1 or top < 1:
        raise ValueError(f"iters and top must be at least 1, got {iters} and {top}")
    prof = cProfile.Profile()
    sync()
    prof.enable()
    for _ in range(iters):
        step()
    prof.disable()
    sync()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][_SORT[sort]])[:top]
    return [{"function": f"{Path(f).name}:{line}:{name}", f"calls_per_{per}": st[0] / iters,
             "own_us": st[2] / iters * 1e6, "cum_us": st[3] / iters * 1e6} for (f, line, name), st in rows]
