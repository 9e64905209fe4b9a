"""Records into tables: the sweep's printed summary (``format_table``) and its points (``sweep_points``: what
scripts/sweep_table.py and scripts/plot_bench.py show), a profiled point's kernels (``format_profile``), and the
layer modes' markdown tables (``loop_table``, ``layer_table``, ``ceiling_table``: scripts/layer_table.py). A
point measured more than once shows its latest record (``latest``)."""

from __future__ import annotations

from .moe_layer import LAYER_DTYPES, LAYER_PATHS
from .records import ratio


def cell(v, fmt: str, missing: str = "-") -> str:
    """One table cell: `v` formatted, or `missing` for an absent value."""
    return missing if v is None else format(v, fmt)


def latest(records: list[dict], kind: str, key) -> list[dict]:
    """The last record of each key among records of `kind` (a point measured again: its later record)."""
    last = {}
    for r in records:
        if r.get("kind") == kind:
            last[key(r)] = r
    return [last[kk] for kk in sorted(last)]


def md_cell(v, fmt: str) -> str:
    """A markdown table's cell: `v` formatted, or an en dash for an absent value."""
    return cell(v, fmt, missing="–")


# --- the sweep -----------------------------------------------------------------------------------
def _pair(r: dict, a: str, b: str, fmt: str) -> str:
    return f"{cell(r.get(a), fmt)}/{cell(r.get(b), fmt)}"


TABLE_COLUMNS = [("dtype", 13), ("tokens", 6), ("hidden", 6), ("graph us d/c", 15), ("round us", 8), ("eager us d/c", 15),
                 ("host us d/c", 13), ("nccl us d/c", 15), ("vs nccl d/c", 11), ("logical GB/s d/c", 16), ("link GB/s d/c", 13),
                 ("blocks d/c", 10)]


def sweep_points(records: list[dict], commit: str | None = None) -> tuple[str, list[dict]]:
    """(commit, its sweep points sorted by dtype, hidden descending, tokens): the intranode points of the
    default routing, the gather combine and the tuning table's launch geometry (no launch_override; experiments
    carry a note) of `commit` (default: the commit with the most distinct such points, the newest among
    equals); a point measured twice gives its later record. scripts/sweep_table.py and
    scripts/plot_bench.py show these."""
    pts = [r for r in records if "dispatch_us" in r and r.get("topology", "intranode") == "intranode"
           and r.get("routing", "uniform") == "uniform" and not r.get("note") and not r.get("launch_override")
           and r.get("combine_mode", "gather") == "gather"]
    if commit is None:
        points: dict[str, set] = {}  # distinct (dtype, hidden, tokens) per commit, in order of first record
        for r in pts:
            points.setdefault(r["commit"], set()).add((r["dtype"], r["hidden"], r["tokens_per_rank"]))
        if not points:
            raise ValueError("no intranode benchmark points")
        commit = max(reversed(list(points)), key=lambda c: len(points[c]))
    pts = [r for r in pts if r["commit"] == commit]
    if not pts:
        raise ValueError(f"no intranode benchmark points for commit {commit}")
    latest = {}
    for r in pts:  # a point measured twice: the later record
        latest[(r["dtype"], r["hidden"], r["tokens_per_rank"])] = r
    order = sorted(latest, key=lambda key: (key[0], -key[1], key[2]))
    return commit, [latest[key] for key in order]


def format_table(rows: list[dict]) -> list[str]:
    """The printed summary: a header and one line per point (graph times and bandwidths; eager times)."""
    lines = [" ".join(f"{name:>{w}}" for name, w in TABLE_COLUMNS)]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['dtype']:>13} {r['tokens_per_rank']:>6} {r['hidden']:>6} failed "
                         f"{r.get('launch_override') or ''}: {r['error']}")
            continue
        tag = (f"{r['dtype']}/{r['protocol']}" if r.get("protocol") else r["dtype"]) \
            if r.get("topology", "intranode") == "intranode" else \
            f"{r['dtype']}/{r.get('internode_route') or r.get('internode_kernel')}"
        if r.get("combine_mode") == "scatter":
            tag += "/scatter"
        cells = [tag, str(r["tokens_per_rank"]), str(r["hidden"]),
                 _pair(r, "dispatch_us", "combine_us", ".1f"), cell(r.get("round_us"), ".1f"),
                 _pair(r, "eager_dispatch_us", "eager_combine_us", ".1f"),
                 _pair(r, "eager_dispatch_host_us", "eager_combine_host_us", ".0f"),
                 _pair(r, "nccl_a2a_us", "nccl_a2a_combine_us", ".1f"),
                 _pair(r, "dispatch_vs_nccl", "combine_vs_nccl", ".2f"),
                 _pair(r, "dispatch_logical_GBps", "combine_logical_GBps", ".0f"),
                 _pair(r, "dispatch_link_GBps", "combine_link_GBps", ".0f"),
                 _pair(r, "dispatch_blocks", "combine_blocks", "")]
        lines.append(" ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, TABLE_COLUMNS)))
    return lines


def format_profile(rec: dict, top: int = 12) -> list[str]:
    """Rank 0's kernel table of a profiled point."""
    what = f"{rec['dtype']} T={rec['tokens_per_rank']} {rec.get('internode_kernel') or 'intranode'}"
    lines = [f"-- profile {what}: device us per dispatch+expert+combine round (eager)"]
    for r in (rec.get("profile") or [])[:top]:
        lines.append(f"{r['us_per_round']:9.1f}  x{r['calls']:<3d} {r['name']}")
    return lines

# --- the layer modes -----------------------------------------------------------------------------
def _x(v) -> str:
    return "–" if v is None else f"{v:.2f}×"


def requested_protocol(r: dict) -> str:
    """The intranode protocol a record's epgen calls asked for ("bw" for records older than the field)."""
    return r.get("intranode_protocol") or "bw"


def layer_column(r: dict) -> str:
    """A layer record's path as tables and plots show it: epgen with the low-latency protocol is "epgen_ll",
    with the fused grouped combine (grouped_combine "fused": records taken before that form was removed)
    "epgen_fused"."""
    if r["path"] == "epgen" and requested_protocol(r) == "ll":
        return "epgen_ll"
    return "epgen_fused" if r["path"] == "epgen" and r.get("grouped_combine") == "fused" else r["path"]


def loop_table(records: list[dict]) -> list[str]:
    """Issue 19's table: per layer µs, epgen (expert -> own tensor / -> combine_in_view) with each intranode
    protocol measured, NCCL, NCCL / epgen."""
    out = ["| tokens/rank | protocol | epgen, expert → own tensor | epgen, expert → combine_in_view | NCCL "
           "| NCCL / epgen (in view) |", "|---|---|---|---|---|---|"]
    for r in latest(records, "layer_loop", lambda r: (r["tokens_per_rank"], requested_protocol(r))):
        out.append(f"| {r['tokens_per_rank']} | {requested_protocol(r)} | {md_cell(r['epgen_own_us'], '.1f')} µs "
                   f"| {md_cell(r['epgen_view_us'], '.1f')} µs | {md_cell(r['nccl_us'], '.1f')} µs "
                   f"| {_x(r.get('nccl_over_epgen_view'))} |")
    return out


def layer_table(records: list[dict]) -> list[str]:
    """Issue 17's table: per (dtype, tokens) the layer and its communication-only time on each path, and
    footnotes naming why a path has no time."""
    recs = latest(records, "layer", lambda r: (r["dtype"], r["tokens_per_rank"], layer_column(r)))
    points: dict = {}
    for r in recs:
        points.setdefault((r["dtype"], r["tokens_per_rank"]), {})[layer_column(r)] = r
    extra = {"epgen_ll": " epgen, low-latency protocol, layer µs (comm) |",
             "epgen_fused": " epgen, fused grouped combine, layer µs (comm) |"}
    columns = list(LAYER_PATHS) + [c for c in extra if any(layer_column(r) == c for r in recs)]
    head = ("| dispatch | tokens/rank | expert GEMMs µs | epgen layer µs (comm) | all_to_all_single layer µs (comm) "
            "| all_to_all_vdev_2d layer µs (comm) |" + "".join(extra[c] for c in columns if c in extra)
            + " a2a / epgen (layer) |")
    out, notes = [head, "|---" * (len(columns) + 4) + "|"], {}
    for (dtype, T) in sorted(points, key=lambda key: (LAYER_DTYPES.index(key[0]) if key[0] in LAYER_DTYPES else 9,
                                                      key[1])):
        row = points[(dtype, T)]
        any_rec = next(iter(row.values()))
        cells = []
        for path in columns:
            r = row.get(path)
            if r is None:
                cells.append("–")
            elif r.get("error"):
                notes.setdefault(r["error"], len(notes) + 1)
                cells.append(f"failed [{notes[r['error']]}]")
            else:
                mode = "" if r.get("graph") else " eager"
                cells.append(f"{md_cell(r['layer_us'], '.1f')} ({md_cell(r['comm_us'], '.1f')}){mode}")
        e, a = row.get("epgen", {}), row.get("a2a", {})
        speedup = ratio(a.get("layer_us"), e.get("layer_us"))
        gemm = any_rec.get("expert_graph_us") or any_rec.get("expert_eager_us")
        out.append(f"| {dtype} | {T} | {md_cell(gemm, '.1f')} | " + " | ".join(cells) + f" | {_x(speedup)} |")
    for reason, n in notes.items():
        out.append(f"\n[{n}] {reason}")
    return out


def ceiling_table(records: list[dict]) -> list[str]:
    out = ["| method | SMs | GB/s per direction | µs | distinct SMs |", "|---|---|---|---|---|"]
    order = {"sm_push": 0, "sm_pull": 1, "copy_engine_push": 2, "copy_engine_pull": 3, "nccl": 4}
    for r in sorted(latest(records, "ceiling", lambda r: (r["method"], r.get("sms_used") or 0)),
                    key=lambda r: (order.get(r["method"], 9), r.get("sms_used") or 0)):
        if r.get("error"):
            out.append(f"| {r['method']} | – | failed: {r['error']} | – | – |")
            continue
        out.append(f"| {r['method']} | {md_cell(r.get('sms_used'), 'd')} | {md_cell(r['GBps'], '.0f')} | {md_cell(r['us'], '.1f')} "
                   f"| {md_cell(r.get('distinct_sms'), 'd')} |")
    return out
