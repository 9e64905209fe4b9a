"""dispatch_direct's histograms (its step 1) in isolation, in several forms, on its launch geometry: which way of
counting a batch's expert ids per block is fastest on this GPU (scripts/hist_probe.cu says what each form does).

    python scripts/hist_probe.py [--tokens 128 1024 4096] [--experts 256] [--topk 8] [--world 1 2]
                                 [--blocks 0] [--threads 512] [--launches 16] [--reps 50] [--out F]

The .cu file is built for the sm_90 target with the generator's own toolchain (specs/targets.toml) and loaded as a
cubin. Per (form, world, T): the ids are each token's top-k distinct experts of a seeded random draw, every block
checked against torch (its count before its own range and over all tokens, per expert and per rank) before the form
is timed as a graph of --launches launches (the median over --reps replays, per launch). One record of kind
"hist_probe" per point with bench.records.meta; the table printed last. --blocks 0: one block per multiprocessor
(dispatch_direct's grid), rounded down to a multiple of 4 for the cluster forms' sake. For the cluster forms the
records also hold how many clusters can be resident at once (dispatch_direct waits for its whole grid, so a cluster
form there needs every cluster of its grid resident: an SM group whose SMs are no multiple of the cluster size leaves
some idle).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FORMS = ("hp_atomic", "hp_replica4", "hp_replica8", "hp_replica16", "hp_cluster2", "hp_cluster4")
MAX_BUCKETS = 320  # scripts/hist_probe.cu's HP_MAX_BUCKETS: experts + ranks


class HpArgs(ctypes.Structure):  # scripts/hist_probe.cu's HpArgs, passed by value
    _fields_ = [("idx", ctypes.c_void_p), ("pre", ctypes.c_void_p), ("tot", ctypes.c_void_p), ("T", ctypes.c_int),
                ("K", ctypes.c_int), ("experts", ctypes.c_int), ("per_rank", ctypes.c_int), ("world", ctypes.c_int),
                ("rank_magic", ctypes.c_uint)]


def expected(ids: torch.Tensor, experts: int, world: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pre, tot) [blocks, experts + world] int32 of ids [T, k]: per block b (its tokens [b T / G, (b + 1) T / G)),
    the pairs per expert and the tokens with a pair per rank (experts // world a rank), over the tokens before its
    range and over all tokens."""
    T = ids.shape[0]
    per_rank = experts // world
    one = torch.zeros((T, experts + world), dtype=torch.int64, device=ids.device)
    one.scatter_add_(1, ids.long(), torch.ones_like(ids, dtype=torch.int64))
    ranks = torch.zeros((T, world), dtype=torch.int64, device=ids.device)
    ranks.scatter_(1, (ids.long() // per_rank), 1)
    one[:, experts:] = ranks
    prefix = torch.cat([torch.zeros_like(one[:1]), one.cumsum(0)])  # [T + 1, B]: counts before token t
    starts = torch.tensor([b * T // blocks for b in range(blocks)], device=ids.device)
    return prefix[starts].to(torch.int32), prefix[T].expand(blocks, -1).to(torch.int32).contiguous()


def build(out_dir: Path) -> bytes:
    """scripts/hist_probe.cu built for sm_90 with the specs' toolchain -> the cubin's bytes."""
    from generator import toolchain
    from runtime.config import load_specs

    specs = load_specs()
    target = specs.targets["sm_90"]
    try:
        tools = toolchain.find(specs.toolchains[target.toolchain])
    except toolchain.ToolchainMissing as e:
        raise RuntimeError(f"hist_probe: no compiler for sm_90: {e}") from e
    cubin = out_dir / "hist_probe.cubin"
    res = toolchain.run(toolchain.compile_command(target, tools, ROOT / "scripts" / "hist_probe.cu", cubin), tools)
    if res.returncode != 0:
        raise RuntimeError(f"hist_probe: building scripts/hist_probe.cu failed:\n{res.stderr[-3000:]}")
    return cubin.read_bytes()


def max_active_clusters(kernel, blocks: int, threads: int) -> int | None:
    """Clusters of a cluster form's kernel that can be resident at once on this GPU (cuOccupancyMaxActiveClusters:
    whether its grid's clusters all fit, which a kernel with a grid barrier needs), or None where the query fails."""
    try:
        cu = kernel._cu
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = blocks, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
        cfg.sharedMemBytes, cfg.numAttrs = 0, 0
        err, n = cu.cuOccupancyMaxActiveClusters(kernel.function, cfg)
        return int(n) if err == cu.CUresult.CUDA_SUCCESS else None
    except Exception:  # noqa: BLE001 - a fact for the table, not a condition of the measurement
        return None


def points(image: bytes, tokens: list[int], experts: int, topk: int, worlds: list[int], blocks: int, threads: int,
           launches: int, reps: int) -> tuple[list[dict], list[str]]:
    """(records, failures): each form at every (world, T), checked against torch before it is timed; a form that
    fails (it would not load or launch, or its counts differ) is named in failures and the others still run."""
    from bench.graphprof import graph_us
    from runtime.kernels import CudaKernel

    dev = torch.device("cuda", torch.cuda.current_device())
    out, failures = [], []
    for form in FORMS:
        kernel = None
        try:
            kernel = CudaKernel(image, form)
            for world in worlds:
                for T in tokens:
                    g = torch.Generator(device=dev).manual_seed(T)
                    ids = torch.rand((T, experts), generator=g, device=dev).topk(topk, dim=1).indices
                    ids = ids.to(torch.int32).contiguous()
                    B, per_rank = experts + world, experts // world
                    pre = torch.full((blocks, B), -1, dtype=torch.int32, device=dev)
                    tot = torch.full((blocks, B), -1, dtype=torch.int32, device=dev)
                    args = HpArgs(ids.data_ptr(), pre.data_ptr(), tot.data_ptr(), T, topk, experts, per_rank, world,
                                  -(-(1 << 32) // per_rank) & 0xFFFFFFFF)

                    def run(kernel=kernel, args=args):
                        kernel.launch(blocks, threads, args)

                    run()
                    torch.cuda.synchronize()
                    want_pre, want_tot = expected(ids, experts, world, blocks)
                    if not (torch.equal(pre, want_pre) and torch.equal(tot, want_tot)):
                        bad = int((pre != want_pre).any(1).logical_or((tot != want_tot).any(1)).sum())
                        raise RuntimeError(f"at {T} tokens, world {world}: {bad} of {blocks} blocks' histograms "
                                           "differ from torch's")
                    out.append({"form": form, "world": world, "tokens_per_rank": T, "blocks": blocks,
                                "threads": threads, "us": graph_us(run, launches, reps),
                                "max_active_clusters": max_active_clusters(kernel, blocks, threads)
                                if "cluster" in form else None})
        except Exception as e:  # noqa: BLE001 - one form's failure is reported; the other forms are still measured
            failures.append(f"hist_probe: {form}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        finally:
            if kernel is not None:
                kernel.close()
    return out, failures


def table(recs: list[dict]) -> list[str]:
    forms = list(dict.fromkeys(r["form"] for r in recs))
    lines = ["| world | tokens | " + " | ".join(forms) + " |", "|---|---|" + "---|" * len(forms)]
    keys = list(dict.fromkeys((r["world"], r["tokens_per_rank"]) for r in recs))
    for w, T in keys:
        us = {r["form"]: r["us"] for r in recs if (r["world"], r["tokens_per_rank"]) == (w, T)}
        lines.append(f"| {w} | {T} | " + " | ".join(f"{us[f]:.2f}" if f in us else "–" for f in forms) + " |")
    return lines


def parse(argv=None) -> argparse.Namespace:
    from bench.graphprof import add_graph_args, check_graph_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--world", type=int, nargs="+", default=[1, 2], help="ranks the experts are split over")
    p.add_argument("--blocks", type=int, default=0, help="0: one per multiprocessor, a multiple of 4")
    p.add_argument("--threads", type=int, default=512)
    add_graph_args(p)
    args = p.parse_args(argv)
    if any(not 1 <= t <= 1 << 20 for t in args.tokens):
        p.error("--tokens must each be in [1, 2^20]")
    if not 1 <= args.topk <= min(64, args.experts):
        p.error("--topk must be in [1, min(64, --experts)]")
    if any(not 1 <= w <= 64 or args.experts % w for w in args.world):
        p.error("--world must each be in [1, 64] and divide --experts")
    if any(args.experts + w > MAX_BUCKETS for w in args.world):
        p.error(f"--experts + --world must be at most {MAX_BUCKETS} (scripts/hist_probe.cu's HP_MAX_BUCKETS)")
    if not 0 <= args.blocks <= 4096 or args.blocks % 4:
        p.error("--blocks must be 0 or a multiple of 4 up to 4096 (the cluster forms take 4 blocks a cluster)")
    if args.threads % 32 or not 32 <= args.threads <= 512:
        p.error("--threads must be a multiple of 32 in [32, 512]")
    check_graph_args(p, args)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available() or torch.version.cuda is None:
        print("hist_probe: needs an NVIDIA GPU (the forms are sm_90 kernels); none is visible", file=sys.stderr)
        return 2
    from bench.records import meta, write_records
    dev = torch.device("cuda", torch.cuda.current_device())
    blocks = args.blocks or torch.cuda.get_device_properties(dev).multi_processor_count // 4 * 4
    try:
        with tempfile.TemporaryDirectory() as tmp:
            image = build(Path(tmp))
    except RuntimeError as e:  # no compiler, or the build failed (the message says which)
        print(str(e), file=sys.stderr)
        return 1
    recs, failures = points(image, args.tokens, args.experts, args.topk, args.world, blocks, args.threads,
                            args.launches, args.reps)
    recs = [meta(dev, kind="hist_probe", experts=args.experts, topk=args.topk, graph=True,
                 launches_per_graph=args.launches, reps=args.reps, **r) for r in recs]
    if args.out is not None:
        write_records(args.out, recs)
    print(f"hist_probe: µs per launch (graph), {blocks} blocks x {args.threads} threads, top-{args.topk} of "
          f"{args.experts} experts; every form checked against torch first")
    if recs:
        print("\n".join(table(recs)))
    fits = {r["form"]: r["max_active_clusters"] for r in recs if r["max_active_clusters"] is not None}
    if fits:
        print("clusters resident at once: " + ", ".join(f"{f} {n}" for f, n in fits.items()) + f" (the grid's: "
              + ", ".join(f"{f} {blocks // int(f[len('hp_cluster'):])}" for f in fits) + ")")
    for line in failures:
        print(line, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
