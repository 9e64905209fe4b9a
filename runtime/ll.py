"""Host side of the low-latency intranode protocol (kernels: templates/kernels/dispatch_ll.j2, combine_ll.j2;
wire format and the argument for it: docs/GUARANTEES.md).

A message is a stream of 32-bit words; vector v of its slot (16 bytes) carries words 3v..3v+2 and the call's
epoch. A dispatched row's message: payload words, scale words (bytes, the last word zero-padded), k ids, k
weights, the source token. A combine cell's message: the expert row's words, then its k weights.
"""

from __future__ import annotations

WORDS_PER_VECTOR = 3  # 12 data bytes + a 4-byte epoch flag per 16-byte vector
VECTOR_BYTES = 16
PROTOCOLS = ("ll", "bw")


def vectors(words: int) -> int:
    """16-byte vectors of a message of `words` 32-bit words."""
    return -(-words // WORDS_PER_VECTOR)


def row_layout(payload_bytes: int, scale_bytes: int, k: int) -> dict[str, int]:
    """Word offsets of a dispatched row's message: payload, scales, ids, weights, src (the source token), and
    its total words."""
    p = payload_bytes // 4
    s = -(-scale_bytes // 4)
    return {"payload": 0, "scales": p, "ids": p + s, "weights": p + s + k, "src": p + s + 2 * k,
            "words": p + s + 2 * k + 1}


def row_bytes(payload_bytes: int, scale_bytes: int, k: int) -> int:
    """Bytes of one dispatch slot (a row's message in flagged vectors)."""
    return VECTOR_BYTES * vectors(row_layout(payload_bytes, scale_bytes, k)["words"])


def cell_bytes(combine_row_bytes: int, k: int) -> int:
    """Bytes of one combine cell (an expert row and its k weights in flagged vectors)."""
    return VECTOR_BYTES * vectors(combine_row_bytes // 4 + k)


def regions(world: int, tokens: int, ll_row: int, ll_cell: int) -> list[tuple[str, int]]:
    """Symmetric workspace regions of the protocol for calls of at most `tokens` tokens per rank (none for 0):
    ll_cnt [2 parities][world] 64-bit count words, ll_x [2][world sources][tokens] dispatch slots,
    ll_c [tokens][world] combine cells, ll_map (local) [world][tokens] source tokens + [world] row counts."""
    if not tokens:
        return []
    return [("ll_cnt", 2 * world * 8), ("ll_x", 2 * world * tokens * ll_row), ("ll_c", tokens * world * ll_cell),
            ("ll_map", 4 * (world * tokens + world))]


def resolve(asked: str, available: bool, max_tokens: int, threshold: int) -> str:
    """The one protocol of every call of an op, decided at construction from what every rank knows alike
    (the config, which the op checks equal across ranks, and the target's threshold), never from a call's
    own token count, which ranks need not share: "ll" when asked, or under "auto" when the config can run it
    (available) and its token bound max_tokens is at most the target's threshold (0: never); else "bw"."""
    if asked == "ll":
        return "ll"
    if asked == "auto" and available and 0 < max_tokens <= threshold:
        return "ll"
    return "bw"


def buffer_tokens(protocol: str, max_tokens: int) -> int:
    """Tokens per rank the low-latency buffers are sized for: the config's bound when the op's protocol is
    "ll", else 0 (no buffers)."""
    return max_tokens if protocol == "ll" else 0


def epoch(calls: int) -> int:
    """The epoch flag of a call after `calls` earlier ones of its leg (32-bit, never 0: zero is empty)."""
    e = (calls + 1) & 0xFFFFFFFF
    return e or 1
