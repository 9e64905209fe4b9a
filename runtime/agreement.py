"""The collective checks an op runs at construction, before anything is allocated: every rank's config agrees
(check_config_agreement) and the real host layout matches gpu_per_node (check_host_layout). A config differing
between ranks, or one that does not match the group's size and this process's rank in it, is a ConfigError on
every rank."""

from __future__ import annotations

import os
import socket

from . import collectives
from .config import EMULATE_NODES_ENV, FIELDS, EpDispatchCombineConfig
from .errors import ConfigError

_MISMATCH_RANKS_NAMED = 1  # per field: rank 0 and the first rank that differs (then a count of the rest)


def config_summary(config: EpDispatchCombineConfig) -> dict:
    """What ranks compare at op construction: every config field and the resolved backend."""
    summary = {name: getattr(config, name) for name in FIELDS}
    summary["resolved_backend"] = config.resolved_backend
    return summary


def check_config_agreement(config: EpDispatchCombineConfig, group=None) -> None:
    """Collective over ``group`` (None: WORLD): raise ConfigError on every rank unless every rank's
    config equals this one in every field but ``rank``, and each rank's config names the group's
    size as world_size and its own rank in the group as rank.

    Runs one gather of objects (runtime/collectives.py; gloo on CPU, NCCL on GPUs) when torch.distributed is initialised
    and the group has more than one rank; without torch.distributed there is nothing to compare
    (the backend then accepts world_size=1 only).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    g = group if group is not None else dist.group.WORLD
    size, me = dist.get_world_size(g), dist.get_rank(g)
    if me < 0:
        raise ConfigError(f"this process is not a member of the process group (config rank={config.rank}, "
                          f"world_size={config.world_size})")
    mine = config_summary(config)
    everyone = collectives.gather_objects(mine, g)
    # every rank sees every summary, so every rank raises (and with the same words, but for its own)
    if (config.world_size, config.rank) != (size, me):
        raise ConfigError(f"the process group has world size {size} and this process is rank {me}, "
                          f"but the config says world_size={config.world_size}, rank={config.rank}")
    for r, other in enumerate(everyone):
        if (other["world_size"], other["rank"]) != (size, r):
            raise ConfigError(f"rank {r} of the process group (world size {size}) has a config with "
                              f"world_size={other['world_size']}, rank={other['rank']}")
    first = everyone[0]
    parts = []
    for name in first:
        if name == "rank":
            continue
        differ = [r for r, other in enumerate(everyone) if other[name] != first[name]]
        if not differ:
            continue
        named = differ[:_MISMATCH_RANKS_NAMED]
        text = ", ".join([f"{name}={first[name]!r} on rank 0"] + [f"{name}={everyone[r][name]!r} on rank {r}"
                                                                   for r in named])
        if len(differ) > len(named):
            text += f" (and {len(differ) - len(named)} more rank(s) differ from rank 0)"
        parts.append(text)
    if parts:
        raise ConfigError("config mismatch between ranks: " + "; ".join(parts))


def emulate_nodes() -> bool:
    """Is the node-emulation switch on? ``EPGEN_EMULATE_NODES=1`` only (unset, "" or "0": off); never
    inferred. Any other value is a ConfigError."""
    value = os.environ.get(EMULATE_NODES_ENV, "")
    if value not in ("", "0", "1"):
        raise ConfigError(f"environment {EMULATE_NODES_ENV}={value!r}: must be '1' (emulate the gpu_per_node "
                          f"grouping on one host, for tests), '0' or unset")
    return value == "1"


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def check_host_layout(config: EpDispatchCombineConfig, group=None) -> None:
    """Collective over ``group``: the real host layout must match ``gpu_per_node``.

    Gathers every rank's ``socket.gethostname()`` and emulation switch with one gather of objects (runtime/collectives.py).
    Ranks are node-major (node = rank // gpu_per_node): the ranks of one node must share a hostname and
    different nodes must have different hostnames, else ConfigError on every rank naming the
    mismatch. ``EPGEN_EMULATE_NODES=1`` (on every rank) treats the grouping as given: several
    emulated nodes on one host (tests). Without torch.distributed or with one rank: nothing to check.
    """
    import torch.distributed as dist

    mine = (socket.gethostname(), emulate_nodes())
    if not (dist.is_available() and dist.is_initialized()) or config.world_size == 1:
        return
    g = group if group is not None else dist.group.WORLD
    everyone = collectives.gather_objects(mine, g)
    switches = [e for _, e in everyone]
    if len(set(switches)) > 1:
        on = [r for r, e in enumerate(switches) if e]
        raise ConfigError(f"{EMULATE_NODES_ENV}=1 is set on {_ranks_text(on)} only: set it on every rank or none")
    if switches[0]:
        return
    gpn = config.resolved_gpu_per_node
    hosts = [h for h, _ in everyone]
    problems = []
    node_host = {}
    for node in range(config.world_size // gpn):
        ranks = list(range(node * gpn, (node + 1) * gpn))
        names = sorted({hosts[r] for r in ranks})
        if len(names) > 1:
            parts = [f"{name!r} ({_ranks_text([r for r in ranks if hosts[r] == name])})" for name in names]
            problems.append(f"node {node} (ranks {ranks[0]}-{ranks[-1]}) spans hosts {', '.join(parts)}")
        node_host[node] = names[0]
    by_host: dict = {}
    for node, name in node_host.items():
        by_host.setdefault(name, []).append(node)
    for name, nodes in by_host.items():
        if len(nodes) > 1:
            problems.append(f"nodes {', '.join(map(str, nodes))} are all on host {name!r}")
    if problems:
        raise ConfigError(f"gpu_per_node={config.gpu_per_node}: the host layout does not match (ranks are "
                          f"node-major, node = rank // {gpn}): " + "; ".join(problems)
                          + f". Set gpu_per_node to the ranks per host, or {EMULATE_NODES_ENV}=1 on every rank "
                            f"to emulate nodes on one host (tests)")
