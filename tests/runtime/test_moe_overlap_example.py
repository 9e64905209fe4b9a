"""examples/moe_overlap.py on CPU: the MoE block of examples/moe_layer.py as two overlapped micro-batches (split-phase
legs, max_inflight=2; the torch backend runs each leg's halves in order) on 2 gloo ranks: within the dense
reference's tolerance (tests/support/moe_layer_ref.py) and bit for bit the micro-batches run one at a time; and the
example's own torchrun command."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.ep_dist import get_world
from tests.support.moe_layer_ref import REL_TOL, dense_reference, load_example, relative_errors, torchrun_example


def scn_overlap(rank, world, hidden, experts, topk, inter, tokens):
    ex = load_example("moe_overlap")
    block = ex.build(hidden, experts, topk, inter, tokens, device="cpu")
    g = torch.Generator().manual_seed(2000 + dist.get_rank())
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    with block.op:
        assert block.op.config.max_inflight == 2
        got = ex.overlapped_forward(block, x)
        again = ex.overlapped_forward(block, x)  # the slots reused
        one_call = ex.sequential_forward(block, x)
    assert torch.equal(got, one_call) and torch.equal(got, again)
    worst = float(relative_errors(got, dense_reference(ex.layer, x, hidden, experts, topk, inter)).max())
    assert worst <= REL_TOL, worst
    return worst


@pytest.mark.parametrize("tokens", [1, 2, 23])
def test_overlapped_block_matches_dense_reference_and_one_call_form(tokens):
    assert all(e <= REL_TOL for e in get_world(2).run(scn_overlap, 256, 8, 4, 64, tokens, timeout=120))


def test_overlap_example_command_runs_under_torchrun():
    res, lines = torchrun_example("moe_overlap", "--hidden", "256", "--experts", "8", "--topk", "4", "--intermediate",
                                  "64", "--tokens", "16", "--iters", "2")
    assert [line.split(":")[0] for line in lines[-3:-1]] == ["rank 0", "rank 1"], res.stdout
    assert all("the same bits as the one-call form" in line for line in lines[-3:-1]), res.stdout
    assert lines[-1].startswith("OK: the overlapped EP layer on 2 rank(s) matches its dense reference"), res.stdout
