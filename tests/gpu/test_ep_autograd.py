"""runtime/autograd.py on the native backend against the torch backend's backward, on real GPUs: the grouped legs
(bf16 and fp32; weighted and unweighted; a receive cap and a small grouped buffer, with drops) and the plain legs,
forward and every gradient (tokens, routing weights, expert weights) bit-exact: the inputs are exact in a few
bits, so every sum is exact whatever its order (the legs' own sums also run in the same order on both backends);
dispatch_grouped's backward in one combine launch against the pair sum and combine it replaced, on random rows;
an fp8_blockwise dispatch (grouped_dequantize) moves the same bf16 gradients as a bf16 op; several forwards in
flight (bandwidth, low-latency and scatter combines); a checkpointed forward recomputed in the backward (its
dispatch receiving in another order); the layer under torch.compile(fullgraph=True); a forward + backward captured
in one CUDA graph, replayed on new inputs; and examples/train_moe.py's training in bf16 against its dense run.

Run: torchrun --nproc-per-node 2 -m pytest -m multigpu -q tests/gpu/test_ep_autograd.py
"""

import os

import pytest
import torch
import torch.distributed as dist

from runtime import EpDispatchCombineOp
from runtime import autograd as ag
from tests.gpu.dist_util import captured, run_collective
from tests.support.autograd_legs import grouped_step, linear_experts
from tests.support.configs import dist_config
from tests.support.ep_oracle import random_routing
from tests.support.moe_layer_ref import load_example

pytestmark = pytest.mark.multigpu

if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
    pytest.skip("needs torchrun and GPUs", allow_module_level=True)

T, K, EPR, H = 48, 4, 4, 128
# dispatch_grouped's backward as one combine launch (the default; passed here on an H200 before it became one)
ag._ONE_LAUNCH_BACKWARD = True
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _cfg(backend, dtype, **kw):
    return dist_config(hidden_dim=H, max_num_inp_token_per_rank=T, num_experts_per_rank=EPR, num_experts_per_token=K,
                       kernel_backend=backend, data_type=dtype, enable_grouped_layout=True, **kw)


def _inputs(seed, dtype, device="cuda"):
    """(x, weights, ids, expert matrices [EPR, H, H] float32, output gradient), exact in a few bits: x in 1/16ths up
    to 4, weights in 1/8ths, expert entries in {-1, 0, 1} / 8, gradients in {-1, 0, 1} / 2. Every sum the legs, the
    experts and their backward take is then exact in float32 (at most 20 significant bits), so the sums' order
    (CPU against GPU reductions, atomics) cannot show; each rounding to bf16 is of an exact value."""
    g = torch.Generator().manual_seed(seed * 31 + dist.get_rank())
    x = (torch.randint(-64, 65, (T, H), generator=g).float() / 16).to(dtype)
    w = torch.randint(1, 9, (T, K), generator=g).float() / 8
    ids = random_routing(g, T, K, EPR * dist.get_world_size())
    ge = torch.Generator().manual_seed(seed * 31 + 1000 + dist.get_rank())  # this rank's experts
    ew = torch.randint(-1, 2, (EPR, H, H), generator=ge).float() / 8
    grad = (torch.randint(-1, 2, (T, H), generator=g).float() / 2).to(dtype)
    return tuple(t.to(device) for t in (x, w, ids, ew, grad))


def _on(op, tensors):
    return tuple(t.to(op.device) for t in tensors)


def _equal(got, want, what):
    for name, a, b in zip(("out", "grad x", "grad weights", "grad experts"), got, want):
        a, b = a.cpu(), b.cpu()
        assert torch.equal(a, b), f"{what}: {name} differs by {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("dtype,apply_weights,recv_cap,gcap,protocol", [
    ("bf16", True, 0, 0, "bw"), ("fp32", True, 0, 0, "bw"), ("bf16", False, 0, 0, "bw"), ("bf16", True, 0, 0, "ll"),
    ("bf16", True, 60, 0, "bw"),   # a receive cap (~90 rows arrive): rows dropped, zero gradient
    # a small grouped buffer (~180 local pairs): pairs dropped, zero gradient. Which of a cut group's pairs go
    # follows the received rows' order, the (source rank, token) order of the torch backend only where the native
    # one numbers its rows so too: the low-latency protocol, or a receive cap (95 of 96: ordered slots)
    ("bf16", True, 0, 96, "ll"), ("bf16", True, 95, 96, "bw"),
    ("bf16", True, 0, 0, "scatter"),
])
def test_grouped_backward_matches_torch_backend(dtype, apply_weights, recv_cap, gcap, protocol):
    def check():
        kw = dict(max_total_recv_tokens=recv_cap, grouped_capacity=gcap)
        mode = dict(combine_mode="scatter") if protocol == "scatter" else {}
        native = mode or dict(intranode_protocol=protocol)
        with EpDispatchCombineOp(_cfg("native", DTYPES[dtype], **kw, **native)) as op, \
                EpDispatchCombineOp(_cfg("torch", DTYPES[dtype], **kw, **mode)) as ref:
            for seed in (1, 2):
                inputs = _inputs(seed, DTYPES[dtype])
                got = grouped_step(op, *inputs, apply_weights=apply_weights)
                torch.cuda.synchronize()
                want = grouped_step(ref, *_on(ref, inputs), apply_weights=apply_weights)
                _equal(got, want, f"seed {seed}")
    run_collective(check)  # its all-gather is the closing barrier


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("protocol", ["bw", "ll"])
def test_combine_pairs_matches_the_pair_sum_and_its_combine(dtype, protocol):
    """dispatch_grouped's backward in one combine launch (the backend's combine_pairs: each received row summed from
    its pairs' gradient rows, each pair's weight its grouped row's value) against the two launches it replaced
    (sum_pairs, then combine), bit for bit, on random rows: their sums are not exact, so this holds the order of
    the float32 additions, not only the values."""
    def check():
        with EpDispatchCombineOp(_cfg("native", DTYPES[dtype], intranode_protocol=protocol)) as op:
            x, w, ids, _, _ = _inputs(3, DTYPES[dtype])
            with torch.no_grad():
                layout, routing = op.dispatch_grouped(x, w, None, ids, fresh=True)
            g = torch.Generator(device="cuda").manual_seed(5 + dist.get_rank())
            rows = torch.randn(layout.x.shape, generator=g, device="cuda").to(op.config.combine_dtype)
            vals = torch.randn(layout.weights.shape, generator=g, device="cuda")
            want_rows, want_w = op._backend.sum_pairs(rows, layout.pair_pos, vals)
            want = op.combine(want_rows, want_w, routing=routing)
            got = op._combine_pairs(rows, routing, layout.pair_pos, vals)
            unweighted = op._combine_pairs(rows, routing, layout.pair_pos)
            torch.cuda.synchronize()
            assert torch.equal(got[0].cpu(), want[0].cpu()), (got[0].float() - want[0].float()).abs().max()
            assert torch.equal(got[1].cpu(), want[1].cpu()), (got[1] - want[1]).abs().max()
            assert torch.equal(unweighted[0].cpu(), want[0].cpu()) and unweighted[1] is None
            assert got[0].abs().sum() > 0 and got[1].abs().sum() > 0  # rows and weights reached the tokens
    run_collective(check)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("apply_weights,want_dot", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("k,form,hidden", [(0, "rows", 136), (3, "rows", 136), (3, "tokens", 136), (10, "tokens", 136),
                                           (10, "tokens", 2056)])
def test_grouped_scale_kernel(dtype, apply_weights, want_dot, k, form, hidden):
    """combine_grouped's backward kernel on arbitrary values, not the exact ones above: out bit-exact against
    torch's w * x (float32, one rounding) or x, dot within float32 summation error of a float64 <y, x>, and 0 in
    both on padding rows, whose x, y and weight hold NaN (a kernel that read them would show it); out and its
    padding rows start as NaN (torch.empty's memory, filled first). k = 0: x in the grouped layout; k = 3: x the
    received rows, grouped row p taking row src[p] // 3 (pairs in shuffled order), row-major or token-major (the
    pair map given: each x row read once for its pairs; the same bits as row-major, dot included). k = 10: the
    token-major form's pairs in more than one batch (8 bf16 / 4 fp32 columns). H = 136: 17 chunks of 8, fewer
    than a block's threads; H = 2056: 257 chunks, more than a block's threads; 300 rows."""
    def check():
        dt = DTYPES[dtype]
        with EpDispatchCombineOp(_cfg("native", dt)) as op:
            P, Hh = 300, hidden
            gen = torch.Generator().manual_seed(7)
            src = torch.randperm(P, generator=gen).to(torch.int32)  # pair ids, shuffled
            src[torch.randperm(P, generator=gen)[:P // 3]] = -1  # padding rows, scattered
            pad = src < 0
            rows = P if k == 0 else -(-P // k)
            x = torch.randn((rows, Hh), generator=gen).to(dt)
            y = torch.randn((P, Hh), generator=gen).to(dt)
            w = torch.rand((P,), generator=gen)
            y[pad], w[pad] = float("nan"), float("nan")
            at = torch.arange(P) if k == 0 else src.long().clamp(min=0) // k  # row p's x row
            if k == 0:
                x[pad] = float("nan")
            xr = x[at]
            pair_pos = None
            if form == "tokens":  # the inverse map: pair id -> grouped row, -1 for pairs without one
                pair_pos = torch.full((rows * k,), -1, dtype=torch.int32)
                pair_pos[src[~pad].long()] = torch.arange(P, dtype=torch.int32)[~pad]
                pair_pos = pair_pos.cuda()
            args = (x.cuda(), src.cuda(), w.cuda() if apply_weights else None, y.cuda() if want_dot else None)
            torch.empty((P, Hh), dtype=dt, device="cuda").fill_(float("nan"))  # what the next allocation may hold
            out, dot = op._backend.grouped_scale(*args, k=k, pair_pos=pair_pos)
            if form == "tokens":
                row_out, row_dot = op._backend.grouped_scale(*args, k=k)
                assert torch.equal(out, row_out) and (dot is None or torch.equal(dot, row_dot)), "not the same bits"
            want = (xr.float() * w[:, None] if apply_weights else xr.float()).to(dt)
            want[pad] = 0
            assert torch.equal(out.cpu(), want), f"out differs by {(out.cpu().float() - want.float()).abs().max()}"
            if not want_dot:
                assert dot is None
                return
            want_d = (y.double() * xr.double()).sum(1)
            want_d[pad] = 0
            dot = dot.cpu().double()
            assert torch.equal(dot[pad], want_d[pad]), "a padding row's dot is not 0"
            # float32 summation error grows with the terms: about 1e-7 per term of products near 1
            assert torch.allclose(dot, want_d, rtol=1e-5, atol=max(1e-5, 1e-7 * Hh)), (dot - want_d).abs().max()
    run_collective(check)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("with_values", [True, False])
def test_sum_pairs_kernel(dtype, with_values):
    """dispatch_grouped's backward kernel on arbitrary values: every received row (all R of them) the float32 sum in
    ascending column of its pairs' grouped rows, one rounding (bit-exact against the same sum in torch), 0 without a
    pair; with pair values [P], each (row, column) pair's value of its grouped row, 0 without one (bit-exact: a
    gather), None without. Grouped rows that no pair names hold NaN (a kernel that read them would show it)."""
    def check():
        dt = DTYPES[dtype]
        with EpDispatchCombineOp(_cfg("native", dt)) as op:
            cfg = op.config
            R, k, Hh = cfg.max_recv_tokens, cfg.num_experts_per_token, cfg.hidden_dim
            P = R * k + 37  # more grouped rows than pairs: some no pair names
            gen = torch.Generator().manual_seed(11)
            pair_pos = torch.randperm(P, generator=gen)[:R * k].to(torch.int32)  # distinct grouped rows
            pair_pos[torch.randperm(R * k, generator=gen)[:R * k // 3]] = -1  # pairs without a row
            named = torch.zeros(P, dtype=torch.bool)
            named[pair_pos[pair_pos >= 0].long()] = True
            g = torch.randn((P, Hh), generator=gen).to(dt)
            v = torch.randn((P,), generator=gen)
            g[~named], v[~named] = float("nan"), float("nan")
            rows, rows_w = op._backend.sum_pairs(g.cuda(), pair_pos.cuda(), v.cuda() if with_values else None)
            pp = pair_pos.view(R, k).long()
            acc = torch.zeros((R, Hh), dtype=torch.float32)
            for j in range(k):
                has = pp[:, j] >= 0
                acc[has] += g[pp[has, j]].float()
            assert torch.equal(rows.cpu(), acc.to(dt)), (rows.cpu().float() - acc).abs().max()
            if not with_values:
                assert rows_w is None
                return
            want_w = torch.where(pp >= 0, v[pp.clamp(min=0)], torch.zeros(()))
            assert torch.equal(rows_w.cpu(), want_w), (rows_w.cpu() - want_w).abs().max()
    run_collective(check)


def _plain_step(op, x, w, ids, grad):
    """dispatch -> rows times 3 -> combine (weights too) and the backward -> (out, grad x, grad w)."""
    x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    out, out_w, _, _, h = ag.dispatch(op, x, w, ids)
    y, yw = ag.combine(op, out * 3, h, weights=out_w * 2)
    gx, gw = torch.autograd.grad((y, yw), (x, w), (grad, torch.ones_like(yw)))
    return y.detach(), gx, gw


def test_plain_backward_matches_torch_backend():
    def check():
        with EpDispatchCombineOp(_cfg("native", torch.bfloat16)) as op, \
                EpDispatchCombineOp(_cfg("torch", torch.bfloat16)) as ref:
            x, w, ids, _, grad = _inputs(3, torch.bfloat16)
            got = _plain_step(op, x, w, ids, grad)
            torch.cuda.synchronize()
            want = _plain_step(ref, *_on(ref, (x, w, ids, grad)))
            _equal(got, want, "plain legs")
    run_collective(check)


def test_fp8_dispatch_moves_the_gradients_of_a_bf16_op():
    def check():
        fp8 = _cfg("native", torch.bfloat16, dispatch_quant_type="fp8_blockwise", grouped_dequantize=True)
        grads = []
        for cfg in (fp8, _cfg("native", torch.bfloat16)):
            with EpDispatchCombineOp(cfg) as op:
                x, w, ids, _, grad = _inputs(4, torch.bfloat16)
                xx = x.clone().requires_grad_(True)
                layout, h = ag.dispatch_grouped(op, xx, w, ids)
                assert layout.x.dtype == torch.bfloat16
                out = ag.combine_grouped(op, layout.x * 3, h, apply_weights=False)
                grads.append(torch.autograd.grad(out, xx, grad)[0])
                torch.cuda.synchronize()
        assert torch.equal(grads[0], grads[1]), (grads[0].float() - grads[1].float()).abs().max()
    run_collective(check)


@pytest.mark.parametrize("protocol,max_inflight", [("bw", 1), ("ll", 1), ("scatter", 1), ("bw", 2), ("ll", 2)])
def test_forwards_in_flight_keep_their_routing(protocol, max_inflight):
    """The low-latency and scatter combines send rows to the origins of their slot's last dispatch, and with two
    workspace slots the op refuses a stale handle: combining an older handle first replays it where that matters
    (runtime/autograd.py, _combine_through)."""
    def check():
        native = dict(combine_mode="scatter") if protocol == "scatter" else dict(intranode_protocol=protocol)
        with EpDispatchCombineOp(_cfg("native", torch.bfloat16, max_inflight=max_inflight, **native)) as op:
            a, b = _inputs(5, torch.bfloat16), _inputs(6, torch.bfloat16)
            want = [grouped_step(op, *a), grouped_step(op, *b)]
            steps = []
            for x, w, ids, ew, grad in (a, b):  # both dispatches, then both combines, then both backwards
                x, w, ew = (t.clone().requires_grad_(True) for t in (x, w, ew))
                steps.append((x, w, ew, grad, *ag.dispatch_grouped(op, x, w, ids)))
            steps = [(x, w, ew, grad, ag.combine_grouped(op, linear_experts(layout, ew), h))
                     for x, w, ew, grad, layout, h in steps]
            for (x, w, ew, grad, out), wanted in zip(steps, want):
                _equal((out.detach(), *torch.autograd.grad(out, (x, w, ew), grad)), wanted, "in flight")
    run_collective(check)


def test_checkpoint_recomputation_in_arrival_order():
    """torch.utils.checkpoint recomputes the dispatch in the backward, and the bandwidth dispatch (no receive cap)
    receives rows in arrival order, so the recomputation's rows and grouped layout may be ordered differently from
    the first forward's: the backward runs on the recomputation's routing (runtime/autograd.py, _routing_of), and
    the gradients are the torch backend's without checkpointing, bit for bit (exact inputs). Before that, the
    backward took the first forward's routing with the recomputation's rows: gradients as far off as unrelated
    tensors (torchtitan's MoE, two layers checkpointed: relative errors 1.3-1.4)."""
    def check():
        with EpDispatchCombineOp(_cfg("native", torch.bfloat16, intranode_protocol="bw")) as op, \
                EpDispatchCombineOp(_cfg("torch", torch.bfloat16)) as ref:
            for seed in (8, 9, 10):
                inputs = _inputs(seed, torch.bfloat16)
                got = grouped_step(op, *inputs, checkpointed=True)
                torch.cuda.synchronize()
                want = grouped_step(ref, *_on(ref, inputs))
                _equal(got, want, f"checkpointed, seed {seed}")
    run_collective(check)


@pytest.mark.parametrize("protocol,backend,checkpointed", [("bw", "aot_eager", False), ("ll", "aot_eager", False),
                                                            ("bw", "aot_eager", True), ("bw", "inductor", False)])
def test_a_compiled_layer_matches_the_torch_backend(protocol, backend, checkpointed):
    """The layer under torch.compile(fullgraph=True) on the native kernels (its custom ops called by the compiled
    graphs, their backward ops too) against the eager layer on the torch backend: bit-exact, twice (new routings)."""
    def check():
        with EpDispatchCombineOp(_cfg("native", torch.bfloat16, intranode_protocol=protocol)) as op, \
                EpDispatchCombineOp(_cfg("torch", torch.bfloat16)) as ref:
            for seed in (3, 4):
                inputs = _inputs(seed, torch.bfloat16)
                got = grouped_step(op, *inputs, checkpointed=checkpointed, compiled=backend)
                torch.cuda.synchronize()
                want = grouped_step(ref, *_on(ref, inputs))
                _equal(got, want, f"compiled ({backend}), seed {seed}")
    run_collective(check)


def test_forward_and_backward_in_a_cuda_graph():
    def check():
        with EpDispatchCombineOp(_cfg("native", torch.bfloat16)) as op:
            static = [t.clone() for t in _inputs(7, torch.bfloat16)]
            g, res = captured(lambda: grouped_step(op, *static))
            for rep in range(3):
                fresh = _inputs(40 + rep, torch.bfloat16)
                for s, t in zip(static, fresh):
                    s.copy_(t)
                g.replay()
                torch.cuda.synchronize()
                got = [t.clone() for t in res]
                dist.barrier()
                want = grouped_step(op, *fresh)
                torch.cuda.synchronize()
                _equal(got, want, f"replay {rep}")
                dist.barrier()
    run_collective(check)


def test_train_moe_example_matches_its_dense_run_in_bf16():
    def check():
        ex = load_example("train_moe")
        W = dist.get_world_size()
        args = ex.parser().parse_args(["--dtype", "bf16", "--steps", "20", "--hidden", "128", "--experts", str(8 * W),
                                       "--topk", "4", "--intermediate", "64", "--tokens", "64"])
        ok, line = ex.verdict(ex.train(args), torch.bfloat16, W)
        assert ok, line
    run_collective(check)
