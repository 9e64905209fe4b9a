"""runtime/collectives.py (issue 26, item 17): the runtime's gloo collectives keep their tensors until gloo's
worker threads have let go of them, so no gloo thread frees an epgen tensor (the race that aborts a process
exiting right after a collective, `terminate called without an active exception`); objects are gathered
over tensors made and settled there. Gloo ranks through tests/ep_dist.py; settle's wait against a thread
that holds a view of the tensor a while (what gloo's worker does)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from ep_dist import get_world, shutdown_all
from runtime import collectives


def teardown_module():
    shutdown_all()


def scn_gather(rank, world):
    big = "x" * (5000 * (rank + 1))  # every rank's pickle has another size
    got = collectives.gather_objects({"rank": rank, "big": big, "t": (rank, None, 1.5)}, dist.group.WORLD)
    assert [g["rank"] for g in got] == list(range(world))
    assert all(g["big"] == "x" * (5000 * (r + 1)) and g["t"] == (r, None, 1.5) for r, g in enumerate(got))
    return len(got)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gather_objects_in_rank_order(world):
    assert get_world(world).run(scn_gather) == [world] * world


def scn_settled(rank, world):
    """After run(), each tensor given to gloo is referenced only as it was before the call."""
    x = torch.arange(64 * world, dtype=torch.float32) + rank
    y = torch.empty_like(x)
    before = collectives.baseline([x, y])
    collectives.run(lambda: dist.all_to_all_single(y, x, group=dist.group.WORLD), [x, y], dist.group.WORLD)
    assert collectives.baseline([x, y]) == before
    return y.view(world, 64)[:, 0].tolist()


def test_run_leaves_the_tensors_to_the_caller():
    assert get_world(2).run(scn_settled) == [[0.0, 1.0], [64.0, 65.0]]


def _hold(t, seconds, started):
    v = t.view(-1)  # a second reference to the storage, as a worker's copy of the tensor holds
    started.set()
    time.sleep(seconds)
    del v


def test_settle_waits_for_a_thread_that_still_holds_the_storage():
    t = torch.zeros(16)
    before = collectives.baseline([t])
    started = threading.Event()
    th = threading.Thread(target=_hold, args=(t, 0.15, started))
    th.start()
    started.wait()
    assert collectives.baseline([t])[0] > before[0]  # the holder shows in the count
    t0 = time.monotonic()
    assert collectives.settle([t], before)
    assert time.monotonic() - t0 >= 0.1 and collectives.baseline([t]) == before
    th.join()


def test_settle_gives_up_and_stops_looking(monkeypatch):
    monkeypatch.setitem(collectives._state, "looks", True)
    t = torch.zeros(4)
    before = collectives.baseline([t])
    keep = t.view(-1)  # held past the limit: settle must return, not hang
    t0 = time.monotonic()
    assert not collectives.settle([t], before, limit_s=0.05)
    assert time.monotonic() - t0 < 1.0
    assert collectives.baseline([t]) is None  # later calls no longer wait on a torch that keeps references
    del keep
