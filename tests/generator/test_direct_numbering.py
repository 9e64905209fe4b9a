"""dispatch_direct's numbering (templates/kernels/dispatch_direct.j2, step 4): wave 0 numbers a chunk's pairs
EPG_WAVE / k tokens a step, lane = (token, k) token-major. Modelled in Python on the template's expressions (the
test first checks the template holds them), it must give every pair the grouped row, row index and rank word that
numbering one token a step gives (each bucket's counter moving on in (token, k) order: the torch backend's order),
and leave the counters where it leaves them: repeated ids, ids past the experts, -1, one to 64 ranks, k from 1 to
32, waves of 32 and 64 lanes."""

import random

import pytest

from tests.conftest import ROOT

TEMPLATE = (ROOT / "templates" / "kernels" / "dispatch_direct.j2").read_text()
FIRST = 1 << 16  # EPG_DIRECT_FIRST


def test_the_template_holds_the_modelled_numbering():
    for line in ("const int tpi = EPG_WAVE / K, lc = lane / K, lj = lane % K;",
                 "const bool act = lc < tpi && c < nc;",
                 "const epg_u64 same_e = epg_match_any(ok ? e : -1 - lane);",
                 "const epg_u64 same_r = epg_match_any(ok ? lc * W + r : -1 - lane);",
                 "const int g = ok ? sh.hb[e] + epg_popc(same_e & below_me) : -1;",
                 "const bool first = ok && (same_r & below_me) == 0;",
                 "const epg_u64 same_f = epg_match_any(first ? r : -1 - lane);",
                 "const int row0 = first ? sh.hb[NX + r] + epg_popc(same_f & below_me) : 0;",
                 "if (ok && (same_e >> (lane + 1)) == 0) sh.hb[e] += epg_popc(same_e);",
                 "if (first && (same_f >> (lane + 1)) == 0) sh.hb[NX + r] += epg_popc(same_f);",
                 "const int lead = epg_popc((same_r & (~same_r + 1)) - 1);",
                 "const bool kept = ok && g < sh.ht[e];",
                 "sh.dst[c][lj] = ok ? r | (first ? EPG_DIRECT_FIRST : 0) : -1;"):
        assert line in TEMPLATE, line


def _popc(x: int) -> int:
    return bin(x).count("1")


def _match_any(keys: list) -> list:
    return [sum(1 << m for m, other in enumerate(keys) if other == key) for key in keys]


def one_token_a_step(tokens, per_rank, num_experts, hb, ht):
    """The numbering one token a step: -> ({(token, k): (grouped row or -1, row index or -1, rank word)}, counters)."""
    hb, out, nx = list(hb), {}, num_experts
    for c, ids in enumerate(tokens):
        for j, e in enumerate(ids):
            ok = 0 <= e < num_experts
            r = e // per_rank if ok else -1
            g = hb[e] if ok else -1
            if ok:
                hb[e] += 1
            first = ok and r not in [x // per_rank for x in ids[:j] if 0 <= x < num_experts]
            out[(c, j)] = [g if ok and g < ht[e] else -1, -1, (r | (FIRST if first else 0)) if ok else -1]
            if first:
                out[(c, j)][1] = hb[nx + r]
                hb[nx + r] += 1
        for j, e in enumerate(ids):  # every k naming r holds its first k's row index
            if 0 <= e < num_experts:
                lead = next(i for i, x in enumerate(ids) if 0 <= x < num_experts and x // per_rank == e // per_rank)
                out[(c, j)][1] = out[(c, lead)][1]
    return {k: tuple(v) for k, v in out.items()}, hb


def several_tokens_a_step(tokens, per_rank, num_experts, world, hb, ht, wave):
    """The template's numbering, lane by lane (its expressions, test_the_template_holds_the_modelled_numbering)."""
    hb, out, nx, nc, K = list(hb), {}, num_experts, len(tokens), len(tokens[0])
    tpi = wave // K
    for cb in range(0, nc, tpi):
        lanes = range(wave)
        lc, lj = [lane // K for lane in lanes], [lane % K for lane in lanes]
        c = [cb + lc[lane] for lane in lanes]
        act = [lc[lane] < tpi and c[lane] < nc for lane in lanes]
        e = [tokens[c[lane]][lj[lane]] if act[lane] else -1 for lane in lanes]
        ok = [act[lane] and 0 <= e[lane] < num_experts for lane in lanes]
        r = [e[lane] // per_rank if ok[lane] else -1 for lane in lanes]
        below = [(1 << lane) - 1 for lane in lanes]
        same_e = _match_any([e[lane] if ok[lane] else -1 - lane for lane in lanes])
        same_r = _match_any([lc[lane] * world + r[lane] if ok[lane] else -1 - lane for lane in lanes])
        g = [hb[e[lane]] + _popc(same_e[lane] & below[lane]) if ok[lane] else -1 for lane in lanes]
        first = [ok[lane] and same_r[lane] & below[lane] == 0 for lane in lanes]
        same_f = _match_any([r[lane] if first[lane] else -1 - lane for lane in lanes])
        row0 = [hb[nx + r[lane]] + _popc(same_f[lane] & below[lane]) if first[lane] else 0 for lane in lanes]
        moves = [(e[lane], _popc(same_e[lane])) for lane in lanes if ok[lane] and same_e[lane] >> (lane + 1) == 0]
        moves += [(nx + r[lane], _popc(same_f[lane])) for lane in lanes
                  if first[lane] and same_f[lane] >> (lane + 1) == 0]
        for at, n in moves:  # (after the wave barrier: every lane read its counters first)
            hb[at] += n
        for lane in lanes:
            if act[lane]:
                lead = _popc((same_r[lane] & -same_r[lane]) - 1)
                kept = ok[lane] and g[lane] < ht[e[lane]]
                out[(c[lane], lj[lane])] = (g[lane] if kept else -1, row0[lead] if ok[lane] else -1,
                                            (r[lane] | (FIRST if first[lane] else 0)) if ok[lane] else -1)
    return out, hb


@pytest.mark.parametrize("wave", [32, 64])
def test_several_tokens_a_step_number_as_one_token_a_step(wave):
    rng = random.Random(20261206 + wave)
    for _ in range(600):
        world = rng.choice([1, 2, 3, 8, 64])
        per_rank = rng.choice([1, 2, 5, 32])
        num_experts = world * per_rank
        k = rng.choice([1, 2, 3, 4, 6, 8, 9, 16, 32])
        nc = rng.randint(1, 16)  # EPG_DIRECT_CHUNK
        pool = [-1, num_experts, num_experts + 7] + list(range(num_experts)) * 2
        if rng.random() < 0.3:  # few experts: many repeats within and across tokens
            pool = [0, 1 % num_experts, -1]
        tokens = [[rng.choice(pool) for _ in range(k)] for _ in range(nc)]
        hb = [rng.randint(0, 40) for _ in range(num_experts + world)]
        ht = [rng.randint(0, 60) for _ in range(num_experts + world)]
        want = one_token_a_step(tokens, per_rank, num_experts, hb, ht)
        assert several_tokens_a_step(tokens, per_rank, num_experts, world, hb, ht, wave) == want, \
            (world, per_rank, k, tokens)


def _epg_div(n: int, d: int) -> int:
    """templates/targets/common.j2 EpgDiv: the high word of n * floor((2^32 - 1) / d), fixed by one compare."""
    assert 0 <= n < 1 << 32 and d >= 1
    q = (n * (0xFFFFFFFF // d)) >> 32
    return q + 1 if n - q * d >= d else q


def test_the_blocks_split_the_tokens_evenly():
    """Step 1's split: block b takes [floor(b T / G), floor((b + 1) T / G)) in 32-bit arithmetic (the template's
    lines, checked first). Every token once, in order, shares within one token of each other, none above `per` (what
    the wide copy's choice reads), at the largest grid and token count the plan allows (plan.DIRECT_MAX_GRID,
    DIRECT_MAX_TOKENS: T x G < 2^32)."""
    from runtime.plan import DIRECT_MAX_GRID, DIRECT_MAX_TOKENS
    for line in ("const EpgDiv per_grid((epg_u32)epg_nblocks());",
                 "const epg_i64 per = per_grid.div((epg_u32)(T + epg_nblocks() - 1));",
                 "const epg_i64 t0 = per_grid.div((epg_u32)(epg_block() * T));",
                 "const epg_i64 t1 = per_grid.div((epg_u32)((epg_block() + 1) * T));"):
        assert line in TEMPLATE, line
    assert DIRECT_MAX_GRID * DIRECT_MAX_TOKENS + DIRECT_MAX_GRID <= 1 << 32
    for G in (1, 2, 7, 132, 304, DIRECT_MAX_GRID):
        for T in (0, 1, 8, 127, 128, 1000, 1024, 4096, 8191, DIRECT_MAX_TOKENS - 1, DIRECT_MAX_TOKENS):
            per = _epg_div(T + G - 1, G)
            assert per == -(-T // G), (G, T)
            bounds = [(_epg_div(b * T, G), _epg_div((b + 1) * T, G)) for b in range(G)]
            assert bounds[0][0] == 0 and bounds[-1][1] == T, (G, T)
            assert all(bounds[b][1] == bounds[b + 1][0] for b in range(G - 1)), (G, T)
            sizes = {t1 - t0 for t0, t1 in bounds}
            assert max(sizes) - min(sizes) <= 1 and max(sizes) <= per, (G, T, sizes)
    assert {t1 - t0 for t0, t1 in ((_epg_div(b * 4096, 132), _epg_div((b + 1) * 4096, 132)) for b in range(132))} == {31, 32}
