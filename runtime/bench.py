"""EP benchmark: native dispatch / combine vs NCCL all_to_all_single of the same bytes, graph replay.

torchrun --nproc-per-node 2 -m runtime.bench [--tokens 128 4096] [--hidden 7168] [--out results.jsonl]

Every point is correctness-gated first (identity expert: combine(dispatch(x)) == U*x). Times are
device-event medians per leg, events recorded inside the replayed graph, the slowest rank.
Bandwidths: logical = all received rows x row bytes / time; link = rows that crossed to another GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from . import EpDispatchCombineConfig, EpDispatchCombineOp


def _graph_time(legs, inner: int, reps: int) -> list[list[float]]:
    """Per-leg milliseconds of `legs` (callables run in order), captured `inner` times in one graph.

    Each leg is bracketed by timing events recorded inside the graph (external events), so every leg
    is timed on its own, without launch gaps. Returns one list of samples per leg.
    """
    def body():
        for leg in legs:
            leg()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    marks = [[torch.cuda.Event(enable_timing=True, external=True) for _ in range(len(legs) + 1)] for _ in range(inner)]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for ev in marks:
            ev[0].record()
            for leg, end in zip(legs, ev[1:]):
                leg()
                end.record()
    out: list[list[float]] = [[] for _ in legs]
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        for ev in marks[1:]:  # the first iteration absorbs the ranks' start skew
            for i in range(len(legs)):
                out[i].append(ev[i].elapsed_time(ev[i + 1]))
    return out


def _stats(ms: list[float]) -> tuple[float, float]:
    t = torch.tensor(ms, device="cuda")
    med, p99 = t.median(), t.quantile(0.99)
    both = torch.stack([med, p99])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)  # slowest rank
    return float(both[0]), float(both[1])


def _torch_backend_time(cfg_kw: dict, x, w, idx, iters: int = 10) -> tuple[float, float] | str:
    """Eager median (dispatch us, combine us) of the torch reference backend on the same inputs."""
    try:
        cfg = EpDispatchCombineConfig(**{**cfg_kw, "kernel_backend": "torch"})
        with EpDispatchCombineOp(cfg) as op:
            d, c = [], []
            for i in range(iters + 2):
                e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                dist.barrier()
                e[0].record()
                out, ow, _, _, _, h = op.dispatch(x, w, None, idx, return_routing=True)
                e[1].record()
                op.combine(out, routing=h)
                e[2].record()
                torch.cuda.synchronize()
                if i >= 2:
                    d.append(e[0].elapsed_time(e[1]))
                    c.append(e[1].elapsed_time(e[2]))
        return _stats(d)[0] * 1e3, _stats(c)[0] * 1e3
    except Exception as exc:  # the reference backend is a baseline, not the subject
        return f"{type(exc).__name__}: {exc}"


def run_point(T: int, hidden: int, k: int, num_experts: int, dtype, inner: int, reps: int,
              torch_baseline: bool = False) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg_kw = dict(rank=rank, world_size=world, hidden_dim=hidden, max_num_inp_token_per_rank=T,
                  num_experts_per_rank=num_experts // world, num_experts_per_token=k, data_type=dtype,
                  kernel_backend="native")
    cfg = EpDispatchCombineConfig(**cfg_kw)
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    x = torch.randn(T, hidden, device="cuda", generator=g).to(dtype)
    w = torch.rand(T, k, device="cuda", generator=g)
    # uniform routing: k distinct experts per token
    idx = torch.rand(T, num_experts, device="cuda", generator=g).topk(k, dim=1).indices.to(torch.int32)
    with EpDispatchCombineOp(cfg) as op:
        # correctness gate
        out, ow, _, _, total, h = op.dispatch(x, w, None, idx, return_routing=True)
        comb, _ = op.combine(out, routing=h)
        dest = (idx.long() // cfg.num_experts_per_rank)
        U = torch.zeros(T, world, device="cuda").scatter_(1, dest, 1.0)
        remote_rows = int(U.sum() - U[:, rank].sum())  # rows this rank pushes over NVLink
        U = U.sum(1)
        if not torch.equal(comb, (x.float() * U[:, None]).to(dtype)):
            raise SystemExit(f"rank {rank}: identity check failed at T={T}")
        n_recv = int(total.item())
        row = hidden * x.element_size()

        held = {}
        view = op.combine_in_view()

        def disp():
            held["out"], _, _, _, _, held["h"] = op.dispatch(x, w, None, idx, return_routing=True)

        def expert():  # the identity expert writes its output straight into the combine buffer
            view.copy_(held["out"])

        def comb():
            op.combine(view, routing=held["h"])

        def comb_staged():  # expert output in a tensor of its own: combine stages it first
            op.combine(held["out"], routing=held["h"])

        def disp_replay():  # the same rows again through the handle's slots: no slot claims
            op.dispatch(x, w, None, idx, routing=held["h"])

        d_ms, _, c_ms = _graph_time([disp, expert, comb], inner, reps)
        _, s_ms = _graph_time([disp, comb_staged], inner, reps)
        _, r_ms, _, _ = _graph_time([disp, disp_replay, expert, comb], inner, reps)
        (d_med, d_p99), (c_med, c_p99), (s_med, _) = _stats(d_ms), _stats(c_ms), _stats(s_ms)
        r_med = _stats(r_ms)[0]
        geometry = {role: op._backend._geometry(role, T, T * world if role == "dispatch" else T)
                    for role in ("dispatch", "combine")}
        b_med = d_med + c_med
        sent = int(U.sum())
        a2a_in = torch.randn(sent + (world - sent % world) % world, hidden, device="cuda").to(dtype)
        a2a_out = torch.empty_like(a2a_in)
        n_med, n_p99 = _stats(_graph_time([lambda: dist.all_to_all_single(a2a_out, a2a_in)], inner, reps)[0])
    tb = _torch_backend_time(cfg_kw, x, w, idx) if torch_baseline else "not run"
    dev = torch.cuda.get_device_properties(0)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {
        "commit": commit or os.environ.get("EPGEN_COMMIT", ""), "backend": "native", "target": op_arch(),
        "gpu": dev.name, "driver": torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else "",
        "torch": torch.__version__, "world_size": world, "dtype": str(dtype).replace("torch.", ""), "quant": "none",
        "tokens_per_rank": T, "hidden": hidden, "topk": k, "experts": num_experts, "graph": True,
        "dispatch_us": d_med * 1e3, "dispatch_p99_us": d_p99 * 1e3,
        "dispatch_replay_us": r_med * 1e3,
        "dispatch_replay_note": "routing replay of the same rows right after a dispatch (no slot claims; "
                                "includes the dispatch->dispatch entry barrier)",
        "dispatch_blocks": geometry["dispatch"][0], "combine_blocks": geometry["combine"][0],
        "dispatch_threads": geometry["dispatch"][1], "combine_threads": geometry["combine"][1],
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "combine_us": c_med * 1e3, "combine_p99_us": c_p99 * 1e3, "combine_staged_us": s_med * 1e3,
        "combine_input": "combine_in_view (zero-copy); combine_staged_us: separate tensor, staged", "dispatch_combine_us": b_med * 1e3,
        "nccl_a2a_us": n_med * 1e3, "recv_rows": n_recv, "remote_rows": remote_rows,
        "dispatch_logical_GBps": n_recv * row / (d_med * 1e-3) / 1e9 if d_med else 0.0,
        "dispatch_link_GBps": remote_rows * row / (d_med * 1e-3) / 1e9 if d_med else 0.0,
        "combine_link_GBps": remote_rows * row / (c_med * 1e-3) / 1e9,
        "dispatch_vs_nccl": n_med / d_med if d_med else 0.0, "combine_vs_nccl": n_med / c_med,
        "torch_backend_dispatch_us": tb[0] if isinstance(tb, tuple) else None,
        "torch_backend_combine_us": tb[1] if isinstance(tb, tuple) else None,
        "torch_backend_note": "eager, device events" if isinstance(tb, tuple) else tb,
        "dispatch_vs_torch": tb[0] / (d_med * 1e3) if isinstance(tb, tuple) else None,
        "combine_vs_torch": tb[1] / (c_med * 1e3) if isinstance(tb, tuple) else None,
    }


def run_lowprec(T: int, hidden: int, k: int, num_experts: int, inner: int, reps: int) -> dict:
    """fp8 payload dispatch vs bf16 dispatch, and fp8_blockwise scatter combine vs bf16 gather combine,
    on the same routing; each correctness-gated."""
    rank, world = dist.get_rank(), dist.get_world_size()
    base = dict(rank=rank, world_size=world, hidden_dim=hidden, max_num_inp_token_per_rank=T,
                num_experts_per_rank=num_experts // world, num_experts_per_token=k, data_type=torch.bfloat16,
                kernel_backend="native")
    g = torch.Generator(device="cuda").manual_seed(4321 + rank)
    x = torch.randn(T, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand(T, k, device="cuda", generator=g)
    idx = torch.rand(T, num_experts, device="cuda", generator=g).topk(k, dim=1).indices.to(torch.int32)
    U = torch.zeros(T, world, device="cuda").scatter_(1, idx.long() // (num_experts // world), 1.0).sum(1)
    # per-128 fp8 payload (quantized here, outside the timed region)
    blocks = x.float().view(T, hidden // 128, 128)
    scales = (blocks.abs().amax(-1) / 448.0).clamp_min(1e-12)
    xq = (blocks / scales[..., None]).view(T, hidden).to(torch.float8_e4m3fn)
    deq = (xq.float().view(T, hidden // 128, 128) * scales[..., None]).view(T, hidden).to(torch.bfloat16)
    res = {}
    modes = {
        "bf16_gather": dict(),
        "fp8_payload_gather": dict(dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.bfloat16,
                                   scale_dim=hidden // 128, scale_type_size=4),
        "bf16_fp8_scatter": dict(quant_type="fp8_blockwise"),
    }
    for name, extra in modes.items():
        cfg = EpDispatchCombineConfig(**base, **extra)
        inp, sc = (xq, scales) if "payload" in name else (x, None)
        with EpDispatchCombineOp(cfg) as op:
            out, ow, os_, _, total, h = op.dispatch(inp, w, sc, idx, return_routing=True)
            expert = out if "payload" not in name else \
                (out.float().view(-1, hidden // 128, 128) * os_[..., None]).view(-1, hidden).to(torch.bfloat16)
            comb, _ = op.combine(expert, routing=h)
            want = U[:, None] * (deq if "payload" in name else x).float()
            err = ((comb.float() - want).norm() / want.norm().clamp_min(1e-30)).item() if T else 0.0
            if err > (0.05 if "scatter" in name else 0.0):
                raise SystemExit(f"rank {rank}: {name} check failed at T={T}: relative error {err:.3g}")
            held = {"out": expert}

            def disp():
                held["o"], _, _, _, _, held["h"] = op.dispatch(inp, w, sc, idx, return_routing=True)

            def comb():
                op.combine(held["out"], routing=held["h"])

            d_ms, c_ms = _graph_time([disp, comb], inner, reps)
            res[name] = (_stats(d_ms)[0] * 1e3, _stats(c_ms)[0] * 1e3, err)
    return {"tokens_per_rank": T, "hidden": hidden, "topk": k, "experts": num_experts, "graph": True,
            "world_size": world, "target": op_arch(), "gpu": torch.cuda.get_device_properties(0).name,
            "modes": {m: {"dispatch_us": d, "combine_us": c, "rel_err": e} for m, (d, c, e) in res.items()},
            "fp8_dispatch_over_bf16": res["fp8_payload_gather"][0] / res["bf16_gather"][0],
            "fp8_scatter_combine_over_bf16_gather": res["bf16_fp8_scatter"][1] / res["bf16_gather"][1],
            "dispatch_bytes_per_row": {"bf16": hidden * 2, "fp8": hidden + (hidden // 128) * 4}}


def op_arch() -> str:
    from .kernels import device_arch
    return device_arch(torch.device("cuda"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    p.add_argument("--hidden", type=int, nargs="+", default=[7168])
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--inner", type=int, default=20)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--torch-baseline", action="store_true", help="also time the torch reference backend (eager)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"], help="payload dtypes of the sweep")
    p.add_argument("--lowprec", action="store_true", help="also compare fp8 dispatch / fp8 scatter combine with bf16")
    p.add_argument("--lowprec-tokens", type=int, nargs="+", default=[128, 4096])
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rows = []
    for hidden in args.hidden:
        for T in args.tokens:
            for dt in args.dtypes:
                rows.append(run_point(T, hidden, args.topk, args.experts, getattr(torch, dt), args.inner, args.reps,
                                      args.torch_baseline))
    low = [run_lowprec(T, hidden, args.topk, args.experts, args.inner, args.reps)
           for hidden in args.hidden[:1] for T in args.lowprec_tokens] if args.lowprec else []
    if dist.get_rank() == 0:
        if args.out:
            with open(args.out, "a") as f:
                for r in rows + low:
                    f.write(json.dumps(r, sort_keys=True) + "\n")
        print(f"{'dtype':>8} {'tokens':>6} {'hidden':>6} {'disp us':>8} {'comb us':>8} {'staged':>8} {'nccl us':>8} {'disp x':>6} {'comb x':>6} "
              f"{'disp link GB/s':>14} {'comb link GB/s':>14} {'replay us':>9} {'blocks d/c':>10}")
        for r in rows:
            print(f"{r['dtype']:>8} {r['tokens_per_rank']:>6} {r['hidden']:>6} {r['dispatch_us']:>8.1f} {r['combine_us']:>8.1f} {r['combine_staged_us']:>8.1f} "
                  f"{r['nccl_a2a_us']:>8.1f} {r['dispatch_vs_nccl']:>6.2f} {r['combine_vs_nccl']:>6.2f} "
                  f"{r['dispatch_link_GBps']:>14.1f} {r['combine_link_GBps']:>14.1f} {r['dispatch_replay_us']:>9.1f} "
                  f"{r['dispatch_blocks']:>5}/{r['combine_blocks']:<4}")
        for r in low:
            m = r["modes"]
            print(f"T={r['tokens_per_rank']} H={r['hidden']}: dispatch bf16 {m['bf16_gather']['dispatch_us']:.1f} us, "
                  f"fp8 payload {m['fp8_payload_gather']['dispatch_us']:.1f} us (x{r['fp8_dispatch_over_bf16']:.2f}); "
                  f"combine bf16 gather {m['bf16_gather']['combine_us']:.1f} us, fp8_blockwise scatter "
                  f"{m['bf16_fp8_scatter']['combine_us']:.1f} us (x{r['fp8_scatter_combine_over_bf16_gather']:.2f})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
