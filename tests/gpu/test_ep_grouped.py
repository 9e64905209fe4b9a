"""The grouped-GEMM layout on the native backend (kernels grouped_count / grouped_place / grouped_reduce) against
the torch backend, on real GPUs: the groups compared as per-group sets keyed by (source rank, token, column)
(the native receive order under the worst-case buffer is the arrival order), offs / counts / drops exactly,
the combine bit-exact; a receive cap (deterministic order) makes the rows' order and the drops past a small
grouped buffer comparable exactly; routing replay; and the whole round inside a captured CUDA graph.

Run: torchrun --nproc-per-node 2 -m pytest -m multigpu -q tests/gpu/test_ep_grouped.py
"""

import os

import pytest
import torch
import torch.distributed as dist

from runtime import EpDispatchCombineConfig, EpDispatchCombineOp
from tests.ep_oracle import random_routing
from tests.gpu.dist_util import run_collective
from tests.grouped_oracle import MODE_FIELDS, expert_rows

pytestmark = pytest.mark.multigpu

if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
    pytest.skip("needs torchrun and GPUs", allow_module_level=True)

T, K, EPR = 64, 8, 8
MODES = {mode: (256, MODE_FIELDS[mode]) for mode in ("bf16", "fp32", "fp8", "fp8_blockwise")}  # (hidden, fields)


def _cfg(backend, mode, tokens=T, **kw):
    hidden, fields = MODES[mode]
    return EpDispatchCombineConfig(rank=dist.get_rank(), world_size=dist.get_world_size(), hidden_dim=hidden,
                                   max_num_inp_token_per_rank=tokens, num_experts_per_rank=EPR, num_experts_per_token=K,
                                   kernel_backend=backend, enable_grouped_layout=True, **fields, **kw)


def _inputs(seed, mode, device, tokens=T):
    hidden, fields = MODES[mode]
    g = torch.Generator().manual_seed(seed * 31 + dist.get_rank())
    x = (torch.randint(-64, 65, (tokens, hidden), generator=g).float() / 16).to(fields.get("data_type", torch.bfloat16))
    w = torch.randint(1, 64, (tokens, K), generator=g).float() / 64
    idx = random_routing(g, tokens, K, EPR * dist.get_world_size())
    s = None
    if mode == "fp8":
        x = x.float().to(torch.float8_e4m3fn)
        s = torch.rand(tokens, 2, generator=g) + 0.5
    return tuple(None if t is None else t.to(device) for t in (x, w, s, idx))


def _groups(layout, src_id, k):
    """Per group: {(source id, column): (row bytes, scale bytes, weight, expert)} of its kept rows."""
    src, x = layout.src.cpu(), layout.x.cpu().view(torch.uint8)
    sc = None if layout.scales is None else layout.scales.cpu().view(torch.uint8)
    w, m = layout.weights.cpu(), layout.m_indices.cpu()
    out, start = [], 0
    for end in layout.offs.tolist():
        group = {}
        for g in range(start, end):
            p = int(src[g])
            if p >= 0:
                group[(int(src_id[p // k]), p % k)] = (x[g].numpy().tobytes(),
                                                       None if sc is None else sc[g].numpy().tobytes(),
                                                       float(w[g]), int(m[g]))
        out.append(group)
        start = end
    return out


def _native_ids(op):
    return op._backend.recv_src.cpu().tolist()  # rank * max_tokens + token of each received row


def _torch_ids(handle, tokens=T):
    return [s * tokens + t for s, t in handle.recv_src.cpu().tolist()]


def _round(op, x, w, s, idx, mode, routing=None):
    layout, h = op.dispatch_grouped(x, w, s, idx, routing=routing)
    y = expert_rows(layout, mode, op.config.combine_dtype, dist.get_rank() * EPR)
    return layout, h, op.combine_grouped(y, h)[0], op.combine_grouped(y, h, apply_weights=False)[0]


@pytest.mark.parametrize("mode,protocol,recv_cap,gcap,tokens", [
    ("bf16", "bw", 0, 0, T), ("bf16", "ll", 0, 0, T), ("fp32", "bw", 0, 0, T), ("fp8", "bw", 0, 0, T),
    ("fp8_blockwise", "bw", 0, 0, T),
    ("bf16", "bw", 120, 128, T),        # receive cap: (source rank, token) order; a small buffer: drops
    ("fp8_blockwise", "bw", 100, 0, T),
    ("bf16", "bw", 2000, 0, 1024),      # 16000 pairs: the counting kernel's blocks take several steps
])
def test_grouped_matches_torch_backend(mode, protocol, recv_cap, gcap, tokens):
    def check():
        kw = dict(max_total_recv_tokens=recv_cap, grouped_capacity=gcap, tokens=tokens)
        with EpDispatchCombineOp(_cfg("native", mode, intranode_protocol=protocol, **kw)) as op, \
                EpDispatchCombineOp(_cfg("torch", mode, **kw)) as ref:
            for attempt, seed in enumerate((1, 2)):
                x, w, s, idx = _inputs(seed, mode, "cuda", tokens)
                routing = (h_nat, h_ref) if attempt else (None, None)  # the second round replays the first's routing
                if attempt:
                    idx = idx0
                got = _round(op, x, w, s, idx, mode, routing[0])
                torch.cuda.synchronize()
                want = _round(ref, *(None if t is None else t.to(ref.device) for t in (x, w, s, idx)), mode, routing[1])
                (lay, h_n, comb, comb_u), (rlay, h_r, rcomb, rcomb_u) = got, want
                if not attempt:
                    h_nat, h_ref, idx0 = h_n, h_r, idx
                assert lay.offs.tolist() == rlay.offs.tolist(), (lay.offs.tolist(), rlay.offs.tolist())
                assert lay.counts.tolist() == rlay.counts.tolist() and int(lay.dropped) == int(rlay.dropped)
                assert _groups(lay, _native_ids(op), K) == _groups(rlay, _torch_ids(h_ref, tokens), K), f"round {attempt}"
                if recv_cap:  # deterministic receive order: the same rows in the same places
                    assert torch.equal(lay.src.cpu(), rlay.src.cpu()) and torch.equal(lay.m_indices.cpu(), rlay.m_indices.cpu())
                assert torch.equal(comb.cpu(), rcomb.cpu()), (comb.float().cpu() - rcomb.float().cpu()).abs().max()
                assert torch.equal(comb_u.cpu(), rcomb_u.cpu())
                if gcap:
                    assert int(lay.dropped) > 0, "the small buffer dropped nothing"
    run_collective(check)  # its all-gather is the closing barrier


def test_grouped_round_in_a_cuda_graph():
    def check():
        mode = "bf16"
        with EpDispatchCombineOp(_cfg("native", mode)) as op:
            x, w, s, idx = _inputs(5, mode, "cuda")
            sx, sw, sidx = x.clone(), w.clone(), idx.clone()
            st = torch.cuda.Stream()
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                _round(op, sx, sw, None, sidx, mode)
            torch.cuda.current_stream().wait_stream(st)
            torch.cuda.synchronize()
            dist.barrier()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                _, _, res, _ = _round(op, sx, sw, None, sidx, mode)
            for rep in range(3):
                x, w, _, idx = _inputs(40 + rep, mode, "cuda")
                sx.copy_(x), sw.copy_(w), sidx.copy_(idx)
                g.replay()
                torch.cuda.synchronize()
                got = res.clone()
                dist.barrier()
                want = _round(op, x, w, None, idx, mode)[2]
                torch.cuda.synchronize()
                assert torch.equal(got, want), f"replay {rep}: {(got.float() - want.float()).abs().max()}"
                dist.barrier()
    run_collective(check)  # its all-gather is the closing barrier
