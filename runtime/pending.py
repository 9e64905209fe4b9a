"""Split-phase operations: a leg's send half queues its sending work and returns a pending handle; the handle's
receive() (DeepEP's name for it: hook()) completes the leg and returns what the one-call form returns.

    pending = op.dispatch_send(x, w, None, ids, return_routing=True)    # the rows leave; nothing waits
    ...                                                                  # the other micro-batch's GEMMs
    out, out_w, out_s, out_i, total, handle = pending.receive()          # waits for the peers' rows

Engines' names for the same thing: DeepEP low-latency ``return_recv_hook=True`` / ``hook()``, vLLM's
``prepare_async`` / ``finalize_async``, pplx-kernels' ``do_send`` / ``do_recv``, SGLang's ``dispatch_a`` /
``dispatch_b``.

Operations in flight (config ``max_inflight`` = N, default 1): an operation is a dispatch from its send half until
the combine of its rows completes (a dispatch returning no routing handle, which nothing can combine, frees its
slot when it is received); each owns a workspace slot (the native backend's receive, combine, flag and
low-latency regions and its grouped / std-MoE buffers: runtime/plan.py lays them out N times), named by its
handles (``pending.slot``, ``RoutingHandle.slot``). ``SlotTable`` keeps the books on the host; misuse is an
InputError (ClosedError after close), never corruption: a dispatch with every slot in flight, receiving twice, a
combine whose handle is not the one of its slot's rows, or whose expert rows lie in another slot's view, a receive
after reset() or close(). The one-call forms take a slot too (on an op with N = 1 a dispatch may reuse its slot
while the last dispatch is still uncombined: today's behaviour).

Stream ordering (CUDA): ``stream=`` runs both halves on that stream (a communication stream); it first waits on
``previous_event`` when given, else on the caller's current stream (the inputs were made there). The tensors the
leg reads are recorded on that stream (record_stream) and its outputs on the caller's stream, so the caching
allocator never hands them out early; after the receive half ``pending.event`` is recorded on the leg's stream
(``pending.current_stream_wait()`` makes the caller's current stream wait on it). Without ``stream`` both halves
run on the current stream and ``event`` is None unless ``previous_event`` was given. A slot's halves keep their
order across streams: a half issued on another stream than its slot's last half waits for that stream first (the
op's ``_follow``; inside graph capture the caller's fork / join does it).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from .errors import InputError


class SlotTable:
    """The op's workspace slots on the host: the pending operation of each slot (or None), whether its rows
    still wait for their combine (held), and which routing its rows were placed by (route: the seq of the
    dispatch that made it; replays keep it)."""

    def __init__(self, n: int):
        self.n = n
        self.pending: list[Any] = [None] * n
        self.held = [False] * n
        self.route = [0] * n

    def for_dispatch(self, what: str, one_call: bool) -> int:
        """A free slot for a dispatch: no operation pending and no received rows waiting for their combine."""
        for slot in range(self.n):
            if self.pending[slot] is None and not self.held[slot]:
                return slot
        if one_call and self.n == 1 and self.pending[0] is None:
            return 0  # max_inflight=1: a dispatch may follow a dispatch (the earlier one's rows are replaced)
        busy = ", ".join(f"slot {s}: " + (f"{self.pending[s].kind} pending" if self.pending[s] is not None
                                          else "dispatched, not combined yet") for s in range(self.n))
        raise InputError(f"{what}: {self.n} operation(s) already in flight on this op (max_inflight={self.n}; "
                         f"{busy}): receive and combine one first, or build the op with a larger max_inflight")

    def for_combine(self, what: str, routing) -> int:
        """The slot of the rows `routing` names (its dispatch's), checked free of pending work and holding them."""
        slot = routing.slot
        if not 0 <= slot < self.n:
            raise InputError(f"{what}: routing handle names slot {slot}, but this op has {self.n} (max_inflight)")
        if self.pending[slot] is not None:
            raise InputError(f"{what}: slot {slot} has a {self.pending[slot].kind} pending: receive it first")
        if self.n > 1 and routing.route != self.route[slot]:
            raise InputError(f"{what}: routing handle is stale: slot {slot} holds the rows of a later dispatch "
                             f"(each handle combines the rows of its own dispatch, once per dispatch)")
        return slot

    def dispatched(self, slot: int, route: int, held: bool = True) -> None:
        """A dispatch's rows received in `slot`; held (until their combine) when it returned a routing handle."""
        self.held[slot], self.route[slot] = held, route

    def combined(self, slot: int) -> None:
        self.held[slot] = False

    def clear(self) -> None:
        """After reset(): nothing pending, nothing held (the routes stay: the rows are where they were)."""
        self.pending = [None] * self.n
        self.held = [False] * self.n


class Pending:
    """A leg between its halves: ``receive()`` (or ``hook()``) completes it once and returns what the one-call
    form returns. kind: "dispatch", "combine", "dispatch_grouped" or "combine_grouped"; slot: its workspace
    slot; deferred: True when the send half moved nothing (a leg the backend does not split: its receive half
    runs the whole leg; see docs/LAYER.md, Overlap); event: the CUDA event recorded after the receive half
    (None before it, on CPU, and without stream / previous_event)."""

    def __init__(self, op, kind: str, slot: int, finish: Callable[[], Any], order: "StreamOrder",
                 deferred: bool = False):
        self._op, self.kind, self.slot, self._finish, self._order = op, kind, slot, finish, order
        self.deferred = deferred
        self._generation = op._generation
        self.done = False
        self.event: torch.cuda.Event | None = None

    def receive(self):
        """Complete the leg: -> what the one-call form returns. Every rank receives its legs in the same order
        as it sent them (like collectives)."""
        return self._op._receive(self)

    hook = receive  # DeepEP's name (return_recv_hook=True)

    def current_stream_wait(self) -> None:
        """Make the caller's current stream wait for the receive half (no-op without an event)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __repr__(self) -> str:
        state = "received" if self.done else "pending"
        return f"Pending({self.kind}, slot={self.slot}, {state}{', deferred' if self.deferred else ''})"


class StreamOrder:
    """Where a split leg runs and how it is ordered (see the module docstring): ``with order:`` around each
    half; ``outputs(...)`` records the outputs on the caller's stream and the event after the receive half."""

    def __init__(self, what: str, device: torch.device, stream, previous_event, inputs):
        self.stream = self.caller = None
        if stream is None and previous_event is None:
            return
        if device.type != "cuda":
            raise InputError(f"{what}: stream / previous_event order a leg on CUDA streams: this op runs on {device}")
        if stream is not None and not isinstance(stream, torch.cuda.Stream):
            raise InputError(f"{what}: stream must be a torch.cuda.Stream, got {type(stream).__name__}")
        if previous_event is not None and not isinstance(previous_event, torch.cuda.Event):
            raise InputError(f"{what}: previous_event must be a torch.cuda.Event, got {type(previous_event).__name__}")
        self.caller = torch.cuda.current_stream(device)
        self.stream = stream if stream is not None else self.caller
        if previous_event is not None:
            self.stream.wait_event(previous_event)
        elif self.stream != self.caller:
            self.stream.wait_stream(self.caller)  # the inputs were made on the caller's stream
        if self.stream != self.caller:
            for t in inputs:
                if isinstance(t, torch.Tensor):
                    t.record_stream(self.stream)  # read on the leg's stream: not reused before it is done

    def __enter__(self):
        self._ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)

    def outputs(self, result) -> torch.cuda.Event | None:
        """After the receive half: record its outputs on the caller's stream; -> the event after it."""
        if self.stream is None:
            return None
        if self.stream != self.caller:
            for t in _tensors(result):
                t.record_stream(self.caller)
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


def _tensors(obj):
    """The tensors in a (nested) result: tuples, lists, attrs layouts, tensors."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif hasattr(obj, "__attrs_attrs__"):
        for f in obj.__attrs_attrs__:
            yield from _tensors(getattr(obj, f.name))
