"""The runtime's host collectives on gloo, written so that a gloo thread never frees a tensor of epgen's.

Why (issue 26, item 17): gloo runs each collective on a worker thread of its own, which drops its
references to the collective's tensors just after the collective completes, at times after the calling
thread already returned and dropped its own. When the worker's reference is the last one, freeing the
tensor frees its Python object, which needs the GIL; if the process has meanwhile reached interpreter
finalization, the worker thread is made to exit there, inside a destructor, and the process aborts with
``terminate called without an active exception``. It is a race of torch's (a plain two-rank gloo script
with one all_to_all_single and no ``destroy_process_group()`` aborted once in 24 runs on torch 2.14.1,
without epgen), which every collective of a process that exits right after it joins.

So every tensor this runtime hands to a gloo collective is kept by the caller until gloo has let go of
it: ``settle`` waits (bounded; the GIL released) until each tensor's storage is referenced only as it was
before the call, and the caller then frees it on its own thread. ``all_gather_object``'s tensors are
torch's own, so ``gather_objects`` gathers picklable objects over tensors made and settled here (the
peers are the job's own ranks: the same trust as ``all_gather_object``, which pickles too).
"""

from __future__ import annotations

import pickle
import time

import torch
import torch.distributed as dist

SETTLE_S = 1.0  # the longest settle waits for gloo's threads to let go (then it returns: nothing is lost)
_use_count = getattr(torch._C, "_storage_Use_Count", None)  # private; without it settle cannot look
_state = {"looks": _use_count is not None}  # False after a wait ran out: a torch that keeps references on
# purpose would make every call wait SETTLE_S, so settling stops for the process instead


def _refs(t: torch.Tensor) -> int:
    return _use_count(t.untyped_storage()._cdata)


def on_gloo(group) -> bool:
    """Whether `group`'s collectives on host tensors run on gloo (a gloo group, or gloo beside NCCL)."""
    return "gloo" in str(dist.get_backend(group)).lower()


def baseline(tensors) -> list[int] | None:
    """Each tensor's storage references now, before it goes to a collective (None: cannot be read)."""
    if not _state["looks"]:
        return None
    return [_refs(t) for t in tensors]


def settle(tensors, before: list[int] | None, limit_s: float = SETTLE_S) -> bool:
    """Wait until no tensor's storage holds more references than ``before`` said (gloo's worker let go),
    at most ``limit_s`` seconds, yielding the GIL between looks. -> whether they settled."""
    if before is None:
        return False
    end = time.monotonic() + limit_s
    while any(_refs(t) > b for t, b in zip(tensors, before)):
        if time.monotonic() > end:
            _state["looks"] = False
            return False
        time.sleep(0)  # the worker may be waiting for the GIL to finish its own release
    return True


def run(collective, tensors, group) -> None:
    """collective() over `tensors` (the caller keeps them), settled when the group runs on gloo."""
    before = baseline(tensors) if on_gloo(group) else None
    collective()
    settle(tensors, before)


def gather_objects(obj, group) -> list:
    """Every rank's picklable `obj`, in rank order: on gloo over host tensors this module settles, else
    all_gather_object."""
    size = dist.get_world_size(group)
    if not on_gloo(group):  # NCCL's tensors are the device's; the race is gloo's: torch's own gather
        everyone: list = [None] * size
        dist.all_gather_object(everyone, obj, group=group)
        return everyone
    device = torch.device("cpu")
    data = pickle.dumps(obj)
    mine_n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    run(lambda: dist.all_gather(sizes, mine_n, group=group), [mine_n, *sizes], group)
    counts = [int(s) for s in sizes]
    width = max(counts)
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(size)]
    run(lambda: dist.all_gather(parts, mine, group=group), [mine, *parts], group)
    return [pickle.loads(p[:n].cpu().numpy().tobytes()) for p, n in zip(parts, counts)]
