"""The rows and bytes a benchmark point moves (bench/sweep.py's module docstring: "Accounting"): which ranks a
token's rows go to, each rank's rows per destination, the bytes of a row as it crosses and the GB/s over a leg's
time. Pure arithmetic on the routing, but for ``gather_counts`` (every rank's rows, one all_gather)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime import EpDispatchCombineConfig


def destination_mask(indices: torch.Tensor, world_size: int, experts_per_rank: int) -> torch.Tensor:
    """bool [T, world_size]: token t sends rank d a row (one of its ids e >= 0 has e // experts_per_rank == d).

    Ids < 0 mean no expert; an id >= world_size * experts_per_rank is a ValueError.
    """
    if indices.dim() != 2:
        raise ValueError(f"indices must be [tokens, k], got shape {list(indices.shape)}")
    idx = indices.long()
    if idx.numel() and int(idx.max()) >= world_size * experts_per_rank:
        raise ValueError(f"expert id {int(idx.max())} >= {world_size * experts_per_rank} experts")
    dest = torch.where(idx >= 0, idx.div(experts_per_rank, rounding_mode="floor"), world_size)
    mask = torch.zeros(idx.shape[0], world_size + 1, dtype=torch.bool, device=idx.device)
    return mask.scatter_(1, dest, True)[:, :world_size]


def rows_per_destination(indices: torch.Tensor, world_size: int, experts_per_rank: int) -> list[int]:
    """Rows a rank sends to each destination rank: one per (token, distinct destination rank)."""
    return [int(v) for v in destination_mask(indices, world_size, experts_per_rank).sum(0).tolist()]


def accounting(indices: torch.Tensor, rank: int, world_size: int, experts_per_rank: int, row_bytes: int,
               recv_per_source: list[int], combine_row_bytes: int | None = None) -> dict:
    """Rows and bytes one rank's dispatch and combine move (see the module docstring).

    indices: this rank's [T, k] expert ids. recv_per_source[s]: rows this rank receives from rank s,
    i.e. rows_per_destination(rank s's indices)[rank] (the benchmark all-gathers every rank's counts);
    entry `rank` must equal this rank's own rows to itself. row_bytes: bytes of one dispatched row
    (payload + scales); combine_row_bytes: of one combined row (default row_bytes).
    """
    sent = rows_per_destination(indices, world_size, experts_per_rank)
    recv = [int(v) for v in recv_per_source]
    if len(recv) != world_size:
        raise ValueError(f"recv_per_source has {len(recv)} entries, world_size is {world_size}")
    if recv[rank] != sent[rank]:
        raise ValueError(f"recv_per_source[{rank}]={recv[rank]}, but this rank sends itself {sent[rank]} rows")
    crow = row_bytes if combine_row_bytes is None else combine_row_bytes
    sent_rows, local = sum(sent), sent[rank]
    remote = sent_rows - local
    recv_rows = sum(recv)
    return {
        "sent_per_dest": sent, "recv_per_source": recv,
        "sent_rows": sent_rows, "local_rows": local, "remote_rows": remote,
        "recv_rows": recv_rows, "recv_remote_rows": recv_rows - recv[rank],
        "dispatch_row_bytes": row_bytes, "combine_row_bytes": crow,
        "dispatch_logical_bytes": recv_rows * row_bytes, "dispatch_link_bytes": remote * row_bytes,
        "combine_logical_bytes": sent_rows * crow, "combine_link_bytes": remote * crow,
    }


def _gbps(nbytes: int, seconds: float | None) -> float | None:
    if seconds is None:
        return None
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def bandwidths(acc: dict, dispatch_s: float | None, combine_s: float | None) -> dict:
    """GB/s (1e9 bytes/s) of an ``accounting`` dict over the legs' times in seconds (None: not measured
    -> None; a time <= 0 -> 0.0)."""
    return {
        "dispatch_logical_GBps": _gbps(acc["dispatch_logical_bytes"], dispatch_s),
        "dispatch_link_GBps": _gbps(acc["dispatch_link_bytes"], dispatch_s),
        "combine_logical_GBps": _gbps(acc["combine_logical_bytes"], combine_s),
        "combine_link_GBps": _gbps(acc["combine_link_bytes"], combine_s),
    }


def row_bytes(cfg: EpDispatchCombineConfig) -> tuple[int, int]:
    """(dispatch, combine) bytes of one row as it crosses: payload + scales (weights, indices not counted)."""
    H = cfg.hidden_dim
    dq, cq = cfg.dispatch_quant_type, cfg.quant_type
    if dq == "fp8_blockwise":
        d = H + (H // 128) * 4
    elif dq == "fp4_blockwise":
        d = H // 2 + H // 32
    else:  # plain, or a pre-quantized payload (fp4: cols = H/2, one byte each) with its scales
        d = cfg.dispatch_payload_cols * cfg.dispatch_dtype.itemsize + cfg.scale_dim * cfg.scale_type_size
    if cfg.resolved_combine_mode == "scatter" and cq != "none":
        c = {"fp8_direct_cast": H, "fp8_blockwise": H + (H // 128) * 4, "fp4_blockwise": H // 2 + H // 32}[cq]
    else:
        c = H * cfg.combine_dtype.itemsize
    return d, c


def gather_counts(sent: list[int], device) -> list[list[int]]:
    """Every rank's rows per destination: matrix[s][d] = rows rank s sends to rank d."""
    mine = torch.tensor(sent, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [[int(v) for v in t.tolist()] for t in every]
