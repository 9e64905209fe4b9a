"""Print the sweep table of docs/BENCH.md (markdown) from benchmark records.

python scripts/sweep_table.py [results/bench.jsonl] [--commit C]

Takes the intranode points of the default routing and the tuning table's launch geometry (records
without an experiment note or a launch_override) of one commit (default: the commit with the most
distinct such points, the newest among equals), one row per (dtype, hidden, tokens per rank),
graph-replay times and the eager, host and torch-backend columns.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for runtime
from bench.records import read_records  # noqa: E402
from bench.tables import cell, sweep_points as sweep_rows  # noqa: E402

HEADER = ("| dtype | hidden | tokens/rank | dispatch µs | combine µs | staged µs | round µs | NCCL a2a µs (d / c) "
          "| vs NCCL (d / c) | link GB/s (d / c) | eager µs (d / c) | host µs (d / c) | torch backend µs (d / c) |")


def _f(v, fmt: str) -> str:
    return cell(v, fmt, missing="–")


def table(rows: list[dict]) -> list[str]:
    out = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for r in rows:
        cells = [r["dtype"], str(r["hidden"]), str(r["tokens_per_rank"]), _f(r.get("dispatch_us"), ".1f"),
                 _f(r.get("combine_us"), ".1f"), _f(r.get("combine_staged_us"), ".1f"), _f(r.get("round_us"), ".1f"),
                 f"{_f(r.get('nccl_a2a_us'), '.1f')} / {_f(r.get('nccl_a2a_combine_us'), '.1f')}",
                 f"{_f(r.get('dispatch_vs_nccl'), '.2f')}× / {_f(r.get('combine_vs_nccl'), '.2f')}×",
                 f"{_f(r.get('dispatch_link_GBps'), '.0f')} / {_f(r.get('combine_link_GBps'), '.0f')}",
                 f"{_f(r.get('eager_dispatch_us'), '.1f')} / {_f(r.get('eager_combine_us'), '.1f')}",
                 f"{_f(r.get('eager_dispatch_host_us'), '.0f')} / {_f(r.get('eager_combine_host_us'), '.0f')}",
                 f"{_f(r.get('torch_backend_dispatch_us'), '.0f')} / {_f(r.get('torch_backend_combine_us'), '.0f')}"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", nargs="?", default="results/bench.jsonl")
    p.add_argument("--commit", default=None)
    args = p.parse_args(argv)
    records = read_records(args.src)
    try:
        commit, rows = sweep_rows(records, args.commit)
    except ValueError as e:
        print(f"sweep_table: {e}", file=sys.stderr)
        return 1
    r0 = rows[0]
    print(f"Sweep (commit {commit}; {r0.get('world_size')}×{r0.get('gpu')}, driver {r0.get('driver')}, "
          f"torch {r0.get('torch')}, top-{r0.get('topk')} of {r0.get('experts')} experts, uniform routing)")
    print()
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
