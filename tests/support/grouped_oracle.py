"""Plain-python oracle of the grouped-GEMM layout (runtime/grouped.py's rule), shared by the CPU and GPU tests."""

from __future__ import annotations

import torch

MODE_FIELDS = {  # payload mode of the grouped-layout tests: its config fields
    "bf16": {},
    "fp32": {"data_type": torch.float32},
    "fp8": {"dispatch_data_type": torch.float8_e4m3fn, "combine_data_type": torch.bfloat16, "scale_dim": 2,
            "scale_type_size": 4},  # pre-quantized: bytes and two fp32 scales per row, verbatim
    "fp8_blockwise": {"dispatch_quant_type": "fp8_blockwise"},
    "fp4_blockwise": {"dispatch_quant_type": "fp4_blockwise"},
}


def local_pairs(rows_idx, rank: int, epr: int) -> list[list[int]]:
    """Per local expert, the pair ids i * k + j of the local (row, column) pairs, ascending."""
    pairs: list[list[int]] = [[] for _ in range(epr)]
    for i, row in enumerate(rows_idx):
        for j, e in enumerate(row):
            if e >= 0 and e // epr == rank:
                pairs[e - rank * epr].append(i * len(row) + j)
    return pairs


def expected_groups(pairs: list[list[int]], align: int, capacity: int):
    """-> (start, kept pair ids per expert, offs, dropped): the docstring rule of runtime/grouped.py, by hand."""
    start, kept, offs, here = [], [], [], 0
    for p in pairs:
        n = max(0, min(len(p), capacity - here))
        start.append(here)
        kept.append(p[:n])
        here += -(-n // align) * align
        offs.append(here)
    dropped = sum(len(p) for p in pairs) - sum(len(k) for k in kept)
    return start, kept, offs, dropped


def check_layout(layout, out, out_s, out_w, rows_idx, rank: int, epr: int, k: int, align: int, capacity: int):
    """Assert the layout of one dispatch (its outputs out / out_s / out_w, rows_idx the received rows' ids)
    against the oracle: offs, counts, dropped, each group's rows (pair ids ascending, bytes and scales of
    their received row, weights, m_indices) and the padding (-1 / 0). -> the number of kept pairs."""
    pairs = local_pairs(rows_idx, rank, epr)
    start, kept, offs, dropped = expected_groups(pairs, align, capacity)
    assert layout.rows == capacity and layout.offs.tolist() == offs, (layout.offs.tolist(), offs)
    assert layout.counts.tolist() == [len(p) for p in kept] and int(layout.dropped) == dropped
    for t in (layout.offs, layout.counts, layout.src, layout.m_indices):
        assert t.dtype == torch.int32
    assert layout.weights.dtype == torch.float32 and layout.dropped.dtype == torch.int32
    src, m_idx, wts = layout.src.cpu(), layout.m_indices.cpu(), layout.weights.cpu()
    want_src = torch.full((capacity,), -1, dtype=torch.int32)
    want_m = torch.full((capacity,), -1, dtype=torch.int32)
    for e, (s, p) in enumerate(zip(start, kept)):
        want_src[s:s + len(p)] = torch.tensor(p, dtype=torch.int32)
        want_m[s:s + len(p)] = e
    assert torch.equal(src, want_src) and torch.equal(m_idx, want_m)
    real = (want_src >= 0).nonzero().squeeze(1)
    pid = want_src[real].long()
    row, col = pid // k, pid % k
    gx, ox = layout.x.cpu().view(torch.uint8), out.cpu().view(torch.uint8)
    assert torch.equal(gx[real], ox[row])
    if out_s is None:
        assert layout.scales is None
    else:
        assert torch.equal(layout.scales.cpu()[real], out_s.cpu()[row])
    want_w = torch.zeros(capacity)
    want_w[real] = out_w.cpu()[row, col] if out_w is not None else 1.0
    assert torch.equal(wts, want_w)
    return len(real)


def expert_rows(layout, mode: str, combine_dtype, first_expert: int) -> torch.Tensor:
    """A per-expert affine 'expert' on the grouped rows: (a_e * decode(x) + b_e) in the combine dtype; rows
    outside the kept pairs are NaN (a combine that read one would show it)."""
    x = layout.x
    if mode in ("fp8", "fp8_blockwise"):
        f = x.view(torch.float8_e4m3fn).float()
    elif mode == "fp4_blockwise":
        f = x.view(torch.uint8).float().repeat_interleave(2, dim=1) / 16
    else:
        f = x.float()
    e = layout.m_indices.long()
    a = ((e + first_expert) % 4 + 1).float() / 4
    b = ((e + first_expert) % 7 - 3).float() / 8
    y = a[:, None] * f + b[:, None]
    return torch.where((e >= 0)[:, None], y, float("nan")).to(combine_dtype)


def combine_input(y: torch.Tensor, layout, out_w, rows: int, k: int, dtype, apply_weights: bool) -> torch.Tensor:
    """The oracle of the grouped combine's per-row sum: 0.0 + (w *) y[g] for each kept pair, ascending j."""
    acc = torch.zeros(rows, y.shape[1])
    src = layout.src.cpu().tolist()
    yf, w = y.cpu().float(), (out_w.cpu() if out_w is not None else None)
    by_pair = {p: g for g, p in enumerate(src) if p >= 0}
    for i in range(rows):
        for j in range(k):
            g = by_pair.get(i * k + j)
            if g is None:
                continue
            term = yf[g] if not apply_weights or w is None else w[i, j] * yf[g]
            acc[i] = acc[i] + term
    return acc.to(dtype).to(y.device)
