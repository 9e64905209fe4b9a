"""Native intranode EP on real GPUs, one process per GPU.

Run: torchrun --nproc-per-node 2 -m pytest -m multigpu -q tests/gpu/test_ep_native.py
"""

import os

import attrs
import pytest
import torch
import torch.distributed as dist

from runtime import EpDispatchCombineOp, InputError
from tests.support.ep_oracle import expected_received, make_inputs, multiplicity
from tests.support.configs import dist_config
from tests.gpu.dist_util import run_collective

pytestmark = pytest.mark.multigpu

if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
    pytest.skip("needs torchrun and GPUs", allow_module_level=True)


def _cfg(T_max, hidden, k, epr, dtype=torch.bfloat16, backend="native"):
    return dist_config(hidden_dim=hidden, max_num_inp_token_per_rank=T_max, num_experts_per_rank=epr,
                       num_experts_per_token=k, data_type=dtype, kernel_backend=backend)


def _inputs(seed, T, cfg, rank=None):
    x, w, idx = make_inputs(seed, dist.get_rank() if rank is None else rank, T, cfg.hidden_dim,
                            cfg.num_experts_per_token, cfg.num_experts, cfg.data_type)
    return x.cuda(), w.cuda(), idx.cuda()


def _check_identity(op, cfg, x, w, idx, seed, T):
    run_collective(lambda: _identity_error(op, cfg, x, w, idx, seed, T))


def _identity_error(op, cfg, x, w, idx, seed, T):
    out, out_w, out_s, out_idx, total, handle = op.dispatch(x, w, None, idx, return_routing=True)
    comb, comb_w = op.combine(out, weights=out_w, routing=handle)
    torch.cuda.synchronize()
    U = torch.tensor(multiplicity(idx.cpu(), cfg.num_experts_per_rank), dtype=torch.float32, device="cuda")
    want = (x.float() * U[:, None]).to(cfg.data_type)
    assert torch.equal(comb, want), f"T={T}: {(comb != want).any(1).sum()} rows differ"
    assert torch.allclose(comb_w, w * U[:, None], rtol=1e-6, atol=0)
    # the received set equals the oracle's, each row equal to its source row
    world, rank = dist.get_world_size(), dist.get_rank()
    all_idx = [make_inputs(seed, r, T, cfg.hidden_dim, cfg.num_experts_per_token, cfg.num_experts,
                           cfg.data_type)[2] for r in range(world)]
    want_rows = expected_received(all_idx, rank, cfg.num_experts_per_rank)
    n = int(total.item())
    assert n == len(want_rows), (n, len(want_rows))
    src = op._backend.recv_src[:n].cpu()
    got = sorted((int(s) // cfg.max_num_inp_token_per_rank, int(s) % cfg.max_num_inp_token_per_rank) for s in src)
    assert got == want_rows
    if n:
        order = torch.argsort(src)
        xs = {r: _inputs(seed, T, cfg, r)[0] for r in range(world)}
        ref = torch.stack([xs[s][t] for s, t in want_rows])
        assert torch.equal(out[:n][order.cuda()], ref)
        ref_idx = torch.stack([_inputs(seed, T, cfg, s)[2][t] for s, t in want_rows[:64]])
        got_idx = out_idx[:n][order.cuda()][:64]
        bad = (got_idx != ref_idx).any(1).nonzero().flatten().tolist()
        assert not bad, f"T={T}: idx rows differ at {bad[:5]}: got {got_idx[bad[:2]].tolist()} want {ref_idx[bad[:2]].tolist()}"
    return None


@pytest.mark.parametrize("hidden,k,epr", [(7168, 8, 128), (2048, 4, 32), (7168, 1, 8), (2048, 8, 8)])
def test_identity(hidden, k, epr):
    cfg = _cfg(4096, hidden, k, epr)
    with EpDispatchCombineOp(cfg) as op:
        for seed, T in enumerate([0, 1, 7, 128, 512, 4096]):
            x, w, idx = _inputs(seed, T, cfg)
            _check_identity(op, cfg, x, w, idx, seed, T)


@pytest.mark.parametrize("blocks,threads,rows", [(1, 32, "wave"), (3, 64, "wave"), (5, 128, "block"), (0, 512, "block")])
def test_identity_at_launch_geometries(blocks, threads, rows):
    """Many rows per wave (the claims run one row ahead of the copies) and whole-block rows."""
    cfg = attrs.evolve(_cfg(4096, 7168, 8, 128), launch_blocks=blocks, launch_threads=threads, launch_rows=rows)
    with EpDispatchCombineOp(cfg) as op:
        for seed, T in enumerate([1, 33, 1000]):
            x, w, idx = _inputs(100 + seed, T, cfg)
            _check_identity(op, cfg, x, w, idx, 100 + seed, T)


def test_fp32_and_back_to_back_calls():
    cfg = _cfg(512, 2048, 8, 32, dtype=torch.float32)
    with EpDispatchCombineOp(cfg) as op:
        x, w, idx = _inputs(5, 300, cfg)
        op.dispatch(x, w, None, idx)  # dispatch twice in a row: the entry barrier protects the buffers
        _check_identity(op, cfg, x, w, idx, 5, 300)
        out, ow, _, _, _, h = op.dispatch(x, w, None, idx, return_routing=True)
        a, _ = op.combine(out, routing=h)
        b, _ = op.combine(out, routing=h)  # combine twice in a row
        assert torch.equal(a, b)


def test_parity_with_torch_backend():
    def check():  # every collective (the torch backend's) first, the asserts after: no rank leaves early
        cfg = _cfg(1024, 4096, 8, 32)
        ref_cfg = _cfg(1024, 4096, 8, 32, backend="torch")
        with EpDispatchCombineOp(cfg) as op, EpDispatchCombineOp(ref_cfg) as ref:
            x, w, idx = _inputs(11, 1000, cfg)
            o1 = op.dispatch(x, w, None, idx, return_routing=True)
            dev = ref._backend.device  # the torch backend runs where its group does (CPU on gloo: ranks sharing GPUs)
            o2 = ref.dispatch(x.to(dev), w.to(dev), None, idx.to(dev), return_routing=True)
            # a non-trivial expert (scale by 3) through both; same combined output
            c1, _ = op.combine((o1[0].float() * 3).to(cfg.data_type), routing=o1[5])
            c2, _ = ref.combine((o2[0].float() * 3).to(cfg.data_type), routing=o2[5])
            n1, n2 = int(o1[4].item()), int(o2[4].item())
            assert n1 == n2
            # same received set: sort the native rows by source id
            order = torch.argsort(op._backend.recv_src[:n1])
            assert torch.equal(o1[0][:n1][order], o2[0][:n2].to(o1[0].device))
            assert torch.equal(o1[3][:n1][order], o2[3][:n2].to(o1[3].device))
            assert torch.equal(c1, c2.to(c1.device))
    run_collective(check)


def _capture_round(op, sx, sw, sidx, warmups=2):
    """Warm up eagerly on a side stream, then capture dispatch -> identity expert into combine_in_view ->
    combine of the static inputs: -> (graph, combined, combined weights, routing handle)."""
    view = op.combine_in_view()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmups):
            out, ow, _, _, tot, h = op.dispatch(sx, sw, None, sidx, return_routing=True)
            view.copy_(out)
            op.combine(view, weights=ow, routing=h)
    torch.cuda.current_stream().wait_stream(s)
    dist.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, ow, _, _, tot, h = op.dispatch(sx, sw, None, sidx, return_routing=True)
        view.copy_(out)
        comb, comb_w = op.combine(view, weights=ow, routing=h)
    return g, comb, comb_w, h


def _replay_and_check(g, comb, comb_w, cfg, x, w, idx, rep):
    """Replay a _capture_round graph (its static inputs hold x, w, idx) and check the identity result."""
    g.replay()
    torch.cuda.synchronize()
    U = torch.tensor(multiplicity(idx.cpu(), cfg.num_experts_per_rank), dtype=torch.float32, device="cuda")
    assert torch.equal(comb, (x.float() * U[:, None]).to(cfg.data_type)), f"replay {rep}"
    assert torch.allclose(comb_w, w * U[:, None], rtol=1e-6, atol=0)


def test_graph_capture_replays():
    cfg = _cfg(128, 7168, 8, 128)
    with EpDispatchCombineOp(cfg) as op:
        T = 128
        sx, sw, sidx = (t.clone() for t in _inputs(100, T, cfg))
        g, comb, comb_w, _ = _capture_round(op, sx, sw, sidx)
        for rep in range(6):
            x, w, idx = _inputs(200 + rep, T, cfg)
            sx.copy_(x), sw.copy_(w), sidx.copy_(idx)
            _replay_and_check(g, comb, comb_w, cfg, x, w, idx, rep)


def test_graph_replay_after_an_eager_dispatch():
    """The entry barrier is decided on the device from the op's last kernel: a replayed dispatch ->
    combine graph (captured after a combine) right after an eager dispatch still waits for the peers to
    be done with the eager dispatch's receive buffers, and eager combines mix with replays."""
    cfg = _cfg(128, 2048, 8, 32)
    with EpDispatchCombineOp(cfg) as op:
        T = 96
        sx, sw, sidx = (t.clone() for t in _inputs(300, T, cfg))
        g, comb, comb_w, _ = _capture_round(op, sx, sw, sidx, warmups=1)
        for rep in range(4):
            x, w, idx = _inputs(400 + rep, T, cfg)
            op.dispatch(x, w, None, idx)  # eager dispatch, no combine: the replay's dispatch comes next
            if rep % 2:
                _check_identity(op, cfg, x, w, idx, 400 + rep, T)  # eager dispatch -> combine in between
            sx.copy_(x), sw.copy_(w), sidx.copy_(idx)
            _replay_and_check(g, comb, comb_w, cfg, x, w, idx, rep)


def test_bad_expert_id_raises_and_op_stays_usable(monkeypatch):
    cfg = _cfg(64, 2048, 4, 8)
    x, w, idx = _inputs(7, 64, cfg)
    bad = idx.clone()
    bad[3, 1] = cfg.num_experts + 5
    # default ("async"): the kernel notes the id in host-mapped memory, op.check() raises (the next eager
    # call would warn InputWarning); the offending dispatch itself does not synchronise
    monkeypatch.delenv("EPGEN_CHECK_EXPERT_IDS", raising=False)
    with EpDispatchCombineOp(cfg) as op:
        assert op._backend.id_check == "async"
        op.dispatch(x, w, None, bad)
        torch.cuda.synchronize()
        with pytest.raises(InputError, match=f"expert id {cfg.num_experts + 5} >= num_experts={cfg.num_experts}"):
            op.check()
        op.check()  # reported once
        with pytest.raises(InputError):
            op.dispatch(x.float(), w, None, idx)
        _check_identity(op, cfg, x, w, idx, 7, 64)
    # "sync": a device reduction read by the host, raised by the offending call before any launch
    monkeypatch.setenv("EPGEN_CHECK_EXPERT_IDS", "sync")
    with EpDispatchCombineOp(cfg) as op:
        with pytest.raises(InputError, match="num_experts"):
            op.dispatch(x, w, None, bad)
        _check_identity(op, cfg, x, w, idx, 7, 64)


def test_bad_ids_in_graph_are_dropped_and_counted(monkeypatch):
    monkeypatch.setenv("EPGEN_CHECK_EXPERT_IDS", "off")
    cfg = _cfg(64, 2048, 4, 8)
    with EpDispatchCombineOp(cfg) as op:
        x, w, idx = _inputs(8, 64, cfg)
        idx[0, :] = cfg.num_experts + 1  # token 0 has only bad ids: nothing sent, combine gives zeros
        out, ow, _, _, tot, h = op.dispatch(x, w, None, idx, return_routing=True)
        comb, _ = op.combine(out, routing=h)
        torch.cuda.synchronize()
        op.check()  # "off": noted by the kernel, never raised
        assert op._backend.counters()["bad_ids"] == cfg.num_experts_per_token
        assert torch.equal(comb[0], torch.zeros_like(comb[0]))
