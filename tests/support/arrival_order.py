"""The native bandwidth dispatch's receive order, on the torch backend.

Without a receive cap the native bandwidth dispatch claims each received row's slot with an atomic on the
destination's counter (templates/kernels/dispatch.j2), so rows land in arrival order: two dispatches of the same
tokens and ids may number their rows differently (docs/RUNTIME.md, Receive cap). The torch backend always numbers
them in (source rank, token) order, so a CPU test cannot see code that assumes two dispatches of the same routing
give the same rows. ``shuffled_arrivals()`` makes every fresh, uncapped, intranode dispatch of the torch backend
receive its rows in a shuffled slot order instead (a permutation per dispatch and destination, the same on every
rank: each sender knows where its rows land), as the native kernel may; replays keep their handle's slots, as
the native ones do. Everything else (combine, replay, the grouped layout) follows the slots as it would on the
native backend.

Use in a test process of tests/support/ep_dist.py (every rank alike)::

    with shuffled_arrivals():
        ...
"""

from __future__ import annotations

import contextlib

import torch

from runtime.backends.torch_backend import TorchBackend

_REAL_DISPATCH = TorchBackend.dispatch


def _shuffled_dispatch(self, x, weights, scales, indices, routing, **kwargs):
    out, out_w, out_s, out_i, total_recv, fields = _REAL_DISPATCH(self, x, weights, scales, indices, routing,
                                                                  **kwargs)
    cfg = self.config
    if routing is not None or cfg.is_internode or cfg.max_recv_tokens < cfg.worst_case_recv_tokens:
        return out, out_w, out_s, out_i, total_recv, fields  # a replay, or the native dispatch's ordered slots
    calls = self._arrivals = getattr(self, "_arrivals", 0) + 1  # every rank's op counts its dispatches alike
    totals = [int(t) for t in self._all_gather(torch.tensor([fields["total_recv"]], dtype=torch.int64,
                                                            device=self.device))]
    perms = [torch.randperm(n, generator=torch.Generator().manual_seed(7919 * calls + dst)).to(self.device)
             for dst, n in enumerate(totals)]
    mine, total = perms[cfg.rank], fields["total_recv"]  # received row q moves to slot mine[q]
    for t in (out, out_w, out_s, out_i):
        if t is not None:
            t[mine] = t[:total].clone()
    recv_src = fields["recv_src"].clone()
    recv_src[mine] = fields["recv_src"]
    plan = tuple((tok, perms[dst][slots]) for dst, (tok, slots) in enumerate(fields["send_plan"]))
    return out, out_w, out_s, out_i, total_recv, {**fields, "recv_src": recv_src, "send_plan": plan}


@contextlib.contextmanager
def shuffled_arrivals():
    """Within it, the torch backend's fresh uncapped dispatches receive rows in a shuffled order (module
    docstring)."""
    TorchBackend.dispatch = _shuffled_dispatch
    try:
        yield
    finally:
        TorchBackend.dispatch = _REAL_DISPATCH
