"""Reference backend on torch.distributed collectives (gloo on CPU, NCCL on GPUs): the parity oracle.

Simplicity over speed. Dispatch all_gathers every rank's padded tokens, weights, indices and token
count, so every rank knows the whole routing; each rank then picks the rows that land on it,
ordered by (source rank, token). Combine all_gathers every rank's padded expert output and each
rank sums, in float32, the rows its tokens produced on their destination ranks.

Data-dependent errors (expert id out of range, receive overflow) are detected after the gather
from every rank's data, so all ranks raise the same InputError and stay in step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .config import EpDispatchCombineConfig
from .errors import ConfigError, InputError


def destination_mask(indices: torch.Tensor, experts_per_rank: int, world_size: int) -> torch.Tensor:
    """[T, k] expert ids -> [T, world_size] bool: does token t send a row to rank r (ids < 0: none)."""
    idx = indices.long()
    dest = torch.where(idx >= 0, idx // experts_per_rank, world_size)  # world_size: a sink column
    mask = torch.zeros(idx.shape[0], world_size + 1, dtype=torch.bool, device=idx.device)
    mask.scatter_(1, dest, True)
    return mask[:, :world_size]


class TorchBackend:
    """See the module docstring; the interface is described in runtime/op.py."""

    name = "torch"

    def __init__(self, config: EpDispatchCombineConfig, group=None):
        self.config = config
        if dist.is_available() and dist.is_initialized():
            self.group = group if group is not None else dist.group.WORLD
            size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
            if (size, rank) != (config.world_size, config.rank):
                raise ConfigError(f"the process group has world size {size} and this process is rank {rank}, "
                                  f"but the config says world_size={config.world_size}, rank={config.rank}")
            on_gpu = "nccl" in str(dist.get_backend(self.group)).lower()
            self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        else:
            if group is not None or config.world_size != 1:
                raise ConfigError("torch.distributed is not initialized: call torch.distributed."
                                  "init_process_group first (only world_size=1 runs without a group)")
            self.group = None
            self.device = torch.device("cpu")
        self._in_view: torch.Tensor | None = None

    @property
    def capabilities(self) -> dict:
        return {"graph_capture": False, "routing_replay": False}

    # --- collectives -----------------------------------------------------------------------------
    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """All ranks' copies of a same-shaped tensor; any dtype (moved as bytes)."""
        if self.group is None:
            return [t]
        flat = t.contiguous().view(-1).view(torch.uint8)
        parts = [torch.empty_like(flat) for _ in range(self.config.world_size)]
        dist.all_gather(parts, flat, group=self.group)
        return [p.view(t.dtype).view(t.shape) for p in parts]

    # --- dispatch --------------------------------------------------------------------------------
    def dispatch(self, x, weights, scales, indices, routing):
        if routing is not None:
            raise NotImplementedError("routing replay is not built yet")
        cfg, dev = self.config, self.device
        world, me, epr = cfg.world_size, cfg.rank, cfg.num_experts_per_rank
        max_in, k, hidden = cfg.max_num_inp_token_per_rank, cfg.num_experts_per_token, cfg.hidden_dim
        n = x.shape[0]

        x_pad = torch.zeros(max_in, hidden, dtype=x.dtype, device=dev)
        w_pad = torch.zeros(max_in, k, dtype=torch.float32, device=dev)
        i_pad = torch.full((max_in, k), -1, dtype=torch.int32, device=dev)
        x_pad[:n], i_pad[:n] = x, indices
        if weights is not None:
            w_pad[:n] = weights
        counts = [int(c) for c in self._all_gather(torch.tensor([n], dtype=torch.int64, device=dev))]
        all_idx = [t[:c] for t, c in zip(self._all_gather(i_pad), counts)]

        for src, idx in enumerate(all_idx):
            bad = idx[idx >= cfg.num_experts]
            if bad.numel():
                raise InputError(f"dispatch: rank {src} passed expert id {int(bad[0])} >= num_experts="
                                 f"{cfg.num_experts} (world_size * num_experts_per_rank); negative ids mean "
                                 f"'no expert'")
        masks = [destination_mask(idx, epr, world) for idx in all_idx]
        sent = torch.stack([m.sum(0) for m in masks])  # [src, dst] rows
        recv = sent.sum(0)
        if int(recv.max()) > cfg.max_recv_tokens:
            r = int(recv.argmax())
            raise InputError(f"dispatch: rank {r} would receive {int(recv[r])} rows, more than max_recv_tokens="
                             f"{cfg.max_recv_tokens} (config max_total_recv_tokens)")
        offsets = torch.cumsum(sent, 0) - sent  # [src, dst]: first slot of src's rows on dst

        all_x, all_w = self._all_gather(x_pad), self._all_gather(w_pad)
        total = int(recv[me])
        out = torch.zeros(cfg.max_recv_tokens, hidden, dtype=x.dtype, device=dev)
        out_w = torch.zeros(cfg.max_recv_tokens, k, dtype=torch.float32, device=dev)
        out_i = torch.full((cfg.max_recv_tokens, k), -1, dtype=torch.int32, device=dev)
        recv_src = torch.empty(total, 2, dtype=torch.int64, device=dev)
        for src in range(world):
            tok = masks[src][:, me].nonzero().squeeze(1)
            lo = int(offsets[src, me])
            rows = slice(lo, lo + tok.numel())
            out[rows], out_w[rows], out_i[rows] = all_x[src][tok], all_w[src][tok], all_idx[src][tok]
            recv_src[rows, 0], recv_src[rows, 1] = src, tok

        send_plan = []
        for dst in range(world):
            tok = masks[me][:, dst].nonzero().squeeze(1)
            send_plan.append((tok, offsets[me, dst] + torch.arange(tok.numel(), device=dev)))
        total_recv = torch.tensor([total], dtype=torch.int32, device=dev)
        fields = {"total_recv": total, "send_plan": tuple(send_plan), "recv_src": recv_src}
        return out, (out_w if weights is not None else None), None, out_i, total_recv, fields

    # --- combine ---------------------------------------------------------------------------------
    def combine(self, expert_out, weights, indices, routing):
        """``indices`` is checked for shape only: the handle's send plan says where each row goes."""
        cfg, dev = self.config, self.device
        total, rows_max = routing.total_recv, cfg.max_recv_tokens
        if total is None or routing.send_plan is None:
            raise InputError("combine: this routing handle carries no torch-backend plan")
        for name, t in (("expert_out", expert_out), ("weights", weights), ("indices", indices)):
            if t is not None and t.shape[0] < total:
                raise InputError(f"combine: {name} has {t.shape[0]} rows, fewer than total_recv={total}")

        e_pad = torch.zeros(rows_max, cfg.hidden_dim, dtype=expert_out.dtype, device=dev)
        w_pad = torch.zeros(rows_max, cfg.num_experts_per_token, dtype=torch.float32, device=dev)
        e_pad[:total] = expert_out[:total]
        if weights is not None:
            w_pad[:total] = weights[:total]
        all_e, all_w = self._all_gather(e_pad), self._all_gather(w_pad)

        n = routing.num_tokens
        acc = torch.zeros(n, cfg.hidden_dim, dtype=torch.float32, device=dev)
        acc_w = torch.zeros(n, cfg.num_experts_per_token, dtype=torch.float32, device=dev)
        for dst, (tok, slots) in enumerate(routing.send_plan):  # fixed order: deterministic sums
            acc.index_add_(0, tok, all_e[dst][slots].float())
            acc_w.index_add_(0, tok, all_w[dst][slots])
        return acc.to(cfg.combine_dtype), (acc_w if weights is not None else None)

    # --- buffers / lifecycle ---------------------------------------------------------------------
    def combine_in_view(self) -> torch.Tensor:
        if self._in_view is None:
            self._in_view = torch.zeros(self.config.max_recv_tokens, self.config.hidden_dim,
                                        dtype=self.config.combine_dtype, device=self.device)
        return self._in_view

    def reset(self) -> None:
        """Nothing persists between calls in this backend."""

    def close(self) -> None:
        self._in_view = None
