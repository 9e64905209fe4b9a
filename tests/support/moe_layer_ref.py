"""The dense single-process reference of examples/moe_layer.py, and the check both tests use.

Every expert runs on every token (masked by the routing), with the weights the example draws for it
(``expert_weights(e, ...)``), and the weighted sum is taken in float32 and rounded once to bf16.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 0.002). The EP block and the reference round the
# GEMM outputs, the activation and the sums at different points (grouped GEMM vs one GEMM per expert,
# per-rank partial sums rounded to bf16 before the combine adds them): a few roundings per term.
REL_TOL = 1e-2  # per token: ||ep - reference||_2 <= REL_TOL * ||reference||_2


def load_example(name: str = "moe_layer"):
    """examples/NAME.py as a module (moe_layer by default; train_moe: the training example)."""
    spec = importlib.util.spec_from_file_location(f"{name}_example", ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dense_reference(ex, x, hidden, experts, topk, inter, seed=0):
    """sum_k w_k * expert_k(x) per token, every expert built afresh from its seed (float32 sum, bf16 result)."""
    gate = ex.router_weight(experts, hidden, seed, x.device)
    w, idx = ex.route(x, gate, topk)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(experts):
        coef = (w * (idx == e)).sum(1)  # [T]: the token's weight for expert e (0 if not routed there)
        if bool((coef != 0).any()):
            w13, w2 = ex.expert_weights(e, hidden, inter, seed, x.device)
            out += coef[:, None] * ex.expert_ffn(x, w13, w2).float()
    return out.to(torch.bfloat16)


def relative_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per token ||got - want|| / ||want|| (float32)."""
    diff = (got.float() - want.float()).norm(dim=-1)
    return diff / want.float().norm(dim=-1).clamp_min(1e-30)


def check_block(hidden, experts, topk, inter, tokens, seed=0, device=None) -> float:
    """Build the example's block on this rank, run it on random tokens, compare with the dense reference;
    returns the largest per-token relative error (AssertionError past REL_TOL)."""
    import torch.distributed as dist

    ex = load_example()
    block = ex.build(hidden, experts, topk, inter, tokens, seed=seed, device=device)
    dev = block.gate.device
    g = torch.Generator(device=dev).manual_seed(1000 + dist.get_rank())
    x = torch.randn(tokens, hidden, generator=g, device=dev).to(torch.bfloat16)
    with block.op:
        got = block(x).clone()
        again = block(x).clone()  # a second call on the same op gives the same result
    want = dense_reference(ex, x, hidden, experts, topk, inter, seed)
    err = relative_errors(got, want)
    assert bool(torch.isfinite(got.float()).all()), "non-finite output"
    assert torch.equal(got, again), "a second forward differs"
    worst = float(err.max())
    assert worst <= REL_TOL, f"largest per-token relative error {worst:.3g} > {REL_TOL} (token {int(err.argmax())})"
    return worst
