"""The seed's hip-backend tuning table interface (``mori.ops.dispatch_combine_v2.hip_tuning_configs``): the
same answers as ``tuning_configs.lookup`` (one epgen table serves both of the seed's backend names);
``experts_per_rank`` is accepted, as the seed's, and does not change the geometry."""

from __future__ import annotations

from . import tuning_configs


def lookup(world_size, hidden_dim, topk, dtype="bf16", experts_per_rank=None) -> dict:
    return tuning_configs.lookup(world_size, hidden_dim, topk, dtype=dtype)
