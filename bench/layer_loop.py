"""The layer loop: ``python -m bench --layer-loop`` (one of the layer modes, bench/layer.py; docs/LAYER.md).

torchrun --nproc-per-node 2 -m bench --layer-loop [--tokens ...] [--layers 16] [--protocol ll bw]

Layer loop (kind "layer_loop"): L layers of dispatch -> identity expert -> combine captured in one CUDA
graph; time per layer = replay / L, the slowest rank's median over replays. Three variants on the same
rows: epgen with the expert copying the received rows into a tensor of its own (combine stages it),
epgen with the expert copying into combine_in_view(), and NCCL: all_to_all_single of the same rows, the
same copy, all_to_all_single back. Gated by bench.gate.identity_gate first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime import EpDispatchCombineConfig, EpDispatchCombineOp

from .accounting import gather_counts, rows_per_destination
from .gate import identity_gate
from .inputs import make_input_sets, point_config
from .measure import loop_time, median_us
from .records import meta, ratio

LOOP_TOKENS = (1, 8, 32, 128, 512, 4096, 8192)


def run_layer_loop(T: int, hidden: int = 7168, k: int = 8, experts: int = 256, layers: int = 16, reps: int = 20,
                   backend: str = "native", protocol: str = "bw") -> dict:
    """One layer-loop point (bf16) with the intranode wire protocol `protocol` (config intranode_protocol);
    collective; returns the record."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = EpDispatchCombineConfig(**point_config(rank, world, T, hidden, k, experts, torch.bfloat16, backend),
                                  intranode_protocol=protocol)
    with EpDispatchCombineOp(cfg) as op:
        dev = op.device
        s = make_input_sets(cfg, 1, seed=777 + 7919 * rank, device=dev)[0]
        x, w, idx = s["x"], s["w"], s["idx"]
        identity_gate(op, x, w, None, idx, point=f"layer loop T={T}")
        view = op.combine_in_view()
        own = torch.empty_like(view)

        def layer(dst):
            def fn():
                out, _, _, _, _, h = op.dispatch(x, w, None, idx, return_routing=True)
                dst.copy_(out)
                op.combine(dst, routing=h)
            return fn

        sent = rows_per_destination(idx, world, cfg.num_experts_per_rank)
        recv = [row[rank] for row in gather_counts(sent, dev)]
        send_x = torch.randn(sum(sent), hidden, device=dev).to(torch.bfloat16)
        got, mid = (torch.empty(sum(recv), hidden, dtype=torch.bfloat16, device=dev) for _ in range(2))
        back = torch.empty_like(send_x)

        def nccl():
            dist.all_to_all_single(got, send_x, output_split_sizes=recv, input_split_sizes=sent)
            mid.copy_(got)
            dist.all_to_all_single(back, mid, output_split_sizes=sent, input_split_sizes=recv)

        times, graph = {}, False
        for name, fn in (("epgen_own", layer(own)), ("epgen_view", layer(view)), ("nccl", nccl)):
            ms, graph = loop_time(fn, layers, reps)
            times[name] = median_us(ms)
        ran = op.last_intranode_protocol  # the protocol of the timed calls
    own_us, view_us, nccl_us = times["epgen_own"][0], times["epgen_view"][0], times["nccl"][0]
    return {**meta(dev), "kind": "layer_loop", "backend": cfg.resolved_backend, "dtype": "bfloat16",
            "tokens_per_rank": T, "hidden": hidden, "topk": k, "experts": experts, "layers": layers,
            "intranode_protocol": protocol, "protocol": ran, "graph": graph, "graph_reps": reps, "rows_sent": sum(sent), "rows_received": sum(recv),
            "epgen_own_us": own_us, "epgen_own_p99_us": times["epgen_own"][1],
            "epgen_view_us": view_us, "epgen_view_p99_us": times["epgen_view"][1],
            "nccl_us": nccl_us, "nccl_p99_us": times["nccl"][1],
            "nccl_over_epgen_view": ratio(nccl_us, view_us), "nccl_over_epgen_own": ratio(nccl_us, own_us),
            "method": f"{layers} layers of dispatch -> identity copy -> combine in one graph, replay / {layers}, "
                      f"slowest rank's median of {reps} replays; NCCL: all_to_all_single, the same copy, "
                      f"all_to_all_single back, of the same rows",
            "gate": "identity gate (bench.gate.identity_gate) passed"}
