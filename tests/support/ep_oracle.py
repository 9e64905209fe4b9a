"""Plain-python oracle of EP dispatch/combine semantics (shared by the CPU and GPU tests).

Semantics: token t with top-k global expert ids sends one row to each distinct destination rank
``e // experts_per_rank`` of its ids ``e >= 0`` (negative ids: no expert). A rank receives rows
ordered by (source rank, token) in the torch backend. With an identity expert, combine returns
``U[t] * x[t]`` and ``U[t] * w[t]``, U[t] = number of distinct destination ranks of token t.

Combine order: scatter adds a token's rows in ascending destination rank, gather in the order the
ranks first appear among its top-k ids (``first_appearance_ranks``); both start from 0.0 in float32
(``ordered_sum``), after the combine wire's encode/decode (``wire_roundtrip``).
"""

from __future__ import annotations

import torch


def _rows(indices) -> list[list[int]]:
    return indices.tolist() if isinstance(indices, torch.Tensor) else [list(r) for r in indices]


def destination_ranks(row, experts_per_rank: int) -> list[int]:
    """Sorted distinct destination ranks of one token's expert ids."""
    return sorted({int(e) // experts_per_rank for e in row if int(e) >= 0})


def multiplicity(indices, experts_per_rank: int) -> list[int]:
    """U[t]: number of distinct destination ranks of each token."""
    return [len(destination_ranks(r, experts_per_rank)) for r in _rows(indices)]


def expected_received(all_indices, rank: int, experts_per_rank: int) -> list[tuple[int, int]]:
    """(source rank, token) pairs that ``rank`` receives, in (source rank, token) order.

    all_indices[s] is source rank s's [T_s, k] expert ids.
    """
    return [(src, t)
            for src, idx in enumerate(all_indices)
            for t, row in enumerate(_rows(idx))
            if rank in destination_ranks(row, experts_per_rank)]


def experts_per_rank_for(k: int, world: int, experts_per_rank: int) -> int:
    """experts_per_rank, raised where world x experts_per_rank < k: a config's num_experts_per_token is at most
    its num_experts (world_size x num_experts_per_rank); ids repeated within a row stay legal."""
    return max(experts_per_rank, -(-k // world))


def random_routing(gen: torch.Generator, num_tokens: int, k: int, num_experts: int,
                   p_repeat: float = 0.2, p_none: float = 0.1) -> torch.Tensor:
    """[T, k] int32 expert ids: uniform ids, some repeated within a row, some -1 (no expert)."""
    idx = torch.randint(0, num_experts, (num_tokens, k), generator=gen)
    repeat = torch.rand(num_tokens, k, generator=gen) < p_repeat
    for j in range(1, k):  # a repeat copies the previous column's id
        idx[:, j] = torch.where(repeat[:, j], idx[:, j - 1], idx[:, j])
    none = torch.rand(num_tokens, k, generator=gen) < p_none
    return torch.where(none, -1, idx).to(torch.int32)


def make_inputs(seed: int, rank: int, num_tokens: int, hidden: int, k: int, num_experts: int,
                dtype: torch.dtype = torch.bfloat16):
    """Deterministic (x, weights, indices) of one rank; any rank can rebuild any other rank's inputs.

    Values are small multiples of 1/16 (x) and 1/64 (weights), so sums of up to k copies are exact
    in float32 and bf16 -> float32 round trips are exact.
    """
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    x = (torch.randint(-64, 65, (num_tokens, hidden), generator=gen).float() / 16).to(dtype)
    w = torch.randint(1, 64, (num_tokens, k), generator=gen).float() / 64
    return x, w, random_routing(gen, num_tokens, k, num_experts)


# --- combine order and wire formats (low-precision modes) -------------------------------------------
def first_appearance_ranks(row, experts_per_rank: int) -> list[int]:
    """Distinct destination ranks of one token in the order their first expert id appears (gather order)."""
    out: list[int] = []
    for e in (row.tolist() if isinstance(row, torch.Tensor) else row):
        if int(e) >= 0 and int(e) // experts_per_rank not in out:
            out.append(int(e) // experts_per_rank)
    return out


def wire_roundtrip(row: torch.Tensor, quant: str) -> torch.Tensor:
    """One expert row (bf16/fp32) encoded for the combine wire and decoded at the origin, as float32."""
    from runtime import numerics as nx

    if quant == "none":
        return row.float()
    if quant == "fp8_direct_cast":
        return nx.fp8_decode(nx.fp8_encode(row.float(), "ocp"), "ocp")
    if quant == "fp8_blockwise":
        q, s = nx.quantize_fp8(row, "ocp", "fp8_blockwise")
        return nx.dequantize_fp8(q, s, "ocp", "fp8_blockwise", torch.float32)
    if quant == "fp4_blockwise":
        q, s = nx.quantize_fp4(row)
        return nx.dequantize_fp4(q, s, torch.float32)
    raise ValueError(quant)


def ordered_sum(rows, shape, out_dtype=None) -> torch.Tensor:
    """0.0 + rows[0] + rows[1] + ... in float32, one addition at a time; then one rounding to out_dtype."""
    acc = torch.zeros(shape, dtype=torch.float32)
    for r in rows:
        acc = acc + r.float()
    return acc if out_dtype is None else acc.to(out_dtype)
