"""A Python model of the low-latency intranode protocol (templates/kernels/dispatch_ll.j2, combine_ll.j2), for
CPU tests of its wire format and its reuse argument (docs/GUARANTEES.md).

Memory is a dict per rank: 16-byte vectors (tuples of four u32) by address, 64-bit count words. A store to a
peer is not visible at once: it sits in flight until the scheduler delivers it, in any order (NVLink gives no
order between stores without a fence, and the protocol uses none). Each rank's call is a generator that
yields after every memory operation; the scheduler interleaves the ranks' steps and the deliveries at random.
`torn=True` delivers a 16-byte store as two 8-byte halves (what the protocol assumes never happens); `zeroing=
False` leaves consumed vectors in place (what the protocol does not do): tests show either breaks it.
"""

from __future__ import annotations

import random
import struct

from runtime import ll

MASK32 = 0xFFFFFFFF


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def message_words(payload: list[int], scales: bytes, ids: list[int], weights: list[float] | None, t: int) -> list[int]:
    """A dispatched row's message (words), laid out as runtime.ll.row_layout says."""
    lay = ll.row_layout(4 * len(payload), len(scales), len(ids))
    sc = scales + b"\0" * (-len(scales) % 4)
    words = list(payload) + [int.from_bytes(sc[i:i + 4], "little") for i in range(0, len(sc), 4)]
    words += [i & MASK32 for i in ids] + [f32_bits(w) if weights is not None else 0 for w in (weights or [0.0] * len(ids))]
    words.append(t)
    assert len(words) == lay["words"]
    return words


def vectors_of(words: list[int], epoch: int) -> list[tuple[int, int, int, int]]:
    """The flagged 16-byte vectors of a message: three words and the epoch each (zero padded)."""
    w = words + [0] * (-len(words) % 3)
    return [(w[3 * v], w[3 * v + 1], w[3 * v + 2], epoch) for v in range(len(w) // 3)]


class Fabric:
    """Every rank's memory and the stores in flight between them."""

    def __init__(self, world: int, rng: random.Random, torn: bool = False):
        self.world, self.rng, self.torn = world, rng, torn
        self.vec = [dict() for _ in range(world)]      # rank -> {addr: (x, y, z, w)}
        self.count = [dict() for _ in range(world)]    # rank -> {addr: 64-bit word}
        self.flight: list[tuple] = []                  # (rank, kind, addr, value)
        self.overwrites = 0                            # stores that landed on an unconsumed vector

    def store_vec(self, rank: int, addr, value) -> None:
        if self.torn:  # two halves, delivered independently
            self.flight.append((rank, "lo", addr, value[:2]))
            self.flight.append((rank, "hi", addr, value[2:]))
        else:
            self.flight.append((rank, "vec", addr, value))

    def store_count(self, rank: int, addr, value: int) -> None:
        self.flight.append((rank, "count", addr, value))

    def deliver_one(self) -> bool:
        if not self.flight:
            return False
        rank, kind, addr, value = self.flight.pop(self.rng.randrange(len(self.flight)))
        mem = self.vec[rank]
        if kind in ("vec", "lo") and any(mem.get(addr, (0, 0, 0, 0))):
            self.overwrites += 1
        if kind == "vec":
            mem[addr] = value
        elif kind == "lo":
            mem[addr] = tuple(value) + mem.get(addr, (0, 0, 0, 0))[2:]
        elif kind == "hi":
            mem[addr] = mem.get(addr, (0, 0, 0, 0))[:2] + tuple(value)
        else:
            self.count[rank][addr] = value
        return True

    def load_vec(self, rank: int, addr):
        return self.vec[rank].get(addr, (0, 0, 0, 0))


class Rank:
    """One rank's low-latency state words and local buffers (the model of the op's state tensor)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.ll_dispatches = self.ll_combines = 0
        self.recv: list = []          # received rows: (source rank, token, words) in receive order
        self.ll_t: dict = {}          # (source rank, position) -> source token
        self.ll_n: list[int] = []
        self.dropped = 0


def dispatch_call(fab: Fabric, me: Rank, dests: list[set[int]], messages: list[list[int]], nwords: int,
                  max_recv: int, zeroing: bool = True):
    """One rank's dispatch_ll kernel as a generator: dests[t] = ranks token t goes to, messages[t] its words
    (nwords each, the same on every rank).
    Yields after every memory operation; ends with me.recv holding the received rows in receive order."""
    W, r = fab.world, me.rank
    epoch, parity = ll.epoch(me.ll_dispatches), me.ll_dispatches & 1
    # counts first (one 64-bit store per destination: epoch << 32 | rows)
    for d in range(W):
        n = sum(1 for ds in dests if d in ds)
        fab.store_count(d, (parity, r), (epoch << 32) | n)
        yield
    # rows: slot [parity][me][position], position = rows to d before this token
    sent = [0] * W
    order = [(t, d) for t in range(len(dests)) for d in sorted(dests[t])]
    fab.rng.shuffle(order)  # waves run in any order
    pos = {}
    for t in range(len(dests)):
        for d in sorted(dests[t]):
            pos[(t, d)] = sent[d]
            sent[d] += 1
    for t, d in order:
        vecs = vectors_of(messages[t], epoch)
        for v in fab.rng.sample(range(len(vecs)), len(vecs)):
            fab.store_vec(d, ("x", parity, r, pos[(t, d)], v), vecs[v])
            yield
    # receive: every source's count word of this epoch
    counts = []
    for s in range(W):
        while True:
            w = fab.count[r].get((parity, s), 0)
            if w >> 32 == epoch:
                counts.append(w & MASK32)
                break
            yield
    me.ll_n = counts
    me.recv = []
    row = 0
    for s in range(W):
        for i in range(counts[s]):
            words = yield from _receive(fab, r, [("x", parity, s, i, v) for v in range(ll.vectors(nwords))],
                                        epoch, zeroing)
            t = words[nwords - 1]
            me.ll_t[(s, i)] = t
            if row < max_recv:
                me.recv.append((s, t, words[:nwords]))
            row += 1
            yield
    me.dropped = row - len(me.recv)
    me.ll_dispatches += 1


def _receive(fab: Fabric, r: int, addrs: list, epoch: int, zeroing: bool):
    """Poll each vector until it carries `epoch`, take its three words, zero it; -> the message's words."""
    words = []
    for addr in addrs:
        while (vec := fab.load_vec(r, addr))[3] != epoch:
            yield
        words += vec[:3]
        if zeroing:
            fab.vec[r][addr] = (0, 0, 0, 0)
    return words


def combine_call(fab: Fabric, me: Rank, expert: dict, nwords: int, sent_to: list[set[int]], zeroing: bool = True):
    """One rank's combine_ll kernel: pushes expert[(s, t)] (nwords words; a row past the cap, absent, pushes
    zeros) to the origin's cell [t][me], then sums its own cells in rank order into me.combined[t]."""
    W, r = fab.world, me.rank
    epoch = ll.epoch(me.ll_combines)
    for s in range(W):
        for i in range(me.ll_n[s]):
            t = me.ll_t[(s, i)]
            for v, vec in enumerate(vectors_of(expert.get((s, t)) or [0] * nwords, epoch)):
                fab.store_vec(s, ("c", t, r, v), vec)
                yield
    me.combined = {}
    for t, ds in enumerate(sent_to):
        acc = [0] * nwords
        for d in sorted(ds):
            words = yield from _receive(fab, r, [("c", t, d, v) for v in range(ll.vectors(nwords))], epoch, zeroing)
            acc = [a + b for a, b in zip(acc, words)]
        me.combined[t] = acc
    me.ll_combines += 1


def run(fab: Fabric, calls: list, max_steps: int = 300_000) -> None:
    """Interleave the ranks' calls (a list of generators per rank, run in order on that rank, each starting
    once the rank's previous one ended: stream order) with deliveries, at random, until all end."""
    queues = [list(c) for c in calls]
    current = [q.pop(0) if q else None for q in queues]
    for _ in range(max_steps):
        live = [i for i, g in enumerate(current) if g is not None]
        if not live and not fab.flight:
            return
        if fab.flight and (not live or fab.rng.random() < 0.5):
            fab.deliver_one()
            continue
        i = fab.rng.choice(live)
        try:
            next(current[i])
        except StopIteration:
            current[i] = queues[i].pop(0) if queues[i] else None
    raise TimeoutError("the model did not finish (a wait never ended)")
