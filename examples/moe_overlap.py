"""The MoE block of examples/moe_layer.py run as two micro-batches with overlap (split-phase legs, two operations
in flight on one op): one micro-batch's expert GEMMs run while the other's rows travel.

    torchrun --nproc-per-node 2 examples/moe_overlap.py                      # GPUs: NCCL + the generated kernels
    torchrun --nproc-per-node 2 examples/moe_overlap.py --hidden 512 --experts 16 --intermediate 128   # CPU: gloo
    torchrun --nproc-per-node 2 examples/moe_overlap.py --graph              # GPUs: the two-batch layer in a CUDA graph

The op is built with max_inflight=2 (a workspace slot per micro-batch). The schedule (runtime/pending.py,
docs/LAYER.md "Overlap"), communication on its own stream, ordered by events:

    A.dispatch send, B.dispatch send                      (comm stream: the rows leave; nothing waits)
    A.dispatch receive -> A's GEMMs                      (compute stream) | B.dispatch receive (comm)
    A.combine send after A's GEMMs                        (comm)           | B's GEMMs (compute)
    B.combine send after B's GEMMs, A/B.combine receive  (comm) -> the caller's stream waits for them

On CPU (torch backend, gloo) the same calls run their halves in order. The output is checked against the dense
reference (tests/support/moe_layer_ref.py's tolerance) and, bit for bit, against the same micro-batches run one
at a time through the one-call form.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _load_layer():
    """examples/moe_layer.py (the block, its router, experts and dense check)."""
    spec = importlib.util.spec_from_file_location("moe_layer_example", Path(__file__).with_name("moe_layer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


layer = _load_layer()


def _mark():
    """An event on the current CUDA stream (None on CPU)."""
    if not torch.cuda.is_available():
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


def overlapped_forward(block, x: torch.Tensor, comm: torch.cuda.Stream | None = None) -> torch.Tensor:
    """block's layer on x as two micro-batches (the first half of the tokens, then the rest), overlapped;
    -> [T, H], the micro-batches' outputs in token order. comm: the communication stream (None: the current one)."""
    op, k = block.op, block.k
    half = (x.shape[0] + 1) // 2
    mb = [x[:half], x[half:]]
    routed = [layer.route(xi, block.gate, k) for xi in mb]  # (weights, ids) per micro-batch
    order = {"stream": comm} if comm is not None else {}
    # both dispatches leave at once: two operations in flight, a workspace slot each
    sends = [op.dispatch_grouped_send(xi, w, None, ids, **order, previous_event=_mark()) for xi, (w, ids) in
             zip(mb, routed)]
    layout_a, h_a = sends[0].receive()
    sends[0].current_stream_wait()
    y_a = layer.experts_grouped(layout_a.x, layout_a.offs, block.w13, block.w2)  # A's GEMMs ...
    layout_b, h_b = sends[1].receive()  # ... while B's rows arrive (comm stream)
    comb_a = op.combine_grouped_send(y_a, h_a, **order, previous_event=_mark())  # A's rows go back ...
    sends[1].current_stream_wait()
    y_b = layer.experts_grouped(layout_b.x, layout_b.offs, block.w13, block.w2)  # ... during B's GEMMs
    comb_b = op.combine_grouped_send(y_b, h_b, **order, previous_event=_mark())
    out_a, _ = comb_a.receive()
    out_b, _ = comb_b.receive()
    comb_a.current_stream_wait()
    comb_b.current_stream_wait()
    return torch.cat([out_a, out_b])


def sequential_forward(block, x: torch.Tensor) -> torch.Tensor:
    """The same micro-batches one at a time through the one-call form (block.forward)."""
    half = (x.shape[0] + 1) // 2
    return torch.cat([block(x[:half]), block(x[half:])])


def build(hidden=7168, experts=256, topk=8, inter=2048, tokens=128, capacity=0, seed=0, device=None):
    """The rank's MoEBlock with an op for two micro-batches of up to ceil(tokens / 2) tokens in flight."""
    return layer.build(hidden, experts, topk, inter, (tokens + 1) // 2, capacity, seed, device, max_inflight=2)


def main() -> int:
    p = argparse.ArgumentParser(description="examples/moe_layer.py's MoE block as two overlapped micro-batches")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank (two micro-batches)")
    p.add_argument("--capacity", type=int, default=0, help="rows of the grouped layout, a multiple of 16 (0: worst case)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--graph", action="store_true", help="GPUs: capture the two-batch layer in one CUDA graph")
    args = p.parse_args()
    try:
        layer.experts_per_rank(args.experts, int(os.environ.get("WORLD_SIZE", 1)))
    except ValueError as e:
        p.error(str(e))
    on_gpu = torch.cuda.is_available()
    if args.graph and not on_gpu:
        p.error("--graph needs GPUs")
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    block = build(args.hidden, args.experts, args.topk, args.intermediate, args.tokens, args.capacity)
    dev = block.gate.device
    g = torch.Generator(device=dev).manual_seed(dist.get_rank())
    x = torch.randn(args.tokens, args.hidden, generator=g, device=dev).to(torch.bfloat16)
    comm = torch.cuda.Stream() if on_gpu else None
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    with block.op:
        want = sequential_forward(block, x)
        y = overlapped_forward(block, x, comm)  # warm-up
        run = lambda: overlapped_forward(block, x, comm)  # noqa: E731
        if args.graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                overlapped_forward(block, x, comm)  # warm-up off the capture stream
            torch.cuda.current_stream().wait_stream(side)
            sync()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y_graph = overlapped_forward(block, x, comm)
            run = lambda: (graph.replay(), y_graph)[1]  # noqa: E731
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            y = run()
        sync()
        ms = (time.perf_counter() - t0) * 1e3 / args.iters
        same = torch.equal(y, want)
        err = layer.dense_error(x, y, block, args.hidden, args.intermediate)
    rank, world = dist.get_rank(), dist.get_world_size()
    lines = [None] * world
    dist.all_gather_object(lines, (err, same, f"rank {rank}: {args.tokens} tokens as 2 micro-batches x hidden "
                                              f"{args.hidden}: {ms:.2f} ms per layer ({'graph' if args.graph else 'eager'}), "
                                              f"largest per-token relative error vs the dense layer {err:.2e}, "
                                              f"{'the same bits as' if same else 'DIFFERENT from'} the one-call form"))
    worst, all_same = max(e for e, _, _ in lines), all(s for _, s, _ in lines)
    ok = worst <= layer.TOLERANCE and all_same
    if rank == 0:
        print("\n".join(line for *_, line in lines))
        print(f"{'OK' if ok else 'MISMATCH'}: the overlapped EP layer on {world} rank(s) "
              f"{'matches' if ok else 'differs from'} its dense reference (largest per-token relative error {worst:.2e}, "
              f"tolerance {layer.TOLERANCE:g}) and the one-call form")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
