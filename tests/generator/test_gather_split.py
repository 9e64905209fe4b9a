"""combine_gather's split of the gather (templates/kernels/combine_gather.j2): the tokens' segments, in (token,
segment) order, go to the grid's waves as one contiguous range each, the ranges' lengths at most one segment apart.
Modelled in Python on the template's expressions (the test first checks the template holds them), every (token,
segment) must be gathered exactly once, each wave's runs must stay inside one token and follow its range in order,
and no wave may take two segments more than another: any token count (none, fewer than the waves, more), any
segment count, grids from one wave up. Each block's slot range (EpgGatherSplit: the (token, k) slots whose ranks
the block waits for at the staging barrier) must hold every token its waves gather."""

import random

import pytest

from tests.conftest import ROOT

TEMPLATE = (ROOT / "templates" / "kernels" / "combine_gather.j2").read_text()


def test_the_template_holds_the_modelled_split():
    for line in ("const epg_i64 nwaves = gthreads / EPG_WAVE, wv = gtid / EPG_WAVE;",
                 "const epg_i64 units = split.units, u1 = units * (wv + 1) / nwaves;",
                 "units = a.num_tokens * nseg;",
                 "const epg_i64 u0 = units * bw0 / nwaves, u1 = units * (bw0 + wpb) / nwaves;",
                 "slot0 = u1 > u0 ? u0 / nseg * a.k : 0;",
                 "slot1 = u1 > u0 ? ((u1 - 1) / nseg + 1) * a.k : 0;",
                 "for (epg_i64 u = units * wv / nwaves; u < u1;) {",
                 "const epg_i64 t = u / nseg;",
                 "const epg_i64 s0 = u - t * nseg, s1 = s0 + (u1 - u) < nseg ? s0 + (u1 - u) : nseg;",
                 "u += s1 - s0;",
                 "for (epg_i64 seg = s0; seg < s1; ++seg) {"):
        assert line in TEMPLATE, line


def _runs(tokens: int, nseg: int, nwaves: int, wv: int) -> list[tuple[int, int, int]]:
    """Wave wv's (token, first segment, end segment) runs, as the template's loop walks them."""
    units = tokens * nseg
    u1 = units * (wv + 1) // nwaves
    u = units * wv // nwaves
    runs = []
    while u < u1:
        t = u // nseg
        s0 = u - t * nseg
        s1 = s0 + (u1 - u) if s0 + (u1 - u) < nseg else nseg
        u += s1 - s0
        assert s1 > s0, "a run that takes nothing would loop forever"
        runs.append((t, s0, s1))
    return runs


CASES = [(0, 7, 16), (1, 7, 2112), (3, 1, 5), (128, 7, 2112), (3000, 7, 2112), (4096, 7, 2112), (4096, 4, 1),
         (37, 3, 64), (1000, 14, 999)]
rng = random.Random(5)
CASES += [(rng.randrange(0, 600), rng.randrange(1, 16), rng.randrange(1, 700)) for _ in range(40)]


@pytest.mark.parametrize("tokens,nseg,nwaves", CASES)
def test_every_segment_once_in_balanced_ranges(tokens, nseg, nwaves):
    seen = []
    lengths = []
    for wv in range(nwaves):
        runs = _runs(tokens, nseg, nwaves, wv)
        lengths.append(sum(s1 - s0 for _, s0, s1 in runs))
        for t, s0, s1 in runs:
            assert 0 <= t < tokens and 0 <= s0 < s1 <= nseg, (wv, t, s0, s1)
            seen += [(t, s) for s in range(s0, s1)]
    # in (token, segment) order across the waves: each exactly once
    assert seen == [(t, s) for t in range(tokens) for s in range(nseg)]
    assert max(lengths) - min(lengths) <= 1, (min(lengths), max(lengths))


def _block_slots(tokens: int, nseg: int, nwaves: int, wpb: int, block: int, k: int) -> tuple[int, int]:
    """EpgGatherSplit's [slot0, slot1) of block `block` (wpb waves a block), as the template works it out."""
    units = tokens * nseg
    bw0 = block * wpb
    u0, u1 = units * bw0 // nwaves, units * (bw0 + wpb) // nwaves
    return (u0 // nseg * k, ((u1 - 1) // nseg + 1) * k) if u1 > u0 else (0, 0)


@pytest.mark.parametrize("tokens,nseg,nwaves", [c for c in CASES if c[2] % 4 == 0] + [(4096, 7, 2112), (128, 4, 64)])
@pytest.mark.parametrize("wpb", [1, 4])
def test_each_block_waits_for_the_slots_of_every_token_it_gathers(tokens, nseg, nwaves, wpb):
    k = 8
    assert nwaves % wpb == 0  # whole blocks
    for block in range(nwaves // wpb):
        slot0, slot1 = _block_slots(tokens, nseg, nwaves, wpb, block, k)
        gathered = {t for wv in range(block * wpb, (block + 1) * wpb) for t, _, _ in _runs(tokens, nseg, nwaves, wv)}
        for t in gathered:
            assert slot0 <= t * k and (t + 1) * k <= slot1, (block, t, slot0, slot1)
        # and no more than the tokens its waves touch
        assert slot1 - slot0 == (len(gathered) * k if gathered else 0), (block, slot0, slot1, sorted(gathered))
