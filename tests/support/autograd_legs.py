"""The differentiable legs of runtime/autograd.py as functions of every rank's inputs, for gradcheck across ranks
(tests/runtime/test_autograd.py) and for native-against-torch backward checks (tests/gpu/test_ep_autograd.py).

gradcheck on W ranks: every rank holds every rank's inputs ([W, ...], the same values everywhere), feeds its own
slice to the leg (``pick``: its backward all_gathers each rank's gradient of its slice, so every rank ends with
the whole input gradient) and returns every rank's output (``gather``: its backward keeps this rank's slice of
the output gradient). Every rank then checks the same global function, in lockstep (same perturbations, same
collectives), and the numerical Jacobian sees every cross-rank term.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime import autograd as ag


def _all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


class _Pick(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, n):
        ctx.rows = X.shape[1]
        return X[dist.get_rank(), :n].clone()

    @staticmethod
    def backward(ctx, g):
        full = g.new_zeros((ctx.rows, *g.shape[1:]))
        full[:g.shape[0]] = g
        return torch.stack(_all_gather(full)), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, rows):
        ctx.n = y.shape[0]
        full = torch.zeros((rows, *y.shape[1:]), dtype=y.dtype, device=y.device)
        full[:y.shape[0]] = y
        return torch.stack(_all_gather(full))

    @staticmethod
    def backward(ctx, g):
        return g[dist.get_rank(), :ctx.n].contiguous(), None


def pick(X: torch.Tensor, n: int) -> torch.Tensor:
    """This rank's first n rows of X [W, rows, ...] (differentiable; see the module docstring)."""
    return _Pick.apply(X, n)


def gather(y: torch.Tensor, rows: int) -> torch.Tensor:
    """Every rank's y (padded to `rows` rows) as [W, rows, ...] (differentiable; see the module docstring)."""
    return _Gather.apply(y, rows)


def as_dtype(t, dtype):
    return None if t is None else t.to(dtype)


def dispatch_grouped_leg(op, X, Wt, ids, n):
    """(every rank's layout.x, layout.weights) as functions of every rank's tokens and weights."""
    cfg = op.config
    layout, _ = ag.dispatch_grouped(op, pick(X, n).to(cfg.data_type), as_dtype(pick(Wt, n), torch.float32), ids)
    P = cfg.resolved_grouped_capacity
    return gather(layout.x.to(X.dtype), P), gather(layout.weights.to(X.dtype), P)


def combine_grouped_leg(op, X, Wt, Y, ids, n, apply_weights=True):
    """Every rank's combine_grouped output as a function of every rank's tokens, weights and grouped expert rows
    (a linear expert: the rows are layout.x + Y, so x reaches the output through both legs)."""
    cfg = op.config
    layout, h = ag.dispatch_grouped(op, pick(X, n).to(cfg.data_type), as_dtype(pick(Wt, n), torch.float32), ids)
    y = layout.x + pick(Y, Y.shape[1]).to(cfg.combine_dtype)
    out = ag.combine_grouped(op, y, h, apply_weights=apply_weights)
    return gather(out.to(X.dtype), X.shape[1])


def dispatch_leg(op, X, Wt, ids, n):
    """(every rank's dispatch out, out_weights) as functions of every rank's tokens and weights."""
    cfg = op.config
    out, out_w, _, _, _ = ag.dispatch(op, pick(X, n).to(cfg.data_type), as_dtype(pick(Wt, n), torch.float32), ids)
    R = cfg.max_recv_tokens
    return gather(out.to(X.dtype), R), gather(out_w.to(X.dtype), R)


def combine_leg(op, X, Y, Wc, ids, n):
    """(every rank's combine out, out_weights) as functions of every rank's received rows and their weights, after
    a dispatch of X (no gradient through it here: dispatch_leg has that)."""
    cfg = op.config
    with torch.no_grad():
        x = X[dist.get_rank(), :n].to(cfg.data_type)
    _, _, _, _, h = ag.dispatch(op, x, None, ids)
    R = cfg.max_recv_tokens
    out, out_w = ag.combine(op, pick(Y, R).to(cfg.combine_dtype), h, weights=as_dtype(pick(Wc, R), torch.float32))
    return gather(out.to(X.dtype), X.shape[1]), gather(out_w.to(X.dtype), X.shape[1])


def linear_experts(layout, expert_w: torch.Tensor) -> torch.Tensor:
    """Each grouped row times its local expert's matrix expert_w [E_local, H, H] (padding rows: expert 0's), in
    float32 whatever the rows' dtype (exact inputs give the same bits on every device), then the rows' dtype."""
    m = layout.m_indices.long().clamp(min=0)
    return torch.bmm(layout.x.float().unsqueeze(1), expert_w.float()[m]).squeeze(1).to(layout.x.dtype)


def grouped_step(op, x, w, ids, expert_w, grad_out, apply_weights=True, checkpointed=False, compiled=None):
    """One grouped forward (a per-expert linear map expert_w [E_local, H, H] on layout.x) and its backward with
    the upstream gradient grad_out -> (out, grad x, grad w, grad expert_w). checkpointed: the forward under
    torch.utils.checkpoint (non-reentrant), recomputed in the backward, dispatch and combine included. compiled: a
    torch.compile backend ("aot_eager", "inductor") the layer is compiled with, whole (fullgraph=True)."""
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    ew = expert_w.detach().requires_grad_(True)

    def layer(x, w, ew):
        layout, h = ag.dispatch_grouped(op, x, w, ids)
        return ag.combine_grouped(op, linear_experts(layout, ew), h, apply_weights=apply_weights)

    run = layer
    if checkpointed:
        from torch.utils.checkpoint import checkpoint

        def run(*a):
            return checkpoint(layer, *a, use_reentrant=False)
    if compiled:
        run = torch.compile(run, backend=compiled, fullgraph=True)
    out = run(x, w, ew)
    gx, gw, gew = torch.autograd.grad(out, (x, w, ew), grad_out)
    return out.detach(), gx, gw, gew
