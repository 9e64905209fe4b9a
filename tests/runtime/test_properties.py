"""Property-based tests (hypothesis): config validation and the torch backend against a plain-torch oracle.

* Random configs, each field drawn from valid values or perturbed with wild ones (ints incl. 0,
  negatives and huge, floats incl. nan/inf, unsupported dtypes, unknown names, other types): a
  rejection is always a ConfigError that names a field; an accepted config keeps its invariants,
  and validity never depends on ``rank`` (every rank of a group decides the same).
* Random inputs through the torch backend with world_size=1 (in-process, no process group): an
  identity expert gives combine(dispatch(x)) == U*x, U = 1 when the token has a valid expert id and
  is among the first max_recv_tokens such tokens (the rest are dropped and counted), else 0 (plus the combine wire's encode/decode for quantized scatter combines); weights likewise.
* Random bad inputs raise InputError and leave the op usable.

Counts (examples, rows checked) go to the session ``property_stats`` counter, printed at the end.
"""

from __future__ import annotations

import collections
import math
import os
import pickle

import attrs
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.support.ep_oracle import wire_roundtrip
from runtime import ConfigError, EpDispatchCombineConfig, EpDispatchCombineOp, InputError
from runtime import config as rconfig
from runtime.agreement import config_summary

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# derandomized: the same 200 examples every run (a test that fails by chance is a defect). The strategy
# below is weighted towards valid values too, so that any seed gives enough of both outcomes (measured
# over 20 random seeds: 15 to 44 of 200 accepted, where the unweighted one went as low as 9 of the 10
# the test needs); it draws num_experts_per_token <= num_experts by construction, not by filtering
CONFIG_SETTINGS = settings(SETTINGS, max_examples=200, derandomize=True)
FIELDS = rconfig.FIELDS
SPECS = rconfig.load_specs()
BF16, FP32 = torch.bfloat16, torch.float32
ALL_DTYPES = sorted({getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}, key=str)
PAYLOAD = [rconfig.torch_dtype(n) for n in rconfig.PAYLOAD_DTYPES]


@pytest.fixture(scope="module", autouse=True)
def _no_backend_env():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(rconfig.BACKEND_ENV, raising=False)
        yield


# ---------------------------------------------------------------------------------------------
# Random configs
# ---------------------------------------------------------------------------------------------
NAMES = ["none", "gather", "scatter", "torch", "native", "auto", "v2", "v2_ll", "", "fp8", "bf16", "GATHER",
         "fp8_blockwise ", "fp6_blockwise", "cuda", *SPECS.quants]
WILD = st.one_of(
    st.integers(),
    st.integers(min_value=-2 ** 80, max_value=2 ** 80),
    st.sampled_from([0, -1, 1, 2, 3, 127, 128, 2 ** 31, 2 ** 63, 10 ** 30]),
    st.floats(),
    st.sampled_from([0.0, -0.0, 1.0, 30.0, math.nan, math.inf, -math.inf, 1e-300, 1e300]),
    st.text(max_size=8),
    st.sampled_from(NAMES),
    st.sampled_from(ALL_DTYPES),
    st.sampled_from([None, True, False, b"bf16", [1], (2,), {"a": 1}, object(), 1j, torch.device("cpu")]),
)


@st.composite
def valid_fields(draw) -> dict:
    """Values each valid on its own (the combination may still be rejected: quant combos, rules)."""
    ws = draw(st.sampled_from([1, 2, 4, 8] * 3 + [2 ** 40]))
    max_in = draw(st.sampled_from([st.integers(1, 4096)] * 7 + [st.just(2 ** 40)]).flatmap(lambda s: s))
    # weighted towards the common values, so that about a third of the drawn configs are accepted
    quant = draw(st.sampled_from(["none"] * len(SPECS.quants) + list(SPECS.quants)))
    dquant = draw(st.sampled_from(["none"] * 4 + list(rconfig.DISPATCH_QUANT_TYPES)))
    payload = draw(st.sampled_from([None] * 6 + [BF16, FP32, *PAYLOAD]))
    epr = draw(st.integers(1, 300))  # k <= num_experts by construction (no filtering)
    return dict(
        rank=draw(st.integers(0, ws - 1)),
        world_size=ws,
        hidden_dim=draw(st.sampled_from([1, 2, 32, 64, 100, 128, 256, 384, 4096, 7168, 2 ** 40])),
        max_num_inp_token_per_rank=max_in,
        num_experts_per_rank=epr,
        num_experts_per_token=draw(st.integers(1, min(16, ws * epr))),
        data_type=draw(st.sampled_from([BF16, FP32])),
        dispatch_data_type=payload,
        combine_data_type=None if payload is None else draw(st.sampled_from([BF16, FP32])),
        scale_dim=draw(st.sampled_from([0, 0, 1, 4, 56])) if payload in PAYLOAD else 0,
        scale_type_size=draw(st.sampled_from([0, 1, 4])) if payload in PAYLOAD else 0,
        combine_mode=draw(st.sampled_from([None, None, None, "gather", "scatter"])),
        quant_type=quant,
        dispatch_quant_type=dquant,
        enable_std_moe=draw(st.sampled_from([False] * 9 + [True])),
        max_total_recv_tokens=draw(st.one_of(st.just(0), st.integers(0, ws * max_in))),
        gpu_per_node=draw(st.sampled_from([0] * 6 + [ws, ws, 1, 2, 8])),
        internode_kernel=draw(st.sampled_from(list(rconfig.INTERNODE_KERNELS))),
        internode_auto_ll_max_tokens=draw(st.integers(1, 2 ** 20)),
        kernel_backend=draw(st.sampled_from([None, "torch", "native"])),
        timeout_s=draw(st.one_of(st.just(30.0), st.floats(1e-6, 1e9), st.integers(1, 10 ** 6))),
        expert_capacity=draw(st.one_of(st.just(0), st.integers(0, ws * max_in))),
        strict_capacity=draw(st.booleans()),
    )


@st.composite
def config_kwargs(draw) -> tuple[dict, str | None]:
    kw = draw(valid_fields())
    wild = draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))  # how many fields get a wild value
    for name in draw(st.lists(st.sampled_from(FIELDS), min_size=wild, max_size=wild, unique=True)):
        kw[name] = draw(WILD)
    env = draw(st.sampled_from([None] * 10 + ["", "torch", "native", "cuda", "Torch"]))
    return kw, env


def names_a_field(msg: str) -> bool:
    return "=" in msg or any(f in msg for f in FIELDS) or rconfig.BACKEND_ENV in msg


def make_config(kw: dict, env: str | None):
    """-> (config or None, ConfigError or None), with the backend environment variable set to env."""
    old = os.environ.pop(rconfig.BACKEND_ENV, None)
    if env is not None:
        os.environ[rconfig.BACKEND_ENV] = env
    try:
        return EpDispatchCombineConfig(**kw), None
    except ConfigError as e:  # anything else escapes and fails the test
        return None, e
    finally:
        os.environ.pop(rconfig.BACKEND_ENV, None)
        if old is not None:
            os.environ[rconfig.BACKEND_ENV] = old


def check_invariants(cfg: EpDispatchCombineConfig, env: str | None) -> None:
    ints = [f for f in FIELDS if attrs.fields_dict(EpDispatchCombineConfig)[f].type in ("int", int)]
    assert ints and all(type(getattr(cfg, f)) is int for f in ints), ints
    assert cfg.world_size > 0 and 0 <= cfg.rank < cfg.world_size
    assert 0 < cfg.max_recv_tokens <= cfg.world_size * cfg.max_num_inp_token_per_rank
    assert cfg.num_experts == cfg.world_size * cfg.num_experts_per_rank > 0
    assert cfg.num_experts_per_token > 0 and cfg.hidden_dim > 0
    assert cfg.resolved_combine_mode in ("gather", "scatter")
    if cfg.quant_type != "none":
        assert cfg.resolved_combine_mode == "scatter"
    assert cfg.quant_type in SPECS.quants and cfg.dispatch_quant_type in rconfig.DISPATCH_QUANT_TYPES
    assert cfg.data_type in (BF16, FP32) and cfg.combine_dtype in (BF16, FP32)
    assert cfg.dispatch_dtype in (BF16, FP32, *PAYLOAD)
    assert type(cfg.timeout_s) is float and math.isfinite(cfg.timeout_s) and cfg.timeout_s > 0
    for block in (cfg.dispatch_quant_block, cfg.combine_quant_block):
        assert block == 0 or cfg.hidden_dim % block == 0
    if cfg.prequantized:
        assert cfg.dispatch_quant_type == "none" and cfg.resolved_combine_mode == "gather"
        assert cfg.scale_dim > 0 and cfg.scale_type_size in (1, 4)
        assert cfg.dispatch_scales_dtype == (FP32 if cfg.scale_type_size == 4 else torch.uint8)
    else:
        assert cfg.scale_dim == cfg.scale_type_size == 0 and cfg.dispatch_scales_dtype is None
        assert cfg.dispatch_dtype == cfg.data_type == cfg.combine_dtype
    two_per_byte = cfg.dispatch_data_type == torch.float4_e2m1fn_x2
    assert cfg.dispatch_payload_cols * (2 if two_per_byte else 1) == cfg.hidden_dim
    assert cfg.is_internode == (cfg.world_size > cfg.resolved_gpu_per_node)
    assert cfg.world_size % cfg.resolved_gpu_per_node == 0
    if cfg.is_internode:  # gather only, no quantized wire, no std-MoE
        assert cfg.resolved_combine_mode == "gather" and cfg.quant_type == cfg.dispatch_quant_type == "none"
        assert not cfg.enable_std_moe and "intranode" not in cfg.topology_names
    else:
        assert cfg.topology_names == ("intranode",)
    assert cfg.world_size <= cfg.max_recv_tokens and 0 < cfg.resolved_expert_capacity <= cfg.max_recv_tokens
    assert type(cfg.enable_std_moe) is bool and type(cfg.strict_capacity) is bool
    expected_backend = env or cfg.kernel_backend or ("native" if torch.cuda.is_available() else "torch")
    assert cfg.resolved_backend == expected_backend in rconfig.KERNEL_BACKENDS
    # a value: hashable, equal to its copies, pickles
    assert cfg == attrs.evolve(cfg) and hash(cfg) == hash(attrs.evolve(cfg))
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and again.key == cfg.key


def test_random_configs(property_stats):
    seen = collections.Counter()

    @CONFIG_SETTINGS
    @given(config_kwargs())
    def prop(case):
        kw, env = case
        seen["examples"] += 1
        cfg, err = make_config(kw, env)
        ws, rank = kw.get("world_size"), kw.get("rank")
        other_rank = None  # validity must not depend on rank: every rank of a group decides alike
        if type(ws) is int and type(rank) is int and 0 <= rank < ws and ws > 1:
            other_rank = (rank + 1) % ws
        if err is not None:
            seen["rejected"] += 1
            assert isinstance(err, ValueError)
            msg = str(err)
            assert msg and names_a_field(msg), msg
            if other_rank is not None:
                cfg2, err2 = make_config({**kw, "rank": other_rank}, env)
                assert cfg2 is None and str(err2) == msg
            return
        seen["accepted"] += 1
        check_invariants(cfg, env)
        if other_rank is not None:
            cfg2, err2 = make_config({**kw, "rank": other_rank}, env)
            assert err2 is None, err2
            s1, s2 = config_summary(cfg), config_summary(cfg2)
            assert {k for k in s1 if s1[k] != s2[k]} == {"rank"}

    prop()
    # both outcomes are exercised, not just one
    assert seen["accepted"] >= 10 and seen["rejected"] >= 10, seen
    property_stats.update({f"configs {k}": v for k, v in seen.items()})


# ---------------------------------------------------------------------------------------------
# The torch backend, world_size=1, against a plain-torch oracle
# ---------------------------------------------------------------------------------------------
# (combine_mode, quant_type): plain gather/scatter and the scatter combine's wire formats
COMBINES = [(None, "none"), ("gather", "none"), ("scatter", "none"), (None, "fp8_direct_cast"),
            (None, "fp8_blockwise"), (None, "fp4_blockwise")]


@st.composite
def op_case(draw):
    combine_mode, quant = draw(st.sampled_from(COMBINES))
    block = SPECS.quants[quant].block
    hidden = draw(st.sampled_from([128, 256]) if block else st.sampled_from([1, 2, 3, 16, 64, 128]))
    max_in = draw(st.integers(1, 48))
    k = draw(st.integers(1, 8))  # one rank: k <= num_experts_per_rank by construction
    cfg_kw = dict(rank=0, world_size=1, hidden_dim=hidden, max_num_inp_token_per_rank=max_in,
                  num_experts_per_rank=draw(st.integers(k, 9)), num_experts_per_token=k,
                  data_type=draw(st.sampled_from([BF16, FP32])), combine_mode=combine_mode, quant_type=quant,
                  max_total_recv_tokens=draw(st.one_of(st.just(0), st.integers(1, max_in))),
                  kernel_backend="torch", timeout_s=draw(st.sampled_from([30.0, 0.5])))
    return cfg_kw


@st.composite
def token_batch(draw, cfg: EpDispatchCombineConfig, num_tokens=None):
    """(x, weights or None, indices): ids uniform in [0, num_experts), some repeated within a row, some
    -1 (and rarely other negative ids, also 'no expert')."""
    n = draw(st.integers(0, cfg.max_num_inp_token_per_rank)) if num_tokens is None else num_tokens
    k, e = cfg.num_experts_per_token, cfg.num_experts
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 32 - 1)))
    p_none, p_repeat = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])), draw(st.sampled_from([0.0, 0.3, 0.9]))
    idx = torch.randint(0, e, (n, k), generator=gen)
    rep = torch.rand(n, k, generator=gen) < p_repeat
    for j in range(1, k):
        idx[:, j] = torch.where(rep[:, j], idx[:, j - 1], idx[:, j])
    neg = draw(st.sampled_from([-1, -1, -1, -2, -(2 ** 31)]))
    idx = torch.where(torch.rand(n, k, generator=gen) < p_none, neg, idx).to(torch.int32)
    if n and draw(st.booleans()):  # pin the edges: the largest valid id, and a row with none
        idx[draw(st.integers(0, n - 1)), draw(st.integers(0, k - 1))] = e - 1
        idx[draw(st.integers(0, n - 1))] = -1
    scale = draw(st.sampled_from([1.0, 1e-3, 1e3]))
    x = (torch.randn(n, cfg.hidden_dim, generator=gen) * scale).to(cfg.data_type)
    w = torch.rand(n, k, generator=gen) if draw(st.booleans()) else None
    return x, w, idx


def oracle(cfg, x, w, idx):
    """Plain torch: which tokens a world-1 op receives (the first max_recv_tokens of those with a valid
    expert id; the rest are dropped), and what the identity combine returns."""
    valid = (idx >= 0).any(dim=1)  # world 1: a token goes to rank 0 iff it has any expert id >= 0
    kept = valid & (torch.cumsum(valid.int(), 0) <= cfg.max_recv_tokens)
    u = kept.to(torch.float32).unsqueeze(1)
    quant = cfg.quant_type if cfg.resolved_combine_mode == "scatter" else "none"
    decoded = wire_roundtrip(x, quant) if x.shape[0] else x.float()
    combined = (u * decoded + 0.0).to(cfg.combine_dtype)  # 0.0 + row (or nothing), one rounding
    return kept, int(valid.sum()) - int(kept.sum()), combined, (u * w if w is not None else None)


def round_trip(op, x, w, idx, via_view: bool) -> int:
    """dispatch + identity expert + combine, checked against the oracle; -> rows checked."""
    cfg = op.config
    valid, dropped, expect, expect_w = oracle(cfg, x, w, idx)
    n = int(valid.sum())
    out, out_w, out_s, out_i, total, handle = op.dispatch(x, w, None, idx, return_routing=True)
    assert int(op.dropped_count()) == dropped and op.dropped_count().dtype == torch.int32
    assert out.shape == (cfg.max_recv_tokens, cfg.hidden_dim) and out.dtype == cfg.data_type and out_s is None
    assert total.tolist() == [n] and handle.num_tokens == x.shape[0]
    assert handle.recv_src.tolist() == [[0, t] for t in valid.nonzero().flatten().tolist()]
    assert torch.equal(out[:n], x[valid]) and torch.equal(out_i[:n], idx[valid])
    assert not out_i[n:].ne(-1).any() and not out[n:].any()  # nothing written past the kept rows
    if w is None:
        assert out_w is None
    else:
        assert torch.equal(out_w[:n], w[valid])
    expert_out = out
    if via_view:
        expert_out = op.combine_in_view()
        expert_out[:n] = out[:n]
    combined, combined_w = op.combine(expert_out, out_w, routing=handle)
    assert combined.dtype == cfg.combine_dtype and combined.shape == x.shape
    assert torch.equal(combined, expect), (combined - expect).abs().max()
    if w is None:
        assert combined_w is None
    else:
        assert torch.equal(combined_w, expect_w)
    return n + x.shape[0] + dropped


def test_torch_backend_identity(property_stats):
    seen = collections.Counter()

    @SETTINGS
    @given(st.data(), op_case())
    def prop(data, cfg_kw):
        try:
            cfg = EpDispatchCombineConfig(**cfg_kw)
        except ConfigError:
            assume(False)
        seen["examples"] += 1
        with EpDispatchCombineOp(cfg) as op:
            for _ in range(data.draw(st.integers(1, 3))):  # a few rounds on one op
                x, w, idx = data.draw(token_batch(cfg))
                rows = round_trip(op, x, w, idx, data.draw(st.booleans()))
                seen["rounds"] += 1
                seen["rows checked"] += rows
                seen["rows dropped on receive"] += int(op.dropped_count())

    prop()
    assert seen["rows checked"] > 1000, seen
    property_stats.update({f"torch identity {k}": v for k, v in seen.items()})


# ---------------------------------------------------------------------------------------------
# Random bad inputs -> InputError, op still usable
# ---------------------------------------------------------------------------------------------
OTHER_DTYPES = [torch.float16, torch.float64, torch.int32, torch.int64, torch.uint8, torch.bool,
                torch.float8_e4m3fn, BF16, FP32]


def _noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values, not contiguous (needs t.dim() == 2 with both sizes >= 2)."""
    out = torch.cat([t, t], dim=1)[:, ::2]
    assert not out.is_contiguous()
    return out


def _bad_dispatch(data, cfg, x, w, idx):
    """A random bad dispatch call (a thunk) for these valid arguments, with a short description."""
    n, h, k = x.shape[0], cfg.hidden_dim, cfg.num_experts_per_token
    kinds = ["x_dtype", "x_cols", "x_ndim", "x_device", "x_type", "too_many_tokens", "idx_dtype", "idx_shape",
             "idx_type", "w_dtype", "w_shape", "scales", "return_routing"]
    if n:
        kinds += ["id_too_big", "id_too_big"]
    if n >= 2 and h >= 2:
        kinds.append("x_noncontig")
    if n >= 2 and k >= 2:
        kinds += ["idx_noncontig", "w_noncontig"]
    kind = data.draw(st.sampled_from(kinds))
    d = cfg.data_type
    w = w if w is not None else torch.rand(n, k)
    if kind == "x_dtype":
        return kind, lambda op: op.dispatch(x.to(data.draw(st.sampled_from([t for t in OTHER_DTYPES if t != d]))),
                                            w, None, idx)
    if kind == "x_cols":
        cols = data.draw(st.integers(0, h + 5).filter(lambda c: c != h))
        return kind, lambda op: op.dispatch(torch.zeros(n, cols, dtype=d), w, None, idx)
    if kind == "x_ndim":
        bad = data.draw(st.sampled_from([x.reshape(-1), x.unsqueeze(0), torch.zeros((), dtype=d)]))
        return kind, lambda op: op.dispatch(bad, w, None, idx)
    if kind == "x_device":
        return kind, lambda op: op.dispatch(x.to("meta"), w, None, idx)
    if kind == "x_type":
        bad = data.draw(st.sampled_from([x.tolist(), None, 3, "x"]))
        return kind, lambda op: op.dispatch(bad, w, None, idx)
    if kind == "x_noncontig":
        return kind, lambda op: op.dispatch(_noncontig(x), w, None, idx)
    if kind == "too_many_tokens":
        m = cfg.max_num_inp_token_per_rank + data.draw(st.integers(1, 3))
        return kind, lambda op: op.dispatch(torch.zeros(m, h, dtype=d), torch.rand(m, k), None,
                                            torch.zeros(m, k, dtype=torch.int32))
    if kind == "id_too_big":
        bad = idx.clone()
        bad[data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, k - 1))] = data.draw(
            st.one_of(st.just(cfg.num_experts), st.integers(cfg.num_experts, 2 ** 31 - 1)))
        return kind, lambda op: op.dispatch(x, w, None, bad)
    if kind == "idx_dtype":
        t = data.draw(st.sampled_from([torch.int64, torch.int16, torch.float32, torch.uint8]))
        return kind, lambda op: op.dispatch(x, w, None, idx.clamp(min=0).to(t))
    if kind == "idx_shape":
        shape = data.draw(st.sampled_from([(n, k + 1), (n + 1, k), (n, max(k - 1, 0) if k > 1 else 2), (n * k,)]))
        return kind, lambda op: op.dispatch(x, w, None, torch.zeros(shape, dtype=torch.int32))
    if kind == "idx_type":
        return kind, lambda op: op.dispatch(x, w, None, idx.tolist())
    if kind == "idx_noncontig":
        return kind, lambda op: op.dispatch(x, w, None, _noncontig(idx))
    if kind == "w_dtype":
        return kind, lambda op: op.dispatch(x, w.to(data.draw(st.sampled_from([BF16, torch.float64]))), None, idx)
    if kind == "w_shape":
        return kind, lambda op: op.dispatch(x, torch.rand(n, k + 1), None, idx)
    if kind == "w_noncontig":
        return kind, lambda op: op.dispatch(x, _noncontig(w), None, idx)
    if kind == "scales":
        return kind, lambda op: op.dispatch(x, w, torch.ones(n, 1), idx)
    if kind == "return_routing":
        return kind, lambda op: op.dispatch(x, w, None, idx, return_routing=data.draw(st.sampled_from([1, "yes"])))
    raise AssertionError(kind)


def _bad_combine(data, cfg, op, other, x, w, idx):
    """A random bad combine call after a valid dispatch on op (and one on the other op)."""
    out, out_w, _, _, total, handle = op.dispatch(x, w, None, idx, return_routing=True)
    other_handle = other.dispatch(x, w, None, idx, return_routing=True)[-1]
    n, h, rows = int(total), cfg.hidden_dim, cfg.max_recv_tokens
    kinds = ["no_routing", "not_handle", "other_op", "dtype", "cols", "too_many_rows", "w_dtype", "idx_shape"]
    if n:
        kinds.append("too_few_rows")
    if rows >= 2 and h >= 2:
        kinds.append("noncontig")
    kind = data.draw(st.sampled_from(kinds))
    d = cfg.combine_dtype
    call = {
        "no_routing": lambda op: op.combine(out, out_w),
        "not_handle": lambda op: op.combine(out, out_w, routing={"op_uid": op.uid}),
        "other_op": lambda op: op.combine(out, out_w, routing=other_handle),
        "dtype": lambda op: op.combine(out.to(FP32 if d == BF16 else BF16), out_w, routing=handle),
        "cols": lambda op: op.combine(torch.zeros(rows, h + 1, dtype=d), out_w, routing=handle),
        "too_many_rows": lambda op: op.combine(torch.zeros(rows + 1, h, dtype=d), routing=handle),
        "too_few_rows": lambda op: op.combine(out[:n - 1], routing=handle),
        "noncontig": lambda op: op.combine(_noncontig(out), routing=handle),
        "w_dtype": lambda op: op.combine(out, torch.zeros(rows, cfg.num_experts_per_token, dtype=torch.float64),
                                         routing=handle),
        "idx_shape": lambda op: op.combine(out, None, torch.zeros(rows, cfg.num_experts_per_token + 1,
                                                                  dtype=torch.int32), routing=handle),
    }[kind]
    return "combine_" + kind, call


def test_bad_inputs_keep_op_usable(property_stats):
    seen = collections.Counter()

    @SETTINGS
    @given(st.data(), op_case())
    def prop(data, cfg_kw):
        try:
            cfg = EpDispatchCombineConfig(**{**cfg_kw, "max_total_recv_tokens": 0})
        except ConfigError:
            assume(False)
        seen["examples"] += 1
        op, other = EpDispatchCombineOp(cfg), EpDispatchCombineOp(cfg)
        for _ in range(data.draw(st.integers(1, 3))):
            x, w, idx = data.draw(token_batch(cfg))
            if data.draw(st.booleans()):
                kind, call = _bad_dispatch(data, cfg, x, w, idx)
            else:
                kind, call = _bad_combine(data, cfg, op, other, x, w, idx)
            with pytest.raises(InputError) as err:
                call(op)
            assert str(err.value).startswith(("dispatch: ", "combine: ")), err.value
            seen[f"bad {kind}"] += 1
            seen["bad calls"] += 1
            # still usable: a correct round right after
            x, w, idx = data.draw(token_batch(cfg))
            seen["rows checked"] += round_trip(op, x, w, idx, False)
        op.close()
        other.close()

    prop()
    assert seen["bad calls"] >= 100, seen
    property_stats.update({f"bad inputs {k}": v for k, v in seen.items() if not k.startswith("bad ")}
                          | {"bad inputs calls": seen["bad calls"]})
    property_stats["bad input kinds seen"] += sum(1 for k in seen if k.startswith("bad ") and k != "bad calls")
