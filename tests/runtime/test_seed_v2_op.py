"""The seed's EPv2 op test (test_op.py) and its pytest matrix (test_dispatch_combine_v2_intranode.py), its
asymmetric-dtype, lifecycle and backend-parity tests and its benchmark's correctness gate, run through
runtime.seed_compat on 2 and 4 CPU gloo ranks (torch backend): every seed check of each call sequence
(tests/support/seed_v2_calls.py) must pass on every rank."""

from __future__ import annotations

import pytest

from tests.support import seed_v2_calls as calls
from tests.support.ep_dist import get_world

WORLDS = [2, 4]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", list(calls.MATRIX) + list(calls.EXTRA))
def test_seed_op_matrix(world, case):
    env = {**calls.MATRIX, **calls.EXTRA}[case]
    for lines in get_world(world).run(calls.op_matrix_case, env, timeout=180):
        assert all(line.endswith("PASS") for line in lines) and len(lines) >= 2, lines


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("disp", ["fp8", "fp4"])
def test_seed_asym_dtype(world, disp):
    for lines in get_world(world).run(calls.asym_case, disp, timeout=180):
        assert len(lines) == 4, lines


@pytest.mark.parametrize("world", WORLDS)
def test_seed_op_lifecycle(world):
    assert get_world(world).run(calls.lifecycle_case, timeout=180) == [["LIFECYCLE: PASS"]] * world


@pytest.mark.parametrize("world", WORLDS)
def test_seed_backend_parity(world):
    for lines in get_world(world).run(calls.parity_case, timeout=180):
        assert len(lines) == 2, lines


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("disp, combine_in", [("bf16", "inplace"), ("bf16", "staged"), ("fp8", "inplace")])
def test_seed_bench_gate(world, disp, combine_in):
    for lines in get_world(world).run(calls.bench_gate_case, disp, combine_in, timeout=180):
        assert len(lines) == 2, lines
