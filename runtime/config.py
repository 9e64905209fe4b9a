"""EpDispatchCombineConfig: a frozen, validated description of one EP dispatch/combine op.

Validation runs in ``__attrs_post_init__``, before anything is allocated, in this order:
field types and ranges -> names known to the specs -> the spec rules (specs/rules.toml, through
the generator's rule engine, so the runtime and the generator say the same thing) -> what this
release has not built yet.

Kernel backend precedence (``resolved_backend``), fixed at construction:
  1. the environment variable ``EPGEN_KERNEL_BACKEND`` when set and non-empty (it overrides the field),
  2. the ``kernel_backend`` field when not None,
  3. ``"native"`` when ``torch.cuda.is_available()``, else ``"torch"``.
"""

from __future__ import annotations

import functools
import os

import attrs
import torch

from .errors import ConfigError

BACKEND_ENV = "EPGEN_KERNEL_BACKEND"
KERNEL_BACKENDS = ("native", "torch")
INTERNODE_KERNELS = ("v2", "v2_ll", "auto")
COMBINE_MODES = ("gather", "scatter")

# What this release builds (spec dtype names / modes).
BUILT_DTYPES = ("bf16", "fp32")
BUILT_COMBINE_MODES = ("gather",)
BUILT_QUANT_TYPES = ("none",)


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
class EpDispatchCombineConfig:
    """Static shape and mode of an EP dispatch/combine op (see the module docstring)."""

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
    combine_mode: str = "gather"
    quant_type: str = "none"
    enable_std_moe: bool = False
    max_total_recv_tokens: int = 0  # 0: worst case, world_size * max_num_inp_token_per_rank
    gpu_per_node: int = 0  # 0: world_size (one node)
    internode_kernel: str = "auto"
    internode_auto_ll_max_tokens: int = 512
    kernel_backend: str | None = None  # None: see the module docstring
    _resolved_backend: str = attrs.field(init=False, default="", eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._check_types()
        self._check_ranges()
        self._check_names()
        self._check_scales()
        self._check_rules()
        self._check_built()
        object.__setattr__(self, "_resolved_backend", self._resolve_backend())

    # --- derived values ------------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.world_size * self.num_experts_per_rank

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
    def resolved_backend(self) -> str:
        return self._resolved_backend

    @property
    def dispatch_dtype(self) -> torch.dtype:
        return self.data_type if self.dispatch_data_type is None else self.dispatch_data_type

    @property
    def combine_dtype(self) -> torch.dtype:
        return self.data_type if self.combine_data_type is None else self.combine_data_type

    @property
    def topology_names(self) -> tuple[str, ...]:
        """Spec topologies this config may run on ("auto" internode may use either kernel)."""
        if not self.is_internode:
            return ("intranode",)
        return {"v2": ("internode_v2",), "v2_ll": ("internode_v2_ll",)}.get(
            self.internode_kernel, ("internode_v2", "internode_v2_ll"))

    @property
    def key(self) -> tuple:
        """A hashable summary of every field (and the resolved backend)."""
        return tuple(getattr(self, name) for name in FIELDS) + (self.resolved_backend,)

    # --- validation ----------------------------------------------------------------------------
    def _fail(self, field: str, msg: str) -> ConfigError:
        return ConfigError(f"{field}={getattr(self, field)!r}: {msg}")

    def _check_types(self) -> None:
        ints = ("rank", "world_size", "hidden_dim", "max_num_inp_token_per_rank", "num_experts_per_rank",
                "num_experts_per_token", "scale_dim", "scale_type_size", "max_total_recv_tokens",
                "gpu_per_node", "internode_auto_ll_max_tokens")
        for f in ints:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int):
                raise self._fail(f, "must be an int")
        for f in ("combine_mode", "quant_type", "internode_kernel"):
            if not isinstance(getattr(self, f), str):
                raise self._fail(f, "must be a str")
        if not isinstance(self.enable_std_moe, bool):
            raise self._fail("enable_std_moe", "must be a bool")
        if self.kernel_backend is not None and not isinstance(self.kernel_backend, str):
            raise self._fail("kernel_backend", "must be a str or None")
        if not isinstance(self.data_type, torch.dtype):
            raise self._fail("data_type", "must be a torch.dtype")
        for f in ("dispatch_data_type", "combine_data_type"):
            v = getattr(self, f)
            if v is not None and not isinstance(v, torch.dtype):
                raise self._fail(f, "must be a torch.dtype or None")

    def _check_ranges(self) -> None:
        for f in ("world_size", "hidden_dim", "max_num_inp_token_per_rank", "num_experts_per_rank",
                  "num_experts_per_token", "internode_auto_ll_max_tokens"):
            if getattr(self, f) <= 0:
                raise self._fail(f, "must be positive")
        for f in ("scale_dim", "scale_type_size", "max_total_recv_tokens", "gpu_per_node"):
            if getattr(self, f) < 0:
                raise self._fail(f, "must be >= 0")
        if not 0 <= self.rank < self.world_size:
            raise self._fail("rank", f"must be in [0, world_size={self.world_size})")
        if self.world_size % self.resolved_gpu_per_node:
            raise self._fail("gpu_per_node", f"world_size={self.world_size} must be a multiple of gpu_per_node")
        if self.max_total_recv_tokens > self.worst_case_recv_tokens:
            raise self._fail("max_total_recv_tokens",
                             f"must be <= the worst case world_size * max_num_inp_token_per_rank = "
                             f"{self.worst_case_recv_tokens} (0 selects the worst case)")

    def _check_names(self) -> None:
        specs = load_specs()
        if self.combine_mode not in COMBINE_MODES:
            raise self._fail("combine_mode", f"must be one of {', '.join(map(repr, COMBINE_MODES))}")
        if self.quant_type not in specs.quants:
            raise self._fail("quant_type", f"must be one of {', '.join(map(repr, specs.quants))} (specs/quant.toml)")
        if self.internode_kernel not in INTERNODE_KERNELS:
            raise self._fail("internode_kernel", f"must be one of {', '.join(map(repr, INTERNODE_KERNELS))}")
        if self.kernel_backend is not None and self.kernel_backend not in KERNEL_BACKENDS:
            raise self._fail("kernel_backend", f"must be one of {', '.join(map(repr, KERNEL_BACKENDS))} or None")
        env = os.environ.get(BACKEND_ENV)
        if env and env not in KERNEL_BACKENDS:
            raise ConfigError(f"environment {BACKEND_ENV}={env!r}: must be one of "
                              f"{', '.join(map(repr, KERNEL_BACKENDS))} (or unset)")
        for f in ("data_type", "dispatch_data_type", "combine_data_type"):
            v = getattr(self, f)
            if v is not None and spec_dtype(v) is None:
                raise self._fail(f, f"unknown dtype; supported in this release: {_dtype_list(BUILT_DTYPES)}")
        if (self.dispatch_data_type is None) != (self.combine_data_type is None):
            raise ConfigError(f"dispatch_data_type={self.dispatch_data_type!r}, combine_data_type="
                              f"{self.combine_data_type!r}: set both or neither")

    def _check_scales(self) -> None:
        for f in ("scale_dim", "scale_type_size"):
            if getattr(self, f) and spec_dtype(self.dispatch_dtype).kind == "float":
                raise self._fail(f, f"must be 0 for a {self.dispatch_dtype} payload (scales are for fp8/fp4 payloads)")

    def rule_facts(self) -> list[dict[str, str]]:
        """Facts for the spec rule engine: one dict per (family, topology) this config may use."""
        from generator import model as gmodel

        specs = load_specs()
        quant = specs.quants[self.quant_type]

        def wire_for(dtype: torch.dtype, explicit: torch.dtype | None):
            if explicit is not None:
                return spec_dtype(explicit)
            if quant.wire_kind == "none":
                return spec_dtype(dtype)
            kinds = [d for d in specs.dtypes.values() if d.kind == quant.wire_kind]
            return kinds[0] if len(kinds) == 1 else None  # ambiguous (fp8 ocp/fnuz): depends on target

        roles = (
            ("dispatch", "dispatch", self.data_type, wire_for(self.data_type, self.dispatch_data_type)),
            ("combine", f"combine_{self.combine_mode}", self.combine_dtype, wire_for(self.combine_dtype, None)),
        )
        out = []
        for role, preferred, dtype, wire in roles:
            if preferred in specs.families:
                families = [specs.families[preferred]]
            else:
                families = [f for f in specs.families.values() if f.role == role] or [None]
            for fam in families:
                for topo in self.topology_names:
                    out.append(gmodel.combination_facts(family=fam, dtype=spec_dtype(dtype), wire=wire, quant=quant,
                                                        target=None, topology=specs.topologies[topo]))
        return out

    def _check_rules(self) -> None:
        from generator import model as gmodel

        rules = load_specs().rules
        for facts in self.rule_facts():
            rule = gmodel.rejecting_rule(rules, facts)
            if rule is not None:
                raise ConfigError(f"{rule.name}: {rule.message}")

    def _check_built(self) -> None:
        built = _dtype_list(BUILT_DTYPES)
        if spec_dtype(self.data_type).name not in BUILT_DTYPES:
            raise self._fail("data_type", f"not supported in this release (fp8/fp4 payloads are not built yet); "
                                          f"supported: {built}")
        for f in ("dispatch_data_type", "combine_data_type"):
            v = getattr(self, f)
            if v is not None and v != self.data_type:
                raise self._fail(f, f"must equal data_type={self.data_type} in this release "
                                    f"(dtype conversion on the wire is not built yet)")
        if self.combine_mode not in BUILT_COMBINE_MODES:
            raise self._fail("combine_mode", f"not built yet; built: {', '.join(map(repr, BUILT_COMBINE_MODES))}")
        if self.quant_type not in BUILT_QUANT_TYPES:
            raise self._fail("quant_type", f"not built yet; built: {', '.join(map(repr, BUILT_QUANT_TYPES))}")
        if self.enable_std_moe:
            raise self._fail("enable_std_moe", "standard-MoE layout conversion is not built yet")
        if self.is_internode:
            raise ConfigError(f"world_size={self.world_size} > gpu_per_node={self.gpu_per_node}: "
                              f"internode is not built yet (intranode only: gpu_per_node = world_size or 0)")

    def _resolve_backend(self) -> str:
        env = os.environ.get(BACKEND_ENV)
        if env:
            return env
        if self.kernel_backend is not None:
            return self.kernel_backend
        return "native" if torch.cuda.is_available() else "torch"


FIELDS: tuple[str, ...] = tuple(f.name for f in attrs.fields(EpDispatchCombineConfig) if f.init)
