"""grouped_dequantize: the grouped layout of an fp8_blockwise / fp4_blockwise dispatch with its rows decoded
into data_type (torch backend, gloo ranks at W = 1 and 2 through tests/support/ep_dist.py).

Each round dispatches the same tokens through two ops, one with grouped_dequantize and one without, and
checks that the decoded layout is the plain layout with every kept row dequantized by runtime.numerics
(bit for bit), the same groups, no scales; that combine_grouped of the decoded rows gives the bits of
combine_grouped of the plain rows decoded by hand; the config errors; and the memory formula.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.ep_dist import get_world, shutdown_all
from tests.support.configs import make_config
from tests.support.ep_oracle import make_inputs
from runtime import ConfigError, EpDispatchCombineConfig, EpDispatchCombineOp, numerics

T, K, EPR = 12, 4, 4  # k <= the experts of one rank
HIDDEN = {"fp8_blockwise": 256, "fp4_blockwise": 64}


def _cfg(rank, world, quant, dtype=torch.bfloat16, **kw):
    return make_config(rank, world, hidden_dim=HIDDEN[quant], max_num_inp_token_per_rank=T, num_experts_per_rank=EPR,
                       num_experts_per_token=K, data_type=dtype, dispatch_quant_type=quant, enable_grouped_layout=True,
                       **kw)


def _decode(x, scales, quant):
    if quant == "fp8_blockwise":
        return numerics.dequantize_fp8(x.view(torch.uint8), scales, "ocp", "fp8_blockwise", torch.float32)
    return numerics.dequantize_fp4(x, scales, torch.float32)


def scn_dequantized(rank, world, quant, dtype, capacity, seed):
    """One round through a plain and a dequantizing op; -> kept rows here."""
    plain_cfg = _cfg(rank, world, quant, dtype, grouped_capacity=capacity)
    dq_cfg = _cfg(rank, world, quant, dtype, grouped_capacity=capacity, grouped_dequantize=True)
    x, w, idx = make_inputs(seed, rank, T - rank, HIDDEN[quant], K, plain_cfg.num_experts, dtype)
    with EpDispatchCombineOp(plain_cfg) as plain_op, EpDispatchCombineOp(dq_cfg) as dq_op:
        plain, hp = plain_op.dispatch_grouped(x, w, None, idx)
        dq, hd = dq_op.dispatch_grouped(x, w, None, idx)
        P, H = dq_cfg.resolved_grouped_capacity, dq_cfg.hidden_dim
        assert dq.scales is None and dq.x.dtype == dtype and tuple(dq.x.shape) == (P, H)
        assert plain.scales is not None and plain.x.dtype != dtype
        for name in ("offs", "counts", "src", "m_indices", "weights", "dropped"):
            assert torch.equal(getattr(dq, name), getattr(plain, name)), name
        real = (plain.src >= 0).nonzero().squeeze(1)
        want = _decode(plain.x[real], plain.scales[real], quant).to(dtype)
        assert torch.equal(dq.x[real].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
        assert want.abs().sum() > 0  # the rows carry values: a layout of zeros would not pass
        # identity experts: the decoded rows, and the plain rows decoded by hand, combine to the same bits
        y_dq = dq.x.to(dq_cfg.combine_dtype)
        y_plain = _decode(plain.x, plain.scales, quant).to(dtype).to(plain_cfg.combine_dtype)
        got, _ = dq_op.combine_grouped(y_dq, hd)
        ref, _ = plain_op.combine_grouped(y_plain, hp)
        assert torch.equal(got, ref), (got.float() - ref.float()).abs().max()
    return int(real.numel()), int(dq.dropped)


def teardown_module():
    shutdown_all()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("quant", ["fp8_blockwise", "fp4_blockwise"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dequantized_layout_matches_numerics(world, quant, dtype):
    res = get_world(world).run(scn_dequantized, quant, dtype, 0, 5)
    assert all(kept > 0 for kept, _ in res) and all(dropped == 0 for _, dropped in res)


def test_dequantized_layout_with_drops():
    res = get_world(2).run(scn_dequantized, "fp8_blockwise", torch.bfloat16, 16, 9)
    assert any(dropped > 0 for _, dropped in res)  # a 16-row buffer cannot hold every pair


@pytest.mark.parametrize("fields, words", [
    (dict(dispatch_quant_type="none"), "dispatch_quant_type='none'"),
    (dict(enable_grouped_layout=False), "enable_grouped_layout=False"),
])
def test_dequantize_needs_a_quantized_grouped_dispatch(fields, words):
    kw = dict(rank=0, world_size=1, hidden_dim=128, max_num_inp_token_per_rank=4, num_experts_per_rank=4,
              num_experts_per_token=2, kernel_backend="torch", dispatch_quant_type="fp8_blockwise",
              enable_grouped_layout=True, grouped_dequantize=True)
    with pytest.raises(ConfigError, match=f"grouped_dequantize=True.*{words}"):
        EpDispatchCombineConfig(**{**kw, **fields})


@pytest.mark.parametrize("value", [1, "yes", None])
def test_dequantize_must_be_a_bool(value):
    with pytest.raises(ConfigError, match="grouped_dequantize=.*must be a bool"):
        _cfg(0, 1, "fp8_blockwise", grouped_dequantize=value)


def test_dequantized_memory_formula():
    plain, dq = (EpDispatchCombineOp(_cfg(0, 1, "fp8_blockwise", grouped_dequantize=d)) for d in (False, True))
    try:
        P, H = dq.config.resolved_grouped_capacity, dq.config.hidden_dim
        a, b = plain.memory_report()["buffers"], dq.memory_report()["buffers"]
        assert a["grouped_x"] == P * H and a["grouped_scales"] == P * (H // 128) * 4  # fp8 bytes, fp32 scales
        assert b["grouped_x"] == P * H * 2 and b["grouped_scales"] == 0  # bf16 rows, no scales
    finally:
        plain.close()
        dq.close()
