"""Tuner: measure the EP kernels' launch geometries on this machine's GPUs and keep the fastest.

torchrun --nproc-per-node N -m bench.tune [--tokens 128 4096] [--hidden 7168] [--topk 8] [--experts 256]
                                            [--blocks B ...] [--threads 256 512] [--rows wave [block]]
                                            [--write | --write-specs] [--fallback]
torchrun --nproc-per-node N -m bench.tune --ll-threshold [--tokens 1 8 32 64 128 256 512] [--write]
(or: torchrun --nproc-per-node N $(which epgen) tune ...)

For each token count (a bucket edge) it times dispatch and combine (graph replay, slowest-rank
median, correctness-gated like the benchmark) for every candidate (blocks, threads, dispatch rows)
and keeps the fastest. --write: rank 0 writes this target's buckets for this run's world size (`world =
N`; --fallback: the buckets any world size without its own falls back to) into the user tuning file
($EPGEN_TUNING_FILE, else ~/.config/epgen/tuning.toml), which the runtime lays over the specs'
tuning.toml; --write-specs: into the checkout's specs/tuning.toml instead (to commit; refused for the copy
installed with the package). Other world sizes' and other targets' entries are kept as they are.

--ll-threshold times one round (dispatch + combine, graph replay, slowest rank's median, identity-gated)
with the low-latency and the bandwidth intranode protocols at each token count (each protocol with its
tuning-table geometry) and sets this target's ``intranode_ll_max_tokens`` (what ``intranode_protocol =
"auto"`` switches on) to the largest count up to which the low-latency protocol won at every count
measured (0: it never did).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from generator import specs as gspecs

from runtime import EpDispatchCombineConfig, EpDispatchCombineOp
from runtime.errors import EpgenError
from runtime.kernels import device_arch

from .cli import require_gpus
from .measure import graph_time, stats

HEADER_END = "# `python -m bench.tune`"
USER_HEADER = ("# Launch geometry tuned on this machine by `python -m bench.tune --write` (epgen tune): laid over the\n"
               "# specs' tuning.toml by the runtime, table by table and world size by world size. Delete it to go\n"
               "# back to the shipped tables.\n")


def render(tuning: dict[tuple[str, str], list[gspecs.Bucket]], header: str, ll_max: dict[str, int] | None = None) -> str:
    """Tuning-file text for these buckets (targets and roles in a stable order), the low-latency threshold of
    each target ll_max names first."""
    out = [header.rstrip("\n"), ""]
    ll_max = ll_max or {}
    for target in sorted({t for t, _ in tuning} | set(ll_max)):
        if target in ll_max:
            out += [f"[tuning.{target}]", f"{gspecs.LL_THRESHOLD_KEY} = {ll_max[target]}", ""]
        for role, b in ((role, b) for role in gspecs.TUNING_ROLES for b in tuning.get((target, role), ())):
            out += ([f"[[tuning.{target}.{role}]]"] + ([f"world = {b.world}"] if b.world else []) +
                    [f"max_tokens = {b.max_tokens}", f"blocks = {b.blocks}", f"threads = {b.threads}"] +
                    ([f'rows = "{b.rows}"'] if b.rows != "wave" else []) + [""])
    return "\n".join(out).rstrip("\n") + "\n"


def rewrite(path: Path, target: str, new: dict[str, list[gspecs.Bucket]], ll_max: int | None = None) -> str:
    """Replace `target`'s buckets of the world size the new ones carry (their `world`; 0: the fallback)
    in the tuning file at `path`, keeping every other world's, and its low-latency threshold when
    `ll_max` is given; returns the new text."""
    specs = gspecs.load(path.parent, tuning_overlay=False)
    text = path.read_text()
    header = text[: re.search(r"^\[\[?tuning\.", text, re.M).start()]
    tuning = {key: list(b) for key, b in specs.tuning.items()}
    for role, buckets in new.items():
        worlds = {b.world for b in buckets}
        tuning[(target, role)] = [b for b in tuning[(target, role)] if b.world not in worlds] + list(buckets)
    thresholds = dict(specs.ll_max_tokens)
    if ll_max is not None:
        thresholds[target] = ll_max
    return render(tuning, header, thresholds)


def rewrite_user(path: Path, target: str, new: dict[str, list[gspecs.Bucket]], ll_max: int | None = None) -> str:
    """The user tuning file at `path` (absent: empty) with `target`'s new buckets and threshold laid over it
    (as rewrite), holding only what was tuned; returns the new text."""
    targets = gspecs.load(tuning_overlay=False).targets
    tuning, thresholds = gspecs.read_tuning_overlay(path, targets) if path.exists() else ({}, {})
    tuning = gspecs.merge_tuning(tuning, {(target, role): buckets for role, buckets in new.items()})
    if ll_max is not None:
        thresholds = {**thresholds, target: ll_max}
    return render(tuning, USER_HEADER, thresholds)


def write_tables(args, target: str, new: dict[str, list[gspecs.Bucket]], ll_max: int | None = None) -> None:
    """--write: the user tuning file; --write-specs: the checkout's specs/tuning.toml (rank 0)."""
    if args.write_specs:
        path = gspecs.default_root() / "tuning.toml"
        path.write_text(rewrite(path, target, new, ll_max))
    else:
        path = gspecs.user_tuning_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rewrite_user(path, target, new, ll_max))
    print(f"wrote {path}")


def ll_threshold(rounds: dict[int, tuple[float, float]]) -> int:
    """{tokens: (low-latency us, bandwidth us)} -> the largest token count up to which the low-latency
    protocol was faster at every measured count (0: not at the smallest)."""
    best = 0
    for t in sorted(rounds):
        ll, bw = rounds[t]
        if not ll < bw:
            break
        best = t
    return best


def buckets_from(best: dict[int, tuple], world: int = 0) -> list[gspecs.Bucket]:
    """Measured token counts -> buckets for ops of `world` ranks (0: the fallback): each count ends a
    bucket; the largest one is unlimited. best[T] = (blocks, threads) or (blocks, threads, rows)."""
    counts = sorted(best)
    return [gspecs.Bucket(max_tokens=0 if t == counts[-1] else t, blocks=best[t][0], threads=best[t][1],
                          rows=best[t][2] if len(best[t]) > 2 else "wave", world=world)
            for t in counts]


def measure(T: int, hidden: int, k: int, experts: int, blocks: int, threads: int, rows: str = "wave",
            protocol: str = "bw") -> tuple[float, float]:
    """(dispatch us, combine us) of one geometry (0, 0: the tuning table's) and intranode protocol."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = EpDispatchCombineConfig(rank=rank, world_size=world, hidden_dim=hidden, max_num_inp_token_per_rank=T,
                                  num_experts_per_rank=experts // world, num_experts_per_token=k,
                                  kernel_backend="native", launch_blocks=blocks, launch_threads=threads,
                                  launch_rows=rows, intranode_protocol=protocol)
    g = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(T, hidden, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.rand(T, experts, device="cuda", generator=g).topk(k, dim=1).indices.to(torch.int32)
    with EpDispatchCombineOp(cfg) as op:
        view = op.combine_in_view()
        out, _, _, _, _, h = op.dispatch(x, None, None, idx, return_routing=True)
        view.copy_(out)
        comb, _ = op.combine(view, routing=h)
        U = torch.zeros(T, world, device="cuda").scatter_(1, idx.long() // (experts // world), 1.0).sum(1)
        if not torch.equal(comb, (x.float() * U[:, None]).to(torch.bfloat16)):
            raise SystemExit(f"rank {rank}: identity check failed at blocks={blocks} threads={threads} rows={rows}")
        held = {}

        def disp():
            held["out"], _, _, _, _, held["h"] = op.dispatch(x, None, None, idx, return_routing=True)

        def comb_leg():
            op.combine(view, routing=held["h"])

        d_ms, c_ms = graph_time([disp, comb_leg], 10, 20)
        return stats(d_ms)[0] * 1e3, stats(c_ms)[0] * 1e3


def build_parser(prog: str = "python -m bench.tune") -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog=prog, description=doc[0] + "\n\n" + "\n\n".join(doc[2:]),
                                epilog=doc[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 4096],
                   help="tokens per rank to time, each the upper edge of a bucket (the largest: no limit); "
                        "default 128 4096 (--ll-threshold: 1 8 32 64 128 256 512)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size of the timed tokens (default 7168)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default 8)")
    p.add_argument("--experts", type=int, default=256, help="experts in all, divided over the ranks (default 256)")
    p.add_argument("--blocks", type=int, nargs="+", default=None,
                   help="candidate grid sizes (0: one per multiprocessor); default 16 32 64 0 and twice the "
                        "multiprocessors (kept only where the kernel's occupancy lets them all stay resident)")
    p.add_argument("--threads", type=int, nargs="+", default=[256, 512],
                   help="candidate threads per block (multiples of the wave size, at most 1024; default 256 512)")
    p.add_argument("--rows", nargs="+", default=["wave"], choices=["wave", "block"],
                   help="dispatch row modes to try (add block for whole-block rows: slower at every point "
                        "measured on 2xH200, results/tune_rows_and_host_2xH200.log); combine takes its best "
                        "over all candidates")
    p.add_argument("--ll-threshold", action="store_true",
                   help="time the low-latency vs the bandwidth protocol per token count (tuning-table geometry) and "
                        "set intranode_ll_max_tokens; --tokens default 1 8 32 64 128 256 512")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--write", action="store_true",
                       help=f"write the tuned tables into the user tuning file (${gspecs.TUNING_ENV}, else "
                            "~/.config/epgen/tuning.toml), which the runtime reads over the specs' tables; "
                            "without --write nothing is written")
    where.add_argument("--write-specs", action="store_true",
                       help="write them into the checkout's specs/tuning.toml instead (to commit them)")
    p.add_argument("--fallback", action="store_true",
                   help="write the buckets every world size falls back to, not those of this run's world size")
    return p


def main(argv=None, prog: str = "python -m bench.tune") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.write_specs and gspecs.is_packaged(gspecs.default_root()):
        raise SystemExit(f"{prog}: error: --write-specs: the specs in use are the copy installed with the package "
                         f"({gspecs.default_root()}); use --write (the user tuning file) instead")
    require_gpus(prog)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    if args.ll_threshold:
        return tune_ll_threshold(args)
    if args.blocks is None:
        args.blocks = [16, 32, 64, 0, 2 * torch.cuda.get_device_properties(0).multi_processor_count]
    best = {"dispatch": {}, "combine": {}}
    for T in args.tokens:
        for blocks, threads, rows in itertools.product(args.blocks, args.threads, args.rows):
            try:
                d, c = measure(T, args.hidden, args.topk, args.experts, blocks, threads, rows)
            except EpgenError as exc:  # raised alike on every rank, at construction
                if dist.get_rank() == 0:
                    print(f"T={T:>5} blocks={blocks:>3} threads={threads:>4} rows={rows:>5}: skipped: {exc}")
                continue
            if dist.get_rank() == 0:
                print(f"T={T:>5} blocks={blocks:>3} threads={threads:>4} rows={rows:>5}: dispatch {d:8.1f} us  "
                      f"combine {c:8.1f} us")
            for role, t, geo in (("dispatch", d, (blocks, threads, rows)), ("combine", c, (blocks, threads))):
                if T not in best[role] or t < best[role][T][-1]:
                    best[role][T] = (*geo, t)
    if dist.get_rank() == 0:
        arch = device_arch(torch.device("cuda"))
        world = 0 if args.fallback else dist.get_world_size()
        new = {role: buckets_from({T: v[:-1] for T, v in per.items()}, world) for role, per in best.items()}
        for role, bs in new.items():
            print(f"{arch} {role}: " + ", ".join(f"<= {b.max_tokens or 'any'}: {b.blocks or 'SMs'} x {b.threads}"
                                                 f"{' (block rows)' if b.rows == 'block' else ''}" for b in bs))
        if args.write or args.write_specs:
            write_tables(args, arch, new)
    dist.destroy_process_group()
    return 0


def tune_ll_threshold(args) -> int:
    tokens = args.tokens if args.tokens != [128, 4096] else [1, 8, 32, 64, 128, 256, 512]
    rounds = {}
    for T in tokens:
        ll, bw = (sum(measure(T, args.hidden, args.topk, args.experts, 0, 0, "wave", protocol))
                  for protocol in ("ll", "bw"))
        rounds[T] = (ll, bw)
        if dist.get_rank() == 0:
            print(f"T={T:>5}: dispatch + combine: low-latency {ll:8.1f} us  bandwidth {bw:8.1f} us")
    if dist.get_rank() == 0:
        arch, n = device_arch(torch.device("cuda")), ll_threshold(rounds)
        print(f"{arch} {gspecs.LL_THRESHOLD_KEY} = {n}")
        if args.write or args.write_specs:
            write_tables(args, arch, {}, ll_max=n)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
