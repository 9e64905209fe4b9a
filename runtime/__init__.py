"""epgen runtime: EP dispatch/combine ops over generated kernels (native) or torch.distributed (torch)."""

import generator as _generator

__epgen__ = "runtime"
if getattr(_generator, "__epgen__", None) != "generator":  # a foreign 'generator' shadows epgen's (README)
    raise ImportError(f"epgen's runtime needs epgen's 'generator' package, but Python imports another one "
                      f"({getattr(_generator, '__file__', None) or 'a namespace package'}): a package or folder "
                      f"named 'generator' comes first on sys.path; run from another folder, or install epgen in a "
                      f"venv of its own")
try:  # torch imports without numpy, but its object collectives (the ranks' config agreement) need it
    import numpy as _numpy  # noqa: F401
except ImportError:
    raise ImportError("epgen's runtime needs numpy (torch.distributed's object collectives, which every op's "
                      "construction uses), and it is not installed: pip install 'epgen[runtime]' (README: Install)",
                      name="numpy") from None

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
