"""EpDispatchCombineConfig: a frozen, validated description of one EP dispatch/combine op.

Validation runs in ``__attrs_post_init__``, before anything is allocated, in this order:
field types and ranges -> names known to the specs -> dtypes -> scales -> quantization modes ->
the spec rules (specs/rules.toml, through the generator's rule engine, so the runtime and the
generator say the same thing) -> what this release has not built yet.

Payload modes (data_type is always the model dtype, bf16 or fp32):
  * plain: dispatch moves data_type rows, combine takes and returns data_type.
  * pre-quantized: dispatch_data_type fp8 (float8_e4m3fn / float8_e4m3fnuz, x [T, hidden_dim]) or
    float4_e2m1fn_x2 (x [T, hidden_dim // 2]) with combine_data_type bf16/fp32, scale_dim > 0 and
    scale_type_size 4 (float32 scales) or 1 (e8m0 uint8 scales); payload and scales move verbatim;
    gather combine only.
  * in-kernel quantization: dispatch_quant_type "fp8_blockwise" / "fp4_blockwise": x is data_type,
    dispatch returns the quantized rows and their scales (see runtime/op.py).
Combine: combine_mode None resolves to "scatter" when quant_type != "none" (wire compression of
the combine rows: fp8_direct_cast, fp8_blockwise, fp4_blockwise), else "gather".

Receive capacity: ``max_total_recv_tokens`` (0: the worst case ``world_size *
max_num_inp_token_per_rank``; otherwise in [world_size, worst case]) rows per rank. Rows past it are
dropped (the last ones in (source rank, token) order) and counted (``op.dropped_count()``);
``strict_capacity=True`` makes an eager dispatch raise ``runtime.errors.CapacityError`` on every rank
that dropped rows (inside CUDA graph capture nothing can raise: read ``dropped_count()`` after replays).

Standard-MoE layout (``enable_std_moe=True``, intranode, bf16/fp32 payloads): dispatch output
converts to per-local-expert buckets of ``expert_capacity`` rows (0: max_recv_tokens,
``resolved_expert_capacity``); see ``EpDispatchCombineOp.convert_dispatch_output``.

Grouped-GEMM layout (``enable_grouped_layout=True``, every payload, intranode): the received (row, local
expert) pairs as rows grouped per local expert, contiguous, each group padded to a multiple of
``expert_alignment`` rows (1..1024; 16 suits torch._grouped_mm, 128 DeepGEMM's m-grouped contiguous
layout), in a buffer of ``grouped_capacity`` rows (0: the worst case, ``resolved_grouped_capacity``); see
``EpDispatchCombineOp.grouped_layout`` / ``combine_grouped`` and runtime/grouped.py.
``grouped_dequantize=True`` (with ``dispatch_quant_type`` "fp8_blockwise" or "fp4_blockwise"): the grouped
layout holds the rows dequantized into ``data_type`` (the placement kernel decodes them as it places them;
``scales`` None), for grouped GEMMs in bf16/fp32 fed by a quantized wire; the bits are those of
runtime.numerics' dequantize of the received rows.

Internode (``world_size > gpu_per_node``; ranks node-major, node = rank // gpu_per_node): both
backends run it (``internode_kernel`` "v2" hierarchical, "v2_ll" one copy per destination rank, "auto"
per call: the call's largest per-rank token count <= ``internode_auto_ll_max_tokens`` picks "v2_ll");
gather combine only, ``quant_type`` and ``dispatch_quant_type`` "none" (rule internode_quant_none;
pre-quantized fp8/fp4 payloads are allowed), no std-MoE. The op checks the real host layout at
construction (``EPGEN_EMULATE_NODES=1`` skips it). The native backend runs it on generated record kernels
around NCCL/RCCL all_to_all_single (runtime/backends/internode.py).

Intranode wire protocol (``intranode_protocol``, native backend): "bw" (bandwidth: claimed slots, one
completion barrier per leg), "ll" (low latency: rows carry per-16-byte epoch flags the receiver polls, no
fence or barrier on the critical path; verbatim payloads, gather arithmetic, at most ``LL_MAX_TOKENS``
tokens per rank; docs/GUARANTEES.md) or "auto", the default: "ll" when the config can run it and its token
bound ``max_num_inp_token_per_rank`` is at most the target's ``intranode_ll_max_tokens`` in
specs/tuning.toml, else "bw". The op decides once, at construction, from the config (checked equal on every
rank) and the target, never from a call's token count (ranks' counts may differ), so every rank takes the
same protocol for every call (the native backend checks it across ranks). Both give the same results; the
torch backend has one protocol and ignores the field.

Operations in flight (``max_inflight``, 1..8, default 1): how many split-phase operations (a dispatch from its
send half until the combine of its rows received, ``op.dispatch_send`` / ``PendingDispatch.receive``) one op
keeps at once, for micro-batch overlap. Each has a workspace slot of its own (receive, combine, flag and
low-latency regions, and the grouped / std-MoE buffers), so the op's memory grows max_inflight times; 1 keeps
today's memory. See runtime/pending.py and docs/LAYER.md (Overlap).

Device-side waits (barrier signals, counters) give up after ``timeout_s`` seconds (> 0, finite);
the native backend then raises ``runtime.errors.EpTimeoutError`` (see docs/GUARANTEES.md).

Kernel backend precedence (``resolved_backend``), fixed at construction:
  1. the environment variable ``EPGEN_KERNEL_BACKEND`` when set and non-empty (it overrides the field),
  2. the ``kernel_backend`` field when not None,
  3. ``"native"`` when ``torch.cuda.is_available()``, else ``"torch"``.
"""

from __future__ import annotations

import functools
import math
import os

import attrs
import torch

from . import aliases
from .errors import ConfigError

BACKEND_ENV = "EPGEN_KERNEL_BACKEND"
EMULATE_NODES_ENV = "EPGEN_EMULATE_NODES"  # "1": treat the gpu_per_node grouping as given (one-host tests)
KERNEL_BACKENDS = ("native", "torch")
INTERNODE_KERNELS = ("v2", "v2_ll", "auto")
INTRANODE_PROTOCOLS = ("auto", "ll", "bw")
COMBINE_MODES = ("gather", "scatter")
DISPATCH_QUANT_TYPES = ("none", "fp8_blockwise", "fp4_blockwise")
SCALE_TYPE_SIZES = (1, 4)  # 1: e8m0 bytes (torch.uint8), 4: torch.float32

MAX_INFLIGHT = 8  # the most operations in flight on one op (max_inflight)

# Declared ranges of the int fields, [least, most], checked first: counts of ranks, tokens, rows and
# experts are int32 in routing handles and kernel indices (their products are checked too, and the
# bytes of the largest row buffer); a grid has at most 2^31 - 1 blocks, a block at most 1024 threads.
INT32_MAX = 2 ** 31 - 1
_I32 = "int32: ranks, tokens, rows, experts and blocks are numbered in int32"
INT_RANGES = {  # field: (least, most, why the most)
    **{f: (1, INT32_MAX, _I32) for f in ("world_size", "max_num_inp_token_per_rank", "num_experts_per_rank",
                                         "num_experts_per_token", "internode_auto_ll_max_tokens")},
    "hidden_dim": (1, INT32_MAX, "elements per token row: the declared limit"),
    **{f: (0, INT32_MAX, _I32) for f in ("scale_dim", "max_total_recv_tokens", "gpu_per_node", "expert_capacity",
                                         "launch_blocks", "scale_type_size")},  # scale_type_size: 0, 1 or 4 (below)
    "launch_threads": (0, 1024, "threads per block"),
    "expert_alignment": (1, 1024, "rows a grouped-layout group is padded to a multiple of"),
    "grouped_capacity": (0, INT32_MAX, _I32),
    "max_inflight": (1, MAX_INFLIGHT, "operations in flight on one op: each has a workspace slot of its own"),
}

# What this release builds (spec dtype names / modes).
BUILT_DTYPES = ("bf16", "fp32")  # data_type (the model dtype) and combine dtypes
PAYLOAD_DTYPES = ("fp8_e4m3fn", "fp8_e4m3fnuz", "fp4_e2m1")  # pre-quantized dispatch payloads
BUILT_COMBINE_MODES = ("gather", "scatter")
BUILT_QUANT_TYPES = ("none", "fp8_direct_cast", "fp8_blockwise", "fp4_blockwise")


@functools.cache
def load_specs():
    """The specs under specs/, loaded once per process."""
    from generator import specs as gspecs

    return gspecs.load()


def spec_dtype(dtype: torch.dtype):
    """The spec dtype record whose ``torch`` name is this torch dtype, or None."""
    name = str(dtype).removeprefix("torch.")
    return next((d for d in load_specs().dtypes.values() if d.torch == name), None)


def torch_dtype_name(spec_name: str) -> str:
    """Spec dtype name -> torch attribute name, e.g. "bf16" -> "bfloat16"."""
    return load_specs().dtypes[spec_name].torch


def torch_dtype(spec_name: str) -> torch.dtype:
    """Spec dtype name -> torch dtype, e.g. "bf16" -> torch.bfloat16."""
    return getattr(torch, torch_dtype_name(spec_name))


def built_torch_dtypes() -> tuple[torch.dtype, ...]:
    return tuple(torch_dtype(n) for n in BUILT_DTYPES)


def _dtype_list(names) -> str:
    return ", ".join(f"torch.{torch_dtype_name(n)}" for n in names)


@attrs.frozen(kw_only=True)
class EpDispatchCombineConfig(aliases.SeedConfigMembers):
    """Static shape and mode of an EP dispatch/combine op (see the module docstring).

    The seed library's fields and properties are accepted too (runtime/aliases.py,
    docs/SEED_COMPAT.md)."""

    rank: int
    world_size: int
    hidden_dim: int
    max_num_inp_token_per_rank: int
    num_experts_per_rank: int
    num_experts_per_token: int
    data_type: torch.dtype = torch.bfloat16
    dispatch_data_type: torch.dtype | None = None
    combine_data_type: torch.dtype | None = None
    scale_dim: int = 0
    scale_type_size: int = 0
    combine_mode: str | None = None  # None: "scatter" if quant_type != "none" else "gather"
    quant_type: str = "none"
    dispatch_quant_type: str = "none"
    enable_std_moe: bool = False
    max_total_recv_tokens: int = 0  # 0: worst case, world_size * max_num_inp_token_per_rank
    gpu_per_node: int = attrs.field(default=0, converter=aliases.gpu_per_node)  # 0 (or None): world_size (one node)
    internode_kernel: str = "auto"
    internode_auto_ll_max_tokens: int = 512
    intranode_protocol: str = "auto"  # "auto" | "ll" (low latency) | "bw" (bandwidth); see the module docstring
    kernel_backend: str | None = attrs.field(default=None, converter=aliases.kernel_backend)  # None: see the module docstring
    timeout_s: float = 30.0  # seconds a device-side wait may last before the kernel gives up
    expert_capacity: int = 0  # std-MoE packed rows per local expert; 0: max_recv_tokens
    strict_capacity: bool = False  # dispatch raises CapacityError when it dropped received rows
    launch_blocks: int = 0  # EP kernel grid override; 0: specs/tuning.toml
    launch_threads: int = 0  # EP kernel threads per block override; 0: specs/tuning.toml
    launch_rows: str = ""  # dispatch row copy override: "wave" | "block"; "": specs/tuning.toml
    enable_grouped_layout: bool = False  # grouped-GEMM layout buffers and kernels (op.grouped_layout)
    expert_alignment: int = 16  # grouped layout: each group padded to a multiple of this many rows
    grouped_capacity: int = 0  # grouped layout: rows of its buffer (a multiple of expert_alignment); 0: worst case
    grouped_dequantize: bool = False  # grouped layout of a quantized dispatch: rows dequantized into data_type
    max_inflight: int = 1  # operations in flight at once (split-phase calls): workspace slots, each a full set
    # the seed library's fields (aliases.SEED_FIELDS): launch geometry aliases, or accepted and ignored
    dispatch_block_num: int | None = None
    combine_block_num: int | None = None
    warp_num_per_block: int | None = None
    combine_warp_num_per_block: int | None = None
    schedule: tuple | None = attrs.field(default=None, converter=aliases.schedule)
    num_qp_per_pe: int | None = None
    dispatch_rdma_block_num: int | None = None
    combine_rdma_block_num: int | None = None
    max_token_type_size: int | None = None
    _resolved_backend: str = attrs.field(init=False, default="", eq=False, repr=False)
    _key: tuple = attrs.field(init=False, default=(), eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._check_types()
        self._check_ranges()
        self._check_names()
        self._check_dtypes()
        self._check_scales()
        self._check_quants()
        self._check_rules()
        self._check_built()
        aliases.check_seed_fields(self)
        object.__setattr__(self, "timeout_s", float(self.timeout_s))
        object.__setattr__(self, "_resolved_backend", self._resolve_backend())
        object.__setattr__(self, "_key", tuple(getattr(self, name) for name in FIELDS) + (self._resolved_backend,))

    # --- derived values ------------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.world_size * self.num_experts_per_rank

    def expert_id_bound(self) -> str:
        """num_experts as an expert-id error states it, its product spelled out: a total the world size does not
        divide shows where it was truncated (256 // 3 ranks: 3 × 85 = 255)."""
        n = self.num_experts
        return (f"num_experts={n} (world_size × num_experts_per_rank = {self.world_size} × "
                f"{self.num_experts_per_rank} = {n}; valid ids: 0..{n - 1}, negative = no expert)")

    @property
    def resolved_gpu_per_node(self) -> int:
        """GPUs per node, resolved (0 -> world_size)."""
        return self.gpu_per_node or self.world_size

    @property
    def is_internode(self) -> bool:
        return self.world_size > self.resolved_gpu_per_node

    @property
    def worst_case_recv_tokens(self) -> int:
        return self.world_size * self.max_num_inp_token_per_rank

    @property
    def max_recv_tokens(self) -> int:
        """Rows of the receive buffer (max_total_recv_tokens, 0 -> worst case)."""
        return self.max_total_recv_tokens or self.worst_case_recv_tokens

    @property
    def resolved_expert_capacity(self) -> int:
        """Rows per local expert of the standard-MoE packed layout (expert_capacity, 0 -> max_recv_tokens)."""
        return self.expert_capacity or self.max_recv_tokens

    @property
    def worst_case_grouped_rows(self) -> int:
        """Rows the grouped layout needs at most: every (received row, column) pair local, each of the
        num_experts_per_rank groups padded by up to expert_alignment - 1 rows (a multiple of the alignment)."""
        a = self.expert_alignment
        return (self.max_recv_tokens * self.num_experts_per_token + self.num_experts_per_rank * (a - 1)) // a * a

    @property
    def resolved_grouped_capacity(self) -> int:
        """Rows of the grouped layout's buffer (grouped_capacity, 0 -> worst_case_grouped_rows)."""
        return self.grouped_capacity or self.worst_case_grouped_rows

    @property
    def resolved_backend(self) -> str:
        return self._resolved_backend

    @property
    def resolved_combine_mode(self) -> str:
        """combine_mode, resolved (None -> "scatter" when quant_type != "none", else "gather")."""
        if self.combine_mode is not None:
            return self.combine_mode
        return "scatter" if self.quant_type != "none" else "gather"

    @property
    def dispatch_dtype(self) -> torch.dtype:
        """dtype of dispatch's x (the payload as the caller passes it)."""
        return self.data_type if self.dispatch_data_type is None else self.dispatch_data_type

    @property
    def combine_dtype(self) -> torch.dtype:
        """dtype of combine's expert_out and of its result."""
        return self.data_type if self.combine_data_type is None else self.combine_data_type

    @property
    def prequantized(self) -> bool:
        """True when dispatch's x is an fp8/fp4 payload with caller-made scales (dispatch_data_type)."""
        return self.dispatch_data_type is not None and spec_dtype(self.dispatch_data_type).kind in ("fp8", "fp4")

    @property
    def dispatch_payload_cols(self) -> int:
        """Columns of dispatch's x: hidden_dim, or hidden_dim // 2 for a float4_e2m1fn_x2 payload."""
        if self.dispatch_data_type is not None and spec_dtype(self.dispatch_data_type).kind == "fp4":
            return self.hidden_dim // 2
        return self.hidden_dim

    @property
    def dispatch_scales_dtype(self) -> torch.dtype | None:
        """dtype of dispatch's scales argument (a pre-quantized payload), else None (scales must be None)."""
        if not self.prequantized:
            return None
        return torch.float32 if self.scale_type_size == 4 else torch.uint8

    @property
    def dispatch_quant_block(self) -> int:
        """Elements per scale of in-kernel dispatch quantization (0: none)."""
        return load_specs().quants[self.dispatch_quant_type].block

    @property
    def combine_quant_block(self) -> int:
        """Elements per scale of the combine wire compression (0: none or fp8_direct_cast)."""
        return load_specs().quants[self.quant_type].block

    @property
    def topology_names(self) -> tuple[str, ...]:
        """Spec topologies this config may run on ("auto" internode may use either kernel)."""
        if not self.is_internode:
            return ("intranode",)
        return {"v2": ("internode_v2",), "v2_ll": ("internode_v2_ll",)}.get(
            self.internode_kernel, ("internode_v2", "internode_v2_ll"))

    def launch_override(self, role: str, tokens: int, wave: int) -> tuple[int, int]:
        """(blocks, threads) overrides of a call (0: specs/tuning.toml); see aliases.launch_override."""
        return aliases.launch_override(self, role, tokens, wave)

    def launch_thread_overrides(self, role: str, wave: int) -> set[int]:
        """Every thread count the overrides can launch ``role`` with (empty: specs/tuning.toml decides)."""
        return aliases.launch_thread_overrides(self, role, wave)

    @property
    def key(self) -> tuple:
        """A hashable summary of every field (and the resolved backend); made once, at construction."""
        return self._key

    # --- validation ----------------------------------------------------------------------------
    def _fail(self, field: str, msg: str) -> ConfigError:
        return ConfigError(f"{field}={getattr(self, field)!r}: {msg}")

    def _check_types(self) -> None:
        ints = ("rank", "world_size", "hidden_dim", "max_num_inp_token_per_rank", "num_experts_per_rank",
                "num_experts_per_token", "scale_dim", "scale_type_size", "max_total_recv_tokens",
                "gpu_per_node", "internode_auto_ll_max_tokens", "expert_capacity", "launch_blocks",
                "launch_threads", "expert_alignment", "grouped_capacity", "max_inflight")
        for f in ints:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int):
                raise self._fail(f, "must be an int")
        for f in ("quant_type", "dispatch_quant_type", "internode_kernel", "intranode_protocol", "launch_rows"):
            if not isinstance(getattr(self, f), str):
                raise self._fail(f, "must be a str")
        for f in ("combine_mode", "kernel_backend"):
            v = getattr(self, f)
            if v is not None and not isinstance(v, str):
                raise self._fail(f, "must be a str or None")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)):
            raise self._fail("timeout_s", "must be a number of seconds (int or float)")
        for f in ("enable_std_moe", "strict_capacity", "enable_grouped_layout", "grouped_dequantize"):
            if not isinstance(getattr(self, f), bool):
                raise self._fail(f, "must be a bool")
        if not isinstance(self.data_type, torch.dtype):
            raise self._fail("data_type", "must be a torch.dtype")
        for f in ("dispatch_data_type", "combine_data_type"):
            v = getattr(self, f)
            if v is not None and not isinstance(v, torch.dtype):
                raise self._fail(f, "must be a torch.dtype or None")

    def _check_ranges(self) -> None:
        for f, (least, most, why) in INT_RANGES.items():
            v = getattr(self, f)
            if v < least:
                raise self._fail(f, "must be positive" if least == 1 else f"must be >= {least}")
            if v > most:
                raise self._fail(f, f"must be at most {most} ({why})")
        if self.launch_rows not in ("", "wave", "block"):
            raise self._fail("launch_rows", f"must be 'wave', 'block' or '' (specs/tuning.toml), got {self.launch_rows!r}")
        if self.launch_threads % 32 or self.launch_threads > 1024:
            raise self._fail("launch_threads", "must be a multiple of 32 and at most 1024 (0: specs/tuning.toml)")
        try:
            finite = math.isfinite(self.timeout_s)
        except OverflowError:  # an int too large for a float
            finite = False
        if not (finite and self.timeout_s > 0):
            raise self._fail("timeout_s", "must be > 0 and finite (seconds a device-side wait may last)")
        if not 0 <= self.rank < self.world_size:
            raise self._fail("rank", f"must be in [0, world_size={self.world_size})")
        if self.world_size % self.resolved_gpu_per_node:
            raise self._fail("gpu_per_node", f"world_size={self.world_size} must be a multiple of gpu_per_node")
        if self.max_total_recv_tokens > self.worst_case_recv_tokens:
            raise self._fail("max_total_recv_tokens",
                             f"must be <= the worst case world_size * max_num_inp_token_per_rank = "
                             f"{self.worst_case_recv_tokens} (0 selects the worst case)")
        if 0 < self.max_total_recv_tokens < self.world_size:
            raise self._fail("max_total_recv_tokens",
                             f"capacity smaller than one token per rank: must be >= world_size={self.world_size} "
                             f"(0 selects the worst case)")
        if self.num_experts > INT32_MAX:
            raise self._fail("num_experts_per_rank", f"num_experts = world_size x num_experts_per_rank = "
                                                     f"{self.num_experts}: expert ids are int32 (must be < 2^31)")
        if self.num_experts_per_token > self.num_experts:
            raise self._fail("num_experts_per_token",
                             f"must be <= num_experts = world_size x num_experts_per_rank = {self.num_experts} "
                             f"(a token's top-k picks k of the experts)")
        # routing handles number rows in int32: slot * world + rank, rank * T + token, (row, k) pairs
        for what, n in (("max_total_recv_tokens (resolved) x world_size", self.max_recv_tokens * self.world_size),
                        ("max_num_inp_token_per_rank x world_size", self.worst_case_recv_tokens),
                        ("max_total_recv_tokens (resolved) x num_experts_per_token",
                         self.max_recv_tokens * self.num_experts_per_token),
                        ("num_experts_per_rank x expert capacity (resolved)",
                         self.num_experts_per_rank * self.resolved_expert_capacity),
                        ("grouped_capacity (resolved)",
                         self.resolved_grouped_capacity if self.enable_grouped_layout else 0)):
            if n >= 2 ** 31:
                raise self._fail("max_num_inp_token_per_rank", f"{what} = {n}: row numbers are int32 (must be < 2^31)")
        rows = max(self.max_recv_tokens, self.max_num_inp_token_per_rank)
        size = max(self.data_type.itemsize, self.combine_dtype.itemsize)
        if rows * self.hidden_dim * size >= 2 ** 63:
            raise self._fail("hidden_dim", f"a buffer of {rows} rows x hidden_dim x {size} bytes = "
                                           f"{rows * self.hidden_dim * size} bytes: no tensor is that large (< 2^63)")
        if self.expert_capacity > self.max_recv_tokens:
            raise self._fail("expert_capacity", f"must be <= max_recv_tokens={self.max_recv_tokens} (rows per local "
                                                f"expert in the standard-MoE layout; 0 selects max_recv_tokens)")
        if self.grouped_capacity % self.expert_alignment:
            raise self._fail("grouped_capacity", f"must be a multiple of expert_alignment={self.expert_alignment} "
                                                 f"(rows of the grouped layout; 0 selects the worst case)")
        if self.grouped_capacity > self.worst_case_grouped_rows:
            raise self._fail("grouped_capacity", f"must be <= the worst case {self.worst_case_grouped_rows} rows "
                                                 f"(max_recv_tokens x num_experts_per_token pairs, each of the "
                                                 f"num_experts_per_rank groups padded to a multiple of "
                                                 f"expert_alignment={self.expert_alignment}; 0 selects it)")

    def _check_names(self) -> None:
        specs = load_specs()
        if self.combine_mode is not None and self.combine_mode not in COMBINE_MODES:
            raise self._fail("combine_mode", f"must be one of {', '.join(map(repr, COMBINE_MODES))} or None")
        if self.quant_type not in specs.quants:
            raise self._fail("quant_type", f"must be one of {', '.join(map(repr, specs.quants))} (specs/quant.toml)")
        dq_names = [q for q in DISPATCH_QUANT_TYPES if q in specs.quants]
        if self.dispatch_quant_type not in dq_names:
            raise self._fail("dispatch_quant_type", f"must be one of {', '.join(map(repr, dq_names))}")
        if self.internode_kernel not in INTERNODE_KERNELS:
            raise self._fail("internode_kernel", f"must be one of {', '.join(map(repr, INTERNODE_KERNELS))}")
        if self.intranode_protocol not in INTRANODE_PROTOCOLS:
            raise self._fail("intranode_protocol", f"must be one of {', '.join(map(repr, INTRANODE_PROTOCOLS))}")
        if self.kernel_backend is not None and self.kernel_backend not in KERNEL_BACKENDS:
            raise self._fail("kernel_backend", f"must be one of {', '.join(map(repr, KERNEL_BACKENDS))} or None")
        env = os.environ.get(BACKEND_ENV)
        if env and env not in KERNEL_BACKENDS:
            raise ConfigError(f"environment {BACKEND_ENV}={env!r}: must be one of "
                              f"{', '.join(map(repr, KERNEL_BACKENDS))} (or unset)")
        supported = {"data_type": BUILT_DTYPES, "dispatch_data_type": BUILT_DTYPES + PAYLOAD_DTYPES,
                     "combine_data_type": BUILT_DTYPES}
        for f in ("data_type", "dispatch_data_type", "combine_data_type"):
            v = getattr(self, f)
            if v is not None and spec_dtype(v) is None:
                raise self._fail(f, f"unknown dtype; supported in this release: {_dtype_list(supported[f])}")
        if (self.dispatch_data_type is None) != (self.combine_data_type is None):
            raise ConfigError(f"dispatch_data_type={self.dispatch_data_type!r}, combine_data_type="
                              f"{self.combine_data_type!r}: set both or neither")

    def _combine_mode_words(self) -> str:
        if self.combine_mode is not None:
            return f"combine_mode={self.combine_mode!r}"
        return f"combine_mode=None (resolved to {self.resolved_combine_mode!r} for quant_type={self.quant_type!r})"

    def _check_dtypes(self) -> None:
        built = _dtype_list(BUILT_DTYPES)
        if spec_dtype(self.data_type).name not in BUILT_DTYPES:
            raise self._fail("data_type", f"must be the model dtype, {built} (an fp8/fp4 payload is "
                                          f"dispatch_data_type, with combine_data_type {built})")
        dd = self.dispatch_data_type
        if dd is None:
            return
        if self.dispatch_quant_type != "none":
            raise self._fail("dispatch_quant_type", f"in-kernel quantization takes a data_type payload: "
                                                    f"dispatch_data_type must be None, got {dd}")
        if not self.prequantized:  # a bf16/fp32 payload: the model dtype itself
            for f in ("dispatch_data_type", "combine_data_type"):
                v = getattr(self, f)
                if v != self.data_type:
                    raise self._fail(f, f"must equal data_type={self.data_type} for a bf16/fp32 payload "
                                        f"(dtype conversion on the wire is not built yet)")
            return
        if spec_dtype(self.combine_data_type).name not in BUILT_DTYPES:
            raise self._fail("combine_data_type", f"with a {dd} payload, combine_data_type must be {built}")
        if spec_dtype(dd).kind == "fp4" and self.hidden_dim % 2:
            raise self._fail("hidden_dim", f"a {dd} payload packs two values per byte: hidden_dim must be even")
        if self.resolved_combine_mode != "gather":
            raise ConfigError(f"{self._combine_mode_words()}: a pre-quantized {dd} payload "
                              f"(dispatch_data_type) combines with combine_mode='gather' only")

    def _check_scales(self) -> None:
        if not self.prequantized:
            for f in ("scale_dim", "scale_type_size"):
                if getattr(self, f):
                    raise self._fail(f, f"must be 0 for a {self.dispatch_dtype} payload "
                                        f"(scales are for fp8/fp4 payloads)")
            return
        dd = self.dispatch_data_type
        if self.scale_dim == 0:
            raise self._fail("scale_dim", f"a {dd} payload needs scales: scale_dim must be > 0 "
                                          f"(scale columns per token)")
        if self.scale_type_size not in SCALE_TYPE_SIZES:
            raise self._fail("scale_type_size", f"must be 1 (e8m0 bytes, torch.uint8) or 4 (torch.float32) "
                                                f"for a {dd} payload")

    def _check_block(self, field: str) -> None:
        name = getattr(self, field)
        block = load_specs().quants[name].block
        if block and self.hidden_dim % block:
            raise self._fail("hidden_dim", f"{field}={name!r} scales blocks of {block} elements: hidden_dim "
                                           f"must be a multiple of {block}")

    def _check_quants(self) -> None:
        self._check_block("dispatch_quant_type")
        if self.quant_type != "none" and self.combine_mode == "gather":
            raise self._fail("combine_mode", f"quant_type={self.quant_type!r} forces combine_mode='scatter' "
                                             f"(combine wire compression runs in the scatter combine; "
                                             f"None resolves it)")
        self._check_block("quant_type")

    def rule_fact_groups(self, ll: bool | None = None) -> list[list[dict[str, str]]]:
        """Facts for the spec rule engine: one group per (role, topology) this config may use.

        A group holds the alternatives of a wire that depends on the target (an fp8 quant's wire is
        float8_e4m3fn or float8_e4m3fnuz, whichever the target has natively); the config has no
        target, so a group passes when any alternative passes.

        dispatch: family "dispatch"; a pre-quantized payload is the family's dtype itself
        (dtype = wire = dispatch_data_type, quant none, convert "same"); otherwise dtype =
        data_type, wire = the dispatch_quant_type's wire dtype (data_type for "none"), quant =
        dispatch_quant_type. combine: family combine_<resolved mode>, dtype = the combine dtype,
        wire = the quant_type's wire dtype, quant = quant_type. A family the specs do not declare
        contributes only ``family.role``. ll (None: intranode_protocol == "ll"): the low-latency families
        (dispatch_ll, combine_ll) instead.
        """
        from generator import model as gmodel

        specs = load_specs()
        if ll is None:
            ll = self.intranode_protocol == "ll" and not self.is_internode

        def quant_wires(quant, dtype):
            if quant.wire_kind == "none":
                return [dtype]
            return [d for d in specs.dtypes.values() if d.kind == quant.wire_kind]

        dquant, cquant = specs.quants[self.dispatch_quant_type], specs.quants[self.quant_type]
        cdtype = spec_dtype(self.combine_dtype)
        if self.dispatch_data_type is not None:
            ddtype = spec_dtype(self.dispatch_data_type)
            dwires = [ddtype]
        else:
            ddtype = spec_dtype(self.data_type)
            dwires = quant_wires(dquant, ddtype)
        roles = [
            ("dispatch", "dispatch", ddtype, dwires, dquant),
            ("combine", f"combine_{self.resolved_combine_mode}", cdtype, quant_wires(cquant, cdtype), cquant),
        ]
        if ll:
            roles = [("dispatch", "dispatch_ll", ddtype, dwires, dquant),
                     ("combine", "combine_ll", cdtype, quant_wires(cquant, cdtype), cquant)]
        groups = []
        for role, family, dtype, wires, quant in roles:
            fam = specs.families.get(family)
            for topo in self.topology_names:
                group = []
                for wire in wires:
                    facts = gmodel.combination_facts(family=fam, dtype=dtype, wire=wire, quant=quant, target=None,
                                                     topology=specs.topologies[topo])
                    facts.setdefault("family.role", role)
                    group.append(facts)
                groups.append(group)
        return groups

    def rule_facts(self) -> list[dict[str, str]]:
        """Every alternative of every group of ``rule_fact_groups``, flattened."""
        return [facts for group in self.rule_fact_groups() for facts in group]

    def _rejecting_rule(self, ll: bool | None = None):
        """The first spec rule that rejects this config's kernels (the low-latency ones with ll), or None."""
        from generator import model as gmodel

        rules = load_specs().rules
        for group in self.rule_fact_groups(ll):
            rejected = [gmodel.rejecting_rule(rules, facts) for facts in group]
            if all(r is not None for r in rejected):
                return rejected[0]
        return None

    def _check_rules(self) -> None:
        rule = self._rejecting_rule()
        if rule is not None:
            raise ConfigError(f"{rule.name}: {rule.message}")

    def ll_unavailable(self) -> str | None:
        """Why the low-latency intranode protocol cannot run this config (None: it can)."""
        from generator.abi import LL_MAX_TOKENS

        if self.is_internode:
            return (f"it is intranode only (world_size={self.world_size} > gpu_per_node={self.gpu_per_node} "
                    f"is internode)")
        if self.resolved_combine_mode != "gather":
            return f"{self._combine_mode_words()}: it combines with the gather combine's arithmetic only"
        if self.max_num_inp_token_per_rank > LL_MAX_TOKENS:
            return (f"max_num_inp_token_per_rank={self.max_num_inp_token_per_rank}: it takes at most "
                    f"{LL_MAX_TOKENS} tokens per rank")
        rule = self._rejecting_rule(ll=True)
        return None if rule is None else f"{rule.name}: {rule.message}"

    @property
    def intranode_protocols(self) -> tuple[str, ...]:
        """The intranode wire protocols this config may take ("ll", "bw"; none internode): under "auto" both when
        it can run "ll"; which one an op takes is decided at its construction (runtime.ll.resolve, by the token
        bound and the target's threshold), one for all its calls."""
        if self.is_internode:
            return ()
        if self.intranode_protocol == "auto":
            return ("ll", "bw") if self.ll_unavailable() is None else ("bw",)
        return (self.intranode_protocol,)

    def _check_built(self) -> None:
        if self.intranode_protocol == "ll":
            why = self.ll_unavailable()
            if why is not None:
                raise ConfigError(f"intranode_protocol='ll': the low-latency protocol cannot run this config: {why}")
        if self.grouped_dequantize and not (self.enable_grouped_layout and self.dispatch_quant_type != "none"):
            raise ConfigError(f"grouped_dequantize=True: dequantizes the grouped layout of a dispatch quantized in the "
                              f"kernel; this config has enable_grouped_layout={self.enable_grouped_layout}, "
                              f"dispatch_quant_type={self.dispatch_quant_type!r} (needs enable_grouped_layout=True and "
                              f"dispatch_quant_type 'fp8_blockwise' or 'fp4_blockwise')")
        if self.enable_grouped_layout and self.is_internode:
            raise ConfigError(f"enable_grouped_layout=True: the grouped layout is intranode only in this release; "
                              f"world_size={self.world_size} > gpu_per_node={self.gpu_per_node} is internode")
        if self.enable_std_moe and self.is_internode:
            raise ConfigError(f"enable_std_moe=True: the standard-MoE layout conversion is intranode only; "
                              f"world_size={self.world_size} > gpu_per_node={self.gpu_per_node} is internode")
        if self.is_internode and self.resolved_combine_mode != "gather":
            raise ConfigError(f"{self._combine_mode_words()}: internode (world_size={self.world_size} > "
                              f"gpu_per_node={self.gpu_per_node}) combines with combine_mode='gather' only "
                              f"(the scatter combine is intranode only)")

    def _resolve_backend(self) -> str:
        env = os.environ.get(BACKEND_ENV)
        if env:
            return env
        if self.kernel_backend is not None:
            return self.kernel_backend
        return "native" if torch.cuda.is_available() else "torch"


FIELDS: tuple[str, ...] = tuple(f.name for f in attrs.fields(EpDispatchCombineConfig) if f.init)
