"""runtime/collectives.py (issue 26, item 17): the runtime's gloo collectives return only once gloo's worker
threads have let go of their tensors, Python references included, so no gloo thread still waits for the
GIL when the caller goes on (the race that aborts a process exiting right after a collective,
`terminate called without an active exception`); objects are gathered over tensors made and settled
there. Gloo ranks through tests/support/ep_dist.py; settle's wait against a thread that holds the tensor a while
(what gloo's worker does)."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.ep_dist import get_world, shutdown_all
from runtime import collectives


def teardown_module():
    shutdown_all()


def scn_gather(rank, world):
    big = "x" * (5000 * (rank + 1))  # every rank's pickle has another size
    got = collectives.gather_objects({"rank": rank, "big": big, "t": (rank, None, 1.5)}, dist.group.WORLD)
    assert [g["rank"] for g in got] == list(range(world))
    assert all(g["big"] == "x" * (5000 * (r + 1)) and g["t"] == (r, None, 1.5) for r, g in enumerate(got))
    assert collectives._state["looks"] or world == 1  # every settle of the gather settled (none ran out)
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
    assert before is not None and collectives.baseline([x, y]) == before
    return y.view(world, 64)[:, 0].tolist()


def test_run_leaves_the_tensors_to_the_caller():
    assert get_world(2).run(scn_settled) == [[0.0, 1.0], [64.0, 65.0]]


CALLS = 400


def _seen(tensors):
    """Each tensor's (Python references, C++ references), read here, not through the module under test."""
    return [(sys.getrefcount(t), t._use_count()) for t in tensors]


def scn_many(rank, world):
    """CALLS collectives through run(), fresh small tensors each: gloo's worker often still holds the
    tensors when all_to_all_single returns (torch 2.13: about one call in ten), never once run() returned.
    -> (calls whose tensors were still held after run, calls of the same loop without settle that were)."""
    held_after_run = held_bare = 0
    for _ in range(CALLS):
        x, y = torch.randn(64 * world), torch.empty(64 * world)
        before = _seen([x, y])
        collectives.run(lambda: dist.all_to_all_single(y, x), [x, y], dist.group.WORLD)
        held_after_run += _seen([x, y]) != before
        x, y = torch.randn(64 * world), torch.empty(64 * world)
        before = _seen([x, y])
        dist.all_to_all_single(y, x)
        held_bare += _seen([x, y]) != before
        end = time.monotonic() + 5
        while _seen([x, y]) != before:  # let the worker go before the next call
            assert time.monotonic() < end, "gloo's worker kept the tensors 5 s"
            time.sleep(1e-4)
    assert collectives._state["looks"]  # no wait ran out (the counts above were read, not None)
    return held_after_run, held_bare


def test_run_returns_only_after_the_worker_let_go_every_time():
    got = get_world(2).run(scn_many)
    assert [a for a, _ in got] == [0, 0], got
    print(f"calls of {CALLS} whose tensors gloo's worker still held without settle: {[b for _, b in got]}")


def scn_round(rank, world):
    """An op's construction and a dispatch + combine on the torch backend: every gloo collective settles
    (a settle that ran out would switch settling off for the process)."""
    from runtime import EpDispatchCombineConfig, EpDispatchCombineOp
    cfg = EpDispatchCombineConfig(rank=rank, world_size=world, hidden_dim=32, max_num_inp_token_per_rank=4,
                                  num_experts_per_rank=2, num_experts_per_token=2, kernel_backend="torch")
    op = EpDispatchCombineOp(cfg)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    idx = torch.arange(8, dtype=torch.int32).view(4, 2) % cfg.num_experts
    out, _, _, _, _, h = op.dispatch(x, None, None, idx, return_routing=True)
    op.combine(out, routing=h)
    op.close()
    return collectives._state["looks"]


def test_an_op_round_settles_every_collective():
    assert get_world(2).run(scn_round) == [True, True]


def _hold(t, seconds, started):
    mine = t  # a second reference to the tensor, as a worker that has not yet let go holds
    started.set()
    time.sleep(seconds)
    del mine


def test_settle_waits_for_a_thread_that_still_holds_the_tensor():
    t = torch.zeros(16)
    before = collectives.baseline([t])
    started = threading.Event()
    th = threading.Thread(target=_hold, args=(t, 0.15, started))
    th.start()
    started.wait()
    assert collectives.baseline([t]) != before  # the holder shows in the count
    t0 = time.monotonic()
    assert collectives.settle([t], before)
    assert time.monotonic() - t0 >= 0.1 and collectives.baseline([t]) == before
    th.join()


def test_settle_gives_up_and_stops_looking(monkeypatch):
    monkeypatch.setitem(collectives._state, "looks", True)
    t = torch.zeros(4)
    before = collectives.baseline([t])
    keep = t  # held past the limit: settle must return, not hang
    t0 = time.monotonic()
    assert not collectives.settle([t], before, limit_s=0.05)
    assert time.monotonic() - t0 < 1.0
    assert collectives.baseline([t]) is None  # later calls no longer wait on a torch that keeps references
    del keep
