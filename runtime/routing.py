"""RoutingHandle: what dispatch learned about where each token went, for combine (and replay);
ordered_slots: the native backend's deterministic slot layout under a receive cap."""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch


@attrs.frozen(kw_only=True, eq=False, slots=False)  # (a dict, not slots: attrs' frozen __init__ then fills the
# instance's dict directly, where with slots it calls object.__setattr__ per field: 2.6 -> 1.2 us of every dispatch)
class RoutingHandle:
    """Returned by ``dispatch(..., return_routing=True)``; only the op that made it accepts it.

    op_uid / config_key identify the op; num_tokens is the dispatching rank's token count.
    The torch backend fills total_recv, send_plan, recv_src and dest_order; the native backends keep their
    own payload in ``extra`` (its "recv_src": a live view of the receive buffer's origins, source rank *
    max_num_inp_token_per_rank + token per received row, valid until the next dispatch).
    """

    op_uid: int
    config_key: tuple
    num_tokens: int
    # torch backend payload
    total_recv: int | None = None
    # per destination rank r: (local token ids int64, their receive slots on r int64), in slot order
    send_plan: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    # [total_recv, 2] int64: (source rank, source token) of each received row
    recv_src: torch.Tensor | None = None
    # [num_tokens, world_size] int64: each local token's destination ranks in the order of their first
    # appearance among its top-k ids, then -1 (the gather combine's summation order)
    dest_order: torch.Tensor | None = None
    # rows the dispatching rank dropped on receive past max_recv_tokens (a replay drops the same)
    recv_dropped: int = 0
    # the op's dispatch counter at the dispatch that made this handle (checks of convert_combine_input)
    seq: int = 0
    # the workspace slot holding this dispatch's rows (config max_inflight; runtime/pending.py), and its routing:
    # the seq of the dispatch that made it (a replay keeps its handle's)
    slot: int = 0
    route: int = 0
    extra: dict[str, Any] = attrs.field(factory=dict)


def send_counts(indices: torch.Tensor, world_size: int, experts_per_rank: int, num_experts: int):
    """-> (send [T, k] bool, dest [T, k] int64, hot [T, W] int64).

    One row per (token, destination rank): the first of a token's k ids naming that rank sends it;
    ids < 0 or >= num_experts send nothing. hot[t, r] = 1 when token t sends a row to rank r.
    """
    T, k = indices.shape
    e = indices.long()
    valid = (e >= 0) & (e < num_experts)
    dest = torch.where(valid, e // experts_per_rank, -1)
    earlier = torch.ones(k, k, dtype=torch.bool, device=indices.device).tril(-1)  # [j, jj]: jj < j
    send = valid & ~((dest[:, :, None] == dest[:, None, :]) & earlier).any(-1)
    hot = torch.zeros(T, world_size, dtype=torch.int64, device=indices.device)
    hot.scatter_add_(1, dest.clamp_min(0), send.long())
    return send, dest, hot


def ordered_slots(indices: torch.Tensor, rank: int, world_size: int, experts_per_rank: int, num_experts: int,
                  capacity: int, all_gather: Callable[[torch.Tensor], torch.Tensor], kernels=None):
    """Receive slots numbered in (source rank, token) order, the same on every run.

    all_gather(counts [W]) -> [W, W] (row s: source s's rows to each destination) is the only
    exchange. Returns (slots [T, k] int32 = row * W + destination, -1 for no row or a row at or past
    `capacity`; total [1] int32 rows this rank receives, at most capacity; dropped: a 0-d integer
    tensor). Everything stays on indices' device: no host synchronisation, so it can be graph-captured.
    kernels: the loaded (route_count, route_slots) variants of the device: two one-block kernels
    around the all-gather instead of the torch ops below (which are the reference, and the CPU path).
    """
    W = world_size
    if kernels:
        return _ordered_slots_kernels(indices, rank, W, experts_per_rank, num_experts, capacity, all_gather, *kernels)
    send, dest, hot = send_counts(indices, W, experts_per_rank, num_experts)
    every = all_gather(hot.sum(0))                                        # [source, destination]
    # rows before it at its destination, [T, W]; the scan runs along the last dimension of the [W, T]
    # transpose (a dim-0 scan of [T, W] runs W-wide: ~360 us at T=4096 on an H200, measured)
    by_dst = hot.t().contiguous()
    ahead = every[:rank].sum(0) + (by_dst.cumsum(1) - by_dst).t()
    row = ahead.gather(1, dest.clamp_min(0))
    keep = send & (row < capacity)
    slots = torch.where(keep, row * W + dest, -1).to(torch.int32)
    arriving = every[:, rank].sum()
    total = arriving.clamp(max=capacity)
    return slots, total.to(torch.int32).view(1), arriving - total


def all_gather_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """[W] rows this rank sends to each destination -> [W, W] (row s: source s), on the device, over
    `group` (one small collective; graph-capturable on NCCL/RCCL)."""
    from .workspace import all_gather_single

    W = counts.numel()
    every = torch.empty(W * W, dtype=counts.dtype, device=counts.device)
    all_gather_single(every, counts, group)
    return every.view(W, W)


ROUTE_THREADS = 1024  # the routing kernels run as one block


def _ordered_slots_kernels(indices, rank, W, experts_per_rank, num_experts, capacity, all_gather, count, number):
    T, k = indices.shape
    dev = indices.device
    threads = min(ROUTE_THREADS, count.max_threads, number.max_threads) // 64 * 64  # whole waves, any target
    counts = torch.empty(W, dtype=torch.int32, device=dev)
    count.launch(1, threads, indices=indices, counts=counts, num_tokens=T, k=k, world=W,
                 experts_per_rank=experts_per_rank, num_experts=num_experts)
    every = all_gather(counts).contiguous()  # [source, destination] int32
    slots = torch.empty((T, k), dtype=torch.int32, device=dev)
    out = torch.empty(2, dtype=torch.int32, device=dev)  # total, dropped
    number.launch(1, threads, indices=indices, every=every, slots=slots, total=out[0:1], dropped=out[1:2],
                  num_tokens=T, k=k, world=W, experts_per_rank=experts_per_rank, num_experts=num_experts, rank=rank,
                  capacity=capacity)
    return slots, out[0:1], out[1]
