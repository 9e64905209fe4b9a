"""dispatch_grouped's backward on the native backend's host side (over stand-ins for the device,
tests/support/host_standin.py): one combine launch that forms each received row from its pairs' gradient rows under
the forward's saved pair map and sends each pair's weight gradient (grp_pair_w), under both protocols; the separate
pair sum and combine where the op combines grouped rows in two kernels (one_kernel "never"); and no later combine
inherits the field. The numbers themselves are held on the GPU (tests/gpu/test_ep_autograd.py: against the torch
backend and against the pair sum + combine, bit for bit). It is on by default since those passed
(runtime.autograd._ONE_LAUNCH_BACKWARD); test_on_by_default and test_switched_off_keeps_the_pair_sum hold the switch."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from runtime import autograd as ag
from tests.support.host_standin import standin_device


@pytest.fixture(autouse=True)
def one_launch_backward(monkeypatch):
    """The one-launch backward (the default) for every test here, whatever another test left set."""
    monkeypatch.setattr(ag, "_ONE_LAUNCH_BACKWARD", True)

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "host_cost.py"
_SPEC = importlib.util.spec_from_file_location("host_cost", _SCRIPT)
host_cost = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(host_cost)


def _backward_launches(tokens: int, one_kernel: str = "auto"):
    """-> (the backward's launches [(kernel, args)], the saved pair map's address, a later plain combine_grouped's
    combine arguments, the op's protocol)."""
    with standin_device() as log:
        op, x, w, idx = host_cost.build(tokens, hidden=64, experts=16)
        try:
            op._backend.one_kernel = one_kernel
            xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            layout, h = ag.dispatch_grouped(op, xr, wr, idx)
            out = ag.combine_grouped(op, layout.x * 1.0, h)
            pair_map = h._saved.pair_pos.data_ptr()
            before = len(log)
            out.float().sum().backward()
            back = [(sym.split("__")[0], a.as_dict()) for sym, _, _, a in log[before:]]
            assert xr.grad is not None and wr.grad is not None
            with torch.no_grad():
                lay, r = op.dispatch_grouped(x, w, None, idx)
                before = len(log)
                op.combine_grouped(lay.x, r)
            later = [a.as_dict() for sym, _, _, a in log[before:] if "combine" in sym]
            return back, pair_map, later, op._backend.protocol
        finally:
            op.close()


@pytest.mark.parametrize("tokens,protocol,combine", [(1, "ll", "epg_combine_ll"), (128, "bw", "epg_combine_gather")])
def test_dispatch_grouped_backward_is_one_combine_of_the_pairs(tokens, protocol, combine):
    back, pair_map, later, got_protocol = _backward_launches(tokens)
    assert got_protocol == protocol
    names = [name for name, _ in back]
    assert "epg_grouped_reduce" not in names, names  # no pair sum of its own
    name, a = back[-1]  # dispatch's backward runs last (combine's backward feeds it)
    assert name == combine, names
    assert a["grp_pair_pos"] == pair_map  # the forward's saved map, not the op's buffer
    assert a["grp_pair_w"] != 0 and a["has_weights"] == 1 and a["expert_weights"] == 0
    assert a["grp_apply_weights"] == 0  # the gradient rows are summed as they are
    assert a["out_weights"] != 0
    (c,) = later  # the next forward's combine: its own weights, no pair values left over from the backward
    assert c["grp_pair_w"] == 0


def test_two_kernel_grouped_combines_keep_the_pair_sum_in_the_backward():
    back, _, later, _ = _backward_launches(1, one_kernel="never")
    names = [name for name, _ in back]
    assert names[-2:] == ["epg_grouped_reduce", "epg_combine_ll"], names
    assert back[-1][1]["grp_pair_w"] == 0 and back[-1][1]["grp_pair_pos"] == 0
    assert all(c["grp_pair_w"] == 0 for c in later)


def test_on_by_default():
    # the module's own assignment (the fixture above sets the attribute for every test here)
    tree = ast.parse(Path(ag.__file__).read_text())
    values = [node.value for node in tree.body if isinstance(node, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "_ONE_LAUNCH_BACKWARD" for t in node.targets)]
    assert len(values) == 1 and isinstance(values[0], ast.Constant) and values[0].value is True


def test_switched_off_keeps_the_pair_sum(monkeypatch):
    monkeypatch.setattr(ag, "_ONE_LAUNCH_BACKWARD", False)
    back, _, _, _ = _backward_launches(1)
    assert [name for name, _ in back][-2:] == ["epg_grouped_reduce", "epg_combine_ll"]
    assert back[-1][1]["grp_pair_w"] == 0
