"""epgen runtime: EP dispatch/combine ops over generated kernels (native) or torch.distributed (torch)."""

from .config import EpDispatchCombineConfig
from .errors import (CapacityError, ClosedError, ConfigError, EpgenError, EpTimeoutError, InputError, InputWarning,
                     VariantMissError)
from .op import EpDispatchCombineOp
from .routing import RoutingHandle
from .workspace import release_workspaces

__all__ = [
    "EpDispatchCombineConfig",
    "EpDispatchCombineOp",
    "RoutingHandle",
    "EpgenError",
    "ConfigError",
    "InputError",
    "InputWarning",
    "ClosedError",
    "CapacityError",
    "EpTimeoutError",
    "VariantMissError",
    "release_workspaces",
]
