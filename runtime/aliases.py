"""The seed library's spellings that epgen's own config and op accept (DESIGN.md: the config's field names
follow the seed's EPv2 config): the seed's config fields and what each maps to (``SEED_FIELDS``), their
converters and checks, the launch-geometry aliases, the seed's config properties (``SeedConfigMembers``) and
the op's seed-style arguments. Part of the core: config.py and op.py import it; it imports only errors. The
drop-in package for seed code is runtime/seed_compat/, which sits on top of the core."""


from __future__ import annotations

import torch

from .errors import ConfigError

# The seed's config fields that epgen does not have under the same name, and what epgen does with each.
#   alias:   mapped onto epgen's launch geometry (per role; see launch_override)
#   ignored: accepted (validated as the seed's type), no effect, for the reason given
SEED_FIELDS = {
    "dispatch_block_num": ("alias", "dispatch grid (blocks); epgen: launch_blocks / specs/tuning.toml"),
    "combine_block_num": ("alias", "combine grid (blocks); epgen: launch_blocks / specs/tuning.toml"),
    "warp_num_per_block": ("alias", "dispatch threads = warps x the device's wave size; epgen: launch_threads"),
    "combine_warp_num_per_block": ("alias", "combine threads = warps x wave size; epgen: launch_threads"),
    "schedule": ("alias", "per-token-count buckets (max_tokens | None, dispatch blocks, dispatch warps, "
                          "combine blocks, combine warps); epgen: the buckets of specs/tuning.toml"),
    "num_qp_per_pe": ("ignored", "RDMA queue pairs per peer: epgen's internode path moves rows with "
                                 "NCCL/RCCL all_to_all_single, it opens no queue pairs of its own"),
    "dispatch_rdma_block_num": ("ignored", "blocks driving RDMA in the dispatch: epgen's internode kernels "
                                           "only pack and unpack rows around NCCL/RCCL"),
    "combine_rdma_block_num": ("ignored", "blocks driving RDMA in the combine: as dispatch_rdma_block_num"),
    "max_token_type_size": ("ignored", "bytes of the widest token type, for buffer sizing: epgen sizes its "
                                       "buffers from data_type / dispatch_data_type / combine_data_type"),
}
# The declared range of each of them (int32 counts; warps x the wave size is at most 1024 threads per block).
_WARPS = (1, 32, "warps per block: at most 1024 threads of 32-lane waves")
SEED_RANGES = {
    "dispatch_block_num": (1, 2 ** 31 - 1, "blocks: an int32 count"),
    "combine_block_num": (1, 2 ** 31 - 1, "blocks: an int32 count"),
    "warp_num_per_block": _WARPS, "combine_warp_num_per_block": _WARPS,
    **{f: (0, 2 ** 31 - 1, "an int32 count") for f in ("num_qp_per_pe", "dispatch_rdma_block_num",
                                                       "combine_rdma_block_num", "max_token_type_size")},
}
SCHEDULE_RANGES = ((1, 2 ** 31 - 1), (1, 2 ** 31 - 1), _WARPS[:2], (1, 2 ** 31 - 1), _WARPS[:2])  # per bucket field
SEED_KERNEL_BACKENDS = {"hip": "native", "flydsl": "native"}  # the seed's GPU kernel backends -> epgen's
_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
_FP4 = getattr(torch, "float4_e2m1fn_x2", None)


def _nbytes(dtype: torch.dtype) -> int:
    return 1 if dtype == _FP4 else dtype.itemsize  # fp4: the seed's nominal 1 (two values per byte)


def gpu_per_node(value):
    """The seed's ``gpu_per_node=None`` (its default: one node) is epgen's 0."""
    return 0 if value is None else value


def kernel_backend(value):
    """The seed's kernel_backend names ("hip", "flydsl": its GPU kernels) -> epgen's "native"."""
    return SEED_KERNEL_BACKENDS.get(value, value) if isinstance(value, str) else value


def schedule(value):
    """A schedule given as lists (JSON, say) -> tuples, so the config stays hashable."""
    if isinstance(value, (list, tuple)):
        return tuple(tuple(b) if isinstance(b, (list, tuple)) else b for b in value)
    return value


def check_seed_fields(cfg) -> None:
    """Validate the seed's fields of an epgen config (types, ranges, no clash with launch_*)."""
    def fail(field, msg):
        return ConfigError(f"{field}={getattr(cfg, field)!r}: {msg}")

    for name in SEED_FIELDS:
        value = getattr(cfg, name)
        if value is None or name == "schedule":
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail(name, "must be an int or None (the seed's field)")
        least, most, why = SEED_RANGES[name]
        if value < least:
            raise fail(name, f"must be >= {least} or None")
        if value > most:
            raise fail(name, f"must be at most {most} ({why})")
    if cfg.schedule is not None:
        buckets = cfg.schedule
        ok = isinstance(buckets, tuple) and buckets and all(
            isinstance(b, tuple) and len(b) == 5 and all(
                (i == 0 and v is None) or _in(v, *SCHEDULE_RANGES[i]) for i, v in enumerate(b)) for b in buckets)
        if not ok:
            raise fail("schedule", "must be a non-empty sequence of (max_tokens or None, dispatch blocks, dispatch "
                                   "warps, combine blocks, combine warps) with positive ints (the seed's schedule; "
                                   "max_tokens and blocks at most 2^31 - 1, warps at most 32)")
    pinned = [n for n, (kind, _) in SEED_FIELDS.items() if kind == "alias" and getattr(cfg, n) is not None]
    if pinned and (cfg.launch_blocks or cfg.launch_threads):
        raise ConfigError(f"{', '.join(pinned)} (the seed's launch geometry) and launch_blocks / launch_threads "
                          f"(epgen's) both set: pick one")


def _in(v, least: int, most: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and least <= v <= most


def type_name(value) -> str:
    """The type of `value` as a message names it: `bool`, `numpy.bool`, `torch.Tensor` (never ambiguous)."""
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def as_bool(value):
    """A Python bool for a bool or a numpy bool (np.bool_); anything else is returned as it is."""
    t = type(value)
    return bool(value) if t.__module__ == "numpy" and t.__name__ in ("bool", "bool_") else value


def launch_override(cfg, role: str, tokens: int, wave: int) -> tuple[int, int]:
    """(blocks, threads) a call of ``tokens`` tokens launches with, from epgen's launch_blocks /
    launch_threads or the seed's geometry fields; 0 where neither says (specs/tuning.toml decides).

    The seed's schedule: the first bucket whose max_tokens (None: any) covers the call, else the last;
    its fields dispatch_block_num / warp_num_per_block and combine_block_num / combine_warp_num_per_block
    pin the geometry of every call of that role (a pinned field wins over the schedule, as in the seed).
    Threads are warps x ``wave`` (the device's wave size)."""
    blocks, warps = _seed_geometry(cfg, role, tokens)
    return (cfg.launch_blocks or blocks or 0, cfg.launch_threads or (warps * wave if warps else 0))


def launch_thread_overrides(cfg, role: str, wave: int) -> set[int]:
    """Every thread count the overrides can launch ``role`` with (empty: the tuning table decides)."""
    if cfg.launch_threads:
        return {cfg.launch_threads}
    warps = {w for w in (_seed_geometry(cfg, role, t)[1] for t in _bucket_edges(cfg)) if w}
    return {w * wave for w in warps}


def _bucket_edges(cfg) -> list[int]:
    edges = [b[0] for b in cfg.schedule or () if b[0] is not None]
    return [1] + edges + [e + 1 for e in edges]


def _seed_geometry(cfg, role: str, tokens: int) -> tuple[int | None, int | None]:
    dispatch = role.startswith("dispatch")  # dispatch, dispatch_ll; combine, combine_ll
    blocks = cfg.dispatch_block_num if dispatch else cfg.combine_block_num
    warps = cfg.warp_num_per_block if dispatch else cfg.combine_warp_num_per_block
    if cfg.schedule:
        bucket = next((b for b in cfg.schedule if b[0] is None or tokens <= b[0]), cfg.schedule[-1])
        sb, sw = (bucket[1], bucket[2]) if dispatch else (bucket[3], bucket[4])
        blocks, warps = blocks or sb, warps or sw
    return blocks, warps


class SeedDtypeMembers:
    """The seed config's properties derived from its dtypes and quant_type alone (dispatch_dtype, combine_dtype,
    hidden_dim, quant_type): shared by epgen's config (through SeedConfigMembers) and the seed's own config class
    (runtime/seed_compat/config.py)."""

    @property
    def fp8_direct_cast(self) -> bool:
        return self.quant_type == "fp8_direct_cast"

    @property
    def fp8_blockwise(self) -> bool:
        return self.quant_type == "fp8_blockwise"

    @property
    def is_fp4(self) -> bool:
        return self.dispatch_dtype == _FP4

    @property
    def is_fp8(self) -> bool:
        return self.dispatch_dtype in _FP8

    @property
    def elem_size(self) -> int:
        """Bytes per element of dispatch's input (fp4: a nominal 1, as the seed)."""
        return _nbytes(self.dispatch_dtype)

    @property
    def token_nbytes(self) -> int:
        """Bytes of one token as dispatch takes it (fp4: hidden_dim // 2)."""
        return self.hidden_dim // 2 if self.is_fp4 else self.hidden_dim * self.elem_size

    @property
    def combine_elem_size(self) -> int:
        return _nbytes(self.combine_dtype)

    @property
    def combine_token_nbytes(self) -> int:
        return self.hidden_dim // 2 if self.combine_dtype == _FP4 else self.hidden_dim * self.combine_elem_size

    @property
    def is_asymmetric_dtype(self) -> bool:
        return self.dispatch_dtype != self.combine_dtype

    @property
    def dtype_str(self) -> str:
        """The seed's tuning key: "fp4", "fp4_disp_bf16_comb", "fp8" or "bf16" (fp32 too, as the seed)."""
        if self.is_fp4:
            return "fp4" if self.combine_dtype == _FP4 else "fp4_disp_bf16_comb"
        return "fp8" if self.is_fp8 else "bf16"


class SeedConfigMembers(SeedDtypeMembers):
    """The seed config's public properties, on epgen's EpDispatchCombineConfig (a base class of it).

    Same definitions as the seed's, over epgen's fields; where the two libraries' buffers differ the
    property says what epgen's tensors have (docs/SEED_COMPAT.md)."""

    @property
    def is_scatter(self) -> bool:
        return self.resolved_combine_mode == "scatter"

    @property
    def combine_scale_dim(self) -> int:
        """Scales per token of the combine wire compression (fp8_blockwise: hidden_dim // 128; 0: none)."""
        block = self.combine_quant_block
        return self.hidden_dim // block if block else 0

    @property
    def wire_elem_size(self) -> int:
        """Bytes per element of the combine wire: 1 for a compressed (fp8 or the nominal fp4) wire."""
        return 1 if self.quant_type != "none" else self.combine_elem_size

    @property
    def max_recv(self) -> int:
        """world_size * max_num_inp_token_per_rank (the worst case), as the seed."""
        return self.worst_case_recv_tokens

    @property
    def effective_max_recv(self) -> int:
        """Rows of the receive buffer, what dispatch's outputs have: epgen's max_recv_tokens, which is
        max_total_recv_tokens exactly (the seed rounds it up to a multiple of world_size)."""
        return self.max_recv_tokens

    @property
    def effective_max_recv_per_rank(self) -> int:
        return -(-self.max_recv_tokens // self.world_size)

    @property
    def nodes(self) -> int:
        """Nodes the ranks span: world_size // gpu_per_node (gpu_per_node 0 or None: one)."""
        return self.world_size // self.resolved_gpu_per_node

    @classmethod
    def tuned(cls, **kwargs):
        """The seed's tuned constructor: epgen's plain constructor already takes specs/tuning.toml."""
        return cls(**kwargs)


COMBINE_WEIGHTS = ("values", "fold")


def check_op_args(group, combine_weights) -> None:
    """The op's constructor arguments: a torch.distributed group (the seed passes a CCO Communicator)."""
    if combine_weights not in COMBINE_WEIGHTS:
        raise ConfigError(f"combine_weights={combine_weights!r}: must be one of {', '.join(map(repr, COMBINE_WEIGHTS))}")
    if group is None:
        return
    import torch.distributed as dist

    if not isinstance(group, dist.ProcessGroup):
        raise ConfigError(f"group must be a torch.distributed ProcessGroup or None (WORLD), got {type(group).__name__}: "
                          f"epgen's ranks meet over torch.distributed (the seed's CCO Communicator has no "
                          f"counterpart here; init_process_group and pass None or a group)")


def renamed(call: str, name: str, value, seed_name: str, seed_value):
    """An argument given under epgen's name or the seed's (not both)."""
    from .errors import InputError

    if seed_value is None:
        return value
    if value is not None:
        raise InputError(f"{call}: {name} and {seed_name} (the seed's name for it) both given")
    return seed_value


def forwarded_weights(last: dict):
    """The weight fold's values: the weights the last dispatch forwarded (its out_weights)."""
    from .errors import InputError

    if last["out_w"] is None:
        raise InputError("combine: the weight fold sums the weights dispatch forwarded, but the last dispatch "
                         "had weights=None")
    return last["out_w"]
