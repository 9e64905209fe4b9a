"""Reference backend on torch.distributed collectives (gloo on CPU, NCCL on GPUs): the parity oracle.

Simplicity over speed. Dispatch all_gathers every rank's padded tokens, weights, indices and token
count, so every rank knows the whole routing; each rank then picks the rows that land on it,
ordered by (source rank, token). Combine all_gathers every rank's padded expert output and each
rank sums, in float32, the rows its tokens produced on their destination ranks.

Low-precision semantics (what the GPU kernels must match bit for bit; FP8 here is always OCP
e4m3, ``wire_dtype`` torch.float8_e4m3fn, numerics format "ocp"):

* pre-quantized payload (dispatch_data_type fp8/fp4): payload bytes and scales move verbatim.
* in-kernel dispatch quantization: the source rank encodes each of its rows
  (numerics.quantize_fp8(row, "ocp", "fp8_blockwise") / numerics.quantize_fp4(row)) and the
  encoded rows and scales move verbatim; a row's encoding depends on that row only.
* gather combine (quant_type "none"): token t's result is 0.0 (float32) plus, one addition at a
  time, its row from each destination rank, the ranks taken in the order of their first
  appearance among t's top-k ids (ascending j of the slot that first names the rank); then one
  rounding to the combine dtype. Weights: the same order.
* scatter combine: each destination rank encodes each of its received rows (quant_type
  "fp8_direct_cast": numerics.fp8_encode(row.float(), "ocp"), no scale; "fp8_blockwise":
  numerics.quantize_fp8(row, "ocp", "fp8_blockwise"); "fp4_blockwise": numerics.quantize_fp4(row);
  "none": the row itself) and sends it to the row's origin; the origin decodes each row to
  float32 (fp8_decode / dequantize_fp8 / dequantize_fp4, or row.float()) and adds them to 0.0 in
  ascending destination-rank order, then rounds once to the combine dtype. Weights travel as
  float32 and are added in the same order.

Data-dependent errors (expert id out of range, receive overflow) are detected after the gather
from every rank's data, so all ranks raise the same InputError and stay in step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import numerics
from .config import EpDispatchCombineConfig
from .errors import ConfigError, InputError

FP8_FORMAT = "ocp"  # this backend's FP8 e4m3 (torch.float8_e4m3fn)


def destination_mask(indices: torch.Tensor, experts_per_rank: int, world_size: int) -> torch.Tensor:
    """[T, k] expert ids -> [T, world_size] bool: does token t send a row to rank r (ids < 0: none)."""
    idx = indices.long()
    dest = torch.where(idx >= 0, idx // experts_per_rank, world_size)  # world_size: a sink column
    mask = torch.zeros(idx.shape[0], world_size + 1, dtype=torch.bool, device=idx.device)
    mask.scatter_(1, dest, True)
    return mask[:, :world_size]


def destination_order(indices: torch.Tensor, experts_per_rank: int, world_size: int) -> torch.Tensor:
    """[T, k] expert ids -> [T, world_size] int64: each token's destination ranks in the order of their
    first appearance among its k ids (ascending column j), then -1 padding."""
    idx = indices.long()
    n, k = idx.shape
    dest = torch.where(idx >= 0, idx // experts_per_rank, world_size)
    first = torch.full((n, world_size + 1), k, dtype=torch.int64, device=idx.device)
    cols = torch.arange(k, device=idx.device).expand(n, k)
    first.scatter_reduce_(1, dest, cols, reduce="amin")
    first = first[:, :world_size]
    order = torch.argsort(first, dim=1, stable=True)
    return torch.where(torch.gather(first, 1, order) < k, order, -1)


def _on_cpu(fn):
    """Run a numerics reference function on CPU copies (it builds CPU constants) and return results on
    the device of its first tensor argument (the backend also runs over NCCL on GPUs)."""
    def wrapped(*args):
        dev = next(a.device for a in args if isinstance(a, torch.Tensor))
        out = fn(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
        if isinstance(out, tuple):
            return tuple(o.to(dev) if isinstance(o, torch.Tensor) else o for o in out)
        return out.to(dev)
    return wrapped


@_on_cpu
def quantize_rows(x: torch.Tensor, quant_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """In-kernel dispatch quantization of rows [N, H] -> (payload uint8, scales)."""
    if quant_type == "fp8_blockwise":
        return numerics.quantize_fp8(x, FP8_FORMAT, "fp8_blockwise")
    if quant_type == "fp4_blockwise":
        return numerics.quantize_fp4(x)
    raise ValueError(f"unknown dispatch_quant_type {quant_type!r}")


def encode_rows(rows: torch.Tensor, quant_type: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Combine wire encoding of expert rows [N, H] (bf16/fp32) -> (payload, scales or None)."""
    return (rows, None) if quant_type == "none" else _encode(rows, quant_type)


def decode_rows(payload: torch.Tensor, scales: torch.Tensor | None, quant_type: str) -> torch.Tensor:
    """Inverse of ``encode_rows`` to float32 [N, H]."""
    return payload.float() if quant_type == "none" else _decode(payload, scales, quant_type)


@_on_cpu
def _encode(rows, quant_type):
    if quant_type == "fp8_direct_cast":
        return numerics.fp8_encode(rows.float(), FP8_FORMAT), None
    if quant_type == "fp8_blockwise":
        return numerics.quantize_fp8(rows, FP8_FORMAT, "fp8_blockwise")
    if quant_type == "fp4_blockwise":
        return numerics.quantize_fp4(rows)
    raise ValueError(f"unknown quant_type {quant_type!r}")


@_on_cpu
def _decode(payload, scales, quant_type):
    if quant_type == "fp8_direct_cast":
        return numerics.fp8_decode(payload, FP8_FORMAT)
    if quant_type == "fp8_blockwise":
        return numerics.dequantize_fp8(payload, scales, FP8_FORMAT, "fp8_blockwise", torch.float32)
    if quant_type == "fp4_blockwise":
        return numerics.dequantize_fp4(payload, scales, torch.float32)
    raise ValueError(f"unknown quant_type {quant_type!r}")


class TorchBackend:
    """See the module docstring; the interface is described in runtime/op.py."""

    name = "torch"
    wire_dtype = torch.float8_e4m3fn  # FP8 of in-kernel quantization (numerics format "ocp")

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
    def _dispatch_payload(self, x, scales):
        """The rows as they travel, and their scales: (payload [n, cols], scales [n, s] or None, out dtype)."""
        cfg = self.config
        if cfg.dispatch_quant_type != "none":
            q, s = quantize_rows(x, cfg.dispatch_quant_type)
            return q, s, (self.wire_dtype if cfg.dispatch_quant_type == "fp8_blockwise" else torch.uint8)
        if cfg.prequantized:  # fp8 / float4_e2m1fn_x2: one byte per element, moved as bytes
            return x.view(torch.uint8), scales, x.dtype
        return x, None, x.dtype

    def dispatch(self, x, weights, scales, indices, routing):
        if routing is not None:
            raise NotImplementedError("routing replay is not built yet")
        cfg, dev = self.config, self.device
        world, me, epr = cfg.world_size, cfg.rank, cfg.num_experts_per_rank
        max_in, k = cfg.max_num_inp_token_per_rank, cfg.num_experts_per_token
        n = x.shape[0]

        payload, pscales, out_dtype = self._dispatch_payload(x, scales)
        x_pad = torch.zeros(max_in, payload.shape[1], dtype=payload.dtype, device=dev)
        w_pad = torch.zeros(max_in, k, dtype=torch.float32, device=dev)
        i_pad = torch.full((max_in, k), -1, dtype=torch.int32, device=dev)
        x_pad[:n], i_pad[:n] = payload, indices
        if weights is not None:
            w_pad[:n] = weights
        s_pad = None
        if pscales is not None:
            s_pad = torch.zeros(max_in, pscales.shape[1], dtype=pscales.dtype, device=dev)
            s_pad[:n] = pscales
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
        all_s = self._all_gather(s_pad) if s_pad is not None else None
        total, rows_max = int(recv[me]), cfg.max_recv_tokens
        out = torch.zeros(rows_max, x_pad.shape[1], dtype=x_pad.dtype, device=dev)
        out_s = torch.zeros(rows_max, s_pad.shape[1], dtype=s_pad.dtype, device=dev) if s_pad is not None else None
        out_w = torch.zeros(rows_max, k, dtype=torch.float32, device=dev)
        out_i = torch.full((rows_max, k), -1, dtype=torch.int32, device=dev)
        recv_src = torch.empty(total, 2, dtype=torch.int64, device=dev)
        for src in range(world):
            tok = masks[src][:, me].nonzero().squeeze(1)
            lo = int(offsets[src, me])
            rows = slice(lo, lo + tok.numel())
            out[rows], out_w[rows], out_i[rows] = all_x[src][tok], all_w[src][tok], all_idx[src][tok]
            if out_s is not None:
                out_s[rows] = all_s[src][tok]
            recv_src[rows, 0], recv_src[rows, 1] = src, tok

        send_plan = []
        for dst in range(world):
            tok = masks[me][:, dst].nonzero().squeeze(1)
            send_plan.append((tok, offsets[me, dst] + torch.arange(tok.numel(), device=dev)))
        total_recv = torch.tensor([total], dtype=torch.int32, device=dev)
        fields = {"total_recv": total, "send_plan": tuple(send_plan), "recv_src": recv_src,
                  "dest_order": destination_order(indices, epr, world)}
        return (out.view(out_dtype), (out_w if weights is not None else None), out_s, out_i, total_recv,
                fields)

    # --- combine ---------------------------------------------------------------------------------
    def combine(self, expert_out, weights, indices, routing):
        """``indices`` is checked for shape only: the handle's send plan says where each row goes."""
        cfg, dev = self.config, self.device
        total, rows_max, hidden = routing.total_recv, cfg.max_recv_tokens, cfg.hidden_dim
        if total is None or routing.send_plan is None or routing.dest_order is None:
            raise InputError("combine: this routing handle carries no torch-backend plan")
        for name, t in (("expert_out", expert_out), ("weights", weights), ("indices", indices)):
            if t is not None and t.shape[0] < total:
                raise InputError(f"combine: {name} has {t.shape[0]} rows, fewer than total_recv={total}")

        # what each destination rank sends back: its rows, encoded for the wire in scatter mode
        quant = cfg.quant_type if cfg.resolved_combine_mode == "scatter" else "none"
        payload, scales = encode_rows(expert_out[:total], quant)
        p_pad = torch.zeros(rows_max, payload.shape[1], dtype=payload.dtype, device=dev)
        p_pad[:total] = payload
        all_p = self._all_gather(p_pad)
        all_s = None
        if scales is not None:
            s_pad = torch.zeros(rows_max, scales.shape[1], dtype=scales.dtype, device=dev)
            s_pad[:total] = scales
            all_s = self._all_gather(s_pad)
        w_pad = torch.zeros(rows_max, cfg.num_experts_per_token, dtype=torch.float32, device=dev)
        if weights is not None:
            w_pad[:total] = weights[:total]
        all_w = self._all_gather(w_pad)

        n, world = routing.num_tokens, cfg.world_size
        slot_of = torch.full((n, world), -1, dtype=torch.int64, device=dev)  # [token, rank] -> slot there
        for dst, (tok, slots) in enumerate(routing.send_plan):
            slot_of[tok, dst] = slots
        acc = torch.zeros(n, hidden, dtype=torch.float32, device=dev)
        acc_w = torch.zeros(n, cfg.num_experts_per_token, dtype=torch.float32, device=dev)

        def add(tok, dst, slots):  # one float32 addition per element of each token's accumulator
            rows = decode_rows(all_p[dst][slots], all_s[dst][slots] if all_s is not None else None, quant)
            acc[tok] = acc[tok] + rows
            acc_w[tok] = acc_w[tok] + all_w[dst][slots]

        if cfg.resolved_combine_mode == "scatter":  # ascending destination rank
            for dst, (tok, slots) in enumerate(routing.send_plan):
                add(tok, dst, slots)
        else:  # gather: each token's ranks in first-appearance order of its top-k ids
            for step in range(world):
                ranks = routing.dest_order[:, step]
                for dst in range(world):
                    tok = (ranks == dst).nonzero().squeeze(1)
                    if tok.numel():
                        add(tok, dst, slot_of[tok, dst])
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
