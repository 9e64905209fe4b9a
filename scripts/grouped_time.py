"""What the grouped-GEMM layout's kernels cost at the layer's shape (GPU machine, one rank: world size 1,
every received pair local, so a rank at T tokens here moves what a rank of a 2-rank layer at T / 2 tokens
receives, with twice its local pairs).

    torchrun --nproc-per-node 1 scripts/grouped_time.py [--tokens 128 1024 8192] [--hidden 7168] [--iters 20]

Native op, bf16, top-8 of 128 local experts (distinct per token), the grouped buffer at its worst case.
Per point: the mean of --iters back-to-back eager calls between two CUDA events (host launch cost
included) of dispatch, grouped_layout (grouped_count + grouped_place), the grouped reduce alone
(combine_grouped's reduce pass, into the combine buffer) and combine; then combine_grouped whole (the op's
choice: one combine kernel staging the rows from the groups where it can, runtime/backends/native.py
one_kernel_legs).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from runtime import EpDispatchCombineConfig, EpDispatchCombineOp


def mean_us(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 8192])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    H, K, E = args.hidden, args.topk, args.experts
    for T in args.tokens:
        time_point(args, T, H, K, E)
    dist.destroy_process_group()


def time_point(args, T: int, H: int, K: int, E: int) -> None:
    cfg = EpDispatchCombineConfig(rank=0, world_size=1, hidden_dim=H, max_num_inp_token_per_rank=T,
                                  num_experts_per_rank=E, num_experts_per_token=K, kernel_backend="native",
                                  enable_grouped_layout=True)
    with EpDispatchCombineOp(cfg) as op:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.rand(T, K, device="cuda", generator=g)
        idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)]).to(torch.int32)
        layout, h = op.dispatch_grouped(x, w, None, idx)
        y = torch.randn(layout.rows, H, device="cuda").to(torch.bfloat16)
        view = op.grouped_out_view()
        view.copy_(y)
        times = {"dispatch": mean_us(lambda: op.dispatch(x, w, None, idx), args.iters),
                 "grouped_layout": mean_us(op.grouped_layout, args.iters)}
        times["grouped_reduce"] = mean_us(lambda: op._backend.grouped_reduce(y, True), args.iters)
        times["combine"] = mean_us(lambda: op.combine(op.combine_in_view(), routing=h), args.iters)
        _, h = op.dispatch_grouped(x, w, None, idx)  # combine_grouped takes the last grouped dispatch
        times["combine_grouped"] = mean_us(lambda: op.combine_grouped(view, h), args.iters)
        print(f"T={T}: pairs {T * K}, grouped rows {int(layout.offs[-1])} of {layout.rows}: "
              + ", ".join(f"{name} {us:.1f} us" for name, us in times.items()), flush=True)


if __name__ == "__main__":
    main()
