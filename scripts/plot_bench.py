"""Render results/bench.jsonl into results/bench.png: latency and link bandwidth vs tokens per rank.

python scripts/plot_bench.py [results/bench.jsonl] [results/bench.png]   (needs matplotlib)
python scripts/plot_bench.py --layer [results/layer.jsonl] [results/layer.png]   (layer records: main_layer)
Plots the sweep's points (bench.tables.sweep_points: intranode, default routing and geometry, no
experiment note, of the commit with the most distinct points): one row of panels per hidden size,
one colour per dtype, and the performance issue's targets on the hidden-7168 panels.
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for runtime
from bench.moe_layer import LAYER_PATHS  # noqa: E402
from bench.records import read_records  # noqa: E402
from bench.tables import latest, layer_column, requested_protocol, sweep_points  # noqa: E402

COLORS = {"epgen": "tab:blue", "a2a": "tab:orange", "vdev2d": "tab:green", "epgen_ll": "tab:purple",
          "epgen_fused": "tab:red"}


def _finish(fig, title: str, dst: str) -> int:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")
    return 0


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
    return _finish(fig, f"epgen intranode EP, {r0['world_size']}x{r0['gpu']}, top-{r0['topk']} of {r0['experts']} "
                        f"experts, commit {newest}", dst)


def main_layer(src="results/layer.jsonl", dst="results/layer.png") -> int:
    """The layer loop, the MoE layer per EP path and the link's ceiling (bench.layer records), one panel each."""
    records = read_records(src)
    loop = latest(records, "layer_loop", lambda r: (r["tokens_per_rank"], requested_protocol(r)))
    layer = [dict(r, path=layer_column(r))
             for r in latest(records, "layer", lambda r: (r["dtype"], r["tokens_per_rank"], layer_column(r)))
             if r.get("layer_us") is not None]
    ceil = [r for r in latest(records, "ceiling", lambda r: (r["method"], r.get("sms_used") or 0)) if r.get("GBps")]
    if not (loop or layer or ceil):
        print(f"no layer records in {src}")
        return 1
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(17, 4.6))
    bw = [r for r in loop if requested_protocol(r) == "bw"]
    ll = [r for r in loop if requested_protocol(r) == "ll"]
    for pts, key, label, style in ((bw, "epgen_own_us", "epgen, expert → own tensor", "o-"),
                                   (bw, "epgen_view_us", "epgen, expert → combine_in_view", "s-"),
                                   (ll, "epgen_view_us", "epgen low-latency, expert → combine_in_view", "d-"),
                                   (bw or ll, "nccl_us", "NCCL", "x:")):
        if pts:
            a1.plot([r["tokens_per_rank"] for r in pts], [r[key] for r in pts], style, label=label)
    a1.set_title("layer loop (bf16; per layer, graph)", fontsize=9)
    for path in (*LAYER_PATHS, "epgen_ll", "epgen_fused"):
        for dtype, style in (("bf16", "-"), ("fp8", "--")):
            pts = [r for r in layer if (r["path"], r["dtype"]) == (path, dtype)]
            if pts:
                tt = [r["tokens_per_rank"] for r in pts]
                a2.plot(tt, [r["layer_us"] for r in pts], "o" + style, color=COLORS[path], label=f"{path} {dtype} layer")
                a2.plot(tt, [r["comm_us"] for r in pts], "x" + style, color=COLORS[path], alpha=0.5,
                        label=f"{path} {dtype} comm")
    a2.set_title("MoE layer (layer, and communication only)", fontsize=9)
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("tokens per rank")
        a.set_ylabel("µs (slowest-rank median)")
    for method, style in (("sm_push", "o-"), ("sm_pull", "s-")):
        pts = sorted((r for r in ceil if r["method"] == method), key=lambda r: r["sms_used"])
        a3.plot([r["sms_used"] for r in pts], [r["GBps"] for r in pts], style, label=f"copy kernel, {method[3:]}")
    for r in ceil:
        if r["method"] in ("copy_engine_push", "copy_engine_pull", "nccl"):
            a3.axhline(r["GBps"], linestyle=":", linewidth=1, label=r["method"].replace("_", " "),
                       color={"nccl": "k", "copy_engine_push": "tab:red"}.get(r["method"], "tab:purple"))
    a3.set_xlabel("SMs")
    a3.set_ylabel("GB/s per direction")
    a3.set_title("link ceiling", fontsize=9)
    for a in (a1, a2, a3):
        a.grid(True, alpha=0.3)
        a.legend(fontsize=6)
    r0 = (loop or layer or ceil)[0]
    return _finish(fig, f"epgen layer benchmarks, {r0.get('world_size')}x{r0.get('gpu')}, commit {r0.get('commit')}", dst)



if __name__ == "__main__":
    if sys.argv[1:2] == ["--layer"]:
        sys.exit(main_layer(*sys.argv[2:]))
    sys.exit(main(*sys.argv[1:]))
