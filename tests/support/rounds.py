"""One dispatch + identity combine round on every rank, checked against the plain-python oracle (ep_oracle)."""

from __future__ import annotations

import torch

from runtime import EpDispatchCombineOp, RoutingHandle
from tests.support.ep_oracle import expected_received, make_inputs, multiplicity


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
