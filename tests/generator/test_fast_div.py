"""EpgDiv (templates/targets/common.j2): n / d for a kernel-fixed d as the high word of n * m, m = floor((2^32 - 1) / d),
plus one compare. The template's arithmetic, modelled in Python on 32-bit words, must give floor(n / d) for every 32-bit
n and d >= 1; the model reads its expressions from the template, so a changed template is tested as it is."""

import random
import re

import pytest

from tests.conftest import ROOT

TEMPLATE = (ROOT / "templates" / "targets" / "common.j2").read_text()
M32 = 0xFFFFFFFF


def test_the_template_holds_the_modelled_arithmetic():
    body = TEMPLATE[TEMPLATE.index("struct EpgDiv {"):]
    body = body[:body.index("};")]
    assert "m(0xffffffffu / divisor)" in body
    assert re.search(r"q = \(epg_u32\)\(\(\(epg_u64\)n \* m\) >> 32\);", body)
    assert "return n - q * d >= d ? q + 1u : q;" in body
    assert "return div(n + d - 1u) * d;" in body


def div(n: int, d: int) -> int:
    m = M32 // d
    q = ((n * m) >> 32) & M32
    return q + 1 if ((n - q * d) & M32) >= d else q


def round_up(n: int, d: int) -> int:
    return (div((n + d - 1) & M32, d) * d) & M32


EDGES = [0, 1, 2, 3, 7, 8, 15, 16, 255, 256, 1 << 16, (1 << 24) - 1, 1 << 24, (1 << 31) - 1, 1 << 31, M32 - 1, M32]


@pytest.mark.parametrize("d", [1, 2, 3, 5, 6, 7, 8, 12, 16, 24, 32, 48, 96, 128, 255, 256, 700, 1000, 4096,
                               65535, 65536, 65537, (1 << 31) - 1, 1 << 31, M32 - 1, M32])
def test_division_is_exact_at_the_edges(d):
    ns = set(EDGES)
    for k in (1, 2, 3, 1000, 65536):  # around multiples of d, where an off-by-one would show
        for base in (k * d - 1, k * d, k * d + 1):
            if 0 <= base <= M32:
                ns.add(base)
    for n in ns:
        assert div(n, d) == n // d, (n, d)


def test_division_is_exact_for_random_words():
    rng = random.Random(35)
    for _ in range(200_000):
        d = rng.choice((rng.randint(1, 64), rng.randint(1, 1 << 16), rng.randint(1, M32)))
        n = rng.choice((rng.randint(0, 1 << 12), rng.randint(0, M32)))
        assert div(n, d) == n // d, (n, d)


def test_division_is_exact_for_every_small_pair():
    for d in range(1, 130):
        for n in range(0, 4 * d + 600):
            assert div(n, d) == n // d, (n, d)


@pytest.mark.parametrize("d", [1, 3, 16, 48, 128, 1000])
def test_round_up_pads_to_the_next_multiple(d):
    for n in list(range(0, 3 * d + 5)) + [100_000, (1 << 24) + 3]:
        assert round_up(n, d) == -(-n // d) * d, (n, d)
