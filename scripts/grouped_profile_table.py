"""Print one table (markdown) of the grouped layer's device kernels from scripts/grouped_profile.py's records.

python scripts/grouped_profile_table.py results/<date>-<machine>-<commit>/grouped_profile.jsonl [...]

One row per record (tokens per rank, the form: "reduce", or "fused" in records taken before that form of
combine_grouped was removed, and "one legs" / "separate legs" where the record forced the one-kernel legs on or
off), in the order of the files and their lines: the layer's µs in the graph replay and each kernel's µs per
layer (calls per layer x median): the dispatch, the grouped layout's two kernels (count, place), the identity
expert's copy, grouped_reduce and the combine, or the old fused form's one combine_grouped kernel, and the rest
summed ("other"). CPU only.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for bench
from bench.records import read_records  # noqa: E402

# (column, whether a kernel's short name belongs to it), first match wins
COLUMNS = (("dispatch", lambda k: k.startswith("epg_dispatch")),
           ("grouped_count", lambda k: k.startswith("epg_grouped_count")),
           ("grouped_place", lambda k: k.startswith("epg_grouped_place")),
           ("identity copy", lambda k: k == "copy"),
           ("grouped_reduce", lambda k: k.startswith("epg_grouped_reduce")),
           ("combine", lambda k: k.startswith("epg_combine_") and not k.startswith("epg_combine_grouped")),
           ("combine_grouped", lambda k: k.startswith("epg_combine_grouped")),
           ("other", lambda k: True))


def row(rec: dict) -> str:
    us = dict.fromkeys((name for name, _ in COLUMNS), 0.0)
    seen = set()
    for kernel, v in rec["kernels"].items():
        name = next(n for n, owns in COLUMNS if owns(kernel))
        us[name] += v["per_layer"] * v["median_us"]
        seen.add(name)
    cells = [f"{us[n]:.1f}" if n in seen else "–" for n, _ in COLUMNS]
    legs = rec.get("legs", "auto")  # records before 2026-12-04's geometry options may hold a dict here (a bug)
    form = rec.get("grouped_combine", "reduce") + ("" if legs == "auto" else f" ({legs} legs)" if isinstance(legs, str)
                                     else " (legs not recorded)")
    geo = ", ".join(f"{name} {rec[key]}" for key, name in (("launch_blocks", "blocks"), ("launch_threads", "threads"))
                    if rec.get(key))
    form += f" [{geo}]" if geo else ""
    form += " (direct dispatch)" if rec.get("direct") == "always" else ""
    form += f" ({rec['protocol']} protocol)" if rec.get("protocol_choice", "auto") != "auto" else ""
    return (f"| {rec['commit']} | {rec['tokens_per_rank']} | {form} | {rec['per_layer_us']:.1f} | "
            + " | ".join(cells) + " |")


def table(records: list[dict]) -> list[str]:
    head = ["commit", "tokens", "form", "layer µs"] + [n for n, _ in COLUMNS]
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [row(r) for r in records]


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("grouped_profile_table: name the grouped_profile.jsonl records to tabulate", file=sys.stderr)
        return 2
    records = []
    for path in paths:
        try:
            records += [r for r in read_records(path) if r.get("kind") == "grouped_profile"]
        except OSError as e:
            print(f"grouped_profile_table: {e}", file=sys.stderr)
            return 1
    if not records:
        print("grouped_profile_table: no grouped_profile records", file=sys.stderr)
        return 1
    r0 = records[0]
    print(f"(W = {r0['world_size']}, {r0['gpu']}, {r0['target']}; bf16, hidden {r0['hidden']}, top-{r0['topk']} of "
          f"{r0['experts']} experts; µs per layer)\n")
    print("\n".join(table(records)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
