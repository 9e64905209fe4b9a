"""The eager grouped legs' host work, counted on the native backend's host side over stand-ins for the device
(scripts/host_cost.py): each leg one launch, and no more Python function calls than the budgets below. The counts do
not depend on the machine; a change that adds a layer to the eager path fails here and must say why in the budget."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.support.host_standin import standin_device

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "host_cost.py"
_SPEC = importlib.util.spec_from_file_location("host_cost", _SCRIPT)
host_cost = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(host_cost)

#: Python-level calls per eager call (sys.setprofile "call" events), at 1 token (low-latency protocol) and 128 (the
#: bandwidth protocol's direct dispatch), and the plain legs. Before the steady path (2026-12-04): 55 / 40 and 58 / 44
#: for the grouped legs.
BUDGET = {"dispatch_grouped": 23, "combine_grouped": 19, "dispatch": 20, "combine": 16}
FRESH_BUDGET = 47  # dispatch_grouped(fresh=True): the training forward's call (its own layout's allocations)


@pytest.mark.parametrize("tokens,protocol", [(1, "ll"), (128, "bw")])
def test_each_eager_grouped_leg_is_one_launch_within_its_call_budget(tokens, protocol):
    with standin_device(record_args=False) as log:
        rec = host_cost.point(tokens, "auto", 100, 0, log)
    assert rec["protocol"] == protocol
    legs = rec["legs"]
    for name, most in BUDGET.items():
        assert legs[name]["launches"] == 1, (name, legs[name]["kernels"])
        assert legs[name]["py_calls"] <= most, (name, legs[name]["py_calls"], most)
    assert legs["dispatch_grouped_fresh"]["py_calls"] <= FRESH_BUDGET


def test_host_cost_script_writes_its_records(tmp_path, capsys):
    out = tmp_path / "host.jsonl"
    assert host_cost.main(["--tokens", "1", "--iters", "100", "--profile", "3", "--out", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 1 and recs[0]["kind"] == "host_cost" and recs[0]["tokens_per_rank"] == 1
    leg = recs[0]["legs"]["dispatch_grouped"]
    assert leg["us"] > 0 and len(leg["host_top"]) == 3 and {"commit", "host_cpu", "torch"} <= set(recs[0])
    printed = capsys.readouterr().out
    assert "| 1 | ll | dispatch_grouped | 1 |" in printed


#: epgen's own Python calls (functions under runtime/) in one training step through runtime.autograd at a tiny shape:
#: dispatch_grouped -> an elementwise expert -> combine_grouped, forward and backward. At 5c8f18f: 167; 149 since
#: dispatch_grouped's backward is one combine launch (no pair-sum call) and its forward reuses its layout's views;
#: 151 since each grouped backward's work is a function of its own, which the eager Function and the custom op that
#: torch.compile traces (epgen::*_backward) both call; 153 since GroupedLayout's __init__ is epgen's own (one dict
#: store per field, where the frozen dataclass's generated one, not counted here, set each through object.__setattr__).
STEP_BUDGET = 153


def test_a_training_step_is_five_launches_within_its_call_budget():
    """The step's kernels (forward: dispatch and combine; backward: the routing replay, combine's backward kernel,
    and dispatch's backward as one combine that sums each row's pair gradients itself) and epgen's own Python calls, counted by the functions' files (torch's own
    Python, which changes with its version, is not counted)."""
    import collections

    import torch

    import runtime
    from runtime import autograd as ag

    root = str(Path(runtime.__file__).parent)
    ag._ONE_LAUNCH_BACKWARD, was = True, ag._ONE_LAUNCH_BACKWARD  # the one-launch backward (the default), whatever ran before
    with standin_device(record_args=False) as log:
        op, x, w, idx = host_cost.build(1, hidden=64, experts=16)
        try:
            xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

            def step():
                layout, h = ag.dispatch_grouped(op, xr, wr, idx)
                ag.combine_grouped(op, layout.x * 1.0, h).float().sum().backward()
            step()
            before, n = len(log), collections.Counter()

            def hook(frame, event, arg):
                if event == "call" and frame.f_code.co_filename.startswith(root):
                    n["epgen"] += 1
            host_cost.profiled(hook, step)
            kernels = [entry[0].split("__")[0] for entry in log[before:]]
        finally:
            op.close()
            ag._ONE_LAUNCH_BACKWARD = was
    # the forward's dispatch places its layout (dispatch_ll_tail); the backward's replay places none (dispatch_ll)
    assert kernels == ["epg_dispatch_ll_tail", "epg_combine_ll", "epg_dispatch_ll", "epg_grouped_scale",
                       "epg_combine_ll"], kernels
    assert 0 < n["epgen"] <= STEP_BUDGET, n
    assert torch.is_grad_enabled()


def test_the_standalone_placement_records_its_end_in_the_ops_state():
    """grouped_place on the op's own buffers is given the address of the slot's state word grouped_end (its block 0
    writes the layout's end there: a later dispatch tail re-marks the rows from it); on a fresh layout's outputs it
    is given none (the op's own rows are untouched)."""
    from generator.abi import STATE_WORDS

    with standin_device() as log:
        op, x, w, idx = host_cost.build(1, hidden=64, experts=16)
        try:
            be = op._backend
            be.one_kernel = "never"  # dispatch_ll, then the standalone grouped_place

            def place_args(call) -> dict:
                n = len(log)
                call()
                places = [a for sym, _, _, a in log[n:] if sym.startswith("epg_grouped_place")]
                assert len(places) == 1, [entry[0] for entry in log[n:]]
                return places[0].as_dict()
            word = be.state.data_ptr() + 4 * STATE_WORDS.index("grouped_end")
            assert place_args(lambda: op.dispatch_grouped(x, w, None, idx))["grouped_end"] == word
            assert place_args(lambda: op.dispatch_grouped(x, w, None, idx, fresh=True))["grouped_end"] == 0
        finally:
            op.close()
