"""Render results/bench.jsonl into results/bench.png: latency and link bandwidth vs tokens per rank.

python scripts/plot_bench.py [results/bench.jsonl] [results/bench.png]   (needs matplotlib)
Plots the sweep's points (runtime.bench.sweep_points: intranode, default routing and geometry, no
experiment note, of the commit with the most distinct points): one row of panels per hidden size,
one colour per dtype, and the performance issue's targets on the hidden-7168 panels.
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for runtime
from runtime.bench import read_records, sweep_points  # noqa: E402


def main(src="results/bench.jsonl", dst="results/bench.png") -> int:
    records = read_records(src)
    try:
        newest, rows = sweep_points(records)
    except ValueError:
        print(f"no benchmark rows in {src}")
        return 1
    hiddens = sorted({r["hidden"] for r in rows}, reverse=True)
    dtypes = sorted({r["dtype"] for r in rows})
    colors = dict(zip(dtypes, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    fig, axes = plt.subplots(len(hiddens), 2, figsize=(12, 4.2 * len(hiddens)), squeeze=False)
    for (ax1, ax2), hidden in zip(axes, hiddens):
        for dtype in dtypes:
            pts = sorted((r for r in rows if (r["hidden"], r["dtype"]) == (hidden, dtype)),
                         key=lambda r: r["tokens_per_rank"])
            if not pts:
                continue
            t, c = [r["tokens_per_rank"] for r in pts], colors[dtype]
            ax1.plot(t, [r["dispatch_us"] for r in pts], "o-", color=c, label=f"dispatch {dtype}")
            ax1.plot(t, [r["combine_us"] for r in pts], "s--", color=c, label=f"combine {dtype}")
            ax1.plot(t, [r["nccl_a2a_us"] for r in pts], "x:", color=c, alpha=0.6, label=f"NCCL all_to_all {dtype}")
            ax2.plot(t, [r["dispatch_link_GBps"] for r in pts], "o-", color=c, label=f"dispatch {dtype}")
            ax2.plot(t, [r["combine_link_GBps"] for r in pts], "s--", color=c, label=f"combine {dtype}")
        if hidden == 7168:  # the performance issue's targets (2 ranks, hidden 7168, bf16)
            ax1.plot([128, 128], [15, 18], "k_", markersize=14, label="targets at 128 tokens (15 / 18 µs)")
            ax2.axhline(355, color="k", linewidth=0.8, linestyle="-.", label="target at 4096 tokens (355 GB/s)")
        for ax in (ax1, ax2):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens per rank")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
            ax.set_title(f"hidden {hidden}", fontsize=9)
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
