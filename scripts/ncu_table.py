"""Tables of what Nsight Compute's warp sampling says about epgen's kernels (scripts/device_run.sh NCU=1 exports).

    python scripts/ncu_table.py DIR [--ranges] [--gap 8] [--min-samples 10]

DIR holds ncu_raw.csv(.gz) (ncu --page raw --csv) and, for --ranges, ncu_source.csv(.gz) (ncu --page source --csv
--print-source sass). Prints, per profiled launch, the kernel's duration and its warps' sampled states as shares of
all samples (smsp__pcsamp_warps_issue_stalled_*: no_instructions = the instruction fetch, imc_miss = the kernel
parameters' constant cache, barrier = a block barrier, long_scoreboard = a global / L2 load, wait = a fixed latency);
with --ranges, per launch, the stretches of SASS the launch executed (runs of executed instructions, joined across
gaps of at most --gap unexecuted ones), each with its samples by reason and its first SASS instruction: where a
stretch starts after a jump over code the launch never runs, its first instructions wait for the fetch.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import sys
from pathlib import Path

REASONS = ("no_instructions", "imc_miss", "barrier", "long_scoreboard", "short_scoreboard", "wait",
           "math_pipe_throttle", "branch_resolving", "not_selected", "selected", "membar", "drain", "mio_throttle",
           "lg_throttle", "dispatch_stall", "sleeping", "misc", "tex_throttle")
SOURCE_COLUMNS = {"no_inst": "stall_no_inst", "imc": "stall_imc", "barrier": "stall_barrier",
                  "long_sb": "stall_long_sb", "wait": "stall_wait"}


class TableError(Exception):
    pass


def _open(folder: Path, name: str):
    for path in (folder / name, folder / (name + ".gz")):
        if path.is_file():
            raw = path.read_bytes()
            if path.suffix == ".gz":
                try:
                    raw = gzip.decompress(raw)
                except (OSError, EOFError) as e:
                    raise TableError(f"{path}: not a gzip file ({e})") from None
            return io.StringIO(raw.decode("utf-8", errors="replace"))
    raise TableError(f"{folder}: no {name} or {name}.gz (scripts/device_run.sh NCU=1 writes them)")


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def launches(folder: Path) -> list[dict]:
    """Per profiled launch: kernel, duration µs, samples by reason (from the raw page)."""
    rows = list(csv.reader(_open(folder, "ncu_raw.csv")))
    if len(rows) < 3 or "Kernel Name" not in rows[0]:
        raise TableError(f"{folder}/ncu_raw.csv: not an ncu raw page (no header with 'Kernel Name')")
    head = rows[0]
    name_at = head.index("Kernel Name")
    dur_at = head.index("gpu__time_duration.sum") if "gpu__time_duration.sum" in head else None
    at = {r: head.index(f"smsp__pcsamp_warps_issue_stalled_{r}") for r in REASONS
          if f"smsp__pcsamp_warps_issue_stalled_{r}" in head}
    if not at:
        raise TableError(f"{folder}/ncu_raw.csv: no warp sampling metrics (profile with --section WarpStateStats "
                         f"--section SourceCounters)")
    out = []
    for r in rows[2:]:  # row 1: units
        if len(r) != len(head):
            continue
        dur = _number(r[dur_at]) if dur_at is not None else 0.0
        out.append({"kernel": r[name_at], "us": dur / 1e3 if dur > 1e3 else dur,
                    "samples": {k: _number(r[i]) for k, i in at.items()}})
    return out


def source_kernels(folder: Path) -> list[dict]:
    """Per profiled launch, its SASS rows (the source page), in the raw page's order."""
    out, head = [], None
    for r in csv.reader(_open(folder, "ncu_source.csv")):
        if r and r[0] == "Kernel Name" and len(r) > 1:
            out.append({"kernel": r[1], "rows": []})
            head = None
        elif r and r[0] == "Address" and out:
            head = r
        elif head and r and len(r) == len(head):
            out[-1]["rows"].append(dict(zip(head, r)))
    return out


def stretches(rows: list[dict], gap: int) -> list[dict]:
    """Runs of executed instructions (joined across at most `gap` unexecuted ones), with their samples."""
    executed = [_number(r.get("Instructions Executed", "0")) > 0 for r in rows]
    runs, start = [], None
    for i, e in enumerate(executed + [False]):
        if e and start is None:
            start = i
        elif not e and start is not None:
            if runs and start - runs[-1][1] - 1 <= gap:
                runs[-1] = (runs[-1][0], i - 1)
            else:
                runs.append((start, i - 1))
            start = None
    out = []
    for a, b in runs:
        part = rows[a:b + 1]
        out.append({"first": a, "last": b, "opens": part[0].get("Source", "").strip(),
                    "samples": sum(_number(r.get("Warp Stall Sampling (All Samples)", "0")) for r in part),
                    **{k: sum(_number(r.get(col, "0")) for r in part) for k, col in SOURCE_COLUMNS.items()}})
    return out


def reason_table(items: list[dict]) -> list[str]:
    shown = ("no_instructions", "imc_miss", "barrier", "long_scoreboard", "wait", "short_scoreboard")
    out = ["| launch | kernel | µs (under ncu) | samples | " + " | ".join(shown) + " | other |",
           "|---|---|---|---|" + "---|" * (len(shown) + 1)]
    for i, it in enumerate(items):
        total = sum(it["samples"].values()) or 1.0
        share = [it["samples"].get(k, 0.0) / total for k in shown]
        out.append(f"| {i} | {it['kernel'][:40]} | {it['us']:.2f} | {total:.0f} | "
                   + " | ".join(f"{s:.0%}" for s in share) + f" | {1 - sum(share):.0%} |")
    return out


def range_table(kernel: dict, gap: int, min_samples: float) -> list[str]:
    rows = kernel["rows"]
    runs = stretches(rows, gap)
    executed = sum(r["last"] - r["first"] + 1 for r in runs)
    out = [f"{kernel['kernel']}: {len(rows)} SASS instructions, {executed} in {len(runs)} executed stretches "
           f"(stretches with fewer than {min_samples:g} samples left out)",
           "| first | last | instructions | samples | no_inst | imc | barrier | long_sb | wait | opens with |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if r["samples"] >= min_samples:
            opens = r["opens"].replace("|", "/")[:48]
            out.append(f"| {r['first']} | {r['last']} | {r['last'] - r['first'] + 1} | {r['samples']:.0f} | "
                       f"{r['no_inst']:.0f} | {r['imc']:.0f} | {r['barrier']:.0f} | {r['long_sb']:.0f} | "
                       f"{r['wait']:.0f} | `{opens}` |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--ranges", action="store_true", help="the executed stretches of SASS per launch")
    p.add_argument("--gap", type=int, default=8)
    p.add_argument("--min-samples", type=float, default=10.0)
    args = p.parse_args(argv)
    if args.gap < 0 or args.min_samples < 0:
        p.error("--gap and --min-samples must be >= 0")
    try:
        items = launches(args.folder)
        print("\n".join(reason_table(items)))
        if args.ranges:
            for k in source_kernels(args.folder):
                print()
                print("\n".join(range_table(k, args.gap, args.min_samples)))
    except TableError as e:
        print(f"ncu_table: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
