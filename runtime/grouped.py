"""The grouped-GEMM layout of a dispatch and the combine out of it: the object users get, and the reference
in plain torch ops (device-side, no host sync; the torch backend and any backend without kernels of its
own use it; the native kernels, templates/kernels/grouped_layout.j2 / grouped_reduce.j2, match it).

Semantics (E = num_experts_per_rank, A = expert_alignment, P = resolved_grouped_capacity rows, k = top-k):

* The local (received row i, column j) pairs, i < total_recv, are those of runtime/moe.py (expert id e >= 0
  with e // E == rank; every column counts). Pair id = i * k + j.
* Group e holds expert e's pairs in ascending pair id, at rows [start_e, start_e + kept_e); the group is
  padded to a multiple of A rows: offs[e] = start_e + ceil(kept_e / A) * A, start_0 = 0, start_{e+1} =
  offs[e] (an expert without pairs has an empty group). kept_e = min(count_e, P - start_e): when the real
  pairs do not fit the buffer, the last experts' last pairs are dropped (counted in ``dropped``, never
  written, never combined). Rows past a group's kept pairs (its padding) and past offs[-1] are
  unspecified in x / scales (the torch backend writes zeros, the native one leaves them) and hold
  src = -1, m_indices = -1, weights = 0.
* combine_grouped: received row i of the combine input is 0.0 (float32) plus, in ascending j, for each
  kept local pair (i, j) at grouped row g: w_ij * float32(expert_out[g]) (the product rounded to float32,
  then added: no fused multiply-add; w_ij the dispatch's weight, 1.0 when it had none) with
  apply_weights=True, or float32(expert_out[g]) with apply_weights=False; then one rounding to the
  combine dtype; rows without a kept pair are 0. These are convert_combine_input's numerics
  (runtime/moe.py), so the same pairs give the same bits on both layouts. combine() then sums each
  token's rows over the ranks as always.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class GroupedLayout:
    """The last dispatch's local pairs grouped per local expert (see the module docstring).

    x          [P, cols] dispatch out dtype: the pairs' rows, group e at rows [offs[e-1], offs[e]) (offs[-1] = 0);
               with config grouped_dequantize, [P, hidden] data_type: the rows decoded
    scales     [P, scale cols] (fp8/fp4 dispatches: each row's scales, the same order) or None (also with
               grouped_dequantize)
    offs       int32 [E]: group ends, a multiple of expert_alignment each: torch._grouped_mm's ``offs``
    counts     int32 [E]: kept pairs per group (the real rows at the head of each group)
    src        int32 [P]: pair id i * k + j (received row i = src // k, column j = src % k) of each row; -1 padding
    m_indices  int32 [P]: local expert of each row, -1 padding (DeepGEMM's m-grouped contiguous ``m_indices``)
    weights    float32 [P]: the dispatch's weight of each row (1.0 without weights), 0 padding
    dropped    int32 scalar: local pairs past the buffer's rows (grouped_capacity), dropped

    Every tensor is on the device and may be the op's buffer: valid until the next grouped_layout(); a fresh
    layout's (op.dispatch_grouped(fresh=True)) are the call's own, valid as long as they are held.
    """
    x: torch.Tensor
    scales: torch.Tensor | None
    offs: torch.Tensor
    counts: torch.Tensor
    src: torch.Tensor
    m_indices: torch.Tensor
    weights: torch.Tensor
    dropped: torch.Tensor
    pair_pos: torch.Tensor | None = dataclasses.field(repr=False)  # int32 [R * k]: grouped row of each pair, -1 none
    # (combine); None in a layout made under torch.compile (runtime.autograd: the pair map stays with the handle)
    seq: int = dataclasses.field(default=0, repr=False)  # the dispatch it was made from
    # a fresh layout's (dispatch_grouped(fresh=True)) int32 block, which offs, counts, src, m_indices, dropped and
    # pair_pos are views of (block_parts); None for a layout in the op's buffers
    block: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    def __init__(self, x, scales, offs, counts, src, m_indices, weights, dropped, pair_pos, seq=0, block=None):
        # the fields stored in the instance's dict at once: a frozen dataclass's own __init__ sets each through
        # object.__setattr__, ~2.5 us of every eager dispatch_grouped's host time (a layout per call) against ~1
        d = self.__dict__
        d["x"], d["scales"], d["offs"], d["counts"], d["src"], d["m_indices"] = x, scales, offs, counts, src, m_indices
        d["weights"], d["dropped"], d["pair_pos"], d["seq"], d["block"] = weights, dropped, pair_pos, seq, block

    @property
    def rows(self) -> int:
        """P: rows of the buffer (resolved_grouped_capacity)."""
        return self.x.shape[0]

    @property
    def num_groups(self) -> int:
        return self.offs.shape[0]


def block_size(experts_per_rank: int, rows: int, pairs: int) -> int:
    """int32 elements of a fresh layout's block: offs [E], counts [E], src [P], m_indices [P], dropped [1], the pair
    map [R * k] (pairs), in that order."""
    return 2 * experts_per_rank + 2 * rows + 1 + pairs


def block_parts(block: torch.Tensor, experts_per_rank: int, rows: int) -> tuple[torch.Tensor, ...]:
    """A fresh layout's int32 block -> (offs, counts, src, m_indices, dropped [1], pair_pos) views (block_size's
    order; one split)."""
    E, P = experts_per_rank, rows
    return torch.split_with_sizes(block, (E, E, P, P, 1, block.numel() - 2 * E - 2 * P - 1))


def meta_parts(meta: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    """The head of a fresh layout's block, without the pair map (the training forward's int32 output) ->
    (offs, counts, src, m_indices, dropped [1]) views; P = rows, E from its size."""
    return block_parts(meta, (meta.numel() - 2 * rows - 1) // 2, rows)[:5]


def grouped_rows(world: int, tokens: int, experts_per_rank: int, top_k: int, align: int) -> int:
    """Rows of the grouped layout that hold every local pair when a token names each expert at most once (top-k
    routing): a rank receives at most world * tokens rows, each with at most min(top_k, experts_per_rank) local
    pairs, plus up to align - 1 rows of padding per group; rounded up to a multiple of align (torchtitan's
    EpgenTokenDispatcher sizes its op's grouped_capacity so)."""
    rows = world * tokens * min(top_k, experts_per_rank) + experts_per_rank * (align - 1)
    return -(-rows // align) * align


def group_bounds(counts: torch.Tensor, align: int, capacity: int):
    """Per-expert real pair counts int64 [E] -> (start int64 [E], kept int64 [E], offs int64 [E]) by the rule
    of the module docstring, without a loop: with S = the exclusive prefix of the padded counts (nothing cut),
    every expert before the first one that does not fit keeps all (S + padded count <= capacity: both are
    multiples of align), that one keeps capacity - S and ends the buffer, the rest keep nothing."""
    padded = (counts + align - 1) // align * align
    S = torch.cumsum(padded, 0) - padded
    start = S.clamp(max=capacity)
    kept = torch.minimum(counts, capacity - S).clamp(min=0)
    offs = (S + padded).clamp(max=capacity)
    return start, kept, offs


def group(out, out_scales, out_weights, out_indices, total_recv, rank: int, experts_per_rank: int, align: int,
          capacity: int) -> GroupedLayout:
    """Dispatch outputs -> the grouped layout (see the module docstring)."""
    from .moe import _local_experts

    E, P = experts_per_rank, capacity
    k = out_indices.shape[1]
    dev = out.device
    e = _local_experts(out_indices, total_recv, rank, E)  # [R * k], E: not local
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, e, torch.ones_like(e))[:E]
    start, kept, offs = group_bounds(counts, align, P)
    order = torch.sort(e, stable=True).indices  # grouped by expert, ascending pair id inside each
    se = e[order]
    sec = se.clamp(max=E - 1)
    first = torch.cumsum(counts, 0) - counts  # sorted index of each expert's first pair
    pos = torch.arange(e.numel(), device=dev) - first[sec]
    keep = (se < E) & (pos < kept[sec])
    dest = torch.where(keep, start[sec] + pos, P)  # P: a sink row, cut off below
    src = torch.full((P + 1,), -1, dtype=torch.int64, device=dev).scatter_(0, dest, torch.where(keep, order, -1))[:P]
    pair_pos = torch.full((e.numel(),), -1, dtype=torch.int64, device=dev)
    pair_pos[order] = torch.where(keep, dest, -1)
    filled = src >= 0
    row = torch.where(filled, torch.div(src, k, rounding_mode="floor"), 0)
    col = torch.where(filled, src % k, 0)
    raw = out.view(torch.uint8)  # rows as bytes: fp8 / fp4 payloads have no torch.where kernel everywhere
    x = torch.where(filled.unsqueeze(-1), raw[row], torch.zeros((), dtype=torch.uint8, device=dev)).view(out.dtype)
    scales = None
    if out_scales is not None:
        s = out_scales[row]
        scales = torch.where(filled.unsqueeze(-1), s, torch.zeros((), dtype=s.dtype, device=dev))
    if out_weights is None:
        weights = filled.to(torch.float32)
    else:
        weights = torch.where(filled, out_weights[row, col], torch.zeros((), dtype=torch.float32, device=dev))
    m_idx = torch.where(filled, e[src.clamp(min=0)], -1)
    return GroupedLayout(x=x, scales=scales, offs=offs.to(torch.int32), counts=kept.to(torch.int32),
                         src=src.to(torch.int32), m_indices=m_idx.to(torch.int32), weights=weights,
                         dropped=(counts - kept).sum().to(torch.int32), pair_pos=pair_pos.to(torch.int32))


def dequantized(layout: GroupedLayout, quant_type: str, dtype: torch.dtype) -> GroupedLayout:
    """The layout of a quantized dispatch with its rows decoded (config grouped_dequantize): x [P, H] ``dtype``,
    scales None. Each row is runtime.numerics' dequantize of its payload and scales (float32, then one
    rounding to ``dtype``), the bits the native placement kernel writes; padding rows (zero payload and
    scales here) decode to 0."""
    from . import numerics

    x, s = layout.x.cpu(), layout.scales.cpu()  # numerics' decoders run on the host
    if quant_type == "fp8_blockwise":
        fmt = "ocp" if x.dtype == torch.float8_e4m3fn else "fnuz"
        f = numerics.dequantize_fp8(x.view(torch.uint8), s, fmt, "fp8_blockwise", torch.float32)
    elif quant_type == "fp4_blockwise":
        f = numerics.dequantize_fp4(x, s, torch.float32)
    else:
        raise ValueError(f"grouped dequantize: {quant_type!r} is not a quantized dispatch")
    return dataclasses.replace(layout, x=f.to(dtype).to(layout.x.device), scales=None)


def reduce(expert_out: torch.Tensor, layout: GroupedLayout, out_weights, rows: int, k: int,
           out_dtype: torch.dtype, apply_weights: bool = True) -> torch.Tensor:
    """Expert outputs in the grouped layout [P, H] -> combine input [rows, H] (see the module docstring)."""
    P, H = expert_out.shape
    dev = expert_out.device
    pos = layout.pair_pos.long().view(-1, k)[:rows]  # [rows, k] grouped row of each pair, -1 none
    y = expert_out.float()
    acc = torch.zeros(rows, H, dtype=torch.float32, device=dev)
    for j in range(k):  # ascending j: one float32 addition per element and kept pair
        sel = pos[:, j] >= 0
        term = y[pos[:, j].clamp(min=0)]
        if apply_weights and out_weights is not None:
            term = out_weights[:rows, j:j + 1] * term  # one float32 rounding
        acc = torch.where(sel.unsqueeze(1), acc + term, acc)
    return acc.to(out_dtype)
