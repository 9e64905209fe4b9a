"""Drop-in for the seed library's EPv2 API (``mori.ops.dispatch_combine_v2`` of amd-mori, and the
``mori.cco.Communicator`` its ops meet over).

Code written for the seed runs on epgen after changing its imports::

    from mori.ops.dispatch_combine_v2 import EpDispatchCombineConfig, EpDispatchCombineOp
    ->  from runtime.seed_compat import EpDispatchCombineConfig, EpDispatchCombineOp
    from mori.ops.dispatch_combine_v2 import tuning_configs  ->  from runtime.seed_compat import tuning_configs
    from mori.cco import Communicator  ->  from runtime.seed_compat.cco import Communicator

The modules mirror the seed's layout: ``config`` (the seed's config class and how it maps onto epgen's),
``op`` (the op and ``EpDispatchRoutingHandle``), ``cco`` (the communicator), ``tuning_configs`` and
``hip_tuning_configs`` (``lookup``). This package sits on top of the runtime core (it imports runtime.op
and runtime.config; nothing in the core imports it). docs/SEED_COMPAT.md lists every seed name, what it
maps to and what differs.
"""

from __future__ import annotations

from ..aliases import SEED_FIELDS, SEED_KERNEL_BACKENDS, launch_override  # noqa: F401 - the core config's seed fields
from . import cco, hip_tuning_configs, tuning_configs  # noqa: F401 - the seed's module layout
from .cco import Communicator
from .config import EpDispatchCombineConfig
from .op import EpDispatchCombineOp, EpDispatchRoutingHandle

__all__ = ["EpDispatchCombineConfig", "EpDispatchCombineOp", "EpDispatchRoutingHandle", "Communicator",
           "tuning_configs", "hip_tuning_configs", "cco"]
