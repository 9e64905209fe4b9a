"""Training through epgen: dispatch and combine that record autograd (docs/TRAINING.md).

Public surface (names stable; each takes the op first):

  dispatch_grouped(op, x, weights=None, indices=...) -> (GroupedLayout, Handle)
      op.dispatch_grouped with a backward: ``layout.x`` (float payloads, or a quantized dispatch with
      grouped_dequantize=True) carries the gradient back to ``x``, ``layout.weights`` (float32 [P]) to
      ``weights``. The layout's tensors are fresh (not the op's buffers), so several forwards may be in flight.
  combine_grouped(op, y, handle, apply_weights=True) -> out [num_tokens, hidden]
      op.combine_grouped with a backward: gradients reach ``y`` and (apply_weights=True) the routing weights:
      d out / d w of a pair = <y row of the pair, output gradient of its token>, summed in float32.
  dispatch(op, x, weights=None, indices=...) -> (out, out_weights, out_indices, total_recv, Handle)
  combine(op, y, handle, weights=None) -> (out, out_weights)
      the plain legs (bf16/fp32 payloads): gradients reach x / weights and y / weights.
  Handle: what a backward needs of its forward's routing (ids copied out of the op's reused buffers);
      ``handle.routing`` is the op's RoutingHandle.
  OP_NAMES: the torch.library ops ("epgen::dispatch", "epgen::combine", "epgen::dispatch_grouped",
      "epgen::combine_grouped"), e.g. for a selective activation checkpointing policy.

Every function takes the op's own path, unchanged, when autograd is off (``torch.is_grad_enabled()`` False:
``torch.no_grad()``, inference): the op's outputs are then its buffers, as with the op methods. With autograd on it
runs as the custom op ``epgen::NAME`` (torch.library, ``register_autograd``), whose arguments are tensors and
integers only: the op is named by its uid (runtime.op.LIVE_OPS), a forward's routing by its handle id, which the
forward returns as a CPU scalar (the handle tensor; as torchtitan's DeepEP integration names its handles). The
custom op runs wherever named ops can be seen (a torch dispatch mode is active: selective activation
checkpointing, tracing, fake tensors; torch.compile); a plain eager call runs the same forward and backward work as
a torch.autograd.Function, which skips the custom op's Python dispatch layers (_Leg).

Under torch.compile the legs compile whole (``fullgraph=True``; tests/runtime/test_autograd.py and, with
torchtitan's MoE, tests/runtime/test_torchtitan_dispatcher.py): each function then calls its custom op alone
(_traced_dispatch_grouped), a combine taking its dispatch's handle tensor; the ops' registered backwards keep
nothing but ctx attributes and saved tensors and call the custom ops ``epgen::NAME_backward`` (BACKWARD_OP_NAMES),
which find the routing when they run: the dispatch's handle tensor holds it (an attribute; autograd keeps a saved
tensor's Python object, so it lives as long as the graph that saved it, eager or compiled).

Backward (no new routing, no host sync):
  * dispatch's backward is a combine of the gradient rows through the forward's routing (each token's gradient
    summed over its destination ranks; in the grouped form each received row first sums its local pairs'
    gradient rows, in float32: a pair-sum launch first; the native combine kernel can do that sum itself, one
    launch, where the op combines grouped rows in one kernel (_pairs_in_combine; _ONE_LAUNCH_BACKWARD)); the
    weights' gradients travel in combine's weights channel;
  * combine's backward is a dispatch replay (``op.dispatch(grad, routing=handle)``) of the output gradient; in the
    grouped form the replay keeps the forward's row numbering, so pair p's token gradient is received row
    src[p] // k (native: one grouped_scale kernel reads it there; the torch backend replays a dispatch_grouped);
  * pairs or rows the forward dropped (receive cap ``max_total_recv_tokens``, grouped capacity) get zero
    gradient; rows past total_recv and grouped padding rows get zero gradient (and the padding rows of the
    layout's x are zeros: a grouped GEMM over them gives finite weight gradients);
  * a quantized dispatch (fp8 / fp4 blockwise) or a quantized combine (quant_type) is treated as the identity for
    the gradient: the backward moves the gradients unquantized (data_type) through a companion op of the same
    routing geometry without quantization, built on first use (collectively: every rank's forward) and closed
    with the op.
A backward through a handle whose op was closed raises ClosedError. A handle saved for a backward keeps the routing
it needs (ids, pair map, row count: copies), so later forwards on the same op cannot change it; where the op's
native combine sends rows to the origins its workspace slot's last dispatch recorded (low latency, scatter,
internode) and that was another handle's (or the op has several slots, max_inflight > 1), a combine through the
handle first replays a dispatch of zeros along it (see _combine_through). The forwards return the handle id as
their last output, so selective activation checkpointing that saves these ops replays them whole.
Activation checkpointing that recomputes them (torch's non-reentrant checkpoint, a selective policy that does not
save them) runs the dispatch again in the backward, and that dispatch may number its received rows differently
(the native bandwidth dispatch receives in arrival order): the saved tensors the backward gets (the expert rows,
the layout's weights) are the recomputation's, so every backward takes the routing of the forward whose saved
tensors it has, named by a handle id saved beside them (_remember / _routing_of), never the first forward's; the
routing of a forward recomputed inside a backward is kept until that backward ends (_keep_while_in_backward).
"""

from __future__ import annotations

import itertools
import types
import weakref
from typing import Optional

import attrs
import torch
from torch._subclasses.fake_tensor import is_fake

from . import grouped
from .errors import ClosedError, InputError
from .op import LIVE_OPS
from .routing import RoutingHandle

OP_NAMES = ("epgen::dispatch", "epgen::combine", "epgen::dispatch_grouped", "epgen::combine_grouped")
#: the ops the forward ops' backwards call (what a compiled backward graph names)
BACKWARD_OP_NAMES = tuple(f"{name}_backward" for name in OP_NAMES)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_OPS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()  # op uid -> op
_HANDLES: "weakref.WeakValueDictionary[int, _Saved]" = weakref.WeakValueDictionary()  # handle id -> saved routing
_PENDING: dict[int, "_Saved"] = {}  # made by a forward, until its wrapper takes it (the same call)
_KEPT: dict[int, "_Saved"] = {}  # made by a forward recomputed inside a backward, until that backward ends
_IDS = itertools.count(1)


class _Saved:
    """A forward's routing as its backward needs it: tensors of its own, never the op's reused buffers. guard: the
    tensors held as they are that others can reach (the token ids, the grouped layout's int32 block), each with
    its version when saved, so a backward after an in-place change to one of them is refused (_live), as torch
    refuses it for saved tensors."""

    __slots__ = ("op", "routing", "ids", "total", "pair_pos", "src", "guard", "named", "parts", "__weakref__")

    def __init__(self, op, routing: RoutingHandle, ids: torch.Tensor, total=None, pair_pos=None, src=None,
                 guard: tuple = ()):
        self.op, self.routing, self.ids = op, routing, ids
        self.total, self.pair_pos, self.src = total, pair_pos, src
        self.guard = tuple((t, t._version) for t in guard)
        self.named = None  # (handle id,): the id its handle tensor (the forward's last output) carries
        self.parts = None  # dispatch_grouped: (its meta output, the layout's offs, counts, src, m_indices, dropped)


class Handle:
    """A forward's routing for combine / combine_grouped and for the backwards (see the module docstring).

    routing: the op's RoutingHandle (None for a handle made under torch.compile: the routing stays with `tensor`);
    id: this handle's id in the registry the custom ops read (0 under torch.compile); weights: the grouped layout's
    differentiable weights (dispatch_grouped; combine_grouped applies them); tensor: the forward custom op's last
    output, the CPU scalar naming its routing (None where autograd was off)."""

    __slots__ = ("id", "op_uid", "routing", "weights", "_saved", "tensor", "_tokens")

    def __init__(self, op, routing: RoutingHandle | None, saved: _Saved | None, weights: torch.Tensor | None = None,
                 handle_id: int = 0, tensor: torch.Tensor | None = None, tokens=None):
        self.id, self.op_uid, self.routing, self.weights, self._saved = handle_id, op.uid, routing, weights, saved
        self.tensor, self._tokens = tensor, tokens
        if saved is not None:
            _HANDLES[handle_id] = saved

    @property
    def num_tokens(self) -> int:
        return self.routing.num_tokens if self.routing is not None else self._tokens

    def __repr__(self) -> str:
        seq = self.routing.seq if self.routing is not None else None
        return f"Handle(id={self.id}, op_uid={self.op_uid}, seq={seq}, tokens={self.num_tokens})"


# --- registries ------------------------------------------------------------------------------------
def _register(op) -> None:
    if op.closed:
        raise ClosedError("epgen autograd: this EpDispatchCombineOp is closed")
    if _OPS.get(op.uid) is op:  # registered by an earlier forward: every check below passed then
        return
    if op.combine_weights != "values":
        raise InputError("epgen autograd: the op must be built with combine_weights='values' (the default)")
    _OPS[op.uid] = op
    if _needs_grad_op(op.config) and op._grad_op is None:
        op._grad_op = _make_grad_op(op)


def _op(op_id: int, call: str):
    op = _OPS.get(op_id)
    if op is None:  # a custom op called by a compiled graph: no wrapper registered the op (runtime.op.LIVE_OPS)
        op = LIVE_OPS.get(op_id)
        if op is not None and not op.closed:
            _register(op)
    if op is None or op.closed:
        raise ClosedError(f"{call}: the op (uid {op_id}) is closed or gone")
    return op


def _traced_op(op_id: int):
    """Op `op_id` as the fake implementations see it while tracing (its config and device: the shapes). Once a
    second op has run through the same compiled code, torch.compile passes the uid as a symbolic int (a graph
    input): reading its value here guards the graph on it, so each op gets a graph of its own shapes."""
    if isinstance(op_id, torch.SymInt):
        op_id = int(op_id)
    op = _OPS.get(op_id) or LIVE_OPS.get(op_id)
    if op is None:
        raise ClosedError(f"epgen autograd: the op (uid {op_id}) is gone")
    return op


def _live(saved: _Saved, call: str):
    """The op of a saved routing, refusing a closed one (a backward after op.close()) and a routing whose held
    tensors changed in place since (_Saved.guard)."""
    if saved.op.closed:
        raise ClosedError(f"backward of {call}: the EpDispatchCombineOp (uid {saved.op.uid}) its forward ran on "
                          f"is closed; run the backward before op.close()")
    _unchanged(saved, f"backward of {call}")
    return saved.op


def _unchanged(saved: _Saved, what: str) -> None:
    for t, version in saved.guard:
        if t._version != version:
            raise InputError(f"{what}: a tensor its dispatch kept (the expert ids, or the grouped layout's offs / "
                             f"counts / src / m_indices / dropped) was modified in place after the dispatch, which "
                             f"reads it again: clone it before changing it")


def _no_saved_routing(call: str, handle: Handle, *inputs) -> None:
    """A combine recording autograd needs its dispatch's saved routing: refuse a handle of a dispatch run with
    autograd off for inputs that need a gradient (they would silently get none)."""
    if handle._saved is None and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        raise InputError(f"{call}: the handle comes from a dispatch run with autograd off (torch.no_grad()), so "
                         f"no gradient can go back through it; dispatch with autograd on")


def _handle_tensor(handle_id: int, saved: _Saved) -> torch.Tensor:
    """A forward custom op's last output: its handle id (a CPU scalar: reading it never waits for the device). It
    holds the routing it names (an attribute: autograd keeps a saved tensor's Python object, so the routing lives
    exactly as long as the tensor, in an eager graph or among a compiled graph's saved activations); the combine
    takes the tensor as an input. The routing does not hold it (no reference cycle)."""
    t = torch.scalar_tensor(handle_id, dtype=torch.int64)
    t._epgen_saved = saved
    saved.named = (handle_id,)
    _HANDLES[handle_id] = saved
    return t


def _saved_of(handle_t: torch.Tensor, read_id: bool = False) -> _Saved:
    """The routing a handle tensor names: the one it holds, or (a copy of it: selective checkpointing stores the
    saved outputs detached) the registry's under its id. read_id: read the id even where the tensor holds the
    routing (a selective checkpoint's replay must see the forward's torch ops)."""
    handle_id = int(handle_t) if read_id else None
    saved = getattr(handle_t, "_epgen_saved", None)
    return saved if saved is not None else _take(handle_id if read_id else int(handle_t))


def _keep(handle_t: torch.Tensor) -> _Saved | None:
    """What a custom op's setup keeps on ctx for its backward: the routing (None while tracing: fake tensors name
    none; a compiled graph keeps the handle tensor itself among its saved activations)."""
    return None if is_fake(handle_t) else _saved_of(handle_t, read_id=True)


def _saved_after(handle_id: int, handle_t: torch.Tensor) -> _Saved:
    """The routing a forward custom op saved: this call's, or, where selective activation checkpointing replays
    the op's saved outputs instead of running it, the original forward's, named by the output's handle id."""
    named = int(handle_t)  # read on every call (checkpointing then replays the read as it replays the op)
    saved = _PENDING.pop(handle_id, None)
    return saved if saved is not None else _take(named)


def _forward(leg: "_Leg", x, weights, indices, op_id: int):
    """Run a forward leg under a fresh handle id -> (its outputs, the routing it saved, the id)."""
    hid = next(_IDS)
    try:
        outs = leg(x.contiguous(), None if weights is None else weights.contiguous(), indices, op_id, hid)
    except BaseException:
        _PENDING.pop(hid, None)
        raise
    saved = _saved_after(hid, outs[-1])
    _keep_while_in_backward(hid, saved)
    return outs, saved, hid


def _keep_while_in_backward(handle_id: int, saved: _Saved) -> None:
    """A forward that runs inside a backward is an activation checkpoint's recomputation: its autograd graph is
    dropped once the recomputation is over, but the backward of the first forward's graph goes on with the
    recomputed saved tensors and, through the handle id saved beside them, this routing (_routing_of). Keep it
    until that backward ends."""
    if torch._C._current_graph_task_id() == -1:  # not inside a backward: the forward's graph keeps it
        return
    _KEPT[handle_id] = saved
    torch.autograd.Variable._execution_engine.queue_callback(lambda: _KEPT.pop(handle_id, None))


def _take(handle_id: int) -> _Saved:
    saved = _PENDING.get(handle_id) or _HANDLES.get(handle_id) or _KEPT.get(handle_id)
    if saved is None:
        raise InputError(f"epgen autograd: no routing under handle id {handle_id} (call the functions of "
                         f"runtime.autograd, not the custom ops directly)")
    return saved


def _remember(ctx, saved: _Saved, handle_t: torch.Tensor) -> torch.Tensor:
    """setup_context's record of the routing a forward ran (a Function's: eager calls): ctx holds it, and the
    handle tensor naming it (the dispatch's last output; a combine's input) goes into ctx.save_for_backward beside
    the other saved tensors, for _routing_of. Under a selective checkpoint's replay the tensor may be a copy naming
    the first forward's routing by the same id."""
    ctx.saved, ctx.handle_id = saved, saved.named[0]
    return handle_t


def _routing_of(ctx, handle_t: torch.Tensor) -> _Saved:
    """The routing a backward runs on: that of the forward whose saved tensors it got. Without recomputation it
    is ctx's own; under activation checkpointing the saved tensors (with handle_t) are the recomputation's, whose
    dispatch may have numbered the received rows, and so laid out the grouped rows, differently from the first
    forward's (the native bandwidth dispatch receives in arrival order): its routing, not ctx's."""
    handle_id = int(handle_t)
    return ctx.saved if handle_id == ctx.handle_id else _take(handle_id)


class _Leg:
    """One epgen op recording autograd: the torch.library custom op (register_autograd), and the same forward,
    setup_context and backward as a torch.autograd.Function. A call runs the custom op where anything may look
    at named ops (a torch dispatch mode is active: selective activation checkpointing's policy, tracing, fake
    tensors) and the Function otherwise: plain eager calls skip the custom op's Python dispatch layers (tens of
    µs of host time per call), with the same outputs, saved tensors and gradients."""

    __slots__ = ("custom_op", "function")

    def __init__(self, custom_op, impl, setup, backward, op_setup=None, op_backward=None):
        # the custom op's own setup and backward (op_setup / op_backward where given: torch.compile traces them, so
        # they keep no Python state but ctx attributes and call only custom ops), the Function's setup and backward
        torch.library.register_autograd(custom_op, op_backward or backward, setup_context=op_setup or setup)
        self.custom_op = custom_op

        def forward(ctx, *args):  # ctx in forward: apply() then skips binding the arguments by signature per call
            output = impl(*args)
            setup(ctx, args, output)
            return output

        self.function = type(f"{impl.__name__}_function", (torch.autograd.Function,), {
            "forward": staticmethod(forward), "backward": staticmethod(backward)})

    def __call__(self, *args):
        if torch._C._len_torch_dispatch_stack():
            return self.custom_op(*args)
        return self.function.apply(*args)


# --- masks -------------------------------------------------------------------------------------------
_ZEROS: dict = {}  # (device, dtype) -> a 0-dim zero, made once outside graph capture


def _where(keep: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """torch.where(keep, t, 0) with a kept 0-dim zero of t's dtype on t's device: a Python 0 there becomes a new
    device scalar per call (an allocation and a fill kernel)."""
    key = (t.device, t.dtype)
    zero = _ZEROS.get(key)
    if zero is None:
        zero = torch.zeros((), dtype=t.dtype, device=t.device)
        if t.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():  # a graph's pool may reuse it
            _ZEROS[key] = zero
    return torch.where(keep, t, zero)


# --- the companion op for quantized legs -------------------------------------------------------------
def _needs_grad_op(cfg) -> bool:
    return cfg.dispatch_quant_type != "none" or cfg.quant_type != "none"


def _make_grad_op(op):
    """The op the gradients of a quantized op move through: the same routing geometry, no quantization
    (collective, like any op's construction)."""
    from .op import EpDispatchCombineOp

    cfg = op.config
    protocol = getattr(op._backend, "protocol", None)
    fields = dict(dispatch_quant_type="none", quant_type="none", combine_mode=None, grouped_dequantize=False,
                  enable_grouped_layout=False, enable_std_moe=False, strict_capacity=False)
    if protocol in ("ll", "bw"):
        fields["intranode_protocol"] = protocol
    group = getattr(op._backend, "group", None)
    return EpDispatchCombineOp(attrs.evolve(cfg, **fields), group)


def _mover(op, routing: RoutingHandle, quantized: bool):
    """(op, routing) a gradient moves through: the op itself, or its unquantized companion."""
    if not quantized:
        return op, routing
    g = op._grad_op
    return g, attrs.evolve(routing, op_uid=g.uid, config_key=g.config.key)


# --- the two moves every backward is made of ---------------------------------------------------------
def _rows_mask(total: torch.Tensor, rows: int) -> torch.Tensor:
    return (torch.arange(rows, device=total.device) < total.to(torch.int64)).unsqueeze(1)


def _replay(saved: _Saved, call: str, grad: torch.Tensor, grad_w: torch.Tensor | None):
    """combine's backward: dispatch the output gradient [T, H] (and [T, k]) along the forward's routing ->
    (rows [R, H] data_type, zero past total_recv; weights rows [R, k] or None)."""
    op = _live(saved, call)
    cfg = op.config
    mover, routing = _mover(op, saved.routing, cfg.dispatch_quant_type != "none")
    out, out_w, _, _, total = mover.dispatch(grad.to(cfg.data_type).contiguous(), grad_w, None, saved.ids,
                                             routing=routing)
    keep = _rows_mask(total, out.shape[0])
    rows = _where(keep, out)
    if out_w is not None:
        out_w = _where(keep, out_w)
    return rows, out_w


def _replay_rows(saved: _Saved, call: str, grad: torch.Tensor) -> torch.Tensor:
    """combine_grouped's backward: the output gradient [T, H] dispatched along the forward's routing -> the
    received rows [R, H] data_type in the forward's numbering (a replay keeps it), pair p's token gradient at
    row p // k (rows past total_recv: anything). A quantized dispatch's gradients move unquantized through the
    companion op (_replay)."""
    op = _live(saved, call)
    cfg = op.config
    if cfg.dispatch_quant_type == "none" and not cfg.prequantized:
        x = grad.to(cfg.data_type).contiguous()
        if x.shape == (saved.routing.num_tokens, cfg.hidden_dim) and x.device == op.device:  # as the op's checks want
            return op.dispatch(x, None, None, saved.ids, _replay_of=saved.routing)[0]
        return op.dispatch(x, None, None, saved.ids, routing=saved.routing)[0]
    return _replay(saved, call, grad, None)[0]


def _replay_grouped(saved: _Saved, call: str, grad: torch.Tensor) -> torch.Tensor:
    """combine_grouped's backward where no kernel takes the received rows (the torch backend): the output
    gradient [T, H] dispatched along the forward's routing into the forward's grouped layout -> [P, H]
    data_type, row p the gradient of pair p's token (padding rows: anything). A replay keeps the forward's
    received-row numbering, so its layout puts every pair where the forward did: one dispatch_grouped. A
    quantized dispatch's gradients move unquantized through the companion op, which has no grouped layout: a
    dispatch, then a gather of each pair's row."""
    op = _live(saved, call)
    cfg = op.config
    x = grad.to(cfg.data_type).contiguous()
    if cfg.dispatch_quant_type == "none" and not cfg.prequantized:
        layout, _ = op.dispatch_grouped(x, None, None, saved.ids, routing=saved.routing)
        return layout.x
    rows = _replay_rows(saved, call, grad)
    k = cfg.num_experts_per_token
    return rows[torch.div(saved.src.long().clamp(min=0), k, rounding_mode="floor")]


def _gather_back(saved: _Saved, call: str, rows: torch.Tensor, rows_w: torch.Tensor | None):
    """dispatch's backward: combine gradient rows [R, H] (and [R, k]) back to the tokens, summed over the
    destination ranks -> (grad [T, H] combine dtype, grad weights [T, k] float32 or None)."""
    op = _live(saved, call)
    cfg = op.config
    mover, routing = _mover(op, saved.routing, cfg.quant_type != "none")
    return _combine_through(mover, routing, saved, rows.to(mover.config.combine_dtype).contiguous(), rows_w)


#: dispatch_grouped's backward as one combine launch (_pairs_in_combine), on since its kernels (the combines'
#: grp_pair_w) passed tests/gpu/test_ep_autograd.py on an H200 (bit for bit against the pair sum + combine and the
#: torch backend). False: the pair-sum launch, then the combine (scripts/train_layer.py --backward-pair-sum, the A/B).
_ONE_LAUNCH_BACKWARD = True


def _pairs_in_combine(op, saved: _Saved, grad_xg: torch.Tensor | None) -> bool:
    """Does dispatch_grouped's backward take one combine kernel that forms each received row from its pairs'
    gradient rows (the backend's combine_pairs: grp_pair_w sends the weights' gradients per pair), rather than
    sum_pairs and then a combine? Where the op combines grouped rows in one kernel (grouped_staged), the combine
    is not quantized (a quantized op's gradients move through its companion) and the rows are as the kernel
    reads them (the combine dtype, contiguous)."""
    if not _ONE_LAUNCH_BACKWARD or grad_xg is None or not hasattr(op._backend, "combine_pairs"):
        return False
    cfg = op.config
    return cfg.quant_type == "none" and grad_xg.dtype == cfg.combine_dtype and grad_xg.is_contiguous() and \
        op._backend.grouped_staged(saved.routing)


def _combine_through(op, routing: RoutingHandle, saved: _Saved, rows, rows_w, pairs=None):
    """op.combine through a handle whose workspace slot may hold another dispatch's rows by now (a later forward,
    another layer's backward). A slot whose last dispatch was this routing's (the forward, or a replay of it) is
    taken as it is. Otherwise, where it matters (several slots, max_inflight > 1: the op refuses a stale handle;
    the native low-latency, scatter and internode combines, which send each received row to the origin its slot's
    last dispatch recorded), a replay of zeros along the routing places its rows again first, and the combine goes
    through the replay's handle. pairs: (pair map, weights per grouped row or None): rows are grouped rows [P, H]
    the combine kernel sums per received row itself (op._combine_pairs)."""
    slots = op._slots
    if slots.route[routing.slot] != routing.route:
        same = [s for s in range(slots.n) if slots.route[s] == routing.route and slots.pending[s] is None]
        if same:
            routing = attrs.evolve(routing, slot=same[0])
    sends_by_last = op.backend_name != "torch" and (routing.extra.get("protocol") == "ll" or op.config.is_internode
                                                   or op.config.resolved_combine_mode == "scatter")
    if slots.route[routing.slot] != routing.route and (slots.n > 1 or sends_by_last):
        zeros = torch.zeros((routing.num_tokens, op.config.hidden_dim), dtype=op.config.data_type, device=op.device)
        *_, routing = op.dispatch(zeros, None, None, saved.ids, return_routing=True, routing=routing)
    if pairs is not None:
        return op._combine_pairs(rows, routing, *pairs)
    return op.combine(rows, rows_w, routing=routing)


def _sum_pairs(op, grad_xg: torch.Tensor | None, pair_pos: torch.Tensor, rows: int, k: int,
               grad_wg: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Grouped rows' gradients [P, H] -> (per received row the float32 sum, in ascending column, of its local pairs'
    rows [R, H], rounded once to the combine dtype (zeros where grad_xg is None: no gradient reached the rows);
    with grad_wg [P] float32, [R, k]: each pair's value of it, 0 where the pair has no row, else None). The native
    backend does both in one kernel (the grouped combine's reduce, which also gathers the pair values)."""
    cfg = op.config
    own = getattr(op._backend, "sum_pairs", None)
    if own is not None and grad_xg is not None and grad_xg.dtype == cfg.combine_dtype and grad_xg.is_contiguous() \
            and (grad_wg is None or grad_wg.is_contiguous()):
        return own(grad_xg, pair_pos, grad_wg)
    rows_w = _pair_weights(grad_wg, pair_pos, rows, k) if grad_wg is not None else None
    if grad_xg is None:
        return torch.zeros((rows, cfg.hidden_dim), dtype=cfg.combine_dtype, device=pair_pos.device), rows_w
    return grouped.reduce(grad_xg, types.SimpleNamespace(pair_pos=pair_pos), None, rows, k, cfg.combine_dtype,
                          apply_weights=False), rows_w


def _pair_weights(wg: torch.Tensor, pair_pos: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """Grouped rows' values [P] -> [R, k] per (received row, column) pair, 0 where the pair has no row: the
    values with a zero appended, indexed by the pair map as it is (its -1, a pair without a row, is the last
    element: that zero), two small ops."""
    return torch.nn.functional.pad(wg, (0, 1))[pair_pos.view(-1, k)[:rows]]


# --- epgen::dispatch_grouped -----------------------------------------------------------------------
def _dispatch_grouped_impl(x: torch.Tensor, weights: Optional[torch.Tensor], indices: torch.Tensor, op_id: int,
                           handle_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                    torch.Tensor]:
    """-> (x rows [P, cols] with the padding rows zeroed, weights [P], scales [P, scale cols] (0 columns
    without), meta int32 (the layout's block without its pair map: grouped.meta_parts), the handle id)."""
    op = _op(op_id, "epgen::dispatch_grouped")
    traced = handle_id == 0  # called by a compiled graph (_traced_dispatch_grouped): the id is made here
    if traced:
        handle_id = next(_IDS)
    # a layout of this forward's own (no copies: the placing kernel writes it whole, every row without a pair
    # zeroed, so a grouped GEMM over a group's padding gives finite, zero, weight gradients); the backward keeps
    # its pair map and pair ids (views of its int32 block, whose head is the output `meta`) and the token ids as
    # they are, guarded against in-place changes (_live)
    layout, routing = op.dispatch_grouped(x, weights, None, indices, fresh=True)
    block = layout.block
    saved = _Saved(op, routing, indices, pair_pos=layout.pair_pos, src=layout.src, guard=(indices, block))
    scales = layout.scales if layout.scales is not None else x.new_empty((layout.rows, 0))
    meta = block[:block.numel() - layout.pair_pos.numel()]
    if not traced:  # the wrapper takes it (_forward) and builds the layout from these views
        _PENDING[handle_id] = saved
        saved.parts = (meta, layout.offs, layout.counts, layout.src, layout.m_indices, layout.dropped)
    return layout.x, layout.weights, scales, meta, _handle_tensor(handle_id, saved)


_dispatch_grouped_op = torch.library.custom_op("epgen::dispatch_grouped", _dispatch_grouped_impl,
                                                mutates_args=())


@_dispatch_grouped_op.register_fake
def _(x, weights, indices, op_id, handle_id):
    op = _traced_op(op_id)
    cfg = op.config
    P = cfg.resolved_grouped_capacity
    shape, dtype = op.grouped_x_spec()
    sd = None if cfg.grouped_dequantize else op.dispatch_out_scales_dtype
    scales = x.new_empty((P, op.dispatch_out_scale_cols), dtype=sd) if sd is not None else x.new_empty((P, 0))
    return (x.new_empty(shape, dtype=dtype), x.new_empty((P,), dtype=torch.float32), scales,
            x.new_empty((grouped.block_size(cfg.num_experts_per_rank, P, 0),), dtype=torch.int32),
            torch.empty((), dtype=torch.int64))


def _dispatch_grouped_setup(ctx, inputs, output):
    ctx.save_for_backward(_remember(ctx, _take(int(output[-1])), output[-1]))
    ctx.x_dtype = inputs[0].dtype
    ctx.set_materialize_grads(False)  # an output no gradient reached comes as None: no zero tensors made for it
    ctx.mark_non_differentiable(*output[2:])
    if output[0].dtype not in _FLOAT_DTYPES:
        ctx.mark_non_differentiable(output[0])


def _dispatch_grouped_grads(saved: _Saved, grad_xg, grad_wg, want_x: bool, want_w: bool, x_dtype):
    """dispatch_grouped's backward along `saved`: -> (grad x [T, H] x_dtype or None, grad weights [T, k] float32 or
    None), each None where not wanted."""
    op = _live(saved, "epgen::dispatch_grouped")
    cfg = op.config
    R, k = cfg.max_recv_tokens, cfg.num_experts_per_token
    pair_w = grad_wg.float().contiguous() if grad_wg is not None and want_w else None
    if _pairs_in_combine(op, saved, grad_xg):  # one combine kernel forms the rows from the pairs (and their weights)
        gx, gw = _combine_through(op, saved.routing, saved, grad_xg, None, pairs=(saved.pair_pos, pair_w))
    else:
        rows, rows_w = _sum_pairs(op, grad_xg, saved.pair_pos, R, k, pair_w)
        gx, gw = _gather_back(saved, "epgen::dispatch_grouped", rows, rows_w)
    gx = gx.to(x_dtype) if want_x else None
    if gw is None and want_w:  # the weights took part in the forward: zeros, not "unused"
        gw = torch.zeros((saved.routing.num_tokens, cfg.num_experts_per_token), dtype=torch.float32,
                         device=op.device)
    return gx, (gw if want_w else None)


def _dispatch_grouped_backward(ctx, grad_xg, grad_wg, *_):
    saved = _routing_of(ctx, *ctx.saved_tensors)
    gx, gw = _dispatch_grouped_grads(saved, grad_xg, grad_wg, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                     ctx.x_dtype)
    return gx, gw, None, None, None


# the custom op's own setup and backward (torch.compile traces them): the routing is named by the saved handle
# tensor and resolved inside epgen::dispatch_grouped_backward, an op of its own, when the backward runs
def _dispatch_grouped_op_setup(ctx, inputs, output):
    x, _, _, op_id, _ = inputs
    ctx.op_id, ctx.x_dtype, ctx.num_tokens = op_id, x.dtype, x.shape[0]
    ctx.keep = _keep(output[-1])  # eager: the routing, held as long as the graph (a checkpoint's copy names it)
    ctx.save_for_backward(output[-1])
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[2:])
    if output[0].dtype not in _FLOAT_DTYPES:
        ctx.mark_non_differentiable(output[0])


def _dispatch_grouped_op_backward(ctx, grad_xg, grad_wg, *_):
    want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (want_x or want_w):
        return None, None, None, None, None
    gx, gw = _dispatch_grouped_backward_op(grad_xg, grad_wg, *ctx.saved_tensors, ctx.op_id, ctx.num_tokens, want_x,
                                           want_w, ctx.x_dtype)
    return (gx if want_x else None), (gw if want_w else None), None, None, None


def _dispatch_grouped_backward_impl(grad_xg: Optional[torch.Tensor], grad_wg: Optional[torch.Tensor],
                                    handle: torch.Tensor, op_id: int, num_tokens: int, want_x: bool, want_w: bool,
                                    x_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (grad x, grad weights); an empty tensor where one is not wanted (an op returns tensors)."""
    saved = _saved_of(handle)
    gx, gw = _dispatch_grouped_grads(saved, grad_xg, grad_wg, want_x, want_w, x_dtype)
    device = saved.op.device
    return (gx if gx is not None else torch.empty((0,), device=device)), \
        (gw if gw is not None else torch.empty((0,), device=device))


_dispatch_grouped_backward_op = torch.library.custom_op("epgen::dispatch_grouped_backward",
                                                        _dispatch_grouped_backward_impl, mutates_args=())


@_dispatch_grouped_backward_op.register_fake
def _(grad_xg, grad_wg, handle, op_id, num_tokens, want_x, want_w, x_dtype):
    op = _traced_op(op_id)
    cfg, dev = op.config, op.device
    gx = torch.empty((num_tokens, cfg.hidden_dim) if want_x else (0,), dtype=x_dtype if want_x else torch.float32,
                     device=dev)
    gw = torch.empty((num_tokens, cfg.num_experts_per_token) if want_w else (0,), dtype=torch.float32, device=dev)
    return gx, gw


_DISPATCH_GROUPED = _Leg(_dispatch_grouped_op, _dispatch_grouped_impl, _dispatch_grouped_setup,
                         _dispatch_grouped_backward, _dispatch_grouped_op_setup, _dispatch_grouped_op_backward)


def dispatch_grouped(op, x, weights=None, indices=None):
    """op.dispatch_grouped(x, weights, None, indices) recording autograd -> (GroupedLayout, Handle); see the
    module docstring. The layout's x and weights are differentiable (x: float payloads, or grouped_dequantize)."""
    if torch.compiler.is_compiling():
        return _traced_dispatch_grouped(op, x, weights, indices)
    if not torch.is_grad_enabled():
        layout, routing = op.dispatch_grouped(x, weights, None, indices)
        return layout, Handle(op, routing, None, layout.weights)
    _register(op)
    (xg, wg, scales, meta, handle_t), saved, hid = _forward(_DISPATCH_GROUPED, x, weights, indices, op.uid)
    parts, saved.parts = saved.parts, None
    if parts is not None and parts[0] is meta and not torch._C._len_torch_dispatch_stack():
        offs, counts, src, m_idx, dropped = parts[1:]  # the Function path (_Leg): the forward's own layout views
    else:  # the custom op (a dispatch mode sees its ops: the split runs in a checkpoint's forward and its replay alike)
        offs, counts, src, m_idx, dropped = grouped.meta_parts(meta, xg.shape[0])
        dropped = dropped.view(())
    handle = Handle(op, saved.routing, saved, wg, hid, handle_t)
    layout = grouped.GroupedLayout(x=xg, scales=scales if scales.shape[1] else None, offs=offs, counts=counts,
                                   src=src, m_indices=m_idx, weights=wg, dropped=dropped,
                                   pair_pos=saved.pair_pos, seq=saved.routing.seq)
    return layout, handle


def _traced_dispatch_grouped(op, x, weights, indices):
    """dispatch_grouped as torch.compile traces it: the custom op alone (with autograd on or off: the layout is the
    call's own either way), the layout's views of its outputs, a handle naming the routing by the op's handle
    tensor. No registry is touched here (the op's impl registers what its backward and the combine need)."""
    xg, wg, scales, meta, handle_t = _dispatch_grouped_op(x.contiguous(),
                                                          None if weights is None else weights.contiguous(),
                                                          indices, op.uid, 0)
    offs, counts, src, m_idx, dropped = grouped.meta_parts(meta, xg.shape[0])
    layout = grouped.GroupedLayout(x=xg, scales=scales if scales.shape[1] else None, offs=offs, counts=counts,
                                   src=src, m_indices=m_idx, weights=wg, dropped=dropped.view(()), pair_pos=None)
    return layout, Handle(op, None, None, wg, 0, handle_t, x.shape[0])


# --- epgen::combine_grouped ------------------------------------------------------------------------
def _combine_grouped_impl(y: torch.Tensor, wg: torch.Tensor, handle: torch.Tensor, op_id: int, num_tokens: int,
                          apply_weights: bool) -> torch.Tensor:
    """-> out [num_tokens, hidden]; handle: the dispatch's handle tensor (its last output), num_tokens its token
    count (the output's rows, for tracing)."""
    op = _op(op_id, "epgen::combine_grouped")
    saved = _saved_of(handle)
    last = op._grouped_by.get(saved.routing.slot)
    if last is not None and last.seq == saved.routing.seq:  # the op's own path: its slot's layout is this handle's
        return op.combine_grouped(y, saved.routing, apply_weights)[0]
    _unchanged(saved, "combine_grouped")
    cfg = op.config  # an older handle: the pairs' rows from the saved map, then the combine
    R, k = cfg.max_recv_tokens, cfg.num_experts_per_token
    checks_shape = (cfg.resolved_grouped_capacity, cfg.hidden_dim)
    if tuple(y.shape) != checks_shape or y.dtype != cfg.combine_dtype:
        raise InputError(f"combine_grouped: expert_out must be {list(checks_shape)} {cfg.combine_dtype}, got "
                         f"{list(y.shape)} {y.dtype}")
    pw = _pair_weights(wg, saved.pair_pos, R, k) if apply_weights else None
    rows = grouped.reduce(y, types.SimpleNamespace(pair_pos=saved.pair_pos), pw, R, k, cfg.combine_dtype,
                          apply_weights)
    return _combine_through(op, saved.routing, saved, rows, None)[0]


_combine_grouped_op = torch.library.custom_op("epgen::combine_grouped", _combine_grouped_impl,
                                               mutates_args=())


@_combine_grouped_op.register_fake
def _(y, wg, handle, op_id, num_tokens, apply_weights):
    cfg = _traced_op(op_id).config
    return y.new_empty((num_tokens, cfg.hidden_dim), dtype=cfg.combine_dtype)


def _combine_grouped_setup(ctx, inputs, output):
    y, wg, handle_t, _, _, apply_weights = inputs
    ctx.apply_weights = apply_weights
    saved = _saved_of(handle_t)
    ctx.saved, ctx.handle_id = saved, saved.named[0]  # _remember's record, inline (this leg's host budget)
    ctx.save_for_backward(y, wg, handle_t)


def _combine_grouped_backward(ctx, grad_out):
    y, wg, handle_t = ctx.saved_tensors
    want_y, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and ctx.apply_weights
    grad_y, grad_w = _combine_grouped_grads(_routing_of(ctx, handle_t), grad_out, y, wg, ctx.apply_weights, want_y,
                                            want_w)
    return grad_y, grad_w, None, None, None, None


def _combine_grouped_grads(saved: _Saved, grad_out, y, wg, apply_weights: bool, want_y: bool, want_w: bool):
    """combine_grouped's backward along `saved`: -> (grad y [P, H] or None, grad weights [P] float32 or None)."""
    op = _live(saved, "epgen::combine_grouped")
    own = getattr(op._backend, "grouped_scale", None)
    if own is not None and (want_y or want_w) and y.dtype == op.config.data_type and wg.dtype == torch.float32 \
            and y.is_contiguous() and wg.is_contiguous():
        # one kernel from the replayed rows: each pair's row times its weight and <y, g>, y read once (grad_w
        # summed in another order than below: the same float32 products, sums that may differ in the last bits)
        rows = _replay_rows(saved, "epgen::combine_grouped", grad_out)
        grad_y, grad_w = own(rows, saved.src, wg if apply_weights else None, y if want_w else None,
                             k=op.config.num_experts_per_token, pair_pos=saved.pair_pos)
        return (grad_y if want_y else None), grad_w
    g = _replay_grouped(saved, "epgen::combine_grouped", grad_out)  # [P, H]: each pair's token gradient
    filled = saved.src >= 0  # the grouped rows that hold a pair (padding rows of g may hold anything)
    grad_y = grad_w = None
    if want_y:
        grad_y = torch.empty_like(y)
        if apply_weights:  # w * g in float32, one rounding (torch.mul computes in the promoted dtype)
            torch.mul(g, wg.unsqueeze(1), out=grad_y)
        else:
            grad_y.copy_(g)
        grad_y.masked_fill_(~filled.unsqueeze(1), 0)  # padding rows (their g and weight may hold anything)
    if want_w:  # padding rows of y may hold anything: 0 there
        grad_w = _where(filled, (y.float() * g).sum(1))
    return grad_y, grad_w


# the custom op's own setup and backward (torch.compile traces them; see dispatch_grouped's)
def _combine_grouped_op_setup(ctx, inputs, output):
    y, wg, handle_t, op_id, _, apply_weights = inputs
    ctx.op_id, ctx.apply_weights = op_id, apply_weights
    ctx.keep = _keep(handle_t)
    ctx.save_for_backward(y, wg, handle_t)


def _combine_grouped_op_backward(ctx, grad_out):
    want_y, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and ctx.apply_weights
    if not (want_y or want_w):
        return None, None, None, None, None, None
    grad_y, grad_w = _combine_grouped_backward_op(grad_out, *ctx.saved_tensors, ctx.op_id, ctx.apply_weights, want_y,
                                                  want_w)
    return (grad_y if want_y else None), (grad_w if want_w else None), None, None, None, None


def _combine_grouped_backward_impl(grad_out: torch.Tensor, y: torch.Tensor, wg: torch.Tensor, handle: torch.Tensor,
                                   op_id: int, apply_weights: bool, want_y: bool,
                                   want_w: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (grad y, grad weights); an empty tensor where one is not wanted."""
    grad_y, grad_w = _combine_grouped_grads(_saved_of(handle), grad_out, y, wg, apply_weights, want_y, want_w)
    return (grad_y if grad_y is not None else y.new_empty((0,))), (grad_w if grad_w is not None else wg.new_empty((0,)))


_combine_grouped_backward_op = torch.library.custom_op("epgen::combine_grouped_backward",
                                                       _combine_grouped_backward_impl, mutates_args=())


@_combine_grouped_backward_op.register_fake
def _(grad_out, y, wg, handle, op_id, apply_weights, want_y, want_w):
    return (torch.empty_like(y) if want_y else y.new_empty((0,))), \
        (torch.empty_like(wg) if want_w else wg.new_empty((0,)))


_COMBINE_GROUPED = _Leg(_combine_grouped_op, _combine_grouped_impl, _combine_grouped_setup, _combine_grouped_backward,
                        _combine_grouped_op_setup, _combine_grouped_op_backward)


def combine_grouped(op, y, handle: Handle, apply_weights: bool = True) -> torch.Tensor:
    """op.combine_grouped(y, handle.routing, apply_weights) recording autograd -> out [num_tokens, hidden]
    (a fresh tensor); gradients reach y and, with apply_weights, the layout's weights (module docstring)."""
    if not isinstance(handle, Handle):
        raise InputError(f"combine_grouped: handle must be the runtime.autograd.Handle of dispatch_grouped, got "
                         f"{type(handle).__name__}")
    if handle.op_uid != op.uid:
        raise InputError(f"combine_grouped: the handle comes from another op (uid {handle.op_uid}, this op is uid "
                         f"{op.uid})")
    if torch.compiler.is_compiling():  # the custom op alone (_traced_dispatch_grouped)
        if handle.tensor is None or handle.weights is None:
            raise InputError("combine_grouped under torch.compile: the handle must come from dispatch_grouped "
                             "called with autograd on or in the compiled code")
        return _combine_grouped_op(y.contiguous(), handle.weights, handle.tensor, op.uid, handle.num_tokens,
                                   bool(apply_weights))
    if not torch.is_grad_enabled() or handle._saved is None:
        _no_saved_routing("combine_grouped", handle, y)
        return op.combine_grouped(y, handle.routing, apply_weights)[0]
    if handle.weights is None:
        raise InputError("combine_grouped: the handle is not from dispatch_grouped")
    _register(op)
    return _COMBINE_GROUPED(y.contiguous(), handle.weights, handle.tensor, op.uid, handle.num_tokens,
                            bool(apply_weights))


# --- epgen::dispatch (plain) -----------------------------------------------------------------------
def _check_plain(op, call: str) -> None:
    cfg = op.config
    if cfg.prequantized or cfg.dispatch_quant_type != "none":
        raise InputError(f"{call}: a quantized dispatch returns {op.dispatch_out_dtype} rows, which carry no "
                         f"gradient; train through dispatch_grouped with grouped_dequantize=True")


def _dispatch_impl(x: torch.Tensor, weights: Optional[torch.Tensor], indices: torch.Tensor, op_id: int,
                   handle_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    op = _op(op_id, "epgen::dispatch")
    traced = handle_id == 0  # called by a compiled graph (dispatch's traced path): the id is made here
    if traced:
        handle_id = next(_IDS)
    out, out_w, _, out_i, total, routing = op.dispatch(x, weights, None, indices, return_routing=True)
    total = total.clone()
    saved = _Saved(op, routing, indices.clone(), total=total)
    if not traced:
        _PENDING[handle_id] = saved
    if out_w is None:
        out_w = torch.zeros(out_i.shape, dtype=torch.float32, device=out_i.device)
    return out.clone(), out_w.clone(), out_i.clone(), total.clone(), _handle_tensor(handle_id, saved)


_dispatch_op = torch.library.custom_op("epgen::dispatch", _dispatch_impl, mutates_args=())


@_dispatch_op.register_fake
def _(x, weights, indices, op_id, handle_id):
    cfg = _traced_op(op_id).config
    R, k = cfg.max_recv_tokens, cfg.num_experts_per_token
    return (x.new_empty((R, x.shape[1])), x.new_empty((R, k), dtype=torch.float32),
            x.new_empty((R, k), dtype=torch.int32), x.new_empty((1,), dtype=torch.int32),
            torch.empty((), dtype=torch.int64))


def _dispatch_setup(ctx, inputs, output):
    ctx.save_for_backward(_remember(ctx, _take(int(output[-1])), output[-1]))
    ctx.x_dtype = inputs[0].dtype
    ctx.mark_non_differentiable(output[2], output[3])


def _dispatch_grads(saved: _Saved, grad_out, grad_w, want_x: bool, want_w: bool, x_dtype):
    """dispatch's backward along `saved`: -> (grad x [T, H] x_dtype or None, grad weights [T, k] float32 or None)."""
    keep = _rows_mask(saved.total, grad_out.shape[0])
    rows = _where(keep, grad_out)
    rows_w = _where(keep, grad_w).contiguous() if want_w else None
    gx, gw = _gather_back(saved, "epgen::dispatch", rows, rows_w)
    return (gx.to(x_dtype) if want_x else None), gw


def _dispatch_backward(ctx, grad_out, grad_w, *_):
    gx, gw = _dispatch_grads(_routing_of(ctx, *ctx.saved_tensors), grad_out, grad_w, ctx.needs_input_grad[0],
                             ctx.needs_input_grad[1], ctx.x_dtype)
    return gx, gw, None, None, None


# the custom op's own setup and backward (torch.compile traces them; see dispatch_grouped's)
def _dispatch_op_setup(ctx, inputs, output):
    x, _, _, op_id, _ = inputs
    ctx.op_id, ctx.x_dtype, ctx.num_tokens = op_id, x.dtype, x.shape[0]
    ctx.keep = _keep(output[-1])
    ctx.save_for_backward(output[-1])
    ctx.mark_non_differentiable(output[2], output[3])


def _dispatch_op_backward(ctx, grad_out, grad_w, *_):
    want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (want_x or want_w):
        return None, None, None, None, None
    gx, gw = _dispatch_backward_op(grad_out, grad_w if want_w else None, *ctx.saved_tensors, ctx.op_id,
                                   ctx.num_tokens, want_x, want_w, ctx.x_dtype)
    return (gx if want_x else None), (gw if want_w else None), None, None, None


def _dispatch_backward_impl(grad_out: torch.Tensor, grad_w: Optional[torch.Tensor], handle: torch.Tensor, op_id: int,
                            num_tokens: int, want_x: bool, want_w: bool,
                            x_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (grad x, grad weights); an empty tensor where one is not wanted."""
    saved = _saved_of(handle)
    gx, gw = _dispatch_grads(saved, grad_out, grad_w, want_x, want_w, x_dtype)
    device = saved.op.device
    return (gx if gx is not None else torch.empty((0,), device=device)), \
        (gw if gw is not None else torch.empty((0,), device=device))


_dispatch_backward_op = torch.library.custom_op("epgen::dispatch_backward", _dispatch_backward_impl,
                                                mutates_args=())


@_dispatch_backward_op.register_fake
def _(grad_out, grad_w, handle, op_id, num_tokens, want_x, want_w, x_dtype):
    cfg = _traced_op(op_id).config
    dev = grad_out.device
    gx = torch.empty((num_tokens, cfg.hidden_dim) if want_x else (0,), dtype=x_dtype if want_x else torch.float32,
                     device=dev)
    gw = torch.empty((num_tokens, cfg.num_experts_per_token) if want_w else (0,), dtype=torch.float32, device=dev)
    return gx, gw


_DISPATCH = _Leg(_dispatch_op, _dispatch_impl, _dispatch_setup, _dispatch_backward, _dispatch_op_setup,
                 _dispatch_op_backward)


def dispatch(op, x, weights=None, indices=None):
    """op.dispatch(x, weights, None, indices, return_routing=True) recording autograd -> (out [R, H],
    out_weights [R, k] float32 or None, out_indices, total_recv, Handle); out and out_weights are differentiable
    (bf16/fp32 payloads; a quantized dispatch trains through dispatch_grouped)."""
    if torch.compiler.is_compiling():  # the custom op alone (see _traced_dispatch_grouped)
        _check_plain(op, "dispatch")
        out, out_w, out_i, total, handle_t = _dispatch_op(x.contiguous(),
                                                          None if weights is None else weights.contiguous(),
                                                          indices, op.uid, 0)
        return out, (out_w if weights is not None else None), out_i, total, Handle(op, None, None, None, 0, handle_t,
                                                                                   x.shape[0])
    if not torch.is_grad_enabled():
        out, out_w, _, out_i, total, routing = op.dispatch(x, weights, None, indices, return_routing=True)
        return out, out_w, out_i, total, Handle(op, routing, None)
    _check_plain(op, "dispatch")
    _register(op)
    (out, out_w, out_i, total, handle_t), saved, hid = _forward(_DISPATCH, x, weights, indices, op.uid)
    return out, (out_w if weights is not None else None), out_i, total, Handle(op, saved.routing, saved, None, hid,
                                                                               handle_t)


# --- epgen::combine (plain) ------------------------------------------------------------------------
def _combine_impl(y: torch.Tensor, weights: Optional[torch.Tensor], handle: torch.Tensor, op_id: int,
                  num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out [num_tokens, H], out weights [num_tokens, k]); handle: the dispatch's handle tensor."""
    op = _op(op_id, "epgen::combine")
    saved = _saved_of(handle)
    out, out_w = op.combine(y, weights, routing=saved.routing)
    if out_w is None:
        out_w = torch.zeros((out.shape[0], op.config.num_experts_per_token), dtype=torch.float32, device=out.device)
    return out, out_w


_combine_op = torch.library.custom_op("epgen::combine", _combine_impl, mutates_args=())


@_combine_op.register_fake
def _(y, weights, handle, op_id, num_tokens):
    cfg = _traced_op(op_id).config
    return (y.new_empty((num_tokens, cfg.hidden_dim), dtype=cfg.combine_dtype),
            y.new_empty((num_tokens, cfg.num_experts_per_token), dtype=torch.float32))


def _combine_setup(ctx, inputs, output):
    y, _, handle_t, _, _ = inputs
    ctx.rows, ctx.y_dtype = y.shape[0], y.dtype
    ctx.save_for_backward(_remember(ctx, _saved_of(handle_t), handle_t))


def _combine_grads(saved: _Saved, grad_out, grad_w, rows: int, want_y: bool, want_w: bool, y_dtype):
    """combine's backward along `saved`: -> (grad y [rows, H] y_dtype or None, grad weights [rows, k] or None)."""
    got, got_w = _replay(saved, "epgen::combine", grad_out, grad_w.contiguous() if want_w else None)
    return (got[:rows].to(y_dtype) if want_y else None), (got_w[:rows] if got_w is not None else None)


def _combine_backward(ctx, grad_out, grad_w):
    grad_y, grad_weights = _combine_grads(_routing_of(ctx, *ctx.saved_tensors), grad_out, grad_w, ctx.rows,
                                          ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.y_dtype)
    return grad_y, grad_weights, None, None, None


# the custom op's own setup and backward (torch.compile traces them; see dispatch_grouped's)
def _combine_op_setup(ctx, inputs, output):
    y, _, handle_t, op_id, _ = inputs
    ctx.op_id, ctx.rows, ctx.y_dtype = op_id, y.shape[0], y.dtype
    ctx.keep = _keep(handle_t)
    ctx.save_for_backward(handle_t)


def _combine_op_backward(ctx, grad_out, grad_w):
    want_y, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (want_y or want_w):
        return None, None, None, None, None
    grad_y, grad_weights = _combine_backward_op(grad_out, grad_w if want_w else None, *ctx.saved_tensors,
                                                ctx.op_id, ctx.rows, want_y, want_w, ctx.y_dtype)
    return (grad_y if want_y else None), (grad_weights if want_w else None), None, None, None


def _combine_backward_impl(grad_out: torch.Tensor, grad_w: Optional[torch.Tensor], handle: torch.Tensor, op_id: int,
                           rows: int, want_y: bool, want_w: bool,
                           y_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (grad y, grad weights); an empty tensor where one is not wanted."""
    grad_y, grad_weights = _combine_grads(_saved_of(handle), grad_out, grad_w, rows, want_y, want_w, y_dtype)
    return (grad_y if grad_y is not None else grad_out.new_empty((0,))), \
        (grad_weights if grad_weights is not None else grad_out.new_empty((0,), dtype=torch.float32))


_combine_backward_op = torch.library.custom_op("epgen::combine_backward", _combine_backward_impl, mutates_args=())


@_combine_backward_op.register_fake
def _(grad_out, grad_w, handle, op_id, rows, want_y, want_w, y_dtype):
    cfg = _traced_op(op_id).config
    gy = grad_out.new_empty((rows, cfg.hidden_dim) if want_y else (0,), dtype=y_dtype if want_y else grad_out.dtype)
    gw = grad_out.new_empty((rows, cfg.num_experts_per_token) if want_w else (0,), dtype=torch.float32)
    return gy, gw


_COMBINE = _Leg(_combine_op, _combine_impl, _combine_setup, _combine_backward, _combine_op_setup,
                _combine_op_backward)


def combine(op, y, handle: Handle, weights=None):
    """op.combine(y, weights, routing=handle.routing) recording autograd -> (out [num_tokens, H], out_weights
    [num_tokens, k] or None); gradients reach y and weights."""
    if not isinstance(handle, Handle):
        raise InputError(f"combine: handle must be a runtime.autograd.Handle, got {type(handle).__name__}")
    if handle.op_uid != op.uid:
        raise InputError(f"combine: the handle comes from another op (uid {handle.op_uid}, this op is uid {op.uid})")
    w = None if weights is None else weights.contiguous()
    if torch.compiler.is_compiling():  # the custom op alone (see _traced_dispatch_grouped)
        if handle.tensor is None:
            raise InputError("combine under torch.compile: the handle must come from dispatch called with "
                             "autograd on or in the compiled code")
        out, out_w = _combine_op(y.contiguous(), w, handle.tensor, op.uid, handle.num_tokens)
        return out, (out_w if weights is not None else None)
    if not torch.is_grad_enabled() or handle._saved is None:
        _no_saved_routing("combine", handle, y, weights)
        return op.combine(y, weights, routing=handle.routing)
    _register(op)
    out, out_w = _COMBINE(y.contiguous(), w, handle.tensor, op.uid, handle.num_tokens)
    return out, (out_w if weights is not None else None)
