"""The memory's floor of the grouped layer's two legs at one rank (W = 1, no link): plain Triton kernels in a CUDA
graph doing only what the legs must do at least, on the layer's shape (scripts/grouped_profile.py's), so a leg's
kernel time reads as a multiple of its floor on the same card.

    torchrun --nproc-per-node 1 scripts/hbm_floor.py [--tokens 1 128 4096] [--hidden 7168] [--topk 8]
                                                     [--experts 256] [--launches 16] [--reps 50] [--out F]

Per token count T (bf16, each token's top-k distinct experts of a seeded random draw), one program per token:
  expand  x [T, H] -> pair rows [T k, H]: each token's row stored at its k pairs' positions in the grouped order
          (by expert, tokens in order within an expert, no padding): what dispatch_grouped moves at W = 1;
  reduce  pair rows [T k, H] -> out [T, H]: a token's k pair rows weighted in fp32 and summed: what combine_grouped
          moves at W = 1;
  copy    x [T, H] -> out [T, H]: the plain legs' floor;
and the launch's own cost: an empty kernel of one program, and of one program per SM. Each kernel is checked
against torch first, then timed as a graph of --launches launches, the median over --reps replays, per launch.
One record of kind "hbm_floor" per (kernel, T) with bench.records.meta (commit, GPU, driver, torch) and triton's
version, the bytes it moves and their rate; the table printed last.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def grouped_positions(ids: torch.Tensor) -> torch.Tensor:
    """Expert ids [T, k] -> each pair's row in the grouped order [T, k] int32: pairs sorted by expert, the tokens
    in order within an expert (a stable sort of the flattened ids), no padding between the groups."""
    order = torch.sort(ids.reshape(-1), stable=True).indices
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=ids.device)
    return pos.view(ids.shape).to(torch.int32)


def routing(tokens: int, experts: int, topk: int, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k] int32: distinct experts per token, weights [T, k] float32) from a seeded draw."""
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand((tokens, experts), generator=g, device=device)
    w, ids = scores.topk(topk, dim=1)
    return ids.to(torch.int32), w


def bytes_moved(kernel: str, tokens: int, hidden: int, topk: int, elem: int = 2) -> int:
    """The row bytes a kernel reads and writes (the ids, positions and weights left out: under 1 % at k = 8)."""
    row = hidden * elem
    return {"expand": tokens * row * (1 + topk), "reduce": tokens * row * (1 + topk), "copy": 2 * tokens * row,
            "empty": 0, "empty_per_sm": 0}[kernel]


@functools.cache
def _kernels():
    """(triton, the Triton kernels), made once on first use (triton imports only where there is a GPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def expand(x, pos, rows, H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, KP)
        dst = tl.load(pos + t * K + j, mask=j < K, other=0).to(tl.int64)  # the token's k rows, loaded once
        for c0 in tl.range(0, H, BLOCK):
            col = c0 + tl.arange(0, BLOCK)
            v = tl.load(x + t * H + col, mask=col < H)
            m = (j[:, None] < K) & (col[None, :] < H)
            tl.store(rows + dst[:, None] * H + col[None, :], tl.broadcast_to(v[None, :], (KP, BLOCK)), mask=m)

    @triton.jit
    def reduce(rows, pos, w, out, H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, KP)
        src = tl.load(pos + t * K + j, mask=j < K, other=0).to(tl.int64)
        wt = tl.load(w + t * K + j, mask=j < K, other=0.0)
        for c0 in tl.range(0, H, BLOCK):
            col = c0 + tl.arange(0, BLOCK)
            m = (j[:, None] < K) & (col[None, :] < H)
            v = tl.load(rows + src[:, None] * H + col[None, :], mask=m, other=0.0).to(tl.float32)
            tl.store(out + t * H + col, tl.sum(v * wt[:, None], axis=0).to(out.dtype.element_ty), mask=col < H)

    @triton.jit
    def copy(x, out, H: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        for c0 in tl.range(0, H, BLOCK):
            col = c0 + tl.arange(0, BLOCK)
            tl.store(out + t * H + col, tl.load(x + t * H + col, mask=col < H), mask=col < H)

    @triton.jit
    def empty(p):
        pass

    return triton, {"expand": expand, "reduce": reduce, "copy": copy, "empty": empty}


def points(tokens: list[int], hidden: int, topk: int, experts: int, launches: int, reps: int) -> list[dict]:
    """Every (kernel, T) point on the current GPU, each checked against torch before it is timed."""
    from bench.graphprof import graph_us

    triton, k = _kernels()
    dev = torch.device("cuda", torch.cuda.current_device())
    KP = triton.next_power_of_2(topk)
    BLOCK = min(1024, max(64, 8192 // KP))  # a program's tile of the k rows: at most 8192 values
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = [{"kernel": "empty", "tokens_per_rank": None, "us": graph_us(lambda: k["empty"][(1,)](flag), launches, reps)},
           {"kernel": "empty_per_sm", "tokens_per_rank": None,
            "us": graph_us(lambda: k["empty"][(sms,)](flag), launches, reps)}]
    for T in tokens:
        ids, w = routing(T, experts, topk, dev, seed=T)
        pos = grouped_positions(ids)
        x = torch.randn((T, hidden), device=dev, dtype=torch.bfloat16)
        rows = torch.empty((T * topk, hidden), device=dev, dtype=torch.bfloat16)
        y = torch.empty((T, hidden), device=dev, dtype=torch.bfloat16)
        runs = {
            "expand": lambda: k["expand"][(T,)](x, pos, rows, H=hidden, K=topk, KP=KP, BLOCK=BLOCK),
            "reduce": lambda: k["reduce"][(T,)](rows, pos, w, y, H=hidden, K=topk, KP=KP, BLOCK=BLOCK),
            "copy": lambda: k["copy"][(T,)](x, y, H=hidden, BLOCK=1024),
        }
        runs["expand"]()  # the checks: every pair row is its token's row; the sums within bf16's rounding
        want_rows = torch.empty_like(rows)
        want_rows[pos.reshape(-1).long()] = x.repeat_interleave(topk, dim=0)
        if not torch.equal(rows, want_rows):
            raise RuntimeError(f"hbm_floor: the expand kernel's rows differ from torch's at {T} tokens")
        runs["reduce"]()
        want = w.sum(1, keepdim=True) * x.float()  # every pair row of a token is its row
        if not torch.allclose(y.float(), want, rtol=2e-2, atol=2e-2):
            raise RuntimeError(f"hbm_floor: the reduce kernel's sums differ from torch's at {T} tokens")
        runs["copy"]()
        if not torch.equal(y, x):
            raise RuntimeError(f"hbm_floor: the copy kernel's rows differ from its input at {T} tokens")
        for name, fn in runs.items():
            out.append({"kernel": name, "tokens_per_rank": T, "us": graph_us(fn, launches, reps)})
    for r in out:
        T = r["tokens_per_rank"]
        r["bytes"] = bytes_moved(r["kernel"], T or 0, hidden, topk)
        r["tbps"] = r["bytes"] / r["us"] / 1e6 if r["bytes"] else None
    return out


def table(recs: list[dict]) -> list[str]:
    lines = ["| kernel | tokens | µs per launch (graph) | bytes | TB/s |", "|---|---|---|---|---|"]
    for r in recs:
        rate = f"{r['tbps']:.2f}" if r["tbps"] else "–"
        lines.append(f"| {r['kernel']} | {r['tokens_per_rank'] or '–'} | {r['us']:.2f} | {r['bytes']} | {rate} |")
    return lines


def parse(argv=None) -> argparse.Namespace:
    from bench.graphprof import add_graph_args, check_graph_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 4096])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    add_graph_args(p)
    args = p.parse_args(argv)
    if any(not 1 <= t <= 1 << 20 for t in args.tokens):
        p.error("--tokens must each be in [1, 2^20]")
    if not 1 <= args.hidden <= 1 << 16:
        p.error("--hidden must be in [1, 65536]")
    if not 1 <= args.topk <= min(64, args.experts) or not 1 <= args.experts <= 4096:
        p.error("--topk must be in [1, min(64, --experts)] and --experts in [1, 4096]")
    check_graph_args(p, args)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("hbm_floor: needs a CUDA GPU (the floor is a device's); none is visible", file=sys.stderr)
        return 2
    from bench.records import meta, write_records
    triton, _ = _kernels()
    try:
        recs = points(args.tokens, args.hidden, args.topk, args.experts, args.launches, args.reps)
    except torch.cuda.OutOfMemoryError:
        print(f"hbm_floor: the rows of {max(args.tokens)} tokens x {args.topk} pairs x {args.hidden} do not fit in "
              f"this GPU's memory; ask for fewer tokens", file=sys.stderr)
        return 1
    except RuntimeError as e:  # a floor kernel that disagrees with torch (its message names which)
        print(str(e).splitlines()[0], file=sys.stderr)
        return 1
    info = meta(torch.device("cuda", torch.cuda.current_device()), kind="hbm_floor", triton=triton.__version__,
                dtype="bfloat16", hidden=args.hidden, topk=args.topk, experts=args.experts, graph=True,
                launches_per_graph=args.launches, reps=args.reps)
    recs = [{**info, **r} for r in recs]
    if args.out:
        write_records(args.out, recs)
    print(f"hbm_floor ({info['gpu']}, driver {info['driver']}, torch {info['torch']}, triton {info['triton']}; "
          f"bf16, hidden {args.hidden}, top-{args.topk} of {args.experts}):")
    print("\n".join(table(recs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
