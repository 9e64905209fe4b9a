"""The tests' one config factory. A test file binds its own shape (``functools.partial(make_config, hidden_dim=H,
...)`` or a small function that maps its parameters onto fields) and passes every other field by name."""

from __future__ import annotations

import torch.distributed as dist

from runtime import EpDispatchCombineConfig
from tests.support.ep_oracle import experts_per_rank_for

#: the fields a test leaves out: 64-wide rows, 128 tokens a rank, 2 experts a rank, k = 4, the torch backend
DEFAULTS = dict(hidden_dim=64, max_num_inp_token_per_rank=128, num_experts_per_rank=2, num_experts_per_token=4,
                kernel_backend="torch")


def make_config(rank: int = 0, world: int = 1, **fields) -> EpDispatchCombineConfig:
    """Rank ``rank`` of ``world``: DEFAULTS, then ``fields``; num_experts_per_rank is raised where world x it <
    num_experts_per_token (a config's k is at most its num_experts; ep_oracle.experts_per_rank_for)."""
    fields = {**DEFAULTS, **fields}
    fields["num_experts_per_rank"] = experts_per_rank_for(fields["num_experts_per_token"], world,
                                                          fields["num_experts_per_rank"])
    return EpDispatchCombineConfig(rank=rank, world_size=world, **fields)


def dist_config(**fields) -> EpDispatchCombineConfig:
    """make_config for this process's rank of its torch.distributed group (the GPU tests); the native backend unless
    ``fields`` name another."""
    return make_config(dist.get_rank(), dist.get_world_size(), **{"kernel_backend": "native", **fields})
