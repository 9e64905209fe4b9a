"""The seed library's EPv2 op and routing handle, on epgen's op (runtime.EpDispatchCombineOp).

The op wraps one epgen op built from ``config.epgen_plan`` and adapts the calls: payload layouts (scale bytes
as extra columns, fp8/fp4 views and codecs), the seed's return shapes (three tensors from
convert_dispatch_output, None from convert_combine_input, int32 dwords of scales), the seed's routing handle,
its backend names and capability names. docs/SEED_COMPAT.md lists every name and what differs.
"""

from __future__ import annotations

import weakref

import torch

from ..errors import ClosedError, ConfigError, InputError
from ..op import EpDispatchCombineOp as EpgenOp
from ..routing import RoutingHandle, send_counts
from . import config as sconfig
from .config import FP4, FP8, EpDispatchCombineConfig

# the seed's capability names, per backend (its flydsl backend: the full set; hip: the gather path)
CAPABILITIES = {
    "flydsl": frozenset({"gather", "scatter", "quant", "std_moe", "scales", "replay", "local_expert_count",
                         "asymmetric_dtype", "recv_cap"}),
    "hip": frozenset({"gather"}),
}
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of each e2m1 code (bit 3: the sign)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _zeros(rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros of any token dtype: 1-byte types (fp8, fp4) are made as bytes and viewed, since some torch builds
    have no CUDA fill for float4_e2m1fn_x2."""
    if dtype.itemsize == 1:
        return torch.zeros(rows, cols, dtype=torch.uint8, device=device).view(dtype)
    return torch.zeros(rows, cols, dtype=dtype, device=device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-byte tensor as uint8 (copies of fp4 tensors are not implemented on every device), else itself."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def decode_fp4(x: torch.Tensor) -> torch.Tensor:
    """float4_e2m1fn_x2 [rows, H/2] (element 2i in the low nibble) -> its exact float32 values [rows, H]."""
    b = x.view(torch.uint8)
    nib = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2).long()
    grid = torch.tensor(_E2M1, dtype=torch.float32, device=x.device)
    mag = grid[nib & 7]
    return torch.where(nib >= 8, -mag, mag)


def encode_fp4(y: torch.Tensor) -> torch.Tensor:
    """float32 [rows, H] -> float4_e2m1fn_x2 [rows, H/2]: nearest e2m1 value, ties to the even code,
    saturating at 6 (NaN -> 6 with its sign)."""
    y = y.float()
    mag = y.abs().nan_to_num(nan=6.0).clamp(max=6.0)
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=y.device)
    code = torch.bucketize(mag, mids)  # a tie (mag on a midpoint) gives the lower code
    tie = (code < len(_E2M1_MIDPOINTS)) & (mag == mids[code.clamp(max=len(_E2M1_MIDPOINTS) - 1)])
    code = torch.where(tie & (code % 2 == 1), code + 1, code).to(torch.uint8)
    nib = code | (torch.signbit(y).to(torch.uint8) << 3)
    packed = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return packed.contiguous().view(FP4)


def decode_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return decode_fp4(x) if dtype == FP4 else x.float()


def encode_rows(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == FP4:
        return encode_fp4(y)
    top = sconfig.fp_max(dtype)
    return y.clamp(-top, top).to(dtype)  # saturating; NaN stays NaN


class EpDispatchRoutingHandle:
    """The seed's routing handle: its five tensors and cur_rank_num_token.

    disp_dest_tok_id_map: int32 [max_num_inp_token_per_rank * k], entry t*k + j = destination rank *
    effective_max_recv + receive slot for the first of token t's k ids naming that rank (world_size *
    effective_max_recv where no row went: a later id of the same rank, an id < 0, a dropped row).
    disp_tok_id_to_src_tok_id_local: int32 [effective_max_recv], receive slot -> source rank *
    max_num_inp_token_per_rank + source token (-1 past total_recv); cloned on first access (after the
    dispatch, as the seed: it reads the op's receive buffer). inter_node_*: empty int32 (the seed's placeholders).
    A handle made by dispatch is accepted by that op without a look at its tensors; one made by
    from_tensors is matched to the dispatch its tensors came from, or rebuilt from them.
    """

    def __init__(self, disp_dest_tok_id_map, inter_node_disp_dest_tok_id_map, inter_node_disp_send_map,
                 total_recv_token_num, disp_tok_id_to_src_tok_id_local=None, cur_rank_num_token=0, *,
                 _dest_map=None, _reverse=None, _epgen=None, _op=None):
        self._dest = disp_dest_tok_id_map
        self._dest_fn = _dest_map
        self.inter_node_disp_dest_tok_id_map = inter_node_disp_dest_tok_id_map
        self.inter_node_disp_send_map = inter_node_disp_send_map
        self.total_recv_token_num = total_recv_token_num
        self.cur_rank_num_token = cur_rank_num_token
        self._reverse_cache = disp_tok_id_to_src_tok_id_local
        self._reverse_fn = _reverse
        self._epgen = _epgen
        self._op = _op

    @property
    def disp_dest_tok_id_map(self) -> torch.Tensor:
        if self._dest is None:
            self._dest = self._dest_fn()
            op = self._op() if self._op is not None else None
            if op is not None:
                op._remember(self._dest, self._epgen)  # from_tensors(handle.tensors()) finds this dispatch again
        return self._dest

    @property
    def disp_tok_id_to_src_tok_id_local(self) -> torch.Tensor:
        if self._reverse_cache is None:
            self._reverse_cache = self._reverse_fn()
        return self._reverse_cache

    def tensors(self):
        return (self.disp_dest_tok_id_map, self.inter_node_disp_dest_tok_id_map, self.inter_node_disp_send_map,
                self.total_recv_token_num, self.disp_tok_id_to_src_tok_id_local)

    @classmethod
    def from_tensors(cls, tensors, cur_rank_num_token=0):
        return cls(*tensors, cur_rank_num_token=cur_rank_num_token)


class EpDispatchCombineOp:
    """The seed's EPv2 op: ``EpDispatchCombineOp(cfg, comm)`` with the seed's calls and semantics.

    cfg: this module's (the seed's) EpDispatchCombineConfig. comm: a ``runtime.seed_compat.cco.Communicator``,
    a torch.distributed ProcessGroup, or None (WORLD). The kernel backend asked for (cfg.kernel_backend, else
    MORI_V2_KERNEL_BACKEND, else "flydsl") is a profile: "flydsl" the seed's full feature set, "hip" its gather
    path (it refuses the rest, as the seed's hip backend); "torch" / "native" pick epgen's backend directly (the
    full set). Either seed name runs on epgen's native backend with a GPU, on its torch backend without one
    (``epgen_backend`` says which; EPGEN_KERNEL_BACKEND overrides).
    """

    def __init__(self, cfg, comm):
        if not isinstance(cfg, EpDispatchCombineConfig):
            raise ConfigError(f"cfg must be runtime.seed_compat.EpDispatchCombineConfig (the seed's config), got "
                              f"{type(cfg).__name__}; epgen's own config goes with runtime.EpDispatchCombineOp")
        from .cco import Communicator

        self._cfg = cfg
        self._name = cfg.requested_backend()
        self._plan = plan = sconfig.epgen_plan(cfg, self._name)
        self._comm = comm if isinstance(comm, Communicator) else None
        group = comm.group if self._comm is not None else comm
        self._core = EpgenOp(plan.config, group, combine_weights="fold", count_routed=True)
        self._closed = False
        self._made: dict[int, tuple] = {}  # id(dest map) -> (weakref to it, epgen handle)
        self._last = None  # the last dispatch's outputs (recv_tokens() ...) and its epgen handle
        self._packed = None  # (packed_x, epgen handle) of the last convert_dispatch_output
        self._staged = None  # (epgen handle, rows) of the last convert_combine_input
        self._view = None  # combine_in_view() when the seed's combine rows are not epgen's
        R, k = cfg.effective_max_recv, cfg.num_experts_per_token
        dev = self._core.device
        self._zeros = {"w": torch.zeros(R, k, dtype=torch.float32, device=dev)}
        self._empty = torch.empty(0, dtype=torch.int32, device=dev)  # the handles' inter-node placeholders
        if plan.extra_cols or plan.combine_codec is not None:
            self._view = _zeros(R, self._cols(cfg.combine_dtype), cfg.combine_dtype, dev)
        else:
            self._core.combine_in_view().zero_()  # the seed zeroes its arena at construction
        if self._comm is not None:
            self._comm._register(self)

    # --- the seed's attributes -----------------------------------------------------------------------
    @property
    def cfg(self) -> EpDispatchCombineConfig:
        return self._cfg

    @property
    def backend_name(self) -> str:
        """The kernel backend asked for ("flydsl", "hip", or epgen's "torch" / "native")."""
        return self._name

    @property
    def epgen_backend(self) -> str:
        """The epgen backend that runs this op ("native" or "torch")."""
        return self._core.backend_name

    @property
    def comm(self):
        return self._comm

    @property
    def dev(self) -> torch.device:
        return self._core.device

    @property
    def capabilities(self) -> frozenset:
        return CAPABILITIES["hip" if self._name == "hip" else "flydsl"]

    @classmethod
    def available_backends(cls) -> list[str]:
        """The seed's backend names that run here (both, on epgen's native backend or its torch one)."""
        return list(sconfig.SEED_BACKENDS)

    def scale_stride_bytes(self) -> int:
        """Bytes between rows of out_scales (the seed's int32 dwords), 0 without scales."""
        return 4 * self._cfg.scale_num_i32

    # --- dispatch / combine ----------------------------------------------------------------------------
    def dispatch(self, input, weights, scales, indices, *, routing=None, return_routing=False):
        """-> (out, out_weights, out_scales, out_indices, total_recv[, routing]), the seed's.

        out [effective_max_recv, hidden] (hidden/2 for fp4) in the dispatch dtype; out_weights float32 (zeros
        when weights is None); out_scales int32 [effective_max_recv, ceil(scale bytes / 4)] or None;
        out_indices int32; total_recv int32 [1] on the device. routing=: replay that handle's layout."""
        self._check_open("dispatch")
        cfg, plan = self._cfg, self._plan
        if routing is not None and return_routing:
            raise InputError("pass either routing= (replay) or return_routing=True, not both")
        if not isinstance(input, torch.Tensor):
            raise InputError(f"dispatch: input must be a torch.Tensor, got {type(input).__name__}")
        n = input.shape[0]
        if n > cfg.max_num_inp_token_per_rank:
            raise InputError(f"{n} tokens exceeds max_num_inp_token_per_rank={cfg.max_num_inp_token_per_rank}")
        ehandle = None
        if routing is not None:
            if self._name == "hip":
                raise NotImplementedError("the hip backend has no routing replay")
            ehandle = self._epgen_handle(routing, "dispatch")
        x = self._dispatch_rows(input, scales)
        sc = self._dispatch_scales(input, scales)
        out, out_w, out_s, out_i, total, eh = self._core.dispatch(x, weights, sc, indices, return_routing=True,
                                                                 routing=ehandle)
        recv_x, recv_s = self._split_received(out, out_s)
        self._last = {"x": recv_x, "w": out_w if out_w is not None else self._zeros["w"], "s": recv_s,
                      "i": out_i, "handle": eh, "total": total}
        self._packed = self._staged = None
        base = (recv_x, self._last["w"], recv_s, out_i, total)
        if not return_routing:
            return base
        ids = indices.clone() if eh.send_plan is not None else None  # the torch backend's map needs the columns
        return base + (self._seed_handle(eh, ids, total, n),)

    def combine(self, input, weights=None, indices=None, *, routing):
        """-> (out [tokens, hidden] combine dtype, out_weights [tokens, k] float32 or None).

        ``weights`` is a request, as in the seed: any non-None value asks for the weight fold, the sum of the
        weights the dispatch forwarded; ``indices`` is unused. After convert_combine_input(routing) (std-MoE)
        combine reduces the rows that call made and ``input`` is not read, as in the seed."""
        self._check_open("combine")
        eh = self._epgen_handle(routing, "combine")
        if self._staged is not None and self._staged[0] is eh:
            rows = self._staged[1]
        else:
            rows = self._combine_rows(input)
        self._staged = None
        out, out_w = self._core.combine(rows, weights, None, routing=eh)
        return self._combined(out), out_w

    def combine_in_view(self) -> torch.Tensor:
        """[effective_max_recv, hidden] combine dtype: write the expert output here and pass it to combine."""
        self._check_open("combine_in_view")
        return self._view if self._view is not None else self._core.combine_in_view()

    # --- the receive buffers -------------------------------------------------------------------------
    def recv_tokens(self) -> torch.Tensor:
        """The last dispatch's out (zeros before the first)."""
        self._check_open("recv_tokens")
        if self._last is None:
            cfg = self._cfg
            return _zeros(cfg.effective_max_recv, self._cols(cfg.dispatch_dtype), cfg.dispatch_dtype, self.dev)
        return self._last["x"]

    def recv_weights(self) -> torch.Tensor:
        self._check_open("recv_weights")
        return self._zeros["w"] if self._last is None else self._last["w"]

    def recv_indices(self) -> torch.Tensor:
        self._check_open("recv_indices")
        if self._last is None:
            cfg = self._cfg
            return torch.full((cfg.effective_max_recv, cfg.num_experts_per_token), -1, dtype=torch.int32,
                              device=self.dev)
        return self._last["i"]

    def recv_scales(self):
        """The last dispatch's out_scales (int32 dwords), None for a config without scales."""
        self._check_open("recv_scales")
        cfg = self._cfg
        if not cfg.scale_bytes:
            return None
        if self._last is None:
            return torch.zeros(cfg.effective_max_recv, cfg.scale_num_i32, dtype=torch.int32, device=self.dev)
        return self._last["s"]

    # --- MoE integration ---------------------------------------------------------------------------------
    def local_expert_count(self) -> torch.Tensor:
        """int32 [num_experts_per_rank]: the last dispatch's routed (token, k) pairs per local expert, as the
        seed counts them: rows dropped past the receive cap included (epgen's routed_expert_count)."""
        self._check_open("local_expert_count")
        if self._name == "hip":
            raise NotImplementedError("local_expert_count is flydsl-only; use backend='flydsl'")
        return self._core.routed_expert_count()

    def convert_dispatch_output(self):
        """-> (packed_x [E, C, hidden], packed_count int32 [E], packed_src int32 [E * C]), the seed's three.

        packed_src holds each packed row's origin as the seed's (source rank * max_num_inp_token_per_rank +
        source token; -1 past the count). The expert writes its output into packed_x in place; then
        convert_combine_input(routing) and combine."""
        self._check_open("convert_dispatch_output")
        if self._name == "hip":
            raise NotImplementedError("StdMoE is flydsl-only; use backend='flydsl'")
        packed_x, count, src, _ = self._core.convert_dispatch_output()
        last = self._last
        k = self._cfg.num_experts_per_token
        origin = self._reverse_map(last["handle"], last["total"])
        seed_src = torch.where(src >= 0, origin[(src // k).clamp(min=0).long()], -1).to(torch.int32)
        self._packed = (packed_x, last["handle"])
        return packed_x, count, seed_src.reshape(-1)

    def convert_combine_input(self, routing) -> None:
        """Weighted sum of each received row's local-expert outputs from packed_x (as the expert left it), kept
        for the next combine(..., routing=routing), which reduces it."""
        self._check_open("convert_combine_input")
        if self._name == "hip":
            raise NotImplementedError("StdMoE is flydsl-only; use backend='flydsl'")
        eh = self._epgen_handle(routing, "convert_combine_input")
        if self._packed is None:
            raise InputError("convert_combine_input: call convert_dispatch_output() after the dispatch first")
        self._staged = (eh, self._core.convert_combine_input(self._packed[0], eh))

    # --- lifecycle ---------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Collective: clear the op's counters and signals (epgen's reset)."""
        self._check_open("reset")
        self._last = self._packed = self._staged = None
        self._core.reset()

    def close(self) -> None:
        """Release the op (idempotent) and untrack it from its communicator."""
        if self._closed:
            return
        self._closed = True
        self._last = self._packed = self._staged = self._view = None
        self._core.close()
        if self._comm is not None:
            self._comm._unregister(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        cfg = self._cfg
        return (f"{type(self).__name__}(backend={self._name}, epgen_backend={self._core.backend_name}, "
                f"rank={cfg.rank}/{cfg.world_size}, hidden={cfg.hidden_dim}, topk={cfg.num_experts_per_token})")

    # --- adaptation --------------------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"{what}: this EpDispatchCombineOp is closed")

    def _cols(self, dtype: torch.dtype) -> int:
        return self._cfg.hidden_dim // 2 if dtype == FP4 else self._cfg.hidden_dim

    def _dispatch_rows(self, x: torch.Tensor, scales) -> torch.Tensor:
        cfg, plan = self._cfg, self._plan
        if x.dtype != cfg.dispatch_dtype:
            raise InputError(f"dispatch: input must be {cfg.dispatch_dtype}, got {x.dtype}")
        if plan.wire_dtype != x.dtype:
            x = x.view(plan.wire_dtype)  # the same e4m3 bytes in the native target's flavour
        if not plan.extra_cols:
            return x
        wide = _zeros(x.shape[0], cfg.hidden_dim + plan.extra_cols, x.dtype, x.device)
        _bytes(wide)[:, :cfg.hidden_dim] = _bytes(x)
        if scales is not None:
            wide[:, cfg.hidden_dim:].view(torch.uint8)[:, :cfg.scale_wire_bytes] = self._scale_bytes(scales, x.shape[0])
        return wide

    def _scale_bytes(self, scales: torch.Tensor, n: int) -> torch.Tensor:
        """The seed's per-token scales (any dtype, scale_bytes or whole int32 dwords per row) as uint8
        [n, 4 * ceil(scale_bytes / 4)]: the dwords the seed's kernels copy (zero bytes past a short row)."""
        cfg = self._cfg
        if not isinstance(scales, torch.Tensor) or scales.shape[:1] != (n,):
            raise InputError(f"dispatch: scales must be a tensor of {n} rows (one per token)")
        raw = scales.contiguous().view(torch.uint8).reshape(n, -1)
        if raw.shape[1] not in (cfg.scale_bytes, cfg.scale_wire_bytes):
            raise InputError(f"dispatch: scales rows have {raw.shape[1]} bytes, the config says scale_dim * "
                             f"scale_type_size = {cfg.scale_bytes} ({cfg.scale_num_i32} int32 dwords)")
        if raw.shape[1] == cfg.scale_wire_bytes:
            return raw
        padded = torch.zeros(n, cfg.scale_wire_bytes, dtype=torch.uint8, device=raw.device)
        padded[:, :raw.shape[1]] = raw
        return padded

    def _dispatch_scales(self, x: torch.Tensor, scales):
        """epgen's scales argument: the seed's bytes for a pre-quantized payload (a zero byte per token when the
        seed config has none), None otherwise (bf16/fp32 rows carry them in extra columns). The seed ignores
        scales passed to a config without scales, and so does this."""
        cfg, plan = self._cfg, self._plan
        if plan.config.dispatch_data_type is None:
            return None
        n = x.shape[0]
        if plan.dummy_scales or scales is None:
            return torch.zeros(n, plan.config.scale_dim, dtype=torch.uint8, device=x.device)
        return self._scale_bytes(scales, n).contiguous()

    def _split_received(self, out: torch.Tensor, out_s):
        cfg, plan = self._cfg, self._plan
        if plan.extra_cols:
            H = cfg.hidden_dim
            raw = out[:, H:].contiguous().view(torch.uint8)[:, :cfg.scale_wire_bytes]
            return out[:, :H].contiguous(), self._as_dwords(raw)
        if plan.wire_dtype != cfg.dispatch_dtype:
            out = out.view(cfg.dispatch_dtype)
        if plan.dummy_scales or not cfg.scale_bytes:
            return out, None
        return out, self._as_dwords(out_s)

    @staticmethod
    def _as_dwords(raw: torch.Tensor) -> torch.Tensor:
        """uint8 [rows, 4 * dwords] -> the seed's int32 [rows, dwords]."""
        return raw.contiguous().view(torch.int32)

    def _combine_rows(self, y) -> torch.Tensor:
        cfg, plan = self._cfg, self._plan
        if not isinstance(y, torch.Tensor):
            raise InputError(f"combine: input must be a torch.Tensor, got {type(y).__name__}")
        if y.dtype != cfg.combine_dtype:
            raise InputError(f"combine: input must be {cfg.combine_dtype}, got {y.dtype}")
        if plan.combine_codec is not None:
            return decode_rows(y, plan.combine_codec).contiguous()
        if plan.extra_cols:
            wide = _zeros(y.shape[0], cfg.hidden_dim + plan.extra_cols, y.dtype, y.device)
            _bytes(wide)[:, :cfg.hidden_dim] = _bytes(y)
            return wide
        return y.contiguous()

    def _combined(self, out: torch.Tensor) -> torch.Tensor:
        plan = self._plan
        if plan.combine_codec is not None:
            return encode_rows(out, plan.combine_codec)
        if plan.extra_cols:
            return out[:, :self._cfg.hidden_dim].contiguous()
        return out

    # --- routing handles -----------------------------------------------------------------------------------
    def _seed_handle(self, eh: RoutingHandle, indices, total, n: int) -> EpDispatchRoutingHandle:
        return EpDispatchRoutingHandle(None, self._empty, self._empty, total, None, n,
                                       _dest_map=lambda: self._dest_map(eh, indices, n),
                                       _reverse=lambda: self._reverse_map(eh, total), _epgen=eh,
                                       _op=weakref.ref(self))

    def _null(self) -> int:
        return self._cfg.world_size * self._cfg.effective_max_recv

    def _dest_map(self, eh: RoutingHandle, indices, n: int) -> torch.Tensor:
        """The seed's forward map (see EpDispatchRoutingHandle) of the dispatch that made ``eh``."""
        cfg = self._cfg
        W, R, k = cfg.world_size, cfg.effective_max_recv, cfg.num_experts_per_token
        flat = torch.full((cfg.max_num_inp_token_per_rank * k,), self._null(), dtype=torch.int32, device=self.dev)
        if n == 0:
            return flat
        if eh.send_plan is not None:  # torch backend: (tokens, slots) per destination rank
            slot_of = torch.full((n, W), -1, dtype=torch.int64, device=self.dev)
            for dst, (tok, slots) in enumerate(eh.send_plan):
                slot_of[tok, dst] = slots
            send, dest, _ = send_counts(indices[:n], W, cfg.num_experts_per_rank, cfg.num_experts_per_rank * W)
            slot = slot_of.gather(1, dest.clamp(min=0))
            entry = torch.where(send & (slot >= 0), dest * R + slot, self._null())
        else:  # native: slots [n, k] = row * W + destination, -1 for none
            s = eh.extra["map"].slots[:n].long()
            entry = torch.where(s >= 0, (s % W) * R + s // W, self._null())
        flat[:n * k] = entry.reshape(-1).to(torch.int32)
        return flat

    def _reverse_map(self, eh: RoutingHandle, total: torch.Tensor) -> torch.Tensor:
        """Receive slot -> source rank * max_num_inp_token_per_rank + token, [effective_max_recv], -1 past total."""
        cfg = self._cfg
        M, R = cfg.max_num_inp_token_per_rank, cfg.effective_max_recv
        if eh.recv_src is not None:  # torch backend: [total, 2] (source rank, token)
            rev = torch.full((R,), -1, dtype=torch.int32, device=self.dev)
            total = eh.recv_src.shape[0]
            rev[:total] = (eh.recv_src[:, 0] * M + eh.recv_src[:, 1]).to(torch.int32)
            return rev
        live = eh.extra.get("recv_src")
        if live is None:
            raise InputError("this routing handle's dispatch kept no receive origins (the reverse map)")
        rows = torch.arange(R, device=self.dev)
        return torch.where(rows < total.long(), live[:R], -1).to(torch.int32)

    def _epgen_handle(self, routing, what: str) -> RoutingHandle:
        """The epgen handle behind a seed handle: the one dispatch made, else the dispatch its tensors came
        from, else one rebuilt from its tensors."""
        if not isinstance(routing, EpDispatchRoutingHandle):
            raise InputError(f"{what}: routing must be an EpDispatchRoutingHandle, got {type(routing).__name__}")
        if routing._epgen is not None:
            return routing._epgen
        dest = routing.disp_dest_tok_id_map
        ref, found = self._made.get(id(dest), (None, None))
        if ref is None or ref() is not dest:
            found = None
        if found is None:
            found = self._rebuild(routing)
        routing._epgen = found
        return found

    def _remember(self, dest: torch.Tensor, eh: RoutingHandle) -> None:
        self._made = {key: (ref, h) for key, (ref, h) in self._made.items() if ref() is not None}
        self._made[id(dest)] = (weakref.ref(dest), eh)

    def _rebuild(self, routing: EpDispatchRoutingHandle) -> RoutingHandle:
        """An epgen handle from the seed handle's tensors alone (from_tensors of tensors this op did not make)."""
        cfg, core = self._cfg, self._core
        W, R, k, M = cfg.world_size, cfg.effective_max_recv, cfg.num_experts_per_token, cfg.max_num_inp_token_per_rank
        n = int(routing.cur_rank_num_token)
        dest = routing.disp_dest_tok_id_map
        if not isinstance(dest, torch.Tensor) or dest.numel() < n * k or not 0 <= n <= M:
            raise InputError(f"routing: disp_dest_tok_id_map must hold cur_rank_num_token * k = {n * k} entries")
        if cfg.is_internode:
            raise InputError("routing: a handle rebuilt from tensors is not supported internode (its plan is not "
                             "in the seed's tensors)")
        flat = dest.to(self.dev).long()[:n * k].view(n, k)
        kept = (flat >= 0) & (flat < self._null())
        dst, slot = flat // R, flat % R
        total = routing.total_recv_token_num.to(self.dev).to(torch.int32).reshape(1)
        common = dict(op_uid=core.uid, config_key=core.config.key, num_tokens=n)
        if core.backend_name != "torch":
            slots = torch.where(kept, slot * W + dst, -1).to(torch.int32)
            from ..backends.native import SlotMap
            return RoutingHandle(**common, extra={"map": SlotMap.of(slots, total), "protocol": "bw"})
        plan = []
        for d in range(W):
            tok, col = ((dst == d) & kept).nonzero(as_tuple=True)
            s = slot[tok, col]
            order = torch.argsort(s)
            plan.append((tok[order], s[order]))
        rank_of = torch.where(kept, dst, W)
        order = torch.full((n, W), -1, dtype=torch.int64, device=self.dev)
        for t in range(n):
            ranks = [int(r) for r in rank_of[t] if int(r) < W]
            order[t, :len(ranks)] = torch.tensor(ranks, dtype=torch.int64)
        rev = routing.disp_tok_id_to_src_tok_id_local.to(self.dev).long()
        count = int(total)
        src = torch.stack((rev[:count] // M, rev[:count] % M), dim=1)
        return RoutingHandle(**common, total_recv=count, send_plan=tuple(plan), recv_src=src, dest_order=order)
