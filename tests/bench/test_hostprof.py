"""bench/hostprof.py: the top functions of a step under cProfile, per call of the step."""

from __future__ import annotations

import time

import pytest

from bench import hostprof


def _slow():
    time.sleep(0.002)


def _fast():
    pass


def _step():
    _slow()
    _fast()


@pytest.mark.parametrize("sort", ["own", "cum"])
def test_the_slow_function_leads_and_counts_are_per_step(sort):
    synced = []
    rows = hostprof.top_functions(_step, 5, top=50, sort=sort, per="step", sync=lambda: synced.append(1))
    assert synced == [1, 1]  # before and after the profiled calls
    by_name = {r["function"].split(":")[-1]: r for r in rows}
    assert by_name["_slow"]["calls_per_step"] == 1.0 and by_name["_fast"]["calls_per_step"] == 1.0
    assert by_name["_slow"]["cum_us"] >= 1500  # 2 ms of sleep per step
    assert by_name["_slow"]["cum_us"] > 10 * by_name["_fast"]["cum_us"]
    key = 2 if sort == "own" else 3
    values = [r["own_us" if key == 2 else "cum_us"] for r in rows]
    assert values == sorted(values, reverse=True)
    assert all(r["function"].count(":") >= 2 for r in rows)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="sort must be one of"):
        hostprof.top_functions(_step, 1, top=1, sort="wall", per="step")
    with pytest.raises(ValueError, match="at least 1"):
        hostprof.top_functions(_step, 0, top=1, sort="own", per="step")
