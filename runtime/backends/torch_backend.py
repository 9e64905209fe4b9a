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

Data-dependent errors (expert id out of range) are detected after the gather from every rank's
data, so all ranks raise the same InputError and stay in step. Receive overflow is not an error:
rows past max_recv_tokens are dropped (the last ones in (source rank, token) order) and counted;
a token's dropped row contributes nothing to its combine. strict_capacity=True raises CapacityError
on each rank that dropped rows (after the data moved; the other ranks return normally).

Internode (config.is_internode; G = gpu_per_node, ranks node-major: node(r) = r // G, local index
loc(r) = r % G). Both routes give exactly the intranode results (same received rows in the same
slots, same combine arithmetic): only how the bytes travel differs. Every rank still all_gathers
the token counts and expert ids (metadata: the whole plan, ``slots_all``, is computed alike
everywhere, so senders, forwarders and receivers agree on every message without extra
headers); each row travels as one byte record (payload | scales | weights | ids), verbatim, through
``all_to_all_single`` on the op's group (uneven splits, zero where a rank has nothing for a peer).

* "v2_ll" (low latency): one copy per (token, kept destination rank), one all_to_all. Combine: each
  destination sends each received row straight back to its origin (one all_to_all).
* "v2" (hierarchical), two all_to_alls per leg. Dispatch stage 1 (between nodes, "rails"): source s
  sends one copy per (token, destination node M) that has a kept destination on M, to its node peer
  p = M*G + loc(s) (the same local index on M; every non-zero split of this stage connects ranks of
  one rail, loc equal). Stage 2 (inside node M): p forwards each row it received to the final ranks
  d on its node that keep it; d receives from each local forwarder p the rows of the sources of
  p's rail, in ascending source then token order, and puts them in their slots. Combine reverses
  both stages: d sends each row to its node peer of the origin's rail, which forwards it to the
  origin. The forwarder does not pre-reduce a token's rows of its node (the native design would):
  a partial sum would change the float32 summation order, and this backend must match the intranode
  arithmetic exactly, so the inter-node leg of the combine carries one row per (token, destination
  rank). The stages run on the whole group (zero splits outside the rail / node) rather than on
  rail and node subgroups: no extra communicators, same bytes per link.
* "auto": per dispatch, v2_ll when the call's largest per-rank token count (gathered anyway, so every
  rank picks alike) is <= internode_auto_ll_max_tokens, else v2. A combine takes its handle's route.
  ``last_internode_kernel`` says which route the last call took.

Routing replay (dispatch(..., routing=handle)): the handle's plan is reused verbatim: the new rows,
weights, indices and scales land in exactly the rows the handle's dispatch used (same total_recv, same
drops); the new indices are moved as data and do not route.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import collectives, moe, numerics
from ..config import EpDispatchCombineConfig
from ..errors import CapacityError, ConfigError, InputError

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


def _records(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Row-aligned tensors [n, ...] -> one uint8 record per row [n, sum of row bytes], and the byte widths."""
    flat = [p.contiguous().view(torch.uint8).reshape(p.shape[0], p.shape[1:].numel() * p.element_size())
            for p in parts]
    return torch.cat(flat, 1), [f.shape[1] for f in flat]


def _unrecord(records: torch.Tensor, widths: list[int], like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of ``_records``: the parts, with the dtypes of ``like``."""
    return [c.contiguous().view(t.dtype) for c, t in zip(records.split(widths, 1), like)]


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
        self._in_views: dict[int, torch.Tensor] = {}  # combine_in_view of each workspace slot (max_inflight)
        self.slot = 0
        self._dropped: torch.Tensor | None = None
        self._routed: torch.Tensor | None = None  # routed_expert_count of the last dispatch
        self.last_internode_kernel: str | None = None

    @property
    def capabilities(self) -> dict:
        return {"graph_capture": False, "routing_replay": True, "internode": True}

    # --- collectives -----------------------------------------------------------------------------
    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """All ranks' copies of a same-shaped tensor; any dtype (moved as bytes)."""
        if self.group is None:
            return [t]
        flat = t.contiguous().view(-1).view(torch.uint8)
        parts = [torch.empty_like(flat) for _ in range(self.config.world_size)]
        collectives.run(lambda: dist.all_gather(parts, flat, group=self.group), [flat, *parts], self.group)
        return [p.view(t.dtype).view(t.shape) for p in parts]

    def _exchange(self, send: list[torch.Tensor], recv_counts: list[int], width: int) -> list[torch.Tensor]:
        """all_to_all_single of byte records: send[r] ([n_r, width] uint8) goes to rank r; -> what each
        rank sent here (recv_counts[r] records from rank r)."""
        buf = torch.cat(send) if send else torch.empty(0, width, dtype=torch.uint8, device=self.device)
        out = torch.empty(sum(recv_counts), width, dtype=torch.uint8, device=self.device)
        collectives.run(lambda: dist.all_to_all_single(out, buf, recv_counts, [t.shape[0] for t in send],
                                                       group=self.group), [out, buf], self.group)
        return list(out.split(recv_counts))

    def _route(self, counts: list[int]) -> str | None:
        """The internode route of a dispatch with these per-rank token counts (None: intranode)."""
        cfg = self.config
        if not cfg.is_internode:
            return None
        if cfg.internode_kernel != "auto":
            return cfg.internode_kernel
        return "v2_ll" if max(counts) <= cfg.internode_auto_ll_max_tokens else "v2"

    def _internode_move(self, route: str, rows: list[torch.Tensor], slots_all, width: int,
                        back: bool) -> list[torch.Tensor]:
        """Move byte records along ``route``; -> per peer rank, its records in the order the receiver wants.

        Dispatch (back=False): rows[0] [n_me, width] are this rank's token records; returns, per
        source s, the records of s's tokens kept here, in token (= slot) order.
        Combine (back=True): rows[0] [rows_max, width] are this rank's received-row records by slot;
        returns, per destination d, the records d sends back for this rank's tokens kept on d, in
        token order (the order of send_plan[d]).
        """
        cfg = self.config
        world, me, gpn = cfg.world_size, cfg.rank, cfg.resolved_gpu_per_node
        node, loc = me // gpn, me % gpn
        mine = rows[0]
        empty = mine[:0]

        def kept(s, d):  # tokens of s kept on d, ascending, and their slots on d
            col = slots_all[s][:, d]
            tok = (col >= 0).nonzero().squeeze(1)
            return tok, col[tok]

        def n_kept(s, d) -> int:
            return int((slots_all[s][:, d] >= 0).sum())

        if route == "v2_ll":
            if not back:
                send = [mine[kept(me, d)[0]] for d in range(world)]
                return self._exchange(send, [n_kept(s, me) for s in range(world)], width)
            send = [mine[kept(s, me)[1]] for s in range(world)]
            return self._exchange(send, [n_kept(me, d) for d in range(world)], width)

        rail = [s for s in range(world) if s % gpn == loc]  # this rank's rail: one rank per node
        my_node = range(node * gpn, (node + 1) * gpn)

        def to_node(s, m):  # tokens of s with a kept destination on node m, ascending
            block = slots_all[s][:, m * gpn:(m + 1) * gpn]
            return (block >= 0).any(1).nonzero().squeeze(1)

        if not back:
            # stage 1 (between nodes, along the rail): one copy per (token, destination node)
            send1 = [mine[to_node(me, p // gpn)] if p % gpn == loc else empty for p in range(world)]
            recv1 = [int(to_node(s, node).numel()) if s % gpn == loc else 0 for s in range(world)]
            got1 = self._exchange(send1, recv1, width)
            # stage 2 (inside the node): forward what arrived to the final ranks that keep it
            send2 = []
            for d in range(world):
                if d // gpn != node:
                    send2.append(empty)
                    continue
                parts = [got1[s][slots_all[s][to_node(s, node), d] >= 0] for s in rail]
                send2.append(torch.cat(parts))
            recv2 = [sum(n_kept(s, me) for s in range(p % gpn, world, gpn)) if p in my_node else 0
                     for p in range(world)]
            got2 = self._exchange(send2, recv2, width)
            out = [empty] * world  # per source, in token order
            for p in my_node:
                srcs = list(range(p % gpn, world, gpn))
                for s, part in zip(srcs, got2[p].split([n_kept(s, me) for s in srcs])):
                    out[s] = part
            return out

        # combine, stage 2 reversed (inside the node): each received row to the origin's node peer
        send2 = [torch.cat([mine[kept(s, me)[1]] for s in range(p % gpn, world, gpn)]) if p in my_node else empty
                 for p in range(world)]
        recv2 = [sum(n_kept(s, d) for s in rail) if d in my_node else 0 for d in range(world)]
        got2 = self._exchange(send2, recv2, width)
        by_dst = {d: dict(zip(rail, got2[d].split([n_kept(s, d) for s in rail]))) for d in my_node}
        # stage 1 reversed (between nodes, along the rail): the forwarder sends every row on, unreduced
        send1 = [torch.cat([by_dst[d][s] for d in my_node]) if s in rail else empty for s in range(world)]
        recv1 = [sum(n_kept(me, d) for d in range(p // gpn * gpn, (p // gpn + 1) * gpn)) if p % gpn == loc else 0
                 for p in range(world)]
        got1 = self._exchange(send1, recv1, width)
        out = [empty] * world  # per destination, in token order
        for p in rail:
            dsts = list(range(p // gpn * gpn, (p // gpn + 1) * gpn))
            for d, part in zip(dsts, got1[p].split([n_kept(me, d) for d in dsts])):
                out[d] = part
        return out

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
        """Fresh routing, or a replay of ``routing``'s plan (same rows, same total_recv, same drops).

        Receive cap: every rank's rows are numbered in (source rank, token) order; rows numbered at or
        past max_recv_tokens are dropped (never written) and counted (``dropped_count``).
        """
        cfg, dev = self.config, self.device
        world, me, epr = cfg.world_size, cfg.rank, cfg.num_experts_per_rank
        max_in, k, rows_max = cfg.max_num_inp_token_per_rank, cfg.num_experts_per_token, cfg.max_recv_tokens
        n = x.shape[0]
        if routing is not None and (routing.recv_src is None or routing.send_plan is None
                                    or routing.total_recv is None):
            raise InputError("dispatch: this routing handle carries no torch-backend plan")

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
                raise InputError(f"dispatch: rank {src} passed expert id {int(bad[0])} >= {cfg.expert_id_bound()}")
        if routing is None:
            masks = [destination_mask(idx, epr, world) for idx in all_idx]
            sent = torch.stack([m.sum(0) for m in masks])  # [src, dst] rows addressed
            offsets = torch.cumsum(sent, 0) - sent  # [src, dst]: (source rank, token) number of src's first row
            addressed = int(sent[:, me].sum())
            total = min(addressed, rows_max)
            recv_src = torch.empty(total, 2, dtype=torch.int64, device=dev)
            for src in range(world):
                tok = masks[src][:, me].nonzero().squeeze(1)
                lo = int(offsets[src, me])
                kept = tok[:max(0, min(tok.numel(), rows_max - lo))]
                recv_src[lo:lo + kept.numel(), 0], recv_src[lo:lo + kept.numel(), 1] = src, kept
            send_plan = []
            for dst in range(world):
                tok = masks[me][:, dst].nonzero().squeeze(1)
                slots = offsets[me, dst] + torch.arange(tok.numel(), device=dev)
                keep = slots < rows_max  # rows past dst's cap are dropped there: nothing comes back
                send_plan.append((tok[keep], slots[keep]))
            fields = {"total_recv": total, "send_plan": tuple(send_plan), "recv_src": recv_src,
                      "dest_order": destination_order(indices, epr, world), "recv_dropped": addressed - total}
            if cfg.is_internode:  # the whole plan: [T_src, world] slot on each destination, -1 none/dropped
                slots_all = []
                for src, m in enumerate(masks):
                    pos = torch.cumsum(m.long(), 0) - 1 + offsets[src]
                    slots_all.append(torch.where(m & (pos < rows_max), pos, -1))
                fields["extra"] = {"slots_all": tuple(slots_all)}
        else:  # replay: the handle's rows, plan and drops; the new indices travel as data only
            total, recv_src = routing.total_recv, routing.recv_src
            fields = {"total_recv": total, "send_plan": routing.send_plan, "recv_src": recv_src,
                      "dest_order": routing.dest_order, "recv_dropped": routing.recv_dropped}
            if cfg.is_internode:
                if "slots_all" not in routing.extra:
                    raise InputError("dispatch: this routing handle carries no internode plan")
                fields["extra"] = {"slots_all": routing.extra["slots_all"]}
        dropped = fields["recv_dropped"]

        out = torch.zeros(rows_max, x_pad.shape[1], dtype=x_pad.dtype, device=dev)
        out_s = torch.zeros(rows_max, s_pad.shape[1], dtype=s_pad.dtype, device=dev) if s_pad is not None else None
        out_w = torch.zeros(rows_max, k, dtype=torch.float32, device=dev)
        out_i = torch.full((rows_max, k), -1, dtype=torch.int32, device=dev)
        route = self._route(counts)
        self.last_internode_kernel = route
        if route is not None:
            fields["extra"] = {**fields["extra"], "route": route}
            slots_all = fields["extra"]["slots_all"]
            parts = [x_pad[:n], w_pad[:n], i_pad[:n]] + ([s_pad[:n]] if s_pad is not None else [])
            records, widths = _records(parts)
            got = self._internode_move(route, [records], slots_all, records.shape[1], back=False)
            recv = torch.zeros(rows_max, records.shape[1], dtype=torch.uint8, device=dev)
            for src in range(world):
                col = slots_all[src][:, me]
                recv[col[col >= 0]] = got[src]
            targets = [out, out_w, out_i] + ([out_s] if out_s is not None else [])
            for t, part in zip(targets, _unrecord(recv[:total], widths, targets)):
                t[:total] = part
        else:
            all_x, all_w = self._all_gather(x_pad), self._all_gather(w_pad)
            all_s = self._all_gather(s_pad) if s_pad is not None else None
            for src in range(world):
                sel = (recv_src[:, 0] == src).nonzero().squeeze(1)  # this source's rows, in slot order
                tok = recv_src[sel, 1]
                out[sel], out_w[sel], out_i[sel] = all_x[src][tok], all_w[src][tok], all_idx[src][tok]
                if out_s is not None:
                    out_s[sel] = all_s[src][tok]
        self._dropped = torch.tensor(dropped, dtype=torch.int32, device=dev)
        self._routed = moe.routed_pairs(torch.cat(all_idx), cfg.num_experts)[me * epr:(me + 1) * epr]
        if dropped and cfg.strict_capacity:
            raise CapacityError(f"dispatch: rank {me} dropped {dropped} received row(s) past its receive "
                                f"capacity max_recv_tokens={rows_max} (strict_capacity=True)",
                                dropped=dropped, capacity=rows_max)
        total_recv = torch.tensor([total], dtype=torch.int32, device=dev)
        return (out.view(out_dtype), (out_w if weights is not None else None), out_s, out_i, total_recv,
                fields)

    def dropped_count(self) -> torch.Tensor:
        """int32 scalar on the device: rows this rank dropped on receive in the last dispatch."""
        if self._dropped is None:
            raise InputError("dropped_count: no dispatch yet")
        return self._dropped

    def routed_expert_count(self) -> torch.Tensor:
        """int32 [num_experts_per_rank]: the last dispatch's (token, k) pairs of every rank per local expert,
        dropped rows included (every source's ids are gathered here anyway)."""
        return self._routed

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
        w_pad = torch.zeros(rows_max, cfg.num_experts_per_token, dtype=torch.float32, device=dev)
        if weights is not None:
            w_pad[:total] = weights[:total]
        all_s = None
        route = routing.extra.get("route") if cfg.is_internode else None
        self.last_internode_kernel = route
        if route is not None:  # gather combine only (no scales): rows travel back along the route
            slots_all = routing.extra["slots_all"]
            records, widths = _records([p_pad, w_pad])
            got = self._internode_move(route, [records], slots_all, records.shape[1], back=True)
            all_p, all_w = [], []
            for dst in range(cfg.world_size):  # laid out by slot on dst, as the intranode gather has them
                col = slots_all[cfg.rank][:, dst]
                back = torch.zeros_like(records)
                back[col[col >= 0]] = got[dst]
                p_back, w_back = _unrecord(back, widths, [p_pad, w_pad])
                all_p.append(p_back)
                all_w.append(w_back)
        else:
            all_p = self._all_gather(p_pad)
            if scales is not None:
                s_pad = torch.zeros(rows_max, scales.shape[1], dtype=scales.dtype, device=dev)
                s_pad[:total] = scales
                all_s = self._all_gather(s_pad)
            all_w = self._all_gather(w_pad)

        n, world = routing.num_tokens, cfg.world_size
        slot_of = torch.full((n, world), -1, dtype=torch.int64, device=dev)  # [token, rank] -> slot there
        for dst, (tok, slots) in enumerate(routing.send_plan):  # (-1: none, or dropped past dst's cap)
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
                    tok = ((ranks == dst) & (slot_of[:, dst] >= 0)).nonzero().squeeze(1)
                    if tok.numel():
                        add(tok, dst, slot_of[tok, dst])
        return acc.to(cfg.combine_dtype), (acc_w if weights is not None else None)

    # --- buffers / lifecycle ---------------------------------------------------------------------
    def select_slot(self, slot: int) -> None:
        """The operation slot of the next calls (config max_inflight): only combine_in_view has one buffer per
        slot here (every other output is a fresh tensor); the split halves run in order (runtime/pending.py)."""
        self.slot = slot

    def combine_in_view(self) -> torch.Tensor:
        view = self._in_views.get(self.slot)
        if view is None:
            view = self._in_views[self.slot] = torch.zeros(self.config.max_recv_tokens, self.config.hidden_dim,
                                                           dtype=self.config.combine_dtype, device=self.device)
        return view

    def memory_report(self) -> dict:
        """Bytes of what this backend allocates (it keeps no workspace: fresh tensors per call)."""
        cfg = self.config
        R, W, T, H, k = (cfg.max_recv_tokens, cfg.world_size, cfg.max_num_inp_token_per_rank, cfg.hidden_dim,
                         cfg.num_experts_per_token)
        cols = cfg.hidden_dim // 2 if cfg.dispatch_quant_type == "fp4_blockwise" else cfg.dispatch_payload_cols
        wire_row = cols  # bytes: one per element for fp8/fp4 payloads and quantized rows
        if cfg.dispatch_quant_type == "none" and not cfg.prequantized:
            wire_row = cols * cfg.data_type.itemsize
        if cfg.dispatch_quant_type != "none":
            block = cfg.dispatch_quant_block
            scale_row = (H // block) * (4 if cfg.dispatch_quant_type == "fp8_blockwise" else 1)
        else:
            scale_row = cfg.scale_dim * cfg.scale_type_size
        c = cfg.combine_dtype.itemsize
        buffers = {
            "dispatch_out_x": R * wire_row, "dispatch_out_scales": R * scale_row, "dispatch_out_weights": R * k * 4,
            "dispatch_out_indices": R * k * 4, "combine_in_view": R * H * c * len(self._in_views),
            "dispatch_gather_staging": W * T * (wire_row + scale_row + 8 * k),
            "combine_gather_staging": W * R * (H * c + 4 * k),
        }
        if cfg.enable_std_moe:
            C, E = cfg.resolved_expert_capacity, cfg.num_experts_per_rank
            buffers["std_moe_packed_x"] = E * C * H * cfg.data_type.itemsize
            buffers["std_moe_packed_meta"] = E * (4 + C * 8)
        if cfg.enable_grouped_layout:
            P, E = cfg.resolved_grouped_capacity, cfg.num_experts_per_rank
            dq = cfg.grouped_dequantize  # rows decoded into data_type, no scales
            buffers["grouped_x"] = P * (H * cfg.data_type.itemsize if dq else wire_row)
            buffers["grouped_scales"] = 0 if dq else P * scale_row
            buffers["grouped_meta"] = 12 * P + 8 * R * k + 12 * E + 4
        return {"backend": "torch", "buffers": buffers, "total_bytes": sum(buffers.values()),
                "formula": "torch backend, per call (fresh tensors, no persistent workspace): dispatch outputs "
                           "R*(wire_row + scale_row + 8k) + staging W*T*(wire_row + scale_row + 8k); combine "
                           "staging W*R*(H*c + 4k); combine_in_view R*H*c per operation slot once used; std-MoE E_local*C*(H*d + 8) "
                           "+ 4*E_local; grouped layout P*(wire_row + scale_row) + 12P + 8Rk + 12E_local + 4 "
                           "(P = resolved_grouped_capacity; grouped_dequantize: P*H*data_type bytes in place of "
                           "P*(wire_row + scale_row))"}

    def reset(self) -> None:
        """Nothing persists between calls in this backend but the last drop and routed counts."""
        self._dropped = self._routed = None

    def close(self) -> None:
        self._in_views = {}
        self._dropped = self._routed = None
        self.group = None  # a closed op keeps no process group alive (to interpreter exit, say)
