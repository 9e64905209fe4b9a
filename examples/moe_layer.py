"""A DeepSeek-V3-shaped MoE block with expert parallelism through epgen.

    torchrun --nproc-per-node 2 examples/moe_layer.py                      # GPUs: NCCL + the generated kernels
    torchrun --nproc-per-node 2 examples/moe_layer.py --hidden 512 --experts 16 --intermediate 128   # CPU: gloo

Router (softmax over the experts, top-k, weights renormalised to sum 1) -> epgen dispatch into the
grouped-GEMM layout (each local expert's rows contiguous, each group padded to a multiple of 16 rows;
generated kernels, no host sync) -> the experts (two GEMMs and a SiLU-gated activation each; one
torch._grouped_mm per projection where torch has it for the device, else a loop over the groups) ->
epgen combine out of that layout (the weighted sum per row, then back to the tokens). Experts are sharded over ranks:
rank r holds experts [r * E / W, (r + 1) * E / W). DeepSeek-V3's sizes are the defaults (hidden 7168,
256 routed experts, top-8, expert intermediate 2048); its shared expert and group-limited sigmoid
routing are left out. docs/LAYER.md has more; tests/runtime/test_moe_layer.py checks this block against a
dense single-process reference.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime import EpDispatchCombineConfig, EpDispatchCombineOp


def expert_weights(e: int, hidden: int, inter: int, seed: int = 0, device="cpu", dtype=torch.bfloat16):
    """Expert e's (w13 [2I, H]: gate and up projections, w2 [H, I]), drawn from a generator seeded by
    (seed, e): every rank, and a dense reference, builds the same expert."""
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + e)
    w13 = torch.randn(2 * inter, hidden, generator=g, device=device) / hidden ** 0.5
    w2 = torch.randn(hidden, inter, generator=g, device=device) / inter ** 0.5
    return w13.to(dtype), w2.to(dtype)


def router_weight(num_experts: int, hidden: int, seed: int = 0, device="cpu", dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 - 1)
    return (torch.randn(num_experts, hidden, generator=g, device=device) / hidden ** 0.5).to(dtype)


def route(x: torch.Tensor, gate: torch.Tensor, k: int):
    """Softmax router: (weights float32 [T, k] summing to 1, expert ids int32 [T, k])."""
    scores = torch.softmax((x @ gate.t()).float(), dim=-1)
    w, idx = scores.topk(k, dim=-1)
    return w / w.sum(-1, keepdim=True), idx.to(torch.int32)


def expert_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: silu(x W_gate^T) * (x W_up^T), then W2."""
    gate, up = (x @ w13.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


def grouped_gemm_ok(x: torch.Tensor) -> bool:
    """torch._grouped_mm runs bf16 operands on sm_90 (and on CPU in recent torch)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(x.device) == (9, 0) if x.is_cuda else True


def experts_grouped(xs: torch.Tensor, offs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Every local expert on its group of rows (group e = rows [offs[e-1], offs[e])): [P, H] -> [P, H]; rows
    outside the groups' pairs are unspecified (combine never reads them)."""
    if grouped_gemm_ok(xs):  # one grouped GEMM per projection, no host sync (graph-capturable)
        gate, up = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
    out = torch.empty_like(xs)
    start = 0
    for e, end in enumerate(offs.tolist()):  # a loop over the groups (one host sync)
        if end > start:
            out[start:end] = expert_ffn(xs[start:end], w13[e], w2[e])
        start = end
    return out


class MoEBlock(torch.nn.Module):
    """Router + this rank's experts; dispatch / combine through one EpDispatchCombineOp."""

    def __init__(self, op: EpDispatchCombineOp, gate: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.op, self.gate, self.w13, self.w2 = op, gate, w13, w2  # w13 [E_local, 2I, H], w2 [E_local, H, I]
        self.k = op.config.num_experts_per_token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x, self.gate, self.k)
        # each token goes once to every rank holding one of its experts; there its (token, local expert) pairs
        # become rows grouped per expert: layout.x [P, H], layout.offs the group ends
        layout, handle = self.op.dispatch_grouped(x, weights, None, ids)
        y = experts_grouped(layout.x, layout.offs, self.w13, self.w2)
        out, _ = self.op.combine_grouped(y, handle)  # sum_k w_k * expert_k(x): weighted per row, then over ranks
        return out  # a fresh tensor per call


def experts_per_rank(experts: int, world: int) -> int:
    """The experts each rank holds; ValueError, naming counts that would pass, when `world` does not divide `experts`
    (the ids a router draws from `experts` must all exist: world × experts // world of them do)."""
    if experts < world or experts % world:
        fit = sorted({max(world, experts // world * world), (experts // world + 1) * world})
        raise ValueError(f"--experts {experts}: {world} rank(s) hold the experts in equal shares, so the world size must "
                         f"divide the expert count ({world} × {experts // world} = {experts // world * world}); "
                         f"try --experts {' or '.join(map(str, fit))}")
    return experts // world


def build(hidden=7168, experts=256, topk=8, inter=2048, tokens=128, capacity=0, seed=0, device=None):
    """The rank's MoEBlock (torch.distributed initialised; world size divides `experts`). capacity: rows of
    the grouped layout, a multiple of 16 (0: the worst case, which never drops a pair; op.grouped_layout()'s
    dropped counts the pairs past a smaller one)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    per_rank = experts_per_rank(experts, world)
    cfg = EpDispatchCombineConfig(rank=rank, world_size=world, hidden_dim=hidden, max_num_inp_token_per_rank=tokens,
                                  num_experts_per_rank=per_rank, num_experts_per_token=topk, data_type=torch.bfloat16,
                                  enable_grouped_layout=True, expert_alignment=16, grouped_capacity=capacity)
    mine = [expert_weights(e, hidden, inter, seed, device) for e in range(rank * per_rank, (rank + 1) * per_rank)]
    w13, w2 = (torch.stack(ws) for ws in zip(*mine))
    return MoEBlock(EpDispatchCombineOp(cfg), router_weight(experts, hidden, seed, device), w13, w2)


TOLERANCE = 1e-2  # largest per-token ||layer - dense|| / ||dense|| accepted (tests/runtime/test_moe_layer.py's bound)


def dense_error(x: torch.Tensor, y: torch.Tensor, block: MoEBlock, hidden: int, inter: int, seed: int = 0) -> float:
    """The largest per-token relative distance of y (the EP layer's output for x) from the same layer computed
    densely on this rank: every expert a token routes to, rebuilt from its seed, weighted and summed."""
    w, idx = route(x, block.gate, block.k)
    want = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in idx.unique().tolist():
        w13, w2 = expert_weights(e, hidden, inter, seed, x.device)
        want += (w * (idx == e)).sum(1, keepdim=True) * expert_ffn(x, w13, w2).float()
    want = want.to(torch.bfloat16).float()
    return float(((y.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)).max())


def shape_arguments(p: argparse.ArgumentParser, hidden=7168, experts=256, topk=8, inter=2048, tokens=128) -> None:
    """The layer's shape flags (examples/train_moe.py takes them too, with defaults of its own)."""
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--experts", type=int, default=experts)
    p.add_argument("--topk", type=int, default=topk)
    p.add_argument("--intermediate", type=int, default=inter)
    p.add_argument("--tokens", type=int, default=tokens, help="tokens per rank")


def init_ranks(p: argparse.ArgumentParser, args) -> None:
    """Refuse an expert count the world size does not divide (before any process group: every rank alike, in one
    line), then join the process group: NCCL on GPUs (the generated kernels), gloo on CPU (the torch backend)."""
    try:
        experts_per_rank(args.experts, int(os.environ.get("WORLD_SIZE", 1)))
    except ValueError as e:
        p.error(str(e))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        if int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > torch.cuda.device_count():
            dist.init_process_group("gloo")  # ranks sharing a GPU (NCCL refuses them): correctness runs only
        else:
            dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")  # the torch backend of epgen runs on gloo


def main() -> int:
    p = argparse.ArgumentParser(description="A DeepSeek-V3-shaped MoE block with epgen expert parallelism")
    shape_arguments(p)
    p.add_argument("--capacity", type=int, default=0, help="rows of the grouped layout, a multiple of 16 (0: the worst case)")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    init_ranks(p, args)
    block = build(args.hidden, args.experts, args.topk, args.intermediate, args.tokens, args.capacity)
    g = torch.Generator(device=block.gate.device).manual_seed(dist.get_rank())
    x = torch.randn(args.tokens, args.hidden, generator=g, device=block.gate.device).to(torch.bfloat16)
    with block.op:
        y = block(x)  # warm-up
        sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            y = block(x)
        sync()
        ms = (time.perf_counter() - t0) * 1e3 / args.iters
        err = dense_error(x, y, block, args.hidden, args.intermediate)
    rank, world = dist.get_rank(), dist.get_world_size()
    lines = [None] * world  # each rank's line, printed whole by rank 0
    dist.all_gather_object(lines, (err, f"rank {rank}: {args.tokens} tokens x hidden {args.hidden}, {args.experts} "
                                        f"experts top-{args.topk}: {ms:.2f} ms per layer (eager), largest per-token "
                                        f"relative error vs the dense layer {err:.2e}"))
    worst = max(e for e, _ in lines)
    if rank == 0:
        print("\n".join(line for _, line in lines))
        print(f"{'OK' if worst <= TOLERANCE else 'MISMATCH'}: the EP layer on {world} rank(s) "
              f"{'matches' if worst <= TOLERANCE else 'differs from'} its dense reference (largest per-token relative "
              f"error {worst:.2e}, tolerance {TOLERANCE:g})")
    dist.destroy_process_group()
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    raise SystemExit(main())
