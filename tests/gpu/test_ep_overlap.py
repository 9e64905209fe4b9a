"""Split-phase legs and two operations in flight on the native backend (runtime/pending.py): two micro-batches in
flight give, bit for bit, what the one-call form gives (dispatch rows compared in (source rank, token) order, combine
outputs exactly), eagerly (on the current stream and on a communication stream ordered by events) and inside one
CUDA graph; both intranode protocols, fp8 payloads (pre-quantized, and quantized in dispatch), the grouped layout,
the scatter combine; a send half finishes on one rank while its peer has sent nothing
(nothing of epgen waits between the halves).

Run (2 ranks sharing one H200, or one per GPU):
    torchrun --nproc-per-node 2 -m pytest -m multigpu -q tests/gpu/test_ep_overlap.py
"""

import os

import pytest
import torch
import torch.distributed as dist

from runtime import EpDispatchCombineOp
from tests.gpu.dist_util import captured, run_collective
from tests.support.configs import dist_config
from tests.support.ep_oracle import random_routing
from tests.support.grouped_oracle import MODE_FIELDS

pytestmark = pytest.mark.multigpu

if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
    pytest.skip("needs torchrun and GPUs", allow_module_level=True)

T, K, EPR, HIDDEN = 64, 8, 8, 256
MODES = ("bf16", "fp8", "fp8_blockwise")  # fp8: pre-quantized payload with fp32 scales; fp8_blockwise: in dispatch
CASES = [(p, m) for p in ("ll", "bw") for m in MODES if not (p == "ll" and m == "fp8_blockwise")]  # ll: verbatim


def _cfg(protocol, mode, **kw):
    return dist_config(hidden_dim=HIDDEN, max_num_inp_token_per_rank=T, num_experts_per_rank=EPR,
                       num_experts_per_token=K, intranode_protocol=protocol, timeout_s=30, **MODE_FIELDS[mode], **kw)


def _inputs(seed, mode, tokens=T):
    g = torch.Generator().manual_seed(seed * 31 + dist.get_rank())
    x = (torch.randint(-64, 65, (tokens, HIDDEN), generator=g).float() / 16).to(torch.bfloat16)
    w = torch.randint(1, 64, (tokens, K), generator=g).float() / 64
    idx = random_routing(g, tokens, K, EPR * dist.get_world_size())
    s = None
    if mode == "fp8":
        x = x.float().to(torch.float8_e4m3fn)
        s = torch.rand(tokens, 2, generator=g) + 0.5
    return tuple(None if t is None else t.cuda() for t in (x, w, s, idx))


def _expert(out):
    """A row-wise stand-in expert (each received row on its own: the rows' order does not matter): 2 * row - 1."""
    return (out.float() * 2 - 1).to(torch.bfloat16)


def _bytes(t):
    return None if t is None else t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def _received(res):
    """A dispatch's received rows in (source rank, token) order (the bandwidth protocol's slots follow arrival):
    [origin ids, rows, weights, scales, ids] as host tensors."""
    out, out_w, out_s, out_i, total, h = res
    n = int(total.item())
    src = h.extra["recv_src"][:n]
    order = torch.argsort(src)
    return [src[order].cpu()] + [None if t is None else _bytes(t[:n][order]).cpu() for t in (out, out_w, out_s, out_i)]


def _same(a, b, what):
    assert len(a) == len(b), what
    for i, (p, q) in enumerate(zip(a, b)):
        assert (p is None) == (q is None), f"{what}: part {i}"
        assert p is None or torch.equal(p, q), f"{what}: part {i} differs"


def _one_call(op, batches):
    """The reference: each micro-batch dispatched and combined in turn by the one-call form."""
    want = []
    for x, w, s, idx in batches:
        res = op.dispatch(x, w, s, idx, return_routing=True)
        rec = _received(res)
        comb, comb_w = op.combine(_expert(res[0]), res[1], routing=res[-1])
        want.append((rec, comb.clone(), comb_w.clone()))
    return want


def _two_in_flight(op, batches, comm=None, check=True, pendings=None):
    """Both micro-batches in flight: A send, B send, A receive, A combine send, B receive, B combine send, A combine
    receive, B combine receive. -> [(received rows or None, combined, combined weights)] per micro-batch (the
    combines' Pending objects appended to `pendings` when given)."""
    order = {"stream": comm} if comm is not None else {}
    sends = [op.dispatch_send(x, w, s, idx, return_routing=True, **order) for x, w, s, idx in batches]
    assert [p.slot for p in sends] == [0, 1]
    got = []
    res_a = sends[0].receive()
    sends[0].current_stream_wait()
    y_a = _expert(res_a[0])
    ev = torch.cuda.Event()
    ev.record()
    comb_a = op.combine_send(y_a, res_a[1], routing=res_a[-1], **order, previous_event=ev if comm else None)
    res_b = sends[1].receive()
    sends[1].current_stream_wait()
    got_rows = [_received(res_a) if check else None, _received(res_b) if check else None]
    comb_b = op.combine_send(_expert(res_b[0]), res_b[1], routing=res_b[-1], **order)
    if pendings is not None:
        pendings += [comb_a, comb_b]
    for p, rows in zip((comb_a, comb_b), got_rows):
        c, cw = p.receive()
        p.current_stream_wait()
        got.append((rows, c, cw))
    return got


def _compare(want, got, what):
    for i, ((rows_w, c_w, cw_w), (rows_g, c_g, cw_g)) in enumerate(zip(want, got)):
        if rows_g is not None:
            _same(rows_w, rows_g, f"{what}: micro-batch {i} received rows")
        assert torch.equal(c_w, c_g), f"{what}: micro-batch {i} combined rows differ"
        assert torch.equal(cw_w, cw_g), f"{what}: micro-batch {i} combined weights differ"


@pytest.mark.parametrize("protocol,mode", CASES)
@pytest.mark.parametrize("on_comm_stream", [False, True])
def test_two_batches_in_flight_match_one_call(protocol, mode, on_comm_stream):
    def check():
        with EpDispatchCombineOp(_cfg(protocol, mode, max_inflight=2)) as op, \
                EpDispatchCombineOp(_cfg(protocol, mode)) as ref:
            comm = torch.cuda.Stream() if on_comm_stream else None
            two, one = op.memory_report(), ref.memory_report()
            assert two["symmetric_workspace"] == 2 * one["symmetric_workspace"]
            assert two["regions"]["recv_x@1"] == one["regions"]["recv_x"] and "state@1" in two["other_device_buffers"]
            for rnd in range(3):  # the slots reused round after round
                batches = [_inputs(10 * rnd, mode), _inputs(10 * rnd + 1, mode, tokens=T - 17 * rnd)]
                want = _one_call(ref, batches)
                combs = []
                got = _two_in_flight(op, batches, comm, pendings=combs)
                torch.cuda.synchronize()
                assert not any(p.deferred for p in combs)  # both protocols' gather combines are split
                assert all((p.event is not None) == on_comm_stream for p in combs)
                _compare(want, got, f"{protocol}/{mode} round {rnd}")
                assert op.last_intranode_protocol == protocol
    run_collective(check)


def test_receive_cap_orders_rows_and_drops_alike():
    """Under a receive cap the bandwidth dispatch numbers its rows first (a small all-gather in the send half):
    rows, drops and combine the same as the one-call form's."""
    def check():
        cap = T * dist.get_world_size() // 2
        with EpDispatchCombineOp(_cfg("bw", "bf16", max_inflight=2, max_total_recv_tokens=cap)) as op, \
                EpDispatchCombineOp(_cfg("bw", "bf16", max_total_recv_tokens=cap)) as ref:
            batches = [_inputs(3, "bf16"), _inputs(4, "bf16")]
            want = _one_call(ref, batches)
            got = _two_in_flight(op, batches)
            torch.cuda.synchronize()
            _compare(want, got, "bw under a receive cap")
    run_collective(check)


@pytest.mark.parametrize("protocol,mode", CASES)
def test_two_batch_schedule_in_a_cuda_graph(protocol, mode):
    """Both micro-batches' legs (on a communication stream) and their experts captured in one graph, replayed on new
    inputs: the one-call form's bits every replay."""
    def check():
        with EpDispatchCombineOp(_cfg(protocol, mode, max_inflight=2)) as op, \
                EpDispatchCombineOp(_cfg(protocol, mode)) as ref:
            static = [tuple(None if t is None else t.clone() for t in _inputs(50 + i, mode)) for i in range(2)]
            comm = torch.cuda.Stream()
            graph, got = captured(lambda: _two_in_flight(op, static, comm, check=False))
            for rep in range(3):
                batches = [_inputs(60 + 2 * rep + i, mode) for i in range(2)]
                for st, new in zip(static, batches):
                    for a, b in zip(st, new):
                        if a is not None:
                            a.copy_(b)
                graph.replay()
                torch.cuda.synchronize()
                _compare(_one_call(ref, batches), got, f"{protocol}/{mode} graph replay {rep}")
    run_collective(check)


def _grouped_round(op, batches, split, comm=None):
    """dispatch_grouped -> row-wise expert -> combine_grouped for both micro-batches (split: both in flight)."""
    if not split:
        outs = []
        for x, w, s, idx in batches:
            layout, h = op.dispatch_grouped(x, w, s, idx)
            outs.append(op.combine_grouped(_expert(layout.x), h)[0].clone())
        return outs
    order = {"stream": comm} if comm is not None else {}
    sends = [op.dispatch_grouped_send(x, w, s, idx, **order) for x, w, s, idx in batches]
    combs = []
    for p in sends:
        layout, h = p.receive()
        p.current_stream_wait()
        ev = torch.cuda.Event()
        y = _expert(layout.x)
        ev.record()
        combs.append(op.combine_grouped_send(y, h, **order, previous_event=ev if comm else None))
    outs = []
    for p in combs:
        outs.append(p.receive()[0])
        p.current_stream_wait()
    return outs, combs


@pytest.mark.parametrize("protocol,mode", [("ll", "bf16"), ("ll", "fp8"), ("bw", "bf16"), ("bw", "fp8_blockwise"),
                                           ("bw", "fp8")])
def test_grouped_layout_two_in_flight(protocol, mode):
    """dispatch_grouped_send / combine_grouped_send: the one-call grouped legs' bits, eagerly on a communication
    stream and in a graph; every grouped combine's send half launches (none deferred)."""
    def check():
        kw = dict(enable_grouped_layout=True)
        with EpDispatchCombineOp(_cfg(protocol, mode, max_inflight=2, **kw)) as op, \
                EpDispatchCombineOp(_cfg(protocol, mode, **kw)) as ref:
            comm = torch.cuda.Stream()
            batches = [_inputs(70, mode), _inputs(71, mode, tokens=T - 9)]
            want = _grouped_round(ref, batches, split=False)
            got, combs = _grouped_round(op, batches, split=True, comm=comm)
            torch.cuda.synchronize()
            assert not any(p.deferred for p in combs)
            assert all(torch.equal(a, b) for a, b in zip(want, got)), "eager grouped legs differ"
            static = [tuple(None if t is None else t.clone() for t in b) for b in batches]
            graph, (outs, _) = captured(lambda: _grouped_round(op, static, split=True, comm=comm))
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(want, outs)), "graph grouped legs differ"
    run_collective(check)


def test_scatter_combine_is_deferred_and_exact():
    """combine_mode="scatter" (fp8 on the way back) is not split on the native backend: the send half launches
    nothing (Pending.deferred), the receive half runs the one-call kernel: the same bits."""
    def check():
        kw = dict(quant_type="fp8_direct_cast", combine_mode="scatter")
        with EpDispatchCombineOp(_cfg("bw", "bf16", max_inflight=2, **kw)) as op, \
                EpDispatchCombineOp(_cfg("bw", "bf16", **kw)) as ref:
            batches = [_inputs(80, "bf16"), _inputs(81, "bf16")]
            want = _one_call(ref, batches)
            combs = []
            got = _two_in_flight(op, batches, pendings=combs)
            torch.cuda.synchronize()
            assert [p.deferred for p in combs] == [True, True]
            _compare(want, got, "scatter")
    run_collective(check)


@pytest.mark.parametrize("protocol", ["ll", "bw"])
def test_send_half_finishes_while_the_peer_has_sent_nothing(protocol):
    """Rank 0's send halves (dispatch, then combine) run to completion on the GPU before rank 1 launches its own:
    no epgen kernel waits between a send half and its receive half."""
    def check():
        rank = dist.get_rank()
        with EpDispatchCombineOp(_cfg(protocol, "bf16", max_inflight=2)) as op:
            x, w, s, idx = _inputs(90, "bf16")

            def alone(send):
                if rank == 0:
                    try:
                        p = send()
                        torch.cuda.synchronize()  # would last until the kernel's timeout if it waited for rank 1
                        op.check()  # EpTimeoutError then
                        assert not p.deferred
                    finally:
                        dist.barrier()
                    return p
                dist.barrier()
                return send()
            p = alone(lambda: op.dispatch_send(x, w, s, idx, return_routing=True))
            out, out_w, *_, h = p.receive()
            c = alone(lambda: op.combine_send(_expert(out), out_w, routing=h))
            comb, _ = c.receive()
            torch.cuda.synchronize()
            op.check()
            assert bool(torch.isfinite(comb.float()).all())
    run_collective(check)


@pytest.mark.parametrize("graph", [False, True])
def test_overlap_example_layer(graph):
    """examples/moe_overlap.py's two-batch layer (grouped GEMMs on the compute stream, legs on a communication
    stream), eager and captured whole in one CUDA graph: within the dense reference's tolerance and the bits of the
    micro-batches run one at a time."""
    from tests.support.moe_layer_ref import REL_TOL, dense_reference, load_example, relative_errors

    def check():
        ex = load_example("moe_overlap")
        hidden, experts, topk, inter, tokens = 2048, 16 * dist.get_world_size(), 8, 512, 128
        block = ex.build(hidden, experts, topk, inter, tokens, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(3000 + dist.get_rank())
        x = torch.randn(tokens, hidden, generator=g, device="cuda").to(torch.bfloat16)
        comm = torch.cuda.Stream()
        with block.op:
            want = ex.sequential_forward(block, x)
            if graph:
                sx = x.clone()
                graph_, got = captured(lambda: ex.overlapped_forward(block, sx, comm))
                graph_.replay()
            else:
                got = ex.overlapped_forward(block, x, comm)
            torch.cuda.synchronize()
            assert torch.equal(got, want), "the overlapped layer differs from the one-call form"
            worst = float(relative_errors(got, dense_reference(ex.layer, x, hidden, experts, topk, inter)).max())
            assert worst <= REL_TOL, worst
    run_collective(check)
