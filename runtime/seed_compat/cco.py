"""The seed's communicator (``mori.cco.Communicator``) as the EPv2 op sees it, on torch.distributed.

The seed's ops meet over a CCO communicator made from a unique id (``get_unique_id`` on one rank, broadcast,
``init(npes, rank, uid, per_rank_vmm)`` everywhere) and register their symmetric memory and window with it
(``_resources``; ``close()`` untracks them). Here the ranks meet over torch.distributed: ``init`` uses the
default process group when one is initialised (it must have npes ranks, this process rank ``rank``), else
initialises one from the id (a TCP rendezvous address rank 0 chose: NCCL with a GPU, gloo without).
``per_rank_vmm`` (the seed's reservation of virtual memory) is accepted and unused: epgen sizes each op's
workspace itself. Each op registers two resources, as the seed's (its buffers and their peer mapping).
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from ..errors import ConfigError

UID_PREFIX = "tcp://"


class Resource:
    """One thing an op registered with its communicator: ``kind`` "memory" (its buffers) or "window" (their
    peer mapping), ``owner`` the op."""

    __slots__ = ("kind", "owner")

    def __init__(self, kind: str, owner):
        self.kind, self.owner = kind, owner

    def __repr__(self) -> str:
        return f"Resource({self.kind!r}, {self.owner!r})"


class Communicator:
    """The seed's Communicator on a torch.distributed group (see the module docstring)."""

    def __init__(self, npes: int, rank: int, group, owns_group: bool):
        self.npes, self.rank, self._group, self._owns_group = npes, rank, group, owns_group
        self._resources: list[Resource] = []
        self._destroyed = False

    @staticmethod
    def get_unique_id() -> str:
        """A rendezvous id (call on one rank, broadcast it): a TCP address on this host with a free port."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{UID_PREFIX}{socket.gethostname()}:{port}"

    @classmethod
    def init(cls, npes: int, rank: int, uid=None, per_rank_vmm=None) -> "Communicator":
        for name, value in (("npes", npes), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"Communicator.init: {name}={value!r} must be an int")
        if not 0 <= rank < npes:
            raise ConfigError(f"Communicator.init: rank={rank} must be in [0, npes={npes})")
        owns = False
        if not dist.is_initialized():
            if not (isinstance(uid, str) and uid.startswith(UID_PREFIX)):
                raise ConfigError(f"Communicator.init: torch.distributed is not initialised and uid={uid!r} is not an "
                                  f"id from Communicator.get_unique_id() ({UID_PREFIX}host:port)")
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", init_method=uid,
                                    world_size=npes, rank=rank)
            owns = True
        group = dist.group.WORLD
        if (dist.get_world_size(group), dist.get_rank(group)) != (npes, rank):
            raise ConfigError(f"Communicator.init(npes={npes}, rank={rank}): the torch.distributed default group has "
                              f"{dist.get_world_size(group)} ranks and this process is rank {dist.get_rank(group)}")
        return cls(npes, rank, group, owns)

    @property
    def group(self):
        self._check("group")
        return self._group

    def barrier(self) -> None:
        self._check("barrier")
        dist.barrier(group=self._group)

    def _register(self, op) -> None:
        self._check("register an op")
        self._resources += [Resource("memory", op), Resource("window", op)]

    def _unregister(self, op) -> None:
        self._resources = [r for r in self._resources if r.owner is not op]

    def destroy(self) -> None:
        """Close every op still registered, then give up the group (destroyed too when init made it)."""
        if self._destroyed:
            return
        for op in {id(r.owner): r.owner for r in self._resources}.values():
            op.close()
        self._destroyed = True
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def _check(self, what: str) -> None:
        if self._destroyed:
            raise ConfigError(f"Communicator.{what}: this communicator was destroyed")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()
