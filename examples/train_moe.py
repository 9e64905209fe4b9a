"""Train a small MoE model through epgen's differentiable dispatch and combine (runtime/autograd.py).

    torchrun --nproc-per-node 2 examples/train_moe.py                   # CPU: gloo ranks, the torch backend
    torchrun --nproc-per-node 2 examples/train_moe.py --plot loss.png   # and a loss curve (matplotlib)
    torchrun --nproc-per-node 2 examples/train_moe.py --dtype bf16      # GPUs: NCCL, the generated kernels

The model is examples/moe_layer.py's block (softmax router, top-k, SiLU-gated experts sharded over the ranks)
trained with AdamW to fit a fixed random linear map of synthetic tokens (mean squared error); the parameters are
float32, the forward and the communication run in --dtype (bf16: mixed precision). Each rank draws its
own batch per step; the router is replicated (its gradient is all-reduced, as data parallelism does), the experts
are expert-parallel (each rank's experts get their gradients from every rank's tokens through the backward of
dispatch_grouped / combine_grouped). Rank 0 also trains the same model densely in one process (every rank's
batch, every expert, the same initial weights and optimizer) and prints both losses per step: they agree, and
fall. docs/TRAINING.md explains the gradients; tests/runtime/test_train_moe.py runs this at 2 gloo ranks.
"""

from __future__ import annotations

import argparse
import os
import runpy
import types
from pathlib import Path

import torch
import torch.distributed as dist

from runtime import EpDispatchCombineConfig, EpDispatchCombineOp
from runtime import autograd as ag
from runtime import collectives


# examples/moe_layer.py's definitions (the router, the experts and their seeded weights), run as a file: no package
layer = types.SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("moe_layer.py"))))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # largest |loss_ep - loss_dense| / loss_dense accepted


def batch(step: int, rank: int, tokens: int, hidden: int, seed: int, device, dtype):
    """Rank `rank`'s tokens at `step` and their targets: the same on any process (seeded by step and rank)."""
    g = torch.Generator(device="cpu").manual_seed((seed * 7919 + step) * 1009 + rank)
    x = torch.randn(tokens, hidden, generator=g)
    teacher = torch.Generator(device="cpu").manual_seed(seed * 7919 - 1)
    A = torch.randn(hidden, hidden, generator=teacher) / hidden ** 0.5
    return x.to(device, dtype), (x @ A.t()).to(device, dtype)


class MoEParams(torch.nn.Module):
    """Router [E, H] and experts (w13 [E', 2I, H], w2 [E', H, I]), float32 (the optimizer's master weights); the
    forward computes in the tokens' dtype (bf16: mixed precision)."""

    def __init__(self, gate, w13, w2, k: int):
        super().__init__()
        self.k = k
        self.gate, self.w13, self.w2 = (torch.nn.Parameter(t.float().clone()) for t in (gate, w13, w2))

    def weights(self, dtype):
        return (p.to(dtype) for p in (self.gate, self.w13, self.w2))


class EPMoE(MoEParams):
    """Router (replicated) + this rank's experts, dispatch / combine through runtime.autograd."""

    def __init__(self, op: EpDispatchCombineOp, gate, w13, w2):
        super().__init__(gate, w13, w2, op.config.num_experts_per_token)
        self.op = op

    def forward(self, x):
        gate, w13, w2 = self.weights(x.dtype)
        weights, ids = layer.route(x, gate, self.k)  # weights differentiable w.r.t. the gate
        lay, h = ag.dispatch_grouped(self.op, x, weights, ids)
        y = layer.experts_grouped(lay.x, lay.offs, w13, w2)
        return ag.combine_grouped(self.op, y, h)  # sum_k w_k expert_k(x): the weights' gradient too


class DenseMoE(MoEParams):
    """The same model in one process: every expert on its tokens, no communication."""

    def forward(self, x):
        gate, w13, w2 = self.weights(x.dtype)
        weights, ids = layer.route(x, gate, self.k)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():
            coef = (weights * (ids == e)).sum(1, keepdim=True)
            out = out + coef * layer.expert_ffn(x, w13[e], w2[e]).float()
        return out.to(x.dtype)


def mse(pred, target, count: int):
    """Sum of squared errors over count * hidden elements (count: every rank's tokens)."""
    return ((pred.float() - target.float()) ** 2).sum() / (count * pred.shape[1])


def initial_weights(experts, hidden, inter, seed, device, dtype):
    """(router [E, H], w13 [E, 2I, H], w2 [E, H, I]) of every expert, from examples/moe_layer.py's seeds."""
    pairs = [layer.expert_weights(e, hidden, inter, seed, device, dtype) for e in range(experts)]
    w13, w2 = (torch.stack(ws) for ws in zip(*pairs))
    return layer.router_weight(experts, hidden, seed, device, dtype), w13, w2


def all_reduce(t: torch.Tensor) -> None:
    """Sum t over the ranks in place (through the host where a gloo group meets GPU tensors: ranks sharing a GPU).
    On gloo the call returns once gloo's worker thread has let go of the tensor (runtime.collectives.run): a worker
    still holding one at exit aborts the process (`terminate called without an active exception`, docs/GUARANTEES.md;
    seen once in 16 two-rank runs of this example under load)."""
    if t.is_cuda and dist.get_backend() == "gloo":
        host = t.cpu()
        collectives.run(lambda: dist.all_reduce(host), [host], None)
        t.copy_(host)
    else:
        collectives.run(lambda: dist.all_reduce(t), [t], None)


def train(args) -> list[tuple[float, float | None]]:
    """-> per step (EP loss over every rank's tokens, the dense run's loss on rank 0 or None)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = DTYPES[args.dtype]
    per_rank = layer.experts_per_rank(args.experts, world)
    cfg = EpDispatchCombineConfig(rank=rank, world_size=world, hidden_dim=args.hidden,
                                  max_num_inp_token_per_rank=args.tokens, num_experts_per_rank=per_rank,
                                  num_experts_per_token=args.topk, data_type=dtype, enable_grouped_layout=True,
                                  expert_alignment=16)
    gate, w13, w2 = initial_weights(args.experts, args.hidden, args.intermediate, args.seed, device, torch.float32)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    losses = []
    # --single-thread-backward: the autograd engine runs every backward node on this thread, with no hand-off to
    # its per-GPU thread and back (thread-local; docs/TRAINING.md, "Small batches"); the gradients are the same
    with torch.autograd.set_multithreading_enabled(not args.single_thread_backward), EpDispatchCombineOp(cfg) as op:
        model = EPMoE(op, gate, w13[mine], w2[mine])
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        dense = DenseMoE(gate, w13, w2, args.topk) if rank == 0 and args.check else None
        dense_opt = torch.optim.AdamW(dense.parameters(), lr=args.lr, weight_decay=0.01) if dense else None
        for step in range(args.steps):
            x, target = batch(step, rank, args.tokens, args.hidden, args.seed, device, dtype)
            loss = mse(model(x), target, world * args.tokens)  # this rank's share of the global loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            all_reduce(model.gate.grad)  # the replicated router: the sum of every rank's share
            opt.step()
            total = loss.detach().float().clone()
            all_reduce(total)
            want = None
            if dense is not None:
                xs, ts = zip(*(batch(step, r, args.tokens, args.hidden, args.seed, device, dtype)
                               for r in range(world)))
                dloss = mse(dense(torch.cat(xs)), torch.cat(ts), world * args.tokens)
                dense_opt.zero_grad(set_to_none=True)
                dloss.backward()
                dense_opt.step()
                want = float(dloss.detach())
            losses.append((float(total), want))
            if rank == 0:
                line = f"step {step:3d}  loss {float(total):.6f}"
                if want is not None:
                    line += f"  dense {want:.6f}  rel.diff {abs(float(total) - want) / abs(want):.1e}"
                print(line, flush=True)
    return losses


def plot(losses, path: str) -> str:
    """Save the loss curve; -> the line to print (a clear message when matplotlib is missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot {path}: matplotlib is not installed (pip install matplotlib); no plot written"
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([ep for ep, _ in losses], label="epgen (expert parallel)")
    if all(d is not None for _, d in losses):
        ax.plot([d for _, d in losses], "--", label="dense, one process")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (MSE)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"loss curve written to {path}"


def verdict(losses, dtype, world: int) -> tuple[bool, str]:
    """(ok, line): the loss fell, and (with the dense run) agreed with it at every step."""
    first, last = losses[0][0], losses[-1][0]
    fell = last < first
    text = (f"{world} rank(s), {len(losses)} steps: loss {first:.6f} -> {last:.6f} "
            f"({'falls' if fell else 'does NOT fall'})")
    ok = fell
    if all(d is not None for _, d in losses):
        worst = max(abs(ep - d) / abs(d) for ep, d in losses)
        agree = worst <= TOLERANCE[dtype]
        ok = ok and agree
        text += (f"; largest relative difference from the dense run {worst:.1e} (tolerance {TOLERANCE[dtype]:g}"
                 f"{'' if agree else ': MISMATCH'})")
    return ok, f"{'OK' if ok else 'FAILED'}: {text}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train a small MoE model through epgen's differentiable EP legs")
    layer.shape_arguments(p, hidden=64, experts=8, topk=2, inter=32, tokens=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the dense run on rank 0")
    p.add_argument("--plot", metavar="FILE.png", help="save the loss curve (needs matplotlib)")
    p.add_argument("--single-thread-backward", action="store_true",
                   help="run the backward on the calling thread (torch.autograd.set_multithreading_enabled(False)): "
                        "less host time per step at small batches")
    return p


def main() -> int:
    p = parser()
    args = p.parse_args()
    layer.init_ranks(p, args)
    try:
        losses = train(args)
    finally:
        world = dist.get_world_size()
        dist.destroy_process_group()
    ok = True
    if int(os.environ.get("RANK", 0)) == 0:
        if args.plot:
            print(plot(losses, args.plot))
        ok, line = verdict(losses, DTYPES[args.dtype], world)
        print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
