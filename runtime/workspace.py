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
"""

from __future__ import annotations

import threading

import attrs
import torch
import torch.distributed as dist

_lock = threading.Lock()
_pool: dict[tuple, list["Workspace"]] = {}
_seq: dict[tuple, int] = {}


@attrs.define
class Workspace:
    key: tuple
    seq: int
    buf: torch.Tensor
    handle: object
    world: object = None  # the default process group it was made under (a re-initialised one never reuses it)


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """dist.all_gather_single (torch >= 2.13), or all_gather_into_tensor, its older name."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, inp, group=group)


def current_world():
    """The default process group object (a new one after destroy_process_group + init_process_group)."""
    return dist.group.WORLD


def _key(device: torch.device, group, nbytes: int) -> tuple:
    return (device.index, group.group_name, nbytes)


def _symmetric(nbytes: int, device: torch.device, group) -> tuple[torch.Tensor, object]:
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    buf.zero_()
    return buf, symm_mem.rendezvous(buf, group.group_name)


def acquire(nbytes: int, device: torch.device, group, allocate=_symmetric) -> Workspace:
    """A zeroed symmetric workspace of `nbytes` on `device`, rendezvoused over `group` (collective).

    allocate(nbytes, device, group) -> (buffer, handle) makes a fresh one (tests pass their own)."""
    key = _key(device, group, nbytes)
    with _lock:
        free = _pool.get(key, [])
        free[:] = [ws for ws in free if ws.world is current_world()]  # made under an earlier init: dropped
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
    return Workspace(key, seq, *allocate(nbytes, device, group), world=current_world())


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
        freed = sum(ws.buf.numel() for free in _pool.values() for ws in free)
        _pool.clear()
    return freed
