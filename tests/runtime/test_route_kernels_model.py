"""The routing kernels' algorithm (templates/kernels/route_count.j2, route_slots.j2), stepped in Python
lane by lane with their wave ballots and block scans, against the torch reference
(runtime/routing.py send_counts / ordered_slots) on random routings: ids past num_experts, negative
ids, repeated ranks, receive caps, several block and wave sizes. The GPU tests run the kernels
themselves; this pins the arithmetic (the ballot prefix, the per-chunk carry) on CPU."""

from __future__ import annotations

import pytest
import torch

from runtime.routing import ordered_slots, send_counts


def model_route_count(idx, W, epr, E):
    counts = [0] * W
    for ids in idx.tolist():
        for j, e in enumerate(ids):
            if not 0 <= e < E:
                continue
            d = e // epr
            if all(not (0 <= ids[jj] < E and ids[jj] // epr == d) for jj in range(j)):
                counts[d] += 1
    return counts


def model_route_slots(idx, every, rank, W, epr, E, cap, block, wave):
    T, k = idx.shape
    ids = idx.tolist()
    slots = [[-1] * k for _ in range(T)]
    waves = block // wave
    for d in range(W):
        nxt = sum(every[s][d] for s in range(rank))
        for c0 in range(0, T, block):
            jf = []
            for tid in range(block):
                t = c0 + tid
                f = -1
                if t < T:
                    for j in range(k):
                        e = ids[t][j]
                        if 0 <= e < E and e // epr == d:
                            f = j
                            break
                jf.append(f)
            masks = []
            for w in range(waves):  # the ballot of each wave, bit = lane
                masks.append(sum(1 << lane for lane in range(wave) if jf[w * wave + lane] >= 0))
            wave_rows = [bin(m).count("1") for m in masks]
            for tid in range(block):
                w, lane = divmod(tid, wave)
                below = ((masks[w] << (64 - lane)) & ((1 << 64) - 1)) if lane else 0
                row = nxt + bin(below).count("1") + sum(wave_rows[:w])
                if jf[tid] >= 0:
                    slots[c0 + tid][jf[tid]] = row * W + d if row < cap else -1
            nxt += sum(wave_rows)
    arriving = sum(every[s][rank] for s in range(W))
    kept = min(arriving, cap)
    return slots, kept, arriving - kept


@pytest.mark.parametrize("W,T,k,epr,block,wave", [(2, 37, 4, 3, 64, 32), (4, 130, 8, 2, 128, 64),
                                                   (3, 5, 2, 4, 64, 64), (8, 300, 8, 4, 256, 32)])
@pytest.mark.parametrize("cap_frac", [1.0, 0.5, 0.1])
def test_kernel_model_matches_the_reference(W, T, k, epr, block, wave, cap_frac):
    E = W * epr
    g = torch.Generator().manual_seed(W * 1000 + T)
    # every rank's routing; some ids invalid (>= E or negative), repeats of a rank common
    idxs = [torch.randint(-2, E + 3, (T, k), generator=g, dtype=torch.int32) for _ in range(W)]
    counts = [model_route_count(i, W, epr, E) for i in idxs]
    for i, c in zip(idxs, counts):
        assert c == send_counts(i, W, epr, E)[2].sum(0).tolist()
    every = counts  # every[s][d]
    cap = max(1, int(cap_frac * W * T))
    for rank in range(W):
        want_slots, want_total, want_dropped = ordered_slots(
            idxs[rank], rank, W, epr, E, cap, lambda c: torch.tensor(every, dtype=c.dtype))
        slots, total, dropped = model_route_slots(idxs[rank], every, rank, W, epr, E, cap, block, wave)
        assert slots == want_slots.tolist(), (rank, cap)
        assert (total, dropped) == (int(want_total), int(want_dropped))
