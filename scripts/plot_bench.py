"""Render results/bench.jsonl into results/bench.png: latency and link bandwidth vs tokens per rank.

python scripts/plot_bench.py [results/bench.jsonl] [results/bench.png]   (needs matplotlib)
Plots the intranode rows (default routing and geometry, no experiment note) of the commit with the
widest sweep.
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for runtime
from runtime.bench import sweep_points  # noqa: E402


def main(src="results/bench.jsonl", dst="results/bench.png") -> int:
    records = [json.loads(line) for line in Path(src).read_text().splitlines() if line.strip()]
    try:
        newest, rows = sweep_points(records)
    except ValueError:
        print(f"no benchmark rows in {src}")
        return 1
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = sorted({(r["hidden"], r["dtype"]) for r in rows})
    for hidden, dtype in series:
        pts = sorted((r for r in rows if (r["hidden"], r["dtype"]) == (hidden, dtype)), key=lambda r: r["tokens_per_rank"])
        t = [r["tokens_per_rank"] for r in pts]
        lab = f"{dtype} h{hidden}"
        ax1.plot(t, [r["dispatch_us"] for r in pts], "o-", label=f"dispatch {lab}")
        ax1.plot(t, [r["combine_us"] for r in pts], "s-", label=f"combine {lab}")
        ax1.plot(t, [r["nccl_a2a_us"] for r in pts], "x--", label=f"NCCL all_to_all {lab}")
        ax2.plot(t, [r["dispatch_link_GBps"] for r in pts], "o-", label=f"dispatch {lab}")
        ax2.plot(t, [r["combine_link_GBps"] for r in pts], "s-", label=f"combine {lab}")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax1.set_yscale("log")
    ax1.set_ylabel("µs (graph replay, slowest-rank median)")
    ax2.set_ylabel("link GB/s (bytes over NVLink / time)")
    r0 = rows[0]
    fig.suptitle(f"epgen intranode EP, {r0['world_size']}x{r0['gpu']}, top-{r0['topk']} of {r0['experts']} experts, "
                 f"commit {newest}")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
