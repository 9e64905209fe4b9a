"""RoutingHandle: what dispatch learned about where each token went, for combine (and replay)."""

from __future__ import annotations

from typing import Any

import attrs
import torch


@attrs.frozen(kw_only=True, eq=False)
class RoutingHandle:
    """Returned by ``dispatch(..., return_routing=True)``; only the op that made it accepts it.

    op_uid / config_key identify the op; num_tokens is the dispatching rank's token count.
    The torch backend fills total_recv, send_plan, recv_src and dest_order; the native backend keeps its
    own payload in ``extra``.
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
    extra: dict[str, Any] = attrs.field(factory=dict)
