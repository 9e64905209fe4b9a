"""MoE integration on the op facade and the torch backend, against plain-torch oracles written here.

Local expert counts, the standard-MoE layout (convert_dispatch_output / convert_combine_input with a
per-expert affine expert a_e * x + b_e), routing replay, the receive cap (drops in (source rank, token)
order, dropped_count, strict_capacity), memory_report, bad inputs and the op's lifecycle.
2 gloo ranks through tests/support/ep_dist.py, and world_size=1 in-process.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.support.configs import make_config
from tests.support.ep_dist import get_world, shutdown_all
from tests.support.ep_oracle import destination_ranks, expected_received, experts_per_rank_for, make_inputs
from runtime import (CapacityError, ClosedError, ConfigError, EpDispatchCombineConfig, EpDispatchCombineOp,
                     InputError)
from runtime.op import NATIVE_WORKSPACE_FORMULA, native_workspace

H, T, K, EPR = 32, 24, 4, 3


def _epr(world):
    return experts_per_rank_for(K, world, EPR)


_cfg = functools.partial(make_config, hidden_dim=H, max_num_inp_token_per_rank=T, num_experts_per_rank=EPR,
                         num_experts_per_token=K)  # _cfg(rank, world, **fields)


def _all_inputs(seed, world, counts, dtype, num_experts):
    return [make_inputs(seed, r, counts[r], H, K, num_experts, dtype) for r in range(world)]


def _affine(num_experts):
    """Dyadic per-expert a_e in {1/4, ..., 1}, b_e in multiples of 1/8: a*x + b and w*(a*x + b) are exact in fp32."""
    a = torch.tensor([(e % 4 + 1) / 4 for e in range(num_experts)])
    b = torch.tensor([(e % 7 - 3) / 8 for e in range(num_experts)])
    return a, b


def _local_pairs(rows_idx, rank, epr):
    """Oracle: per local expert, the pair ids i * k + j of local (row, column) pairs, ascending i then j."""
    pairs = [[] for _ in range(epr)]
    for i, row in enumerate(rows_idx):
        for j, e in enumerate(row):
            if e >= 0 and e // epr == rank:
                pairs[e - rank * epr].append(i * len(row) + j)
    return pairs


def _exp_received(inputs, rank, cap=None):
    got = expected_received([i for _, _, i in inputs], rank, _epr(len(inputs)))
    return got if not cap else got[:cap]  # cap 0: the worst case, nothing dropped


# ---------------------------------------------------------------------------------------------
# Scenarios (run on every rank)
# ---------------------------------------------------------------------------------------------
def scn_std_moe(rank, world, dtype, capacity, use_weights, seed):
    """Pack against the oracle, the affine expert round trip, local counts; -> (local pairs, valid pairs here,
    duplicate local pairs seen, dropped)."""
    cfg = _cfg(rank, world, enable_std_moe=True, data_type=dtype, expert_capacity=capacity)
    E, C, R = cfg.num_experts_per_rank, cfg.resolved_expert_capacity, cfg.max_recv_tokens
    counts = [T - 3 * r for r in range(world)]
    inputs = _all_inputs(seed, world, counts, dtype, cfg.num_experts)
    x, w, idx = inputs[rank]
    a, b = _affine(cfg.num_experts)
    with EpDispatchCombineOp(cfg) as op:
        out, out_w, _, out_i, total, h = op.dispatch(x, w if use_weights else None, None, idx, return_routing=True)
        received = _exp_received(inputs, rank)
        n = len(received)
        assert int(total) == n
        rows_idx = [inputs[s][2][t].tolist() for s, t in received]
        pairs = _local_pairs(rows_idx, rank, E)
        lec = op.local_expert_count()
        assert lec.dtype == torch.int32 and lec.tolist() == [len(p) for p in pairs]

        px, pc, psrc, pw = op.convert_dispatch_output()
        assert px.shape == (E, C, H) and px.dtype == dtype and pc.dtype == psrc.dtype == torch.int32
        assert psrc.shape == pw.shape == (E, C) and pw.dtype == torch.float32
        dropped = sum(max(len(p) - C, 0) for p in pairs)
        assert op.std_moe_dropped().dtype == torch.int32 and int(op.std_moe_dropped()) == dropped
        for e in range(E):
            kept = pairs[e][:C]
            m = len(kept)
            assert int(pc[e]) == m and psrc[e].tolist() == kept + [-1] * (C - m), (e, kept)
            for p, pid in enumerate(kept):
                s, t = received[pid // K]
                assert torch.equal(px[e, p], inputs[s][0][t])
                want_w = inputs[s][1][t][pid % K] if use_weights else torch.tensor(1.0)
                assert float(pw[e, p]) == float(want_w)
            assert not px[e, m:].any() and not pw[e, m:].any()
        dup = sum(len(p) - len({pid // K for pid in p}) for p in pairs)  # a token naming a local expert twice

        # the affine expert on every slot (the ones past the count give b_e: must be ignored)
        first = rank * E
        y = (a[first:first + E, None, None] * px.float() + b[first:first + E, None, None]).to(dtype)
        comb_in = op.convert_combine_input(y, h)
        assert comb_in.shape == (R, H) and comb_in.dtype == dtype
        want_in = torch.zeros(R, H)  # oracle of the layout: ascending j, float32, one rounding
        slot = {pid: (e, p) for e in range(E) for p, pid in enumerate(pairs[e][:C])}
        for i in range(n):
            for j in range(K):
                if i * K + j in slot:
                    e, p = slot[i * K + j]
                    want_in[i] = want_in[i] + pw[e, p] * y[e, p].float()
        assert torch.equal(comb_in, want_in.to(dtype))
        combined, _ = op.combine(comb_in, routing=h)

        # oracle of the whole round: sum over this token's kept pairs (on every rank) of w * (a_e x + b_e)
        kept_pairs = set()  # (dst rank, source rank, token, j)
        for d in range(world):
            rec = _exp_received(inputs, d)
            for e_pairs in _local_pairs([inputs[s][2][t].tolist() for s, t in rec], d, E):
                for pid in e_pairs[:C]:
                    s, t = rec[pid // K]
                    kept_pairs.add((s, t, pid % K))
        want = torch.zeros(counts[rank], H, dtype=torch.float64)
        scale = torch.zeros(counts[rank], H, dtype=torch.float64)
        for t in range(counts[rank]):
            for j in range(K):
                if (rank, t, j) in kept_pairs:
                    e = int(idx[t, j])
                    term = (float(w[t, j]) if use_weights else 1.0) * (a[e] * x[t].double() + b[e])
                    want[t] += term
                    scale[t] += term.abs()
        if dtype == torch.float32:
            assert torch.equal(combined, want.float()), (combined.double() - want).abs().max()
        else:  # bf16: each expert row, each rank's combine row and the result round once (2^-9 relative each)
            err = (combined.double() - want).abs()
            assert bool((err <= 3 * 2.0 ** -8 * scale + 1e-6).all()), float((err - 3 * 2.0 ** -8 * scale).max())
        valid_here = int((idx >= 0).sum())
        return int(lec.sum()), valid_here, dup, dropped


def scn_replay(rank, world, cap):
    cfg = _cfg(rank, world, max_total_recv_tokens=cap)
    counts = [T - 5 * r for r in range(world)]
    first = _all_inputs(3, world, counts, torch.bfloat16, cfg.num_experts)
    second = _all_inputs(4, world, counts, torch.bfloat16, cfg.num_experts)  # other rows, weights, indices
    with EpDispatchCombineOp(cfg) as op:
        x, w, idx = first[rank]
        out, out_w, _, out_i, total, h = op.dispatch(x, w, None, idx, return_routing=True)
        n, d0, layout = int(total), int(op.dropped_count()), h.recv_src.tolist()
        y, w2, idx2 = second[rank]
        out2, out_w2, _, out_i2, total2, h2 = op.dispatch(y, w2, None, idx2, routing=h, return_routing=True)
        assert int(total2) == n and int(op.dropped_count()) == d0 and h2.recv_src.tolist() == layout
        for i, (s, t) in enumerate(layout):  # the original rows, now carrying the new data
            assert torch.equal(out2[i], second[s][0][t]) and torch.equal(out_w2[i], second[s][1][t])
            assert torch.equal(out_i2[i], second[s][2][t])
        assert not out2[n:].any() and not out_i2[n:].ne(-1).any()
        # combine with either handle: the old plan, y's rows (identity expert): each token gets y once per kept row
        combined, _ = op.combine(out2, routing=h2)
        kept = {d: set(map(tuple, _exp_received(first, d, cap))) for d in range(world)}
        u = torch.tensor([[sum((rank, t) in kept[d] for d in range(world))] for t in range(counts[rank])],
                         dtype=torch.float32)
        assert torch.equal(combined, (u * y.float()).to(torch.bfloat16))
        # the replayed op is still fine for a fresh dispatch
        out3, *_ , total3 = op.dispatch(x, w, None, idx)
        assert int(total3) == n and torch.equal(out3[:n], out[:n])
    return n, d0


def scn_cap(rank, world, cap, seed):
    """Forced overflow: rows past the cap are the last ones in (source rank, token) order, never written."""
    cfg = _cfg(rank, world, max_total_recv_tokens=cap)
    counts = [T] * world
    inputs = _all_inputs(seed, world, counts, torch.bfloat16, cfg.num_experts)
    x, w, idx = inputs[rank]
    with EpDispatchCombineOp(cfg) as op:
        out, out_w, _, out_i, total, h = op.dispatch(x, w, None, idx, return_routing=True)
        full = _exp_received(inputs, rank)
        kept = full[:cap]
        dropped = op.dropped_count()
        assert dropped.dtype == torch.int32 and dropped.dim() == 0 and dropped.device == op.device
        assert int(dropped) == len(full) - len(kept) and int(total) == len(kept)
        assert out.shape[0] == cap and h.recv_src.tolist() == [list(p) for p in kept]
        for i, (s, t) in enumerate(kept):
            assert torch.equal(out[i], inputs[s][0][t]) and torch.equal(out_w[i], inputs[s][1][t])
        # local expert counts see only the kept rows; routed counts every rank's pairs, dropped rows included
        pairs = _local_pairs([inputs[s][2][t].tolist() for s, t in kept], rank, cfg.num_experts_per_rank)
        assert op.local_expert_count().tolist() == [len(p) for p in pairs]
        routed = [len(p) for p in _local_pairs([r.tolist() for _, _, i in inputs for r in i], rank,
                                               cfg.num_experts_per_rank)]
        got = op.routed_expert_count()
        assert got.dtype == torch.int32 and got.device == op.device and got.tolist() == routed
        lost = _local_pairs([inputs[s][2][t].tolist() for s, t in full[cap:]], rank, cfg.num_experts_per_rank)
        assert routed == [len(a) + len(b) for a, b in zip(pairs, lost)]  # each dropped row had a local pair
        scn_routed_on_the_op(rank, world, cap, inputs, routed)
        # identity combine: a token gets one copy per destination rank that kept its row
        kept_all = {d: set(_exp_received(inputs, d)[:cap]) for d in range(world)}
        u = torch.tensor([[sum((rank, t) in kept_all[d] for d in range(world))] for t in range(T)], dtype=torch.float32)
        combined, combined_w = op.combine(out, out_w, routing=h)
        assert torch.equal(combined, (u * x.float()).to(torch.bfloat16)) and torch.equal(combined_w, u * w)
        assert any(int(u[t]) < len(destination_ranks(idx[t].tolist(), cfg.num_experts_per_rank))
                   for t in range(T)) or not int(dropped)
    return int(dropped)


def scn_routed_on_the_op(rank, world, cap, inputs, routed):
    """routed_expert_count where the backend keeps none (the native ones): the op gathers every rank's pairs
    when built with count_routed=True, refuses under a cap without it, and needs nothing without a cap."""
    x, w, idx = inputs[rank]
    for count_routed, c in ((True, cap), (False, cap), (False, 0)):
        with EpDispatchCombineOp(_cfg(rank, world, max_total_recv_tokens=c), count_routed=count_routed) as op:
            op._backend.routed_expert_count = None  # as a backend without its own count
            op.dispatch(x, w, None, idx)
            if c and not count_routed:
                with pytest.raises(InputError, match=r"^routed_expert_count: under a receive cap .* count_routed=True"):
                    op.routed_expert_count()
                continue
            got = op.routed_expert_count()
            assert got.dtype == torch.int32 and got.tolist() == routed
            assert c or torch.equal(got, op.local_expert_count())


def scn_strict(rank, world):
    """Everything goes to rank 0's experts: rank 0 overflows and raises, the others return normally."""
    cap = 2 * world
    cfg = _cfg(rank, world, max_total_recv_tokens=cap, strict_capacity=True)
    n = 5
    x, w, _ = make_inputs(9, rank, n, H, K, cfg.num_experts)
    to_zero = torch.zeros(n, K, dtype=torch.int32)
    with EpDispatchCombineOp(cfg) as op:
        if rank == 0:
            with pytest.raises(CapacityError, match=rf"rank 0 dropped {n * world - cap} received row\(s\) past its "
                                                    rf"receive capacity max_recv_tokens={cap}") as err:
                op.dispatch(x, w, None, to_zero)
            assert (err.value.dropped, err.value.capacity) == (n * world - cap, cap)
            assert isinstance(err.value, RuntimeError)
            assert int(op.dropped_count()) == n * world - cap
            with pytest.raises(InputError, match="no dispatch yet"):
                op.local_expert_count()  # the failed call returned nothing to count
        else:
            out, *_, total = op.dispatch(x, w, None, to_zero)
            assert int(total) == 0 and int(op.dropped_count()) == 0
        # a dispatch within the cap right after works on every rank
        spread = torch.tensor([[r * cfg.num_experts_per_rank for r in range(world)][:K] + [-1] * (K - world)] * 1,
                              dtype=torch.int32)
        out, out_w, _, _, total, h = op.dispatch(x[:1].contiguous(), w[:1].contiguous(), None, spread,
                                                 return_routing=True)
        assert int(total) == world and int(op.dropped_count()) == 0
        combined, _ = op.combine(out, routing=h)
        assert torch.equal(combined, (world * x[:1].float()).to(torch.bfloat16))
    return True


# ---------------------------------------------------------------------------------------------
# Multi-process tests (2 gloo ranks)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _worlds():
    yield
    shutdown_all()


@pytest.mark.parametrize("dtype,capacity,use_weights", [
    (torch.float32, 0, True), (torch.bfloat16, 0, True), (torch.float32, 0, False), (torch.float32, 3, True),
    (torch.bfloat16, 2, False)])
def test_std_moe_round_trip(dtype, capacity, use_weights):
    res = get_world(2).run(scn_std_moe, dtype, capacity, use_weights, 11)
    local, valid, dup, dropped = (sum(v) for v in zip(*res))
    assert local == valid, "local expert counts summed over ranks != valid (token, k) pairs"
    assert dup > 0, "no token named a local expert twice: the duplicate-column case went untested"
    assert (dropped > 0) == (capacity > 0)


@pytest.mark.parametrize("cap", [0, 20])
def test_routing_replay(cap):
    res = get_world(2).run(scn_replay, cap)
    assert all(n > 0 for n, _ in res) and (sum(d for _, d in res) > 0) == bool(cap)


def test_receive_cap_drops_the_last_rows():
    assert sum(get_world(2).run(scn_cap, 7, 5)) > 0


def test_strict_capacity_raises_where_rows_dropped():
    get_world(2).run(scn_strict)


# ---------------------------------------------------------------------------------------------
# world_size=1, in-process
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("EPGEN_KERNEL_BACKEND", raising=False)


EPR1 = _epr(1)  # one rank holds all the experts: K of them


def test_single_rank_std_moe_and_cap(no_env):
    local, valid, dup, dropped = scn_std_moe(0, 1, torch.float32, 0, True, 5)
    # 4 experts, top-4 with repeated ids (make_inputs repeats a column's id 1 time in 5): an expert named twice by
    # some rows gets more pairs than rows, so even C = max_recv_tokens overflows
    assert local == valid and dup > 0 and dropped > 0
    assert scn_cap(0, 1, 9, 6) > 0
    scn_strict(0, 1)
    assert scn_replay(0, 1, 10)[1] > 0


def _one_rank_op(**kw):
    return EpDispatchCombineOp(_cfg(0, 1, **kw))


def _args(n=6, seed=1):
    x, w, idx = make_inputs(seed, 0, n, H, K, EPR1)
    return x, w, idx


def test_bad_inputs(no_env):
    x, w, idx = _args()
    plain = _one_rank_op()
    with pytest.raises(InputError, match=r"convert_dispatch_output: the standard-MoE layout conversion requires "
                                         r"enable_std_moe=True"):
        plain.convert_dispatch_output()
    op, other = _one_rank_op(enable_std_moe=True), _one_rank_op(enable_std_moe=True)
    for call, what in ((op.convert_dispatch_output, "convert_dispatch_output"),
                       (op.local_expert_count, "local_expert_count"), (op.dropped_count, "dropped_count"),
                       (op.routed_expert_count, "routed_expert_count"), (op.std_moe_dropped, "std_moe_dropped")):
        with pytest.raises(InputError, match=f"^{what}: no dispatch yet"):
            call()
    with pytest.raises(ConfigError, match=r"^count_routed must be a bool, got str$"):
        EpDispatchCombineOp(_cfg(0, 1), count_routed="yes")
    y = torch.zeros(EPR1, op.config.resolved_expert_capacity, H, dtype=torch.bfloat16)
    *_, h = op.dispatch(x, w, None, idx, return_routing=True)
    other_h = other.dispatch(x, w, None, idx, return_routing=True)[-1]
    with pytest.raises(InputError, match="call convert_dispatch_output"):
        op.convert_combine_input(y, h)
    with pytest.raises(InputError, match="call convert_dispatch_output"):
        op.std_moe_dropped()
    op.convert_dispatch_output()
    with pytest.raises(InputError, match="from another op"):
        op.convert_combine_input(y, other_h)
    with pytest.raises(InputError, match=rf"expert_out must have shape \[{EPR1}, 24, 32\], got \[{EPR1}, 5, 32\]"):
        op.convert_combine_input(y[:, :5].contiguous(), h)
    with pytest.raises(InputError, match="expert_out must be torch.bfloat16"):
        op.convert_combine_input(y.float(), h)
    # replay: a handle from another op, or another config, or another token count
    with pytest.raises(InputError, match="from another op"):
        op.dispatch(x, w, None, idx, routing=other_h)
    stale = EpDispatchCombineOp(_cfg(0, 1, enable_std_moe=True, expert_capacity=2))
    stale_h = stale.dispatch(x, w, None, idx, return_routing=True)[-1]
    with pytest.raises(InputError, match="from another op"):
        op.dispatch(x, w, None, idx, routing=stale_h)
    with pytest.raises(InputError, match="same token count"):
        op.dispatch(x[:5].contiguous(), w[:5].contiguous(), None, idx[:5].contiguous(), routing=h)
    # a later dispatch makes the converted handle stale for convert_combine_input
    h2 = op.dispatch(x, w, None, idx, return_routing=True)[-1]
    op.convert_dispatch_output()
    with pytest.raises(InputError, match="not from the dispatch that convert_dispatch_output converted"):
        op.convert_combine_input(y, h)
    assert op.convert_combine_input(y, h2).shape == (op.config.max_recv_tokens, H)
    # fp8/fp4 payloads and in-kernel quantization: not built yet
    for kw in (dict(dispatch_quant_type="fp8_blockwise", hidden_dim=128),
               dict(dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.bfloat16, scale_dim=1,
                    scale_type_size=4)):
        lp = _one_rank_op(enable_std_moe=True, **kw)
        with pytest.raises(InputError, match="not built yet"):
            lp.convert_dispatch_output()
    # capacity below one token per rank (config), expert_capacity past the receive buffer
    with pytest.raises(ConfigError, match="capacity smaller than one token per rank"):
        _cfg(0, 4, max_total_recv_tokens=3)
    with pytest.raises(ConfigError, match="^expert_capacity=25: must be <= max_recv_tokens=24"):
        _cfg(0, 1, expert_capacity=25)


def test_unweighted_and_empty(no_env):
    op = _one_rank_op(enable_std_moe=True)
    x, w, idx = _args(0)
    op.dispatch(x, None, None, idx)
    assert op.local_expert_count().tolist() == [0] * EPR1 and int(op.dropped_count()) == 0
    px, pc, psrc, pw = op.convert_dispatch_output()
    assert not pc.any() and bool((psrc == -1).all()) and not pw.any() and not px.any()


def test_memory_report(no_env):
    op = _one_rank_op(enable_std_moe=True, expert_capacity=4)
    rep = op.memory_report()
    assert rep["backend"] == "torch" and "formula" in rep and rep["total_bytes"] == sum(rep["buffers"].values())
    assert rep["buffers"]["std_moe_packed_x"] == EPR1 * 4 * H * 2
    assert rep["buffers"]["dispatch_out_x"] == T * H * 2 and rep["buffers"]["combine_in_view"] == 0
    op.combine_in_view()
    assert op.memory_report()["buffers"]["combine_in_view"] == T * H * 2

    # the native formula (docs/RUNTIME.md, Memory), by hand: W=2, R=16, T=8, H=256, k=4, bf16, gather, std-MoE C=5, E=3
    cfg = EpDispatchCombineConfig(rank=0, world_size=2, hidden_dim=256, max_num_inp_token_per_rank=8,
                                  num_experts_per_rank=3, num_experts_per_token=4, enable_std_moe=True,
                                  expert_capacity=5, kernel_backend="torch")
    up = lambda n: -(-n // 256) * 256  # noqa: E731
    nat = native_workspace(cfg)
    assert nat["regions"] == {"signal": 256, "counter": 256, "recv_x": 16 * 512, "recv_scales": 0,
                              "recv_w": 256, "recv_idx": 256, "recv_src": 256, "comb_x": 16 * 512, "comb_w": 256,
                              "std_moe_x": 3 * 5 * 256 * 2}
    assert nat["total_bytes"] == sum(up(v) for v in (8, 8, 16 * 512, 16 * 16, 16 * 16, 64, 16 * 512, 256,
                                                      3 * 5 * 512)) and nat["formula"] == NATIVE_WORKSPACE_FORMULA
    scat = native_workspace(attrs_evolve(cfg, quant_type="fp8_blockwise"))["regions"]
    assert (scat["scat_x"], scat["scat_s"], scat["scat_w"]) == (16 * 256, up(16 * 2 * 4), 256)
    assert "comb_x" not in scat


def attrs_evolve(cfg, **kw):
    import attrs
    return attrs.evolve(cfg, **kw)


def test_build_close_ten_times_then_closed(no_env):
    x, w, idx = _args()
    for _ in range(10):
        op = EpDispatchCombineOp(_cfg(0, 1, enable_std_moe=True))
        out, *_, h = op.dispatch(x, w, None, idx, return_routing=True)
        op.convert_dispatch_output()
        op.close()
        op.close()  # idempotent
        assert op.closed and op._last is None and op._packed is None
    y = torch.zeros(EPR1, T, H, dtype=torch.bfloat16)
    calls = {
        "dispatch": lambda: op.dispatch(x, w, None, idx), "combine": lambda: op.combine(out, routing=h),
        "combine_in_view": op.combine_in_view, "check": op.check, "reset": op.reset,
        "dropped_count": op.dropped_count, "local_expert_count": op.local_expert_count,
        "routed_expert_count": op.routed_expert_count,
        "convert_dispatch_output": op.convert_dispatch_output, "std_moe_dropped": op.std_moe_dropped,
        "convert_combine_input": lambda: op.convert_combine_input(y, h), "memory_report": op.memory_report,
        "scale_stride_bytes": op.scale_stride_bytes, "grouped_layout": op.grouped_layout,
        "grouped_x_spec": op.grouped_x_spec,
        "dispatch_grouped": lambda: op.dispatch_grouped(x, w, None, idx),
        "combine_grouped": lambda: op.combine_grouped(out, h), "grouped_out_view": op.grouped_out_view,
        "dispatch_send": lambda: op.dispatch_send(x, w, None, idx), "combine_send": lambda: op.combine_send(out, routing=h),
        "dispatch_grouped_send": lambda: op.dispatch_grouped_send(x, w, None, idx),
        "combine_grouped_send": lambda: op.combine_grouped_send(out, h),
    }
    public = {n for n in dir(EpDispatchCombineOp) if not n.startswith("_") and callable(getattr(EpDispatchCombineOp, n))}
    # close is idempotent; available_backends is a classmethod (the machine's, no op state)
    assert public - {"close", "available_backends"} == set(calls), "a public method is missing from this test"
    for name, call in calls.items():
        with pytest.raises(ClosedError, match=f"^{name}: this EpDispatchCombineOp is closed"):
            call()
    with EpDispatchCombineOp(_cfg(0, 1)) as op2:
        pass
    assert op2.closed


def test_reset_after_rejected_call(no_env):
    x, w, idx = _args()
    with EpDispatchCombineOp(_cfg(0, 1, enable_std_moe=True)) as op:
        with pytest.raises(InputError):
            op.dispatch(x.float(), w, None, idx)
        bad = idx.clone()
        bad[0, 0] = 10 ** 6
        with pytest.raises(InputError, match="expert id"):
            op.dispatch(x, w, None, bad)
        op.reset()
        with pytest.raises(InputError, match="no dispatch yet"):
            op.local_expert_count()  # a reset makes earlier outputs stale
        out, out_w, _, _, total, h = op.dispatch(x, w, None, idx, return_routing=True)
        px, *_ = op.convert_dispatch_output()
        combined, _ = op.combine(op.convert_combine_input(px, h), routing=h)
        want = torch.stack([sum((float(w[t, j]) * x[t].float() for j in range(K) if idx[t, j] >= 0),
                                torch.zeros(H)) for t in range(x.shape[0])])
        assert torch.allclose(combined.float(), want, rtol=2 ** -7, atol=1e-6)
