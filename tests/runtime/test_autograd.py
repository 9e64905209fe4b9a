"""runtime/autograd.py on the torch backend: gloo ranks at W = 1, 2, 4 (tests/support/ep_dist.py).

gradcheck of every leg (dispatch, combine, dispatch_grouped, combine_grouped) as a function of every rank's
inputs (tests/support/autograd_legs.py): fp64 inputs on fp32 ops. The inputs are multiples of 1/8 with few bits
and eps = 1/8, so every value the legs compute is exact in fp32 and the central differences of these linear (and,
for the weights, bilinear) maps are exact: gradcheck's default tolerances hold. Receive-cap drops, grouped-capacity
drops and repeated ids (a token naming one expert, or one rank, twice) included. Then: several forwards in flight,
a backward after op.close(), torch.utils.checkpoint, the no-grad path, fp8 dispatch (bf16 gradients) and the
registered op names.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.autograd_legs import (combine_grouped_leg, combine_leg, dispatch_grouped_leg, dispatch_leg,
                                         grouped_step, linear_experts)
from tests.support.configs import make_config
from tests.support.ep_dist import get_world
from runtime import ClosedError, EpDispatchCombineOp, InputError
from runtime import autograd as ag

H, K = 4, 2
EIGHTHS = 1 / 8


def _cfg(rank, world, tokens, **kw):
    fields = dict(hidden_dim=H, max_num_inp_token_per_rank=tokens, num_experts_per_rank=2, num_experts_per_token=K,
                  data_type=torch.float32, enable_grouped_layout=True, expert_alignment=2)
    return make_config(rank, world, **{**fields, **kw})


def _dyadic(g, *shape):
    """Multiples of 1/8 in [-1, 1]: exact in fp32, and so are their sums and products here."""
    return torch.randint(-8, 9, shape, generator=g, dtype=torch.int64).to(torch.float64) * EIGHTHS


def _global_inputs(world, tokens, num_experts, seed, repeats):
    g = torch.Generator().manual_seed(seed)
    X = _dyadic(g, world, tokens, H)
    Wt = _dyadic(g, world, tokens, K)
    ids = torch.randint(0, num_experts, (world, tokens, K), generator=g).to(torch.int32)
    if repeats:  # token 0 names one expert twice, token 1 two experts of one rank
        ids[:, 0, 1] = ids[:, 0, 0]
        ids[:, 1, 1] = ids[:, 1, 0] // 2 * 2 + (1 - ids[:, 1, 0] % 2)
    return X, Wt, ids


def _gradcheck(fn, inputs):
    inputs = tuple(t.requires_grad_(True) for t in inputs)
    return torch.autograd.gradcheck(fn, inputs, eps=EIGHTHS, atol=1e-6, rtol=1e-6)


def scn_gradcheck(rank, world, leg, tokens, seed, repeats, cfg_fields):
    cfg = _cfg(rank, world, tokens, **cfg_fields)
    X, Wt, ids = _global_inputs(world, tokens, cfg.num_experts, seed, repeats)
    n = tokens - (rank % 2)  # ranks with fewer tokens than the others
    my_ids = ids[rank, :n].contiguous()
    g = torch.Generator().manual_seed(seed + 1)
    with EpDispatchCombineOp(cfg) as op:
        if leg == "dispatch_grouped":
            ok = _gradcheck(lambda X, Wt: dispatch_grouped_leg(op, X, Wt, my_ids, n), (X, Wt))
        elif leg == "combine_grouped":
            Y = _dyadic(g, world, cfg.resolved_grouped_capacity, H)
            ok = _gradcheck(lambda X, Wt, Y: combine_grouped_leg(op, X, Wt, Y, my_ids, n), (X, Wt, Y))
        elif leg == "combine_grouped_unweighted":
            Y = _dyadic(g, world, cfg.resolved_grouped_capacity, H)
            ok = _gradcheck(lambda X, Y: combine_grouped_leg(op, X, Wt, Y, my_ids, n, apply_weights=False), (X, Y))
        elif leg == "dispatch":
            ok = _gradcheck(lambda X, Wt: dispatch_leg(op, X, Wt, my_ids, n), (X, Wt))
        else:
            R = cfg.max_recv_tokens
            Y, Wc = _dyadic(g, world, R, H), _dyadic(g, world, R, K)
            ok = _gradcheck(lambda Y, Wc: combine_leg(op, X, Y, Wc, my_ids, n), (Y, Wc))
        with torch.no_grad():  # what the caps dropped here: (received rows, grouped pairs)
            layout, _ = op.dispatch_grouped(X[rank, :n].float(), None, None, my_ids)
            dropped = (int(op.dropped_count()), int(layout.dropped))
    return ok, dropped


LEGS = ["dispatch_grouped", "combine_grouped", "combine_grouped_unweighted", "dispatch", "combine"]
DROPS = {"none": {}, "recv_cap": {"max_total_recv_tokens": 3}, "grouped_cap": {"grouped_capacity": 4}}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("leg", LEGS)
def test_gradcheck_every_leg(world, leg):
    tokens = 3 if world == 2 else 2  # gradcheck's cost grows with every rank's inputs and outputs
    assert all(ok for ok, _ in get_world(world).run(scn_gradcheck, leg, tokens, 7, True, {}, timeout=240))


@pytest.mark.parametrize("leg,drops", [(leg, drops) for drops in DROPS if drops != "none"
                                       for leg in ("dispatch_grouped", "combine_grouped", "dispatch", "combine")
                                       if drops == "recv_cap" or "grouped" in leg])  # plain legs: no grouped layout
def test_gradcheck_with_drops(leg, drops):
    res = get_world(2).run(scn_gradcheck, leg, 4, 11, True, DROPS[drops], timeout=240)
    assert all(ok for ok, _ in res)
    assert sum(d[0 if drops == "recv_cap" else 1] for _, d in res) > 0, res  # the cap did drop


@pytest.mark.parametrize("leg", ["dispatch_grouped", "combine_grouped", "dispatch", "combine"])
def test_gradcheck_with_a_rank_without_tokens(leg):
    """One token per rank but rank 1 has none (scn_gradcheck gives odd ranks a token less)."""
    assert all(ok for ok, _ in get_world(2).run(scn_gradcheck, leg, 1, 3, False, {}, timeout=240))


def test_gradcheck_one_rank():
    assert all(ok for ok, _ in get_world(1).run(scn_gradcheck, "combine_grouped", 3, 5, True, {}, timeout=240))


# --- semantics beyond gradcheck ------------------------------------------------------------------------
def _step_inputs(rank, cfg, seed, tokens):
    """(x, w, ids, expert matrices, upstream gradient) of one rank's step."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(tokens, cfg.hidden_dim, generator=g).to(cfg.data_type)
    w = torch.rand(tokens, K, generator=g)
    ids = torch.randint(0, cfg.num_experts, (tokens, K), generator=g).to(torch.int32)
    gg = torch.Generator().manual_seed(seed)
    ew = torch.randn(cfg.num_experts_per_rank, cfg.hidden_dim, cfg.hidden_dim, generator=gg).to(cfg.data_type)
    grad = torch.randn(tokens, cfg.hidden_dim, generator=g).to(cfg.data_type)
    return x, w, ids, ew, grad


def _layer(op, ids):
    """A layer on the legs: relu'd linear experts between dispatch_grouped and combine_grouped, tanh after."""
    def layer(x, w, ew):
        layout, h = ag.dispatch_grouped(op, x, w, ids)
        return torch.tanh(ag.combine_grouped(op, torch.relu(linear_experts(layout, ew)), h))
    return layer


def _grads(fn, tensors, grad):
    """Gradients of fn(*tensors) (fresh leaves) for the output gradient grad."""
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    return torch.autograd.grad(fn(*leaves), leaves, grad)


def scn_in_flight(rank, world, max_inflight):
    """Two forwards, then their backwards in reverse order (gradient accumulation), against one at a time; with two
    workspace slots each forward holds one until its combine."""
    cfg = _cfg(rank, world, 6, hidden_dim=8, max_inflight=max_inflight)
    a, b = _step_inputs(rank, cfg, 1, 6), _step_inputs(rank, cfg, 2, 6)
    with EpDispatchCombineOp(cfg) as op:
        want_a, want_b = grouped_step(op, *a), grouped_step(op, *b)
        outs = []
        for x, w, ids, ew, grad in (a, b):  # both forwards first: the second reuses every buffer of the op
            x, w, ew = (t.clone().requires_grad_(True) for t in (x, w, ew))
            layout, h = ag.dispatch_grouped(op, x, w, ids)
            outs.append((x, w, ew, layout, h))
        # the experts and both combines after both dispatches (the older handle first: not the op's last layout)
        ys = [ag.combine_grouped(op, linear_experts(layout, ew), h) for _, _, ew, layout, h in outs]
        got = []
        for (x, w, ew, _, _), out, (_, _, _, _, grad) in reversed(list(zip(outs, ys, (a, b)))):
            got.append((out.detach(), *torch.autograd.grad(out, (x, w, ew), grad)))
        got.reverse()
    for want, have in zip((want_a, want_b), got):
        for u, v in zip(want, have):
            assert torch.equal(u, v)
    return True


@pytest.mark.parametrize("max_inflight", [1, 2])
def test_several_forwards_in_flight_keep_their_routing(max_inflight):
    assert all(get_world(2).run(scn_in_flight, max_inflight, timeout=120))


def scn_closed(rank, world):
    cfg = _cfg(rank, world, 4)
    x, w, ids, ew, grad = _step_inputs(rank, cfg, 3, 4)
    op = EpDispatchCombineOp(cfg)
    x.requires_grad_(True)
    layout, h = ag.dispatch_grouped(op, x, w, ids)
    out = ag.combine_grouped(op, layout.x * 2, h)
    op.close()
    with pytest.raises(ClosedError, match=r"^backward of epgen::combine_grouped: the EpDispatchCombineOp \(uid \d+\) "
                                          r"its forward ran on is closed; run the backward before op.close\(\)$"):
        out.backward(grad)
    return True


def test_backward_through_a_closed_op_is_a_clear_error():
    assert all(get_world(2).run(scn_closed, timeout=120))


def scn_changed_in_place(rank, world, what):
    """The backward reads what dispatch_grouped kept as it is (the expert ids, the layout's int32 block): an in-place
    change to one of them after the forward is refused with one clear error, not a wrong gradient."""
    cfg = _cfg(rank, world, 4)
    x, w, ids, ew, grad = _step_inputs(rank, cfg, 3, 4)
    with EpDispatchCombineOp(cfg) as op:
        x.requires_grad_(True)
        layout, h = ag.dispatch_grouped(op, x, w, ids)
        out = ag.combine_grouped(op, layout.x * 2, h)
        if what == "ids":
            ids.add_(0)
        elif what == "src":
            layout.src.add_(0)
        if what == "nothing":
            out.backward(grad)
            return x.grad is not None
        with pytest.raises(InputError, match=r"^backward of epgen::combine_grouped: a tensor its dispatch kept \(the "
                                              r"expert ids, or the grouped layout's offs / counts / src / m_indices / "
                                              r"dropped\) was modified in place after the dispatch, which reads it "
                                              r"again: clone it before changing it$"):
            out.backward(grad)
    return True


@pytest.mark.parametrize("what", ["ids", "src", "nothing"])
def test_a_backward_after_an_in_place_change_to_what_dispatch_kept_is_refused(what):
    assert all(get_world(2).run(scn_changed_in_place, what, timeout=120))


def scn_checkpoint(rank, world, selective):
    """torch.utils.checkpoint (non-reentrant) of a layer: recomputed whole, or (selective) with the outputs of the
    epgen ops saved (docs/TRAINING.md's policy: the recomputation then moves nothing between ranks)."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    saved_ops = {getattr(torch.ops.epgen, name.split("::")[1]).default for name in ag.OP_NAMES}
    calls = []

    def policy(ctx, func, *args, **kwargs):
        if func in saved_ops:
            calls.append(ctx.is_recompute)
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    kwargs = {"context_fn": lambda: create_selective_checkpoint_contexts(policy)} if selective else {}

    cfg = _cfg(rank, world, 5, hidden_dim=8)
    x, w, ids, ew, grad = _step_inputs(rank, cfg, 4, 5)
    with EpDispatchCombineOp(cfg) as op:
        layer = _layer(op, ids)
        want = _grads(layer, (x, w, ew), grad)
        leaves = [t.clone().requires_grad_(True) for t in (x, w, ew)]
        out = checkpoint(layer, *leaves, use_reentrant=False, **kwargs)
        before = op._seq  # dispatches so far
        got = torch.autograd.grad(out, leaves, grad)
        # the backward: combine_grouped's replay, and the recomputed dispatch unless its outputs were saved
        assert op._seq - before == (1 if selective else 2)
    assert all(torch.equal(u, v) for u, v in zip(want, got))
    assert calls == ([False, False] if selective else [])  # the policy saw both epgen ops of the forward
    return True


def test_checkpoint_recomputation_gives_the_same_gradients():
    assert all(get_world(2).run(scn_checkpoint, False, timeout=120))


def test_selective_checkpointing_that_saves_the_epgen_ops_gives_the_same_gradients():
    assert all(get_world(2).run(scn_checkpoint, True, timeout=120))


def _plain_layer(op, ids):
    """A layer on the plain legs: tanh of the received rows (nonlinear: its backward needs the forward's rows in
    the order the combine's backward hands the gradient rows) times the sum of their received weights."""
    def layer(x, w):
        out, out_w, _, _, h = ag.dispatch(op, x, w, ids)
        return ag.combine(op, torch.tanh(out) * out_w.sum(1, keepdim=True), h)[0]
    return layer


def scn_checkpoint_in_arrival_order(rank, world, policy, plain):
    """Checkpointing whose recomputation dispatches again, while every fresh dispatch receives its rows in a
    shuffled order, as the native bandwidth dispatch may (tests/support/arrival_order.py): the recomputed rows and
    grouped layout differ from the first forward's, and the backward must run on the recomputation's routing
    (runtime/autograd.py, _routing_of). -> the gradients' relative errors against no checkpointing."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from tests.support.arrival_order import shuffled_arrivals

    epgen = {getattr(torch.ops.epgen, name.split("::")[1]).default for name in ag.OP_NAMES}
    save = {"whole": None, "save-epgen": CheckpointPolicy.MUST_SAVE, "recompute-epgen": CheckpointPolicy.MUST_RECOMPUTE}

    def choose(ctx, func, *args, **kwargs):
        return save[policy] if func in epgen else CheckpointPolicy.PREFER_RECOMPUTE

    kwargs = {} if policy == "whole" else {"context_fn": lambda: create_selective_checkpoint_contexts(choose)}
    cfg = _cfg(rank, world, 6, hidden_dim=8)
    x, w, ids, ew, grad = _step_inputs(rank, cfg, 7, 6)
    inputs = (x, w) if plain else (x, w, ew)
    with shuffled_arrivals(), EpDispatchCombineOp(cfg) as op:
        layer = _plain_layer(op, ids) if plain else _layer(op, ids)
        want = _grads(layer, inputs, grad)
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        got = torch.autograd.grad(checkpoint(layer, *leaves, use_reentrant=False, **kwargs), leaves, grad)
        kept = len(ag._KEPT)  # the recomputation's routings, released when the backward ended
    return [float((u - v).norm() / v.norm()) for u, v in zip(got, want)], kept


@pytest.mark.parametrize("plain", [False, True], ids=["grouped", "plain"])
@pytest.mark.parametrize("policy", ["whole", "recompute-epgen", "save-epgen"])
def test_checkpointing_when_the_recomputed_dispatch_receives_in_another_order(policy, plain):
    """The native bandwidth dispatch receives rows in arrival order, so a recomputed dispatch may lay its rows out
    differently from the first forward's: the backward gets the recomputation's saved tensors and must take its
    routing too (taking the first forward's gave gradients as far off as unrelated tensors: relative errors
    0.5-4.5 here, 1.3-1.4 in torchtitan's MoE on a GPU). The gradients match no checkpointing to float32 rounding
    (the expert matrices' gradients sum a group's rows in the recomputation's order)."""
    for errs, kept in get_world(2).run(scn_checkpoint_in_arrival_order, policy, plain, timeout=120):
        assert max(errs) <= 1e-6 and kept == 0, (errs, kept)


def scn_no_grad(rank, world):
    """Autograd off: the op's own path and buffers (nothing cloned), the same values as with autograd on."""
    cfg = _cfg(rank, world, 5, hidden_dim=8)
    x, w, ids = _step_inputs(rank, cfg, 5, 5)[:3]
    with EpDispatchCombineOp(cfg) as op:
        with torch.no_grad():
            layout, h = ag.dispatch_grouped(op, x, w, ids)
            assert h.id == 0 and not layout.x.requires_grad  # no routing saved, no custom op
            plain = ag.combine_grouped(op, layout.x, h).clone()
        layout2, h2 = ag.dispatch_grouped(op, x, w, ids)
        assert h2.id > 0 and torch.equal(layout2.x, layout.x)
        assert torch.equal(ag.combine_grouped(op, layout2.x, h2), plain)
    return True


def test_no_grad_takes_the_ops_own_path():
    assert all(get_world(2).run(scn_no_grad, timeout=120))


def scn_fp8(rank, world):
    """fp8_blockwise dispatch (grouped_dequantize): the gradients move unquantized, the same bits as a bf16 op's
    for the same routing and the same upstream gradient (the quantization is the identity for the gradient)."""
    kw = dict(hidden_dim=128, data_type=torch.bfloat16)
    fp8 = _cfg(rank, world, 4, dispatch_quant_type="fp8_blockwise", grouped_dequantize=True, **kw)
    bf16 = _cfg(rank, world, 4, **kw)
    x, w, ids, _, grad = _step_inputs(rank, bf16, 6, 4)
    grads = []
    for cfg in (fp8, bf16):
        with EpDispatchCombineOp(cfg) as op:
            xx = x.clone().requires_grad_(True)
            layout, h = ag.dispatch_grouped(op, xx, w, ids)
            assert layout.x.dtype == torch.bfloat16
            out = ag.combine_grouped(op, layout.x * 3, h, apply_weights=False)
            grads.append(torch.autograd.grad(out, xx, grad)[0])
    assert grads[0].dtype == torch.bfloat16 and torch.equal(grads[0], grads[1])
    return True


def test_fp8_dispatch_moves_bf16_gradients():
    assert all(get_world(2).run(scn_fp8, timeout=180))


def test_a_combine_needing_gradients_refuses_a_handle_made_without_autograd():
    with EpDispatchCombineOp(_cfg(0, 1, 4)) as op:
        x, ids = torch.randn(4, H), torch.zeros(4, K, dtype=torch.int32)
        with torch.no_grad():
            layout, h = ag.dispatch_grouped(op, x, None, ids)
        y = layout.x.clone().requires_grad_(True)
        with pytest.raises(InputError, match="^combine_grouped: the handle comes from a dispatch run with autograd off"):
            ag.combine_grouped(op, y, h)
        assert torch.equal(ag.combine_grouped(op, layout.x, h), 2 * x)  # nothing needs a gradient: the op's path


def test_plain_dispatch_of_a_quantized_op_says_where_to_train():
    cfg = _cfg(0, 1, 4, hidden_dim=128, data_type=torch.bfloat16, dispatch_quant_type="fp8_blockwise")
    with EpDispatchCombineOp(cfg) as op:
        x = torch.randn(4, 128).to(torch.bfloat16).requires_grad_(True)
        ids = torch.zeros(4, K, dtype=torch.int32)
        with pytest.raises(InputError, match="grouped_dequantize=True"):
            ag.dispatch(op, x, None, ids)


def test_the_custom_ops_are_registered_under_epgen():
    assert ag.OP_NAMES == ("epgen::dispatch", "epgen::combine", "epgen::dispatch_grouped", "epgen::combine_grouped")
    assert ag.BACKWARD_OP_NAMES == tuple(name + "_backward" for name in ag.OP_NAMES)
    for name in ag.OP_NAMES + ag.BACKWARD_OP_NAMES:
        ns, op_name = name.split("::")
        assert hasattr(getattr(torch.ops, ns), op_name)


def _graph_ops(record: list):
    """A torch.compile backend (AOTAutograd, then the graphs run as they are) that appends the ops each forward and
    backward graph calls to `record`: what torch.compile saw of the layer."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def seen(gm, _inputs):
        record.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return make_boxed_func(gm.forward)
    return aot_autograd(fw_compiler=seen, bw_compiler=seen)


def scn_compiled(rank, world):
    """A layer on the grouped legs under torch.compile(fullgraph=True): its gradients against the eager layer's, with
    activation checkpointing inside the compiled code, and its no-grad forward; the forward and backward graphs
    name epgen's ops; no routing is left registered after."""
    from torch.utils.checkpoint import checkpoint

    cfg = _cfg(rank, world, 5, hidden_dim=8)
    x, w, ids, ew, grad = _step_inputs(rank, cfg, 8, 5)
    out = {}
    with EpDispatchCombineOp(cfg) as op:
        layer = _layer(op, ids)
        want = _grads(layer, (x, w, ew), grad)
        graphs: list = []
        compiled = torch.compile(layer, backend=_graph_ops(graphs), fullgraph=True)
        out["grads"] = [[float((u - v).abs().max()) for u, v in zip(_grads(compiled, (x, w, ew), grad), want)]
                        for _ in range(2)]  # the second call: the same graphs, new routings
        out["graphs"] = graphs
        checkpointed = torch.compile(lambda *a: checkpoint(layer, *a, use_reentrant=False), backend="aot_eager",
                                     fullgraph=True)
        out["checkpointed"] = [float((u - v).abs().max()) for u, v in zip(_grads(checkpointed, (x, w, ew), grad),
                                                                            want)]
        with torch.no_grad():
            eager = layer(x, w, ew)
            out["no_grad"] = float((torch.compile(layer, backend="aot_eager", fullgraph=True)(x, w, ew) - eager)
                                   .abs().max())
        plain = _plain_layer(op, ids)  # the plain legs
        want = _grads(plain, (x, w), grad)
        plain_graphs: list = []
        got = _grads(torch.compile(plain, backend=_graph_ops(plain_graphs), fullgraph=True), (x, w), grad)
        out["plain"] = [float((u - v).abs().max()) for u, v in zip(got, want)]
        out["plain_graphs"] = plain_graphs

        def unweighted(x):  # the plain legs without routing weights: no weights' gradient anywhere
            moved, _, _, _, h = ag.dispatch(op, x, None, ids)
            return ag.combine(op, torch.tanh(moved), h)[0]
        got = _grads(torch.compile(unweighted, backend="aot_eager", fullgraph=True), (x,), grad)
        out["unweighted"] = float((got[0] - _grads(unweighted, (x,), grad)[0]).abs().max())
    with EpDispatchCombineOp(cfg) as op2, EpDispatchCombineOp(_cfg(rank, world, 5, hidden_dim=16)) as op3:
        # more ops through the same code: torch.compile turns the op's uid into a graph input once it has seen a
        # second value; each op still gets its own shapes (op3's hidden size differs)
        for o, h in ((op2, 8), (op3, 16)):
            xs, ews, grads = x.repeat(1, h // 8), ew.repeat(1, h // 8, h // 8), grad.repeat(1, h // 8)
            got = _grads(torch.compile(_layer(o, ids), backend="aot_eager", fullgraph=True), (xs, w, ews), grads)
            out.setdefault("more_ops", []).append(
                [float((u - v).abs().max()) for u, v in zip(got, _grads(_layer(o, ids), (xs, w, ews), grads))])
    out["left"] = (len(ag._HANDLES), len(ag._PENDING), len(ag._KEPT))
    return out


def _op_targets(names, grouped: bool) -> set:
    return {f"epgen.{n.split('::')[1]}.default" for n in names if ("grouped" in n) == grouped}


def test_a_layer_on_the_legs_compiles_whole():
    """torch.compile(fullgraph=True) of a layer calling dispatch_grouped and combine_grouped, and of one calling the
    plain legs: no graph break; the forward graph calls the legs' custom ops, the backward graph their backward ops
    (ag.BACKWARD_OP_NAMES); the gradients are the eager layer's, bit for bit (the same ops in the same order), also
    with the layer checkpointed inside the compiled code; the no-grad forward likewise; every routing released
    after."""
    for res in get_world(2).run(scn_compiled, timeout=240):
        assert res["grads"] == [[0.0, 0.0, 0.0]] * 2 and res["checkpointed"] == [0.0, 0.0, 0.0], res
        assert res["no_grad"] == 0.0 and res["plain"] == [0.0, 0.0] and res["unweighted"] == 0.0, res
        assert res["more_ops"] == [[0.0, 0.0, 0.0]] * 2, res
        assert res["left"] == (0, 0, 0), res
        for grouped, graphs in ((True, res["graphs"]), (False, res["plain_graphs"])):
            forward, backward = graphs[:2]
            ops, back = _op_targets(ag.OP_NAMES, grouped), _op_targets(ag.BACKWARD_OP_NAMES, grouped)
            assert ops <= forward and not ops & backward and back <= backward, (grouped, graphs)


class _Watching(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that records the ops it sees (as selective checkpointing's policy does)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _legs_in_graph(out) -> int:
    """Nodes of out's autograd graph that are the legs' eager Functions (runtime.autograd._Leg)."""
    seen, todo, n = set(), [out.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        n += type(node).__name__.endswith("_impl_functionBackward")
        todo.extend(f for f, _ in node.next_functions)
    return n


def scn_eager_and_named_paths(rank, world):
    """Plain eager calls run the legs as autograd Functions, calls under a dispatch mode as the named custom ops:
    the same outputs and gradients, bit for bit, for the grouped and the plain legs."""
    cfg = _cfg(rank, world, 5, hidden_dim=8)
    x, w, ids, ew, grad = _step_inputs(rank, cfg, 9, 5)

    def plain(op):
        def layer(x, w):
            out, out_w, _, _, h = ag.dispatch(op, x, w, ids)
            return ag.combine(op, torch.tanh(out) * out_w.sum(1, keepdim=True), h)[0]
        return layer

    with EpDispatchCombineOp(cfg) as op:
        for make, inputs in ((_layer, (x, w, ew)), (plain, (x, w))):
            layer = make(op, ids) if make is _layer else make(op)
            leaves = [t.clone().requires_grad_(True) for t in inputs]
            out = layer(*leaves)
            assert _legs_in_graph(out) == 2  # the eager path: the legs' own Functions, no custom op
            eager = (out.detach(), *torch.autograd.grad(out, leaves, grad))
            leaves = [t.clone().requires_grad_(True) for t in inputs]
            with _Watching() as mode:
                out = layer(*leaves)
            named = [n for n in mode.seen if n.startswith("epgen.")]
            assert named == (["epgen.dispatch_grouped", "epgen.combine_grouped"] if make is _layer
                             else ["epgen.dispatch", "epgen.combine"]), mode.seen
            via_ops = (out.detach(), *torch.autograd.grad(out, leaves, grad))
            assert all(torch.equal(u, v) for u, v in zip(eager, via_ops))
    return True


def test_eager_calls_and_named_op_calls_agree():
    assert all(get_world(2).run(scn_eager_and_named_paths, timeout=120))


def test_weights_the_combine_did_not_apply_get_a_zero_gradient():
    """combine_grouped(apply_weights=False): no gradient reaches the layout's weights, yet the routing weights took
    part in the forward: their gradient is zeros (torch.autograd.grad does not call them unused), x's is the sum of
    its k pairs' gradients (every column a pair, repeated ids too)."""
    with EpDispatchCombineOp(_cfg(0, 1, 4)) as op:
        x, w, ids, _, grad = _step_inputs(0, op.config, 8, 4)
        x, w = x.requires_grad_(True), w.requires_grad_(True)
        layout, h = ag.dispatch_grouped(op, x, w, ids)
        gx, gw = torch.autograd.grad(ag.combine_grouped(op, layout.x * 3, h, apply_weights=False), (x, w), grad)
        assert gw.shape == w.shape and gw.dtype == torch.float32 and not gw.any()
        assert torch.allclose(gx, 3 * K * grad, rtol=1e-6, atol=0)
