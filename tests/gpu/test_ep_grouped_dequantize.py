"""grouped_dequantize on the native backend (kernels grouped_place_fp8 / grouped_place_fp4): the grouped layout of
an fp8_blockwise / fp4_blockwise dispatch placed with its rows decoded into data_type, against the same op
without it (rows decoded by runtime.numerics on the host) and against the torch backend, bit for bit. A receive
cap makes the receive order (source rank, token) on every op, so the rows sit in the same places; the combine
of the decoded rows is compared with the combine of the hand-decoded ones; and the round replays in a CUDA graph.

Run: torchrun --nproc-per-node 2 -m pytest -m multigpu -q tests/gpu/test_ep_grouped_dequantize.py
"""

import os

import pytest
import torch
import torch.distributed as dist

from runtime import EpDispatchCombineOp, numerics
from tests.support.ep_oracle import random_routing
from tests.support.configs import dist_config
from tests.gpu.dist_util import captured, run_collective

pytestmark = pytest.mark.multigpu

if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
    pytest.skip("needs torchrun and GPUs", allow_module_level=True)

T, K, EPR, H = 64, 8, 8, 512
RECV_CAP = 100  # (source rank, token) receive order on both backends


def _cfg(backend, quant, dq, dtype=torch.bfloat16, cap=RECV_CAP):
    return dist_config(hidden_dim=H, max_num_inp_token_per_rank=T, num_experts_per_rank=EPR, num_experts_per_token=K,
                       kernel_backend=backend, data_type=dtype, dispatch_quant_type=quant, enable_grouped_layout=True,
                       grouped_dequantize=dq, max_total_recv_tokens=cap)


def _inputs(seed, dtype):
    g = torch.Generator().manual_seed(seed * 31 + dist.get_rank())
    x = (torch.randn(T, H, generator=g) * torch.logspace(-3, 3, H)).to(dtype)  # a wide range per block
    w = torch.randint(1, 64, (T, K), generator=g).float() / 64
    idx = random_routing(g, T, K, EPR * dist.get_world_size())
    return x.cuda(), w.cuda(), idx.cuda()


def _decode(layout, quant):
    x, s = layout.x.cpu(), layout.scales.cpu()
    if quant == "fp8_blockwise":
        return numerics.dequantize_fp8(x.view(torch.uint8), s, "ocp", "fp8_blockwise", torch.float32)
    return numerics.dequantize_fp4(x, s, torch.float32)


def _bits(t):
    return t.cpu().contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("quant", ["fp8_blockwise", "fp4_blockwise"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dequantized_layout_is_numerics_bit_for_bit(quant, dtype):
    def check():
        with EpDispatchCombineOp(_cfg("native", quant, True, dtype)) as dq_op, \
                EpDispatchCombineOp(_cfg("native", quant, False, dtype)) as plain_op, \
                EpDispatchCombineOp(_cfg("torch", quant, True, dtype)) as ref_op:
            for seed in (1, 2):
                x, w, idx = _inputs(seed, dtype)
                dq, hd = dq_op.dispatch_grouped(x, w, None, idx)
                plain, hp = plain_op.dispatch_grouped(x, w, None, idx)
                torch.cuda.synchronize()
                ref, hr = ref_op.dispatch_grouped(*(t.to(ref_op.device) for t in (x, w)), None, idx.to(ref_op.device))
                assert dq.scales is None and dq.x.dtype == dtype and dq.x.shape == (dq_op.config.resolved_grouped_capacity, H)
                for name in ("offs", "counts", "src", "m_indices"):
                    assert torch.equal(getattr(dq, name).cpu(), getattr(plain, name).cpu()), name
                    assert torch.equal(getattr(dq, name).cpu(), getattr(ref, name).cpu()), name
                real = (plain.src >= 0).nonzero().squeeze(1).cpu()
                assert real.numel() > 0
                want = _decode(plain, quant)[real].to(dtype)
                assert torch.equal(_bits(dq.x.cpu()[real]), _bits(want)), f"seed {seed}: native decode != numerics"
                assert torch.equal(_bits(ref.x.cpu()[real]), _bits(want)), f"seed {seed}: torch backend != numerics"
                # identity experts: the decoded rows combine to the bits of the hand-decoded plain rows
                cd = dq_op.config.combine_dtype
                got = dq_op.combine_grouped(dq.x.to(cd), hd)[0]
                hand = _decode(plain, quant).to(dtype).to(cd).cuda()
                want_c = plain_op.combine_grouped(hand, hp)[0]
                torch.cuda.synchronize()
                ref_c = ref_op.combine_grouped(ref.x.to(cd), hr)[0]  # on the torch backend's device
                assert torch.equal(got, want_c), (got.float() - want_c.float()).abs().max()
                assert torch.equal(got.cpu(), ref_c.cpu())
    run_collective(check)  # its all-gather is the closing barrier


def test_dequantized_round_in_a_cuda_graph():
    def check():
        quant, dtype = "fp8_blockwise", torch.bfloat16
        with EpDispatchCombineOp(_cfg("native", quant, True, dtype, cap=0)) as op:
            x, w, idx = _inputs(5, dtype)
            sx, sw, sidx = x.clone(), w.clone(), idx.clone()

            def round_fn():
                lay, h = op.dispatch_grouped(sx, sw, None, sidx)
                return op.combine_grouped(lay.x.to(op.config.combine_dtype), h)[0]

            g, res = captured(round_fn)
            for rep in range(3):
                x, w, idx = _inputs(40 + rep, dtype)
                sx.copy_(x), sw.copy_(w), sidx.copy_(idx)
                g.replay()
                torch.cuda.synchronize()
                got = res.clone()
                dist.barrier()
                want = round_fn()
                torch.cuda.synchronize()
                assert torch.equal(got, want), f"replay {rep}: {(got.float() - want.float()).abs().max()}"
                dist.barrier()
    run_collective(check)
