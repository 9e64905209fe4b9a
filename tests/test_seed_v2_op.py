"""The seed's EPv2 op test (test_op.py) and its pytest matrix (test_dispatch_combine_v2_intranode.py), its
asymmetric-dtype, lifecycle and backend-parity tests and its benchmark's correctness gate, run through
runtime.seed_compat on 2 and 4 CPU gloo ranks (torch backend): every seed check of each call sequence
(tests/seed_v2_calls.py) must pass on every rank."""

from __future__ import annotations

import pytest

import seed_v2_calls as calls
from ep_dist import get_world

# the seed's matrix (its ids), at a small hidden size and token sweep; fp4 runs everywhere here (the seed skips it
# off gfx950: its kernels need the conversion instructions, epgen's torch backend does not)
MATRIX = {
    "bf16-gather": {"DTYPE": "bf16", "COMBINE": "gather"},
    "bf16-scatter": {"DTYPE": "bf16", "COMBINE": "scatter"},
    "f32-gather": {"DTYPE": "f32", "COMBINE": "gather"},
    "f32-scatter": {"DTYPE": "f32", "COMBINE": "scatter"},
    "fp4-gather": {"DTYPE": "fp4", "COMBINE": "gather", "TUNED": 1},
    "fp8-gather": {"DTYPE": "fp8", "COMBINE": "gather"},
    "fp8-gather-tuned": {"DTYPE": "fp8", "COMBINE": "gather", "TUNED": 1},
    "bf16-scatter-fp8direct": {"DTYPE": "bf16", "COMBINE": "scatter", "QUANT": "fp8_direct_cast"},
    "bf16-scatter-fp8blockwise": {"DTYPE": "bf16", "COMBINE": "scatter", "QUANT": "fp8_blockwise"},
    "bf16-scatter-fp8blockwise-scaled": {"DTYPE": "bf16", "COMBINE": "scatter", "QUANT": "fp8_blockwise",
                                         "INSCALE": 200},
    "bf16-gather-scales": {"DTYPE": "bf16", "COMBINE": "gather", "SCALE_DIM": 32},
    "bf16-scatter-scales": {"DTYPE": "bf16", "COMBINE": "scatter", "SCALE_DIM": 32},
    "bf16-gather-topk4": {"DTYPE": "bf16", "COMBINE": "gather", "TOPK": 4},
    "bf16-gather-topk9": {"DTYPE": "bf16", "COMBINE": "gather", "TOPK": 9},
    "bf16-gather-tuned": {"DTYPE": "bf16", "COMBINE": "gather", "TUNED": 1},
    "bf16-gather-replay": {"DTYPE": "bf16", "COMBINE": "gather", "REPLAY": 1},
    "bf16-stdmoe": {"DTYPE": "bf16", "COMBINE": "gather", "STDMOE": 1},
}
# test_op.py's other switches: a receive cap (MAXRECV), reset between calls (RESET), the quant types given with
# combine_mode="gather" (the seed switches them to scatter), scales not a multiple of 4 bytes, scales on fp8
EXTRA = {
    "bf16-gather-cap": {"MAXRECV": 20},
    "bf16-gather-reset": {"RESET": 1},
    "bf16-gather-fp8direct-switches": {"COMBINE": "gather", "QUANT": "fp8_direct_cast"},
    "f32-scatter-scales6": {"DTYPE": "f32", "COMBINE": "scatter", "SCALE_DIM": 6},
    "fp8-gather-scales": {"DTYPE": "fp8", "SCALE_DIM": 8},
}

WORLDS = [2, 4]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", list(MATRIX) + list(EXTRA))
def test_seed_op_matrix(world, case):
    env = {**MATRIX, **EXTRA}[case]
    for lines in get_world(world).run(calls.op_matrix_case, env, timeout=180):
        assert all(line.endswith("PASS") for line in lines) and len(lines) >= 2, lines


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("disp", ["fp8", "fp4"])
def test_seed_asym_dtype(world, disp):
    for lines in get_world(world).run(calls.asym_case, disp, timeout=180):
        assert len(lines) == 4, lines


@pytest.mark.parametrize("world", WORLDS)
def test_seed_op_lifecycle(world):
    assert get_world(world).run(calls.lifecycle_case) == [["LIFECYCLE: PASS"]] * world


@pytest.mark.parametrize("world", WORLDS)
def test_seed_backend_parity(world):
    for lines in get_world(world).run(calls.parity_case, timeout=180):
        assert len(lines) == 2, lines


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("disp, combine_in", [("bf16", "inplace"), ("bf16", "staged"), ("fp8", "inplace")])
def test_seed_bench_gate(world, disp, combine_in):
    for lines in get_world(world).run(calls.bench_gate_case, disp, combine_in, timeout=180):
        assert len(lines) == 2, lines
