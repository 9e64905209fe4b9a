"""The layer modes of bench: ``python -m bench --layer-loop / --layer / --ceiling`` (docs/LAYER.md); ``run``
runs the ones asked for, in that order.

torchrun --nproc-per-node 2 -m bench --layer-loop [--tokens ...] [--layers 16]
torchrun --nproc-per-node 2 -m bench --layer [--layer-paths epgen a2a] [--layer-dtypes bf16 fp8]
                                              [--intermediate 2048] [--tokens ...]
torchrun --nproc-per-node 2 -m bench --layer --layer-paths a2a vdev2d --experts 32   # own process (NVSHMEM)
torchrun --nproc-per-node 2 -m bench --ceiling [--ceiling-sms 8 16 32 64 132] [--ceiling-mib 64]

Every mode writes JSON-lines records ("kind": "layer_loop" | "layer" | "ceiling") with the usual metadata
(commit, date, gpu, driver, cuda_driver_api, torch, world_size, target, sms: bench.records.meta). Each mode is a
module of its own: the layer loop (bench/layer_loop.py), the MoE layer on three EP paths (bench/moe_layer.py),
the link's ceiling (bench/ceiling.py); scripts/layer_table.py prints their tables (bench.tables:
``loop_table``, ``layer_table``, ``ceiling_table``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from generator.abi import LL_MAX_TOKENS

from .ceiling import run_ceiling
from .gate import GateError
from .layer_loop import LOOP_TOKENS, run_layer_loop
from .measure import on_gpu
from .moe_layer import LAYER_TOKENS, make_weights, run_layer_point


def run(args, emit=lambda recs: None) -> list[dict]:
    """The layer modes selected in bench's parsed arguments; collective; returns the records and
    hands each point's records to emit() as soon as they exist (a run cut short keeps what it measured)."""
    records: list[dict] = []

    def add(recs):
        records.extend(recs)
        emit(recs)

    protocols = getattr(args, "protocol", None) or ["bw"]
    if args.layer_loop:
        for T in args.tokens or LOOP_TOKENS:
            for protocol in protocols:
                if protocol == "ll" and T > LL_MAX_TOKENS:
                    continue  # the low-latency protocol carries at most LL_MAX_TOKENS tokens per rank
                add([run_layer_loop(T, args.hidden[0], args.topk, args.experts, args.layers, args.reps,
                                    protocol=protocol)])
    gate_error = None
    if args.layer:
        dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu")
        inter, hidden = args.intermediate, args.hidden[0]
        weights = make_weights(args.experts // dist.get_world_size(), hidden, inter, dev)  # once: every point's experts
        try:
            for mode in args.layer_dtypes:
                for T in args.tokens or LAYER_TOKENS:
                    add(run_layer_point(T, hidden, args.topk, args.experts, inter, mode, args.layer_paths,
                                        graph_layers=args.graph_layers, eager_iters=args.layer_iters, weights=weights,
                                        protocols=protocols))
                    if dev.type == "cuda":  # the point's graph pools back to the device: no growth across points,
                        torch.cuda.empty_cache()  # and room for the next op's workspace (cudaMalloc, outside torch)
        except GateError as e:  # raised on every rank alike: the layer points stop, the ceiling still runs
            gate_error = e
        del weights
    if args.ceiling:  # last: a sticky device error in its raw peer copies cannot cost the layer points
        add(run_ceiling(args.ceiling_sms, args.ceiling_mib))
    if gate_error is not None:
        raise gate_error
    return records
