"""A host model of the grouped dispatch the senders could write straight into the groups (issue #35, item 1: no
receive buffer between the link and the groups). What it shows: every sender can work out where each of its pairs
lands in every destination's grouped layout from counts alone, exchanged before any row, so that the layout is
the one runtime/grouped.py's rule makes of the rows received in (source rank, token) order (the torch backend's
order, and the native one's under a receive cap).

The counts each sender s publishes for destination r, before its rows: rows[s][r] (its tokens with at least one
expert on r) and pairs[s][r][e] (its (token, j) pairs for r's local expert e, of the rows r keeps). With every
sender's counts, each one computes, with no further exchange:
  * which of its rows r keeps: row index = sum over s' < s of rows[s'][r] + its rank among its own rows to r,
    kept while below max_recv (the receive cap);
  * the groups of r: counts[e] = sum over s of pairs[s][r][e], then grouped.group_bounds (start, kept, offs);
  * each kept pair's grouped row: start[e] + (sum over s' < s of pairs[s'][r][e]) + its rank among its own pairs
    of e in (token, j) order, dropped when that position reaches kept[e] (the grouped capacity).
Plain Python over small shapes: the model, not a kernel.
"""

from __future__ import annotations

import torch

from runtime import grouped


def sender_layout(indices: list[torch.Tensor], experts_per_rank: int, align: int, capacity: int,
                  max_recv: int) -> list[dict]:
    """indices[s]: sender s's expert ids [T_s, k] (ids past the experts are routed nowhere). Per destination r:
    {"where": {(s, t, j): grouped row or -1 (dropped)} for every pair routed to r, "offs", "kept" (lists [E]),
    "dropped" (pairs past the capacity, of kept rows)}: computed per sender from the published counts only."""
    world, E = len(indices), experts_per_rank
    ids = [ix.tolist() for ix in indices]

    def dest(e: int) -> int:
        return e // E if 0 <= e < world * E else -1

    # what each sender publishes: its rows to r in token order, and its kept rows' pairs per local expert
    rows = [[[t for t, row in enumerate(ids[s]) if any(dest(e) == r for e in row)] for r in range(world)]
            for s in range(world)]
    kept_rows = [[None] * world for _ in range(world)]
    pairs = [[[0] * E for _ in range(world)] for _ in range(world)]
    for r in range(world):
        before = 0
        for s in range(world):
            kept_rows[s][r] = set(rows[s][r][:max(0, max_recv - before)])
            before += len(rows[s][r])
            for t in sorted(kept_rows[s][r]):
                for e in ids[s][t]:
                    if dest(e) == r:
                        pairs[s][r][e - r * E] += 1
    out = []
    for r in range(world):
        counts = torch.tensor([sum(pairs[s][r][e] for s in range(world)) for e in range(E)], dtype=torch.int64)
        start, kept, offs = grouped.group_bounds(counts, align, capacity)
        where, seen = {}, [[0] * E for _ in range(world)]
        for s in range(world):
            for t, row in enumerate(ids[s]):
                for j, e in enumerate(row):
                    if dest(e) != r:
                        continue
                    if t not in kept_rows[s][r]:
                        where[(s, t, j)] = -1
                        continue
                    le = e - r * E
                    pos = sum(pairs[s2][r][le] for s2 in range(s)) + seen[s][le]
                    seen[s][le] += 1
                    where[(s, t, j)] = int(start[le]) + pos if pos < int(kept[le]) else -1
        out.append({"where": where, "offs": offs.tolist(), "kept": kept.tolist(),
                    "dropped": int((counts - kept).sum())})
    return out


def received_layout(indices: list[torch.Tensor], r: int, experts_per_rank: int, align: int, capacity: int,
                    max_recv: int) -> dict:
    """The reference for destination r: the rows r receives in (source rank, token) order, cut at max_recv, grouped
    by runtime/grouped.py's rule; the same fields as sender_layout's, pairs named (s, t, j)."""
    world, E = len(indices), experts_per_rank
    names, rows_idx = [], []
    for s, ix in enumerate(indices):
        for t, row in enumerate(ix.tolist()):
            if any(0 <= e < world * E and e // E == r for e in row):
                names.append((s, t))
                rows_idx.append(row)
    k = indices[0].shape[1]
    total = min(len(rows_idx), max_recv)
    R = max(max_recv, 1)
    out_i = torch.full((R, k), -1, dtype=torch.int32)
    if total:
        out_i[:total] = torch.tensor(rows_idx[:total], dtype=torch.int32)
    x = torch.zeros((R, 1), dtype=torch.float32)
    lay = grouped.group(x, None, None, out_i, torch.tensor([total], dtype=torch.int32), r, E, align, capacity)
    where = {}
    for row, (s, t) in enumerate(names):
        for j, e in enumerate(rows_idx[row]):
            if not (0 <= e < world * E and e // E == r):
                continue
            where[(s, t, j)] = int(lay.pair_pos[row * k + j]) if row < total else -1
    return {"where": where, "offs": lay.offs.tolist(), "kept": lay.counts.tolist(), "dropped": int(lay.dropped)}
