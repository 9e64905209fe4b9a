"""The runtime's host collectives on gloo, written so that no gloo thread still needs the GIL for a tensor of
epgen's once the call returned.

Why (issue 26, item 17): gloo runs each collective on a worker thread of its own, which drops its C++
references to the collective's tensors after the collective completes, often after the calling thread has
returned. Torch ties a tensor's Python object to its C++ references (c10's intrusive_ptr: while C++ holds
a reference besides the Python object's own, the C++ side holds a reference to the Python object), so
the worker's drop of the last extra reference also drops a Python reference, and that needs the GIL:
even while the caller still holds the tensor. A worker waiting for the GIL when the process reaches
interpreter finalization is made to exit there, inside a noexcept destructor, and the process aborts
with ``terminate called without an active exception``. Measured on torch 2.13 (CPU, two gloo ranks,
3000 all_to_all_single of 64 floats): after the call returned, 12 % of the input tensors were still
referenced by the worker; 5 ms later, with the caller holding the GIL, the worker had dropped its C++
reference and was still waiting for the GIL to drop the Python one, in every such case.

So every tensor this runtime hands to a gloo collective is settled before the caller goes on: ``settle``
waits (bounded; the GIL released between looks) until each tensor's Python reference count and C++
reference count are both back to their values before the call, which means the worker is done with it,
Python side included. ``all_gather_object``'s tensors are torch's own, so ``gather_objects`` gathers
picklable objects over tensors made and settled here (the peers are the job's own ranks: the same trust
as ``all_gather_object``, which pickles too).
"""

from __future__ import annotations

import pickle
import sys
import time

import torch
import torch.distributed as dist

SETTLE_S = 1.0  # the longest settle waits for gloo's threads to let go (then it returns: nothing is lost)
_state = {"looks": hasattr(torch.Tensor, "_use_count")}  # False after a wait ran out: a torch that keeps
# references on purpose would make every call wait SETTLE_S, so settling stops for the process instead


def _refs(t: torch.Tensor) -> tuple[int, int]:
    """(Python references to t, C++ references to its TensorImpl): the worker's hold shows in both."""
    return sys.getrefcount(t), t._use_count()


def on_gloo(group) -> bool:
    """Whether `group`'s collectives on host tensors run on gloo (a gloo group, or gloo beside NCCL)."""
    return "gloo" in str(dist.get_backend(group)).lower()


def baseline(tensors) -> list[tuple[int, int]] | None:
    """Each tensor's references now, before it goes to a collective (None: cannot be read)."""
    if not _state["looks"]:
        return None
    return _counts(tensors)


def _counts(tensors) -> list[tuple[int, int]]:
    return [_refs(t) for t in tensors]  # baseline and settle read alike (the same temporary references)


def _held(tensors, before) -> bool:
    return any(p > bp or c > bc for (p, c), (bp, bc) in zip(_counts(tensors), before))


def settle(tensors, before: list[tuple[int, int]] | None, limit_s: float = SETTLE_S) -> bool:
    """Wait until no tensor holds more references than ``before`` said (gloo's worker let go, its Python
    side included), at most ``limit_s`` seconds, releasing the GIL between looks. -> whether they settled."""
    if before is None:
        return False
    end = time.monotonic() + limit_s
    nap = 0.0
    while _held(tensors, before):
        if time.monotonic() > end:
            _state["looks"] = False
            return False
        time.sleep(nap)  # the worker waits for the GIL to drop its Python reference: let it take it
        nap = min(2 * nap + 1e-6, 1e-3)
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
    if size == 1:
        return [obj]
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
