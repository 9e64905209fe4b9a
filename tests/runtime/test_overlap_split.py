"""Split-phase legs and operations in flight (runtime/pending.py) on the torch backend: gloo ranks at W = 2 and 4
through tests/support/ep_dist.py.

Two micro-batches in flight (max_inflight=2) give the bits of the one-call form, for every leg (dispatch, combine,
dispatch_grouped, combine_grouped) and for fp8 payloads; the slots are reused round after round; every misuse
is a clear error (a third operation, receiving twice, a stale or foreign handle, expert rows in another slot's view,
a receive after reset or close, streams on CPU); the plan lays the workspace out once per slot and the memory
report counts it.
"""

from __future__ import annotations

import pytest
import torch

from runtime import ClosedError, ConfigError, EpDispatchCombineOp, InputError
from runtime.pending import Pending
from runtime.plan import Plan, native_workspace
from runtime.config import load_specs
from tests.support.configs import make_config
from tests.support.ep_dist import get_world
from tests.support.ep_oracle import make_inputs

T, K, H = 10, 4, 64
MODES = {"bf16": {}, "fp8_blockwise": {"dispatch_quant_type": "fp8_blockwise", "hidden_dim": 128}}


def _cfg(rank, world, mode="bf16", **kw):
    return make_config(rank, world, **{"hidden_dim": H, "max_num_inp_token_per_rank": T, "num_experts_per_rank": 3,
                                       "num_experts_per_token": K, "enable_grouped_layout": True, **MODES[mode], **kw})


def _batch(seed, rank, cfg, n=T):
    return make_inputs(seed, rank, n, cfg.hidden_dim, K, cfg.num_experts, torch.bfloat16)


def _expert(out, cfg, rank):
    """A stand-in expert on the received rows: y = 2 * row + rank (in the combine dtype)."""
    return (out.float() * 2 + rank).to(cfg.combine_dtype) if out.dtype in (torch.bfloat16, torch.float32) else \
        torch.full((out.shape[0], cfg.hidden_dim), float(rank + 1), dtype=cfg.combine_dtype)


def _same(a, b):
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a == b
    return torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                       b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


def scn_two_in_flight(rank, world, mode, rounds):
    """Two micro-batches interleaved (A send, B send, A receive, B receive, B combine send, A combine send, A
    receive, B receive) equal the one-call form bit for bit, round after round (slots reused)."""
    cfg = _cfg(rank, world, mode, max_inflight=2)
    ref_cfg = _cfg(rank, world, mode)
    slots = []
    with EpDispatchCombineOp(cfg) as op, EpDispatchCombineOp(ref_cfg) as ref:
        for r in range(rounds):
            xa, wa, ia = _batch(10 * r, rank, cfg)
            xb, wb, ib = _batch(10 * r + 1, rank, cfg, n=T - 3)
            want = []
            for x, w, i in ((xa, wa, ia), (xb, wb, ib)):
                *outs, h = ref.dispatch(x, w, None, i, return_routing=True)
                got = ref.combine(_expert(outs[0], cfg, rank), outs[1], routing=h)
                want.append(([o.clone() if isinstance(o, torch.Tensor) else o for o in outs], got))
            pa = op.dispatch_send(xa, wa, None, ia, return_routing=True)
            pb = op.dispatch_send(xb, wb, None, ib, return_routing=True)
            assert isinstance(pa, Pending) and (pa.slot, pb.slot) == (0, 1) and not pa.deferred
            ra, rb = pa.receive(), pb.hook()  # DeepEP's name too
            assert pa.done and pa.event is None  # CPU: no stream, no event
            for (outs, _), got in zip(want, (ra, rb)):
                assert all(_same(a, b) for a, b in zip(outs, got[:5]))
            cb = op.combine_send(_expert(rb[0], cfg, rank), rb[1], routing=rb[-1])
            ca = op.combine_send(_expert(ra[0], cfg, rank), ra[1], routing=ra[-1])
            for (_, want_c), got in zip(want, (ca.receive(), cb.receive())):
                assert _same(got[0], want_c[0]) and _same(got[1], want_c[1])
            slots.append((pa.slot, pb.slot))
    return slots


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", list(MODES))
def test_two_batches_in_flight_match_the_one_call_form(world, mode):
    assert get_world(world).run(scn_two_in_flight, mode, 3, timeout=180) == [[(0, 1)] * 3] * world


def scn_grouped_two_in_flight(rank, world):
    """dispatch_grouped_send / combine_grouped_send of two micro-batches against dispatch_grouped / combine_grouped."""
    cfg = _cfg(rank, world, max_inflight=2)
    with EpDispatchCombineOp(cfg) as op, EpDispatchCombineOp(_cfg(rank, world)) as ref:
        batches = [_batch(s, rank, cfg, n=T - s) for s in (3, 4)]
        want = []
        for x, w, i in batches:
            layout, h = ref.dispatch_grouped(x, w, None, i)
            y = (layout.x.float() * 3 - 1).to(cfg.combine_dtype)
            want.append((layout.x.clone(), ref.combine_grouped(y, h)[0]))
        pend = [op.dispatch_grouped_send(x, w, None, i) for x, w, i in batches]
        got = [p.receive() for p in pend]
        for (lx, _), (layout, _) in zip(want, got):
            assert torch.equal(layout.x, lx)
        cpend = [op.combine_grouped_send((layout.x.float() * 3 - 1).to(cfg.combine_dtype), h)
                 for layout, h in reversed(got)]
        outs = [p.receive()[0] for p in reversed(cpend)]
        return all(torch.equal(o, w[1]) for o, w in zip(outs, want))


@pytest.mark.parametrize("world", [2, 4])
def test_grouped_legs_two_in_flight(world):
    assert all(get_world(world).run(scn_grouped_two_in_flight, timeout=180))


def _raises(exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


def scn_misuse(rank, world):
    """Every misuse of the split API is an error on every rank alike (no collective runs before it is raised)."""
    cfg = _cfg(rank, world, max_inflight=2)
    x, w, idx = _batch(7, rank, cfg)
    op = EpDispatchCombineOp(cfg)
    pa = op.dispatch_send(x, w, None, idx, return_routing=True)
    pb = op.dispatch_send(x, w, None, idx, return_routing=True)
    _raises(InputError, r"dispatch_send: 2 operation\(s\) already in flight .*slot 0: dispatch pending",
            lambda: op.dispatch_send(x, w, None, idx))
    _raises(InputError, "already in flight", lambda: op.dispatch(x, w, None, idx))  # one-call forms take a slot too
    ra = pa.receive()
    _raises(InputError, "was received already", pa.receive)
    _raises(InputError, "routing is a Pending dispatch", lambda: op.combine(ra[0], routing=pb))
    _raises(InputError, "slot 1 has a dispatch pending", lambda: op.combine(ra[0], routing=_with_slot(ra[-1], 1)))
    rb = pb.receive()
    # expert rows written into slot 1's view combined with slot 0's handle
    view_b = op.combine_in_view(rb[-1])
    _raises(InputError, "lie in the view of workspace slot 1", lambda: op.combine_send(view_b, routing=ra[-1]))
    view_b.copy_(_expert(rb[0], cfg, rank))
    pc = op.combine_send(view_b, routing=rb[-1])
    _raises(InputError, "slot 1 has a combine pending", lambda: op.combine(view_b, routing=rb[-1]))
    pc.receive()
    op.combine(_expert(ra[0], cfg, rank), routing=ra[-1])
    # slot 0 free again: a new dispatch takes it and slot 0's old handle is stale
    *_, h_new = op.dispatch(x, w, None, idx, return_routing=True)
    assert h_new.slot == 0
    _raises(InputError, "routing handle is stale: slot 0 holds the rows of a later dispatch",
            lambda: op.combine(ra[0], routing=ra[-1]))
    op.combine(ra[0], routing=h_new)
    op.combine(ra[0], routing=h_new)  # combining again with the same handle (no dispatch in between) is allowed
    # a handle of another op
    with EpDispatchCombineOp(cfg) as other:
        *_, h_other = other.dispatch(x, w, None, idx, return_routing=True)
        _raises(InputError, "comes from another op", lambda: op.combine_send(ra[0], routing=h_other))
    # streams and events order CUDA streams only
    _raises(InputError, "stream / previous_event order a leg on CUDA streams",
            lambda: op.dispatch_send(x, w, None, idx, stream=object()))
    # reset voids pending work; close makes every receive a ClosedError
    pd = op.dispatch_send(x, w, None, idx, return_routing=True)
    op.reset()
    _raises(InputError, "the op was reset after this dispatch was sent", pd.receive)
    pe = op.dispatch_send(x, w, None, idx, return_routing=True)
    op.close()
    _raises(ClosedError, "^dispatch receive: this EpDispatchCombineOp is closed", pe.receive)
    return True


def _with_slot(handle, slot):
    import attrs
    return attrs.evolve(handle, slot=slot)


@pytest.mark.parametrize("world", [2, 4])
def test_misuse_is_a_clear_error(world):
    assert all(get_world(world).run(scn_misuse, timeout=180))


def scn_one_in_flight(rank, world):
    """max_inflight=1 (the default): the split form works round after round; a second operation while one is in
    flight is an error, while the one-call dispatch may still follow a dispatch (today's behaviour)."""
    cfg = _cfg(rank, world)
    x, w, idx = _batch(3, rank, cfg)
    with EpDispatchCombineOp(cfg) as op:
        for _ in range(2):
            p = op.dispatch_send(x, w, None, idx, return_routing=True)
            _raises(InputError, r"1 operation\(s\) already in flight", lambda: op.dispatch_send(x, w, None, idx))
            out, out_w, *_, h = p.receive()
            _raises(InputError, "slot 0: dispatched, not combined yet", lambda: op.dispatch_send(x, w, None, idx))
            one = op.combine(_expert(out, cfg, rank), out_w, routing=h)
            split = op.combine_send(_expert(out, cfg, rank), out_w, routing=h).receive()
            assert torch.equal(one[0], split[0]) and torch.equal(one[1], split[1])
        op.dispatch(x, w, None, idx)
        op.dispatch(x, w, None, idx)  # one-call dispatches back to back: allowed at max_inflight=1
    return True


def test_one_in_flight_by_default():
    assert all(get_world(2).run(scn_one_in_flight, timeout=120))


@pytest.mark.parametrize("bad", [0, 9, -1, True, "2", 1.0])
def test_max_inflight_is_validated(bad):
    with pytest.raises(ConfigError, match="max_inflight"):
        make_config(0, 1, max_inflight=bad)


def test_plan_lays_out_one_workspace_slot_per_operation_in_flight():
    target = load_specs().targets["sm_90"]
    one = _cfg(0, 2, intranode_protocol="ll")
    two = _cfg(0, 2, intranode_protocol="ll", max_inflight=2)
    p1, p2 = Plan.of(one, target), Plan.of(two, target)
    lay1, lay2 = p1.layout(one), p2.layout(two)
    assert lay2["total"] == 2 * lay1["total"]
    slot0, slot1 = Plan.slot_layout(lay2, 0), Plan.slot_layout(lay2, 1)
    assert slot0.keys() == lay1.keys() == slot1.keys()
    assert all(slot0[n] == lay1[n] for n in lay1 if n != "total")
    assert all(slot1[n] == lay1[n] + lay1["total"] for n in lay1 if n != "total")
    names = {r.name for r in p2.regions(two)}
    assert {"recv_x", "recv_x@1", "ll_x@1", "comb_x@1", "grouped_x", "grouped_x@1"} <= names
    w1, w2 = native_workspace(one, p1.ll_tokens), native_workspace(two, p2.ll_tokens)
    assert w2["total_bytes"] == 2 * w1["total_bytes"] and "max_inflight" in w2["formula"]


def test_memory_report_counts_every_slot():
    with EpDispatchCombineOp(_cfg(0, 1)) as one, EpDispatchCombineOp(_cfg(0, 1, max_inflight=2)) as two:
        one.combine_in_view()
        x, w, idx = _batch(1, 0, two.config)
        handles = [two.dispatch(x, w, None, idx, return_routing=True)[-1] for _ in range(2)]
        assert [h.slot for h in handles] == [0, 1]
        views = [two.combine_in_view(h) for h in handles]
        assert views[0].data_ptr() != views[1].data_ptr()
        assert two.memory_report()["buffers"]["combine_in_view"] == 2 * one.memory_report()["buffers"]["combine_in_view"]
        assert two.capabilities["max_inflight"] == 2 and two.capabilities["split_phase"]


def scn_capacity_at_receive(rank, world):
    """strict_capacity: the receive half raises the CapacityError the one-call form raises; the slot is free after."""
    from runtime import CapacityError

    cfg = _cfg(rank, world, max_inflight=2, strict_capacity=True, max_total_recv_tokens=world)
    x, w, idx = _batch(5, rank, cfg)
    with EpDispatchCombineOp(cfg) as op:
        p = op.dispatch_send(x, w, None, idx, return_routing=True)  # the torch backend moved the rows already
        raised = False
        try:
            p.receive()
        except CapacityError:
            raised = int(op.dropped_count()) > 0
        q = op.dispatch_send(x[:0], w[:0], None, idx[:0], return_routing=True)
        r = op.dispatch_send(x[:0], w[:0], None, idx[:0], return_routing=True)  # slot 0 was freed by the error
        assert {q.slot, r.slot} == {0, 1}
        q.receive(), r.receive()
        return raised


def test_capacity_error_comes_from_the_receive_half():
    assert any(get_world(2).run(scn_capacity_at_receive, timeout=120))


def scn_no_handle_frees_its_slot(rank, world):
    """A dispatch that returns no routing handle (nothing can combine it) holds no slot once received."""
    cfg = _cfg(rank, world, max_inflight=2)
    x, w, idx = _batch(6, rank, cfg)
    with EpDispatchCombineOp(cfg) as op:
        for _ in range(3):
            op.dispatch(x, w, None, idx)
            op.dispatch_send(x, w, None, idx).receive()
        held = [op.dispatch(x, w, None, idx, return_routing=True)[-1] for _ in range(2)]
        _raises(InputError, "slot 1: dispatched, not combined yet", lambda: op.dispatch(x, w, None, idx))
        return [h.slot for h in held]


def test_a_dispatch_without_a_handle_frees_its_slot():
    assert get_world(2).run(scn_no_handle_frees_its_slot, timeout=120) == [[0, 1]] * 2
