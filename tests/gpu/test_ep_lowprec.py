"""Low-precision EP on real GPUs: fp8/fp4 payloads, in-kernel quantization, scatter combine with
FP8/FP4 wire compression, graph capture.

Run: torchrun --nproc-per-node 2 -m pytest -m multigpu -q tests/gpu/test_ep_lowprec.py
"""

import functools
import os

import pytest
import torch
import torch.distributed as dist

from runtime import EpDispatchCombineOp, numerics
from tests.support.ep_oracle import multiplicity, random_routing
from tests.support.configs import dist_config
from tests.gpu.dist_util import run_collective

pytestmark = pytest.mark.multigpu

if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
    pytest.skip("needs torchrun and GPUs", allow_module_level=True)

H, T, K, EPR = 2048, 256, 8, 16
BF16 = torch.bfloat16


def _inputs(seed, rank):
    """(x bf16 [T, H] with a spread of magnitudes, weights, indices) of `rank`, rebuildable anywhere."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(T, H, generator=g) * torch.exp2(torch.randint(-6, 7, (T, 1), generator=g).float())
    w = torch.rand(T, K, generator=g)
    idx = random_routing(g, T, K, EPR * dist.get_world_size())
    return x.to(BF16), w, idx


_cfg = functools.partial(dist_config, hidden_dim=H, max_num_inp_token_per_rank=T, num_experts_per_rank=EPR,
                         num_experts_per_token=K, data_type=BF16)


def _sources(op, total):
    """(source rank, token) of each received row."""
    n = int(total.item())
    src = op._backend.recv_src[:n].cpu()
    return n, [(int(s) // T, int(s) % T) for s in src]


def _fp8_fmt(op):
    return "fnuz" if op.dispatch_out_dtype == torch.float8_e4m3fnuz else "ocp"


@pytest.mark.parametrize("payload", ["fp8", "fp4"])
def test_payload_dispatch_is_byte_exact(payload):
    def check():
        if payload == "fp8":
            cfg = _cfg(dispatch_data_type=torch.float8_e4m3fn, combine_data_type=BF16, scale_dim=H // 128, scale_type_size=4)
        else:
            cfg = _cfg(dispatch_data_type=torch.float4_e2m1fn_x2, combine_data_type=BF16, scale_dim=H // 32, scale_type_size=1)
        enc = {}
        for r in range(dist.get_world_size()):
            x, w, idx = _inputs(1, r)
            q, s = numerics.quantize_fp8(x, "ocp", "fp8_blockwise") if payload == "fp8" else numerics.quantize_fp4(x)
            enc[r] = (q, s, w, idx)
        q, s, w, idx = enc[dist.get_rank()]
        xq = q.cuda().view(cfg.dispatch_data_type)
        with EpDispatchCombineOp(cfg) as op:
            out, ow, os_, oi, total = op.dispatch(xq, w.cuda(), s.cuda(), idx.cuda())
            torch.cuda.synchronize()
            n, srcs = _sources(op, total)
            got = out[:n].view(torch.uint8).cpu()
            want = torch.stack([enc[r][0][t] for r, t in srcs]) if n else got
            assert torch.equal(got, want), f"{payload}: payload bytes differ in {(got != want).any(1).sum()} rows"
            got_s = os_[:n].cpu()
            want_s = torch.stack([enc[r][1][t] for r, t in srcs]) if n else got_s
            assert torch.equal(got_s.view(torch.uint8), want_s.view(torch.uint8)), "scales differ"
    run_collective(check)  # its all-gather is the closing barrier


@pytest.mark.parametrize("mode", ["fp8_blockwise", "fp4_blockwise"])
def test_in_kernel_quantization_is_bit_exact(mode):
    def check():
        cfg = _cfg(dispatch_quant_type=mode)
        xs = {r: _inputs(2, r) for r in range(dist.get_world_size())}
        x, w, idx = xs[dist.get_rank()]
        with EpDispatchCombineOp(cfg) as op:
            fmt = _fp8_fmt(op)
            out, ow, osc, oi, total = op.dispatch(x.cuda(), w.cuda(), None, idx.cuda())
            torch.cuda.synchronize()
            n, srcs = _sources(op, total)
            rows = torch.stack([xs[r][0][t] for r, t in srcs])
            q, s = numerics.quantize_fp8(rows, fmt, mode) if mode == "fp8_blockwise" else numerics.quantize_fp4(rows)
            got_q, got_s = out[:n].view(torch.uint8).cpu(), osc[:n].cpu()
            assert torch.equal(got_q, q), f"{mode}: {(got_q != q).sum()} bytes differ"
            assert torch.equal(got_s.view(torch.uint8), s.view(torch.uint8)), f"{mode}: scales differ"
    run_collective(check)  # its all-gather is the closing barrier


def _wire_roundtrip(rows_bf16, quant, fmt):
    """What the origin decodes for one pushed bf16 row (float32)."""
    if quant == "none":
        return rows_bf16.float()
    if quant == "fp8_direct_cast":
        return numerics.fp8_decode(numerics.fp8_encode(rows_bf16.float(), fmt), fmt)
    if quant == "fp8_blockwise":
        q, s = numerics.quantize_fp8(rows_bf16, fmt, quant)
        return numerics.dequantize_fp8(q, s, fmt, quant, torch.float32)
    q, s = numerics.quantize_fp4(rows_bf16)
    return numerics.dequantize_fp4(q, s, torch.float32)


# Tolerance of the identity round trip |combine - U*x| per element, and why:
#   fp8 e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of |x| (blockwise: |x| >= amax*2^-6 stays normal;
#   smaller values lose relative precision, bounded by amax/448 * 2^-4 absolute), times U;
#   fp4 e2m1: half a grid step of the largest bin, 1 * 2^e with 2^e <= amax/4, times U.
TOL = {"none": lambda x, amax: 0 * x, "fp8_direct_cast": lambda x, amax: x.abs() * 2**-4 + 2**-10,
       "fp8_blockwise": lambda x, amax: x.abs() * 2**-4 + amax / 448 * 2**-3,
       "fp4_blockwise": lambda x, amax: amax / 4 + 0 * x}


@pytest.mark.parametrize("quant", ["none", "fp8_direct_cast", "fp8_blockwise", "fp4_blockwise"])
def test_scatter_identity(quant):
    def check():
        cfg = _cfg(quant_type=quant, combine_mode="scatter")
        x, w, idx = _inputs(3, dist.get_rank())
        with EpDispatchCombineOp(cfg) as op:
            fmt = "ocp" if op._backend.plan.combine_variant.find("fnuz") < 0 else "fnuz"
            out, ow, _, _, total, h = op.dispatch(x.cuda(), w.cuda(), None, idx.cuda(), return_routing=True)
            comb, comb_w = op.combine(out, weights=ow, routing=h)
            torch.cuda.synchronize()
            U = torch.tensor(multiplicity(idx, EPR), dtype=torch.float32)
            y = _wire_roundtrip(x, quant, fmt)
            want = torch.zeros(T, H)
            for u in range(int(U.max()) if T else 0):  # identical rows: the rank order cannot matter
                want = torch.where((U > u)[:, None], want + y, want)
            assert torch.equal(comb.cpu(), want.to(BF16)), f"{quant}: {(comb.cpu() != want.to(BF16)).any(1).sum()} rows differ"
            assert torch.allclose(comb_w.cpu(), w * U[:, None], rtol=1e-6, atol=0)
            amax = x.float().abs().amax(1, keepdim=True)
            err = (comb.cpu().float() - U[:, None] * x.float()).abs()
            assert bool((err <= U[:, None] * TOL[quant](x.float(), amax) + 2**-7 * x.float().abs() * U[:, None]).all()), \
                f"{quant}: max error {err.max()}"
    run_collective(check)  # its all-gather is the closing barrier


def test_scatter_gather_parity_bf16():
    def check():
        x, w, idx = _inputs(4, dist.get_rank())
        res = []
        for mode in ("gather", "scatter"):
            with EpDispatchCombineOp(_cfg(combine_mode=mode)) as op:
                out, ow, _, _, total, h = op.dispatch(x.cuda(), w.cuda(), None, idx.cuda(), return_routing=True)
                expert = (out.float() * 3 - 1).to(BF16)
                res.append(op.combine(expert, routing=h)[0].cpu())
            dist.barrier()
        assert torch.equal(res[0], res[1]), f"{(res[0] != res[1]).any(1).sum()} rows differ"
    run_collective(check)


def test_graph_fp8_dispatch_identity_fp8_combine():
    def check():
        cfg = _cfg(dispatch_quant_type="fp8_blockwise", quant_type="fp8_blockwise")
        with EpDispatchCombineOp(cfg) as op:
            fmt = _fp8_fmt(op)
            sx, sw, sidx = (t.cuda() for t in _inputs(10, dist.get_rank()))
            expert_out = torch.empty(cfg.max_recv_tokens, H, dtype=BF16, device="cuda")

            def step():
                out, ow, osc, _, _, h = op.dispatch(sx, sw, None, sidx, return_routing=True)
                expert_out.copy_((out.float() * osc.repeat_interleave(128, dim=1)).to(BF16))  # identity expert
                return op.combine(expert_out, weights=ow, routing=h)

            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step()
            torch.cuda.current_stream().wait_stream(s)
            dist.barrier()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                comb, comb_w = step()
            for rep in range(5):
                x, w, idx = _inputs(20 + rep, dist.get_rank())
                sx.copy_(x), sw.copy_(w), sidx.copy_(idx)
                g.replay()
                torch.cuda.synchronize()
                q, sc = numerics.quantize_fp8(x, fmt, "fp8_blockwise")
                dq = numerics.dequantize_fp8(q, sc, fmt, "fp8_blockwise", BF16)
                y = _wire_roundtrip(dq, "fp8_blockwise", fmt)
                U = torch.tensor(multiplicity(idx, EPR), dtype=torch.float32)
                want = torch.zeros(T, H)
                for u in range(int(U.max())):
                    want = torch.where((U > u)[:, None], want + y, want)
                assert torch.equal(comb.cpu(), want.to(BF16)), f"replay {rep}: {(comb.cpu() != want.to(BF16)).any(1).sum()} rows differ"
                assert torch.allclose(comb_w.cpu(), w * U[:, None], rtol=1e-6, atol=0)
    run_collective(check)  # its all-gather is the closing barrier
