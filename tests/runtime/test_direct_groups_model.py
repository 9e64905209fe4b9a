"""The host model of a grouped dispatch whose senders write straight into the groups (tests/support/direct_groups.py):
from the counts alone every sender places its pairs where runtime/grouped.py's rule puts them in the rows received
in (source rank, token) order, through repeated ids, ids routed nowhere, ranks with no tokens, the receive cap and
a grouped capacity that drops pairs, alignments that are no power of two."""

from __future__ import annotations

import random

import pytest
import torch

from runtime import grouped
from tests.support.direct_groups import received_layout, sender_layout


def _case(seed: int):
    rnd = random.Random(seed)
    world, E, k = rnd.choice((1, 2, 3, 4)), rnd.choice((1, 3, 8)), rnd.choice((1, 2, 4, 8))
    align = rnd.choice((1, 3, 16))
    tokens = [rnd.choice((0, 1, 5, 12)) for _ in range(world)]
    indices = []
    for T in tokens:
        ids = [[rnd.randrange(world * E + (1 if rnd.random() < 0.1 else 0)) for _ in range(k)] for _ in range(T)]
        indices.append(torch.tensor(ids, dtype=torch.int64).view(T, k))
    full = grouped.grouped_rows(world, max(tokens + [1]), E, k, align)  # the default capacity: nothing cut
    capacity = rnd.choice((full, max(align, full // 3)))
    max_recv = rnd.choice((world * max(tokens + [1]), max(1, sum(tokens) // 3)))
    return indices, E, align, capacity, max_recv


@pytest.mark.parametrize("seed", range(60))
def test_senders_place_their_pairs_where_the_receivers_rule_does(seed):
    indices, E, align, capacity, max_recv = _case(seed)
    model = sender_layout(indices, E, align, capacity, max_recv)
    for r, got in enumerate(model):
        want = received_layout(indices, r, E, align, capacity, max_recv)
        assert got == want, (seed, r)


def test_the_model_is_not_vacuous():
    """Across the cases, pairs are placed, dropped by the receive cap and by the grouped capacity."""
    placed = cap_drops = capacity_drops = 0
    for seed in range(60):
        indices, E, align, capacity, max_recv = _case(seed)
        for lay in sender_layout(indices, E, align, capacity, max_recv):
            placed += sum(1 for g in lay["where"].values() if g >= 0)
            capacity_drops += lay["dropped"]
            cap_drops += sum(1 for g in lay["where"].values() if g < 0) - lay["dropped"]
    assert placed > 500 and cap_drops > 0 and capacity_drops > 0, (placed, cap_drops, capacity_drops)
