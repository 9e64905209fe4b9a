"""The backends behind ``EpDispatchCombineOp``: one room each, one interface (``Backend``), made by ``make``.

- ``torch_backend.TorchBackend``: the reference, on ``torch.distributed`` collectives (CPU / gloo and any GPU).
- ``native.NativeBackend``: the generated intranode kernels over peer-mapped memory.
- ``internode.NativeInternodeBackend``: the generated internode kernels (pack / unpack around NCCL/RCCL).
- ``common``: what the two native backends share (group and device checks, target lookup, id-check mode,
  routing kernels, drop accounting).

A backend imports the core (config, errors, kernels, workspace, routing, numerics, ll); the core never imports
a backend except through ``make`` (called by the op). A new backend is a module here with a class that has
the members of ``Backend`` (the required ones; the optional ones where it can do better than the op's
fallback) and a branch in ``make``.

A backend is built as ``Backend(config, group)`` and provides:

  name: str; device: torch.device; capabilities: dict (merged over the op's defaults)
  wire_dtype: torch.dtype (optional, default torch.float8_e4m3fn): the FP8 e4m3 dtype of in-kernel
      fp8 quantization (torch.float8_e4m3fnuz where the target's native e4m3 is FNUZ, gfx942)
  dispatch_out_dtype: torch.dtype (optional): overrides the op's own derivation (runtime/op.py)
  dispatch(x, weights, scales, indices, routing)
      -> (out, out_weights, out_scales, out_indices, total_recv, handle_fields: dict)
      handle_fields are keyword arguments of RoutingHandle (e.g. {"extra": {...}}); routing is
      None or an already-checked handle of this op (replay).
  combine(expert_out, weights, indices, routing) -> (combined, combined_weights)
  combine_in_view() -> tensor [max_recv_tokens, hidden_dim]
  reset() -> None;  close() -> None
  check() -> None (optional): raise runtime.errors.EpTimeoutError if a kernel gave up waiting
  wait() -> None (optional): wait for the op's queued kernels (op.check(sync=True) calls it first)
  MoE integration (each optional; without one the op uses the plain-torch reference in runtime/moe.py
  on the last dispatch's outputs, except dropped_count, which the backend must provide):
  dropped_count() -> int32 scalar tensor; local_expert_count() -> int32 [num_experts_per_rank];
  routed_expert_count() -> int32 [num_experts_per_rank] (without it the op gathers the counts itself when
  built with count_routed=True, under a receive cap);
  convert_dispatch_output() -> (packed_x, packed_count, packed_src, packed_weights);
  std_moe_dropped() -> int32 scalar tensor; convert_combine_input(expert_out, routing) -> [R, H];
  memory_report() -> dict (else the op reports the native workspace formula of docs/RUNTIME.md)
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..errors import ConfigError, EpgenError


class Backend(Protocol):
    """The required members (the module docstring lists the optional ones and every signature)."""

    name: str
    device: torch.device

    @property
    def capabilities(self) -> dict: ...

    def dispatch(self, x, weights, scales, indices, routing) -> tuple: ...

    def combine(self, expert_out, weights, indices, routing) -> tuple: ...

    def combine_in_view(self) -> torch.Tensor: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


def make(config: Any, group) -> Backend:
    """The backend ``config.resolved_backend`` names, on ``group``."""
    name = config.resolved_backend
    if name == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend(config, group)
    if name == "native":
        try:
            from .internode import NativeInternodeBackend
            from .native import NativeBackend
        except EpgenError:
            raise
        except Exception as e:  # ImportError, or a vendor binding failing to load
            raise EpgenError(f"kernel backend 'native' is unavailable: importing runtime.backends.native failed "
                             f"({type(e).__name__}: {e}); use kernel_backend='torch' or "
                             f"EPGEN_KERNEL_BACKEND=torch for the reference backend") from e
        return (NativeInternodeBackend if config.is_internode else NativeBackend)(config, group)
    raise ConfigError(f"unknown kernel backend {name!r}")  # the config validates this already


def available() -> list[str]:
    """Kernel backends that can run on this machine: "torch" always, "native" where a GPU and its
    vendor bindings are there."""
    out = ["torch"]
    if torch.cuda.is_available():
        try:
            from . import native  # noqa: F401
            out.insert(0, "native")
        except Exception:  # ImportError, or a vendor binding failing to load
            pass
    return out
