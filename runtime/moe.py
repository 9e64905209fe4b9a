"""Standard-MoE layout conversion and local expert counts: the reference, in plain torch ops.

Device-side and free of host syncs (graph-capturable on GPUs); used by the torch backend (and by
any backend without kernels of its own). Semantics (the native kernels match them):

* A (received row, column) pair (i, j), i < total_recv, is *local* when its expert id e = out_indices[i, j]
  is >= 0 and e // num_experts_per_rank == rank; its local expert is e - rank * num_experts_per_rank.
  Every column counts (a token naming a local expert twice gives two pairs).
* Pairs are ordered by pair id i * k + j (ascending row, then column). Each local expert takes its
  pairs in that order into ``capacity`` slots; pairs past the capacity are dropped and counted.
* convert_combine_input: row i of the combine input is 0.0 (float32) plus, in ascending j, the
  float32 product packed_weights[e, p] * float32(expert_out[e, p]) (rounded to float32, then added:
  no fused multiply-add) of each packed pair (e, p) with packed_src[e, p] == i * k + j; then one
  rounding to the combine dtype. Rows without a packed pair are 0.
"""

from __future__ import annotations

import torch


def _local_experts(out_indices: torch.Tensor, total_recv: torch.Tensor, rank: int, experts_per_rank: int):
    """-> [R * k] int64 local expert of each pair in pair-id order (experts_per_rank: not local / past total)."""
    rows = out_indices.shape[0]
    ids = out_indices.long()
    valid = torch.arange(rows, device=ids.device).unsqueeze(1) < total_recv.to(ids.device).long()
    local = (ids >= 0) & (torch.div(ids, experts_per_rank, rounding_mode="floor") == rank) & valid
    return torch.where(local, ids - rank * experts_per_rank, experts_per_rank).reshape(-1)


def local_expert_count(out_indices, total_recv, rank: int, experts_per_rank: int) -> torch.Tensor:
    """int32 [experts_per_rank]: local (received row, column) pairs per local expert."""
    e = _local_experts(out_indices, total_recv, rank, experts_per_rank)
    counts = torch.zeros(experts_per_rank + 1, dtype=torch.int64, device=e.device)
    counts.scatter_add_(0, e, torch.ones_like(e))
    return counts[:experts_per_rank].to(torch.int32)


def routed_pairs(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 [num_experts]: (token, column) pairs of `indices` [T, k] per expert id, before any receive cap
    drops a row (ids outside 0..num_experts-1 name no expert). A source's share of routed_expert_count:
    summed over the sources, the slice of rank r's experts is r's routed count."""
    e = indices.long().reshape(-1)
    e = torch.where((e >= 0) & (e < num_experts), e, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=indices.device)
    counts.scatter_add_(0, e, torch.ones_like(e))
    return counts[:num_experts].to(torch.int32)


def pack(out, out_weights, out_indices, total_recv, rank: int, experts_per_rank: int, capacity: int):
    """Dispatch output -> (packed_x [E, C, H], packed_count int32 [E], packed_src int32 [E, C],
    packed_weights float32 [E, C], dropped int32 scalar). See the module docstring."""
    E, C = experts_per_rank, capacity
    k = out_indices.shape[1]
    dev = out.device
    e = _local_experts(out_indices, total_recv, rank, E)  # [R * k]
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, e, torch.ones_like(e))
    order = torch.sort(e, stable=True).indices  # pairs grouped by expert, ascending pair id inside each
    sorted_e = e[order]
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(e.numel(), device=dev) - starts[sorted_e]
    keep = (sorted_e < E) & (pos < C)
    dest = torch.where(keep, sorted_e * C + pos, E * C)  # E * C: a sink slot, cut off below
    src = torch.full((E * C + 1,), -1, dtype=torch.int64, device=dev)
    src.scatter_(0, dest, torch.where(keep, order, -1))
    packed_src = src[:E * C].view(E, C)
    filled = packed_src >= 0
    row = torch.where(filled, torch.div(packed_src, k, rounding_mode="floor"), 0)
    col = torch.where(filled, packed_src % k, 0)
    packed_x = torch.where(filled.unsqueeze(-1), out[row], torch.zeros((), dtype=out.dtype, device=dev))
    if out_weights is None:
        packed_w = filled.to(torch.float32)
    else:
        packed_w = torch.where(filled, out_weights[row, col], torch.zeros((), dtype=torch.float32, device=dev))
    packed_count = torch.clamp(counts[:E], max=C).to(torch.int32)
    dropped = torch.clamp(counts[:E] - C, min=0).sum().to(torch.int32)
    return packed_x, packed_count, packed_src.to(torch.int32), packed_w, dropped


def unpack(expert_out, packed_src, packed_weights, rows: int, k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Expert outputs [E, C, H] -> combine input [rows, H] in out_dtype (see the module docstring)."""
    E, C, H = expert_out.shape
    dev = expert_out.device
    src = packed_src.reshape(-1).long()
    prod = packed_weights.reshape(-1, 1) * expert_out.reshape(E * C, H).float()  # one float32 rounding
    acc = torch.zeros(rows + 1, H, dtype=torch.float32, device=dev)  # row `rows`: a sink, cut off below
    row = torch.div(src, k, rounding_mode="floor")
    for j in range(k):  # ascending j; within one j a row has at most one pair: one addition per element
        sel = (src >= 0) & (src % k == j)
        acc.index_add_(0, torch.where(sel, row, rows), prod)
    return acc[:rows].to(out_dtype)
