"""The grouped-GEMM layout (op.grouped_layout / dispatch_grouped / combine_grouped) on the torch backend,
against the plain-python oracle of tests/support/grouped_oracle.py: gloo ranks at W = 1, 2, 4 through
tests/support/ep_dist.py.

Payloads bf16, fp32, fp8 pre-quantized (bytes and fp32 scales verbatim), fp8_blockwise and fp4_blockwise
(quantized in dispatch); the buffer's capacity (pairs past it dropped and counted), the receive cap, routing
replay, weighted and unweighted combine, and the combine's bits against combine() of the oracle's rows (the
numerics of convert_combine_input, runtime/moe.py) and against the standard-MoE path itself.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.ep_dist import get_world, shutdown_all
from tests.support.ep_oracle import expected_received, experts_per_rank_for, make_inputs
from tests.support.configs import make_config
from tests.support.grouped_oracle import MODE_FIELDS, check_layout, combine_input, expert_rows
from runtime import ConfigError, EpDispatchCombineConfig, EpDispatchCombineOp, InputError, grouped

T, K, EPR = 12, 4, 3


def _epr(world):
    return experts_per_rank_for(K, world, EPR)


EPR1 = _epr(1)  # one rank holds all the experts: K of them
HIDDEN = {"bf16": 32, "fp32": 32, "fp8": 32, "fp8_blockwise": 128, "fp4_blockwise": 64}
MODES = {mode: (HIDDEN[mode], MODE_FIELDS[mode]) for mode in HIDDEN}  # mode: (hidden, config fields)


def _cfg(rank, world, mode, **kw):
    hidden, fields = MODES[mode]
    return make_config(rank, world, hidden_dim=hidden, max_num_inp_token_per_rank=T, num_experts_per_rank=EPR,
                       num_experts_per_token=K, enable_grouped_layout=True, **fields, **kw)


def _inputs(seed, rank, n, mode, num_experts):
    hidden, fields = MODES[mode]
    x, w, idx = make_inputs(seed, rank, n, hidden, K, num_experts, fields.get("data_type", torch.bfloat16))
    scales = None
    if mode == "fp8":
        x = x.float().to(torch.float8_e4m3fn)
        scales = (torch.arange(n * 2, dtype=torch.float32).view(n, 2) + 1 + 100 * rank) / 8
    return x, w, scales, idx


def scn_grouped(rank, world, mode, align, capacity, recv_cap, use_weights, seed):
    """One grouped round (and its replay) against the oracle; -> (kept pairs, dropped) here."""
    cfg = _cfg(rank, world, mode, expert_alignment=align, grouped_capacity=capacity, max_total_recv_tokens=recv_cap)
    counts = [T - 2 * r for r in range(world)]
    inputs = [_inputs(seed, r, counts[r], mode, cfg.num_experts) for r in range(world)]
    x, w, s, idx = inputs[rank]
    w = w if use_weights else None
    epr = cfg.num_experts_per_rank
    with EpDispatchCombineOp(cfg) as op:
        P = cfg.resolved_grouped_capacity
        out, out_w, out_s, out_i, total, h = op.dispatch(x, w, s, idx, return_routing=True)
        received = expected_received([i for *_, i in inputs], rank, epr)[:cfg.max_recv_tokens]
        rows_idx = [inputs[src][3][t].tolist() for src, t in received]
        layout = op.grouped_layout()
        kept = check_layout(layout, out, out_s, out_w, rows_idx, rank, epr, K, align, P)
        dropped = int(layout.dropped)
        y = expert_rows(layout, mode, cfg.combine_dtype, rank * epr)
        for apply in (True, False):
            got, got_w = op.combine_grouped(y, h, apply_weights=apply)
            assert got_w is None and got.dtype == cfg.combine_dtype
            want_in = combine_input(y, layout, out_w, cfg.max_recv_tokens, K, cfg.combine_dtype, apply)
            want, _ = op.combine(want_in, routing=h)
            assert torch.equal(got, want), (apply, (got.float() - want.float()).abs().max())
            assert not got.isnan().any()  # no padding row (NaN) was read

        # routing replay (same ids, new rows and weights): the handle's rows, the same groups
        x2, w2, s2, _ = _inputs(seed + 1, rank, counts[rank], mode, cfg.num_experts)
        layout2, h2 = op.dispatch_grouped(x2, w2 if use_weights else None, s2, idx, routing=h)
        assert torch.equal(layout2.offs, layout.offs) and torch.equal(layout2.src, layout.src)
        out2 = op._last["out"]
        real = (layout2.src >= 0).nonzero().squeeze(1)
        rows2 = layout2.src[real].long() // K
        assert torch.equal(layout2.x.view(torch.uint8)[real], out2.view(torch.uint8)[rows2])
        y2 = expert_rows(layout2, mode, cfg.combine_dtype, rank * epr)
        got2, _ = op.combine_grouped(y2, h2)
        want2, _ = op.combine(combine_input(y2, layout2, op._last["out_w"], cfg.max_recv_tokens, K, cfg.combine_dtype,
                                            True), routing=h2)
        assert torch.equal(got2, want2)
    return kept, dropped


def scn_std_parity(rank, world, dtype, seed):
    """combine_grouped and the standard-MoE path (convert_dispatch_output / convert_combine_input) give the
    same bits for the same expert function."""
    cfg = _cfg(rank, world, "bf16" if dtype == torch.bfloat16 else "fp32", enable_std_moe=True, expert_alignment=8)
    inputs = [_inputs(seed, r, T, "bf16", cfg.num_experts) for r in range(world)]
    x, w, _, idx = inputs[rank]
    x = x.to(dtype)
    epr = cfg.num_experts_per_rank
    with EpDispatchCombineOp(cfg) as op:
        layout, h = op.dispatch_grouped(x, w, None, idx)
        assert int(layout.dropped) == 0
        y = expert_rows(layout, "bf16", dtype, rank * epr)
        got, _ = op.combine_grouped(y, h)
        px, pc, psrc, pw = op.convert_dispatch_output()
        e = torch.arange(epr)[:, None].expand(epr, px.shape[1]) + rank * epr
        ys = (((e % 4 + 1).float() / 4)[..., None] * px.float() + ((e % 7 - 3).float() / 8)[..., None]).to(dtype)
        want, _ = op.combine(op.convert_combine_input(ys, h), routing=h)
        assert torch.equal(got, want)
    return True


@pytest.fixture(scope="module", autouse=True)
def _worlds():
    yield
    shutdown_all()


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("mode,align,capacity,recv_cap,use_weights", [
    ("bf16", 16, 0, 0, True),
    ("bf16", 4, 16, 0, True),          # capacity below the pairs: the last experts' last pairs dropped
    ("fp8", 8, 0, 0, True),
    ("fp8_blockwise", 1, 0, 0, False),
    ("fp32", 128, 256, 0, True),      # DeepGEMM's alignment, one group fills the buffer
])
def test_grouped_round(world, mode, align, capacity, recv_cap, use_weights):
    res = get_world(world).run(scn_grouped, mode, align, capacity, recv_cap, use_weights, 7)
    kept, dropped = (sum(v) for v in zip(*res))
    assert kept > 0
    if capacity == 0:
        assert dropped == 0  # the worst case holds every pair
    if capacity == 16:
        assert dropped > 0, "the small buffer dropped nothing: the drop rule went untested"


@pytest.mark.parametrize("mode,recv_cap", [("bf16", 7), ("fp4_blockwise", 0)])
def test_grouped_with_receive_cap_and_fp4(mode, recv_cap):
    get_world(2).run(scn_grouped, mode, 16, 0, recv_cap, True, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_matches_std_moe(dtype):
    assert all(get_world(2).run(scn_std_parity, dtype, 5))


def test_grouped_bad_inputs(monkeypatch):
    monkeypatch.delenv("EPGEN_KERNEL_BACKEND", raising=False)
    with pytest.raises(ConfigError, match=r"^expert_alignment=0: must be positive"):
        _cfg(0, 1, "bf16", expert_alignment=0)
    with pytest.raises(ConfigError, match=r"^expert_alignment=2048: must be at most 1024"):
        _cfg(0, 1, "bf16", expert_alignment=2048)
    with pytest.raises(ConfigError, match=r"^grouped_capacity=20: must be a multiple of expert_alignment=16"):
        _cfg(0, 1, "bf16", grouped_capacity=20)
    worst = _cfg(0, 1, "bf16").worst_case_grouped_rows
    assert worst == (T * K + EPR1 * 15) // 16 * 16
    with pytest.raises(ConfigError, match=rf"^grouped_capacity={worst + 16}: must be <= the worst case {worst}"):
        _cfg(0, 1, "bf16", grouped_capacity=worst + 16)
    with pytest.raises(ConfigError, match="enable_grouped_layout=True: the grouped layout is intranode only"):
        _cfg(0, 4, "bf16", gpu_per_node=2)
    plain = EpDispatchCombineOp(EpDispatchCombineConfig(rank=0, world_size=1, hidden_dim=32, max_num_inp_token_per_rank=T,
                                                        num_experts_per_rank=EPR1, num_experts_per_token=K,
                                                        kernel_backend="torch"))
    with pytest.raises(InputError, match="^grouped_layout: the grouped layout requires enable_grouped_layout=True"):
        plain.grouped_layout()
    op, other = EpDispatchCombineOp(_cfg(0, 1, "bf16")), EpDispatchCombineOp(_cfg(0, 1, "bf16"))
    with pytest.raises(InputError, match="^grouped_layout: no dispatch yet"):
        op.grouped_layout()
    x, w, _, idx = _inputs(1, 0, 6, "bf16", EPR1)
    *_, h = op.dispatch(x, w, None, idx, return_routing=True)
    y = torch.zeros(op.config.resolved_grouped_capacity, 32, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="call grouped_layout"):
        op.combine_grouped(y, h)
    layout = op.grouped_layout()
    with pytest.raises(InputError, match="from another op"):
        op.combine_grouped(y, other.dispatch_grouped(x, w, None, idx)[1])
    with pytest.raises(InputError, match=r"expert_out must have shape \[96, 32\], got \[8, 32\]"):
        op.combine_grouped(y[:8].contiguous(), h)
    with pytest.raises(InputError, match="expert_out must be torch.bfloat16"):
        op.combine_grouped(y.float(), h)
    with pytest.raises(InputError, match="apply_weights must be a bool"):
        op.combine_grouped(y, h, apply_weights=1)
    h2 = op.dispatch(x, w, None, idx, return_routing=True)[-1]
    with pytest.raises(InputError, match="call grouped_layout"):
        op.combine_grouped(y, h2)  # the new dispatch made the old layout stale
    op.grouped_layout()
    with pytest.raises(InputError, match="not from the dispatch that grouped_layout"):
        op.combine_grouped(y, h)
    assert op.combine_grouped(y, h2)[0].shape == (6, 32) and layout.rows == 96
    for o in (op, other, plain):
        o.close()


def test_dispatch_grouped_into_the_callers_tensor(monkeypatch):
    """out_x: the layout's x is the caller's tensor (the same rows as the op's own layout, rows without a pair
    zeroed whatever it held); a tensor of another shape, dtype or layout is refused with the call's message."""
    monkeypatch.delenv("EPGEN_KERNEL_BACKEND", raising=False)
    with EpDispatchCombineOp(_cfg(0, 1, "bf16")) as op:
        x, w, _, idx = _inputs(1, 0, 6, "bf16", EPR1)
        shape, dtype = op.grouped_x_spec()
        assert shape == (op.config.resolved_grouped_capacity, 32) and dtype == torch.bfloat16
        own, h = op.dispatch_grouped(x, w, None, idx)
        own_x = own.x.clone()
        out = torch.full(shape, float("nan"), dtype=dtype)
        lay, _ = op.dispatch_grouped(x, w, None, idx, out_x=out, routing=h)
        assert lay.x is out and torch.equal(out, own_x)
        assert bool((out[lay.src < 0] == 0).all()) and int((lay.src < 0).sum()) > 0
        for bad, message in ((torch.empty(shape, dtype=torch.float32), "out_x must be torch.bfloat16"),
                             (torch.empty((8, 32), dtype=dtype), r"out_x must have shape \[96, 32\], got \[8, 32\]"),
                             (torch.empty((32, 96), dtype=dtype).t(), "out_x must be contiguous"),
                             ([0.0], "out_x must be a torch.Tensor, got list")):
            with pytest.raises(InputError, match=rf"^dispatch_grouped: {message}"):
                op.dispatch_grouped(x, w, None, idx, out_x=bad)


NAMES = ("x", "offs", "counts", "src", "m_indices", "weights", "dropped", "pair_pos")


def test_a_fresh_layout_is_the_calls_own(monkeypatch):
    """fresh=True: the same layout as the op's own, every tensor the call's (the int32 ones views of one block, in
    grouped.block_parts' order), untouched by the next dispatch; a fresh that is not a bool is refused."""
    monkeypatch.delenv("EPGEN_KERNEL_BACKEND", raising=False)
    with EpDispatchCombineOp(_cfg(0, 1, "bf16")) as op:
        x, w, _, idx = _inputs(1, 0, 6, "bf16", EPR1)
        own, h = op.dispatch_grouped(x, w, None, idx)
        own = {n: getattr(own, n).clone() for n in NAMES}
        lay, h2 = op.dispatch_grouped(x, w, None, idx, fresh=True)
        assert lay.block is not None and lay.block.dtype == torch.int32
        parts = (lay.offs, lay.counts, lay.src, lay.m_indices, lay.dropped, lay.pair_pos)
        assert [p.data_ptr() for p in parts] == [p.data_ptr() for p in grouped.block_parts(lay.block, EPR1, lay.rows)]
        assert lay.block.numel() == grouped.block_size(EPR1, lay.rows, op.config.max_recv_tokens * op.config.num_experts_per_token)
        for n in NAMES:
            assert torch.equal(getattr(lay, n), own[n]), n
        kept = {n: getattr(lay, n).clone() for n in NAMES}
        other, _ = op.dispatch_grouped(x[:2], w[:2], None, idx[:2])  # the op's buffers move on, the fresh layout not
        assert not torch.equal(other.src, kept["src"])
        for n in NAMES:
            assert torch.equal(getattr(lay, n), kept[n]), n
        with pytest.raises(InputError, match="^dispatch_grouped: fresh must be a bool, got int$"):
            op.dispatch_grouped(x, w, None, idx, fresh=1)


def test_grouped_empty_dispatch(monkeypatch):
    monkeypatch.delenv("EPGEN_KERNEL_BACKEND", raising=False)
    with EpDispatchCombineOp(_cfg(0, 1, "bf16")) as op:
        x, w, _, idx = _inputs(1, 0, 0, "bf16", EPR1)
        layout, h = op.dispatch_grouped(x, w, None, idx)
        assert layout.offs.tolist() == [0] * EPR1 and not layout.counts.any() and int(layout.dropped) == 0
        assert bool((layout.src == -1).all()) and bool((layout.m_indices == -1).all())
        y = torch.zeros(layout.rows, 32, dtype=torch.bfloat16)
        assert op.combine_grouped(y, h)[0].shape == (0, 32)


def test_grouped_memory_formula(monkeypatch):
    """The grouped buffer's size (docs/RUNTIME.md, Memory): P*(wire_row + scale_row) + 12P + 8Rk + 12E + 4."""
    from runtime.op import native_workspace

    monkeypatch.delenv("EPGEN_KERNEL_BACKEND", raising=False)
    up = lambda n: -(-n // 256) * 256  # noqa: E731
    cfg = _cfg(0, 1, "fp8_blockwise")  # H = 128: fp8 rows of 128 bytes, one fp32 scale each
    R, P = cfg.max_recv_tokens, cfg.resolved_grouped_capacity
    assert P == (R * K + EPR1 * 15) // 16 * 16 == cfg.worst_case_grouped_rows
    nat = native_workspace(cfg)["regions"]
    assert (nat["grouped_x"], nat["grouped_scales"], nat["grouped_meta"]) == \
        (up(P * 128), up(P * 4), up(12 * P + 8 * R * K + 12 * EPR1 + 4))
    with EpDispatchCombineOp(_cfg(0, 1, "bf16", grouped_capacity=32)) as op:
        buf = op.memory_report()["buffers"]
        assert (buf["grouped_x"], buf["grouped_scales"], buf["grouped_meta"]) == (32 * 64, 0, 12 * 32 + 8 * R * K + 12 * EPR1 + 4)
    plain = EpDispatchCombineConfig(rank=0, world_size=1, hidden_dim=32, max_num_inp_token_per_rank=T,
                                    num_experts_per_rank=EPR1, num_experts_per_token=K, kernel_backend="torch")
    assert "grouped_x" not in native_workspace(plain)["regions"]


def test_grouped_out_view_and_no_fused_form(monkeypatch):
    """grouped_out_view is a [P, H] buffer of the op's own that combine_grouped takes like any other tensor (the
    same bits); the fused form of combine_grouped is gone with its config field (an unknown keyword) and its
    workspace regions."""
    from runtime.op import native_workspace

    monkeypatch.delenv("EPGEN_KERNEL_BACKEND", raising=False)
    with pytest.raises(TypeError, match="grouped_combine"):
        _cfg(0, 1, "bf16", grouped_combine="fused")
    x, w, _, idx = _inputs(3, 0, 9, "bf16", EPR1)
    with EpDispatchCombineOp(_cfg(0, 1, "bf16")) as op:
        layout, h = op.dispatch_grouped(x, w, None, idx)
        y = expert_rows(layout, "bf16", torch.bfloat16, 0)
        view = op.grouped_out_view()
        assert view.shape == (op.config.resolved_grouped_capacity, 32) and view.dtype == torch.bfloat16
        assert op.grouped_out_view() is view and view.data_ptr() != y.data_ptr()
        view.copy_(y)
        assert torch.equal(op.combine_grouped(view, h)[0], op.combine_grouped(y, h)[0])
    regions = native_workspace(_cfg(0, 1, "bf16"))["regions"]
    assert "grp_y" not in regions and "grp_pos" not in regions


def test_grouped_layout_init_is_its_fields():
    """GroupedLayout's own __init__ (one dict store per field, for the eager path's host time) takes exactly the
    dataclass's fields, in their order, with their defaults, stores each as given, and keeps the instance frozen."""
    import dataclasses
    import inspect

    fields = dataclasses.fields(grouped.GroupedLayout)
    params = list(inspect.signature(grouped.GroupedLayout.__init__).parameters.values())[1:]
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields):
        want = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert p.default == want, f.name
    values = {f.name: object() for f in fields}
    layout = grouped.GroupedLayout(**values)
    assert all(getattr(layout, name) is v for name, v in values.items())
    assert vars(layout).keys() == values.keys()
    again = dataclasses.replace(layout, seq=7)
    assert again.seq == 7 and again.x is values["x"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.x = None
