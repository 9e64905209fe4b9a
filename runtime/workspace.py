"""Process-wide pool of symmetric workspaces, so that building and closing ops does not grow memory.

Every ``symm_mem.rendezvous`` of a fresh allocation leaves a small bookkeeping allocation in torch
(the device arrays of peer pointers: about 1 KiB per rendezvous with torch 2.11, never freed), and
each rendezvous is a collective. A closed op therefore hands its workspace back here, and the next
op on the same device and group that needs the same number of bytes takes it again: no new
allocation, no new rendezvous.

Reuse must be decided identically on every rank: a rank that wrote through peer pointers of another
pairing would corrupt a peer silently. Each pooled workspace carries the sequence number it was
allocated under (allocation is collective, so the numbers agree across ranks); before reusing, the
ranks all-gather the number they would take and reuse only when all of them hold the same one.
Otherwise every rank allocates afresh.

``release_workspaces()`` frees the pooled buffers (torch keeps its ~1 KiB per rendezvous).

Two allocators (environment ``EPGEN_WORKSPACE``): ``ipc`` (the default: the runtime's own vendor-IPC
workspace, runtime/ipc.py; works when ranks share a GPU) and ``symmetric`` (torch's private
``_symmetric_memory``; refuses ranks that share a device, leaks per rendezvous).

Host collectives: on a group whose backend has no device collectives (gloo, as when several ranks
share a GPU and NCCL cannot run), ``all_gather_single`` stages device tensors through host memory;
that needs a host synchronisation, so it cannot run inside graph capture (a clear error says so).
"""

from __future__ import annotations

import os
import threading
import weakref

import attrs
import torch
import torch.distributed as dist

from . import collectives
from .errors import EpgenError

_lock = threading.Lock()
_pool: dict[tuple, list["Workspace"]] = {}
_seq: dict[tuple, int] = {}


@attrs.define
class Workspace:
    key: tuple
    seq: int
    buf: torch.Tensor
    handle: object
    world: object = None  # weakref to the default process group it was made under (a re-initialised one never
    # reuses it); weak, so that a pooled workspace never keeps a process group alive to interpreter exit


ALLOCATOR_ENV = "EPGEN_WORKSPACE"


def device_collectives(group) -> bool:
    """Whether `group`'s backend runs collectives on device tensors (NCCL/RCCL; gloo does not)."""
    return "nccl" in str(dist.get_backend(group)).lower()


def capture_unsupported() -> EpgenError:
    """The error of a host-staged collective inside graph capture."""
    return EpgenError("a collective on a gloo process group (ranks sharing a GPU) cannot be captured in a CUDA "
                      "graph: it synchronises with the host (receive-capped dispatch and the internode transport "
                      "exchange data this way); run it eagerly, or give each rank its own GPU and NCCL")


def _host_staged(collective, out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """collective(out, inp) on `group`; device tensors on a host-only group (gloo) go through host memory
    (which needs a host synchronisation: refused inside graph capture)."""
    if not inp.is_cuda or device_collectives(group):
        collective(out, inp)
        return
    if torch.cuda.is_current_stream_capturing():
        raise capture_unsupported()
    host, src = torch.empty(out.shape, dtype=out.dtype), inp.cpu()
    collectives.run(lambda: collective(host, src), [host, src], group)
    out.copy_(host)


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """dist.all_gather_single (torch >= 2.13), or all_gather_into_tensor, its older name."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _host_staged(lambda o, i: gather(o, i, group=group), out, inp, group)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                      group) -> None:
    """dist.all_to_all_single, through host memory on a host-only group."""
    _host_staged(lambda o, i: dist.all_to_all_single(o, i, out_splits, in_splits, group=group), out, inp, group)


def current_world():
    """The default process group object (a new one after destroy_process_group + init_process_group)."""
    return dist.group.WORLD


def _key(device: torch.device, group, nbytes: int) -> tuple:
    return (device.index, group.group_name, nbytes)


def _ipc(nbytes: int, device: torch.device, group) -> tuple[torch.Tensor, object]:
    from . import ipc

    return ipc.allocate(nbytes, device, group)


ALLOCATORS = {"ipc": _ipc}


def allocator_name() -> str:
    """The workspace allocator EPGEN_WORKSPACE names (unset: ipc), validated."""
    name = os.environ.get(ALLOCATOR_ENV, "").strip().lower() or "ipc"
    if name not in ("ipc", "symmetric"):
        raise EpgenError(f"environment {ALLOCATOR_ENV}={name!r}: must be ipc or symmetric (unset: ipc)")
    return name


def default_allocator():
    return ALLOCATORS[allocator_name()]


def _symmetric(nbytes: int, device: torch.device, group) -> tuple[torch.Tensor, object]:
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    buf.zero_()
    return buf, symm_mem.rendezvous(buf, group.group_name)


ALLOCATORS["symmetric"] = _symmetric


def acquire(nbytes: int, device: torch.device, group, allocate=None) -> Workspace:
    """A zeroed symmetric workspace of `nbytes` on `device`, rendezvoused over `group` (collective).

    allocate(nbytes, device, group) -> (buffer, handle) makes a fresh one (None: EPGEN_WORKSPACE's;
    tests pass their own)."""
    allocate = allocate or default_allocator()
    key = (*_key(device, group, nbytes), allocate)
    with _lock:
        free = _pool.get(key, [])
        free[:] = [ws for ws in free if ws.world() is current_world()]  # made under an earlier init: dropped
        mine = free.pop() if free else None
    want = torch.tensor([mine.seq if mine else -1], dtype=torch.int64, device=device)
    every = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    all_gather_single(every, want, group)
    seqs = set(every.tolist())
    if mine is not None and seqs == {mine.seq}:
        mine.buf.zero_()
        return mine
    if mine is not None:  # the ranks disagree: keep it for later, allocate afresh everywhere
        with _lock:
            _pool.setdefault(key, []).append(mine)
    with _lock:
        seq = _seq[key] = _seq.get(key, 0) + 1
    return Workspace(key, seq, *allocate(nbytes, device, group), world=weakref.ref(current_world()))


def release(ws: Workspace) -> None:
    """Give a workspace back (its op is closed; the device has finished with it)."""
    with _lock:
        _pool.setdefault(ws.key, []).append(ws)


def pooled_bytes() -> int:
    with _lock:
        return sum(ws.buf.numel() for free in _pool.values() for ws in free)


def release_workspaces() -> int:
    """Free every pooled workspace of this process; returns the bytes released."""
    with _lock:
        pooled = [ws for free in _pool.values() for ws in free]
        _pool.clear()
    if pooled and any(ws.buf.is_cuda for ws in pooled):
        torch.cuda.synchronize()
    for ws in pooled:
        close = getattr(ws.handle, "close", None)  # IPC workspaces unmap peers and free their memory
        ws.buf = None
        if close is not None:
            close()
    return sum(ws.key[2] for ws in pooled)
