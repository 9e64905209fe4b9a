"""The op facade and the torch reference backend: 1 rank in-process, 2 and 4 gloo ranks in worker processes.

Scenario functions (``scn_*``) run on every rank of a gloo world (tests/support/ep_dist.py); they assert
against the plain-python oracle in tests/support/ep_oracle.py. The low-precision section checks pre-quantized
payloads (byte-exact by source row), in-kernel quantization (bit-exact numerics.quantize_*), and the
combine's wire formats and summation orders (bit-exact against a per-token loop, plus error bounds).
"""

from __future__ import annotations

import sys
import types

import attrs
import pytest
import torch

from tests.support.ep_dist import get_world, shutdown_all
from tests.support.ep_oracle import (expected_received, first_appearance_ranks, make_inputs, multiplicity, ordered_sum,
                                     wire_roundtrip)
from tests.support.configs import make_config
from tests.support.rounds import check_round
from runtime import numerics
from runtime import ClosedError, ConfigError, EpDispatchCombineOp, EpgenError, InputError

TOKEN_COUNTS = (0, 1, 7, 128)


_cfg = make_config  # the factory's defaults are these tests' config


def all_ranks_routing(cfg):
    """Indices sending every token to every rank (so every rank receives rows)."""
    row = [(j * cfg.num_experts_per_rank) % cfg.num_experts for j in range(cfg.num_experts_per_token)]
    return lambda n: torch.tensor([row] * n, dtype=torch.int32).reshape(n, len(row))


# ---------------------------------------------------------------------------------------------
# Scenarios (run on every rank)
# ---------------------------------------------------------------------------------------------
def scn_identity_matrix(rank, world, hidden, dtype=torch.bfloat16):
    """Every (top-k, experts per rank) pair (experts per rank raised where the world would hold fewer than k
    experts, _cfg); equal and mixed token counts per rank."""
    received = 0
    for k in (1, 4, 8):
        for epr in (2, 8):
            with EpDispatchCombineOp(_cfg(rank, world, hidden_dim=hidden, num_experts_per_token=k,
                                          num_experts_per_rank=epr, data_type=dtype)) as op:
                plans = [[c] * world for c in TOKEN_COUNTS]
                plans.append([TOKEN_COUNTS[(r + k) % len(TOKEN_COUNTS)] for r in range(world)])
                for seed, counts in enumerate(plans):
                    received += check_round(op, rank, world, seed + 100 * k + epr, counts)
    return received


def scn_variants(rank, world):
    """No weights, combine through combine_in_view, all-ranks routing, a capped receive buffer."""
    op = EpDispatchCombineOp(_cfg(rank, world))
    check_round(op, rank, world, 1, [5] * world, use_weights=False)
    check_round(op, rank, world, 2, [9] * world, via_view=True)
    assert op.combine_in_view() is op.combine_in_view()
    check_round(op, rank, world, 3, [3] * world, indices_fn=all_ranks_routing(op.config))
    op.reset()
    check_round(op, rank, world, 4, [0] * world)
    op.close()
    capped = EpDispatchCombineOp(_cfg(rank, world, max_total_recv_tokens=10))
    assert capped.config.max_recv_tokens == 10
    check_round(capped, rank, world, 5, [10 // world] * world, indices_fn=all_ranks_routing(capped.config))
    return True


def bad_input_context(rank, world):
    """An op with a valid dispatch done, plus what the bad-input cases need."""
    cfg = _cfg(rank, world, max_num_inp_token_per_rank=16)
    op, other = EpDispatchCombineOp(cfg), EpDispatchCombineOp(cfg)
    x, w, _ = make_inputs(7, rank, 6, cfg.hidden_dim, cfg.num_experts_per_token, cfg.num_experts)
    idx = all_ranks_routing(cfg)(6)
    out, out_w, _, _, total, handle = op.dispatch(x, w, None, idx, return_routing=True)
    other_handle = other.dispatch(x, w, None, idx, return_routing=True)[-1]
    bad_idx = idx.clone()
    if rank == 0:
        bad_idx[2, 1] = cfg.num_experts
    return types.SimpleNamespace(op=op, cfg=cfg, x=x, w=w, idx=idx, out=out, out_w=out_w, total=int(total),
                                 handle=handle, other_handle=other_handle, bad_idx=bad_idx)


def _big(c):
    n = c.cfg.max_num_inp_token_per_rank + 1
    return torch.zeros(n, c.cfg.hidden_dim, dtype=torch.bfloat16), torch.zeros(n, 4, dtype=torch.int32)


# name -> (error class, message pattern, call). Every rank makes the same call.
BAD_CASES = {
    "x_dtype": (InputError, "x must be torch.bfloat16", lambda c: c.op.dispatch(c.x.float(), c.w, None, c.idx)),
    "x_not_tensor": (InputError, "x must be a torch.Tensor", lambda c: c.op.dispatch(c.x.tolist(), c.w, None, c.idx)),
    "x_1d": (InputError, "x must be 2-D", lambda c: c.op.dispatch(c.x.reshape(-1), c.w, None, c.idx)),
    "x_hidden": (InputError, r"hidden_dim=64\], got \(6, 63\)",
                 lambda c: c.op.dispatch(c.x[:, 1:].contiguous(), c.w, None, c.idx)),
    "x_noncontiguous": (InputError, "x must be contiguous",
                        lambda c: c.op.dispatch(torch.cat([c.x, c.x], 1)[:, ::2], c.w, None, c.idx)),
    "x_device": (InputError, "x must be on cpu, got meta", lambda c: c.op.dispatch(c.x.to("meta"), c.w, None, c.idx)),
    "too_many_tokens": (InputError, "17 tokens, more than max_num_inp_token_per_rank=16",
                        lambda c: c.op.dispatch(_big(c)[0], None, None, _big(c)[1])),
    "indices_dtype": (InputError, "indices must be torch.int32", lambda c: c.op.dispatch(c.x, c.w, None, c.idx.long())),
    "indices_missing": (InputError, "indices must be a torch.Tensor", lambda c: c.op.dispatch(c.x, c.w, None, None)),
    "indices_shape": (InputError, r"indices must have shape \[6, 4\]",
                      lambda c: c.op.dispatch(c.x, c.w, None, c.idx[:, :3].contiguous())),
    "indices_noncontiguous": (InputError, "indices must be contiguous",
                              lambda c: c.op.dispatch(c.x, c.w, None, c.idx.t().contiguous().t())),
    "weights_dtype": (InputError, "weights must be torch.float32",
                      lambda c: c.op.dispatch(c.x, c.w.bfloat16(), None, c.idx)),
    "weights_shape": (InputError, r"weights must have shape \[6, 4\]",
                      lambda c: c.op.dispatch(c.x, c.w[:5].contiguous(), None, c.idx)),
    "scales": (InputError, "scales must be None", lambda c: c.op.dispatch(c.x, c.w, torch.ones(6, 1), c.idx)),
    "expert_id_too_big": (InputError, r"rank 0 passed expert id (\d+) >= num_experts=\1 "
                                      r"\(world_size × num_experts_per_rank = \d+ × \d+ = \1;",
                          lambda c: c.op.dispatch(c.x, c.w, None, c.bad_idx)),
    "convert_without_std_moe": (InputError, r"requires enable_std_moe=True",
                                lambda c: c.op.convert_dispatch_output()),
    "convert_back_without_std_moe": (InputError, r"requires enable_std_moe=True",
                                     lambda c: c.op.convert_combine_input(c.out, c.handle)),
    "std_moe_dropped_without_std_moe": (InputError, r"requires enable_std_moe=True",
                                        lambda c: c.op.std_moe_dropped()),
    "replay_other_op": (InputError, "from another op",
                        lambda c: c.op.dispatch(c.x, c.w, None, c.idx, routing=c.other_handle)),
    "replay_token_count": (InputError, "same token count",
                           lambda c: c.op.dispatch(c.x[:5], c.w[:5], None, c.idx[:5], routing=c.handle)),
    "combine_no_routing": (InputError, "routing is required", lambda c: c.op.combine(c.out, c.out_w)),
    "combine_not_handle": (InputError, "routing must be a RoutingHandle",
                           lambda c: c.op.combine(c.out, routing={"op_uid": c.op.uid})),
    "combine_other_op": (InputError, "from another op", lambda c: c.op.combine(c.out, routing=c.other_handle)),
    "combine_stale_config": (InputError, "different config",
                             lambda c: c.op.combine(c.out, routing=attrs.evolve(c.handle, config_key=("old",)))),
    "combine_dtype": (InputError, "expert_out must be torch.bfloat16",
                      lambda c: c.op.combine(c.out.float(), routing=c.handle)),
    "combine_hidden": (InputError, "expert_out must have shape",
                       lambda c: c.op.combine(c.out[:, 1:].contiguous(), routing=c.handle)),
    "combine_noncontiguous": (InputError, "expert_out must be contiguous",
                              lambda c: c.op.combine(torch.cat([c.out, c.out], 1)[:, ::2], routing=c.handle)),
    "combine_too_few_rows": (InputError, "fewer than total_recv",
                             lambda c: c.op.combine(c.out[:c.total - 1], routing=c.handle)),
    "combine_weights_dtype": (InputError, "weights must be torch.float32",
                              lambda c: c.op.combine(c.out, c.out_w.double(), routing=c.handle)),
    "combine_indices_shape": (InputError, "indices must have shape",
                              lambda c: c.op.combine(c.out, None, torch.zeros(4, 3, dtype=torch.int32),
                                                     routing=c.handle)),
}


def scn_bad_inputs(rank, world, names):
    """Each bad call raises its error on every rank, and a correct round works right after it."""
    c = bad_input_context(rank, world)
    for i, name in enumerate(names):
        exc, pattern, call = BAD_CASES[name]
        with pytest.raises(exc, match=pattern):
            call(c)
        check_round(c.op, rank, world, 1000 + i, [(i + r) % 9 for r in range(world)])
    # a combine for the first dispatch still works after all of that
    combined, _ = c.op.combine(c.out, routing=c.handle)
    assert torch.equal(combined, (world * c.x.float()).to(torch.bfloat16))
    return len(names)


def scn_closed(rank, world):
    with EpDispatchCombineOp(_cfg(rank, world)) as op:
        check_round(op, rank, world, 3, [4] * world)
        x, w, idx = make_inputs(3, rank, 4, 64, 4, op.config.num_experts)
        out, *_, handle = op.dispatch(x, w, None, idx, return_routing=True)
    assert op.closed
    op.close()  # idempotent
    for call in (lambda: op.dispatch(x, w, None, idx), lambda: op.combine(out, routing=handle),
                 op.combine_in_view, op.reset):
        with pytest.raises(ClosedError, match="closed"):
            call()
    return True


# ---------------------------------------------------------------------------------------------
# Multi-process tests
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _worlds():
    yield
    shutdown_all()


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("hidden", [64, 256])
def test_identity_and_oracle(world, hidden):
    received = get_world(world).run(scn_identity_matrix, hidden)
    assert all(r > 0 for r in received)


@pytest.mark.parametrize("world", [2, 4])
def test_identity_fp32(world):
    get_world(world).run(scn_identity_matrix, 64, torch.float32)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_variants(world):
    get_world(world).run(scn_variants)


@pytest.mark.parametrize("world", [2, 4])
def test_bad_inputs_keep_op_usable(world):
    assert get_world(world).run(scn_bad_inputs, list(BAD_CASES)) == [len(BAD_CASES)] * world


@pytest.mark.parametrize("world", [2, 4])
def test_calls_after_close(world):
    get_world(world).run(scn_closed)


def test_config_must_match_group():
    get_world(2).run(scn_wrong_world)


def scn_wrong_world(rank, world):
    with pytest.raises(ConfigError, match=f"process group has world size {world} and this process is rank {rank}"):
        EpDispatchCombineOp(_cfg(rank, world * 2))


# ---------------------------------------------------------------------------------------------
# Single process (world_size=1, no process group)
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("EPGEN_KERNEL_BACKEND", raising=False)


@pytest.mark.parametrize("name", list(BAD_CASES))
def test_bad_input_single_rank(name, no_env):
    scn_bad_inputs(0, 1, [name])


def test_single_rank_rounds(no_env):
    assert scn_identity_matrix(0, 1, 64) > 0
    scn_variants(0, 1)
    scn_closed(0, 1)


def test_capabilities(no_env):
    op = EpDispatchCombineOp(_cfg(0, 1))
    caps = op.capabilities
    assert caps["backend"] == "torch" and caps["device"] == "cpu"
    assert caps["dtypes"] == (torch.bfloat16, torch.float32)
    assert caps["combine_modes"] == ("gather", "scatter")
    assert caps["quant_types"] == ("none", "fp8_direct_cast", "fp8_blockwise", "fp4_blockwise")
    assert caps["dispatch_quant_types"] == ("none", "fp8_blockwise", "fp4_blockwise")
    assert caps["payload_dtypes"] == (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float4_e2m1fn_x2)
    assert caps["graph_capture"] is False and caps["routing_replay"] is True and caps["std_moe"] is False
    assert caps["max_recv_tokens"] == 128
    view = op.combine_in_view()
    assert view.shape == (128, 64) and view.dtype == torch.bfloat16


def test_needs_process_group_for_several_ranks(no_env):
    with pytest.raises(ConfigError, match="torch.distributed is not initialized"):
        EpDispatchCombineOp(_cfg(0, 2))


def test_rejects_non_config():
    with pytest.raises(ConfigError, match="must be an EpDispatchCombineConfig"):
        EpDispatchCombineOp({"rank": 0})


def test_native_backend_unavailable(monkeypatch):
    monkeypatch.delenv("EPGEN_KERNEL_BACKEND", raising=False)
    monkeypatch.setitem(sys.modules, "runtime.backends.native", None)  # makes `from .native import` fail
    with pytest.raises(EpgenError, match="kernel backend 'native' is unavailable: importing runtime.backends.native"):
        EpDispatchCombineOp(_cfg(0, 1, kernel_backend="native"))


def test_env_selects_backend(monkeypatch):
    monkeypatch.setenv("EPGEN_KERNEL_BACKEND", "torch")
    op = EpDispatchCombineOp(_cfg(0, 1, kernel_backend="native"))
    assert op.capabilities["backend"] == "torch"


# ---------------------------------------------------------------------------------------------
# Low-precision modes: pre-quantized payloads, in-kernel quantization, scatter combine + wire formats
# ---------------------------------------------------------------------------------------------
LP = dict(hidden_dim=256, max_num_inp_token_per_rank=32, num_experts_per_rank=2, num_experts_per_token=4)
WIRE_QUANTS = ("none", "fp8_direct_cast", "fp8_blockwise", "fp4_blockwise")


def _lp_cfg(rank, world, **kw):
    return _cfg(rank, world, **{**LP, **kw})


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits of a tensor (one integer per element), for bit-exact comparisons (NaN included)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _payload_inputs(seed, rank, n, cfg):
    """Random payload bytes (any bit pattern, NaN codes included) and scales of one rank."""
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randint(0, 256, (n, cfg.dispatch_payload_cols), generator=gen, dtype=torch.uint8)
    if cfg.dispatch_scales_dtype == torch.uint8:
        s = torch.randint(0, 256, (n, cfg.scale_dim), generator=gen, dtype=torch.uint8)
    else:
        s = torch.randn(n, cfg.scale_dim, generator=gen) * 2.0 ** torch.randint(-20, 20, (n, cfg.scale_dim),
                                                                                generator=gen)
    return x.view(cfg.dispatch_data_type), s


def _varied_x(seed, rank, n, hidden, dtype):
    """Rows with per-32-element magnitudes from 2^-12 to 2^12 (so block scales differ within a row)."""
    gen = torch.Generator().manual_seed(seed * 104729 + rank)
    mag = 2.0 ** torch.randint(-12, 13, (n, hidden // 32, 1), generator=gen).float()
    return (torch.randn(n, hidden // 32, 32, generator=gen) * mag).reshape(n, hidden).to(dtype)


def scn_prequantized(rank, world):
    """fp8 (ocp, fnuz) and fp4 payloads with float32 or e8m0 scales: moved verbatim, by source row."""
    cases = [(torch.float8_e4m3fn, 4, 2, torch.bfloat16), (torch.float8_e4m3fnuz, 4, 2, torch.float32),
             (torch.float8_e4m3fn, 1, 8, torch.float32), (torch.float4_e2m1fn_x2, 1, 8, torch.bfloat16),
             (torch.float4_e2m1fn_x2, 4, 3, torch.float32)]
    rows_checked = 0
    for case, (dtype, size, sdim, comb) in enumerate(cases):
        cfg = _lp_cfg(rank, world, dispatch_data_type=dtype, combine_data_type=comb, scale_dim=sdim,
                      scale_type_size=size)
        with EpDispatchCombineOp(cfg) as op:
            assert op.dispatch_out_dtype is dtype and op.dispatch_out_scales_dtype is cfg.dispatch_scales_dtype
            assert op.dispatch_out_cols == cfg.dispatch_payload_cols and op.dispatch_out_scale_cols == sdim
            counts = [(11 + 5 * r + case) % 33 for r in range(world)]
            payloads = [_payload_inputs(case, r, counts[r], cfg) for r in range(world)]
            routing = [make_inputs(case, r, counts[r], 16, cfg.num_experts_per_token, cfg.num_experts)
                       for r in range(world)]
            x, s = payloads[rank]
            _, w, idx = routing[rank]
            out, out_w, out_s, out_i, total, handle = op.dispatch(x, w, s, idx, return_routing=True)
            n = int(total)
            assert n == len(expected_received([i for *_, i in routing], rank, cfg.num_experts_per_rank))
            assert out.dtype is dtype and tuple(out.shape) == (cfg.max_recv_tokens, cfg.dispatch_payload_cols)
            assert out_s.dtype is cfg.dispatch_scales_dtype and tuple(out_s.shape) == (cfg.max_recv_tokens, sdim)
            for i, (src, t) in enumerate(handle.recv_src.tolist()):
                assert torch.equal(_as_bits(out[i]), _as_bits(payloads[src][0][t])), (case, i, src, t)
                assert torch.equal(_as_bits(out_s[i]), _as_bits(payloads[src][1][t])), (case, i, src, t)
            rows_checked += n
            # combine in the combine dtype: an expert that returns its token's (bf16-exact) activation
            acts = [make_inputs(case + 50, r, counts[r], cfg.hidden_dim, 1, 1, comb)[0] for r in range(world)]
            expert_out = torch.zeros(cfg.max_recv_tokens, cfg.hidden_dim, dtype=comb)
            for i, (src, t) in enumerate(handle.recv_src.tolist()):
                expert_out[i] = acts[src][t]
            combined, combined_w = op.combine(expert_out, out_w, routing=handle)
            u = torch.tensor(multiplicity(idx, cfg.num_experts_per_rank), dtype=torch.float32).unsqueeze(1)
            assert combined.dtype is comb and torch.equal(combined, (u * acts[rank].float()).to(comb))
            assert torch.equal(combined_w, u * w)
    return rows_checked


def _quantize_ref(x, quant):
    if quant == "fp8_blockwise":
        return numerics.quantize_fp8(x, "ocp", "fp8_blockwise")
    return numerics.quantize_fp4(x)


def _dequantize_ref(q, s, quant, dtype):
    if quant == "fp8_blockwise":
        return numerics.dequantize_fp8(q.view(torch.uint8), s, "ocp", "fp8_blockwise", dtype)
    return numerics.dequantize_fp4(q, s, dtype)


POISON = {3: ((5, float("inf")), (200, float("nan"))), 9: ((40, float("-inf")), (41, float("nan")))}


def _poison(x):
    """Token 3: +inf in block 0 and NaN in the last fp8 block; token 9: -inf next to a NaN (one fp4 block)."""
    x = x.clone()
    for t, cells in POISON.items():
        for col, v in cells:
            if t < x.shape[0]:
                x[t, col] = v
    return x


def scn_dispatch_quant(rank, world, quant, dtype):
    """In-kernel quantization: bit-exact numerics.quantize_* of each source row; inf/NaN rows stay local."""
    cfg = _lp_cfg(rank, world, dispatch_quant_type=quant, data_type=dtype)
    op = EpDispatchCombineOp(cfg)
    block, hidden, R = cfg.dispatch_quant_block, cfg.hidden_dim, cfg.max_recv_tokens
    want_dtype = torch.float8_e4m3fn if quant == "fp8_blockwise" else torch.uint8
    assert op.wire_dtype is torch.float8_e4m3fn and op.dispatch_out_dtype is want_dtype
    assert op.dispatch_out_cols == (hidden if quant == "fp8_blockwise" else hidden // 2)
    assert op.dispatch_out_scale_cols == hidden // block
    assert op.dispatch_out_scales_dtype is (torch.float32 if quant == "fp8_blockwise" else torch.uint8)
    counts = [20 + 3 * r for r in range(world)]
    clean = [_varied_x(4, r, counts[r], hidden, dtype) for r in range(world)]
    dirty = [_poison(x) if r == 0 else x for r, x in enumerate(clean)]
    routes = [make_inputs(4, r, counts[r], 16, cfg.num_experts_per_token, cfg.num_experts) for r in range(world)]
    _, w, idx = routes[rank]
    results = {}
    for name, xs in (("clean", clean), ("dirty", dirty)):
        out, out_w, out_s, _, total, handle = op.dispatch(xs[rank], w, None, idx, return_routing=True)
        n = int(total)
        assert out.dtype is want_dtype and tuple(out.shape) == (R, op.dispatch_out_cols)
        assert out_s.dtype is op.dispatch_out_scales_dtype and tuple(out_s.shape) == (R, hidden // block)
        refs = [_quantize_ref(x, quant) for x in xs]
        src = handle.recv_src.tolist()
        for i, (sr, t) in enumerate(src):
            assert torch.equal(_as_bits(out[i]), refs[sr][0][t]), (name, i, sr, t)
            assert torch.equal(_as_bits(out_s[i]), _as_bits(refs[sr][1][t])), (name, i, sr, t)
        # identity expert on the dequantized rows; combine sums its U copies in float32
        expert_out = torch.zeros(R, hidden, dtype=dtype)
        expert_out[:n] = _dequantize_ref(out[:n], out_s[:n], quant, dtype)
        combined, _ = op.combine(expert_out, out_w, routing=handle)
        deq = _dequantize_ref(refs[rank][0], refs[rank][1], quant, dtype)
        for t, u in enumerate(multiplicity(idx, cfg.num_experts_per_rank)):
            want = ordered_sum([deq[t]] * u, (hidden,), dtype)
            assert torch.equal(_as_bits(combined[t]), _as_bits(want)) or (
                torch.isnan(want).any() and torch.equal(torch.isnan(combined[t]), torch.isnan(want))), (name, t)
        results[name] = (src, out[:n].view(torch.uint8).clone(), _as_bits(out_s[:n]).clone(), combined)
    # the poisoned tokens change only their own rows
    (src, q0, s0, c0), (src1, q1, s1, c1) = results["clean"], results["dirty"]
    assert src == src1
    bad = [i for i, (sr, t) in enumerate(src) if sr == 0 and t in POISON]
    good = [i for i in range(len(src)) if i not in bad]
    assert torch.equal(q0[good], q1[good]) and torch.equal(s0[good], s1[good])
    if rank == 0:
        keep = [t for t in range(counts[0]) if t not in POISON]
        assert torch.equal(_as_bits(c0[keep]), _as_bits(c1[keep]))
    # saturation per format, on the poisoned rows as they arrived
    for i in bad:
        t = src[i][1]
        q, sc = q1[i], s1[i]
        if quant == "fp8_blockwise":
            scales = sc.view(torch.float32)
            if t == 3:  # block 0 holds +inf: scale inf, inf -> NaN code, finite -> 0; NaN (block 1) -> 0x7F
                assert torch.isinf(scales[0]) and q[5] == 0x7F and bool((q[:128][torch.arange(128) != 5] & 0x7F == 0).all())
                assert q[200] == 0x7F and torch.isfinite(scales[1])
            else:  # -inf and NaN in block 0
                assert torch.isinf(scales[0]) and q[40] == 0x7F and q[41] == 0x7F
        else:
            nib = torch.stack((q & 0xF, q >> 4), -1).reshape(-1)
            if t == 3:  # block 0: e8m0 byte 254 (e = 127), inf -> code 7 (6.0, saturated); NaN -> code 7
                assert sc[0] == 254 and nib[5] == 0x7 and (nib[200] & 0x7) == 0x7
            else:
                assert sc[1] == 254 and nib[40] == 0xF and (nib[41] & 0x7) == 0x7
    op.close()
    return len(bad)


# "skew": ranks 1 and 2 return +-F * x (exact negatives, also after any wire encoding, which is sign-symmetric)
# next to rank 0's x, so a float32 sum that meets them in another order rounds (or cancels) differently
# even after the final bf16 rounding
SKEW = {"identity": None, "dyadic": (1.0, 2.0, 0.5, 4.0), "skew": (1.0, 1.37 * 2**30, -1.37 * 2**30, 7.3)}


def _expert(kind, dst, rows):
    """The test's expert on rank dst: identity, or a per-rank float32 factor (then rounded to rows' dtype)."""
    if SKEW[kind] is None:
        return rows.clone()
    return (rows.float() * torch.tensor(SKEW[kind][dst], dtype=torch.float32)).to(rows.dtype)


def _expert_w(kind, dst, w):
    return w.clone() if SKEW[kind] is None else w * torch.tensor(SKEW[kind][dst], dtype=torch.float32)


def scn_combine(rank, world, quant, mode, kind, dtype=torch.bfloat16, check_u=False):
    """Combine of an expert over dispatched rows == the plain per-token oracle, summed in the mode's order."""
    cfg = _lp_cfg(rank, world, quant_type=quant, combine_mode=mode, data_type=dtype, num_experts_per_token=6)
    assert cfg.resolved_combine_mode == mode
    op = EpDispatchCombineOp(cfg)
    epr, hidden = cfg.num_experts_per_rank, cfg.hidden_dim
    counts = [32 - 2 * r for r in range(world)]
    inputs = [make_inputs(77, r, counts[r], hidden, cfg.num_experts_per_token, cfg.num_experts, dtype)
              for r in range(world)]
    if kind == "skew":  # full-precision activations so float32 sums round
        inputs = [(_varied_x(77, r, counts[r], hidden, dtype), w, i) for r, (_, w, i) in enumerate(inputs)]
    x, w, idx = inputs[rank]
    out, out_w, _, _, total, handle = op.dispatch(x, w, None, idx, return_routing=True)
    n = int(total)
    expert_out = op.combine_in_view()
    expert_out[:n] = _expert(kind, rank, out[:n])
    combined, combined_w = op.combine(expert_out, _expert_w(kind, rank, out_w), routing=handle)
    assert combined.dtype is dtype and combined.shape == (counts[rank], hidden)

    order_matters = 0
    for t in range(counts[rank]):
        ranks = sorted(set(first_appearance_ranks(idx[t], epr))) if mode == "scatter" \
            else first_appearance_ranks(idx[t], epr)
        rows = [wire_roundtrip(_expert(kind, d, x[t:t + 1])[0], quant) for d in ranks]
        ws = [_expert_w(kind, d, w[t]) for d in ranks]
        want, want_w = ordered_sum(rows, (hidden,), dtype), ordered_sum(ws, (cfg.num_experts_per_token,))
        assert torch.equal(_as_bits(combined[t]), _as_bits(want)), (t, ranks)
        assert torch.equal(_as_bits(combined_w[t]), _as_bits(want_w)), (t, ranks)
        other = ordered_sum(rows[::-1], (hidden,), dtype)
        order_matters += not torch.equal(_as_bits(other), _as_bits(want))
    if check_u:  # identity expert: the wire format's error bound around U * x
        u = torch.tensor(multiplicity(idx, epr), dtype=torch.float32).unsqueeze(1)
        err = (combined.float() - u * x.float()).abs()
        tol = _combine_tolerance(x, u, quant, dtype)
        assert bool((err <= tol).all()), f"{quant}: max excess {float((err - tol).max())}"
        if quant == "none":
            assert torch.equal(combined, (u * x.float()).to(dtype))
    op.close()
    return order_matters


def _wire_error_bound(x: torch.Tensor, quant: str) -> torch.Tensor:
    """Per-element bound of |decode(encode(x)) - x| for the wire formats (x: finite, |x| <= 4, and every
    nonzero |x| >= 1/16 as make_inputs gives)."""
    x = x.float()
    ax = x.abs()
    if quant == "none":
        return torch.zeros_like(x)
    if quant == "fp8_direct_cast":
        # e4m3: 3 mantissa bits, round to nearest even -> error <= half an ulp <= 2^-4 * |x| for normal |x|
        # (>= 2^-6; here >= 1/16), and |x| <= 4 < 448: no saturation
        return 2.0 ** -4 * ax
    if quant == "fp8_blockwise":
        # x / s with s = amax / 448 lies in [-448, 448]: half an ulp = 2^-4 * |x| in the normal range, plus
        # half the subnormal spacing 2^-9 (2^-10 * s in x units) for elements far below the block's amax,
        # plus the float32 roundings of x / s and q * s (2^-24 each, relative: 2^-22 * |x| covers both)
        amax = ax.reshape(*x.shape[:-1], -1, 128).amax(-1, keepdim=True)
        s = (amax / 448).expand(*x.shape[:-1], x.shape[-1] // 128, 128).reshape(x.shape)
        return 2.0 ** -4 * ax + 2.0 ** -10 * s + 2.0 ** -22 * ax
    if quant == "fp4_blockwise":
        # block scale 2^e, e = floor(log2(amax)) - 2, so |x| / 2^e = m lies in [0, 8). e2m1 grid steps are
        # 0.5 up to 2, 1 up to 4, 2 up to 6: error <= half a step (0.25, 0.5, 1); m > 6 saturates to 6 (error m - 6)
        amax = ax.reshape(*x.shape[:-1], -1, 32).amax(-1, keepdim=True)
        e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax))
        scale = (2.0 ** e).expand(*x.shape[:-1], x.shape[-1] // 32, 32).reshape(x.shape)
        m = ax / scale
        half_step = torch.where(m <= 2, 0.25, torch.where(m <= 4, 0.5, torch.where(m <= 6, 1.0, m - 6)))
        return half_step * scale
    raise ValueError(quant)


def _combine_tolerance(x, u, quant, dtype):
    """U copies each off by at most the wire bound, then one rounding of the float32 sum to dtype
    (half an ulp: eps/2 relative)."""
    b = _wire_error_bound(x, quant)
    return u * b + torch.finfo(dtype).eps / 2 * (u * x.float().abs() + u * b)


def scn_scatter_gather_parity(rank, world, kind):
    """bf16, quant none: scatter and gather combines agree bit for bit (sums of exactly representable rows)."""
    results = []
    for mode in ("gather", "scatter"):
        cfg = _lp_cfg(rank, world, combine_mode=mode, num_experts_per_token=6)
        with EpDispatchCombineOp(cfg) as op:
            inputs = [make_inputs(91, r, 30, cfg.hidden_dim, 6, cfg.num_experts) for r in range(world)]
            x, w, idx = inputs[rank]
            out, out_w, _, _, total, handle = op.dispatch(x, w, None, idx, return_routing=True)
            n = int(total)
            combined, combined_w = op.combine(_expert(kind, rank, out[:n]), _expert_w(kind, rank, out_w[:n]),
                                              routing=handle)
            results.append((combined, combined_w))
    (cg, wg), (cs, ws) = results
    assert torch.equal(_as_bits(cg), _as_bits(cs)) and torch.equal(_as_bits(wg), _as_bits(ws))
    return True


@pytest.mark.parametrize("world", [2])
def test_prequantized_payload_dispatch(world):
    assert all(r > 0 for r in get_world(world).run(scn_prequantized))


@pytest.mark.parametrize("quant", ["fp8_blockwise", "fp4_blockwise"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dispatch_quant_bit_exact(quant, dtype):
    bad = get_world(2).run(scn_dispatch_quant, quant, dtype)
    assert sum(bad) > 0  # the poisoned rows reached some rank


@pytest.mark.parametrize("quant", WIRE_QUANTS)
def test_combine_wire_identity(quant):
    get_world(2).run(scn_combine, quant, "scatter", "identity", torch.bfloat16, True)


@pytest.mark.parametrize("quant", WIRE_QUANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_scatter_order(quant, dtype):
    """4 ranks, a per-rank expert factor: results follow ascending destination-rank order exactly."""
    order_matters = get_world(4).run(scn_combine, quant, "scatter", "skew", dtype)
    if quant != "fp8_direct_cast":  # e4m3 values (4 significant bits, 2^-9..448) add exactly in float32
        assert sum(order_matters) > 0, "no token's result depends on the order: the check would be vacuous"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_gather_order(dtype):
    """4 ranks: gather sums in first-appearance order of the top-k ids (not ascending rank)."""
    order_matters = get_world(4).run(scn_combine, "none", "gather", "skew", dtype)
    assert sum(order_matters) > 0


@pytest.mark.parametrize("world,kind", [(2, "identity"), (4, "dyadic")])
def test_scatter_gather_parity(world, kind):
    get_world(world).run(scn_scatter_gather_parity, kind)


# --- bad inputs of the low-precision modes (checked by the op before any collective: one rank) -----
def _lp_single(**kw):
    return EpDispatchCombineOp(_lp_cfg(0, 1, **kw))


def _fp8_op():
    return _lp_single(dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.bfloat16, scale_dim=2,
                      scale_type_size=4)


def _lp_args(op, n=6):
    cfg = op.config
    x, s = _payload_inputs(1, 0, n, cfg) if cfg.prequantized else (
        _varied_x(1, 0, n, cfg.hidden_dim, cfg.data_type), None)
    _, w, idx = make_inputs(1, 0, n, 16, cfg.num_experts_per_token, cfg.num_experts)
    return x, w, s, idx


LP_BAD = {
    "scales_missing": (_fp8_op, r"scales are required for a torch.float8_e4m3fn payload: pass \[num_tokens, "
                                r"scale_dim=2\] torch.float32", lambda op, x, w, s, i: op.dispatch(x, w, None, i)),
    "scales_shape": (_fp8_op, r"scales must have shape \[6, 2\], got \[6, 3\]",
                     lambda op, x, w, s, i: op.dispatch(x, w, torch.zeros(6, 3), i)),
    "scales_rows": (_fp8_op, r"scales must have shape \[6, 2\], got \[5, 2\]",
                    lambda op, x, w, s, i: op.dispatch(x, w, s[:5].contiguous(), i)),
    "scales_dtype": (_fp8_op, "scales must be torch.float32, got torch.uint8",
                     lambda op, x, w, s, i: op.dispatch(x, w, s.to(torch.uint8), i)),
    "e8m0_scales_dtype": (lambda: _lp_single(dispatch_data_type=torch.float4_e2m1fn_x2,
                                             combine_data_type=torch.float32, scale_dim=8, scale_type_size=1),
                          "scales must be torch.uint8, got torch.float32",
                          lambda op, x, w, s, i: op.dispatch(x, w, s.float(), i)),
    "payload_dtype": (_fp8_op, "x must be torch.float8_e4m3fn, got torch.bfloat16",
                      lambda op, x, w, s, i: op.dispatch(torch.zeros(6, 256, dtype=torch.bfloat16), w, s, i)),
    "payload_fnuz_vs_ocp": (_fp8_op, "x must be torch.float8_e4m3fn, got torch.float8_e4m3fnuz",
                            lambda op, x, w, s, i: op.dispatch(x.view(torch.float8_e4m3fnuz), w, s, i)),
    "fp4_payload_width": (lambda: _lp_single(dispatch_data_type=torch.float4_e2m1fn_x2,
                                             combine_data_type=torch.bfloat16, scale_dim=8, scale_type_size=1),
                          r"x must have shape \[num_tokens, hidden_dim // 2=128 \(two torch.float4_e2m1fn_x2 "
                          r"values per byte\)\], got \(6, 256\)",
                          lambda op, x, w, s, i: op.dispatch(torch.zeros(6, 256, dtype=torch.uint8).view(x.dtype),
                                                             w, s, i)),
    "combine_payload_dtype": (_fp8_op, "expert_out must be torch.bfloat16, got torch.float8_e4m3fn",
                              lambda op, x, w, s, i: op.combine(torch.zeros(4, 256, dtype=torch.float8_e4m3fn),
                                                                routing=op.dispatch(x, w, s, i, True)[-1])),
    "quant_scales_given": (lambda: _lp_single(dispatch_quant_type="fp8_blockwise"),
                           r"scales must be None for a torch.bfloat16 payload \(dispatch_quant_type='fp8_blockwise' "
                           r"makes the scales\)",
                           lambda op, x, w, s, i: op.dispatch(x, w, torch.ones(6, 2), i)),
    "quant_x_dtype": (lambda: _lp_single(dispatch_quant_type="fp4_blockwise"), "x must be torch.bfloat16",
                      lambda op, x, w, s, i: op.dispatch(x.to(torch.float8_e4m3fn), w, None, i)),
    "quant_combine_dtype": (lambda: _lp_single(dispatch_quant_type="fp8_blockwise"),
                            "expert_out must be torch.bfloat16, got torch.float8_e4m3fn",
                            lambda op, x, w, s, i: op.combine(op.dispatch(x, w, None, i)[0], routing=op.dispatch(
                                x, w, None, i, True)[-1])),
}


@pytest.mark.parametrize("name", list(LP_BAD))
def test_low_precision_bad_inputs(name, no_env):
    make_op, pattern, call = LP_BAD[name]
    op = make_op()
    x, w, s, idx = _lp_args(op)
    with pytest.raises(InputError, match=pattern):
        call(op, x, w, s, idx)
    # the op stays usable: a correct dispatch + combine right after
    out, out_w, out_s, _, total, handle = op.dispatch(x, w, s, idx, return_routing=True)
    n = int(total)
    expert = torch.zeros(n, op.config.hidden_dim, dtype=op.config.combine_dtype)
    combined, _ = op.combine(expert, out_w[:n], routing=handle)
    assert combined.shape == (6, op.config.hidden_dim) and not combined.any()
