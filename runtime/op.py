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

import itertools
import os
import socket

import attrs
import torch

from .config import (EMULATE_NODES_ENV, BUILT_COMBINE_MODES, BUILT_QUANT_TYPES, DISPATCH_QUANT_TYPES, FIELDS, PAYLOAD_DTYPES,
                     EpDispatchCombineConfig, built_torch_dtypes, torch_dtype)
from . import aliases, backends, collectives, grouped, moe
from .errors import CapacityError, ClosedError, ConfigError, EpgenError, InputError
from .routing import RoutingHandle

_UIDS = itertools.count(1)
_MISMATCH_RANKS_NAMED = 1  # per field: rank 0 and the first rank that differs (then a count of the rest)


def config_summary(config: EpDispatchCombineConfig) -> dict:
    """What ranks compare at op construction: every config field and the resolved backend."""
    summary = {name: getattr(config, name) for name in FIELDS}
    summary["resolved_backend"] = config.resolved_backend
    return summary


def check_config_agreement(config: EpDispatchCombineConfig, group=None) -> None:
    """Collective over ``group`` (None: WORLD): raise ConfigError on every rank unless every rank's
    config equals this one in every field but ``rank``, and each rank's config names the group's
    size as world_size and its own rank in the group as rank.

    Runs one gather of objects (runtime/collectives.py; gloo on CPU, NCCL on GPUs) when torch.distributed is initialised
    and the group has more than one rank; without torch.distributed there is nothing to compare
    (the backend then accepts world_size=1 only).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    g = group if group is not None else dist.group.WORLD
    size, me = dist.get_world_size(g), dist.get_rank(g)
    if me < 0:
        raise ConfigError(f"this process is not a member of the process group (config rank={config.rank}, "
                          f"world_size={config.world_size})")
    mine = config_summary(config)
    everyone = collectives.gather_objects(mine, g)
    # every rank sees every summary, so every rank raises (and with the same words, but for its own)
    if (config.world_size, config.rank) != (size, me):
        raise ConfigError(f"the process group has world size {size} and this process is rank {me}, "
                          f"but the config says world_size={config.world_size}, rank={config.rank}")
    for r, other in enumerate(everyone):
        if (other["world_size"], other["rank"]) != (size, r):
            raise ConfigError(f"rank {r} of the process group (world size {size}) has a config with "
                              f"world_size={other['world_size']}, rank={other['rank']}")
    first = everyone[0]
    parts = []
    for name in first:
        if name == "rank":
            continue
        differ = [r for r, other in enumerate(everyone) if other[name] != first[name]]
        if not differ:
            continue
        named = differ[:_MISMATCH_RANKS_NAMED]
        text = ", ".join([f"{name}={first[name]!r} on rank 0"] + [f"{name}={everyone[r][name]!r} on rank {r}"
                                                                   for r in named])
        if len(differ) > len(named):
            text += f" (and {len(differ) - len(named)} more rank(s) differ from rank 0)"
        parts.append(text)
    if parts:
        raise ConfigError("config mismatch between ranks: " + "; ".join(parts))


def emulate_nodes() -> bool:
    """Is the node-emulation switch on? ``EPGEN_EMULATE_NODES=1`` only (unset, "" or "0": off); never
    inferred. Any other value is a ConfigError."""
    value = os.environ.get(EMULATE_NODES_ENV, "")
    if value not in ("", "0", "1"):
        raise ConfigError(f"environment {EMULATE_NODES_ENV}={value!r}: must be '1' (emulate the gpu_per_node "
                          f"grouping on one host, for tests), '0' or unset")
    return value == "1"


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def check_host_layout(config: EpDispatchCombineConfig, group=None) -> None:
    """Collective over ``group``: the real host layout must match ``gpu_per_node``.

    Gathers every rank's ``socket.gethostname()`` and emulation switch with one gather of objects (runtime/collectives.py).
    Ranks are node-major (node = rank // gpu_per_node): the ranks of one node must share a hostname and
    different nodes must have different hostnames, else ConfigError on every rank naming the
    mismatch. ``EPGEN_EMULATE_NODES=1`` (on every rank) treats the grouping as given: several
    emulated nodes on one host (tests). Without torch.distributed or with one rank: nothing to check.
    """
    import torch.distributed as dist

    mine = (socket.gethostname(), emulate_nodes())
    if not (dist.is_available() and dist.is_initialized()) or config.world_size == 1:
        return
    g = group if group is not None else dist.group.WORLD
    everyone = collectives.gather_objects(mine, g)
    switches = [e for _, e in everyone]
    if len(set(switches)) > 1:
        on = [r for r, e in enumerate(switches) if e]
        raise ConfigError(f"{EMULATE_NODES_ENV}=1 is set on {_ranks_text(on)} only: set it on every rank or none")
    if switches[0]:
        return
    gpn = config.resolved_gpu_per_node
    hosts = [h for h, _ in everyone]
    problems = []
    node_host = {}
    for node in range(config.world_size // gpn):
        ranks = list(range(node * gpn, (node + 1) * gpn))
        names = sorted({hosts[r] for r in ranks})
        if len(names) > 1:
            parts = [f"{name!r} ({_ranks_text([r for r in ranks if hosts[r] == name])})" for name in names]
            problems.append(f"node {node} (ranks {ranks[0]}-{ranks[-1]}) spans hosts {', '.join(parts)}")
        node_host[node] = names[0]
    by_host: dict = {}
    for node, name in node_host.items():
        by_host.setdefault(name, []).append(node)
    for name, nodes in by_host.items():
        if len(nodes) > 1:
            problems.append(f"nodes {', '.join(map(str, nodes))} are all on host {name!r}")
    if problems:
        raise ConfigError(f"gpu_per_node={config.gpu_per_node}: the host layout does not match (ranks are "
                          f"node-major, node = rank // {gpn}): " + "; ".join(problems)
                          + f". Set gpu_per_node to the ranks per host, or {EMULATE_NODES_ENV}=1 on every rank "
                            f"to emulate nodes on one host (tests)")


class EpDispatchCombineOp:
    """Expert-parallel dispatch/combine over one process group (see the module docstring)."""

    def __init__(self, config: EpDispatchCombineConfig, group=None, *, combine_weights: str = "values"):
        """combine_weights: what combine's ``weights`` means. "values" (epgen): the rows passed are summed per
        token like the expert output. "fold" (the seed library's; runtime.seed_compat's op uses it): any non-None
        ``weights`` asks for the sum of the last dispatch's forwarded weights; the values passed, and
        ``indices``, are unused."""
        if not isinstance(config, EpDispatchCombineConfig):
            raise ConfigError(f"config must be an EpDispatchCombineConfig, got {type(config).__name__}")
        aliases.check_op_args(group, combine_weights)
        self._combine_weights = combine_weights
        check_config_agreement(config, group)  # collective; before anything is allocated
        check_host_layout(config, group)  # collective
        self.config = config
        self.uid = next(_UIDS)
        self._closed = False
        self._seq = 0  # dispatches that moved data (returned, or raised CapacityError)
        self._last: dict | None = None  # the last returned dispatch's outputs (MoE integration)
        self._packed: dict | None = None  # the last std-MoE conversion of that dispatch
        self._grouped: grouped.GroupedLayout | None = None  # the last grouped layout of that dispatch
        self._grouped_out: torch.Tensor | None = None  # grouped_out_view's buffer where the backend has none
        self._backend = backends.make(config, group)

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
                 input=None):
        """-> (out, out_weights, out_scales, out_indices, total_recv[, routing handle]). ``input``: the seed's
        name for x."""
        self._check_open("dispatch")
        x = aliases.renamed("dispatch", "x", x, "input", input)
        cfg = self.config
        k, cols = cfg.num_experts_per_token, cfg.dispatch_payload_cols
        self._check_tensor("dispatch", "x", x, cfg.dispatch_dtype, ndim=2)
        num_tokens = x.shape[0]
        if x.shape[1] != cols:
            width = f"hidden_dim={cols}" if cols == cfg.hidden_dim else \
                f"hidden_dim // 2={cols} (two {cfg.dispatch_dtype} values per byte)"
            raise InputError(f"dispatch: x must have shape [num_tokens, {width}], got {tuple(x.shape)}")
        if num_tokens > cfg.max_num_inp_token_per_rank:
            raise InputError(f"dispatch: x has {num_tokens} tokens, more than max_num_inp_token_per_rank="
                             f"{cfg.max_num_inp_token_per_rank}")
        self._check_tensor("dispatch", "indices", indices, torch.int32, shape=(num_tokens, k))
        if weights is not None:
            self._check_tensor("dispatch", "weights", weights, torch.float32, shape=(num_tokens, k))
        scales_dtype = cfg.dispatch_scales_dtype
        if scales_dtype is None and scales is not None:
            why = f"dispatch_quant_type={cfg.dispatch_quant_type!r} makes the scales" \
                if cfg.dispatch_quant_type != "none" else "scale_dim=0"
            raise InputError(f"dispatch: scales must be None for a {cfg.dispatch_dtype} payload ({why})")
        if scales_dtype is not None:
            if scales is None:
                raise InputError(f"dispatch: scales are required for a {cfg.dispatch_dtype} payload: pass "
                                 f"[num_tokens, scale_dim={cfg.scale_dim}] {scales_dtype}")
            self._check_tensor("dispatch", "scales", scales, scales_dtype, shape=(num_tokens, cfg.scale_dim))
        return_routing = aliases.as_bool(return_routing)  # numpy's bools too
        if not isinstance(return_routing, bool):
            raise InputError(f"dispatch: return_routing must be a bool, got {aliases.type_name(return_routing)}")
        if routing is not None:
            self._check_handle("dispatch", routing)
            if routing.num_tokens != num_tokens:
                raise InputError(f"dispatch: routing replay needs the same token count: the handle has "
                                 f"{routing.num_tokens} tokens, x has {num_tokens}")
        self._last = self._packed = self._grouped = None  # the buffers are about to change
        try:
            *outs, fields = self._backend.dispatch(x, weights, scales, indices, routing)
        except CapacityError:
            self._seq += 1  # the data moved; dropped_count() reports it
            raise
        self._seq += 1
        out, out_w, out_s, out_i, total = outs
        self._last = {"seq": self._seq, "out": out, "out_w": out_w, "out_s": out_s, "out_i": out_i, "total": total}
        if not return_routing:
            return tuple(outs)
        handle = RoutingHandle(op_uid=self.uid, config_key=cfg.key, num_tokens=num_tokens, seq=self._seq, **fields)
        return (*outs, handle)

    def combine(self, expert_out=None, weights=None, indices=None, routing=None, *, input=None):
        """-> (combined [num_tokens, hidden_dim], combined_weights [num_tokens, k] or None). ``input``: the seed's
        name for expert_out; ``weights``: see combine_weights in __init__."""
        self._check_open("combine")
        expert_out = aliases.renamed("combine", "expert_out", expert_out, "input", input)
        if self._combine_weights == "fold":  # the seed's combine: indices taken for parity only, unused
            indices = None
            if weights is not None:
                weights = aliases.forwarded_weights(self._need_dispatch("combine (weight fold)"))
        cfg = self.config
        if routing is None:
            raise InputError("combine: routing is required: pass the RoutingHandle from "
                             "dispatch(..., return_routing=True) of this op")
        self._check_handle("combine", routing)
        rows_max, k = cfg.max_recv_tokens, cfg.num_experts_per_token
        self._check_tensor("combine", "expert_out", expert_out, cfg.combine_dtype, ndim=2)
        if expert_out.shape[1] != cfg.hidden_dim or expert_out.shape[0] > rows_max:
            raise InputError(f"combine: expert_out must have shape [rows <= max_recv_tokens={rows_max}, "
                             f"hidden_dim={cfg.hidden_dim}], got {tuple(expert_out.shape)}")
        for name, t, dtype in (("weights", weights, torch.float32), ("indices", indices, torch.int32)):
            if t is None:
                continue
            self._check_tensor("combine", name, t, dtype, ndim=2)
            if t.shape[1] != k or t.shape[0] > rows_max:
                raise InputError(f"combine: {name} must have shape [rows <= max_recv_tokens={rows_max}, "
                                 f"num_experts_per_token={k}], got {tuple(t.shape)}")
        return self._backend.combine(expert_out, weights, indices, routing)

    def combine_in_view(self) -> torch.Tensor:
        """A [max_recv_tokens, hidden_dim] tensor the expert may write its output into directly (combine then
        reads it in place, no staging copy). Write it between a dispatch and the combine that follows: after a
        combine the peers may still be reading it until this rank's next dispatch. To combine again without
        a dispatch, pass the new expert output in a tensor of its own (combine stages it safely)."""
        self._check_open("combine_in_view")
        return self._backend.combine_in_view()

    # --- MoE integration -------------------------------------------------------------------------
    def dropped_count(self) -> torch.Tensor:
        """int32 scalar tensor on the device: rows this rank dropped on receive (past max_recv_tokens) in
        the last dispatch, the last ones in (source rank, token) order. No host sync: after CUDA graph
        replays (where strict_capacity cannot raise) read it here."""
        self._check_open("dropped_count")
        if not self._seq:
            raise InputError("dropped_count: no dispatch yet")
        own = getattr(self._backend, "dropped_count", None)
        if own is None:
            raise EpgenError(f"dropped_count: the {self._backend.name} backend does not report receive drops")
        return own()

    def local_expert_count(self) -> torch.Tensor:
        """int32 [num_experts_per_rank] on the device: after the last dispatch, the (received row, column)
        pairs whose expert id is local (id // num_experts_per_rank == rank), per local expert; every
        column counts (a token naming a local expert twice counts twice). No host sync."""
        self._check_open("local_expert_count")
        last = self._need_dispatch("local_expert_count")
        own = getattr(self._backend, "local_expert_count", None)
        if own is not None:
            return own()
        cfg = self.config
        return moe.local_expert_count(last["out_i"], last["total"], cfg.rank, cfg.num_experts_per_rank)

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
        self._packed = {"seq": last["seq"], "src": src, "w": w, "dropped": dropped}
        return packed_x, count, src, w

    def std_moe_dropped(self) -> torch.Tensor:
        """int32 scalar tensor on the device: pairs the last convert_dispatch_output dropped past capacity."""
        self._check_open("std_moe_dropped")
        self._need_std_moe("std_moe_dropped")
        packed = self._need_packed("std_moe_dropped")
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
        last = self._need_dispatch("grouped_layout")
        own = getattr(self._backend, "grouped_layout", None)
        cfg = self.config
        if own is not None:
            layout = own()
        else:
            layout = grouped.group(last["out"], last["out_s"], last["out_w"], last["out_i"], last["total"], cfg.rank,
                                   cfg.num_experts_per_rank, cfg.expert_alignment, cfg.resolved_grouped_capacity)
            if cfg.grouped_dequantize:
                layout = grouped.dequantized(layout, cfg.dispatch_quant_type, cfg.data_type)
        self._grouped = layout = attrs.evolve(layout, seq=last["seq"])
        return layout

    def dispatch_grouped(self, x, weights=None, scales=None, indices=None, routing=None):
        """dispatch(x, weights, scales, indices, return_routing=True, routing=routing), then grouped_layout():
        -> (GroupedLayout, routing handle). The grouped GEMMs run on the layout; combine_grouped(expert_out,
        handle) brings their rows back."""
        self._check_open("dispatch_grouped")
        self._need_grouped("dispatch_grouped")
        *_, handle = self.dispatch(x, weights, scales, indices, return_routing=True, routing=routing)
        return self.grouped_layout(), handle

    def combine_grouped(self, expert_out, routing, apply_weights: bool = True):
        """Expert outputs in the grouped layout of the last grouped_layout() -> combine.

        expert_out: [P = config.resolved_grouped_capacity, hidden_dim] combine dtype, row for row with the
        layout's x (rows outside the groups' kept pairs are never read); routing: the handle of that dispatch.
        Each received row becomes the float32 sum, in ascending column j, of its kept local pairs' rows, each
        times its dispatch weight (apply_weights=True, the default: a token's result is then sum_j w_j *
        expert_j(x), as with convert_combine_input; 1.0 when dispatch had no weights) or as they are
        (apply_weights=False: the expert already applied them), rounded once to the combine dtype (written
        straight into the combine buffer by the native backend); then combine(that, routing=routing).
        With config grouped_combine="fused" the native backend does both in one kernel (the combine reads
        the peers' grouped rows itself; same bits); expert_out written into grouped_out_view() is not staged.
        -> combine's (combined [num_tokens, hidden_dim], None).
        """
        self._check_open("combine_grouped")
        self._need_grouped("combine_grouped")
        self._check_handle("combine_grouped", routing)
        self._need_dispatch("combine_grouped")
        layout = self._grouped
        if layout is None:
            raise InputError("combine_grouped: call grouped_layout() after the dispatch first")
        if routing.seq != layout.seq:
            raise InputError("combine_grouped: routing handle is not from the dispatch that grouped_layout() "
                             "grouped last")
        if not isinstance(apply_weights, bool):
            raise InputError(f"combine_grouped: apply_weights must be a bool, got {type(apply_weights).__name__}")
        cfg = self.config
        shape = (cfg.resolved_grouped_capacity, cfg.hidden_dim)
        self._check_tensor("combine_grouped", "expert_out", expert_out, cfg.combine_dtype, shape=shape)
        fused = getattr(self._backend, "grouped_fused", None)
        if fused is not None and fused(routing):  # config grouped_combine="fused", a bandwidth-protocol call
            return self._backend.combine_grouped_fused(expert_out, routing, apply_weights)
        own = getattr(self._backend, "grouped_reduce", None)
        if own is not None:
            rows = own(expert_out, apply_weights)
        else:
            rows = grouped.reduce(expert_out, layout, self._last["out_w"], cfg.max_recv_tokens,
                                  cfg.num_experts_per_token, cfg.combine_dtype, apply_weights)
        return self.combine(rows, routing=routing)

    def grouped_out_view(self) -> torch.Tensor:
        """A [resolved_grouped_capacity, hidden_dim] combine-dtype tensor the grouped GEMMs may write their
        output into for combine_grouped: with grouped_combine="fused" (native backend) it lies in the
        peer-mapped workspace and the fused combine reads it in place (no staging copy); otherwise a buffer
        of the op's own. Write it between a dispatch and the combine that follows (as combine_in_view)."""
        self._check_open("grouped_out_view")
        self._need_grouped("grouped_out_view")
        own = getattr(self._backend, "grouped_out_view", None)
        view = own() if own is not None else None
        if view is None:
            if self._grouped_out is None:
                cfg = self.config
                self._grouped_out = torch.empty((cfg.resolved_grouped_capacity, cfg.hidden_dim),
                                                dtype=cfg.combine_dtype, device=self.device)
            view = self._grouped_out
        return view

    def memory_report(self) -> dict:
        """Bytes per buffer of this op, and a "formula" string: the backend's own report when it has one,
        else the native workspace formula (docs/RUNTIME.md, Memory) evaluated for this config."""
        self._check_open("memory_report")
        own = getattr(self._backend, "memory_report", None)
        report = dict(own()) if own is not None else native_workspace(self.config, self.dispatch_out_dtype,
                                                                      self.wire_dtype)
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
        self._last = self._packed = self._grouped = None  # outputs and handles from before a reset are stale
        self._backend.reset()

    def close(self) -> None:
        """Release the backend; idempotent. Every later call raises ClosedError."""
        if not self._closed:
            self._closed = True
            self._last = self._packed = self._grouped = None
            self._backend.close()

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
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{call}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise InputError(f"{call}: {name} must have shape {list(shape)}, got {list(t.shape)}")
        if ndim is not None and t.dim() != ndim:
            raise InputError(f"{call}: {name} must be {ndim}-D, got shape {list(t.shape)}")
        if t.dtype != dtype:
            raise InputError(f"{call}: {name} must be {dtype}, got {t.dtype}")
        if t.device != self.device:
            raise InputError(f"{call}: {name} must be on {self.device}, got {t.device}")
        if not t.is_contiguous():
            raise InputError(f"{call}: {name} must be contiguous")

    def _check_handle(self, call: str, routing) -> None:
        if not isinstance(routing, RoutingHandle):
            raise InputError(f"{call}: routing must be a RoutingHandle, got {type(routing).__name__}")
        if routing.op_uid != self.uid:
            raise InputError(f"{call}: routing handle comes from another op (uid {routing.op_uid}, this op is "
                             f"uid {self.uid}); use the handle returned by this op's dispatch")
        if routing.config_key != self.config.key:
            raise InputError(f"{call}: routing handle was made for a different config (stale handle)")


NATIVE_WORKSPACE_FORMULA = (
    "per rank, bytes = 12*W + 8 + R*(wire_row + scale_row + 8k + 4) + (gather: R*(H*c + 4k); scatter: "
    "T*W*(scat_row + scat_scale_row + 4k)) + std-MoE E_local*C*H*d + grouped layout P*(wire_row + scale_row) + "
    "(12P + 8Rk + 12E_local + 4) (+ with grouped_combine='fused': grp_y P*H*c, grp_pos 16 + 4Rk in the workspace, "
    "grouped_meta's 8Rk then 4Rk), every region rounded up to 256 bytes "
    "(regions: signal, counter, recv_x, recv_scales, recv_w, recv_idx, recv_src, comb_x, comb_w | scat_x, "
    "scat_s, scat_w; std_moe_x, grouped_x, grouped_scales, grouped_meta outside the symmetric workspace); counter = 2 claim + 2W arrival words; an op that may "
    "take the low-latency protocol adds ll_cnt 16W, ll_x 2*W*L*ll_row, ll_c L*W*ll_cell, ll_map 4*(W*L + W) "
    "(L = its low-latency token limit, ll_row / ll_cell: runtime/ll.py); R = max_recv_tokens, W = world_size, T = max_num_inp_token_per_rank, "
    "H = hidden_dim, k = top-k, c/d = bytes per combine/dispatch element, C = expert capacity, "
    "E_local = num_experts_per_rank, P = grouped rows (grouped_capacity, else the worst case "
    "floor((R*k + E_local*(A - 1)) / A) * A, A = expert_alignment)")
_REGION_ALIGN = 256


def native_workspace(config: EpDispatchCombineConfig, dispatch_out_dtype: torch.dtype,
                     wire_dtype: torch.dtype = torch.float8_e4m3fn, ll_tokens: int = 0) -> dict:
    """The native workspace formula (docs/RUNTIME.md, Memory) for this config: {"regions": {name: bytes}, "total_bytes",
    "formula"}; each region rounded up to 256 bytes. ll_tokens: the low-latency protocol's token limit
    (0: the op never takes it)."""
    from . import ll
    from .config import load_specs

    cfg = config
    R, W, T, H, k = (cfg.max_recv_tokens, cfg.world_size, cfg.max_num_inp_token_per_rank, cfg.hidden_dim,
                     cfg.num_experts_per_token)
    cols = cfg.hidden_dim // 2 if cfg.dispatch_quant_type == "fp4_blockwise" else cfg.dispatch_payload_cols
    wire_row = cols * dispatch_out_dtype.itemsize  # fp8: 1 byte per element; fp4: two per byte (cols = H/2)
    specs = load_specs()
    if cfg.dispatch_quant_type != "none":
        q = specs.quants[cfg.dispatch_quant_type]
        scale_row = (H // q.block) * (4 if cfg.dispatch_quant_type == "fp8_blockwise" else 1)
    else:
        scale_row = cfg.scale_dim * cfg.scale_type_size
    c = cfg.combine_dtype.itemsize
    regions = [("signal", 4 * W), ("counter", 8 + 8 * W),
               *ll.regions(W, ll_tokens, ll.row_bytes(wire_row, scale_row, k), ll.cell_bytes(H * cfg.combine_dtype.itemsize, k)),
               ("recv_x", R * wire_row), ("recv_scales", R * scale_row),
               ("recv_w", R * 4 * k), ("recv_idx", R * 4 * k), ("recv_src", R * 4)]
    if cfg.resolved_combine_mode == "scatter":
        q = specs.quants[cfg.quant_type]
        if cfg.quant_type == "none":
            scat_row, scat_scale_row = H * c, 0
        else:
            scat_row = H if q.wire_kind == "fp8" else H // 2
            scat_scale_row = {"fp8_blockwise": (H // 128) * 4, "fp4_blockwise": H // 32}.get(cfg.quant_type, 0)
        regions += [("scat_x", T * W * scat_row), ("scat_s", T * W * scat_scale_row), ("scat_w", T * W * 4 * k)]
    else:
        regions += [("comb_x", R * H * c), ("comb_w", R * 4 * k)]
    if cfg.enable_std_moe:
        regions.append(("std_moe_x", cfg.num_experts_per_rank * cfg.resolved_expert_capacity * H
                        * dispatch_out_dtype.itemsize))
    if cfg.enable_grouped_layout:
        P, E = cfg.resolved_grouped_capacity, cfg.num_experts_per_rank
        fused = cfg.grouped_combine == "fused"  # the pair map in the workspace, with the expert rows: the peers read them
        regions += [("grouped_x", P * wire_row), ("grouped_scales", P * scale_row),
                    ("grouped_meta", 12 * P + (4 if fused else 8) * R * k + 12 * E + 4)]  # src, m_indices, weights; pair maps; offs, counts
        if fused:
            regions += [("grp_y", P * H * c), ("grp_pos", 16 + 4 * R * k)]
    sized = {name: -(-n // _REGION_ALIGN) * _REGION_ALIGN for name, n in regions}
    return {"backend": "native (formula)", "regions": sized, "total_bytes": sum(sized.values()),
            "formula": NATIVE_WORKSPACE_FORMULA}
