"""The MoE layer's forward + backward, eager (as training runs it), on epgen against torchtitan's all-to-all
dispatcher with the same experts: records of kind "train_layer" (docs/TRAINING.md, "Measured").

  torchrun --nproc-per-node 1 scripts/train_layer.py [--tokens 1 128 4096] [--hidden 7168] [--experts 256]
                                                     [--topk 8] [--iters 100] [--warmup 10] [--out F.jsonl]
                                                     [--no-titan] [--backend native|torch] [--device cuda|cpu]

Every path runs the same layer: tokens x [T, H] bf16 and their routing weights w [T, k] float32, both requiring
grad, k distinct experts per token (bench.inputs.make_input_sets, uniform routing), identity experts that autograd
passes through (the rows each dispatcher hands out times 1: one elementwise kernel forward, one backward), and a
fixed output gradient g [T, H]:

  epgen        runtime.autograd.dispatch_grouped -> rows * 1 -> combine_grouped on an EpDispatchCombineOp with
               the config torchtitan's EpgenTokenDispatcher builds (grouped layout, expert_alignment 1,
               grouped_capacity: every local pair of top-k routing, runtime.grouped.grouped_rows); --backend native
               (the generated kernels) or torch (torch.distributed collectives: CPU / gloo, the CPU test).
  titan_a2a    torchtitan 0.3.0's AllToAllTokenDispatcher alone: dispatch -> rows * 1 -> combine, on an EP mesh of
               every rank, its default spmd_types path (--titan-spmd; the meshes registered as its trainer does).
  titan_epgen  the same through torchtitan's interface on epgen: runtime.integrations.torchtitan.EpgenTokenDispatcher.
Without torchtitan (not importable, or --no-titan) the titan paths' records say why ("skipped"), never silently.

Times, µs, eager, autograd recording; each iteration starts with every rank synchronized (device sync, barrier)
and ends with a device sync; the median over --iters after --warmup, then the slowest rank's (a max over ranks):
  fwd_us       the forward alone (its graph dropped after the clock stops);
  fwd_bwd_us   the forward and out.backward(g); bwd_us = fwd_bwd_us - fwd_us.
Per leg (epgen), in iterations of their own (so the marks cost the two figures above nothing): a mark at every
boundary of the step, a CUDA event recorded on the stream (perf_counter on a CPU): before dispatch_grouped, after
it, after the experts, after combine_grouped, then inside out.backward(g) from hooks on the legs' autograd nodes
(Node.register_prehook / register_hook) before and after combine's backward (a dispatch replay of the output
gradient) and before and after dispatch's backward (a combine of the gradient rows), and after backward returns.
A leg's time is the stream's time from the mark before it to the mark after it: the time from the moment the work
before the leg is done to the moment the leg's last kernel is. Where the device waits for the host (small batches)
that is the leg's host work up to its last launch plus its kernels; where the host runs ahead, the leg's kernels:
the leg's share of the eager step's wall time, as training pays it. The marks partition the step: each step's
segments (dispatch_fwd, expert_fwd, combine_fwd, fwd_to_bwd, combine_bwd, expert_bwd, dispatch_bwd, bwd_tail) sum
to its total; legs_us holds each segment's median, legs_total_us the median total (comparable with fwd_bwd_us, plus
what the marks and hooks cost). dispatch_bwd_over_fwd = legs_us.dispatch_bwd / legs_us.dispatch_fwd,
combine_bwd_over_fwd = legs_us.combine_bwd / legs_us.combine_fwd. The same backward legs against the forward leg of the
same communication (dispatch's backward is a combine, combine's backward a dispatch):
dispatch_bwd_over_combine_fwd = legs_us.dispatch_bwd / legs_us.combine_fwd, combine_bwd_over_dispatch_fwd =
legs_us.combine_bwd / legs_us.dispatch_fwd (the issue's "the forward leg it mirrors" read that way; "meets_targets"
holds the first reading, "meets_targets_same_communication" this one).

Each path is also checked once (forward + backward) against the layer in float32 (identity experts, k distinct
experts: out = sum_k w_k x, d x = (sum_k w_k) g, d w_k = <x, g>): relative errors (float64 norms) in "check",
at most CHECK_TOL in bf16 ("check_ok"); a failed check makes the exit status 1 after the records are written.
vs_titan = fwd_bwd_us / titan_a2a's fwd_bwd_us (fwd_vs_titan: the forwards'); the targets (issue 36, item 7):
vs_titan <= 0.2 at every size, each backward leg within 1.1x of the forward leg it mirrors ("meets_targets").
At one rank (W = 1) no link is in the way: the host work, the glue and the kernels of one GPU, never a 2-GPU figure.
--one-launch-backward runs dispatch_grouped's backward as one combine launch (the default);
--backward-pair-sum as a pair-sum launch, then the combine: an A/B on one host; records say which ran
("dispatch_backward").
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import graphprof, hostprof  # noqa: E402
from bench.inputs import make_input_sets  # noqa: E402
from bench.records import meta as record_meta, write_records  # noqa: E402
from runtime import EpDispatchCombineConfig, EpDispatchCombineOp, EpgenError  # noqa: E402
from runtime import autograd as ag  # noqa: E402
from runtime.grouped import grouped_rows  # noqa: E402

PATHS = ("epgen", "titan_a2a", "titan_epgen")
LEGS = ("dispatch_fwd", "expert_fwd", "combine_fwd", "fwd_to_bwd", "combine_bwd", "expert_bwd", "dispatch_bwd",
        "bwd_tail")
MIRRORS = {"dispatch": ("dispatch_bwd", "dispatch_fwd"), "combine": ("combine_bwd", "combine_fwd")}
#: each backward leg against the forward leg that moves the same way (dispatch's backward is a combine, combine's a
#: dispatch): record field -> (backward leg, forward leg)
SAME_COMMUNICATION = {"dispatch_bwd_over_combine_fwd": ("dispatch_bwd", "combine_fwd"),
                      "combine_bwd_over_dispatch_fwd": ("combine_bwd", "dispatch_fwd")}
TARGETS = {"vs_titan": 0.2, "bwd_over_fwd": 1.1}
CHECK_TOL = 2e-2  # bf16: one rounding of the output (epgen), products rounded then summed in bf16 (torchtitan)
EXPERT = "identity: rows * 1 (one elementwise kernel forward, one backward)"
LEG_METHOD = ("stream time between marks at the step's boundaries (CUDA events; perf_counter on a CPU), backward "
              "boundaries from pre/post hooks on the legs' autograd nodes; iterations of their own")
DTYPE = torch.bfloat16


class UsageError(Exception):
    """A bad combination of arguments or a machine that cannot run them: the message, no traceback."""


# --- arguments -------------------------------------------------------------------------------------------------
def _at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    parse.__name__ = f"integer >= {lo}"
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/train_layer.py", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=_at_least(1), nargs="+", default=[1, 128, 4096], help="tokens per rank")
    p.add_argument("--hidden", type=_at_least(1), default=7168)
    p.add_argument("--experts", type=_at_least(1), default=256, help="experts in all (a multiple of the ranks)")
    p.add_argument("--topk", type=_at_least(1), default=8)
    p.add_argument("--iters", type=_at_least(1), default=100, help="timed iterations per figure")
    p.add_argument("--warmup", type=_at_least(0), default=10, help="untimed iterations before them")
    p.add_argument("--warmup-steps", type=_at_least(0), default=200,
                   help="untimed steps of the first token count (epgen's and torchtitan's) before any figure")
    p.add_argument("--out", type=Path, default=None, help="append the records (jsonl) to this file")
    p.add_argument("--no-titan", action="store_true", help="epgen alone (the titan records say so)")
    p.add_argument("--titan-spmd", choices=["spmd_types", "partial_dtensor"], default="spmd_types",
                   help="torchtitan's SPMD backend for its all-to-all dispatcher (its default: spmd_types)")
    p.add_argument("--backend", choices=["native", "torch"], default="native", help="epgen's kernel backend")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--seed", type=_at_least(0), default=7)
    p.add_argument("--host-profile", action="store_true",
                   help="cProfile epgen's forward + backward: the functions that take its host time (host_top)")
    p.add_argument("--host-sort", choices=["cum", "own"], default="cum",
                   help="--host-profile's order: cumulative time (callees included) or own time")
    p.add_argument("--kernel-profile", action="store_true",
                   help="kineto over epgen's eager forward + backward: device time per kernel name (kernel_top)")
    p.add_argument("--host-trace", action="store_true",
                   help="kineto with Python stacks over epgen's steps: the last step's outline per thread (host_trace)")
    p.add_argument("--host-trace-depth", type=_at_least(1), default=9,
                   help="--host-trace's deepest nesting level shown (the custom Functions' insides lie below 9)")
    p.add_argument("--host-ledger", action="store_true",
                   help="host µs of each piece of epgen's step, called alone (host_ledger): what the step is made of")
    p.add_argument("--single-thread-engine", action="store_true",
                   help="every path's backward on the calling thread (torch.autograd.set_multithreading_enabled(False)):"
                        " no hand-off to the autograd engine's device thread; records say engine 'single-thread'")
    p.add_argument("--one-launch-backward", action="store_true",
                   help="dispatch_grouped's backward as one combine launch (runtime.autograd._ONE_LAUNCH_BACKWARD: the "
                        "default)")
    p.add_argument("--backward-pair-sum", action="store_true",
                   help="dispatch_grouped's backward as a pair-sum launch, then a combine (the path before its one "
                        "combine launch), for an A/B on one host; records say which (dispatch_backward)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.topk > args.experts:
        p.error(f"--topk {args.topk} exceeds --experts {args.experts}")
    if args.backend == "native" and args.device != "cuda":
        p.error("--backend native runs the generated kernels: it needs --device cuda (on a CPU: --backend torch)")
    return args


# --- timing ------------------------------------------------------------------------------------------------------
class Clock:
    """Where the time is read: CUDA events and device syncs on a GPU, perf_counter on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def start(self) -> None:
        """Every rank's earlier work done, the ranks lined up."""
        self.sync()
        if dist.get_world_size() > 1:
            dist.barrier()
            self.sync()

    def mark(self) -> float:
        """A mark on a CPU (a GPU's marks are CUDA events: Marks)."""
        return time.perf_counter()

    def us(self, a, b) -> float:
        """µs from mark a to mark b (after a sync)."""
        return a.elapsed_time(b) * 1e3 if self.cuda else (b - a) * 1e6


class Marks:
    """The boundary marks of one step: mark(name) starts the segment `name` (and ends the one before). On a GPU
    the step's events are made beforehand, so a mark only records one."""

    def __init__(self, clock: Clock, n: int = len(LEGS) + 1):
        self.clock, self.names, self.points = clock, [], []
        self.nodes: dict = {}  # the legs' autograd nodes (epgen_fwd), where the backward's marks hook in
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(n)] if clock.cuda else []

    def mark(self, name: str) -> None:  # returns None: as a hook it changes no gradient
        if self._events:
            e = self._events[len(self.points)]
            e.record()
            self.points.append(e)
        else:
            self.points.append(self.clock.mark())
        self.names.append(name)

    def segments(self) -> dict[str, float]:
        return {n: self.clock.us(a, b) for n, a, b in zip(self.names, self.points, self.points[1:])}


def wall_us(clock: Clock, step, iters: int, warmup: int) -> float:
    """Median wall µs of step() (its return value kept until the clock stops, then dropped)."""
    samples = []
    for i in range(warmup + iters):
        clock.start()
        t0 = time.perf_counter()
        kept = step()
        clock.sync()
        t1 = time.perf_counter()
        del kept
        if i >= warmup:
            samples.append((t1 - t0) * 1e6)
    return statistics.median(samples)


def legs_us(clock: Clock, marked_step, iters: int, warmup: int) -> dict[str, float]:
    """Median µs per segment of marked_step(marks), and legs_total_us (first mark to last)."""
    per: dict[str, list[float]] = {}
    for i in range(warmup + iters):
        marks = Marks(clock)
        clock.start()
        marked_step(marks)
        clock.sync()
        if i >= warmup:
            seg = marks.segments()
            assert list(seg) == list(LEGS), f"the step's marks came in another order: {list(seg)}"
            seg["legs_total_us"] = clock.us(marks.points[0], marks.points[-1])
            for k, v in seg.items():
                per.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in per.items()}


def slowest(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Every rank's figures -> the largest over the ranks (the slowest rank's), the same keys on every rank."""
    if dist.get_world_size() == 1:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


# --- the layer ---------------------------------------------------------------------------------------------------
def op_config(rank: int, world: int, T: int, args) -> EpDispatchCombineConfig:
    """The op EpgenTokenDispatcher builds for these sizes (its default pad_multiple 1 and grouped rows)."""
    if args.experts % world:
        raise UsageError(f"--experts {args.experts} do not split evenly over {world} ranks")
    per_rank = args.experts // world
    cfg = EpDispatchCombineConfig(rank=rank, world_size=world, hidden_dim=args.hidden, max_num_inp_token_per_rank=T,
                                  num_experts_per_rank=per_rank, num_experts_per_token=args.topk, data_type=DTYPE,
                                  kernel_backend=args.backend, enable_grouped_layout=True, expert_alignment=1)
    rows = min(cfg.worst_case_grouped_rows, grouped_rows(world, T, per_rank, args.topk, 1))
    return attrs.evolve(cfg, grouped_capacity=rows)


def layer_setup(T: int, args, device: torch.device) -> tuple[EpDispatchCombineConfig, dict]:
    """This rank's op config and layer inputs at T tokens (the same for every pass over T: timings, profiles,
    warm-up)."""
    rank = dist.get_rank()
    cfg = op_config(rank, dist.get_world_size(), T, args)
    return cfg, layer_inputs(cfg, device, args.seed + 7919 * rank)


def layer_inputs(cfg: EpDispatchCombineConfig, device: torch.device, seed: int) -> dict:
    """x (bf16) and w (float32) leaves requiring grad, ids [T, k] int32 (k distinct experts), g [T, H]."""
    s = make_input_sets(cfg, 1, seed=seed, device=device)[0]
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    g = torch.randn(s["x"].shape, device=device, generator=gen).to(DTYPE)
    return {"x": s["x"].detach().requires_grad_(True), "w": s["w"].detach().requires_grad_(True),
            "ids": s["idx"], "g": g}


def reference(inp: dict) -> dict:
    """The layer with identity experts in float32: out = sum_k w_k x; d x = (sum_k w_k) g; d w_k = <x, g>."""
    x, w, g = inp["x"].detach().double(), inp["w"].detach().double(), inp["g"].double()
    ws = w.sum(1, keepdim=True)
    return {"out": ws * x, "grad_x": ws * g, "grad_w": (x * g).sum(1, keepdim=True).expand_as(w)}


def check(fwd, inp: dict) -> dict:
    """One forward + backward of the path against reference(): relative errors (float64 norms)."""
    out = fwd()
    gx, gw = torch.autograd.grad(out, (inp["x"], inp["w"]), inp["g"])
    want = reference(inp)
    got = {"out": out.detach(), "grad_x": gx, "grad_w": gw}
    errs = {}
    for k, ref in want.items():
        den = ref.norm()
        errs[k] = float((got[k].double() - ref).norm() / den) if den > 0 else float(got[k].double().norm())
    return errs


def epgen_fwd(op, inp: dict):
    """The epgen layer's forward; fwd(marks) also marks its boundaries and hands marks the legs' autograd nodes."""
    def fwd(marks: Marks | None = None):
        mark = marks.mark if marks is not None else _unmarked
        mark("dispatch_fwd")
        layout, h = ag.dispatch_grouped(op, inp["x"], inp["w"], inp["ids"])
        mark("expert_fwd")
        y = layout.x * 1
        mark("combine_fwd")
        out = ag.combine_grouped(op, y, h)
        if marks is not None:
            marks.nodes = {"combine": out.grad_fn, "dispatch": layout.x.grad_fn}
        return out
    return fwd


def _unmarked(name: str) -> None:
    pass


def epgen_marked(op, inp: dict):
    """The epgen step with a mark at every boundary (the module docstring)."""
    fwd = epgen_fwd(op, inp)

    def step(marks: Marks) -> None:
        out = fwd(marks)
        marks.mark("fwd_to_bwd")
        for leg, before, after in (("combine", "combine_bwd", "expert_bwd"), ("dispatch", "dispatch_bwd", "bwd_tail")):
            node = marks.nodes[leg]
            node.register_prehook(lambda *_, name=before: marks.mark(name))
            node.register_hook(lambda *_, name=after: marks.mark(name))
        out.backward(inp["g"])
        marks.mark("end")
        inp["x"].grad = inp["w"].grad = None
    return step


def host_profile(clock: Clock, step, iters: int, sort: str = "cum", top: int = 30) -> list[dict]:
    """cProfile over `iters` steps: the `top` functions by `sort` time, µs per step (own and cumulative)."""
    return hostprof.top_functions(step, iters, top=top, sort=sort, per="step", sync=clock.sync)


def kernel_profile(clock: Clock, step, iters: int, top: int = 20) -> list[dict]:
    """The device side of `iters` eager steps under kineto: per kernel (memcpy, memset) name, its calls and µs
    per step, the `top` names by time; on a CPU (no device events) an empty list."""
    if not clock.cuda:
        return []
    from torch.profiler import ProfilerActivity, profile

    clock.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        clock.sync()
    total: dict[str, list[float]] = {}
    for name, _, dur in graphprof.device_events(prof.profiler.kineto_results.events()):
        total.setdefault(name[:120], []).append(dur)
    rows = sorted(total.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"kernel": n, "calls_per_step": len(d) / iters, "us_per_step": sum(d) / iters} for n, d in rows]


_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # kineto's Python event names carry the bound object's address


def host_trace(clock: Clock, step, iters: int = 5, depth: int = 9, min_us: float = 3.0,
               top: int = 25) -> tuple[list[str], list[str]]:
    """kineto (CPU activity, Python functions recorded) over `iters` steps -> (the last step's events as an outline,
    thread by thread (the autograd engine runs the backward on a thread of its own, which cProfile does not see),
    nesting up to `depth`, events of at least `min_us`: "thread +start µs  duration µs  name"; the `top` event
    names by their own time in that step, every depth counted (an event's duration less its children's), summed
    per thread and name: "thread  own µs  calls  name")."""
    import json

    from torch.profiler import ProfilerActivity, profile, record_function

    clock.sync()
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for i in range(iters):
            with record_function(f"epgen_step_{i}"):
                step()
            clock.sync()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    last = [e for e in spans if e.get("name") == f"epgen_step_{iters - 1}"]
    if not last:
        return ["(no step span in the trace)"], []
    t0, t1 = last[0]["ts"], last[0]["ts"] + last[0]["dur"]
    mine = sorted((e for e in spans if t0 <= e["ts"] <= t1), key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    lines, threads, stack = [], {}, []
    own: dict[tuple[str, str], list[float]] = {}  # (thread, name) -> [own µs, calls]
    for e in mine:
        tid = threads.setdefault(e["tid"], f"T{len(threads)}")
        while stack and (stack[-1][0] != e["tid"] or e["ts"] >= stack[-1][1]):
            stack.pop()
        level = len(stack)
        if stack:  # the parent's own time loses this child's
            own[stack[-1][2]][0] -= e["dur"]
        key = (tid, _ADDRESS.sub("", e["name"])[:110])  # one row per method, whichever object it was bound to
        own.setdefault(key, [0.0, 0])
        own[key][0] += e["dur"]
        own[key][1] += 1
        stack.append((e["tid"], e["ts"] + e["dur"], key))
        if level <= depth and e["dur"] >= min_us:
            lines.append(f"{tid} +{e['ts'] - t0:8.1f} {e['dur']:8.1f}  {'  ' * level}{e['name'][:110]}")
    ranked = sorted(own.items(), key=lambda kv: -kv[1][0])[:top]
    return lines, [f"{tid} {us:8.1f} {n:5d}  {name}" for (tid, name), (us, n) in ranked]


def host_us(clock: Clock, call, iters: int, warmup: int, setup=None) -> float:
    """Median host µs of call() alone (call(setup()) with a setup, untimed): the device idle before each call
    (synced), the clock stopped when the call returns (its device work may still run)."""
    samples = []
    for i in range(warmup + iters):
        made = setup() if setup is not None else None
        clock.sync()
        t0 = time.perf_counter()
        kept = call() if setup is None else call(made)
        t1 = time.perf_counter()
        del kept
        if i >= warmup:
            samples.append((t1 - t0) * 1e6)
    return statistics.median(samples)


def host_ledger(clock: Clock, op, inp: dict, iters: int, warmup: int) -> dict[str, float]:
    """The host µs of the pieces epgen's training step is made of, each called alone (host_us), in the order the
    step runs them: what a cut of the step's host time can come from. Pieces of the native backend only (its
    kernels' launches) are left out on the torch backend."""
    x, w, ids, g = inp["x"], inp["w"], inp["ids"], inp["g"]
    dev, H = x.device, x.shape[1]

    class Same(torch.autograd.Function):  # the autograd engine's own cost: one node, its input's AccumulateGrad
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, gt):
            return gt

    leaf = torch.zeros_like(x, requires_grad=True)

    def engine():
        Same.apply(leaf).backward(g)
        leaf.grad = None

    layout, h = ag.dispatch_grouped(op, x, w, ids)
    y = (layout.x * 1).detach()
    wg = layout.weights.detach()
    saved = h._saved
    k = op.config.num_experts_per_token
    R = op.config.max_recv_tokens
    pieces = {
        "torch_empty": lambda: torch.empty((x.shape[0], H), dtype=x.dtype, device=dev),
        "torch_mul": lambda: g.mul(1),
        "engine_one_node_fwd_bwd": engine,
        "op_dispatch_grouped": lambda: op.dispatch_grouped(x.detach(), w.detach(), None, ids),
        "op_dispatch_grouped_fresh": lambda: op.dispatch_grouped(x.detach(), w.detach(), None, ids, fresh=True),
        "op_combine_grouped": None,  # after a dispatch_grouped of its own (below)
        "ag_dispatch_grouped": lambda: ag.dispatch_grouped(op, x, w, ids),
        "ag_combine_grouped": None,
        "replay_dispatch": lambda: ag._replay_rows(saved, "ledger", g),
        "grouped_scale": (lambda: op._backend.grouped_scale(y, saved.src, wg, y, k=k, pair_pos=saved.pair_pos))
        if hasattr(op._backend, "grouped_scale") else None,
        "sum_pairs": (lambda: op._backend.sum_pairs(y, saved.pair_pos, wg))
        if hasattr(op._backend, "sum_pairs") else None,
        "pair_weights": lambda: ag._pair_weights(wg, saved.pair_pos, R, k),
        "combine_back": None,
    }
    out = {}
    for name, call in pieces.items():
        if name == "op_combine_grouped":
            with torch.no_grad():
                _, r = op.dispatch_grouped(x.detach(), w.detach(), None, ids)
                out[name] = host_us(clock, lambda: op.combine_grouped(y, r), iters, warmup)
            continue
        if name == "ag_combine_grouped":
            lay, hh = ag.dispatch_grouped(op, x, w, ids)
            ys = lay.x * 1
            out[name] = host_us(clock, lambda: ag.combine_grouped(op, ys, hh), iters, warmup)
            continue
        if name == "combine_back":
            rows, rows_w = ag._sum_pairs(op, y, saved.pair_pos, R, k, wg)
            out[name] = host_us(clock, lambda: ag._gather_back(saved, "ledger", rows, rows_w), iters, warmup)
            continue
        if call is not None:
            out[name] = host_us(clock, call, iters, warmup)
    # the same work (combine's backward: the replay and grouped_scale) timed inside a backward, on the autograd
    # engine's thread, against on this one: what the engine's thread costs the step beyond the engine's own work
    inside: list[float] = []

    def work():
        rows = ag._replay_rows(saved, "ledger", g)
        if hasattr(op._backend, "grouped_scale"):
            op._backend.grouped_scale(rows, saved.src, wg, y, k=k, pair_pos=saved.pair_pos)

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, gt):
            t0 = time.perf_counter()
            work()
            inside.append((time.perf_counter() - t0) * 1e6)
            return gt

    def probe():
        Probe.apply(leaf).backward(g)
        leaf.grad = None
    out["combine_bwd_work_here"] = host_us(clock, work, iters, warmup)
    host_us(clock, probe, iters, warmup)
    out["combine_bwd_work_in_engine"] = statistics.median(inside[warmup:])
    fwd = epgen_fwd(op, inp)
    out["step_fwd"] = host_us(clock, fwd, iters, warmup)
    out["step_fwd_bwd"] = host_us(clock, fwd_bwd_step(fwd, inp), iters, warmup)

    def backward(out_):
        out_.backward(g)
        x.grad = w.grad = None
    out["step_bwd"] = host_us(clock, backward, iters, warmup, setup=fwd)
    return out


def fwd_bwd_step(fwd, inp: dict):
    def step():
        out = fwd()
        out.backward(inp["g"])
        inp["x"].grad = inp["w"].grad = None  # freeing, not zeroing: no kernel
    return step


# --- torchtitan ----------------------------------------------------------------------------------------------------
def titan_missing() -> str | None:
    """None when torchtitan's dispatchers and epgen's integration import, else why not."""
    try:
        import runtime.integrations.torchtitan  # noqa: F401  (installs the torch 2.11 shim first)
        import torchtitan.models.common.token_dispatcher  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a missing or partial install: the record says which
        return f"torchtitan is not importable: {type(e).__name__}: {e}"
    return None


def titan_version() -> str | None:
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return None


class Titan:
    """torchtitan's EP mesh over every rank, registered as its trainer registers it, and its SPMD backend for the
    duration (restored by close())."""

    def __init__(self, device: torch.device, spmd_backend: str):
        from torch.distributed.device_mesh import init_device_mesh
        from torchtitan.distributed.spmd_types import set_spmd_meshes, spmd_dense_mesh, spmd_sparse_mesh
        from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend

        self.mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("ep",))
        self._before = get_spmd_backend()
        try:
            dense = spmd_dense_mesh()
        except AssertionError:  # none registered yet
            dense = None
        self._meshes = (dense, spmd_sparse_mesh())
        self._set_backend, self._set_meshes = set_spmd_backend, set_spmd_meshes
        set_spmd_backend(spmd_backend)
        set_spmd_meshes(dense_mesh=self.mesh, sparse_mesh=self.mesh)

    def close(self) -> None:
        self._set_backend(self._before)
        self._set_meshes(dense_mesh=self._meshes[0], sparse_mesh=self._meshes[1])

    def dispatcher(self, path: str, args, T: int):
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

        from runtime.integrations.torchtitan import EpgenTokenDispatcher

        if path == "titan_a2a":
            cfg = AllToAllTokenDispatcher.Config(num_experts=args.experts, top_k=args.topk)
        else:
            cfg = EpgenTokenDispatcher.Config(num_experts=args.experts, top_k=args.topk, hidden_dim=args.hidden,
                                              num_max_tokens_per_rank=T, dtype=DTYPE, kernel_backend=args.backend)
        d = cfg.build()
        d.wire_meshes(ep_mesh=self.mesh)  # EpgenTokenDispatcher builds its op here (all three sizes given)
        return d


def titan_fwd(d, inp: dict, experts: int):
    ids = inp["ids"].to(torch.int64)
    counts = torch.bincount(ids.flatten(), minlength=experts)  # the router's per-expert counts (not timed)

    def fwd():
        routed, _, meta = d.dispatch(inp["x"], inp["w"], ids, counts)
        return d.combine(routed * 1, meta, inp["x"])
    return fwd


# --- points --------------------------------------------------------------------------------------------------------
def timed(clock: Clock, fwd, inp: dict, args) -> dict:
    fwd_us = wall_us(clock, fwd, args.iters, args.warmup)
    fwd_bwd_us = wall_us(clock, fwd_bwd_step(fwd, inp), args.iters, args.warmup)
    return {"fwd_us": fwd_us, "fwd_bwd_us": fwd_bwd_us}


def point(T: int, args, device: torch.device, titan: Titan | None, skip_reason: str | None, meta: dict) -> list[dict]:
    """The records of one token count: epgen, then torchtitan's two dispatchers (or why they did not run)."""
    clock = Clock(device)
    cfg, inp = layer_setup(T, args, device)
    base = {**meta, "kind": "train_layer", "tokens_per_rank": T, "hidden": args.hidden, "experts": args.experts,
            "topk": args.topk, "dtype": "bfloat16", "mode": "eager", "expert": EXPERT, "iters": args.iters,
            "warmup": args.warmup, "routing": "uniform, k distinct experts per token"}
    out: dict[str, dict] = {}
    with EpDispatchCombineOp(cfg) as op:
        fwd = epgen_fwd(op, inp)
        errs = slowest(check(fwd, inp), device)  # the worst rank's errors
        figures = timed(clock, fwd, inp, args)
        figures |= legs_us(clock, epgen_marked(op, inp), args.iters, args.warmup)
        figures = slowest(figures, device)
        legs = {k: figures.pop(k) for k in LEGS}
        out["epgen"] = {**base, "path": "epgen", "backend": op.backend_name, **figures, "legs_us": legs,
                        "leg_method": LEG_METHOD, "grouped_capacity": cfg.resolved_grouped_capacity,
                        "expert_alignment": cfg.expert_alignment, "check": errs}
        if args.host_ledger:
            out["epgen"]["host_ledger_us"] = slowest(host_ledger(clock, op, inp, args.iters, args.warmup), device)
    for path in PATHS[1:]:
        if titan is None:
            out[path] = {**base, "path": path, "skipped": skip_reason}
            continue
        try:
            out[path] = {**base, **titan_point(path, T, args, inp, titan, clock, device)}
        except Exception as e:  # noqa: BLE001 - torchtitan's side failing: recorded, epgen's records kept
            out[path] = {**base, "path": path, "spmd_backend": args.titan_spmd, "error": f"{type(e).__name__}: {e}"}
    ref = out["titan_a2a"]
    for rec in out.values():
        finish(rec, ref)
    return [out[p] for p in PATHS]


def profiles(T: int, args, device: torch.device) -> dict:
    """The profilers' fields of epgen's record at T tokens (--host-profile, --kernel-profile, --host-trace), on an op
    of their own. run() takes them after every timing: cProfile and kineto leave the host slower afterwards in the
    same process (seen: timings after a kineto trace 1.2-2x their usual), which would skew every later figure."""
    clock = Clock(device)
    cfg, inp = layer_setup(T, args, device)
    out: dict = {}
    with EpDispatchCombineOp(cfg) as op:
        step = fwd_bwd_step(epgen_fwd(op, inp), inp)
        if args.host_profile:
            out["host_top"] = host_profile(clock, step, args.iters, args.host_sort)
            out["host_sort"] = args.host_sort
        if args.kernel_profile:
            out["kernel_top"] = kernel_profile(clock, step, args.iters)
        if args.host_trace:
            out["host_trace"], out["host_trace_own"] = host_trace(clock, step, depth=args.host_trace_depth)
    return out


def titan_point(path: str, T: int, args, inp: dict, titan: Titan, clock: Clock, device: torch.device) -> dict:
    d = titan.dispatcher(path, args, T)  # titan_epgen's op closes with its dispatcher, when this returns
    fwd = titan_fwd(d, inp, args.experts)
    errs = slowest(check(fwd, inp), device)
    figures = slowest(timed(clock, fwd, inp, args), device)
    return {"path": path, **figures, "check": errs, "spmd_backend": args.titan_spmd,
            **({"backend": d.op.backend_name} if path == "titan_epgen" else {})}


def finish(rec: dict, ref: dict) -> None:
    """The derived fields of a timed record: bwd_us, the ratios, the check's verdict, the targets (epgen)."""
    if "fwd_us" not in rec:  # skipped, or failed: the record says which
        return
    rec["bwd_us"] = rec["fwd_bwd_us"] - rec["fwd_us"]
    rec["check_tol"] = CHECK_TOL
    rec["check_ok"] = all(v <= CHECK_TOL for v in rec["check"].values())
    titan = "fwd_us" in ref
    rec["titan_fwd_us"] = ref["fwd_us"] if titan else None
    rec["titan_fwd_bwd_us"] = ref["fwd_bwd_us"] if titan else None
    rec["vs_titan"] = rec["fwd_bwd_us"] / ref["fwd_bwd_us"] if titan else None
    rec["fwd_vs_titan"] = rec["fwd_us"] / ref["fwd_us"] if titan else None
    if "legs_us" in rec:
        legs = rec["legs_us"]
        for name, (bwd, fwd) in MIRRORS.items():
            rec[f"{name}_bwd_over_fwd"] = legs[bwd] / legs[fwd]
        rec["targets"] = dict(TARGETS)
        rec["meets_targets"] = {
            "vs_titan": rec["vs_titan"] <= TARGETS["vs_titan"] if titan else None,
            **{f"{n}_bwd_over_fwd": rec[f"{n}_bwd_over_fwd"] <= TARGETS["bwd_over_fwd"] for n in MIRRORS}}
        for field, (bwd, fwd) in SAME_COMMUNICATION.items():
            rec[field] = legs[bwd] / legs[fwd]
        rec["meets_targets_same_communication"] = {
            field: rec[field] <= TARGETS["bwd_over_fwd"] for field in SAME_COMMUNICATION}


def warm_up(args, device: torch.device, titan: Titan | None) -> None:
    """--warmup-steps untimed steps of the first token count, epgen's and torchtitan's all-to-all in turn, before any
    figure: without them the first token count's figures ran up to 2x slow (host clocks, lazy initialisation), a
    fixed count on every rank (the steps are collective)."""
    if not args.warmup_steps:
        return
    T = args.tokens[0]
    cfg, inp = layer_setup(T, args, device)
    clock = Clock(device)
    with EpDispatchCombineOp(cfg) as op:
        steps = [fwd_bwd_step(epgen_fwd(op, inp), inp)]
        if titan is not None:
            try:
                steps.append(fwd_bwd_step(titan_fwd(titan.dispatcher("titan_a2a", args, T), inp, args.experts), inp))
            except Exception:  # noqa: BLE001 - torchtitan's side failing: point() records why
                pass
        for _ in range(args.warmup_steps):
            for step in steps:
                step()
        clock.sync()


def cpu_model() -> str | None:
    """The host CPU's model name (Linux /proc/cpuinfo), None where it cannot be read: the host's speed moves the
    eager figures, so records name the machine they ran on."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()[:80]
    except OSError:
        pass
    return None


def run(args, device: torch.device | None = None) -> list[dict]:
    """Every token count's records (on every rank; the process group is up). The script's core: the CPU test
    calls it on a gloo rank with --backend torch --device cpu."""
    device = device or (torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda"
                        else torch.device("cpu"))
    meta = record_meta(device, torchtitan=titan_version())
    meta["host_cpus"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    meta["host_threads"] = threading.active_count()
    meta["host_cpu"] = cpu_model()
    meta["engine"] = "single-thread" if args.single_thread_engine else "multithreaded"
    skip = "--no-titan" if args.no_titan else titan_missing()
    titan = Titan(device, args.titan_spmd) if skip is None else None
    meta["titan"] = "ran" if titan is not None else skip
    meta["warmup_steps"] = args.warmup_steps
    # the A/B's "before" (--backward-pair-sum) switches the one-launch backward off for the run
    one = not args.backward_pair_sum and (args.one_launch_backward or ag._ONE_LAUNCH_BACKWARD)
    meta["dispatch_backward"] = "one combine" if args.backend == "native" and one \
        else "pair sum + combine"  # (the torch backend sums the pairs with torch ops, then combines)
    was_one, ag._ONE_LAUNCH_BACKWARD = ag._ONE_LAUNCH_BACKWARD, one
    try:
        with torch.autograd.set_multithreading_enabled(not args.single_thread_engine):
            warm_up(args, device, titan)
            records = [rec for T in args.tokens for rec in point(T, args, device, titan, skip, meta)]
        if args.host_profile or args.kernel_profile or args.host_trace:  # after every timing (profiles' docstring)
            with torch.autograd.set_multithreading_enabled(not args.single_thread_engine):
                for rec in records:
                    if rec["path"] == "epgen":
                        rec.update(profiles(rec["tokens_per_rank"], args, device))
    finally:
        if titan is not None:
            titan.close()
        ag._ONE_LAUNCH_BACKWARD = was_one
    return records


# --- output ----------------------------------------------------------------------------------------------------
def _f(v, fmt="{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def table(records: list[dict]) -> list[str]:
    by = {(r["tokens_per_rank"], r["path"]): r for r in records}
    out = ["| tokens | epgen fwd | epgen fwd+bwd | titan fwd+bwd | ratio | dispatch bwd/fwd | combine bwd/fwd "
           "| dispatch bwd / combine fwd | combine bwd / dispatch fwd |",
           "|---|---|---|---|---|---|---|---|---|"]
    legs = ["| tokens | dispatch fwd | combine fwd | combine bwd | dispatch bwd | experts fwd+bwd | other |",
            "|---|---|---|---|---|---|---|"]
    for T in sorted({t for t, _ in by}):
        e, t = by[(T, "epgen")], by.get((T, "titan_a2a"), {})
        out.append(f"| {T} | {_f(e['fwd_us'])} | {_f(e['fwd_bwd_us'])} | {_f(t.get('fwd_bwd_us'))} | "
                   f"{_f(e['vs_titan'], '{:.3f}')} | {_f(e['dispatch_bwd_over_fwd'], '{:.2f}')} | "
                   f"{_f(e['combine_bwd_over_fwd'], '{:.2f}')} | "
                   f"{_f(e.get('dispatch_bwd_over_combine_fwd'), '{:.2f}')} | "
                   f"{_f(e.get('combine_bwd_over_dispatch_fwd'), '{:.2f}')} |")
        g = e["legs_us"]
        legs.append(f"| {T} | {g['dispatch_fwd']:.1f} | {g['combine_fwd']:.1f} | {g['combine_bwd']:.1f} | "
                    f"{g['dispatch_bwd']:.1f} | {g['expert_fwd'] + g['expert_bwd']:.1f} | "
                    f"{g['fwd_to_bwd'] + g['bwd_tail']:.1f} |")
    r0 = records[0]
    head = (f"train_layer: µs, eager, W={r0['world_size']}, {r0['gpu']}, bf16, hidden {r0['hidden']}, "
            f"top-{r0['topk']} of {r0['experts']}, epgen backend {by[(r0['tokens_per_rank'], 'epgen')]['backend']}, "
            f"median of {r0['iters']} (slowest rank); ratio = epgen fwd+bwd / titan fwd+bwd")
    if r0.get("host_cpus") is not None:
        head += f"; host: {r0['host_cpus']} CPUs usable, {r0['host_threads']} Python threads"
        head += f", {r0.get('host_cpu') or 'CPU model unknown'}, autograd engine {r0.get('engine', 'multithreaded')}"
    if r0["titan"] == "ran":
        notes = ["titan_epgen (EpgenTokenDispatcher) fwd+bwd: " + ", ".join(
            f"{T}: {_f(by[(T, 'titan_epgen')].get('fwd_bwd_us'))}" for T in sorted({t for t, _ in by}))]
        notes += [f"{r['path']} at {r['tokens_per_rank']} tokens failed: {r['error']}" for r in records if "error" in r]
    else:
        notes = [f"titan: {r0['titan']}"]
    host = []
    for r in records:
        if r.get("host_top"):
            by_what = "own time" if r.get("host_sort") == "own" else "cumulative"
            host.append(f"epgen host profile at {r['tokens_per_rank']} tokens (cProfile, µs per step, by {by_what}):")
            host += [f"  {h['cum_us']:8.1f} cum {h['own_us']:7.1f} own {h['calls_per_step']:5g}x  {h['function']}"
                     for h in r["host_top"]]
    for r in records:
        if r.get("host_trace"):
            host.append(f"epgen host trace at {r['tokens_per_rank']} tokens (kineto, one step: thread, +start µs, "
                        f"µs, event):")
            host += ["  " + line for line in r["host_trace"]]
        if r.get("host_trace_own"):
            host.append(f"epgen host trace at {r['tokens_per_rank']} tokens, by own time (thread, own µs, calls, "
                        f"event):")
            host += ["  " + line for line in r["host_trace_own"]]
    for r in records:
        if r.get("host_ledger_us"):
            host.append(f"epgen host ledger at {r['tokens_per_rank']} tokens (µs of host time, each piece alone):")
            host += [f"  {v:8.1f}  {n}" for n, v in r["host_ledger_us"].items()]
    for r in records:
        if r.get("kernel_top"):
            host.append(f"epgen device kernels at {r['tokens_per_rank']} tokens (kineto, µs per step, eager fwd+bwd):")
            host += [f"  {h['us_per_step']:8.1f} us {h['calls_per_step']:5g}x  {h['kernel']}" for h in r["kernel_top"]]
    return [head, *out, "", "epgen's legs (µs, stream time between the step's marks):", *legs, *notes, *host]


def _init(args) -> None:
    """The process group: torchrun's, or a group of one (a plain `python scripts/train_layer.py`)."""
    backend = "nccl" if args.device == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        store = tempfile.NamedTemporaryFile(prefix="train-layer-", delete=False).name
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())) % torch.cuda.device_count())


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("train_layer: --device cuda but no GPU is visible here (on a CPU: --backend torch --device cpu)",
              file=sys.stderr)
        return 2
    _init(args)
    try:
        records = run(args)
    except (UsageError, EpgenError) as e:
        print(f"train_layer: {e}", file=sys.stderr)
        dist.destroy_process_group()
        return 2 if isinstance(e, UsageError) else 1
    failed = [f"{r['path']} at {r['tokens_per_rank']} tokens: check failed (tolerance {CHECK_TOL}): {r['check']}"
              for r in records if r.get("check_ok") is False]
    failed += [f"{r['path']} at {r['tokens_per_rank']} tokens failed: {r['error']}" for r in records if "error" in r]
    if dist.get_rank() == 0:
        if args.out:
            write_records(args.out, records)
        print("\n".join(table(records)), flush=True)
        for f in failed:
            print(f"train_layer: {f}", file=sys.stderr)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
