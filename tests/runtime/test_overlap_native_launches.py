"""The native backend's split-phase launches, on the host (no GPU): which kernel each half launches, with which
phase (specs/kernels.toml [args.ep] `phase`), grid and argument block, per workspace slot. A stand-in kernel set
records the launches; the kernels themselves run in tests/gpu/test_ep_overlap.py."""

from __future__ import annotations

import types

import pytest
import torch

from generator.abi import STATE_SIZE
from runtime.backends.native import PHASE_BOTH, PHASE_RECV, PHASE_SEND, NativeBackend, SlotMap, SlotMaps
from runtime.routing import RoutingHandle
from tests.support.configs import make_config

T, K, H = 6, 4, 64


class Launches:
    """A kernel set that records (role, grid, block, phase, argument block) per launch."""

    def __init__(self):
        self.log = []

    def launch(self, role, grid, block, args=None, /, **kw):
        self.log.append((role, grid, block, args.phase, args))
        return 0

    def launch_struct(self, role, grid, block, args, stream=None):
        return self.launch(role, grid, block, args)


def _backend(protocol, scatter=False, slots=2):
    cfg = make_config(0, 1, hidden_dim=H, max_num_inp_token_per_rank=T, num_experts_per_token=K,
                      max_inflight=slots)
    nb = object.__new__(NativeBackend)
    nb.config, nb.protocol, nb.capped, nb.id_check, nb.device = cfg, protocol, False, "off", torch.device("cpu")
    nb._error_words, nb._late_words, nb._bad_seen = [0] * 8, 0, 0
    nb.k = Launches()
    nb._slot_maps = SlotMaps(nb.device)
    nb.plan = types.SimpleNamespace(scatter=scatter)
    nb._launch_geometry = lambda role, tokens, items: (7, 256, False)
    nb._site_memo, nb._steady_how = {}, {}
    nb._combine_shape, nb._out_like = (H, cfg.combine_dtype, cfg.max_recv_tokens), {}
    nb._slots = []
    R = cfg.max_recv_tokens
    for _ in range(slots):  # what _setup_slot makes, stood in
        nb._slots.append({"_slot_lay": {}, "state": torch.zeros(STATE_SIZE, dtype=torch.int32),
                          "total_recv": torch.zeros(1, dtype=torch.int32), "recv_x": torch.zeros(R, H),
                          "recv_scales": None, "recv_w": torch.zeros(R, K), "recv_idx": torch.zeros(R, K),
                          "recv_src": torch.zeros(R), "comb_x": torch.zeros(R, H),
                          "dargs": types.SimpleNamespace(), "cargs": types.SimpleNamespace(), "_had_weights": False,
                          "_std": None, "_grp": None, "_last": None, "_placed": False})
    nb.slot = 0
    nb._load_slot(0)
    nb.one_kernel = "auto"
    return nb


def _inputs():
    return torch.zeros(T, H), torch.ones(T, K), None, torch.zeros(T, K, dtype=torch.int32)


def _handle(fields):
    return RoutingHandle(op_uid=1, config_key=(), num_tokens=T, **fields)


@pytest.mark.parametrize("protocol,role", [("ll", "dispatch_ll"), ("bw", "dispatch")])
def test_dispatch_halves_launch_send_then_receive(protocol, role):
    nb = _backend(protocol)
    nb.dispatch(*_inputs(), None)
    call = nb.dispatch_send(*_inputs(), None)
    assert nb.k.log[-1][3] == PHASE_SEND
    outs = nb.dispatch_receive(call)
    grids = [(r, g, p) for r, g, _, p, _ in nb.k.log]
    recv_grid = 7 if protocol == "ll" else 1  # the bandwidth receive half is one block's wait for the arrivals
    assert grids == [(role, 7, PHASE_BOTH), (role, 7, PHASE_SEND), (role, recv_grid, PHASE_RECV)]
    assert outs[-1]["extra"]["protocol"] == protocol and nb.last_protocol == protocol
    assert outs[0] is nb.recv_x


@pytest.mark.parametrize("protocol,scatter,role,split", [("ll", False, "combine_ll", True),
                                                         ("bw", False, "combine", True),
                                                         ("bw", True, "combine", False)])
def test_combine_halves(protocol, scatter, role, split):
    nb = _backend(protocol, scatter=scatter)
    *_, fields = nb.dispatch(*_inputs(), None)
    h = _handle(fields)
    y = torch.zeros(nb.config.max_recv_tokens, H)
    nb.k.log.clear()
    call = nb.combine_send(y, None, None, h)
    assert call["deferred"] == (not split)
    assert [p for *_, p, _ in nb.k.log] == ([PHASE_SEND] if split else [])  # deferred: nothing launched yet
    out, _ = nb.combine_receive(call)
    assert [(r, p) for r, _, _, p, _ in nb.k.log] == ([(role, PHASE_SEND)] if split else []) + \
        [(role, PHASE_RECV if split else PHASE_BOTH)]
    assert out.shape == (T, H) and nb._last == "combine"


def test_each_slot_launches_with_its_own_argument_block_and_buffers():
    nb = _backend("ll")
    calls = []
    for slot in (0, 1):
        nb.select_slot(slot)
        calls.append(nb.dispatch_send(*_inputs(), None))
    nb.select_slot(0)
    a0 = nb.dispatch_receive(calls[0])
    nb.select_slot(1)
    a1 = nb.dispatch_receive(calls[1])
    args = [a for *_, a in nb.k.log]
    assert args[0] is args[2] is nb._slots[0]["dargs"] and args[1] is args[3] is nb._slots[1]["dargs"]
    assert a0[0] is nb._slots[0]["recv_x"] and a1[0] is nb._slots[1]["recv_x"]
    assert a0[0] is not a1[0]
    # host state of a slot survives the switches (whether the dispatch carried weights, its last leg)
    assert nb._last == "dispatch" and nb._had_weights
    nb.select_slot(0)
    assert nb._last == "dispatch" and nb._had_weights


@pytest.mark.parametrize("capturing", [False, True])
def test_one_kernel_legs_auto_policy(monkeypatch, capturing):
    """auto: combine_grouped is one kernel under both protocols (combine_ll sums each row's pairs as it pushes it,
    the gather combine stages them), a low-latency dispatch_grouped only outside graph capture (its tail is slower
    than the separate passes in a graph), a bandwidth one never; "always" / "never" override both legs."""
    nb = _backend("ll")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    assert nb.one_kernel_legs("ll", "combine")
    assert nb.one_kernel_legs("ll", "dispatch") == (not capturing)
    assert nb.one_kernel_legs("bw", "combine") and not nb.one_kernel_legs("bw", "dispatch")
    nb.one_kernel = "never"
    assert not nb.one_kernel_legs("ll", "combine")
    nb.one_kernel = "always"
    assert nb.one_kernel_legs("bw", "dispatch") and nb.one_kernel_legs("bw", "combine")


def test_slot_maps_hand_out_memory_of_their_own():
    """Each dispatch's slot map and row count (kept by its routing handle past later dispatches) are memory no
    other call gets, cut from batches bounded in bytes; the addresses the kernels take are the tensors' the handle
    gives; many token counts keep at most KEYS batches."""
    maps = SlotMaps(torch.device("cpu"))
    first = maps.take(3, 8)
    first.slots.fill_(7)
    first.total.fill_(9)
    taken = [first] + [maps.take(3, 8) for _ in range(2 * SlotMaps.BATCH + 5)]
    for m in taken:
        assert (m.slots.data_ptr(), m.total.data_ptr()) == (m.slots_ptr, m.total_ptr) and (m.T, m.k) == (3, 8)
        assert m.slots.shape == (3, 8) and m.slots.is_contiguous() and m.slots.dtype == torch.int32
        assert m.total.shape == (1,) and m.total.dtype == torch.int32
    spans = sorted((m.slots_ptr, m.total_ptr + 4) for m in taken)  # [first byte, past the last) of each map
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two overlap
    for m in taken[1:]:
        m.slots.fill_(-1)
        m.total.fill_(-1)
    assert bool((first.slots == 7).all()) and int(first.total) == 9  # nothing handed out twice
    big = maps.take(4096, 8)  # a batch of about BATCH_BYTES: fewer calls per batch
    assert big.slots._base.shape[0] == SlotMaps.BATCH_BYTES // (4 * (4096 * 8 + 1))
    for T in range(1, SlotMaps.KEYS + 3):
        maps.take(T, 2)
    assert len(maps._batches) <= SlotMaps.KEYS
    own = SlotMap.of(torch.full((2, 4), 5, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    assert (own.T, own.k, own.slots_ptr, own.total_ptr) == (2, 4, own.slots.data_ptr(), own.total.data_ptr())
    captured = maps.take(2, 8, capturing=True)  # a map of its own, not a batch's row
    assert captured.slots.untyped_storage().nbytes() == 4 * (2 * 8 + 1)


def test_dispatch_tail_fields_follow_each_call():
    """The dispatch tail's layout fields (dargs grp_*) are written only when they change, so what each launch sees
    must still be its own call's: the op's buffers, then none (a plain dispatch), then the op's buffers again,
    then a fresh layout's, then the op's again."""
    nb = _backend("ll")
    own = tuple(range(101, 110))
    nb._grp = {"tail": own}
    nb._fresh_outputs = lambda out: out["tensors"]
    seen = []
    nb.k.launch_struct = lambda role, grid, block, args, stream=None: seen.append(
        (args.grp_x, args.grp_dropped, args.grp_zero_padding if args.grp_x else None)) or 0
    fresh = {"tensors": [torch.zeros(1) for _ in range(9)]}
    first, last = fresh["tensors"][0].data_ptr(), fresh["tensors"][-1].data_ptr()
    for layout, out in ((True, None), (False, None), (True, None), (True, fresh), (True, None)):
        call = nb._dispatch_prepare(*_inputs(), None)
        call.update(layout=layout, layout_out=out, direct=False)
        nb._dispatch_launch(call, PHASE_BOTH)
    assert seen == [(101, 109, 0), (0, 109, None), (101, 109, 0), (first, last, 1), (101, 109, 0)]
