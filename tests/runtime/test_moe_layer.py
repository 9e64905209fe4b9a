"""examples/moe_layer.py on CPU: 2 gloo ranks (torch backend) against the dense single-process reference
(tests/support/moe_layer_ref.py: per-token relative error <= 1e-2), and the example's own torchrun command."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.support.ep_dist import get_world
from tests.support.moe_layer_ref import REL_TOL, ROOT, check_block, dense_reference, load_example, torchrun_example


def scn_block(rank, world, hidden, experts, topk, inter, tokens):
    return check_block(hidden, experts, topk, inter, tokens, device="cpu")


@pytest.mark.parametrize("tokens", [1, 24])
def test_moe_block_matches_dense_reference(tokens):
    errs = get_world(2).run(scn_block, 256, 8, 4, 64, tokens, timeout=120)
    assert all(e <= REL_TOL for e in errs)


def test_router_weights_are_normalised_and_experts_reproducible():
    ex = load_example()
    x = torch.randn(5, 64).to(torch.bfloat16)
    w, idx = ex.route(x, ex.router_weight(16, 64), 4)
    assert idx.dtype == torch.int32 and idx.shape == (5, 4)
    assert torch.allclose(w.sum(-1), torch.ones(5))
    assert all(len(set(r)) == 4 for r in idx.tolist())  # distinct experts per token
    a, b = ex.expert_weights(3, 64, 32), ex.expert_weights(3, 64, 32)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert a[0].shape == (64, 64) and a[1].shape == (64, 32)
    assert not torch.equal(a[0], ex.expert_weights(4, 64, 32)[0])


def test_grouped_experts_match_one_expert_at_a_time(monkeypatch):
    ex = load_example()
    w13 = torch.randn(3, 32, 16).to(torch.bfloat16)
    w2 = torch.randn(3, 16, 16).to(torch.bfloat16)
    xs = torch.randn(12, 16).to(torch.bfloat16)
    offs = torch.tensor([4, 4, 12], dtype=torch.int32)  # expert 1's group is empty
    want = [ex.expert_ffn(xs[:4], w13[0], w2[0]), ex.expert_ffn(xs[4:12], w13[2], w2[2])]
    assert ex.grouped_gemm_ok(xs) == hasattr(torch, "_grouped_mm")  # CPU: torch._grouped_mm where torch has it
    if hasattr(torch, "_grouped_mm"):
        out = ex.experts_grouped(xs, offs, w13, w2)
        assert torch.allclose(out[:4].float(), want[0].float(), rtol=2 ** -7, atol=1e-2)
        assert torch.allclose(out[4:].float(), want[1].float(), rtol=2 ** -7, atol=1e-2)
    monkeypatch.setattr(ex, "grouped_gemm_ok", lambda x: False)  # the loop over the groups
    out = ex.experts_grouped(xs, offs, w13, w2)
    assert torch.equal(out[:4], want[0]) and torch.equal(out[4:], want[1])


def test_example_command_runs_under_torchrun():
    # rank 0 prints every rank's line whole, then the verdict
    res, lines = torchrun_example("moe_layer", "--hidden", "256", "--experts", "8", "--topk", "4", "--intermediate", "64",
                                  "--tokens", "16", "--iters", "2")
    assert [line.split(":")[0] for line in lines[-3:-1]] == ["rank 0", "rank 1"], res.stdout
    assert all(line.count("ms per layer (eager)") == 1 for line in lines[-3:-1]), res.stdout
    assert lines[-1].startswith("OK: the EP layer on 2 rank(s) matches its dense reference"), res.stdout


def test_example_verdict_measures_the_distance_from_the_dense_layer():
    import types

    ex = load_example()
    hidden, experts, inter = 64, 8, 32
    x = torch.randn(6, hidden).to(torch.bfloat16)
    block = types.SimpleNamespace(gate=ex.router_weight(experts, hidden), k=2)
    want = dense_reference(ex, x, hidden, experts, 2, inter)
    assert ex.dense_error(x, want, block, hidden, inter) == 0.0
    assert ex.dense_error(x, torch.zeros_like(x), block, hidden, inter) == 1.0 > ex.TOLERANCE


def test_an_expert_count_the_world_size_does_not_divide_is_refused_up_front():
    ex = load_example()
    assert ex.experts_per_rank(16, 2) == 8 and ex.experts_per_rank(255, 3) == 85
    for experts, world, fix in ((15, 2, "2 × 7 = 14); try --experts 14 or 16"),
                                (256, 3, "3 × 85 = 255); try --experts 255 or 258"), (1, 2, "2 × 0 = 0); try --experts 2")):
        with pytest.raises(ValueError, match=rf"^--experts {experts}: .*world size must divide .*\({re.escape(fix)}$"):
            ex.experts_per_rank(experts, world)
    # the command refuses before any process group is made: each rank one line (no torchrun needed to see it)
    env = dict(os.environ, PYTHONPATH=str(ROOT), WORLD_SIZE="2")
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "moe_layer.py"), "--experts", "15"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.splitlines()[-1] == ("moe_layer.py: error: --experts 15: 2 rank(s) hold the experts in equal "
                                          "shares, so the world size must divide the expert count (2 × 7 = 14); try "
                                          "--experts 14 or 16"), res.stderr
