"""Host side of the low-latency intranode protocol (kernels: templates/kernels/dispatch_ll.j2, combine_ll.j2;
wire format and the argument for it: docs/GUARANTEES.md).

A message is a stream of 32-bit words; vector v of its slot (16 bytes) carries words 3v..3v+2 and the call's
epoch. A dispatched row's message: payload words, scale words (bytes, the last word zero-padded), k ids, k
weights, the source token, and for an op with the grouped layout (`ranked`) k ranks: pair j's position among the
sender's pairs of expert ids[j] in (token, j) order (0 where that expert is not on the destination). A combine
cell's message: the expert row's words, then its k weights.
"""

from __future__ import annotations

WORDS_PER_VECTOR = 3  # 12 data bytes + a 4-byte epoch flag per 16-byte vector
VECTOR_BYTES = 16
PROTOCOLS = ("ll", "bw")


def vectors(words: int) -> int:
    """16-byte vectors of a message of `words` 32-bit words."""
    return -(-words // WORDS_PER_VECTOR)


def row_layout(payload_bytes: int, scale_bytes: int, k: int, ranked: bool = False) -> dict[str, int]:
    """Word offsets of a dispatched row's message: payload, scales, ids, weights, src (the source token), with
    `ranked` the pairs' ranks (module docstring), and its total words."""
    p = payload_bytes // 4
    s = -(-scale_bytes // 4)
    out = {"payload": 0, "scales": p, "ids": p + s, "weights": p + s + k, "src": p + s + 2 * k}
    if ranked:
        out["ranks"] = p + s + 2 * k + 1
    return out | {"words": p + s + (3 if ranked else 2) * k + 1}


def row_bytes(payload_bytes: int, scale_bytes: int, k: int, ranked: bool = False) -> int:
    """Bytes of one dispatch slot (a row's message in flagged vectors)."""
    return VECTOR_BYTES * vectors(row_layout(payload_bytes, scale_bytes, k, ranked)["words"])


def grouped_ranked(world: int, experts_per_rank: int, k: int) -> bool:
    """Can the low-latency dispatch of an op with the grouped layout place it without a grid barrier
    (templates/kernels/ll_grouped.j2: every (source rank, local expert) count in a block's shared memory, each
    pair's rank formed by its sender)? Then its messages carry ranks and it has the regions ll_ecnt / ll_rows."""
    from generator.abi import LL_GROUPED_MAX_K, LL_GROUPED_TABLE

    return world * experts_per_rank <= LL_GROUPED_TABLE and k <= LL_GROUPED_MAX_K


def ecnt_vectors(experts_per_rank: int) -> int:
    """16-byte vectors of one (parity, source rank)'s expert counts: three counts and the epoch each."""
    return -(-experts_per_rank // WORDS_PER_VECTOR)


def cell_bytes(combine_row_bytes: int, k: int) -> int:
    """Bytes of one combine cell (an expert row and its k weights in flagged vectors)."""
    return VECTOR_BYTES * vectors(combine_row_bytes // 4 + k)


def regions(world: int, tokens: int, ll_row: int, ll_cell: int, experts_per_rank: int = 0) -> list[tuple[str, int]]:
    """Symmetric workspace regions of the protocol for calls of at most `tokens` tokens per rank (none for 0):
    ll_cnt [2 parities][world] 64-bit count words, ll_x [2][world sources][tokens] dispatch slots,
    ll_c [tokens][world] combine cells, ll_map (local) [world][tokens] source tokens + [world] row counts; with
    experts_per_rank (an op whose dispatch places the grouped layout without a grid barrier: grouped_ranked)
    ll_ecnt [2][world sources][ecnt_vectors] flagged vectors of per-local-expert pair counts and ll_rows (local)
    [world * tokens] i32 readers per received row (templates/kernels/ll_grouped.j2)."""
    if not tokens:
        return []
    out = [("ll_cnt", 2 * world * 8), ("ll_x", 2 * world * tokens * ll_row), ("ll_c", tokens * world * ll_cell),
           ("ll_map", 4 * (world * tokens + world))]
    if experts_per_rank:
        out += [("ll_ecnt", 2 * world * ecnt_vectors(experts_per_rank) * VECTOR_BYTES), ("ll_rows", 4 * world * tokens)]
    return out


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
