"""MoE-integration features of the native backend on real GPUs.

Run: torchrun --nproc-per-node 2 -m pytest -m multigpu -q tests/gpu/test_ep_moe.py
"""

import functools
import os

import pytest
import torch
import torch.distributed as dist

from runtime import EpDispatchCombineOp
from tests.support.ep_oracle import multiplicity, random_routing
from tests.support.configs import dist_config
from tests.gpu.dist_util import run_collective

pytestmark = pytest.mark.multigpu

if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
    pytest.skip("needs torchrun and GPUs", allow_module_level=True)

H, T, K, EPR = 2048, 256, 8, 16


_cfg = functools.partial(dist_config, hidden_dim=H, max_num_inp_token_per_rank=T, num_experts_per_rank=EPR,
                         num_experts_per_token=K, data_type=torch.bfloat16)


def _inputs(seed, rank):
    g = torch.Generator().manual_seed(seed * 31 + rank)
    x = (torch.randint(-64, 65, (T, H), generator=g).float() / 16).to(torch.bfloat16)
    w = torch.randint(1, 64, (T, K), generator=g).float() / 64
    return x.cuda(), w.cuda(), random_routing(g, T, K, EPR * dist.get_world_size()).cuda()


def test_routing_replay_lands_in_the_same_rows():
    def check():
        with EpDispatchCombineOp(_cfg()) as op:
            x, w, idx = _inputs(1, dist.get_rank())
            out, ow, _, oi, total, h = op.dispatch(x, w, None, idx, return_routing=True)
            first = out.clone()
            n = int(total.item())
            y = (x.float() * 2).to(torch.bfloat16)
            out2, _, _, _, total2 = op.dispatch(y, w, None, idx, routing=h)
            torch.cuda.synchronize()
            assert int(total2.item()) == n
            assert torch.equal(out2[:n].float(), first[:n].float() * 2), "replayed rows moved"
            comb, _ = op.combine(out2, routing=h)
            U = torch.tensor(multiplicity(idx.cpu(), EPR), dtype=torch.float32, device="cuda")
            assert torch.equal(comb, (y.float() * U[:, None]).to(torch.bfloat16))
    run_collective(check)  # its all-gather is the closing barrier


def test_local_expert_counts_sum_to_valid_pairs():
    def check():
        with EpDispatchCombineOp(_cfg()) as op:
            x, w, idx = _inputs(2, dist.get_rank())
            op.dispatch(x, w, None, idx)
            counts = op.local_expert_count()
            total = counts.sum().clone()
            dist.all_reduce(total)
            # every valid (token, k) pair of every rank is counted once on the rank owning its expert
            valid = torch.tensor(int((idx >= 0).sum()), device="cuda")
            dist.all_reduce(valid)
            assert int(total) == int(valid), (int(total), int(valid))
    run_collective(check)  # its all-gather is the closing barrier


def test_cap_drops_exactly_the_counted_rows():
    def check():
        cap = 64  # far below the worst case: forced overflow
        world, me = dist.get_world_size(), dist.get_rank()
        with EpDispatchCombineOp(_cfg(max_total_recv_tokens=cap)) as op:
            x, w, idx = _inputs(3, me)
            first = None
            for attempt in range(3):  # the same rows are kept and dropped every time
                out, ow, _, oi, total, h = op.dispatch(x, w, None, idx, return_routing=True)
                torch.cuda.synchronize()
                n, dropped = int(total.item()), int(op.dropped_count())
                got = (out[:n].clone(), oi[:n].clone(), h.extra["map"].slots.clone())
                if first is None:
                    first = got
                assert all(torch.equal(a, b) for a, b in zip(got, first)), f"attempt {attempt} differs"
                op.combine(op.combine_in_view(), routing=h)
            # the oracle: rows addressed to this rank in (source rank, token) order, the first `cap` kept
            xs = [torch.empty_like(x) for _ in range(world)]
            ids = [torch.empty_like(idx) for _ in range(world)]
            dist.all_gather(xs, x)
            dist.all_gather(ids, idx)
            rows = [(src, t) for src in range(world) for t, row in enumerate(ids[src].tolist())
                    if any(e >= 0 and e // EPR == me for e in row)]
            assert n == min(cap, len(rows)), f"total_recv {n}, cap {cap}, addressed {len(rows)}"
            assert n + dropped == len(rows), f"received {n} + dropped {dropped} != {len(rows)}"
            want = torch.stack([xs[src][t] for src, t in rows[:n]])
            assert torch.equal(first[0], want), "kept rows are not the first `cap` in (source, token) order"
            assert torch.equal(first[1], torch.stack([ids[src][t] for src, t in rows[:n]]))
            # the slots in the handle never point past the cap
            assert int((first[2] // world).max()) < cap
    run_collective(check)  # its all-gather is the closing barrier


def test_zero_copy_and_staged_combine_agree():
    def check():
        with EpDispatchCombineOp(_cfg()) as op:
            x, w, idx = _inputs(4, dist.get_rank())
            out, ow, _, _, _, h = op.dispatch(x, w, None, idx, return_routing=True)
            expert = (out.float() * 3 - 1).to(torch.bfloat16)
            staged, _ = op.combine(expert, routing=h)
            view = op.combine_in_view()
            view.copy_(expert)
            zero_copy, _ = op.combine(view, routing=h)
            assert torch.equal(staged, zero_copy)
    run_collective(check)  # its all-gather is the closing barrier


def test_build_and_close_ten_times_leaks_nothing():
    from runtime import workspace

    def check():
        EpDispatchCombineOp(_cfg()).close()  # the first op of this shape fills the workspace pool
        torch.cuda.synchronize()
        before, free_before = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
        def build_use_close() -> dict:  # every tensor it makes dies with it
            op = EpDispatchCombineOp(_cfg())
            x, w, idx = _inputs(6, dist.get_rank())
            h = op.dispatch(x, w, None, idx, return_routing=True)[-1]
            op.combine(op.combine_in_view(), routing=h)
            report = op.memory_report()
            op.close()
            op.close()  # idempotent
            return report

        for _ in range(10):
            report = build_use_close()
        torch.cuda.synchronize()
        after, free_after = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
        print(f"rank {dist.get_rank()}: 10 ops built, used and closed: torch allocated {before} -> {after} B, "
              f"device free {free_before} -> {free_after} B, workspace {report['symmetric_workspace']} B pooled")
        assert after == before, f"torch-allocated GPU memory {before} -> {after} after 10 ops"
        # the device's free memory is the whole GPU's: where ranks share one (RANKS_PER_GPU > 1) the other ranks'
        # allocations move it too (4 MB between the two reads, seen on an H100), so it is only compared on a GPU of
        # this rank's own; torch's count above is this process's alone
        own_gpu = dist.get_world_size() <= torch.cuda.device_count()
        if own_gpu:
            assert free_after == free_before, f"device free memory {free_before} -> {free_after} after 10 ops"
        assert report["total_device_bytes"] > report["symmetric_workspace"] > 0
        released = workspace.release_workspaces()
        torch.cuda.synchronize()
        assert released >= report["symmetric_workspace"], (released, report["symmetric_workspace"])
        if own_gpu:
            assert torch.cuda.mem_get_info()[0] > free_after, "releasing the pool freed no device memory"
    run_collective(check)


def _affine(E):
    g = torch.Generator().manual_seed(99)
    return (torch.rand(E, generator=g) + 0.5).cuda(), (torch.rand(E, generator=g) - 0.5).cuda()


def _std_moe_round(op, x, w, idx, a, b):
    out, ow, _, _, _, h = op.dispatch(x, w, None, idx, return_routing=True)
    px, pc, psrc, pw = op.convert_dispatch_output()
    first = dist.get_rank() * EPR
    y = (a[first:first + EPR, None, None] * px.float() + b[first:first + EPR, None, None]).to(torch.bfloat16)
    return op.combine(op.convert_combine_input(y, h), routing=h)[0]


def _std_moe_expected(x, w, idx, a, b):
    valid = idx >= 0
    e = idx.clamp_min(0).long()
    terms = w[:, :, None] * (a[e][:, :, None] * x.float()[:, None, :] + b[e][:, :, None])
    return (terms * valid[:, :, None]).sum(1), (terms.abs() * valid[:, :, None]).sum(1)


def test_std_moe_round_trip_and_graph():
    def check():
        world = dist.get_world_size()
        a, b = _affine(EPR * world)
        with EpDispatchCombineOp(_cfg(enable_std_moe=True, expert_capacity=T * world)) as op:
            x, w, idx = _inputs(5, dist.get_rank())
            got = _std_moe_round(op, x, w, idx, a, b).float()
            want, scale = _std_moe_expected(x, w, idx, a, b)
            # bf16 expert outputs and a bf16 result: each term and the sum round at 2^-8 relative (asserted after
            # the dist.barrier below: a rank failing here must still reach it)
            eager_err = (got - want).abs().max() if not bool(((got - want).abs() <= scale * 2**-6 + 1e-3).all()) else None
            # graph capture of dispatch -> convert -> expert -> convert back -> combine
            sx, sw, sidx = x.clone(), w.clone(), idx.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                _std_moe_round(op, sx, sw, sidx, a, b)
            torch.cuda.current_stream().wait_stream(s)
            dist.barrier()
            assert eager_err is None, f"max error {eager_err}"
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                res = _std_moe_round(op, sx, sw, sidx, a, b)
            for rep in range(5):
                x, w, idx = _inputs(40 + rep, dist.get_rank())
                sx.copy_(x), sw.copy_(w), sidx.copy_(idx)
                g.replay()
                torch.cuda.synchronize()
                want, scale = _std_moe_expected(x, w, idx, a, b)
                assert bool(((res.float() - want).abs() <= scale * 2**-6 + 1e-3).all()), f"replay {rep}"
    run_collective(check)  # its all-gather is the closing barrier


def test_std_moe_second_combine_without_dispatch():
    """convert_combine_input right after a combine must not write the combine buffer the peers may still
    be reading: it returns a tensor of its own (staged by combine), and the second combine is right."""
    def check():
        world = dist.get_world_size()
        a, b = _affine(EPR * world)
        with EpDispatchCombineOp(_cfg(enable_std_moe=True, expert_capacity=T * world)) as op:
            x, w, idx = _inputs(7, dist.get_rank())
            out, ow, _, _, _, h = op.dispatch(x, w, None, idx, return_routing=True)
            px, _, _, _ = op.convert_dispatch_output()
            first = dist.get_rank() * EPR
            view = op.combine_in_view()
            for scale_a in (1.0, -2.0):  # two expert passes over one dispatch
                aa = a * scale_a
                y = (aa[first:first + EPR, None, None] * px.float() + b[first:first + EPR, None, None]).to(torch.bfloat16)
                conv = op.convert_combine_input(y, h)
                assert (conv.data_ptr() == view.data_ptr()) == (scale_a == 1.0)  # zero-copy only after the dispatch
                got = op.combine(conv, routing=h)[0].float()
                want, tol = _std_moe_expected(x, w, idx, aa, b)
                assert bool(((got - want).abs() <= tol * 2**-6 + 1e-3).all()), f"pass {scale_a}: {(got - want).abs().max()}"
    run_collective(check)  # its all-gather is the closing barrier
