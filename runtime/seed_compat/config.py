"""The seed library's EPv2 config (``mori.ops.dispatch_combine_v2.EpDispatchCombineConfig``) and how it maps
onto epgen's own config.

The seed's config is a mutable dataclass (positional arguments, fields assignable after construction, e.g.
``cfg.schedule = lookup(...)["schedule"]``); epgen's is frozen. So this class is the seed's, with the seed's
fields, checks and properties, and the op builds epgen's config from it when it is constructed
(``epgen_plan``): a snapshot of the fields at that moment.

How the seed's payloads ride on epgen's (``Plan``):
  * bf16/fp32 rows, no scales: epgen's plain op, the same dtype.
  * bf16/fp32 rows with per-token scales (``scale_dim * scale_type_size`` opaque bytes, moved as whole int32
    dwords like the seed's): epgen moves no scales with a bf16/fp32 payload, so the bytes travel as extra columns of each row
    (``extra_cols``, zero in the combine) and are cut off again.
  * fp8/fp4 dispatch (``dispatch_data_type``, or a symmetric ``data_type``): epgen's pre-quantized payload,
    moved verbatim (an fp8 payload in the native target's e4m3 flavour, the bytes unchanged); with no seed
    scales a one-byte dummy scale column rides along (epgen's pre-quantized payload always carries scales).
  * a symmetric fp8/fp4 op (``data_type`` fp8/fp4): combine takes and returns the fp8/fp4 dtype; epgen has no
    fp8/fp4 combine, so the rows are decoded exactly to float32, combined by epgen's float32 gather combine
    (a float32 sum, in epgen's order) and rounded once to the fp8/fp4 dtype (round to nearest even,
    saturating at the format's largest finite value).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ..aliases import SeedDtypeMembers
from ..config import EpDispatchCombineConfig as EpgenConfig, load_specs
from ..errors import ConfigError

SEED_BACKENDS = ("flydsl", "hip")  # the seed's kernel backends (profiles here: what each accepts and offers)
EPGEN_BACKENDS = ("torch", "native")  # epgen's, also accepted as kernel_backend (the flydsl profile)
DEFAULT_BACKEND = "flydsl"  # the seed's default
SEED_BACKEND_ENV = "MORI_V2_KERNEL_BACKEND"  # the seed's environment variable, read for the profile name
QUANT_TYPES = ("none", "fp8_direct_cast", "fp8_blockwise")  # the seed's
FP8 = (torch.float8_e4m3fnuz, torch.float8_e4m3fn)
FP4 = torch.float4_e2m1fn_x2
_NBYTES = {torch.bfloat16: 2, torch.float32: 4, torch.float8_e4m3fnuz: 1, torch.float8_e4m3fn: 1}
MAX_WORLD = 64  # the seed's intranode op: world_size <= 64


@dataclasses.dataclass
class EpDispatchCombineConfig(SeedDtypeMembers):
    """The seed's EPv2 config: its fields, defaults, checks and properties (docs/SEED_COMPAT.md)."""

    rank: int
    world_size: int
    hidden_dim: int
    max_num_inp_token_per_rank: int
    num_experts_per_rank: int
    num_experts_per_token: int
    data_type: torch.dtype = torch.bfloat16
    dispatch_data_type: torch.dtype = None
    combine_data_type: torch.dtype = None
    scale_dim: int = 0
    scale_type_size: int = 0
    combine_mode: str = "gather"
    quant_type: str = "none"
    dispatch_block_num: int = None
    combine_block_num: int = None
    warp_num_per_block: int = None
    combine_warp_num_per_block: int = None
    schedule: tuple = None
    enable_std_moe: bool = False
    max_total_recv_tokens: int = 0
    kernel_backend: str = None
    # the seed's later (internode) fields
    gpu_per_node: int = None
    internode_kernel: str = "auto"
    internode_auto_ll_max_tokens: int = 512
    num_qp_per_pe: int = 1
    dispatch_rdma_block_num: int = None
    combine_rdma_block_num: int = None
    max_token_type_size: int = 0

    def __post_init__(self):
        for name in ("rank", "world_size", "hidden_dim", "max_num_inp_token_per_rank", "num_experts_per_rank",
                     "num_experts_per_token", "scale_dim", "scale_type_size", "max_total_recv_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name}={value!r}: must be an int")
        for name in ("data_type", "dispatch_data_type", "combine_data_type"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise ConfigError(f"{name}={value!r}: must be a torch.dtype" + ("" if name == "data_type" else " or None"))
        if (self.dispatch_data_type is None) != (self.combine_data_type is None):
            raise ConfigError(f"dispatch_data_type / combine_data_type must be set together (all-or-none): got "
                              f"dispatch_data_type={self.dispatch_data_type}, combine_data_type={self.combine_data_type}")
        if self.quant_type not in QUANT_TYPES:
            raise ConfigError(f"quant_type must be one of {QUANT_TYPES}, got {self.quant_type!r}")
        if self.combine_mode not in ("gather", "scatter"):
            raise ConfigError(f"combine_mode must be gather|scatter, got {self.combine_mode!r}")
        if self.quant_type != "none":
            self.combine_mode = "scatter"  # the seed's switch: combine wire compression runs in the scatter combine
        if self.world_size > MAX_WORLD:
            raise ConfigError(f"intranode op supports world_size <= {MAX_WORLD}, got {self.world_size}")
        for name in ("dispatch_dtype", "combine_dtype"):
            if getattr(self, name) not in (*_NBYTES, FP4):
                raise ConfigError(f"{name}={getattr(self, name)}: must be torch.bfloat16, torch.float32, an fp8 "
                                  f"e4m3 dtype or torch.float4_e2m1fn_x2")
        if self.token_nbytes % 16:
            raise ConfigError(f"per-token transport bytes must be 16 B aligned; hidden_dim={self.hidden_dim}, "
                              f"dispatch_dtype={self.dispatch_dtype} -> token_nbytes={self.token_nbytes}")
        if self.is_asymmetric_dtype:
            if self.combine_mode != "gather" or self.quant_type != "none" or self.enable_std_moe:
                raise ConfigError("combine_data_type (asymmetric dtype) requires combine_mode=gather, "
                                  "quant_type=none, enable_std_moe=False")
            if self.combine_dtype == FP4:
                raise ConfigError("asymmetric combine dtype does not support fp4 (fp4 dispatch + bf16 combine is "
                                  "supported; fp4 combine is not)")
            if self.combine_token_nbytes % 16:
                raise ConfigError(f"combine per-token bytes must be 16 B aligned; combine_data_type="
                                  f"{self.combine_data_type} -> {self.combine_token_nbytes}")

    # --- the seed's properties -------------------------------------------------------------------
    @property
    def is_scatter(self) -> bool:
        return self.combine_mode == "scatter"

    @property
    def combine_scale_dim(self) -> int:
        return self.hidden_dim // 128 if self.fp8_blockwise else 0

    @property
    def wire_elem_size(self) -> int:
        return 1 if self.quant_type != "none" else self.elem_size

    @property
    def dispatch_dtype(self) -> torch.dtype:
        return self.data_type if self.dispatch_data_type is None else self.dispatch_data_type

    @property
    def combine_dtype(self) -> torch.dtype:
        return self.data_type if self.combine_data_type is None else self.combine_data_type

    @property
    def max_recv(self) -> int:
        return self.world_size * self.max_num_inp_token_per_rank

    @property
    def effective_max_recv_per_rank(self) -> int:
        if self.max_total_recv_tokens <= 0:
            return self.max_num_inp_token_per_rank
        return min(-(-self.max_total_recv_tokens // self.world_size), self.max_num_inp_token_per_rank)

    @property
    def effective_max_recv(self) -> int:
        """Rows of the receive buffers and the receive cap (the seed's: max_total_recv_tokens rounded up to a
        multiple of world_size, at most the worst case)."""
        return self.world_size * self.effective_max_recv_per_rank

    @property
    def scale_bytes(self) -> int:
        """Bytes of one token's scales (opaque to the op), and the int32 dwords the seed returns them in."""
        return self.scale_dim * self.scale_type_size

    @property
    def scale_num_i32(self) -> int:
        return -(-self.scale_bytes // 4)

    @property
    def scale_wire_bytes(self) -> int:
        """Bytes moved per token: whole int32 dwords, as the seed's kernels copy them."""
        return 4 * self.scale_num_i32

    @property
    def is_internode(self) -> bool:
        return self.world_size > (self.gpu_per_node or self.world_size)

    @property
    def nodes(self) -> int:
        return self.world_size // (self.gpu_per_node or self.world_size)

    @classmethod
    def tuned(cls, **kwargs):
        """The seed's tuned constructor: the geometry fields not given come from ``tuning_configs.lookup``."""
        from .tuning_configs import lookup

        probe = cls(**kwargs)
        for key, value in lookup(probe.world_size, probe.hidden_dim, probe.num_experts_per_token,
                                 dtype=probe.dtype_str).items():
            kwargs.setdefault(key, value)
        return cls(**kwargs)

    # --- epgen ------------------------------------------------------------------------------------
    def requested_backend(self) -> str:
        """The kernel backend this config asks for: kernel_backend, else MORI_V2_KERNEL_BACKEND, else flydsl."""
        name = self.kernel_backend or os.environ.get(SEED_BACKEND_ENV) or DEFAULT_BACKEND
        if name not in SEED_BACKENDS + EPGEN_BACKENDS:
            raise ConfigError(f"unknown kernel backend {name!r}; known: {sorted(SEED_BACKENDS)} (the seed's) and "
                              f"{sorted(EPGEN_BACKENDS)} (epgen's)")
        return name


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one seed config runs on epgen: the epgen config and the shape of the adaptation."""

    config: EpgenConfig
    extra_cols: int  # bf16/fp32 rows widened by this many columns to carry the seed's scale bytes
    dummy_scales: bool  # a pre-quantized payload without seed scales: one zero byte per token rides along
    combine_codec: torch.dtype | None  # symmetric fp8/fp4 op: combine decodes to float32 and rounds back to this
    wire_dtype: torch.dtype  # the dtype epgen's dispatch moves (the seed's, or the native target's e4m3)


def _hip_unsupported(cfg: EpDispatchCombineConfig) -> list[str]:
    """What the seed's hip backend refuses at construction (its contract: gather, bf16/fp32 combine)."""
    bad = []
    if cfg.combine_dtype not in (torch.bfloat16, torch.float32):
        bad.append(f"combine dtype {cfg.combine_dtype} (have bf16, fp32)")
    if cfg.is_scatter:
        bad.append("combine_mode='scatter' (gather only)")
    if cfg.quant_type != "none":
        bad.append(f"quant_type={cfg.quant_type!r}")
    if cfg.enable_std_moe:
        bad.append("enable_std_moe")
    if cfg.scale_dim and cfg.scale_type_size:
        bad.append("per-token scales forwarding")
    if cfg.effective_max_recv < cfg.max_recv:
        bad.append(f"max_total_recv_tokens below the worst case ({cfg.effective_max_recv} < {cfg.max_recv}); "
                   f"token dropping is not implemented")
    return bad


def _native_fp8(device_index: int | None = None) -> torch.dtype:
    """The e4m3 flavour of the current GPU's spec target (float8_e4m3fnuz on gfx942)."""
    from ..kernels import device_arch

    device = torch.device("cuda", torch.cuda.current_device() if device_index is None else device_index)
    target = load_specs().targets.get(device_arch(device))
    return torch.float8_e4m3fnuz if target is not None and target.fp8_e4m3 == "fnuz" else torch.float8_e4m3fn


def _extra_cols(cfg: EpDispatchCombineConfig) -> int:
    """Columns that carry scale_bytes per row: whole 8-column groups (the native kernels' vector width), whole
    quantization blocks when the combine compresses blockwise (the extra block quantizes on its own)."""
    if not cfg.scale_bytes:
        return 0
    unit = {"fp8_blockwise": 128}.get(cfg.quant_type, 8)
    per = unit * cfg.elem_size
    return -(-cfg.scale_wire_bytes // per) * unit


def epgen_plan(cfg: EpDispatchCombineConfig, backend: str) -> Plan:
    """The epgen config (and adaptation) for the seed config as it is now; ``backend`` the requested name.

    Raises ConfigError for what the seed's backend of that name refuses, and for seed configs epgen cannot
    run (each named, docs/SEED_COMPAT.md)."""
    if backend == "hip":
        bad = _hip_unsupported(cfg)
        if bad:
            raise ConfigError("hip backend cannot serve this config:\n  " + "\n  ".join(bad))
    d, c = cfg.dispatch_dtype, cfg.combine_dtype
    low = d in FP8 or d == FP4
    if (d in FP8 or d == FP4) and cfg.is_scatter:
        raise ConfigError("plain fp4/fp8 token dtype is gather-only (fp8 quant uses quant_type=fp8_direct_cast, "
                          "not data_type)")
    if not low and c != d:
        raise ConfigError(f"dispatch dtype {d} with combine dtype {c}: a bf16 <-> fp32 conversion between dispatch "
                          f"and combine is not built in epgen (its bf16/fp32 payloads keep one dtype); see "
                          f"docs/SEED_COMPAT.md")
    if cfg.enable_std_moe and (low or cfg.scale_bytes):
        raise ConfigError("enable_std_moe with fp8/fp4 tokens or per-token scales: epgen's standard-MoE layout "
                          "takes bf16/fp32 rows without scales (the seed's takes bf16 only)")
    if cfg.scale_bytes and cfg.scale_type_size not in (1, 2, 4, 8):
        raise ConfigError(f"scale_type_size={cfg.scale_type_size}: must be the bytes of one scale (1, 2, 4 or 8)")
    fields = dict(rank=cfg.rank, world_size=cfg.world_size, hidden_dim=cfg.hidden_dim,
                  max_num_inp_token_per_rank=cfg.max_num_inp_token_per_rank,
                  num_experts_per_rank=cfg.num_experts_per_rank, num_experts_per_token=cfg.num_experts_per_token,
                  quant_type=cfg.quant_type, combine_mode=cfg.combine_mode, enable_std_moe=cfg.enable_std_moe,
                  max_total_recv_tokens=cfg.effective_max_recv if cfg.max_total_recv_tokens > 0 else 0,
                  kernel_backend=backend if backend in EPGEN_BACKENDS else None,
                  gpu_per_node=cfg.gpu_per_node, internode_kernel=cfg.internode_kernel,
                  internode_auto_ll_max_tokens=cfg.internode_auto_ll_max_tokens, num_qp_per_pe=cfg.num_qp_per_pe,
                  dispatch_rdma_block_num=cfg.dispatch_rdma_block_num,
                  combine_rdma_block_num=cfg.combine_rdma_block_num, max_token_type_size=cfg.max_token_type_size,
                  dispatch_block_num=cfg.dispatch_block_num, combine_block_num=cfg.combine_block_num,
                  warp_num_per_block=cfg.warp_num_per_block,
                  combine_warp_num_per_block=cfg.combine_warp_num_per_block, schedule=cfg.schedule)
    extra, codec = 0, None
    if not low:
        extra = _extra_cols(cfg)
        fields.update(data_type=d, hidden_dim=cfg.hidden_dim + extra)
    else:
        codec = c if c == d else None
        model = torch.float32 if codec is not None else c
        fields.update(data_type=model, dispatch_data_type=d, combine_data_type=model,
                      scale_dim=cfg.scale_wire_bytes or 1, scale_type_size=1)
    ecfg = EpgenConfig(**fields)
    wire = d
    if d in FP8 and ecfg.resolved_backend == "native" and torch.cuda.is_available():
        wire = _native_fp8()
        if wire != d:
            ecfg = EpgenConfig(**{**fields, "dispatch_data_type": wire})
    return Plan(ecfg, extra, low and not cfg.scale_bytes, codec, wire)



def fp_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 e4m3 dtype or of e2m1 (6)."""
    return 6.0 if dtype == FP4 else float(torch.finfo(dtype).max)
