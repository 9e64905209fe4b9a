"""Kernel durations inside a CUDA-graph replay of the layer loop: ``python -m bench --profile-graph``
(records kind "kernel_profile").

torchrun --nproc-per-node 2 -m bench --profile-graph [--tokens 1 8 32 128] [--protocol ll bw] [--layers 16]
                                                     [--reps 30] [--hidden 7168] [--topk 8] [--experts 256]

Per (tokens, protocol): L layers of dispatch -> identity copy into combine_in_view() -> combine (bf16) captured in
one CUDA graph (bench.layer_loop's layer loop, expert -> combine_in_view), gated first (bench.gate.identity_gate);
--reps replays timed (per_layer_us: replay / L, slowest rank's median), then a third as many replays profiled
by kineto (torch.profiler, CUPTI). Every device event of a replay gets a role by its name (``role_of``): the
op's dispatch and combine kernels (by their symbols), "copy" (the identity expert's copy: a memcpy or torch's
copy kernel), "other". Fields per role (``roles``): calls per replay, median / min / max µs on this rank; the
top-level dispatch_us, combine_us, copy_us and gap_us (the median idle time between consecutive device events
of the replay: the launch cost inside a graph) are the slowest rank's medians; per_rank holds every rank's
summary. ``profile_table`` prints the table of docs/PERF.md (scripts/layer_table.py does too).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from generator.abi import LL_MAX_TOKENS
from runtime import EpDispatchCombineConfig, EpDispatchCombineOp

from . import graphprof, records
from .gate import identity_gate
from .inputs import make_input_sets, point_config
from .measure import collective_try, stats, warm_on_side_stream
from .tables import latest, md_cell

PROFILE_TOKENS = (1, 8, 32, 128)
ROLES = ("dispatch", "combine", "copy", "other")


def role_of(name: str, symbols: dict[str, str]) -> str:
    """The role of a device event of the layer loop: symbols maps kernel symbols to "dispatch" / "combine"
    (a kineto name may carry the symbol with a signature); memcpy and torch's copy kernels are "copy"."""
    for sym, role in symbols.items():
        if sym in name:
            return role
    low = name.lower()
    if low.startswith("memcpy") or "copy" in low:
        return "copy"
    return "other"


def plan(args) -> tuple[list[tuple[int, str]], list[str]]:
    """(tokens, protocol) points in order, and why each left-out one cannot run."""
    points, skipped = [], []
    for T in args.tokens or PROFILE_TOKENS:
        for protocol in args.protocol:
            if protocol == "ll" and T > LL_MAX_TOKENS:
                skipped.append(f"T={T} with protocol ll (at most {LL_MAX_TOKENS} tokens per rank)")
                continue
            points.append((T, protocol))
    return points, skipped


def _slowest(per_rank: list[dict], role: str | None) -> float | None:
    vals = [(s["gap_us"] if role is None else (s["roles"].get(role) or {}).get("median_us")) for s in per_rank]
    return None if any(v is None for v in vals) or not vals else max(vals)


def profile_record(meta: dict, rank: int, T: int, protocol: str, ran: str | None, layers: int, replays: int,
                   per_layer: tuple[float, float] | None, per_rank: list[dict], **extra) -> dict:
    """A kernel_profile record (rank `rank`'s view) from every rank's ``graphprof.summarize`` of the profiled
    replays; the top-level role times and gap are the slowest rank's."""
    mine = per_rank[rank] if per_rank else {"roles": {}, "gap_us": None, "busy_us": None, "span_us": None}
    return {**meta, "kind": "kernel_profile", "dtype": "bfloat16", "tokens_per_rank": T, "intranode_protocol": protocol,
            "protocol": ran, "layers": layers, "profiled_replays": replays,
            "per_layer_us": per_layer[0] if per_layer else None, "per_layer_p99_us": per_layer[1] if per_layer else None,
            **{f"{role}_us": _slowest(per_rank, role) for role in ("dispatch", "combine", "copy")},
            "gap_us": _slowest(per_rank, None), "roles": mine["roles"], "busy_us": mine["busy_us"],
            "span_us": mine["span_us"], "per_rank": per_rank, "error": None,
            "method": f"{layers} layers of dispatch -> identity copy into combine_in_view -> combine in one CUDA "
                      f"graph; device events of {replays} replays (kineto); role medians, slowest rank", **extra}


def profile_point(T: int, protocol: str, args, meta: dict) -> dict:
    """One (tokens, protocol) point on the GPU; collective; returns its record."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden = args.hidden[0]
    cfg = EpDispatchCombineConfig(**point_config(rank, world, T, hidden, args.topk, args.experts, torch.bfloat16),
                                  intranode_protocol=protocol)
    with EpDispatchCombineOp(cfg) as op:
        s = make_input_sets(cfg, 1, seed=777 + 7919 * rank, device=op.device)[0]
        x, w, idx = s["x"], s["w"], s["idx"]
        identity_gate(op, x, w, None, idx, point=f"profile-graph T={T} protocol={protocol}")
        view = op.combine_in_view()

        def layer():
            out, _, _, _, _, h = op.dispatch(x, w, None, idx, return_routing=True)
            view.copy_(out)
            op.combine(view, routing=h)

        warm_on_side_stream(layer)
        ran = op.last_intranode_protocol
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(args.layers):
                layer()
        per_layer = stats([ms / args.layers for ms in graphprof.replay_ms(g, args.reps)])
        replays = max(3, args.reps // 3)
        symbols = {sym: ("dispatch" if "dispatch" in sym else "combine") for sym in op.capabilities.get("kernels", ())}
        events = _profiled(g, replays, replays * args.layers, symbols)
        op.check()
        del g
    summary = graphprof.summarize(_replays(events, args.layers, symbols), lambda n: role_of(n, symbols))
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, summary)
    return profile_record(meta, rank, T, protocol, ran, args.layers, replays, (per_layer[0] * 1e3, per_layer[1] * 1e3),
                          per_rank)


def _profiled(g, replays: int, want: int, symbols: dict[str, str], tries: int = 3) -> list:
    """graphprof.graph_kernel_events of `replays` replays, taken again (every rank together) while any rank's
    capture holds fewer than `want` dispatch kernels: with processes sharing a GPU, kineto has come back without
    the graph's kernels after a long run of tests. Raises, naming the counts, if every try came back short."""
    world = dist.get_world_size()
    for _ in range(tries):
        events = graphprof.graph_kernel_events(g, replays, sync=dist.barrier)
        seen = [None] * world
        dist.all_gather_object(seen, sum(role_of(e[0], symbols) == "dispatch" for e in events))
        if min(seen) >= want:
            return events
    raise RuntimeError(f"kineto captured {seen} dispatch kernels per rank of the {want} replayed, in {tries} tries")


def _replays(events, layers: int, symbols: dict[str, str]) -> list[list]:
    """The profiled events cut into replays: a replay starts at every `layers`-th dispatch kernel."""
    starts = [i for i, e in enumerate(events) if role_of(e[0], symbols) == "dispatch"][::layers]
    return [events[a:b] for a, b in zip(starts, starts[1:] + [len(events)])]


def run(args, emit=lambda recs: None) -> list[dict]:
    """The profiled points (module docstring); collective; each record handed to emit() as it is made; a
    point that fails on any rank is a record with its reason (error) and the run goes on."""
    meta = records.meta(torch.device("cuda", torch.cuda.current_device()))
    points, skipped = plan(args)
    if dist.get_rank() == 0:
        for why in skipped:
            print(f"skipped: {why}")
    made = []
    for T, protocol in points:
        rec, why = collective_try(lambda: profile_point(T, protocol, args, meta))
        if why is not None:
            rec = {**meta, "kind": "kernel_profile", "tokens_per_rank": T, "intranode_protocol": protocol,
                   "protocol": None, "layers": args.layers, "error": why,
                   "date": time.strftime("%Y-%m-%d", time.gmtime())}
        made.append(rec)
        emit([rec])
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return made


def profile_table(records: list[dict]) -> list[str]:
    """Kernel durations inside the graph, per protocol and token count (the latest record of each)."""
    out = ["| protocol | tokens | dispatch kernel µs | combine kernel µs | copy µs | gap between kernels µs "
           "| per layer (replay / L) µs |", "|---|---|---|---|---|---|---|"]
    for r in latest(records, "kernel_profile", lambda r: (r.get("intranode_protocol") or "bw", r["tokens_per_rank"])):
        key = (r.get("intranode_protocol") or "bw", r["tokens_per_rank"])
        if r.get("error"):
            out.append(f"| {key[0]} | {key[1]} | failed: {r['error']} | – | – | – | – |")
            continue
        out.append(f"| {r.get('protocol') or key[0]} | {key[1]} | {md_cell(r['dispatch_us'], '.2f')} "
                   f"| {md_cell(r['combine_us'], '.2f')} | {md_cell(r['copy_us'], '.2f')} "
                   f"| {md_cell(r['gap_us'], '.2f')} | {md_cell(r['per_layer_us'], '.1f')} |")
    return out
