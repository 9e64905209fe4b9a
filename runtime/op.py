"""EpDispatchCombineOp: the public facade. Validates every input, then delegates to a backend.

The backend (runtime/backends/: torch reference, native intranode, native internode) is made by
``backends.make(config, group)``; runtime/backends/__init__.py documents the interface the op calls.

Before the backend is built, every rank's config is compared over the process group
(``check_config_agreement``): a config differing between ranks, or one that does not match the
group's size and this process's rank in it, is a ConfigError on every rank.

Inputs reach the backend already checked (dtype, shape, contiguity, device, token count, handle).

Dispatch inputs and outputs by payload mode (T tokens, R = max_recv_tokens, H = hidden_dim):
  plain           x [T, H] data_type, scales None -> out [R, H] data_type, out_scales None
  pre-quantized   x [T, H] fp8 or [T, H/2] float4_e2m1fn_x2 (dispatch_data_type), scales [T, scale_dim]
                  float32 (scale_type_size 4) or uint8 e8m0 (1), required
                  -> out [R, H or H/2] dispatch_data_type, out_scales [R, scale_dim], both moved verbatim
  fp8_blockwise   x [T, H] data_type, scales None (dispatch_quant_type)
                  -> out [R, H] wire_dtype, out_scales [R, H/128] float32
                     (numerics.quantize_fp8(row, fmt, "fp8_blockwise"), fmt "ocp" or "fnuz" per wire_dtype)
  fp4_blockwise   x [T, H] data_type, scales None
                  -> out [R, H/2] uint8 (low nibble first), out_scales [R, H/32] uint8 e8m0
                     (numerics.quantize_fp4(row))
The dtype and width of out / out_scales are the op properties dispatch_out_dtype, dispatch_out_cols,
dispatch_out_scales_dtype and dispatch_out_scale_cols. Combine always takes expert_out [rows, H]
in the combine dtype (combine_data_type, else data_type) and returns that dtype.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import weakref

import attrs
import torch

from .config import (BUILT_COMBINE_MODES, BUILT_QUANT_TYPES, DISPATCH_QUANT_TYPES, PAYLOAD_DTYPES,
                     EpDispatchCombineConfig, built_torch_dtypes, torch_dtype)
from . import aliases, backends, checks, grouped, kernels, moe
from .agreement import check_config_agreement, check_host_layout
from .plan import NATIVE_WORKSPACE_FORMULA, native_workspace
from .errors import CapacityError, ClosedError, ConfigError, EpgenError, InputError
from .pending import Pending, SlotTable, StreamOrder
from .routing import RoutingHandle

_UIDS = itertools.count(1)
#: every op built in this process by uid, while it is alive: the custom ops of runtime/autograd.py name an op by its
#: uid (an integer argument, a constant of a compiled graph) and find it here
LIVE_OPS: "weakref.WeakValueDictionary[int, EpDispatchCombineOp]" = weakref.WeakValueDictionary()


class EpDispatchCombineOp:
    """Expert-parallel dispatch/combine over one process group (see the module docstring)."""

    def __init__(self, config: EpDispatchCombineConfig, group=None, *, combine_weights: str = "values",
                 count_routed: bool = False):
        """combine_weights: what combine's ``weights`` means. "values" (epgen): the rows passed are summed per
        token like the expert output. "fold" (the seed library's; runtime.seed_compat's op uses it): any non-None
        ``weights`` asks for the sum of the last dispatch's forwarded weights; the values passed, and
        ``indices``, are unused. count_routed: keep routed_expert_count() under a receive cap on a backend
        that does not gather every rank's ids (the native ones): one more small all-gather per dispatch."""
        if not isinstance(config, EpDispatchCombineConfig):
            raise ConfigError(f"config must be an EpDispatchCombineConfig, got {type(config).__name__}")
        aliases.check_op_args(group, combine_weights)
        if not isinstance(count_routed, bool):
            raise ConfigError(f"count_routed must be a bool, got {aliases.type_name(count_routed)}")
        self._combine_weights = combine_weights
        self._count_routed = count_routed
        steady = steady_path_enabled()  # before anything is allocated: a bad value raises here
        check_config_agreement(config, group)  # collective; before anything is allocated
        check_host_layout(config, group)  # collective
        self.config = config
        self._config_key = config.key  # (what every handle carries and every call checks: no property per call)
        self.uid = next(_UIDS)
        self._closed = False
        self._seq = 0  # dispatches that moved data (returned, or raised CapacityError)
        self._last: dict | None = None  # the last returned dispatch's outputs (MoE integration)
        self._packed: dict | None = None  # the last std-MoE conversion of that dispatch
        # per workspace slot (config max_inflight; runtime/pending.py): the last received dispatch's outputs, its
        # grouped layout, grouped_out_view's buffer, the views handed out
        self._by_slot: dict[int, dict] = {}
        self._grouped_by: dict[int, grouped.GroupedLayout] = {}
        self._grouped_out: dict[int, torch.Tensor] = {}
        self._views: dict[int, set[int]] = {}
        self._slots = SlotTable(config.max_inflight)
        self._slot_streams: dict[int, int] = {}  # the stream (driver handle) of each slot's last half (_follow)
        self._generation = 0  # reset() and close() make pending handles void
        self._grad_op: EpDispatchCombineOp | None = None  # runtime/autograd.py: a quantized op's gradients move here
        self._backend = backends.make(config, group)
        self._steady = self._steady_signature() if steady else None
        LIVE_OPS[self.uid] = self

    # --- properties ----------------------------------------------------------------------------
    @property
    def cfg(self) -> EpDispatchCombineConfig:
        """The config (the seed library's name for it)."""
        return self.config

    @property
    def backend_name(self) -> str:
        return self._backend.name

    @property
    def combine_weights(self) -> str:
        """"values" or "fold": what combine's weights argument means (see __init__)."""
        return self._combine_weights

    @classmethod
    def available_backends(cls) -> list[str]:
        """Kernel backends that can run on this machine ("native" needs a GPU and its vendor bindings)."""
        return backends.available()

    def scale_stride_bytes(self) -> int:
        """Bytes between consecutive rows of dispatch's out_scales, 0 when dispatch returns no scales
        (epgen's out_scales rows are contiguous: columns x bytes per scale)."""
        self._check_open("scale_stride_bytes")
        dtype = self.dispatch_out_scales_dtype
        return 0 if dtype is None else self.dispatch_out_scale_cols * dtype.itemsize

    @property
    def device(self) -> torch.device:
        return self._backend.device

    @property
    def last_internode_kernel(self) -> str | None:
        """The internode route ("v2" or "v2_ll") the last dispatch or combine took; None intranode or
        before the first call. With internode_kernel="auto" it tells which one the call's token count picked."""
        return getattr(self._backend, "last_internode_kernel", None)

    @property
    def last_intranode_protocol(self) -> str | None:
        """The intranode wire protocol ("ll" low latency or "bw" bandwidth) the last dispatch or combine of
        the native intranode backend took (one per op: "auto" decides by the config's token bound); None
        on other backends or before the first call."""
        return getattr(self._backend, "last_protocol", None)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def capabilities(self) -> dict:
        caps = {
            "backend": self._backend.name,
            "device": str(self._backend.device),
            "dtypes": built_torch_dtypes(),
            "payload_dtypes": tuple(torch_dtype(n) for n in PAYLOAD_DTYPES),
            "combine_modes": BUILT_COMBINE_MODES,
            "quant_types": BUILT_QUANT_TYPES,
            "dispatch_quant_types": DISPATCH_QUANT_TYPES,
            "graph_capture": False,
            "routing_replay": False,
            "internode": False,
            "max_recv_tokens": self.config.max_recv_tokens,
            "std_moe": self.config.enable_std_moe,
            "split_phase": True,  # dispatch_send / combine_send ... -> Pending.receive() (runtime/pending.py)
            "max_inflight": self.config.max_inflight,
        }
        caps.update(self._backend.capabilities)
        return caps

    @property
    def wire_dtype(self) -> torch.dtype:
        """The FP8 e4m3 dtype of in-kernel fp8 quantization on this backend (float8_e4m3fn by default)."""
        return getattr(self._backend, "wire_dtype", torch.float8_e4m3fn)

    @property
    def dispatch_out_dtype(self) -> torch.dtype:
        """dtype of dispatch's out (see the module docstring); the backend's own answer when it has one."""
        own = getattr(self._backend, "dispatch_out_dtype", None)
        if own is not None:
            return own
        cfg = self.config
        if cfg.dispatch_quant_type == "fp8_blockwise":
            return self.wire_dtype
        if cfg.dispatch_quant_type == "fp4_blockwise":
            return torch.uint8
        return cfg.dispatch_dtype

    @property
    def dispatch_out_cols(self) -> int:
        """Columns of dispatch's out: hidden_dim, or hidden_dim // 2 for fp4 (two values per byte)."""
        cfg = self.config
        return cfg.hidden_dim // 2 if cfg.dispatch_quant_type == "fp4_blockwise" else cfg.dispatch_payload_cols

    @property
    def dispatch_out_scales_dtype(self) -> torch.dtype | None:
        """dtype of dispatch's out_scales, None when dispatch returns no scales."""
        cfg = self.config
        return {"fp8_blockwise": torch.float32, "fp4_blockwise": torch.uint8}.get(cfg.dispatch_quant_type,
                                                                                  cfg.dispatch_scales_dtype)

    @property
    def dispatch_out_scale_cols(self) -> int:
        """Columns of dispatch's out_scales (0 when dispatch returns no scales)."""
        cfg = self.config
        if cfg.dispatch_quant_type != "none":
            return cfg.hidden_dim // cfg.dispatch_quant_block
        return cfg.scale_dim

    # --- public API ----------------------------------------------------------------------------
    def dispatch(self, x=None, weights=None, scales=None, indices=None, return_routing: bool = False, routing=None, *,
                 input=None, _layout: bool = False, _layout_out=None, _replay_of=None):
        """-> (out, out_weights, out_scales, out_indices, total_recv[, routing handle]). ``input``: the seed's
        name for x. _replay_of (runtime/autograd.py's backward replays): a handle of this op whose routing the
        caller replays with tensors it made itself to this op's shapes (x [num_tokens, cols] of dispatch_dtype,
        contiguous; indices the forward's, weights and scales None): their checks are skipped."""
        if self._steady is not None and routing is None and scales is None and input is None and not _layout and \
                _replay_of is None:
            done = self._steady_dispatch(x, weights, indices, return_routing)
            if done is not None:
                return done
        self._check_open("dispatch")
        if _replay_of is not None:
            num_tokens, return_routing, slot = self._replay_begin(_replay_of)
            routing = _replay_of
            if self._steady is not None and self._backend.steady_ready(routing):  # the backward's replay: no checks
                *outs, fields = self._backend.steady_dispatch(x, None, indices, num_tokens, None, None, False, routing)
                return self._dispatch_end(slot, outs, fields, num_tokens, return_routing, None, routing)
        else:
            x = aliases.renamed("dispatch", "x", x, "input", input)
            num_tokens, return_routing, slot = self._dispatch_begin("dispatch", x, weights, scales, indices,
                                                                    return_routing, routing, one_call=True)
        routed = self._routed_across(indices)  # before the backend, which may raise on some ranks only
        try:
            *outs, fields = self._backend.dispatch(x, weights, scales, indices, routing,
                                                   **({"layout": True, "layout_out": _layout_out} if _layout else {}))
        except CapacityError:
            self._seq += 1  # the data moved; dropped_count() reports it
            raise
        return self._dispatch_end(slot, outs, fields, num_tokens, return_routing, routed, routing)

    def combine(self, expert_out=None, weights=None, indices=None, routing=None, *, input=None):
        """-> (combined [num_tokens, hidden_dim], combined_weights [num_tokens, k] or None). ``input``: the seed's
        name for expert_out; ``weights``: see combine_weights in __init__."""
        if self._steady is not None and input is None:
            done = self._steady_combine(expert_out, weights, indices, routing)
            if done is not None:
                return done
        self._check_open("combine")
        expert_out, weights, indices, slot = self._combine_begin("combine", expert_out, weights, indices, routing,
                                                                 input)
        try:
            return self._backend.combine(expert_out, weights, indices, routing)
        finally:
            self._slots.combined(slot)

    # --- split phase: send halves -> Pending; Pending.receive() completes the leg (runtime/pending.py) -------
    def dispatch_send(self, x=None, weights=None, scales=None, indices=None, return_routing: bool = False,
                      routing=None, *, input=None, stream=None, previous_event=None) -> Pending:
        """The send half of dispatch (same arguments): queues the sending work and returns a Pending whose
        receive() returns what dispatch returns. The native backend's send launch moves the rows and returns
        (nothing of epgen stays on the GPU until receive()); the torch backend runs the whole leg here. stream /
        previous_event: see runtime/pending.py (stream ordering). Takes a free workspace slot (max_inflight)."""
        self._check_open("dispatch_send")
        x = aliases.renamed("dispatch_send", "x", x, "input", input)
        return self._dispatch_split("dispatch", x, weights, scales, indices, return_routing, routing, stream,
                                    previous_event)

    def combine_send(self, expert_out=None, weights=None, indices=None, routing=None, *, input=None, stream=None,
                     previous_event=None) -> Pending:
        """The send half of combine (same arguments): -> a Pending whose receive() returns what combine returns.
        The native low-latency combine pushes its rows here; the gather combine stages them (its peers read them
        in their receive half); a scatter combine is deferred (Pending.deferred: the receive half runs it)."""
        self._check_open("combine_send")
        expert_out, weights, indices, slot = self._combine_begin("combine_send", expert_out, weights, indices,
                                                                 routing, input)
        order = StreamOrder("combine_send", self.device, stream, previous_event, (expert_out, weights, indices))

        def halves():
            return self._combine_halves(expert_out, weights, indices, routing)
        return self._send("combine", slot, order, halves)

    def dispatch_grouped_send(self, x, weights=None, scales=None, indices=None, routing=None, *, stream=None,
                              previous_event=None) -> Pending:
        """The send half of dispatch_grouped: -> a Pending whose receive() returns (GroupedLayout, routing handle)
        (the receive half also builds the grouped layout)."""
        self._check_open("dispatch_grouped_send")
        self._need_grouped("dispatch_grouped_send")
        return self._dispatch_split("dispatch_grouped", x, weights, scales, indices, True, routing, stream,
                                    previous_event)

    def combine_grouped_send(self, expert_out, routing, apply_weights: bool = True, *, stream=None,
                             previous_event=None) -> Pending:
        """The send half of combine_grouped: the reduce pass into the combine input, then combine_send's work;
        -> a Pending whose receive() returns what combine_grouped returns."""
        self._check_open("combine_grouped_send")
        layout, slot = self._combine_grouped_begin("combine_grouped_send", expert_out, routing, apply_weights)
        order = StreamOrder("combine_grouped_send", self.device, stream, previous_event, (expert_out,))

        def halves():
            rows = self._grouped_rows(expert_out, layout, slot, apply_weights)
            return self._combine_halves(rows, None, None, routing)
        return self._send("combine_grouped", slot, order, halves)

    def _dispatch_split(self, kind, x, weights, scales, indices, return_routing, routing, stream, previous_event):
        what = f"{kind}_send"
        order = StreamOrder(what, self.device, stream, previous_event, (x, weights, scales, indices))
        num_tokens, return_routing, slot = self._dispatch_begin(what, x, weights, scales, indices, return_routing,
                                                                routing, one_call=False)

        def halves():
            routed = self._routed_across(indices)
            send = getattr(self._backend, "dispatch_send", None)
            if send is not None:
                call = send(x, weights, scales, indices, routing)
                recv = lambda: self._backend.dispatch_receive(call)  # noqa: E731
            else:  # the backend's halves in order: the whole leg now
                recv = _ran(lambda: self._backend.dispatch(x, weights, scales, indices, routing))

            def finish():
                try:
                    *outs, fields = recv()
                except CapacityError:
                    self._seq += 1  # the data moved; dropped_count() reports it
                    raise
                res = self._dispatch_end(slot, outs, fields, num_tokens, return_routing, routed, routing)
                if kind == "dispatch_grouped":
                    return self._grouped_layout_of(self._by_slot[slot]), res[-1]
                return res
            return finish, False
        return self._send(kind, slot, order, halves)

    def _combine_halves(self, expert_out, weights, indices, routing):
        """(finish, deferred) of a combine whose send half runs now (the backend's combine_send, else its whole
        combine)."""
        slot = routing.slot
        send = getattr(self._backend, "combine_send", None)
        if send is not None:
            call = send(expert_out, weights, indices, routing)
            return self._combined_after(slot, lambda: self._backend.combine_receive(call)), call["deferred"]
        return self._combined_after(slot, _ran(lambda: self._backend.combine(expert_out, weights, indices,
                                                                             routing))), False

    def _combined_after(self, slot: int, recv):
        def finish():
            try:
                return recv()
            finally:
                self._slots.combined(slot)
        return finish

    def _send(self, kind: str, slot: int, order: StreamOrder, halves) -> Pending:
        with order:
            self._select(slot)
            self._follow(slot)
            finish, deferred = halves()
        pending = self._slots.pending[slot] = Pending(self, kind, slot, finish, order, deferred)
        return pending

    def _receive(self, pending: Pending):
        """Pending.receive(): the receive half, once, on the leg's stream; its outputs recorded on the caller's."""
        what = f"{pending.kind} receive"
        self._check_open(what)
        if pending.done:
            raise InputError(f"{what}: this pending {pending.kind} (slot {pending.slot}) was received already: "
                             f"each send half is received once")
        if pending._generation != self._generation:
            raise InputError(f"{what}: the op was reset after this {pending.kind} was sent: its work is void, "
                             f"send it again")
        pending.done = True
        self._slots.pending[pending.slot] = None
        with pending._order:
            self._select(pending.slot)
            self._follow(pending.slot)
            result = pending._finish()
        pending.event = pending._order.outputs(result)
        return result

    def _dispatch_begin(self, what, x, weights, scales, indices, return_routing, routing, one_call):
        """Checks of a dispatch, then its slot (selected; what it held before is forgotten):
        -> (num_tokens, return_routing, slot)."""
        cfg = self.config
        num_tokens = checks.dispatch_inputs(cfg, self.device, x, weights, scales, indices)
        return_routing = aliases.as_bool(return_routing)  # numpy's bools too
        if not isinstance(return_routing, bool):
            raise InputError(f"{what}: return_routing must be a bool, got {aliases.type_name(return_routing)}")
        if routing is not None:
            self._check_handle(what, routing)
            if routing.num_tokens != num_tokens:
                raise InputError(f"{what}: routing replay needs the same token count: the handle has "
                                 f"{routing.num_tokens} tokens, x has {num_tokens}")
        slot = self._slots.for_dispatch(what, one_call)
        self._forget(slot)  # the slot's buffers are about to change
        self._select(slot)
        if one_call:
            self._follow(slot)
        return num_tokens, return_routing, slot

    def _replay_begin(self, routing):
        """_dispatch_begin of an internal replay (dispatch's _replay_of): the slot work alone."""
        slot = self._slots.for_dispatch("dispatch", True)
        self._forget(slot)
        self._select(slot)
        self._follow(slot)
        return routing.num_tokens, False, slot

    def _dispatch_end(self, slot, outs, fields, num_tokens, return_routing, routed, routing):
        self._seq += 1
        out, out_w, out_s, out_i, total = outs
        self._last = self._by_slot[slot] = {"seq": self._seq, "slot": slot, "out": out, "out_w": out_w,
                                            "out_s": out_s, "out_i": out_i, "total": total, "routed": routed}
        route = routing.route if routing is not None else self._seq  # a replay places rows by its handle's routing
        self._slots.dispatched(slot, route, held=return_routing)  # without a handle nothing can combine its rows
        if not return_routing:
            return tuple(outs)
        handle = RoutingHandle(op_uid=self.uid, config_key=self._config_key, num_tokens=num_tokens, seq=self._seq,
                               slot=slot, route=route, **fields)
        return (*outs, handle)

    def _combine_begin(self, what, expert_out, weights, indices, routing, input):
        """Checks of a combine, then its slot (the handle's; selected): -> (expert_out, weights, indices, slot)."""
        expert_out = aliases.renamed(what, "expert_out", expert_out, "input", input)
        if self._combine_weights == "fold":  # the seed's combine: indices taken for parity only, unused
            indices = None
            if weights is not None:
                weights = aliases.forwarded_weights(self._need_dispatch(f"{what} (weight fold)"))
        cfg = self.config
        if routing is None:
            raise InputError(f"{what}: routing is required: pass the RoutingHandle from "
                             "dispatch(..., return_routing=True) of this op")
        if isinstance(routing, Pending):
            raise InputError(f"{what}: routing is a Pending {routing.kind}: pass the RoutingHandle its receive() "
                             f"returned")
        self._check_handle(what, routing)
        checks.combine_inputs(cfg, self.device, expert_out, weights, indices)
        slot = self._slots.for_combine(what, routing)
        self._check_view_slot(what, expert_out, slot)
        self._select(slot)
        if what == "combine":  # one-call; a split combine follows in its send half, on its own stream
            self._follow(slot)
        return expert_out, weights, indices, slot

    def _check_view_slot(self, what: str, t: torch.Tensor, slot: int) -> None:
        """Expert rows written into another slot's combine_in_view / grouped_out_view are the wrong rows."""
        ptr = t.data_ptr()
        for other, ptrs in self._views.items():
            if other != slot and ptr in ptrs:
                raise InputError(f"{what}: the expert rows lie in the view of workspace slot {other}, but the routing "
                                 f"handle is slot {slot}'s: write them into combine_in_view(handle) / "
                                 f"grouped_out_view(handle) of the handle they are combined with")

    def _follow(self, slot: int) -> int | None:
        """Order this half after the slot's last half when they run on different streams (a slot's kernels rely on
        their order: each leg's buffers are free once the one before it ran). Inside graph capture the caller's
        fork / join orders the streams. -> the current stream (the driver's handle; None off a GPU)."""
        dev = self._backend.device
        if dev.type != "cuda":
            return None
        # the driver's stream handles: a Stream object per call costs microseconds of every eager leg
        now = kernels.current_raw_stream(dev.index)
        last = self._slot_streams.get(slot)
        if last is not None and last != now and not torch.cuda.is_current_stream_capturing():
            torch.cuda.ExternalStream(now, device=dev).wait_stream(torch.cuda.ExternalStream(last, device=dev))
        self._slot_streams[slot] = now
        return now

    def _select(self, slot: int) -> None:
        select = getattr(self._backend, "select_slot", None)
        if select is not None:
            select(slot)

    def _forget(self, slot: int) -> None:
        """What the op kept of the dispatch that slot `slot` held."""
        if self._last is not None and self._last["slot"] == slot:
            self._last = None
        if self._packed is not None and self._packed["slot"] == slot:
            self._packed = None
        self._by_slot.pop(slot, None)
        self._grouped_by.pop(slot, None)

    def _slot_of(self, routing) -> int:
        """The slot of a view's routing handle (default: the last dispatch's slot, else 0)."""
        if routing is not None:
            self._check_handle("view", routing)
            if not 0 <= routing.slot < self.config.max_inflight:
                raise InputError(f"view: routing handle names slot {routing.slot}, this op has "
                                 f"{self.config.max_inflight}")
            return routing.slot
        return self._last["slot"] if self._last is not None else 0

    def _select_last(self) -> None:
        if self._last is not None:
            self._select(self._last["slot"])

    def combine_in_view(self, routing=None) -> torch.Tensor:
        """A [max_recv_tokens, hidden_dim] tensor the expert may write its output into directly (combine then
        reads it in place, no staging copy). Write it between a dispatch and the combine that follows: after a
        combine the peers may still be reading it until this rank's next dispatch. To combine again without
        a dispatch, pass the new expert output in a tensor of its own (combine stages it safely). routing: the
        handle of the dispatch it answers (each operation in flight has its own view; default: the last
        dispatch's)."""
        self._check_open("combine_in_view")
        slot = self._slot_of(routing)
        self._select(slot)
        view = self._backend.combine_in_view()
        self._views.setdefault(slot, set()).add(view.data_ptr())
        return view

    # --- MoE integration -------------------------------------------------------------------------
    def dropped_count(self) -> torch.Tensor:
        """int32 scalar tensor on the device: rows this rank dropped on receive (past max_recv_tokens) in
        the last dispatch, the last ones in (source rank, token) order. No host sync: after CUDA graph
        replays (where strict_capacity cannot raise) read it here."""
        self._check_open("dropped_count")
        self._select_last()
        if not self._seq:
            raise InputError("dropped_count: no dispatch yet")
        own = getattr(self._backend, "dropped_count", None)
        if own is None:
            raise EpgenError(f"dropped_count: the {self._backend.name} backend does not report receive drops")
        return own()

    def local_expert_count(self) -> torch.Tensor:
        """int32 [num_experts_per_rank] on the device: after the last dispatch, the (received row, column)
        pairs whose expert id is local (id // num_experts_per_rank == rank), per local expert; every
        column counts (a token naming a local expert twice counts twice). Rows dropped past the receive cap
        are not counted (the pairs the experts get: routed_expert_count() counts them too). No host sync."""
        self._check_open("local_expert_count")
        self._select_last()
        last = self._need_dispatch("local_expert_count")
        own = getattr(self._backend, "local_expert_count", None)
        if own is not None:
            return own()
        cfg = self.config
        return moe.local_expert_count(last["out_i"], last["total"], cfg.rank, cfg.num_experts_per_rank)

    def routed_expert_count(self) -> torch.Tensor:
        """int32 [num_experts_per_rank] on the device: after the last dispatch, the (token, column) pairs that
        every rank routed to each local expert, rows dropped past the receive cap included (the seed library's
        local_expert_count). Equals local_expert_count() when nothing was dropped. No host sync. A native
        backend under a receive cap needs the op built with count_routed=True."""
        self._check_open("routed_expert_count")
        self._select_last()
        last = self._need_dispatch("routed_expert_count")
        own = getattr(self._backend, "routed_expert_count", None)
        if own is not None:
            return own()
        if last["routed"] is not None:
            return last["routed"]
        if not self._capped:  # nothing can be dropped: every routed pair was received
            return self.local_expert_count()
        raise InputError("routed_expert_count: under a receive cap (max_total_recv_tokens below the worst case) "
                         f"the {self._backend.name} backend counts routed pairs only for an op built with "
                         "count_routed=True")

    @property
    def _capped(self) -> bool:
        cfg = self.config
        return cfg.max_recv_tokens < cfg.world_size * cfg.max_num_inp_token_per_rank

    def _routed_across(self, indices: torch.Tensor) -> torch.Tensor | None:
        """routed_expert_count of this dispatch where the backend keeps none and the op was asked to (under a
        cap): every rank's pairs per expert (moe.routed_pairs) in one all-gather on the backend's group, this
        rank's slice summed on the device. None where not needed."""
        if not (self._count_routed and self._capped) or getattr(self._backend, "routed_expert_count", None):
            return None
        from .workspace import all_gather_single

        cfg = self.config
        mine = moe.routed_pairs(indices, cfg.num_experts)
        group = getattr(self._backend, "group", None)
        if group is not None and cfg.world_size > 1:
            every = torch.empty(cfg.world_size * cfg.num_experts, dtype=mine.dtype, device=mine.device)
            all_gather_single(every, mine, group)
            mine = every.view(cfg.world_size, cfg.num_experts).sum(0, dtype=torch.int32)
        epr = cfg.num_experts_per_rank
        return mine[cfg.rank * epr:(cfg.rank + 1) * epr]

    def convert_dispatch_output(self):
        """Standard-MoE layout of the last dispatch (needs enable_std_moe=True; bf16/fp32 payloads).

        -> (packed_x [E, C, H] dispatch out dtype, packed_count int32 [E], packed_src int32 [E, C],
        packed_weights float32 [E, C]); E = num_experts_per_rank, C = config.resolved_expert_capacity.
        Each local (received row i, column j) pair (see local_expert_count) goes to its expert's next
        slot, in ascending i then j; packed_src = i * k + j (-1 past the count), packed_weights =
        out_weights[i, j] (1.0 when dispatch had no weights; 0 past the count), packed_x = row i
        (unspecified past the count: the torch backend writes zeros, the native one leaves them as
        they are), packed_count = min(pairs, C). Pairs past C are dropped and counted
        (std_moe_dropped); the default C = max_recv_tokens drops nothing unless rows name a local
        expert more than once (an expert may get up to max_recv_tokens * k pairs). Tensors may be the
        op's buffers: valid until the next conversion.
        """
        self._check_open("convert_dispatch_output")
        self._select_last()
        self._need_std_moe("convert_dispatch_output")
        last = self._need_dispatch("convert_dispatch_output")
        own = getattr(self._backend, "convert_dispatch_output", None)
        cfg = self.config
        if own is not None:
            packed_x, count, src, w = own()
            dropped = None
        else:
            packed_x, count, src, w, dropped = moe.pack(last["out"], last["out_w"], last["out_i"], last["total"],
                                                        cfg.rank, cfg.num_experts_per_rank,
                                                        cfg.resolved_expert_capacity)
        self._packed = {"seq": last["seq"], "slot": last["slot"], "src": src, "w": w, "dropped": dropped}
        return packed_x, count, src, w

    def std_moe_dropped(self) -> torch.Tensor:
        """int32 scalar tensor on the device: pairs the last convert_dispatch_output dropped past capacity."""
        self._check_open("std_moe_dropped")
        self._need_std_moe("std_moe_dropped")
        packed = self._need_packed("std_moe_dropped")
        self._select(packed["slot"])  # the slot of the converted dispatch
        own = getattr(self._backend, "std_moe_dropped", None)
        return own() if own is not None else packed["dropped"]

    def convert_combine_input(self, expert_out, routing) -> torch.Tensor:
        """Expert outputs in the standard-MoE layout -> combine input [max_recv_tokens, hidden_dim].

        expert_out: [num_experts_per_rank, resolved_expert_capacity, hidden_dim], combine dtype, slot for
        slot with the last convert_dispatch_output; routing: the handle of that dispatch. Row i of the
        result = 0.0 (float32) + packed_weights[e, p] * expert_out[e, p] (float32 product, then added) for
        each packed pair (e, p) with packed_src[e, p] = i * k + j, in ascending j; one rounding to the
        combine dtype; rows without a pair are 0. combine(result, routing=routing) then gives
        sum_j w_j * expert_j(x) per token (weights are applied here, once).
        """
        self._check_open("convert_combine_input")
        self._need_std_moe("convert_combine_input")
        self._check_handle("convert_combine_input", routing)
        packed = self._need_packed("convert_combine_input")
        self._select(packed["slot"])  # the slot of the converted dispatch
        if routing.seq != packed["seq"]:
            raise InputError("convert_combine_input: routing handle is not from the dispatch that "
                             "convert_dispatch_output converted last")
        cfg = self.config
        shape = (cfg.num_experts_per_rank, cfg.resolved_expert_capacity, cfg.hidden_dim)
        self._check_tensor("convert_combine_input", "expert_out", expert_out, cfg.combine_dtype, shape=shape)
        own = getattr(self._backend, "convert_combine_input", None)
        if own is not None:
            return own(expert_out, routing)
        return moe.unpack(expert_out, packed["src"], packed["w"], cfg.max_recv_tokens, cfg.num_experts_per_token,
                          cfg.combine_dtype)

    # --- the grouped-GEMM layout (runtime/grouped.py) ---------------------------------------------
    def grouped_layout(self) -> grouped.GroupedLayout:
        """The last dispatch's local (received row, column) pairs as rows grouped per local expert, each group
        padded to a multiple of expert_alignment rows (needs enable_grouped_layout=True; every payload: fp8/fp4
        rows keep their bytes and carry their scales in the same order).

        -> GroupedLayout: x [P, cols], scales [P, scale cols] or None, offs int32 [E] (group ends:
        ``torch._grouped_mm(layout.x, w, offs=layout.offs)``), counts int32 [E] (kept pairs per group), src int32
        [P] (pair id row * k + j, -1 padding), m_indices int32 [P] (local expert, -1 padding: DeepGEMM's
        m-grouped contiguous layout), weights float32 [P], dropped int32 scalar (pairs past P =
        config.resolved_grouped_capacity). Sized by the real pairs on the device: no host sync,
        graph-capturable. Tensors may be the op's buffers: valid until the next grouped_layout().
        """
        self._check_open("grouped_layout")
        self._need_grouped("grouped_layout")
        return self._grouped_layout_of(self._need_dispatch("grouped_layout"))

    def _grouped_layout_of(self, last: dict, fresh: bool = False, out=None) -> grouped.GroupedLayout:
        """The grouped layout of the received dispatch `last` (its slot selected and its layout kept); fresh, out
        (the backend's fresh_grouped() tensors, or out_x alone): see dispatch_grouped."""
        self._select(last["slot"])
        own = getattr(self._backend, "grouped_layout", None)
        cfg = self.config
        if own is not None:
            layout = own(seq=last["seq"], out=out)
        else:  # the reference: every tensor made here, so a fresh layout only gathers its int32 ones in one block
            layout = grouped.group(last["out"], last["out_s"], last["out_w"], last["out_i"], last["total"], cfg.rank,
                                   cfg.num_experts_per_rank, cfg.expert_alignment, cfg.resolved_grouped_capacity)
            if cfg.grouped_dequantize:
                layout = grouped.dequantized(layout, cfg.dispatch_quant_type, cfg.data_type)
            changes = {"seq": last["seq"]}
            if fresh:
                block = torch.cat((layout.offs, layout.counts, layout.src, layout.m_indices, layout.dropped.view(1),
                                   layout.pair_pos))
                offs, counts, src, m_idx, dropped, pair_pos = grouped.block_parts(block, cfg.num_experts_per_rank,
                                                                                  cfg.resolved_grouped_capacity)
                changes.update(offs=offs, counts=counts, src=src, m_indices=m_idx, dropped=dropped.view(()),
                               pair_pos=pair_pos, block=block)
                if out is not None:  # out_x: the rows (fresh here, padding zeroed) copied into the caller's
                    changes["x"] = out["x"].copy_(layout.x)
            layout = dataclasses.replace(layout, **changes)
        self._grouped_by[last["slot"]] = layout
        return layout

    def dispatch_grouped(self, x, weights=None, scales=None, indices=None, routing=None, *, out_x=None,
                         fresh: bool = False):
        """dispatch(x, weights, scales, indices, return_routing=True, routing=routing), then grouped_layout():
        -> (GroupedLayout, routing handle). The grouped GEMMs run on the layout; combine_grouped(expert_out,
        handle) brings their rows back.

        fresh=True: every tensor of the layout is the call's own, not the op's buffers (x, scales, weights, and one
        int32 block, layout.block, that offs, counts, src, m_indices, dropped and the pair map are views of), valid
        past the next dispatch: runtime/autograd.py gives every forward its own this way. Every row without a
        pair is zeroed (a grouped GEMM over the padding sees zeros) and every entry written (on the native backend
        by the placing kernel itself: no copies). out_x: a contiguous tensor of the layout's x shape and dtype
        (grouped_x_spec()) for the rows; it implies fresh=True."""
        if self._steady is not None and self._steady.grouped_shape is not None and routing is None and \
                scales is None and (fresh is False or fresh is True):
            done = self._steady_dispatch_grouped(x, weights, indices, fresh or out_x is not None, out_x)
            if done is not None:
                return done
        self._check_open("dispatch_grouped")
        self._need_grouped("dispatch_grouped")
        if out_x is not None:
            shape, dtype = self.grouped_x_spec()
            self._check_tensor("dispatch_grouped", "out_x", out_x, dtype, shape=shape)
            fresh = True
        elif not isinstance(fresh, bool):
            raise InputError(f"dispatch_grouped: fresh must be a bool, got {type(fresh).__name__}")
        make = getattr(self._backend, "fresh_grouped", None) if fresh else None
        out = make(out_x) if make is not None else ({"x": out_x} if out_x is not None else None)
        place = getattr(self._backend, "fuses_layout", False)  # the dispatch kernel may place the layout itself
        *_, handle = self.dispatch(x, weights, scales, indices, return_routing=True, routing=routing, _layout=place,
                                   _layout_out=out)
        return self._grouped_layout_of(self._need_dispatch("grouped_layout"), fresh, out), handle

    def grouped_x_spec(self) -> tuple[tuple[int, int], torch.dtype]:
        """(shape, dtype) of a grouped layout's x: [resolved_grouped_capacity, dispatch_out_cols] of
        dispatch_out_dtype, or [.., hidden_dim] of data_type with grouped_dequantize."""
        self._check_open("grouped_x_spec")
        self._need_grouped("grouped_x_spec")
        cfg = self.config
        if cfg.grouped_dequantize:
            return (cfg.resolved_grouped_capacity, cfg.hidden_dim), cfg.data_type
        return (cfg.resolved_grouped_capacity, self.dispatch_out_cols), self.dispatch_out_dtype

    def combine_grouped(self, expert_out, routing, apply_weights: bool = True):
        """Expert outputs in the grouped layout of the last grouped_layout() -> combine.

        expert_out: [P = config.resolved_grouped_capacity, hidden_dim] combine dtype, row for row with the
        layout's x (rows outside the groups' kept pairs are never read); routing: the handle of that dispatch.
        Each received row becomes the float32 sum, in ascending column j, of its kept local pairs' rows, each
        times its dispatch weight (apply_weights=True, the default: a token's result is then sum_j w_j *
        expert_j(x), as with convert_combine_input; 1.0 when dispatch had no weights) or as they are
        (apply_weights=False: the expert already applied them), rounded once to the combine dtype (written
        straight into the combine buffer by the native backend); then combine(that, routing=routing). The
        native backend does both in one combine kernel where it can (its staging forms each received row from
        its pairs' grouped rows: one_kernel_legs); the same bits.
        -> combine's (combined [num_tokens, hidden_dim], None).
        """
        if self._steady is not None and self._steady.grouped_shape is not None:
            done = self._steady_combine_grouped(expert_out, routing, apply_weights)
            if done is not None:
                return done
        self._check_open("combine_grouped")
        layout, slot = self._combine_grouped_begin("combine_grouped", expert_out, routing, apply_weights)
        staged = getattr(self._backend, "grouped_staged", None)
        if staged is not None and staged(routing):  # one combine kernel, which forms the rows from the groups
            try:
                return self._backend.combine_grouped_staged(expert_out, routing, apply_weights, layout.pair_pos)
            finally:
                self._slots.combined(slot)
        return self.combine(self._grouped_rows(expert_out, layout, slot, apply_weights), routing=routing)

    def _combine_grouped_begin(self, what, expert_out, routing, apply_weights):
        """Checks of a grouped combine: -> (the layout of the handle's dispatch, its slot, selected)."""
        self._need_grouped(what)
        self._check_handle(what, routing)
        slot = self._slots.for_combine(what, routing)
        last = self._by_slot.get(slot)
        if last is None:
            raise InputError(f"{what}: no dispatch yet (or the last one raised, or the op was reset): dispatch first")
        layout = self._grouped_by.get(slot)
        if layout is None:
            raise InputError(f"{what}: call grouped_layout() after the dispatch first")
        if routing.seq != layout.seq:
            raise InputError(f"{what}: routing handle is not from the dispatch that grouped_layout() "
                             "grouped last")
        if not isinstance(apply_weights, bool):
            raise InputError(f"{what}: apply_weights must be a bool, got {type(apply_weights).__name__}")
        cfg = self.config
        shape = (cfg.resolved_grouped_capacity, cfg.hidden_dim)
        self._check_tensor(what, "expert_out", expert_out, cfg.combine_dtype, shape=shape)
        self._check_view_slot(what, expert_out, slot)
        self._select(slot)
        if what == "combine_grouped":  # one-call (its reduce pass runs first, on this stream)
            self._follow(slot)
        return layout, slot

    def _combine_pairs(self, grouped_rows: torch.Tensor, routing, pair_pos: torch.Tensor,
                       pair_w: torch.Tensor | None = None):
        """dispatch_grouped's backward on a backend with combine_pairs (runtime/autograd.py, which checked the rows:
        [P, H] combine dtype, contiguous; pair_pos and pair_w the forward's saved map and the weights' gradients):
        combine(every received row's unweighted sum of its pairs' rows, weights per pair, routing=routing) in one
        combine kernel, with combine's slot work. -> (out [T, H], out_w [T, k] float32 or None)."""
        self._check_open("combine")
        self._check_handle("combine", routing)
        slot = self._slots.for_combine("combine", routing)
        self._select(slot)
        self._follow(slot)
        try:
            return self._backend.combine_pairs(grouped_rows, routing, pair_pos, pair_w)
        finally:
            self._slots.combined(slot)

    def _grouped_rows(self, expert_out, layout, slot: int, apply_weights: bool) -> torch.Tensor:
        """The reduce pass of combine_grouped: grouped expert rows -> the combine input rows of slot `slot`."""
        own = getattr(self._backend, "grouped_reduce", None)
        if own is not None:
            return own(expert_out, apply_weights, layout.pair_pos)
        cfg = self.config
        return grouped.reduce(expert_out, layout, self._by_slot[slot]["out_w"], cfg.max_recv_tokens,
                              cfg.num_experts_per_token, cfg.combine_dtype, apply_weights)

    # --- the steady path: the common eager call with the least host work ---------------------------------------
    def _steady_signature(self) -> "_Steady | None":
        """What a call must match to take the steady path (_steady_dispatch, _steady_combine and their grouped forms),
        or None where this op never takes it: a backend without steady launches (steady_dispatch), a payload with
        scales, routed counts under a receive cap, strict capacity (a device read)."""
        cfg, b = self.config, self._backend
        if not hasattr(b, "steady_dispatch") or cfg.dispatch_scales_dtype is not None or \
                (self._count_routed and self._capped) or cfg.strict_capacity:
            return None
        grouped_on = cfg.enable_grouped_layout
        return _Steady(cfg.dispatch_dtype, b.device, cfg.dispatch_payload_cols, cfg.max_num_inp_token_per_rank,
                       cfg.num_experts_per_token, cfg.combine_dtype, cfg.hidden_dim, cfg.max_recv_tokens,
                       self._combine_weights == "fold",
                       (cfg.resolved_grouped_capacity, cfg.hidden_dim) if grouped_on else None,
                       self.grouped_x_spec() if grouped_on else None)

    def _steady_inputs(self, x, weights, indices) -> int | None:
        """A dispatch's x, weights and indices as the checks want them (one expression each): -> the token count,
        or None (the full path then checks them and says what is wrong)."""
        st = self._steady
        device, k = st.device, st.k
        if self._closed or not (type(x) is torch.Tensor and x.dtype == st.dtype and x.device == device and
                                x.dim() == 2 and x.shape[1] == st.cols and x.shape[0] <= st.most and
                                x.is_contiguous()):
            return None
        T = x.shape[0]
        if not (type(indices) is torch.Tensor and indices.dtype == torch.int32 and indices.device == device
                and indices.shape == (T, k) and indices.is_contiguous()):
            return None
        if weights is not None and not (type(weights) is torch.Tensor and weights.dtype == torch.float32 and
                                        weights.device == device and weights.shape == (T, k) and
                                        weights.is_contiguous()):
            return None
        return T

    def _steady_slot(self) -> int:
        """_dispatch_begin's slot work for a one-call dispatch: a free slot, what it held forgotten, selected."""
        slot = self._slots.for_dispatch("dispatch", True)
        self._forget(slot)
        self._backend.select_slot(slot)
        return slot

    def _steady_dispatch(self, x, weights, indices, return_routing):
        """dispatch(x, weights, None, indices, return_routing) as the full path runs it, with the least host work (the
        same launches, state and results: tests/runtime/test_steady_path.py holds them equal), where the call is the
        common one: inputs as the checks want them (_steady_inputs), a backend ready for it (steady_ready: no error
        to report, no numbering under a cap, no host id check). -> None otherwise: the full path then runs."""
        T = self._steady_inputs(x, weights, indices)
        if T is None or (return_routing is not True and return_routing is not False) or \
                not self._backend.steady_ready():
            return None
        slot = self._steady_slot()
        *outs, fields = self._backend.steady_dispatch(x, weights, indices, T, None, self._follow(slot), False)
        return self._dispatch_end(slot, outs, fields, T, return_routing, None, None)

    def _steady_dispatch_grouped(self, x, weights, indices, fresh: bool, out_x):
        """dispatch_grouped(x, weights, None, indices, fresh=fresh, out_x=out_x) as the full path runs it (as
        _steady_dispatch). -> None where the call is not the common one."""
        T = self._steady_inputs(x, weights, indices)
        if T is None:
            return None
        if out_x is not None:
            shape, out_dtype = self._steady.x_spec
            if not (type(out_x) is torch.Tensor and out_x.dtype == out_dtype and out_x.device == self._steady.device
                    and out_x.shape == shape and out_x.is_contiguous()):
                return None
        b = self._backend
        if not b.steady_ready():
            return None
        out = b.fresh_grouped(out_x) if fresh else None  # before the slot: nothing of it is a slot's
        slot = self._steady_slot()
        *outs, fields = b.steady_dispatch(x, weights, indices, T, out, self._follow(slot))
        handle = self._dispatch_end(slot, outs, fields, T, True, None, None)[-1]
        layout = self._grouped_by[slot] = b.grouped_layout(seq=self._seq, out=out)
        return layout, handle

    def _steady_handle(self, routing) -> bool:
        """routing is a handle of this op that the backend can combine on the steady path."""
        return type(routing) is RoutingHandle and routing.op_uid == self.uid and \
            routing.config_key is self._config_key and self._backend.steady_ready(routing)

    def _steady_combine(self, expert_out, weights, indices, routing):
        """combine(expert_out, weights, indices, routing) as the full path runs it (as _steady_dispatch), where the
        call is the common one: a handle of this op, rows as the checks want them, the op's weights as values (not
        the seed's fold). -> None otherwise."""
        st = self._steady
        if self._closed or st.fold or not self._steady_handle(routing):
            return None
        device, k = st.device, st.k
        if not (type(expert_out) is torch.Tensor and expert_out.dtype == st.combine_dtype and
                expert_out.device == device and expert_out.dim() == 2 and expert_out.shape[1] == st.hidden and
                expert_out.shape[0] <= st.rows and expert_out.is_contiguous()):
            return None
        for t, dtype in ((weights, torch.float32), (indices, torch.int32)):
            if t is not None and not (type(t) is torch.Tensor and t.dtype == dtype and t.device == device and
                                      t.dim() == 2 and t.shape[1] == k and t.shape[0] <= st.rows and
                                      t.is_contiguous()):
                return None
        slot = self._slots.for_combine("combine", routing)
        self._check_view_slot("combine", expert_out, slot)
        self._backend.select_slot(slot)
        stream = self._follow(slot)
        try:
            return self._backend.steady_combine(expert_out, weights, routing, stream)
        finally:
            self._slots.combined(slot)

    def _steady_combine_grouped(self, expert_out, routing, apply_weights):
        """combine_grouped(expert_out, routing, apply_weights) as the full path runs it (as _steady_dispatch), where
        the call is the common one: a handle of this op whose dispatch's layout is the slot's, expert rows as the
        checks want them, one combine kernel for the leg (grouped_staged). -> None otherwise."""
        st = self._steady
        if self._closed or (apply_weights is not True and apply_weights is not False) or \
                not self._steady_handle(routing):
            return None
        if not (type(expert_out) is torch.Tensor and expert_out.dtype == st.combine_dtype and
                expert_out.device == st.device and expert_out.shape == st.grouped_shape and
                expert_out.is_contiguous()):
            return None
        slot = routing.slot
        layout = self._grouped_by.get(slot) if 0 <= slot < self._slots.n else None
        b = self._backend
        if layout is None or routing.seq != layout.seq or slot not in self._by_slot or not b.grouped_staged(routing):
            return None
        self._slots.for_combine("combine_grouped", routing)
        self._check_view_slot("combine_grouped", expert_out, slot)
        b.select_slot(slot)
        stream = self._follow(slot)
        try:
            return b.steady_combine(expert_out, None, routing, stream, layout.pair_pos, apply_weights)
        finally:
            self._slots.combined(slot)

    def grouped_out_view(self, routing=None) -> torch.Tensor:
        """A [resolved_grouped_capacity, hidden_dim] combine-dtype tensor the grouped GEMMs may write their
        output into for combine_grouped, a buffer of the op's own per workspace slot. Write it between a
        dispatch and the combine that follows (as combine_in_view)."""
        self._check_open("grouped_out_view")
        self._need_grouped("grouped_out_view")
        slot = self._slot_of(routing)
        self._select(slot)
        if slot not in self._grouped_out:
            cfg = self.config
            self._grouped_out[slot] = torch.empty((cfg.resolved_grouped_capacity, cfg.hidden_dim),
                                                  dtype=cfg.combine_dtype, device=self.device)
        view = self._grouped_out[slot]
        self._views.setdefault(slot, set()).add(view.data_ptr())
        return view

    def memory_report(self) -> dict:
        """Bytes per buffer of this op, and a "formula" string: the backend's own report when it has one,
        else the native workspace formula (docs/RUNTIME.md, Memory) evaluated for this config."""
        self._check_open("memory_report")
        own = getattr(self._backend, "memory_report", None)
        report = dict(own()) if own is not None else native_workspace(self.config)
        report.setdefault("formula", NATIVE_WORKSPACE_FORMULA)
        return report

    def check(self, sync: bool = True) -> None:
        """Raise EpTimeoutError if a device-side wait of this op expired, or InputError if a dispatch
        kernel saw an expert id >= num_experts since the last report (eager calls only warn
        InputWarning for it; see docs/GUARANTEES.md).

        sync=True (default): first wait for this op's queued work (the stream of its last call and the
        current stream, where graph replays run), so every call issued before check() is reported;
        sync=False reads the host-mapped error words as they are now (no wait: kernels still queued
        are reported by a later check). Inside graph capture it never waits. A backend without
        device-side waits (torch) has nothing to report.
        """
        self._check_open("check")
        check = getattr(self._backend, "check", None)
        if check is None:
            return
        wait = getattr(self._backend, "wait", None)
        if sync and wait is not None:
            wait()
            check = getattr(self._backend, "synced_check", check)  # may also read the device's own counts
        check()

    def reset(self) -> None:
        """Collective: clear the backend's signals, counters and error state (after a timeout, on every rank)."""
        self._check_open("reset")
        self._last = self._packed = None  # outputs and handles from before a reset are stale
        self._by_slot, self._grouped_by = {}, {}
        self._generation += 1  # pending handles from before are void
        self._slots.clear()
        self._backend.reset()

    def close(self) -> None:
        """Release the backend; idempotent. Every later call raises ClosedError."""
        if not self._closed:
            self._closed = True
            self._generation += 1
            self._last = self._packed = None
            self._by_slot, self._grouped_by, self._grouped_out, self._views = {}, {}, {}, {}
            self._slot_streams = {}
            self._backend.close()
            if self._grad_op is not None:
                self._grad_op.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else str(self._backend.device)
        return f"EpDispatchCombineOp(uid={self.uid}, backend={self._backend.name}, {state})"

    # --- checks --------------------------------------------------------------------------------
    def _need_dispatch(self, what: str) -> dict:
        if self._last is None:
            raise InputError(f"{what}: no dispatch yet (or the last one raised, or the op was reset): "
                             f"dispatch first")
        return self._last

    def _need_std_moe(self, what: str) -> None:
        cfg = self.config
        if not cfg.enable_std_moe:
            raise InputError(f"{what}: the standard-MoE layout conversion requires enable_std_moe=True in the config")
        if cfg.prequantized or cfg.dispatch_quant_type != "none":
            raise InputError(f"{what}: the standard-MoE layout of {self.dispatch_out_dtype} payloads "
                             f"(dispatch_data_type={cfg.dispatch_data_type}, dispatch_quant_type="
                             f"{cfg.dispatch_quant_type!r}) is not built yet (bf16/fp32 payloads only)")

    def _need_grouped(self, what: str) -> None:
        if not self.config.enable_grouped_layout:
            raise InputError(f"{what}: the grouped layout requires enable_grouped_layout=True in the config")

    def _need_packed(self, what: str) -> dict:
        self._need_dispatch(what)
        if self._packed is None:
            raise InputError(f"{what}: call convert_dispatch_output() after the dispatch first")
        return self._packed

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"{what}: this EpDispatchCombineOp is closed")

    def _check_tensor(self, call, name, t, dtype, *, ndim=None, shape=None) -> None:
        checks.tensor(call, name, t, dtype, self.device, ndim=ndim, shape=shape)

    def _check_handle(self, call: str, routing) -> None:
        checks.handle(call, routing, self.uid, self._config_key)


def _ran(leg):
    """Run a leg now (a backend without split halves: its halves in order); -> its result's getter, which raises
    the CapacityError the leg raised, if any (at the receive half, as the one-call form would)."""
    try:
        result = leg()
    except CapacityError as e:
        error = e  # `e` is unbound when the except clause ends

        def failed():
            raise error
        return failed
    return lambda: result


STEADY_PATH_ENV = "EPGEN_STEADY_PATH"


def steady_path_enabled() -> bool:
    """Whether ops built from now on take the steady path (environment EPGEN_STEADY_PATH: unset or "1": yes, "0": every
    call takes the full path; the same launches and results either way, docs/RUNTIME.md)."""
    value = os.environ.get(STEADY_PATH_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ConfigError(f"environment {STEADY_PATH_ENV}={value!r}: must be 1 (the steady path, the default) or 0 "
                          f"(every call on the full path)")
    return value != "0"


@attrs.frozen
class _Steady:
    """What a call must match to take the steady path (EpDispatchCombineOp._steady_signature)."""
    dtype: torch.dtype  # dispatch's x
    device: torch.device
    cols: int  # x's columns
    most: int  # max_num_inp_token_per_rank
    k: int
    combine_dtype: torch.dtype
    hidden: int
    rows: int  # max_recv_tokens: a combine's rows at most
    fold: bool  # the seed's weight fold: plain combines take the full path
    grouped_shape: tuple | None  # combine_grouped's expert rows (None: no grouped layout)
    x_spec: tuple | None  # grouped_x_spec()
