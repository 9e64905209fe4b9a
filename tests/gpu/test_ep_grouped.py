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

from runtime.config import load_specs
from runtime import EpDispatchCombineConfig, EpDispatchCombineOp
from tests.support.ep_oracle import random_routing
from tests.support.configs import dist_config
from tests.gpu.dist_util import captured as _captured, run_collective
from tests.support.grouped_oracle import MODE_FIELDS, expert_rows

pytestmark = pytest.mark.multigpu

if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
    pytest.skip("needs torchrun and GPUs", allow_module_level=True)

T, K, EPR = 64, 8, 8
MODES = {mode: (256, MODE_FIELDS[mode]) for mode in ("bf16", "fp32", "fp8", "fp8_blockwise")}  # (hidden, fields)
# rows of 544 16-byte vectors: past one placing wave's chunk (grouped_common.j2 EPG_PLACE_CHUNK x 32 lanes)
MODES["bf16_wide"] = (4352, MODE_FIELDS["bf16"])


def _payload(mode):
    """The oracle's payload mode of a test mode."""
    return mode.removesuffix("_wide")


def _cfg(backend, mode, tokens=T, **kw):
    hidden, fields = MODES[mode]
    return dist_config(hidden_dim=hidden, max_num_inp_token_per_rank=tokens, num_experts_per_rank=EPR,
                       num_experts_per_token=K, kernel_backend=backend, enable_grouped_layout=True, **fields, **kw)


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
    y = expert_rows(layout, _payload(mode), op.config.combine_dtype, dist.get_rank() * EPR)
    return layout, h, op.combine_grouped(y, h)[0], op.combine_grouped(y, h, apply_weights=False)[0]


@pytest.mark.parametrize("mode,protocol,recv_cap,gcap,tokens", [
    ("bf16", "bw", 0, 0, T), ("bf16", "ll", 0, 0, T), ("fp32", "bw", 0, 0, T), ("fp8", "bw", 0, 0, T),
    ("fp8_blockwise", "bw", 0, 0, T),
    ("bf16", "bw", 120, 128, T),        # receive cap: (source rank, token) order; a small buffer: drops
    ("fp8_blockwise", "bw", 100, 0, T),
    ("bf16", "bw", 2000, 0, 1024),      # 16000 pairs: the counting kernel's blocks take several steps
    # rows longer than a placing wave's chunk: a small batch copies each in chunks over several waves, a large
    # one (more pairs than the placing grid has waves) a whole row per wave
    ("bf16_wide", "ll", 0, 0, T), ("bf16_wide", "bw", 0, 0, 1024),
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


@pytest.mark.parametrize("epr,align,gcap,tokens", [
    (700, 16, 0, 256),     # more experts than the placement block has threads: two per thread in its prefix
    (700, 3, 0, 256),      # an alignment that is no power of two
    (300, 16, 2048, 256),  # groups past a small buffer: the serial recurrence, with drops
    (700, 3, 0, 64),       # a small batch: every placing block numbers the pairs itself (count_here)
])
def test_grouped_many_experts_match_torch_backend(epr, align, gcap, tokens):
    def check():
        W = dist.get_world_size()
        kw = dict(rank=dist.get_rank(), world_size=W, hidden_dim=256, max_num_inp_token_per_rank=tokens,
                  num_experts_per_rank=epr, num_experts_per_token=K, enable_grouped_layout=True,
                  expert_alignment=align, grouped_capacity=gcap, data_type=torch.bfloat16)
        with EpDispatchCombineOp(EpDispatchCombineConfig(kernel_backend="native", **kw)) as op, \
                EpDispatchCombineOp(EpDispatchCombineConfig(kernel_backend="torch", **kw)) as ref:
            g = torch.Generator().manual_seed(7 + dist.get_rank())
            x = (torch.randint(-64, 65, (tokens, 256), generator=g).float() / 16).to(torch.bfloat16)
            w = torch.randint(1, 64, (tokens, K), generator=g).float() / 64
            idx = random_routing(g, tokens, K, epr * W)
            lay, h = op.dispatch_grouped(x.cuda(), w.cuda(), None, idx.cuda())
            torch.cuda.synchronize()
            rlay, rh = ref.dispatch_grouped(*(t.to(ref.device) for t in (x, w)), None, idx.to(ref.device))
            assert lay.offs.tolist() == rlay.offs.tolist()
            assert lay.counts.tolist() == rlay.counts.tolist() and int(lay.dropped) == int(rlay.dropped)
            assert _groups(lay, _native_ids(op), K) == _groups(rlay, _torch_ids(rh, tokens), K)
            y = expert_rows(lay, "bf16", op.config.combine_dtype, dist.get_rank() * epr)
            ry = expert_rows(rlay, "bf16", ref.config.combine_dtype, dist.get_rank() * epr)
            assert torch.equal(op.combine_grouped(y, h)[0].cpu(), ref.combine_grouped(ry, rh)[0].cpu())
            assert (int(lay.dropped) > 0) == bool(gcap), int(lay.dropped)
    run_collective(check)


@pytest.mark.parametrize("protocol,tokens", [("auto", T), ("ll", 8)])
def test_grouped_round_in_a_cuda_graph(protocol, tokens):
    """A captured grouped round replays what eager calls give. At 8 tokens under the low-latency protocol the graph
    holds dispatch_ll + the separate placement and combine_grouped as one combine_ll (one_kernel_legs' choice inside
    a graph), the eager calls take dispatch_ll's tail: the same bits."""
    def check():
        mode = "bf16"
        with EpDispatchCombineOp(_cfg("native", mode, tokens, intranode_protocol=protocol)) as op:
            x, w, s, idx = _inputs(5, mode, "cuda", tokens)
            sx, sw, sidx = x.clone(), w.clone(), idx.clone()
            g, (_, _, res, _) = _captured(lambda: _round(op, sx, sw, None, sidx, mode))
            for rep in range(3):
                x, w, _, idx = _inputs(40 + rep, mode, "cuda", tokens)
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


# --- grouped_out_view: the expert rows in a buffer of the op's own -------------------------------------------
def _round_view(op, x, w, s, idx, mode, routing=None):
    """combine_grouped with the expert rows written into grouped_out_view, then with the same rows from a tensor of
    their own, weighted and unweighted."""
    layout, h = op.dispatch_grouped(x, w, s, idx, routing=routing)
    y = expert_rows(layout, _payload(mode), op.config.combine_dtype, dist.get_rank() * EPR)
    view = op.grouped_out_view()
    view.copy_(y)
    in_view = op.combine_grouped(view, h)[0]
    return layout, h, in_view, op.combine_grouped(y, h)[0], op.combine_grouped(y, h, apply_weights=False)[0]


@pytest.mark.parametrize("mode,recv_cap,gcap,tokens", [
    ("bf16", 0, 0, T), ("fp32", 0, 0, T), ("fp8", 0, 0, T), ("fp8_blockwise", 0, 0, T),
    ("bf16", 120, 128, T),       # receive cap and a small grouped buffer: dropped pairs never combined
    ("bf16", 2000, 0, 1024),
])
def test_combine_grouped_from_grouped_out_view_is_bit_exact(mode, recv_cap, gcap, tokens):
    """Expert rows in grouped_out_view or in a tensor of their own: the same bits as each other and as the torch
    backend, eager, with routing replay."""
    def check():
        kw = dict(max_total_recv_tokens=recv_cap, grouped_capacity=gcap, tokens=tokens)
        with EpDispatchCombineOp(_cfg("native", mode, **kw)) as op, EpDispatchCombineOp(_cfg("torch", mode, **kw)) as ref:
            handles, idx0 = (None, None), None
            for attempt, seed in enumerate((1, 2)):
                x, w, s, idx = _inputs(seed, mode, "cuda", tokens)
                if attempt:
                    idx = idx0
                _, hn, in_view, own, unweighted = _round_view(op, x, w, s, idx, mode, handles[0])
                torch.cuda.synchronize()
                cpu = (None if t is None else t.to(ref.device) for t in (x, w, s, idx))
                _, hr, rcomb, rcomb_u = _round(ref, *cpu, mode, handles[1])
                if not attempt:
                    handles, idx0 = (hn, hr), idx
                assert torch.equal(in_view, own), (in_view.float() - own.float()).abs().max()
                assert torch.equal(own.cpu(), rcomb.cpu()) and torch.equal(unweighted.cpu(), rcomb_u.cpu())
    run_collective(check)  # its all-gather is the closing barrier


def test_combine_grouped_from_grouped_out_view_in_a_cuda_graph():
    """The round captured (the expert rows written into grouped_out_view inside the graph) replays to the eager
    bits of another op."""
    def check():
        mode = "bf16"
        with EpDispatchCombineOp(_cfg("native", mode)) as gop, EpDispatchCombineOp(_cfg("native", mode)) as op:
            x, w, _, idx = _inputs(7, mode, "cuda")
            sx, sw, sidx = x.clone(), w.clone(), idx.clone()
            g, (_, _, res, res_own, _) = _captured(lambda: _round_view(gop, sx, sw, None, sidx, mode))
            for rep in range(3):
                x, w, _, idx = _inputs(60 + rep, mode, "cuda")
                sx.copy_(x), sw.copy_(w), sidx.copy_(idx)
                g.replay()
                torch.cuda.synchronize()
                got, got_own = res.clone(), res_own.clone()
                dist.barrier()
                want = _round(op, x, w, None, idx, mode)[2]
                torch.cuda.synchronize()
                assert torch.equal(got, want), f"replay {rep}: {(got.float() - want.float()).abs().max()}"
                assert torch.equal(got_own, want)
                dist.barrier()
    run_collective(check)  # its all-gather is the closing barrier


# --- one kernel per leg: dispatch_grouped places the layout in its dispatch kernel's tail, combine_grouped stages
# the received rows from the groups in its combine kernel (templates/kernels/grouped_tail.j2) ------------------
def _snapshot(lay):
    keep = lay.src >= 0
    return {"offs": lay.offs.clone(), "counts": lay.counts.clone(), "dropped": lay.dropped.clone(),
            "src": lay.src.clone(), "m_indices": lay.m_indices.clone(), "weights": lay.weights.clone(),
            "x": lay.x.view(torch.uint8)[keep].clone(),
            "scales": None if lay.scales is None else lay.scales.view(torch.uint8)[keep].clone(),
            "pair_pos": lay.pair_pos.clone()}


@pytest.mark.parametrize("mode,protocol,gcap,tokens", [
    ("bf16", "bw", 0, T), ("bf16", "ll", 0, T), ("fp32", "bw", 0, T), ("fp32", "ll", 0, T), ("fp8_blockwise", "bw", 0, T),
    ("fp8", "ll", 0, T),  # a pre-quantized payload: its scales placed beside it
    ("bf16", "bw", 128, T),  # a small buffer: drops, the serial recurrence
    # past limits.small_pairs: the tail counts behind a second grid barrier and the standalone passes launch
    # grouped_count; the smaller batch after it is numbered in-block by the tail, by grouped_count standalone
    ("bf16", "bw", 0, 512), ("bf16", "ll", 0, 512), ("bf16_wide", "ll", 0, T),
    # few pairs (total_recv * k <= limits.small_pairs): the low-latency dispatch places rows straight from its slots
    # into the groups (no receive pass, no grid barrier); the combine forms each row as it pushes it
    ("bf16", "ll", 0, 8), ("fp32", "ll", 0, 4), ("fp8", "ll", 0, 8), ("bf16_wide", "ll", 0, 8), ("bf16", "ll", 32, 8),
])
def test_one_kernel_per_leg_matches_the_separate_passes(mode, protocol, gcap, tokens):
    def check():
        with EpDispatchCombineOp(_cfg("native", mode, tokens, intranode_protocol=protocol, grouped_capacity=gcap)) as op:
            assert op._backend.fuses_layout
            small_pairs = op._backend.k["grouped_place"].limits["small_pairs"]
            assert op._backend._grp["count_here"] == (op.config.max_recv_tokens * K <= small_pairs)
            op._backend.one_kernel = "always"  # auto takes it for eager low-latency calls only
            x, w, s, idx = _inputs(3, mode, "cuda", tokens)
            lay, h = op.dispatch_grouped(x, w, s, idx)  # the dispatch kernel's tail
            one = _snapshot(lay)
            y = expert_rows(lay, _payload(mode), op.config.combine_dtype, dist.get_rank() * EPR)
            staged = op.combine_grouped(y, h)[0].clone()  # one combine kernel
            staged_u = op.combine_grouped(y, h, apply_weights=False)[0].clone()
            op.dispatch(x, w, s, idx, routing=h)  # replay: the same rows in the same slots
            two = _snapshot(op.grouped_layout())  # the standalone grouped_count + grouped_place
            for name, got in one.items():
                want = two[name]
                assert (got is None) == (want is None) and (got is None or torch.equal(got, want)), name
            reduced = op.combine(op._backend.grouped_reduce(y, True), routing=h)[0]  # the reduce pass, then combine
            assert torch.equal(staged, reduced), (staged.float() - reduced.float()).abs().max()
            reduced_u = op.combine(op._backend.grouped_reduce(y, False), routing=h)[0]
            assert torch.equal(staged_u, reduced_u)
            if gcap:
                assert int(lay.dropped) > 0
            # a smaller batch after a larger one: the rows past its groups are padding again
            small = tuple(None if t is None else t[: tokens // 8] for t in (x, w, s, idx))
            lay2, h2 = op.dispatch_grouped(*small)
            end = int(lay2.offs[-1])
            assert bool((lay2.src[end:] == -1).all()) and bool((lay2.m_indices[end:] == -1).all())
            assert bool((lay2.weights[end:] == 0).all())
            one2 = _snapshot(lay2)
            op.dispatch(*small, routing=h2)
            two2 = _snapshot(op.grouped_layout())
            for name, got in one2.items():
                want = two2[name]
                assert (got is None) == (want is None) and (got is None or torch.equal(got, want)), name
    run_collective(check)


@pytest.mark.parametrize("mode,tokens", [("bf16", 8), ("bf16_wide", 8), ("bf16", 64)])
def test_a_one_kernel_dispatch_after_the_separate_passes_marks_their_rows(mode, tokens):
    """The standalone placement (a graph's, or one_kernel "never"'s) fills rows up to its layout's end and marks every
    row past it; a later one-kernel dispatch of a smaller batch (dispatch_ll's tail) must re-mark the rows between its
    end and that one's, which held pair ids and experts: the placement records its end in the op's state
    (grouped_end), which the tail reads. The small layout's rows below its end hold exactly its own pairs."""
    def check():
        with EpDispatchCombineOp(_cfg("native", mode, tokens, intranode_protocol="ll")) as op:
            be = op._backend
            x, w, s, idx = _inputs(9, mode, "cuda", tokens)
            be.one_kernel = "never"
            big, _ = op.dispatch_grouped(x, w, s, idx)  # dispatch_ll + the standalone grouped_place
            end_big = int(big.offs[-1])
            be.one_kernel = "always"
            small, _ = op.dispatch_grouped(x[:1], w[:1], None, idx[:1])  # dispatch_ll with its tail
            end = int(small.offs[-1])
            assert end < end_big, (end, end_big)
            assert bool((small.src[end:] == -1).all()) and bool((small.m_indices[end:] == -1).all())
            assert bool((small.weights[end:] == 0).all())
            assert int((small.src[:end] >= 0).sum()) == int(small.counts.sum())  # the small batch's own pairs
    run_collective(check)


def _exact(lay, rlay, total, k, what):
    """The native layout equals the torch backend's bit for bit: received rows in (source rank, token) order."""
    keep = rlay.src >= 0
    for name in ("offs", "counts", "src", "m_indices", "weights"):
        got, want = getattr(lay, name).cpu(), getattr(rlay, name).cpu()
        assert torch.equal(got, want), f"{what}: {name} differs at {(got != want).nonzero().flatten()[:8].tolist()}"
    assert int(lay.dropped) == int(rlay.dropped), what
    assert torch.equal(lay.x.view(torch.uint8).cpu()[keep.cpu()], rlay.x.view(torch.uint8).cpu()[keep.cpu()]), what
    n = total * k
    assert torch.equal(lay.pair_pos.cpu()[:n].long(), rlay.pair_pos.cpu()[:n].long()), what


def _same_groups(lay, rlay, k, what, op, rh):
    """The native layout holds the torch backend's groups, its rows numbered in arrival order: offsets, counts and
    drops equal, each group the same set of (source token, column) rows with the same bytes, weight and expert."""
    for name in ("offs", "counts"):
        assert getattr(lay, name).tolist() == getattr(rlay, name).tolist(), f"{what}: {name} differs"
    assert int(lay.dropped) == int(rlay.dropped), what
    assert _groups(lay, _native_ids(op), k) == _groups(rlay, _torch_ids(rh, op.config.max_num_inp_token_per_rank), k), what


@pytest.mark.parametrize("mode,epr,align,gcap,tokens,direct,k", [
    ("bf16", EPR, 16, 0, T, "always", K), ("fp32", EPR, 16, 0, T, "always", K), ("bf16", EPR, 16, 0, 1, "always", K),
    ("bf16", EPR, 16, 128, T, "always", K),   # a small buffer: drops, the serial cut
    ("bf16", EPR, 3, 0, 512, "always", K),    # an alignment that is no power of two
    ("bf16", EPR, 16, 0, 4096, "always", K),  # more tokens per block than it numbers at once (EPG_DIRECT_CHUNK)
    ("bf16_wide", EPR, 16, 0, T, "always", K),
    ("bf16", 700, 16, 0, 64, "always", K),    # 1400 (rank, expert) counters of the 1536 the kernel holds
    ("bf16", EPR, 16, 0, 512, "always", 6),   # top-k below eight: ids past k count in the histograms' spare bucket
    ("bf16", 16, 16, 0, 512, "always", 10),   # top-k past eight: a token's ids past the first eight counted after them
    # the same ops with the direct kernel turned off: the dispatch and the grouped passes into the workspace's buffers
    # (rows numbered as they arrive, so the groups are compared as sets, with no drops: which pairs a full buffer
    # drops follows that order)
    ("bf16", EPR, 16, 0, T, "never", K), ("bf16", 700, 16, 0, 64, "never", K),
])
def test_direct_dispatch_matches_torch_backend(mode, epr, align, gcap, tokens, direct, k):
    """The direct grouped dispatch (templates/kernels/dispatch_direct.j2: counts first, then each kept pair's row
    stored straight into its group on the destination; NativeBackend.direct "always", as "auto" takes it) gives the
    torch backend's layout exactly (both number the received rows in (source rank, token) order): rows, src,
    m_indices, weights, offs, counts, drops and the pair map; then combine_grouped bit-exact; then a smaller batch
    on the same buffers (the rows past its groups marked as padding again) and a replay of the first routing.
    With "never", the separate kernels on such an op (its grouped buffers in the workspace) number the received rows
    as they arrive: the same groups as sets of (source token, column) rows, the same offsets, counts and combine."""
    def check():
        W = dist.get_world_size()
        hidden, fields = MODES[mode]
        kw = dict(rank=dist.get_rank(), world_size=W, hidden_dim=hidden, max_num_inp_token_per_rank=tokens,
                  num_experts_per_rank=epr, num_experts_per_token=k, enable_grouped_layout=True,
                  expert_alignment=align, grouped_capacity=gcap, intranode_protocol="bw", **fields)
        with EpDispatchCombineOp(EpDispatchCombineConfig(kernel_backend="native", **kw)) as op, \
                EpDispatchCombineOp(EpDispatchCombineConfig(kernel_backend="torch", **kw)) as ref:
            be = op._backend
            # the kernel's (rank, expert) and per-rank counters must fit its shared memory: past that (700 experts
            # at 4 ranks) the op refuses the direct kernel and "always" runs the separate passes, checked as "never"
            fits = W * epr + W <= dict(load_specs().arglists["ep"].limits)["direct_buckets"]
            assert be.plan.direct == fits and (not fits or "dispatch_direct" in be.k), (W, epr)
            be.direct = direct
            exact = direct == "always" and fits  # the direct kernel runs: the torch backend's numbering
            launched = []
            launch, launch_struct = be.k.launch, be.k.launch_struct  # the passes, the EP kernels
            be.k.launch = lambda role, *a, **k: launched.append(role) or launch(role, *a, **k)
            be.k.launch_struct = lambda role, *a, **k: launched.append(role) or launch_struct(role, *a, **k)
            g = torch.Generator().manual_seed(11 + dist.get_rank())
            dt = fields.get("data_type", torch.bfloat16)
            for n in (tokens, max(1, tokens // 8)):
                x = (torch.randint(-64, 65, (n, hidden), generator=g).float() / 16).to(dt)
                w = torch.randint(1, 64, (n, k), generator=g).float() / 64
                idx = random_routing(g, n, k, epr * W)
                launched.clear()
                lay, h = op.dispatch_grouped(x.cuda(), w.cuda(), None, idx.cuda())
                if exact:
                    assert launched == ["dispatch_direct"] and be._placed, launched
                else:
                    assert "dispatch_direct" not in launched and launched[0] == "dispatch", launched
                torch.cuda.synchronize()
                op.check()
                rlay, rh = ref.dispatch_grouped(x.to(ref.device), w.to(ref.device), None, idx.to(ref.device))
                total = int(op._backend.total_recv)
                assert total == rh.total_recv, (total, rh.total_recv)
                def same(got, what):  # the direct kernel's numbering, or the separate passes' arrival order
                    if exact:
                        _exact(got, rlay, total, k, what)
                    else:
                        _same_groups(got, rlay, k, what, op, rh)
                same(lay, f"{n} tokens")
                y = expert_rows(lay, _payload(mode), op.config.combine_dtype, dist.get_rank() * epr)
                ry = expert_rows(rlay, _payload(mode), ref.config.combine_dtype, dist.get_rank() * epr)
                got, want = op.combine_grouped(y, h)[0].cpu(), ref.combine_grouped(ry, rh)[0].cpu()
                assert torch.equal(got, want), (got.float() - want.float()).abs().max()
                if gcap and n == tokens:  # the smaller batch may fit the small buffer
                    assert int(lay.dropped) > 0, "the small buffer dropped nothing"
                # a replay of this routing takes the separate passes (a handle given): the same layout
                op.dispatch(x.cuda(), w.cuda(), None, idx.cuda(), routing=h)
                same(op.grouped_layout(), f"{n} tokens, replayed")
    run_collective(check)


@pytest.mark.parametrize("mode,protocol,one_kernel,give_x,tokens", [
    ("bf16", "bw", "never", True, T), ("bf16", "ll", "always", False, T),
    ("bf16", "bw", "always", True, T), ("fp8_blockwise", "bw", "never", False, T),
    ("fp8", "ll", "always", True, T), ("fp32", "bw", "never", False, T),
    ("bf16", "bw", "always", False, T),
    # few pairs: the low-latency dispatch's receive straight into the groups
    ("bf16", "ll", "always", False, 8), ("fp8", "ll", "always", True, 8),
])
def test_dispatch_grouped_into_a_fresh_layout(mode, protocol, one_kernel, give_x, tokens):
    """dispatch_grouped(fresh=True) / (out_x=...) on both placements (the standalone grouped_place, the dispatch
    kernel's tail): every tensor of the layout is the call's own, written whole although each was filled with 0x7f
    bytes first (an int32 0x7f7f7f7f, a huge float): every kept row and every int32 bit-identical to the op's own
    buffers after a replay, every row without a pair zeroed, the pair map -1 past the received rows; the combine
    reads the fresh layout's pair map (the op's own is wiped first); a later grouped_layout() places into the op's
    buffers again. Groups padded to 3 rows: padding inside the groups."""
    def check():
        with EpDispatchCombineOp(_cfg("native", mode, tokens, intranode_protocol=protocol,
                                      expert_alignment=3)) as op:
            be = op._backend
            be.one_kernel = one_kernel
            made = be.fresh_grouped

            def dirty(out_x=None):  # the fresh tensors as an allocator may hand them out: anything in them
                t = made(out_x)
                for part in (t["x"], t["scales"], t["block"], t["weights"]):
                    if part is not None:
                        part.view(torch.uint8).fill_(0x7F)
                return t
            be.fresh_grouped = dirty
            x, w, s, idx = _inputs(5, mode, "cuda", tokens)
            shape, dtype = op.grouped_x_spec()
            out = torch.empty(shape, dtype=dtype, device="cuda") if give_x else None
            lay, h = op.dispatch_grouped(x, w, s, idx, out_x=out, fresh=True)
            assert lay.block is not None and (lay.x is out if give_x else lay.x.data_ptr() != be._grp["x"].data_ptr())
            assert lay.pair_pos.data_ptr() != be._grp["pair_pos"].data_ptr()
            assert not bool((lay.block == 0x7F7F7F7F).any()), "an int32 of the fresh layout was left unwritten"
            fresh = _snapshot(lay)
            pad = (lay.src < 0).cpu()
            assert int(pad[: int(lay.offs[-1])].sum()) > 0, "no padding inside the groups: the test shows nothing"
            assert bool((lay.x.view(torch.uint8).cpu()[pad] == 0).all()), "a row without a pair is not zeroed"
            rows = int(be.total_recv)
            assert bool((lay.pair_pos[rows * op.config.num_experts_per_token:] == -1).all())
            y = expert_rows(lay, mode, op.config.combine_dtype, dist.get_rank() * EPR)
            be._grp["pair_pos"].fill_(-1)  # the combine must take the fresh layout's map, not the op's buffer
            got = op.combine_grouped(y, h)[0].clone()
            op.dispatch(x, w, s, idx, routing=h)  # replay into the op's own buffers
            own = _snapshot(op.grouped_layout())
            for name, g in fresh.items():
                want = own[name]
                assert (g is None) == (want is None) and (g is None or torch.equal(g, want)), name
            assert op.grouped_layout().x.data_ptr() != lay.x.data_ptr()
            assert torch.equal(got, op.combine(be.grouped_reduce(y, True), routing=h)[0])
    run_collective(check)


# --- memory: the report against what the op's construction allocates -----------------------------------------
@pytest.mark.parametrize("gcap", [0, 256])
def test_memory_report_holds_against_the_bytes_allocated(gcap):
    from runtime import workspace

    def check():
        workspace.release_workspaces()  # the op's workspace is allocated afresh, not taken from the pool
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        op = EpDispatchCombineOp(_cfg("native", "bf16", grouped_capacity=gcap))
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated() - before
        report = op.memory_report()
        others = report["other_device_buffers"]
        # torch's allocator rounds each tensor up to 512 bytes; the workspace is torch's only with the symmetric
        # allocator (the default, vendor IPC, allocates it outside torch)
        lo = sum(others.values())
        slack = 512 * (len(others) + 8)
        ws = report["symmetric_workspace"] if workspace.allocator_name() == "symmetric" else 0
        print(f"rank {dist.get_rank()}: grouped_capacity={gcap}: torch allocated {grown} B at construction, the "
              f"report's local buffers {lo} B (+ workspace {report['symmetric_workspace']} B)")
        assert lo + ws <= grown <= lo + ws + slack, (grown, lo, ws, others)
        assert report["total_device_bytes"] == report["symmetric_workspace"] + lo
        op.close()
    run_collective(check)
