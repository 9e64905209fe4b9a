"""The op facade and the torch reference backend: 1 rank in-process, 2 and 4 gloo ranks in worker processes.

Scenario functions (``scn_*``) run on every rank of a gloo world (tests/ep_dist.py); they assert
against the plain-python oracle in tests/ep_oracle.py.
"""

from __future__ import annotations

import sys
import types

import attrs
import pytest
import torch

from ep_dist import get_world, shutdown_all
from ep_oracle import expected_received, make_inputs, multiplicity
from runtime import (ClosedError, ConfigError, EpDispatchCombineConfig, EpDispatchCombineOp, EpgenError,
                     InputError, RoutingHandle)

TOKEN_COUNTS = (0, 1, 7, 128)


def _cfg(rank: int, world: int, **kw) -> EpDispatchCombineConfig:
    fields = dict(rank=rank, world_size=world, hidden_dim=64, max_num_inp_token_per_rank=128,
                  num_experts_per_rank=2, num_experts_per_token=4, kernel_backend="torch")
    fields.update(kw)
    return EpDispatchCombineConfig(**fields)


def check_round(op: EpDispatchCombineOp, rank: int, world: int, seed: int, counts, *, use_weights=True,
                via_view=False, indices_fn=None) -> int:
    """One dispatch + identity combine on every rank, checked against the oracle; -> rows received."""
    cfg = op.config
    k, epr, hidden, dtype = cfg.num_experts_per_token, cfg.num_experts_per_rank, cfg.hidden_dim, cfg.data_type
    inputs = [make_inputs(seed, r, counts[r], hidden, k, cfg.num_experts, dtype) for r in range(world)]
    if indices_fn is not None:
        inputs = [(x, w, indices_fn(x.shape[0])) for x, w, _ in inputs]
    x, w, idx = inputs[rank]
    out, out_w, out_s, out_i, total, handle = op.dispatch(x, w if use_weights else None, None, idx,
                                                          return_routing=True)
    expected = expected_received([i for _, _, i in inputs], rank, epr)
    n = len(expected)
    rows = cfg.max_recv_tokens
    assert out.shape == (rows, hidden) and out.dtype == dtype
    assert out_i.shape == (rows, k) and out_i.dtype == torch.int32
    assert out_s is None
    assert total.shape == (1,) and total.dtype == torch.int32, (total.shape, total.dtype)
    assert int(total) == n, f"rank {rank}: total_recv {int(total)}, oracle {n} (counts {counts})"
    assert isinstance(handle, RoutingHandle) and handle.num_tokens == counts[rank]
    assert [tuple(p) for p in handle.recv_src.tolist()] == expected, f"rank {rank}: received set/order differs"
    if n:
        assert torch.equal(out[:n], torch.stack([inputs[s][0][t] for s, t in expected])), "received rows differ"
        assert torch.equal(out_i[:n], torch.stack([inputs[s][2][t] for s, t in expected]))
    if use_weights:
        assert out_w.shape == (rows, k) and out_w.dtype == torch.float32
        if n:
            assert torch.equal(out_w[:n], torch.stack([inputs[s][1][t] for s, t in expected]))
    else:
        assert out_w is None

    expert_out = out
    if via_view:
        expert_out = op.combine_in_view()
        expert_out.copy_(out)
    combined, combined_w = op.combine(expert_out, out_w, routing=handle)
    u = torch.tensor(multiplicity(idx, epr), dtype=torch.float32).unsqueeze(1)
    assert combined.shape == (counts[rank], hidden) and combined.dtype == dtype
    assert torch.equal(combined, (u * x.float()).to(dtype)), f"rank {rank}: combine != U*x (counts {counts})"
    if use_weights:
        assert torch.equal(combined_w, u * w), f"rank {rank}: combined weights != U*w"
    else:
        assert combined_w is None
    return n


def all_ranks_routing(cfg):
    """Indices sending every token to every rank (so every rank receives rows)."""
    row = [(j * cfg.num_experts_per_rank) % cfg.num_experts for j in range(cfg.num_experts_per_token)]
    return lambda n: torch.tensor([row] * n, dtype=torch.int32).reshape(n, len(row))


# ---------------------------------------------------------------------------------------------
# Scenarios (run on every rank)
# ---------------------------------------------------------------------------------------------
def scn_identity_matrix(rank, world, hidden, dtype=torch.bfloat16):
    """Every (top-k, experts per rank) pair; equal and mixed token counts per rank."""
    received = 0
    for k in (1, 4, 8):
        for epr in (2, 8):
            with EpDispatchCombineOp(_cfg(rank, world, hidden_dim=hidden, num_experts_per_token=k,
                                          num_experts_per_rank=epr, data_type=dtype)) as op:
                plans = [[c] * world for c in TOKEN_COUNTS]
                plans.append([TOKEN_COUNTS[(r + k) % len(TOKEN_COUNTS)] for r in range(world)])
                for seed, counts in enumerate(plans):
                    received += check_round(op, rank, world, seed + 100 * k + epr, counts)
    return received


def scn_variants(rank, world):
    """No weights, combine through combine_in_view, all-ranks routing, a capped receive buffer."""
    op = EpDispatchCombineOp(_cfg(rank, world))
    check_round(op, rank, world, 1, [5] * world, use_weights=False)
    check_round(op, rank, world, 2, [9] * world, via_view=True)
    assert op.combine_in_view() is op.combine_in_view()
    check_round(op, rank, world, 3, [3] * world, indices_fn=all_ranks_routing(op.config))
    op.reset()
    check_round(op, rank, world, 4, [0] * world)
    op.close()
    capped = EpDispatchCombineOp(_cfg(rank, world, max_total_recv_tokens=10))
    assert capped.config.max_recv_tokens == 10
    check_round(capped, rank, world, 5, [10 // world] * world, indices_fn=all_ranks_routing(capped.config))
    return True


def bad_input_context(rank, world):
    """An op with a valid dispatch done, plus what the bad-input cases need."""
    cfg = _cfg(rank, world, max_num_inp_token_per_rank=16)
    op, other = EpDispatchCombineOp(cfg), EpDispatchCombineOp(cfg)
    x, w, _ = make_inputs(7, rank, 6, cfg.hidden_dim, cfg.num_experts_per_token, cfg.num_experts)
    idx = all_ranks_routing(cfg)(6)
    out, out_w, _, _, total, handle = op.dispatch(x, w, None, idx, return_routing=True)
    other_handle = other.dispatch(x, w, None, idx, return_routing=True)[-1]
    small = EpDispatchCombineOp(_cfg(rank, world, max_num_inp_token_per_rank=16, max_total_recv_tokens=1))
    bad_idx = idx.clone()
    if rank == 0:
        bad_idx[2, 1] = cfg.num_experts
    return types.SimpleNamespace(op=op, cfg=cfg, x=x, w=w, idx=idx, out=out, out_w=out_w, total=int(total),
                                 handle=handle, other_handle=other_handle, small=small, bad_idx=bad_idx)


def _big(c):
    n = c.cfg.max_num_inp_token_per_rank + 1
    return torch.zeros(n, c.cfg.hidden_dim, dtype=torch.bfloat16), torch.zeros(n, 4, dtype=torch.int32)


# name -> (error class, message pattern, call). Every rank makes the same call.
BAD_CASES = {
    "x_dtype": (InputError, "x must be torch.bfloat16", lambda c: c.op.dispatch(c.x.float(), c.w, None, c.idx)),
    "x_not_tensor": (InputError, "x must be a torch.Tensor", lambda c: c.op.dispatch(c.x.tolist(), c.w, None, c.idx)),
    "x_1d": (InputError, "x must be 2-D", lambda c: c.op.dispatch(c.x.reshape(-1), c.w, None, c.idx)),
    "x_hidden": (InputError, r"hidden_dim=64\], got \(6, 63\)",
                 lambda c: c.op.dispatch(c.x[:, 1:].contiguous(), c.w, None, c.idx)),
    "x_noncontiguous": (InputError, "x must be contiguous",
                        lambda c: c.op.dispatch(torch.cat([c.x, c.x], 1)[:, ::2], c.w, None, c.idx)),
    "x_device": (InputError, "x must be on cpu, got meta", lambda c: c.op.dispatch(c.x.to("meta"), c.w, None, c.idx)),
    "too_many_tokens": (InputError, "17 tokens, more than max_num_inp_token_per_rank=16",
                        lambda c: c.op.dispatch(_big(c)[0], None, None, _big(c)[1])),
    "indices_dtype": (InputError, "indices must be torch.int32", lambda c: c.op.dispatch(c.x, c.w, None, c.idx.long())),
    "indices_missing": (InputError, "indices must be a torch.Tensor", lambda c: c.op.dispatch(c.x, c.w, None, None)),
    "indices_shape": (InputError, r"indices must have shape \[6, 4\]",
                      lambda c: c.op.dispatch(c.x, c.w, None, c.idx[:, :3].contiguous())),
    "indices_noncontiguous": (InputError, "indices must be contiguous",
                              lambda c: c.op.dispatch(c.x, c.w, None, c.idx.t().contiguous().t())),
    "weights_dtype": (InputError, "weights must be torch.float32",
                      lambda c: c.op.dispatch(c.x, c.w.bfloat16(), None, c.idx)),
    "weights_shape": (InputError, r"weights must have shape \[6, 4\]",
                      lambda c: c.op.dispatch(c.x, c.w[:5].contiguous(), None, c.idx)),
    "scales": (InputError, "scales must be None", lambda c: c.op.dispatch(c.x, c.w, torch.ones(6, 1), c.idx)),
    "expert_id_too_big": (InputError, r"rank 0 passed expert id (\d+) >= num_experts=\1",
                          lambda c: c.op.dispatch(c.x, c.w, None, c.bad_idx)),
    "recv_overflow": (InputError, "would receive .* rows, more than max_recv_tokens=1",
                      lambda c: c.small.dispatch(c.x, c.w, None, c.idx)),
    "replay": (NotImplementedError, "routing replay is not built yet",
               lambda c: c.op.dispatch(c.x, c.w, None, c.idx, routing=c.handle)),
    "replay_other_op": (InputError, "from another op",
                        lambda c: c.op.dispatch(c.x, c.w, None, c.idx, routing=c.other_handle)),
    "replay_token_count": (InputError, "same token count",
                           lambda c: c.op.dispatch(c.x[:5], c.w[:5], None, c.idx[:5], routing=c.handle)),
    "combine_no_routing": (InputError, "routing is required", lambda c: c.op.combine(c.out, c.out_w)),
    "combine_not_handle": (InputError, "routing must be a RoutingHandle",
                           lambda c: c.op.combine(c.out, routing={"op_uid": c.op.uid})),
    "combine_other_op": (InputError, "from another op", lambda c: c.op.combine(c.out, routing=c.other_handle)),
    "combine_stale_config": (InputError, "different config",
                             lambda c: c.op.combine(c.out, routing=attrs.evolve(c.handle, config_key=("old",)))),
    "combine_dtype": (InputError, "expert_out must be torch.bfloat16",
                      lambda c: c.op.combine(c.out.float(), routing=c.handle)),
    "combine_hidden": (InputError, "expert_out must have shape",
                       lambda c: c.op.combine(c.out[:, 1:].contiguous(), routing=c.handle)),
    "combine_noncontiguous": (InputError, "expert_out must be contiguous",
                              lambda c: c.op.combine(torch.cat([c.out, c.out], 1)[:, ::2], routing=c.handle)),
    "combine_too_few_rows": (InputError, "fewer than total_recv",
                             lambda c: c.op.combine(c.out[:c.total - 1], routing=c.handle)),
    "combine_weights_dtype": (InputError, "weights must be torch.float32",
                              lambda c: c.op.combine(c.out, c.out_w.double(), routing=c.handle)),
    "combine_indices_shape": (InputError, "indices must have shape",
                              lambda c: c.op.combine(c.out, None, torch.zeros(4, 3, dtype=torch.int32),
                                                     routing=c.handle)),
}


def scn_bad_inputs(rank, world, names):
    """Each bad call raises its error on every rank, and a correct round works right after it."""
    c = bad_input_context(rank, world)
    for i, name in enumerate(names):
        exc, pattern, call = BAD_CASES[name]
        with pytest.raises(exc, match=pattern):
            call(c)
        check_round(c.op, rank, world, 1000 + i, [(i + r) % 9 for r in range(world)])
    # a combine for the first dispatch still works after all of that
    combined, _ = c.op.combine(c.out, routing=c.handle)
    assert torch.equal(combined, (world * c.x.float()).to(torch.bfloat16))
    return len(names)


def scn_closed(rank, world):
    with EpDispatchCombineOp(_cfg(rank, world)) as op:
        check_round(op, rank, world, 3, [4] * world)
        x, w, idx = make_inputs(3, rank, 4, 64, 4, op.config.num_experts)
        out, *_, handle = op.dispatch(x, w, None, idx, return_routing=True)
    assert op.closed
    op.close()  # idempotent
    for call in (lambda: op.dispatch(x, w, None, idx), lambda: op.combine(out, routing=handle),
                 op.combine_in_view, op.reset):
        with pytest.raises(ClosedError, match="closed"):
            call()
    return True


# ---------------------------------------------------------------------------------------------
# Multi-process tests
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _worlds():
    yield
    shutdown_all()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("hidden", [64, 256])
def test_identity_and_oracle(world, hidden):
    received = get_world(world).run(scn_identity_matrix, hidden)
    assert all(r > 0 for r in received)


@pytest.mark.parametrize("world", [2, 4])
def test_identity_fp32(world):
    get_world(world).run(scn_identity_matrix, 64, torch.float32)


@pytest.mark.parametrize("world", [2, 4])
def test_variants(world):
    get_world(world).run(scn_variants)


@pytest.mark.parametrize("world", [2, 4])
def test_bad_inputs_keep_op_usable(world):
    assert get_world(world).run(scn_bad_inputs, list(BAD_CASES)) == [len(BAD_CASES)] * world


@pytest.mark.parametrize("world", [2, 4])
def test_calls_after_close(world):
    get_world(world).run(scn_closed)


def test_config_must_match_group():
    get_world(2).run(scn_wrong_world)


def scn_wrong_world(rank, world):
    with pytest.raises(ConfigError, match=f"process group has world size {world} and this process is rank {rank}"):
        EpDispatchCombineOp(_cfg(rank, world * 2))


# ---------------------------------------------------------------------------------------------
# Single process (world_size=1, no process group)
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("EPGEN_KERNEL_BACKEND", raising=False)


@pytest.mark.parametrize("name", list(BAD_CASES))
def test_bad_input_single_rank(name, no_env):
    scn_bad_inputs(0, 1, [name])


def test_single_rank_rounds(no_env):
    assert scn_identity_matrix(0, 1, 64) > 0
    scn_variants(0, 1)
    scn_closed(0, 1)


def test_capabilities(no_env):
    op = EpDispatchCombineOp(_cfg(0, 1))
    caps = op.capabilities
    assert caps["backend"] == "torch" and caps["device"] == "cpu"
    assert caps["dtypes"] == (torch.bfloat16, torch.float32)
    assert caps["combine_modes"] == ("gather",) and caps["quant_types"] == ("none",)
    assert caps["graph_capture"] is False and caps["routing_replay"] is False
    assert caps["max_recv_tokens"] == 128
    view = op.combine_in_view()
    assert view.shape == (128, 64) and view.dtype == torch.bfloat16


def test_needs_process_group_for_several_ranks(no_env):
    with pytest.raises(ConfigError, match="torch.distributed is not initialized"):
        EpDispatchCombineOp(_cfg(0, 2))


def test_rejects_non_config():
    with pytest.raises(ConfigError, match="must be an EpDispatchCombineConfig"):
        EpDispatchCombineOp({"rank": 0})


def test_native_backend_unavailable(monkeypatch):
    monkeypatch.delenv("EPGEN_KERNEL_BACKEND", raising=False)
    monkeypatch.setitem(sys.modules, "runtime.native", None)  # makes `from .native import` fail
    with pytest.raises(EpgenError, match="kernel backend 'native' is unavailable: importing runtime.native"):
        EpDispatchCombineOp(_cfg(0, 1, kernel_backend="native"))


def test_env_selects_backend(monkeypatch):
    monkeypatch.setenv("EPGEN_KERNEL_BACKEND", "torch")
    op = EpDispatchCombineOp(_cfg(0, 1, kernel_backend="native"))
    assert op.capabilities["backend"] == "torch"
