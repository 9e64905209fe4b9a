"""Drop-in for the seed library's EPv2 API (``mori.ops.dispatch_combine_v2`` of amd-mori).

Code written for the seed runs on epgen after changing one import::

    from mori.ops.dispatch_combine_v2 import EpDispatchCombineConfig, EpDispatchCombineOp
    ->  from runtime.seed_compat import EpDispatchCombineConfig, EpDispatchCombineOp

``EpDispatchCombineConfig`` is epgen's own config class: it accepts the seed's fields (this module
maps them, see ``SEED_FIELDS``) and has the seed's public properties (``SeedConfigMembers``). The op
here is epgen's op with the seed's combine-weights semantics: ``combine(input, weights, ...)`` with
any non-None ``weights`` asks for the weight fold, whose values are the forwarded weights of the last
dispatch (the seed's meaning), not the passed tensor (epgen's meaning: its rows are summed per token).
docs/SEED_COMPAT.md lists every seed name, what it maps to and what differs.
"""

from __future__ import annotations

from .aliases import SEED_FIELDS, SEED_KERNEL_BACKENDS, launch_override  # noqa: F401 - the seed's names, mapped
from .config import EpDispatchCombineConfig
from .op import EpDispatchCombineOp as _Op
from .routing import RoutingHandle as EpDispatchRoutingHandle


class EpDispatchCombineOp(_Op):
    """epgen's op with the seed's combine-weights semantics (``combine_weights="fold"``)."""

    def __init__(self, cfg, comm=None, *, combine_weights: str = "fold"):
        super().__init__(cfg, comm, combine_weights=combine_weights)


__all__ = ["EpDispatchCombineConfig", "EpDispatchCombineOp", "EpDispatchRoutingHandle"]
