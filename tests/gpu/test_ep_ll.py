"""The low-latency intranode protocol (dispatch_ll / combine_ll) on real GPUs, one process per GPU: the same
results as the bandwidth protocol and the torch backend, the automatic choice (one per op), graph capture, receive
cap, routing replay, std-MoE, fp8 payloads.

Run: torchrun --nproc-per-node 2 -m pytest -m multigpu -q tests/gpu/test_ep_ll.py
"""

import attrs
import pytest
import torch
import torch.distributed as dist

from runtime import EpDispatchCombineOp, numerics
from runtime.config import load_specs
from tests.support.ep_oracle import multiplicity
from tests.gpu.dist_util import run_collective

pytestmark = pytest.mark.multigpu

# helpers of the bandwidth protocol's tests (their test functions are not collected here); importing them
# skips this module where they skip (no torchrun or no GPU)
from tests.gpu import test_ep_moe as moe_t  # noqa: E402
from tests.gpu import test_ep_native as nat  # noqa: E402


def _cfg(T_max, hidden, k, epr, protocol="ll", **kw):
    return attrs.evolve(nat._cfg(T_max, hidden, k, epr), intranode_protocol=protocol, **kw)


def _threshold():
    from runtime.kernels import device_arch
    return load_specs().ll_max_tokens[device_arch(torch.device("cuda", torch.cuda.current_device()))]


@pytest.mark.parametrize("hidden,k,epr", [(7168, 8, 128), (2048, 4, 32), (7168, 1, 8), (2048, 8, 8), (256, 3, 5)])
def test_identity(hidden, k, epr):
    """combine(dispatch(x)) == U*x, the received set and rows equal the oracle's, ids included (with -1 and
    repeated ids), every token count up to the buffer's, and the rows come in (source rank, token) order."""
    cfg = _cfg(128, hidden, k, epr)
    with EpDispatchCombineOp(cfg) as op:
        for seed, T in enumerate([0, 1, 7, 32, 128, 5]):
            x, w, idx = nat._inputs(seed, T, cfg)
            nat._check_identity(op, cfg, x, w, idx, seed, T)
            assert op.last_intranode_protocol == "ll"
            n = int(op._backend.total_recv.item())
            src = op._backend.recv_src[:n]
            assert bool((src[1:] > src[:-1]).all()), "rows not in (source rank, token) order"


def test_launch_geometries():
    """Few blocks (every block then sends and receives many rows) and small blocks."""
    for blocks, threads in ((1, 32), (3, 64), (0, 512)):
        cfg = _cfg(128, 7168, 8, 128, launch_blocks=blocks, launch_threads=threads)
        with EpDispatchCombineOp(cfg) as op:
            for seed, T in enumerate([1, 77, 128]):
                x, w, idx = nat._inputs(500 + seed, T, cfg)
                nat._check_identity(op, cfg, x, w, idx, 500 + seed, T)


def _identity_local(op, cfg, x, w, idx):
    """This rank's combine(dispatch(x)) == U*x (ranks may pass different token counts)."""
    out, ow, _, _, _, h = op.dispatch(x, w, None, idx, return_routing=True)
    comb, cw = op.combine(out, weights=ow, routing=h)
    torch.cuda.synchronize()
    U = torch.tensor(multiplicity(idx.cpu(), cfg.num_experts_per_rank), dtype=torch.float32, device="cuda")
    assert torch.equal(comb, (x.float() * U[:, None]).to(cfg.data_type)), f"T={x.shape[0]}"
    assert torch.allclose(cw, w * U[:, None], rtol=1e-6, atol=0)
    return h.extra["protocol"]


def test_auto_decides_once_from_the_config_and_ranks_may_differ_in_tokens():
    """auto: "ll" for every call when the config's token bound is at most the target's threshold, "bw" for every
    call above it (a 1-token call included), the same on every rank while the ranks' token counts differ (the case
    a per-call choice by the rank's own count got wrong: ranks on different protocols wait for each other); the
    default protocol is auto; dispatch twice and combine twice stay right."""
    def check():
        limit = _threshold()
        assert nat._cfg(8, 256, 2, 4).intranode_protocol == "auto"  # the default
        rank = dist.get_rank()
        for bound, want in ((max(1, limit), "ll" if limit else "bw"), (limit + 1, "bw"), (1024, "bw")):
            cfg = _cfg(bound, 2048, 8, 32, protocol="auto")
            with EpDispatchCombineOp(cfg) as op:
                for seed, T in enumerate([1, bound, (bound + 1) // 2, 1]):
                    mine = T if rank % 2 == 0 else max(0, bound - T)  # the ranks' counts differ
                    x, w, idx = nat._inputs(600 + seed, mine, cfg)
                    got = _identity_local(op, cfg, x, w, idx)
                    assert got == want and op.last_intranode_protocol == want, (bound, mine, got)
                # dispatch twice, combine twice
                hs = []
                for i in range(2):
                    x, w, idx = nat._inputs(700 + i, 1 + i, cfg)
                    hs.append(op.dispatch(x, w, None, idx, return_routing=True)[-1])
                a, aw = op.combine(op._backend.recv_x, weights=op._backend.recv_w, routing=hs[-1])
                b, bw = op.combine(op._backend.recv_x, weights=op._backend.recv_w, routing=hs[-1])
                torch.cuda.synchronize()
                U = torch.tensor(multiplicity(idx.cpu(), cfg.num_experts_per_rank), dtype=torch.float32, device="cuda")
                assert torch.equal(a, (x.float() * U[:, None]).to(cfg.data_type)) and torch.equal(a, b), bound
                assert torch.equal(aw, bw)
    run_collective(check)  # its all-gather is the closing barrier


def test_parity_with_torch_backend_and_bandwidth_protocol():
    """A non-trivial expert (x * 3) through ll, bw and the torch backend: the same received rows (ll and the
    torch backend in the same order) and bit-identical combined outputs and weights."""
    def check():
        T = 100
        cfgs = [_cfg(128, 4096, 8, 32), _cfg(128, 4096, 8, 32, protocol="bw"),
                attrs.evolve(_cfg(128, 4096, 8, 32, protocol="bw"), kernel_backend="torch")]
        x, w, idx = nat._inputs(11, T, cfgs[0])
        res = []
        for cfg in cfgs:
            with EpDispatchCombineOp(cfg) as op:
                out, ow, _, oi, total, h = op.dispatch(x.to(op.device), w.to(op.device), None, idx.to(op.device),
                                                       return_routing=True)
                n = int(total.item())
                comb, cw = op.combine((out.float() * 3).to(cfg.data_type), weights=ow, routing=h)
                res.append((out[:n].cuda(), oi[:n].cuda(), comb.cuda(), cw.cuda()))
        (lo, li, lc, lw), (bo, bi, bc, bw), (to, ti, tc, tw) = res
        assert torch.equal(lo, to) and torch.equal(li, ti), "ll rows differ from the torch backend's"
        assert torch.equal(lc, tc) and torch.equal(lc, bc), "combined outputs differ"
        assert torch.equal(lw, tw) and torch.equal(lw, bw), "combined weights differ"
        assert lo.shape == bo.shape
    run_collective(check)  # its all-gather is the closing barrier


def test_graph_capture_replays_and_eager_calls_between():
    """dispatch -> identity expert into combine_in_view -> combine captured once, replayed with fresh inputs
    (epochs advance on the device), with eager rounds of other token counts and a lone eager dispatch between."""
    cfg = _cfg(256, 7168, 8, 128)
    T = 64
    with EpDispatchCombineOp(cfg) as op:
        sx, sw, sidx = (t.clone() for t in nat._inputs(100, T, cfg))
        g, comb, comb_w, h = nat._capture_round(op, sx, sw, sidx)
        assert h.extra["protocol"] == "ll"
        for rep in range(8):
            x, w, idx = nat._inputs(200 + rep, T, cfg)
            if rep % 3 == 1:  # an eager round of another size, then an eager dispatch alone
                bx, bw_, bidx = nat._inputs(300 + rep, 200, cfg)
                nat._check_identity(op, cfg, bx, bw_, bidx, 300 + rep, 200)
                assert op.last_intranode_protocol == "ll"
                op.dispatch(x, w, None, idx)
            sx.copy_(x), sw.copy_(w), sidx.copy_(idx)
            nat._replay_and_check(g, comb, comb_w, cfg, x, w, idx, rep)
        op.check()


def test_receive_cap_and_replay_match_torch_backend():
    """Under a cap the same rows are kept and dropped as by the torch backend (first `cap` in (source rank,
    token) order), dropped_count agrees, and a routing replay lands in the same rows."""
    cap = 40
    T = 64
    cfg = _cfg(T, 2048, 8, 16, max_total_recv_tokens=cap)
    ref = attrs.evolve(cfg, kernel_backend="torch")
    x, w, idx = nat._inputs(21, T, cfg)

    def check():
        got = []
        for c in (cfg, ref):
            with EpDispatchCombineOp(c) as op:
                out, ow, _, oi, total, h = op.dispatch(x.to(op.device), w.to(op.device), None, idx.to(op.device),
                                                       return_routing=True)
                n, dropped = int(total.item()), int(op.dropped_count())
                comb, cw = op.combine(out, weights=ow, routing=h)
                rows = out[:n].cuda().clone()
                if c is cfg:  # replay: the same rows, scaled
                    y = (x.float() * 2).to(cfg.data_type)
                    out2, _, _, _, total2 = op.dispatch(y, w, None, idx, routing=h)
                    torch.cuda.synchronize()
                    assert int(total2.item()) == n and torch.equal(out2[:n].float(), rows.float() * 2), "replay moved rows"
                    assert op.last_intranode_protocol == "ll"
                got.append((n, dropped, rows, comb.cuda(), cw.cuda()))
        (n1, d1, r1, c1, w1), (n2, d2, r2, c2, w2) = got
        assert (n1, d1) == (n2, d2), ((n1, d1), (n2, d2))
        assert torch.equal(r1, r2) and torch.equal(c1, c2) and torch.equal(w1, w2)
    run_collective(check)  # its all-gather is the closing barrier


def test_std_moe_round_trip():
    def check():
        world = dist.get_world_size()
        a, b = moe_t._affine(moe_t.EPR * world)
        for protocol in ("ll", "bw"):
            with EpDispatchCombineOp(moe_t._cfg(enable_std_moe=True, expert_capacity=moe_t.T * world,
                                                intranode_protocol=protocol)) as op:
                x, w, idx = moe_t._inputs(5, dist.get_rank())
                got = moe_t._std_moe_round(op, x, w, idx, a, b).float()
                assert op.last_intranode_protocol == protocol
                want, scale = moe_t._std_moe_expected(x, w, idx, a, b)
                assert bool(((got - want).abs() <= scale * 2**-6 + 1e-3).all()), f"{protocol}: {(got - want).abs().max()}"
    run_collective(check)  # its all-gather is the closing barrier


@pytest.mark.parametrize("payload", ["fp8", "fp4"])
def test_low_precision_payloads_byte_exact(payload):
    """Pre-quantized payloads and their scales move verbatim (fp8 with fp32 scales, fp4 with e8m0 bytes: a
    scale row that is not whole words), and the bf16 combine of a dequantized identity expert is U * x."""
    T, H, K, EPR = 96, 2048, 8, 16

    def check():
        if payload == "fp8":
            kw = dict(dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.bfloat16, scale_dim=H // 128,
                      scale_type_size=4)
        else:
            kw = dict(dispatch_data_type=torch.float4_e2m1fn_x2, combine_data_type=torch.bfloat16, scale_dim=H // 32 + 3,
                      scale_type_size=1)
        cfg = _cfg(T, H, K, EPR, **kw)
        enc = {}
        for r in range(dist.get_world_size()):
            x, w, idx = nat._inputs(31, T, cfg, r)
            x = x.cpu().float()
            if payload == "fp8":
                q, s = numerics.quantize_fp8(x, "ocp", "fp8_blockwise")
            else:
                q, s = numerics.quantize_fp4(x)
                s = torch.cat([s, torch.full((T, 3), 0x7f, dtype=torch.uint8)], 1)  # 67 scale bytes per row
            enc[r] = (q, s, w.cpu(), idx.cpu())
        q, s, w, idx = enc[dist.get_rank()]
        with EpDispatchCombineOp(cfg) as op:
            out, ow, os_, oi, total, h = op.dispatch(q.cuda().view(cfg.dispatch_data_type), w.cuda(), s.cuda(),
                                                     idx.cuda(), return_routing=True)
            torch.cuda.synchronize()
            n = int(total.item())
            srcs = [(int(v) // T, int(v) % T) for v in op._backend.recv_src[:n].cpu()]
            got = out[:n].view(torch.uint8).cpu()
            want = torch.stack([enc[r][0][t].view(torch.uint8) for r, t in srcs])
            assert torch.equal(got, want), f"{payload}: payload bytes differ in {(got != want).any(1).sum()} rows"
            want_s = torch.stack([enc[r][1][t] for r, t in srcs])
            assert torch.equal(os_[:n].cpu().view(torch.uint8), want_s.view(torch.uint8)), "scales differ"
            assert torch.equal(oi[:n].cpu(), torch.stack([enc[r][3][t] for r, t in srcs]))
            # identity expert on the dequantized rows: combine == U * dequantized x
            if payload == "fp8":
                deq = numerics.dequantize_fp8(out[:n].view(torch.uint8).cpu(), os_[:n].cpu(), "ocp", "fp8_blockwise",
                                              torch.bfloat16)
                y = torch.zeros(cfg.max_recv_tokens, H, dtype=torch.bfloat16)
                y[:n] = deq
                comb, _ = op.combine(y.cuda(), routing=h)
                mine = numerics.dequantize_fp8(q, s, "ocp", "fp8_blockwise", torch.bfloat16).float()
                U = torch.tensor(multiplicity(idx, EPR), dtype=torch.float32)
                assert torch.equal(comb.cpu(), (mine * U[:, None]).to(torch.bfloat16))
    run_collective(check)  # its all-gather is the closing barrier
