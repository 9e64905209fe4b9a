"""The identity correctness gate of a benchmark point (bench/sweep.py's module docstring, step 3): dispatch ->
identity expert -> combine must give U*x exactly on every rank, total_recv the rows addressed to each rank and
the received rows exactly those rows (an order-free bitwise checksum); ``GateError`` on every rank otherwise."""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime import EpDispatchCombineConfig, EpDispatchCombineOp

from .accounting import destination_mask
from .inputs import FP8_PAYLOADS, dequantize_rows


def identity_expert(out: torch.Tensor, out_scales: torch.Tensor | None, dst: torch.Tensor) -> None:
    """The identity expert: dispatch's received rows into the combine input `dst` (in place); a
    pre-quantized payload is dequantized with its received scales."""
    if out_scales is None:
        dst.copy_(out)
    else:
        dst.copy_(dequantize_rows(out, out_scales, dst.dtype))


def identity_expected(ref: torch.Tensor, indices: torch.Tensor, world_size: int, experts_per_rank: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """What combine(identity(dispatch(x))) must return: 0.0 + ref + ref + ... (U[t] times, float32, one
    addition at a time, as the backends add a token's rows) rounded once to dtype; U[t] = distinct
    destination ranks of token t (0 when all its ids are < 0)."""
    U = destination_mask(indices, world_size, experts_per_rank).sum(1)
    xf = ref.float()
    acc = torch.zeros_like(xf)
    for u in range(1, world_size + 1):
        acc = torch.where((U >= u)[:, None], acc + xf, acc)
    return acc.to(dtype)


class GateError(RuntimeError):
    """The identity check of a benchmark point failed (raised on every rank alike).

    rank: the rank that raised; point: the point's label; per rank r: wrong_rows[r], its combined token
    rows that differ from U*x; recv_rows[r] / expected_recv_rows[r], its total_recv and the rows
    addressed to it; bad_checksum_columns[r], columns whose checksum over its received rows (payload,
    then scales) differs from that of the rows addressed to it."""

    def __init__(self, message: str, rank: int = -1, point: str = "", wrong_rows=(), recv_rows=(),
                 expected_recv_rows=(), bad_checksum_columns=()):
        super().__init__(message)
        self.rank, self.point = rank, point
        self.wrong_rows, self.recv_rows = list(wrong_rows), list(recv_rows)
        self.expected_recv_rows, self.bad_checksum_columns = list(expected_recv_rows), list(bad_checksum_columns)


def check_gate_mode(cfg: EpDispatchCombineConfig) -> None:
    if cfg.dispatch_quant_type != "none" or cfg.quant_type != "none":
        raise ValueError(f"identity_gate: in-kernel quantization (dispatch_quant_type={cfg.dispatch_quant_type!r}, "
                         f"quant_type={cfg.quant_type!r}) is lossy; the gate checks plain and pre-quantized fp8 "
                         f"payloads, which are exact")
    if cfg.prequantized and (cfg.dispatch_dtype not in FP8_PAYLOADS or cfg.scale_type_size != 4
                             or cfg.hidden_dim % cfg.scale_dim):
        raise ValueError(f"identity_gate: a {cfg.dispatch_dtype} payload with scale_type_size={cfg.scale_type_size}, "
                         f"scale_dim={cfg.scale_dim}: only fp8 payloads with float32 block scales are checked")


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def row_checksum(parts: list[torch.Tensor], rows: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [sum of columns]: per column, the sum of the rows' bit patterns (as integers) of each part
    ([R, c] tensors, concatenated). Exact and independent of row order: a row moved verbatim leaves it
    unchanged, a single flipped bit changes it. rows: a bool mask of the rows to take (None: all)."""
    sums = []
    for p in parts:
        bits = p.contiguous().view(_INT_OF_SIZE[p.element_size()]).to(torch.int64)
        sums.append((bits if rows is None else bits[rows]).sum(0))
    return torch.cat(sums)


def identity_gate(op: EpDispatchCombineOp, x, w, scales, idx, corrupt=None, point: str = "") -> int:
    """Collective: dispatch -> identity expert (into combine_in_view) -> combine, checked on every rank.

    Each rank checks (and every rank learns every rank's result through one all_reduce):
      * total_recv == the rows addressed to it (one per (source token, this rank); so a receive cap
        that drops rows fails);
      * its received rows [:total_recv] (payload, and scales for an fp8 payload) hold exactly the rows
        addressed to it: ``row_checksum`` of them == the sum over source ranks of the checksum of the
        rows each addresses to it (catches a single flipped bit that the combine's rounding could hide);
      * combine's result == ``identity_expected`` exactly: U*x, x dequantized with `scales` for an fp8
        payload (U = distinct destination ranks of the token).
    `corrupt(out, total_recv)`, if given, runs on dispatch's received rows tensor before the checks and
    the expert (fault injection for tests). Raises GateError on every rank when any rank is wrong
    (naming the point, each failing rank and its count of wrong rows); returns this rank's total_recv.
    Tensors follow the op's device (CPU for the torch backend over gloo, the GPU otherwise).
    """
    cfg = op.config
    check_gate_mode(cfg)
    world, rank, epr = cfg.world_size, cfg.rank, cfg.num_experts_per_rank
    dev = op.device
    out, _, out_scales, _, total, handle = op.dispatch(x, w, scales, idx, return_routing=True)
    n = int(total.reshape(-1)[0].item())
    if corrupt is not None:
        corrupt(out, n)
    got_sum = row_checksum([out[:n]] + ([out_scales[:n]] if scales is not None else []))
    view = op.combine_in_view()
    identity_expert(out, out_scales, view)
    combined, _ = op.combine(view, routing=handle)
    ref = x if scales is None else dequantize_rows(x, scales, cfg.combine_dtype)
    want = identity_expected(ref, idx, world, epr, cfg.combine_dtype)
    T = x.shape[0]
    if combined.shape == want.shape:
        bad = (combined != want).any(1) if T else torch.zeros(0, dtype=torch.bool, device=dev)
    else:
        bad = torch.ones(T, dtype=torch.bool, device=dev)
    wrong = int(bad.sum())
    first = int(bad.nonzero()[0, 0]) if wrong else -1

    # one all_reduce (sum) over [checksums addressed to each rank | rows addressed to each rank |
    # each rank's (wrong rows, total_recv, first wrong token, tokens) | each rank's received checksum]
    mask = destination_mask(idx, world, epr)
    parts = [x] + ([scales] if scales is not None else [])
    C = got_sum.numel()
    buf = torch.zeros(world * C + world + 4 * world + world * C, dtype=torch.int64, device=dev)
    sent_sums, counts, status, recv_sums = buf.split([world * C, world, 4 * world, world * C])
    for d in range(world):
        sent_sums[d * C:(d + 1) * C] = row_checksum(parts, mask[:, d])
    counts.copy_(mask.sum(0))
    status[4 * rank:4 * rank + 4] = torch.tensor([wrong, n, first, T], dtype=torch.int64, device=dev)
    recv_sums[rank * C:(rank + 1) * C] = got_sum
    if world > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(buf, group=getattr(op._backend, "group", None))
    expected = counts.tolist()
    st = status.view(world, 4).tolist()
    bad_cols = (sent_sums != recv_sums).view(world, C).sum(1).tolist()
    problems = []
    for r, (wr, got, fst, tok) in enumerate(st):
        if got != expected[r]:
            problems.append(f"rank {r}: total_recv {got} != {expected[r]} rows addressed to it")
        if bad_cols[r]:
            problems.append(f"rank {r}: its received rows differ from the rows addressed to it (checksums of "
                            f"{bad_cols[r]} of {C} columns)")
        if wr:
            problems.append(f"rank {r}: {wr} of {tok} combined rows != U*x (first: token {fst})")
    if problems:
        where = f" at {point}" if point else ""
        raise GateError(f"identity gate failed{where} (raised on rank {rank}): " + "; ".join(problems),
                        rank=rank, point=point, wrong_rows=[s[0] for s in st], recv_rows=[s[1] for s in st],
                        expected_recv_rows=expected, bad_checksum_columns=bad_cols)
    return n
