"""The steady path of the eager legs (op._steady_dispatch / _steady_combine and their grouped forms, the backward's
replay; the native backend's steady_dispatch / steady_combine) against the full path, on the native backend's host
side over stand-ins for the device (tests/support/host_standin.py): the same call sequence, once with the steady path
and once without, must make the same launches (kernel, grid, block and every argument value, the call's own tensors'
addresses named), leave the same op and backend state and return the same results; and the steady path must be the
one taken where the call is the common one."""

from __future__ import annotations

import pytest
import torch

from runtime import EpDispatchCombineConfig, EpDispatchCombineOp
from runtime.errors import ConfigError, InputError
from tests.support.host_standin import standin_device

H, K, E = 64, 4, 8


@pytest.fixture(scope="module")
def device():
    with standin_device() as log:
        yield log


def _op(protocol: str, inflight: int = 1, combine_weights: str = "values", **fields) -> EpDispatchCombineOp:
    cfg = EpDispatchCombineConfig(rank=0, world_size=1, hidden_dim=H, max_num_inp_token_per_rank=8,
                                  num_experts_per_rank=E, num_experts_per_token=K, data_type=torch.bfloat16,
                                  kernel_backend="native", enable_grouped_layout=True, expert_alignment=4,
                                  intranode_protocol=protocol, max_inflight=inflight, **fields)
    return EpDispatchCombineOp(cfg, combine_weights=combine_weights)


def _inputs(T: int, seed: int, weights: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T, K, generator=g) if weights else None
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    return x, w, idx


class Names:
    """Addresses of the tensors a sequence handled, named by where they came from (a call's own tensors differ
    between runs; what they are must not)."""

    def __init__(self, workspace: torch.Tensor):
        self.names: dict[int, str] = {}
        self.ranges: dict[str, tuple[int, int]] = {}  # tensors whose views are named by offset
        self.add_range("workspace", workspace)

    def add_range(self, name: str, t: torch.Tensor) -> None:
        self.ranges[name] = (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())

    def add(self, name: str, t) -> None:
        if isinstance(t, torch.Tensor) and t.numel():  # the latest: an address is reused once its tensor is freed
            self.names[t.data_ptr()] = name

    def of(self, v):
        if not isinstance(v, int) or v <= 4096:
            return v
        if v in self.names:
            return self.names[v]
        for name, (lo, hi) in self.ranges.items():
            if lo <= v < hi:
                return f"{name}+{v - lo}"
        return v


def _state(op) -> tuple:
    b = op._backend
    return (op._seq, sorted(op._by_slot), sorted(op._grouped_by), list(op._slots.held), list(op._slots.route),
            [p is None for p in op._slots.pending], op._last["slot"] if op._last else None, b.slot, b._last,
            b._placed, b._had_weights, b.last_protocol)


def _run(op, log: list, steps, steady: bool) -> list:
    """Run `steps` on op (steady path on or off); -> what each step launched and returned, and the state after.
    Each step names the addresses of what is alive in it (an address freed earlier may be reused): the op's buffers,
    the held handles' and layouts' tensors, the step's own."""
    keep = op._steady
    op._steady = keep if steady else None
    b = op._backend
    out, handles, held = [], {}, {}  # held: key -> [(name, tensor or range)] of that handle's dispatch

    def names_now() -> Names:
        names = Names(b.buf)
        names.add("op.peer_bases", b.peer_bases)
        names.add("op.error", b.error)
        for s, slot in enumerate(b._slots):  # every workspace slot's (also those made on first use: restaging)
            for buf in ("recv_x", "recv_w", "recv_idx", "recv_src", "total_recv", "comb_x", "state"):
                names.add(f"slot{s}.{buf}", slot[buf])
            names.add_range(f"slot{s}.state", slot["state"])  # its words (grouped_place's grouped_end)
            for n, t in slot["_grp"].items():
                names.add(f"slot{s}.grp.{n}", t)
        for key, batch in b._slot_maps._batches.items():  # a dispatch without a handle: its map is only here
            names.add_range(f"slot maps {key[1:]}", batch[0])
        for key, tensors in held.items():
            for name, t, ranged in tensors:
                (names.add_range if ranged else names.add)(name, t)
        return names
    try:
        for i, (what, *args) in enumerate(steps):
            before, mine = len(log), []
            try:
                if what in ("dispatch", "fresh", "out_x"):
                    key, T, seed, weights = args
                    x, w, idx = _inputs(T, seed, weights)
                    mine += [(f"{i}.x", x, False), (f"{i}.w", w, False), (f"{i}.idx", idx, False)]
                    out_x = None
                    if what == "out_x":
                        shape, dtype = op.grouped_x_spec()
                        out_x = torch.empty(shape, dtype=dtype)
                    layout, h = op.dispatch_grouped(x, w, None, idx, fresh=what == "fresh", out_x=out_x)
                    handles[key] = (layout, h, idx)
                    sm = h.extra["map"]
                    held[key] = [(f"{i}.slots", sm.slots, False), (f"{i}.total", sm.total, False),
                                 (f"{i}.idx", idx, False)]
                    assert (sm.slots_ptr, sm.total_ptr) == (sm.slots.data_ptr(), sm.total.data_ptr())
                    if what != "dispatch":  # offs, counts, src, ...: views of its block
                        held[key] += [(f"{i}.layout.x", layout.x, False),
                                      (f"{i}.layout.weights", layout.weights, False),
                                      (f"{i}.layout.block", layout.block, True)]
                    names = names_now()
                    got = (tuple(names.of(t.data_ptr()) if isinstance(t, torch.Tensor) else t
                                 for t in (layout.x, layout.offs, layout.counts, layout.src, layout.m_indices,
                                           layout.weights, layout.pair_pos, layout.seq)),
                           (h.num_tokens, h.seq, h.slot, h.route, h.extra["protocol"], sorted(h.extra)))
                elif what == "plain":  # dispatch, with or without a routing handle
                    key, T, seed, weights, ret = args
                    x, w, idx = _inputs(T, seed, weights)
                    mine += [(f"{i}.x", x, False), (f"{i}.w", w, False), (f"{i}.idx", idx, False)]
                    res = op.dispatch(x, w, None, idx, return_routing=ret)
                    names = names_now()
                    for n, t in zip(("x", "w", "idx"), (x, w, idx)):
                        names.add(f"{i}.{n}", t)
                    got = tuple(names.of(t.data_ptr()) if isinstance(t, torch.Tensor) else t for t in res[:5])
                    if ret:
                        h = res[5]
                        handles[key] = (None, h, idx)
                        sm = h.extra["map"]
                        held[key] = [(f"{i}.slots", sm.slots, False), (f"{i}.total", sm.total, False),
                                     (f"{i}.idx", idx, False)]
                        got += ((h.num_tokens, h.seq, h.slot, h.route, h.extra["protocol"], sorted(h.extra)),)
                elif what == "pcombine":  # combine of the received rows (a copy), with weights or not
                    key, weighted = args
                    _, h, _ = handles[key]
                    R = op.config.max_recv_tokens
                    y = op.combine_in_view(h) if weighted == "view" else \
                        torch.randn(R, H, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
                    wts = torch.rand(R, K, generator=torch.Generator().manual_seed(i)) if weighted is True else None
                    res, res_w = op.combine(y, wts, None, routing=h)
                    mine += [(f"{i}.y", y, False), (f"{i}.wts", wts, False), (f"{i}.out", res, False),
                             (f"{i}.out_w", res_w, False)]
                    got = (tuple(res.shape), res.dtype, None if res_w is None else tuple(res_w.shape))
                elif what == "replay":  # the backward's replay of a handle's routing (runtime/autograd.py)
                    key, seed = args
                    _, h, idx = handles[key]
                    x = torch.randn(h.num_tokens, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
                    mine.append((f"{i}.x", x, False))
                    res = op.dispatch(x, None, None, idx, _replay_of=h)
                    names = names_now()
                    names.add(f"{i}.x", x)
                    got = tuple(names.of(t.data_ptr()) if isinstance(t, torch.Tensor) else t for t in res)
                elif what == "combine":
                    key, view, apply = args
                    layout, h, _ = handles[key]
                    y = op.grouped_out_view(h) if view else layout.x.clone()
                    res, res_w = op.combine_grouped(y, h, apply)
                    mine += [(f"{i}.y", y, False), (f"{i}.out", res, False)]
                    got = (tuple(res.shape), res.dtype, res_w)
                else:  # a call the full path refuses
                    key, T = args
                    x, w, idx = _inputs(T, 0)
                    op.dispatch_grouped(x.float(), w, None, idx)
                    got = "accepted"
            except InputError as e:
                got = f"InputError: {e}"
            names = names_now()
            for name, t, _ in mine:
                names.add(name, t)
            launched = [(sym, grid, block, {n: names.of(v) for n, v in a.as_dict().items()})
                        for sym, grid, block, a in log[before:]]
            out.append((what, got, launched, _state(op)))
    finally:
        op._steady = keep
    return out


SEQUENCES = {
    "loop": [("dispatch", "a", 1, 1, True), ("combine", "a", True, True), ("dispatch", "a", 3, 2, True),
             ("combine", "a", True, False), ("dispatch", "a", 8, 3, False), ("combine", "a", False, True),
             ("dispatch", "a", 1, 4, True), ("dispatch", "a", 2, 5, True), ("combine", "a", True, True),
             ("bad", "a", 2), ("dispatch", "a", 2, 6, True), ("combine", "a", True, True),
             ("fresh", "f", 3, 7, True), ("combine", "f", False, True), ("fresh", "f", 2, 8, False),
             ("combine", "f", True, False), ("out_x", "o", 4, 10, True), ("combine", "o", False, True),
             ("dispatch", "a", 2, 9, True), ("combine", "a", True, True)],
    "plain": [("plain", "p", 2, 1, True, True), ("pcombine", "p", True), ("plain", "p", 1, 2, False, True),
              ("pcombine", "p", False), ("plain", "q", 3, 3, True, False), ("plain", "p", 3, 4, True, True),
              ("pcombine", "p", "view"), ("pcombine", "p", False), ("dispatch", "a", 2, 5, True),
              ("pcombine", "a", True), ("plain", "p", 2, 6, True, True), ("combine", "p", True, True),
              ("bad", "a", 1), ("plain", "p", 1, 7, True, True), ("pcombine", "p", True), ("replay", "p", 8),
              ("pcombine", "p", True), ("dispatch", "g", 3, 9, True), ("replay", "g", 10), ("combine", "g", True, True),
              ("replay", "g", 11), ("pcombine", "g", False)],
    "stale": [("dispatch", "a", 2, 1, True), ("dispatch", "b", 2, 2, True), ("combine", "a", True, True),
              ("combine", "b", True, True), ("combine", "b", True, True)],
}


@pytest.mark.parametrize("seq", sorted(SEQUENCES))
@pytest.mark.parametrize("protocol,one_kernel,direct", [("ll", "auto", "auto"), ("ll", "never", "auto"),
                                                        ("bw", "auto", "auto"), ("bw", "auto", "never"),
                                                        ("bw", "never", "never")])
def test_steady_path_launches_and_returns_what_the_full_path_does(device, seq, protocol, one_kernel, direct):
    runs = []
    for steady in (True, False):  # each on a fresh op: the same numbering from the start
        op = _op(protocol)
        try:
            op._backend.one_kernel, op._backend.direct = one_kernel, direct
            runs.append(_run(op, device, SEQUENCES[seq], steady))
        finally:
            op.close()
    for i, (s, f) in enumerate(zip(*runs)):
        assert s == f, f"step {i} {SEQUENCES[seq][i]}"
    assert len(runs[0]) == len(SEQUENCES[seq]) and any(launched for _, _, launched, _ in runs[0])


def test_steady_path_with_two_slots_in_flight(device):
    """max_inflight = 2: two dispatches held, combined out of order, then a third dispatch (a slot is free again)."""
    steps = [("dispatch", "a", 2, 1, True), ("dispatch", "b", 3, 2, True), ("combine", "b", True, True),
             ("combine", "a", True, False), ("dispatch", "c", 1, 3, True), ("combine", "c", True, True),
             ("dispatch", "d", 1, 4, True), ("dispatch", "e", 1, 5, True), ("dispatch", "f", 1, 6, True)]
    for protocol in ("ll", "bw"):
        runs = []
        for steady in (True, False):
            op = _op(protocol, inflight=2)
            try:
                runs.append(_run(op, device, steps, steady))
            finally:
                op.close()
        assert runs[0] == runs[1]
        assert runs[0][-1][1].startswith("InputError") and "in flight" in runs[0][-1][1]


def test_the_common_call_takes_the_steady_path(device, monkeypatch):
    """The eager loop's calls never reach the full path (op.dispatch, _combine_grouped_begin); an error word up, a
    fresh layout or a call the checks refuse do."""
    op = _op("ll")
    try:
        x, w, idx = _inputs(2, 1)
        full = []
        real_dispatch, real_begin = op.dispatch, op._combine_grouped_begin
        monkeypatch.setattr(op, "dispatch", lambda *a, **k: full.append("dispatch") or real_dispatch(*a, **k))
        monkeypatch.setattr(op, "_combine_grouped_begin",
                            lambda *a, **k: full.append("combine") or real_begin(*a, **k))
        for _ in range(3):
            layout, h = op.dispatch_grouped(x, w, None, idx)
            op.combine_grouped(op.grouped_out_view(h), h)
        assert full == []
        layout, h = op.dispatch_grouped(x, w, None, idx, fresh=True)  # the training forward's call
        op.combine_grouped(layout.x.clone(), h)  # a fresh layout's combine: its own pair map
        shape, dtype = op.grouped_x_spec()
        layout, h = op.dispatch_grouped(x, w, None, idx, out_x=torch.empty(shape, dtype=dtype))
        assert full == []
        with pytest.raises(InputError, match="apply_weights must be a bool"):  # the full path refuses these
            op.combine_grouped(layout.x.clone(), h, apply_weights=1)
        assert full == ["combine"]
        with pytest.raises(InputError, match="out_x"):  # (dispatch_grouped's own check, before any dispatch)
            op.dispatch_grouped(x, w, None, idx, out_x=torch.empty(shape, dtype=torch.float32))
        op._backend._error_words[7] = 1  # a kernel noted a bad id: the full path warns
        op._backend._error_words[5] = op._backend._error_words[6] = 1
        with pytest.warns(Warning):
            op.dispatch_grouped(x, w, None, idx)
        assert full[-1] == "dispatch"
        with pytest.raises(InputError, match="indices"):
            op.dispatch_grouped(x, w, None, idx.long())
        assert full[-1] == "dispatch"
    finally:
        op.close()


def test_the_plain_legs_take_the_steady_path(device, monkeypatch):
    """The seed API's eager loop (dispatch with a handle, combine of its rows) never reaches the full path's checks
    (_dispatch_begin, _combine_begin); an op with the seed's weight fold combines on the full path."""
    for fold in (False, True):
        op = _op("ll", combine_weights="fold" if fold else "values")
        try:
            x, w, idx = _inputs(2, 1)
            full = []
            begin_d, begin_c = op._dispatch_begin, op._combine_begin
            monkeypatch.setattr(op, "_dispatch_begin", lambda *a, **k: full.append("dispatch") or begin_d(*a, **k))
            monkeypatch.setattr(op, "_combine_begin", lambda *a, **k: full.append("combine") or begin_c(*a, **k))
            for _ in range(3):
                out, *_, h = op.dispatch(x, w, None, idx, return_routing=True)
                op.combine(out.clone(), None, None, routing=h)
            assert full == (["combine"] * 3 if fold else [])
            real = op._backend.dispatch
            monkeypatch.setattr(op._backend, "dispatch", lambda *a, **k: full.append("replay") or real(*a, **k))
            op.dispatch(x, None, None, idx, _replay_of=h)  # the backward's replay: the backend's steady launch
            assert "replay" not in full
            with pytest.raises(InputError, match="return_routing must be a bool"):  # the full path says so
                op.dispatch(x, w, None, idx, return_routing=1)
            assert full[-1] == "dispatch"
        finally:
            op.close()


def test_the_environment_switches_the_steady_path_off(device, monkeypatch):
    monkeypatch.setenv("EPGEN_STEADY_PATH", "0")
    op = _op("ll")
    try:
        assert op._steady is None
        x, w, idx = _inputs(1, 1)
        layout, h = op.dispatch_grouped(x, w, None, idx)  # the full path, the same results
        assert op.combine_grouped(op.grouped_out_view(h), h)[0].shape == (1, H)
    finally:
        op.close()
    monkeypatch.setenv("EPGEN_STEADY_PATH", "yes")
    with pytest.raises(ConfigError, match="EPGEN_STEADY_PATH='yes': must be 1"):
        _op("ll")
    monkeypatch.setenv("EPGEN_STEADY_PATH", "1")
    op = _op("ll")
    try:
        assert op._steady is not None
    finally:
        op.close()
