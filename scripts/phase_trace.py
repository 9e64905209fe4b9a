"""Where a leg's time goes inside its kernel: phase stamps of the device's global timer from dispatch_ll and
combine_ll (issue #35, item 3: budget each 1-token kernel term by term), and from the direct grouped dispatch and the
gather combine that stages the groups.

  torchrun --nproc-per-node 1 scripts/phase_trace.py [--tokens 1 8] [--forms plain grouped one direct] [--iters 200]
                                                     [--hidden 7168] [--topk 8] [--experts 256] [--warm-dispatch]
                                                     [--out F]

Per (tokens, form), the low-latency protocol (intranode_protocol="ll"), bf16: "plain" is dispatch -> combine of
the received rows, "grouped" dispatch_grouped -> combine_grouped with the separate passes, "one" the same with one
kernel per leg (the grouped layout placed in dispatch_ll's tail, combine_ll forming the rows it sends); "direct"
is the bandwidth protocol's two-kernel layer: dispatch_grouped through dispatch_direct, then combine_grouped as one
combine_gather that stages each received row from its pairs' grouped rows. After
warm-up, --iters eager calls, each with the op's trace buffer (NativeBackend.trace_phases) reset: every block's
thread 0 stamps the global timer (ns) when its block reaches a phase (templates/kernels/ep_common.j2 epg_trace:
a block barrier first, so only while tracing) into its own slot of the buffer (a plain store; records with
"stamps": "per block"; the older records' stamps were two atomics per block and phase on words every block
shared), and the earliest and the latest block per phase are taken from the slots after the call.
Printed and recorded (kind "phase_trace"): per kernel and phase the median over the calls of the earliest and
the latest block's time since the earliest block's entry (µs), and the timer's step (the smallest nonzero
difference seen: stamps are that coarse). The barriers the trace adds make a traced kernel slower than an
untraced one: read differences between phases, not totals against untraced timings. At one rank (W = 1) this is
the kernels' own chain with no link in it, never a 2-GPU figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.inputs import make_input_sets, point_config  # noqa: E402
from bench.records import emit_point, meta as record_meta  # noqa: E402
from runtime import EpDispatchCombineConfig, EpDispatchCombineOp  # noqa: E402

# the phases each kernel stamps, in order (templates/kernels/dispatch_ll.j2, combine_ll.j2: epg_trace(a, N))
PHASES = {
    "dispatch_ll": ("entry", "masks built", "counts posted, rows sent", "counts read", "rows received",
                    "tail: grid barrier passed", "tail: pairs numbered", "tail: groups worked out",
                    "tail: pairs placed", "grouped layout placed", "finished"),
    "combine_ll": ("entry", "row counts read", "ready to push", "rows pushed", "tokens reduced", "finished"),
    "dispatch_direct": ("entry", "histograms counted", "totals posted (block 0)", "tables read",
                        "groups worked out", "last chunk numbered", "last chunk's rows stored",
                        "last chunk's books written", "arrival added", "arrivals in (block 0)"),
    "combine_gather": ("entry", "entry barrier passed", "rows staged", "every rank staged", "tokens gathered",
                       "weights summed"),
}
FORMS = ("plain", "grouped", "one", "direct")
# per form, the kernels in the order of the trace buffer's halves
KERNELS = {form: ("dispatch_direct", "combine_gather") if form == "direct" else ("dispatch_ll", "combine_ll")
           for form in FORMS}
UNSET = (1 << 63) - 1  # an earliest entry no block wrote


def earliest_latest(buf: torch.Tensor) -> list[list[list[int]]]:
    """The kernels' per-block stamps [kernel][block][phase] (ns, 0: not reached) -> [kernel][phase][earliest, latest]
    over the blocks (UNSET, 0 where no block reached the phase)."""
    reached = buf > 0
    earliest = torch.where(reached, buf, torch.full_like(buf, UNSET)).amin(dim=1)
    latest = torch.where(reached, buf, torch.zeros_like(buf)).amax(dim=1)
    return torch.stack((earliest, latest), dim=-1).tolist()


def relative(stamps: list[list[list[int]]], kernels: tuple[str, ...]) -> dict[str, list[tuple[float, float] | None]]:
    """One call's raw stamps [kernel][phase][earliest, latest] (ns) -> per kernel, per phase, (earliest, latest) in
    µs since the kernel's earliest entry, None where no block reached the phase (or the kernel did not run)."""
    out = {}
    for name, rows in zip(kernels, stamps):
        t0 = rows[0][0]
        out[name] = [None if t0 == UNSET or lo == UNSET else ((lo - t0) / 1e3, (hi - t0) / 1e3)
                     for lo, hi in rows[:len(PHASES[name])]]
    return out


def summarize(calls: list[dict], kernels: tuple[str, ...]) -> dict[str, list[dict | None]]:
    """Per kernel and phase the median (earliest, latest) µs over the calls that reached it."""
    out = {}
    for name in kernels:
        rows = []
        for ph in range(len(PHASES[name])):
            seen = [c[name][ph] for c in calls if c[name][ph] is not None]
            rows.append(None if not seen else {"phase": PHASES[name][ph], "calls": len(seen),
                                               "earliest_us": statistics.median(s[0] for s in seen),
                                               "latest_us": statistics.median(s[1] for s in seen)})
        out[name] = rows
    return out


def timer_step(stamps: list[list[list[int]]]) -> int | None:
    """The smallest nonzero difference between two stamps of one call (ns): how coarse the timer is."""
    vals = sorted({v for rows in stamps for pair in rows for v in pair if 0 < v < UNSET})
    steps = [b - a for a, b in zip(vals, vals[1:]) if b > a]
    return min(steps) if steps else None


def table(rec: dict) -> list[str]:
    warm = ", each dispatch right after an untraced one" if rec.get("warm_dispatch") else ""
    out = [f"T={rec['tokens_per_rank']} {rec['form']}{warm}: µs since the kernel's first block entered (median of "
           f"{rec['iters']} eager calls; earliest / latest block; timer step {rec['timer_step_ns']} ns)",
           "| kernel | phase | earliest | latest |", "|---|---|---|---|"]
    for name, rows in rec["phases"].items():
        for row in rows:
            if row is not None:
                out.append(f"| {name} | {row['phase']} | {row['earliest_us']:.2f} | {row['latest_us']:.2f} |")
    return out


def point(T: int, form: str, args, meta: dict, keep: list) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    base = point_config(rank, world, T, args.hidden, args.topk, args.experts, torch.bfloat16)
    protocol = "bw" if form == "direct" else "ll"
    cfg = EpDispatchCombineConfig(**base, intranode_protocol=protocol, enable_grouped_layout=form != "plain",
                                  expert_alignment=16)
    op = EpDispatchCombineOp(cfg)
    keep.append(op)
    backend = op._backend
    if form != "plain":
        backend.one_kernel = "always" if form in ("one", "direct") else "never"
    backend.direct = "always" if form == "direct" else "never"
    if form == "direct" and not backend.plan.direct:
        raise SystemExit(f"phase_trace: the direct dispatch does not serve this op (runtime.plan.direct_grouped) at "
                         f"{T} tokens, hidden {args.hidden}, top-{args.topk} of {args.experts}")
    s = make_input_sets(cfg, 1, seed=991 + 7919 * rank, device=op.device)[0]
    x, w, idx = s["x"], s["w"], s["idx"]

    def dispatch():  # -> (the rows the combine takes, the routing handle)
        if form == "plain":
            out, _, _, _, _, h = op.dispatch(x, w, None, idx, return_routing=True)
            return out, h
        layout, h = op.dispatch_grouped(x, w, None, idx)
        return layout.x, h

    def legs(warm=None):
        # warm: trace the dispatch that runs right after an untraced one of the same inputs (--warm-dispatch: its code
        # and data just used by the kernel before it; nothing launched in between)
        if warm is not None:
            backend.trace_phases(None)
            dispatch()
            backend.trace_phases(warm)
        rows, h = dispatch()
        if form == "plain":
            op.combine(rows, routing=h)
        else:
            op.combine_grouped(rows, h)

    for _ in range(args.warmup):
        legs()
    limits = backend.k["dispatch"].limits
    buf = torch.zeros((2, limits["trace_blocks"], limits["trace_phases"]), dtype=torch.int64,
                      device=op.device)
    backend.trace_phases(buf)
    calls, steps = [], []
    try:
        for _ in range(args.iters):
            buf.zero_()
            legs(buf if args.warm_dispatch else None)
            torch.cuda.synchronize()
            stamps = earliest_latest(buf)
            calls.append(relative(stamps, KERNELS[form]))
            steps.append(timer_step(stamps))
    finally:
        backend.trace_phases(None)
    op.check()
    known = [s for s in steps if s is not None]
    return {**meta, "kind": "phase_trace", "tokens_per_rank": T, "form": form, "world_size": world,
            "dtype": "bfloat16", "mode": "eager", "protocol": protocol, "hidden": args.hidden, "topk": args.topk,
            "experts": args.experts, "iters": args.iters, "warm_dispatch": bool(args.warm_dispatch),
            "stamps": "per block",
            "timer_step_ns": min(known) if known else None,
            "phases": summarize(calls, KERNELS[form])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    p.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--warm-dispatch", action="store_true",
                   help="trace each dispatch right after an untraced one of the same inputs (code and data warm)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not 1 <= args.iters <= 100000 or not 0 <= args.warmup <= 100000:
        p.error("--iters must be 1..100000 and --warmup 0..100000")
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    meta = record_meta(torch.device("cuda", torch.cuda.current_device()))
    keep: list = []
    for T in args.tokens:
        for form in args.forms:
            rec = point(T, form, args, meta, keep)
            emit_point(rec, table(rec), args.out)
    for op in keep:
        op.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
