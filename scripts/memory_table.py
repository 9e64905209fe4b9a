"""What an op allocates per rank, from the kernel plan's buffer table (runtime/plan.py, the table the native
backend allocates from and memory_report() reads; no GPU needed): the DeepSeek-V3 shape (bf16, hidden 7168,
top-8 of 256 experts) by world size and tokens per rank, without and with the grouped layout, and with a
grouped_capacity of twice the balanced load (the drops it may count are the price of the smaller buffer).

  python scripts/memory_table.py [--world 2 8] [--tokens 1 128 4096] [--hidden 7168] [--topk 8] [--experts 256]
                                 [--target sm_90]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime import EpDispatchCombineConfig  # noqa: E402
from runtime.config import load_specs  # noqa: E402
from runtime.op import native_workspace  # noqa: E402
from runtime.plan import Plan  # noqa: E402

GIB = 1 << 30


def config(world: int, tokens: int, args, **extra) -> EpDispatchCombineConfig:
    return EpDispatchCombineConfig(rank=0, world_size=world, hidden_dim=args.hidden, max_num_inp_token_per_rank=tokens,
                                   num_experts_per_rank=args.experts // world, num_experts_per_token=args.topk,
                                   data_type=torch.bfloat16, kernel_backend="torch", **extra)


def balanced_capacity(cfg: EpDispatchCombineConfig, alignment: int = 16) -> int:
    """Twice the grouped rows of a balanced load (tokens x k pairs per rank) plus each expert's padding, at most
    the worst case."""
    rows = 2 * cfg.max_num_inp_token_per_rank * cfg.num_experts_per_token + cfg.num_experts_per_rank * (alignment - 1)
    return min(-(-rows // alignment) * alignment, cfg.worst_case_grouped_rows)


def allocated(cfg: EpDispatchCombineConfig, target) -> dict:
    """The formula for this config as an op on `target` lays it out (its low-latency buffers when its protocol
    takes them)."""
    return native_workspace(cfg, ll_tokens=Plan.of(cfg, target).ll_tokens)


def row(world: int, tokens: int, args, target) -> str:
    plain = allocated(config(world, tokens, args), target)["total_bytes"]
    grouped_cfg = config(world, tokens, args, enable_grouped_layout=True, expert_alignment=16)
    grouped = allocated(grouped_cfg, target)
    cap = balanced_capacity(grouped_cfg)
    capped = allocated(config(world, tokens, args, enable_grouped_layout=True, expert_alignment=16,
                              grouped_capacity=cap), target)["total_bytes"]
    return (f"| {world} | {tokens} | {plain / GIB:.3f} | {grouped['total_bytes'] / GIB:.3f} | "
            f"{grouped['regions']['grouped_x'] / GIB:.3f} | {cap} | {capped / GIB:.3f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[2, 8])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 4096])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--target", default="sm_90", help="the target whose low-latency threshold decides the protocol")
    args = p.parse_args()
    target = load_specs().targets[args.target]
    print(f"(per rank, GiB, on {args.target}; bf16, hidden {args.hidden}, top-{args.topk} of {args.experts} experts, expert_alignment 16)")
    print()
    print("| world | tokens/rank | plain | grouped layout | of which grouped_x | grouped_capacity (2x balanced) "
          "| grouped, that capacity |")
    print("|---|---|---|---|---|---|---|")
    for world in args.world:
        for tokens in args.tokens:
            print(row(world, tokens, args, target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
