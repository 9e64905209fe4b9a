"""The overlap check of the split-phase legs: does anything of epgen run between a send half and its receive half,
and does a GEMM issued in between run as fast as alone? Records of kind "overlap".

  torchrun --nproc-per-node 1 scripts/overlap_profile.py [--tokens 1 128] [--protocols ll bw]
                                                          [--legs dispatch combine] [--gemm 4096] [--out F]

Per (protocol, tokens, leg): the leg's send half on a communication stream, a bf16 GEMM (--gemm square) on the
compute stream, then the receive half on the communication stream once the GEMM is done (as a layer orders it),
and the other leg in one call (an op holds one operation in flight here: max_inflight = 1);
--iters such rounds under kineto, each synchronized. Fields:
  epgen_kernels_between  epgen kernels (epg_*) running at any moment while a round's GEMM runs, that is between
                         the send half and its receive half (the most over the rounds; the target is 0: a send
                         half that left a kernel resident, spinning, would show here);
  gemm_slowdown          the GEMM's median kernel time in those rounds over its median alone (target <= 1.05);
  gemm_alone_us, gemm_between_us: the medians behind it; epgen_kernels_per_round, epgen_us_per_round.
At one rank (W = 1) the send half has no peer to wait for: the check shows that the halves leave the GPU free
between them (no kernel resident, spinning), not what a link's latency hides (the 2-GPU issue's figure).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import graphprof  # noqa: E402
from bench.inputs import make_input_sets, point_config  # noqa: E402
from bench.records import meta as record_meta  # noqa: E402
from runtime import EpDispatchCombineConfig, EpDispatchCombineOp  # noqa: E402


def is_epgen(name: str) -> bool:
    return name.startswith("epg_")


def overlapping(gemm: tuple[str, float, float], events: list[tuple[str, float, float]]) -> int:
    """Epgen kernels (epg_*) among the device events (name, start_us, duration_us) that run at any moment while
    the GEMM does."""
    lo, hi = gemm[1], gemm[1] + gemm[2]
    return sum(1 for name, s, d in events if is_epgen(name) and s < hi and s + d > lo)


def point(protocol: str, T: int, leg: str, args, meta: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    base = point_config(rank, world, T, args.hidden, args.topk, args.experts, torch.bfloat16)
    cfg = EpDispatchCombineConfig(**{**base, "intranode_protocol": protocol})
    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(args.gemm, args.gemm, dtype=torch.bfloat16, device=dev)
    b = torch.randn(args.gemm, args.gemm, dtype=torch.bfloat16, device=dev)
    c = torch.empty_like(a)
    comm = torch.cuda.Stream(dev)
    with EpDispatchCombineOp(cfg) as op:
        s = make_input_sets(cfg, 1, seed=99 + rank, device=dev)[0]
        x, w, idx = s["x"], s["w"], s["idx"]
        y = torch.randn(cfg.max_recv_tokens, cfg.hidden_dim, dtype=cfg.combine_dtype, device=dev)  # staged each time

        def round_():  # a dispatch and a combine (one operation in flight), one of them split around the GEMM
            if leg == "dispatch":
                p = op.dispatch_send(x, w, None, idx, return_routing=True, stream=comm)
            else:
                h = op.dispatch(x, w, None, idx, return_routing=True)[-1]
                p = op.combine_send(y, routing=h, stream=comm)
            torch.mm(a, b, out=c)
            comm.wait_stream(torch.cuda.current_stream())  # the receive half after the compute, as a layer has it
            out = p.receive()
            p.current_stream_wait()
            if leg == "dispatch":
                op.combine(y, routing=out[-1])

        def alone():
            torch.mm(a, b, out=c)

        for _ in range(3):
            round_()
            alone()
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof_alone:
            for _ in range(args.iters):
                alone()
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                round_()
                torch.cuda.synchronize()  # rounds apart: each round's kernels are its own
        op.check()
    is_gemm = lambda name: not is_epgen(name) and ("gemm" in name.lower() or "sm90" in name.lower()  # noqa: E731
                                                    or "cutlass" in name.lower() or "nvjet" in name.lower())
    alone_ev = [e for e in graphprof.device_events(prof_alone.profiler.kineto_results.events()) if is_gemm(e[0])]
    events = graphprof.device_events(prof.profiler.kineto_results.events())
    gemms = [e for e in events if is_gemm(e[0])]
    if len(gemms) != args.iters or len(alone_ev) != args.iters:
        raise RuntimeError(f"found {len(gemms)} and {len(alone_ev)} GEMM kernels for {args.iters} rounds: the GEMM "
                           "kernel's name is not one this script knows (is_gemm)")
    med = lambda v: statistics.median(v) if v else None  # noqa: E731
    gemm_alone, gemm_between = med([d for _, _, d in alone_ev]), med([d for _, _, d in gemms])
    epg = [e for e in events if is_epgen(e[0])]
    return {**meta, "kind": "overlap", "protocol": protocol, "tokens_per_rank": T, "leg": leg, "world_size": world,
            "dtype": "bfloat16", "hidden": args.hidden, "topk": args.topk, "experts": args.experts,
            "gemm": args.gemm, "iters": args.iters, "epgen_kernels_between": max(overlapping(g, events) for g in gemms),
            "gemm_alone_us": gemm_alone, "gemm_between_us": gemm_between,
            "gemm_slowdown": gemm_between / gemm_alone if gemm_alone and gemm_between else None,
            "epgen_kernels_per_round": len(epg) / args.iters, "epgen_us_per_round": sum(d for _, _, d in epg) / args.iters}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    p.add_argument("--protocols", nargs="+", default=["ll", "bw"], choices=["ll", "bw"])
    p.add_argument("--legs", nargs="+", default=["dispatch", "combine"], choices=["dispatch", "combine"])
    p.add_argument("--gemm", type=int, default=4096, help="the GEMM's square size (bf16)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    meta = record_meta(torch.device("cuda", torch.cuda.current_device()))
    for protocol in args.protocols:
        for T in args.tokens:
            for leg in args.legs:
                rec = point(protocol, T, leg, args, meta)
                if dist.get_rank() == 0:
                    print(f"{protocol} T={T} {leg}: epgen kernels between the halves {rec['epgen_kernels_between']}, "
                          f"GEMM {rec['gemm_between_us']:.1f} µs between / {rec['gemm_alone_us']:.1f} alone "
                          f"(x{rec['gemm_slowdown']:.3f}); {rec['epgen_kernels_per_round']:.0f} epgen kernels, "
                          f"{rec['epgen_us_per_round']:.1f} µs per round", flush=True)
                    if args.out:
                        with args.out.open("a") as f:
                            f.write(json.dumps(rec) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
