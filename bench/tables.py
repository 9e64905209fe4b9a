"""Records into tables: the sweep's printed summary (``format_table``) and its points (``sweep_points``: what
scripts/sweep_table.py and scripts/plot_bench.py show), a profiled point's kernels (``format_profile``), and the
cells of every table (``cell``, ``md_cell``). A point measured more than once shows its latest record
(``latest``)."""

from __future__ import annotations


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
