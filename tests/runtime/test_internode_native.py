"""The native internode backend's host orchestration on CPU (tests/support/internode_sim.py): every world
layout the GPU runs cannot reach yet (2 nodes x 2, x 3, x 4 GPUs; 4 nodes x 2), both routes, uneven
and empty token counts, receive caps, fp8 payloads with scales, several calls on the same buffers.
The received rows must be the (source rank, token) oracle's and the combine the intranode gather's
arithmetic: sum over a token's kept destinations, in k order of first appearance, in float32."""

from __future__ import annotations

import pytest
import torch

from tests.support.configs import make_config
from tests.support.ep_oracle import expected_received, random_routing
from tests.support.internode_sim import SimBackend, SimWorld, run_ranks
from runtime import InputError
from runtime.routing import RoutingHandle

H, K, EPR = 32, 4, 3


def _cfg(rank, world, gpn, route, tmax, **kw):
    return make_config(rank, world, gpu_per_node=gpn, hidden_dim=H, max_num_inp_token_per_rank=tmax,
                       num_experts_per_rank=EPR, num_experts_per_token=K, kernel_backend="native",
                       internode_kernel=route, **kw)


def _inputs(seed, rank, T, world):
    g = torch.Generator().manual_seed(seed * 131 + rank)
    x = (torch.randint(-64, 65, (T, H), generator=g).float() / 16).to(torch.bfloat16)
    w = torch.randint(1, 64, (T, K), generator=g).float() / 64
    return x, w, random_routing(g, T, K, EPR * world)


def _round(world, gpn, route, counts, seed, cap=0, calls=2, fp8=False):
    """Run `calls` dispatch -> expert (3x - 1) -> combine rounds on every rank; check each rank."""
    sim = SimWorld(world)
    tmax = max(max(counts), 1)
    extra = dict(max_total_recv_tokens=cap) if cap else {}
    if fp8:
        extra.update(dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.bfloat16, scale_dim=2,
                     scale_type_size=4)

    def rank_fn(rank):
        be = SimBackend(_cfg(rank, world, gpn, route, tmax, **extra), sim, seed=rank)
        routes = []
        for call in range(calls):
            ins = [_inputs(seed + call, r, counts[r], world) for r in range(world)]  # every rank's inputs
            x, w, idx = ins[rank]
            scales = None
            if fp8:
                scales = torch.rand(counts[rank], 2, generator=torch.Generator().manual_seed(rank)) + 0.5
                x = x.to(torch.float8_e4m3fn)
            out, ow, osc, oi, total, fields = be.dispatch(x, w, scales, idx, None)
            h = RoutingHandle(op_uid=0, config_key=(), num_tokens=counts[rank], **fields)
            rows = expected_received([i[2] for i in ins], rank, EPR)
            kept = rows[:cap] if cap else rows
            n = int(total)
            assert n == len(kept), (rank, n, len(kept))
            assert int(be.dropped) == len(rows) - len(kept)
            for i, (s, t) in enumerate(kept):
                src_x = ins[s][0][t] if not fp8 else ins[s][0][t].to(torch.float8_e4m3fn)
                assert torch.equal(out[i].view(torch.uint8), src_x.view(torch.uint8)), (rank, i, s, t)
                assert torch.equal(oi[i], ins[s][2][t]) and torch.equal(ow[i], ins[s][1][t])
                assert int(be.recv_src[i]) == s * tmax + t
            if fp8:
                for i, (s, t) in enumerate(kept):
                    want = torch.rand(counts[s], 2, generator=torch.Generator().manual_seed(s)) + 0.5
                    assert torch.equal(osc[i], want[t])
            # expert: 3 * row - 1 in bf16 into the combine view, weights as received
            view = be.combine_in_view()
            view[:n] = (out[:n].float() * 3 - 1).to(torch.bfloat16)
            comb, cw = be.combine(view[:n], ow[:n], None, h)
            # oracle: each kept (token, destination) row adds expert(x) once, in k order, float32
            everyone = [kept_of(r, ins, cap) for r in range(world)]
            for t in range(counts[rank]):
                e = ((x[t].float() * 3 - 1).to(torch.bfloat16)).float()
                acc, wacc = torch.zeros(H), torch.zeros(K)
                for d in first_appearance(idx[t].tolist()):
                    if (rank, t) in everyone[d]:
                        acc += e
                        wacc += w[t]
                assert torch.equal(comb[t], acc.to(torch.bfloat16)), (rank, t)
                assert torch.equal(cw[t], wacc), (rank, t)
            routes.append(be.last_internode_kernel)
        return routes

    return run_ranks(sim, rank_fn)


def first_appearance(row):
    seen = []
    for e in row:
        if e >= 0 and e // EPR not in seen:
            seen.append(e // EPR)
    return seen


def kept_of(dst, ins, cap):
    rows = expected_received([i[2] for i in ins], dst, EPR)
    return set(rows[:cap] if cap else rows)


LAYOUTS = [(2, 1), (4, 2), (4, 1), (6, 3), (8, 4), (8, 2)]


@pytest.mark.parametrize("world,gpn", LAYOUTS)
@pytest.mark.parametrize("route", ["v2", "v2_ll"])
def test_rows_and_combine(world, gpn, route):
    counts = [(5 + 3 * r) % 9 for r in range(world)]  # uneven, one rank with 0 tokens at some sizes
    counts[-1] = 0
    assert _round(world, gpn, route, counts, seed=world * 10 + gpn) == [[route, route]] * world


@pytest.mark.parametrize("world,gpn", [(4, 2), (8, 4)])
@pytest.mark.parametrize("route", ["v2", "v2_ll"])
def test_receive_cap_and_fp8_payload(world, gpn, route):
    _round(world, gpn, route, [6] * world, seed=3, cap=world + 3)  # forced overflow
    _round(world, gpn, route, [4, 7] * (world // 2), seed=4, fp8=True)


def test_auto_switches_by_the_largest_count():
    assert _round(4, 2, "auto", [3, 0, 2, 1], seed=5, calls=1) == [["v2_ll"]] * 4


def test_combine_takes_the_last_layout_only():
    """The receive cells are reused: combining an older dispatch's handle raises; replaying it first works."""
    world, gpn = 4, 2
    sim = SimWorld(world)

    def rank_fn(rank):
        be = SimBackend(_cfg(rank, world, gpn, "v2", 5), sim, seed=rank)
        handles = []
        for call in range(2):
            x, w, idx = _inputs(20 + call, rank, 5, world)
            *_, fields = be.dispatch(x, w, None, idx, None)
            handles.append((x, w, idx, RoutingHandle(op_uid=0, config_key=(), num_tokens=5, **fields)))
        x0, w0, idx0, h0 = handles[0]
        try:
            be.combine(be.combine_in_view(), None, None, h0)
            return "combined a stale layout"
        except InputError as e:
            assert "last dispatch" in str(e)
        out, _, _, _, total, _ = be.dispatch(x0, w0, None, idx0, h0)  # replay: h0's layout is back
        n = int(total)
        comb, _ = be.combine(out[:n], None, None, h0)
        U = torch.tensor([len(first_appearance(r)) for r in idx0.tolist()], dtype=torch.float32)
        assert torch.equal(comb, (x0.float() * U[:, None]).to(torch.bfloat16))
        return "ok"

    assert run_ranks(sim, rank_fn) == ["ok"] * world


def test_bad_expert_id_raises_on_every_rank_naming_the_rank():
    """Eager: the count all-gather carries each rank's largest id; rank 2's bad id raises everywhere,
    before anything is packed or sent, and the next good call works."""
    world, gpn = 4, 2
    sim = SimWorld(world)

    def rank_fn(rank):
        be = SimBackend(_cfg(rank, world, gpn, "v2", 4), sim, seed=rank)
        x, w, idx = _inputs(30, rank, 4, world)
        bad = idx.clone()
        if rank == 2:
            bad[1, 0] = EPR * world + 7
        try:
            be.dispatch(x, w, None, bad, None)
            return "no error"
        except InputError as e:
            n = EPR * world
            assert (f"expert id {n + 7} >= num_experts={n} (world_size × num_experts_per_rank = {world} × {EPR} = {n}; "
                    f"valid ids: 0..{n - 1}, negative = no expert), passed by rank 2") in str(e), str(e)
        out, _, _, _, total, _ = be.dispatch(x, w, None, idx, None)
        return int(total) == len(expected_received([_inputs(30, r, 4, world)[2] for r in range(world)], rank, EPR))

    assert run_ranks(sim, rank_fn) == [True] * world
