"""Print the layer tables (markdown) from layer benchmark records (bench --layer-loop / --layer / --ceiling).

python scripts/layer_table.py [results/layer.jsonl ...]

The layer loop (issue 19's table: per-layer µs of epgen with the expert writing its own tensor or into
combine_in_view, and NCCL), the MoE layer on each EP path (layer µs and communication-only µs), and the
link's ceiling; a point measured more than once shows its latest record (bench.tables).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for runtime
from bench.records import read_records  # noqa: E402
from bench.tables import ceiling_table, layer_table, loop_table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    paths = (sys.argv[1:] if argv is None else argv) or ["results/layer.jsonl"]
    records = []
    for path in paths:
        try:
            records += read_records(path)
        except OSError as e:
            print(f"layer_table: {e}", file=sys.stderr)
            return 1
    r0 = next((r for r in records if r.get("kind") in ("layer_loop", "layer", "ceiling")), None)
    if r0 is None:
        print("layer_table: no layer records", file=sys.stderr)
        return 1
    print(f"(commit {r0.get('commit')}; {r0.get('world_size')}×{r0.get('gpu')}, driver {r0.get('driver')})\n")
    for title, table in (("Layer loop (per layer, graph, slowest rank's median)", loop_table),
                         ("MoE layer (µs per layer; communication-only in parentheses)", layer_table),
                         ("Link ceiling", ceiling_table)):
        lines = table(records)
        if len(lines) > 2:
            print(f"{title}\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
