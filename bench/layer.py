"""Layer-level benchmarks of bench: the layer loop, the MoE layer on three EP paths, the link's ceiling.

torchrun --nproc-per-node 2 -m bench --layer-loop [--tokens ...] [--layers 16]
torchrun --nproc-per-node 2 -m bench --layer [--layer-paths epgen a2a] [--layer-dtypes bf16 fp8]
                                              [--intermediate 2048] [--tokens ...]
torchrun --nproc-per-node 2 -m bench --layer --layer-paths a2a vdev2d --experts 32   # own process (NVSHMEM)
torchrun --nproc-per-node 2 -m bench --ceiling [--ceiling-sms 8 16 32 64 132] [--ceiling-mib 64]

Every mode writes JSON-lines records ("kind": "layer_loop" | "layer" | "ceiling") with the usual metadata
(commit, date, gpu, driver, cuda_driver_api, torch, world_size, target, sms). docs/LAYER.md describes the
method; scripts/layer_table.py prints the tables (``loop_table``, ``layer_table``, ``ceiling_table``).

Layer loop (kind "layer_loop"): L layers of dispatch -> identity expert -> combine captured in one CUDA
graph; time per layer = replay / L, the slowest rank's median over replays. Three variants on the same
rows: epgen with the expert copying the received rows into a tensor of its own (combine stages it),
epgen with the expert copying into combine_in_view(), and NCCL: all_to_all_single of the same rows, the
same copy, all_to_all_single back. Gated by bench.gate.identity_gate first.

MoE layer (kind "layer", one record per path): top-k of E experts routed by a softmax router, the experts
(two GEMMs and a SiLU-gated activation) sharded over ranks, the same weights and routing on every path:
  epgen   dispatch_grouped (bf16, or fp8_blockwise: quantized in the kernel, per-128 fp32 scales; the received
          rows' local (row, expert) pairs grouped per expert, each group padded to GROUP_ALIGN rows, by the
          generated grouped-layout kernels; fp8 rows decoded to bf16 as they are placed, grouped_dequantize)
          -> grouped GEMMs -> combine_grouped (the weighted sum per row, a
          generated kernel, into the combine buffer) -> combine. Graph-captured (L layers per graph) and eager.
  a2a     the all_to_all_single token shuffle (as torchtitan / Megatron's all-to-all dispatcher): one row
          per (token, expert) pair sorted by expert, the counts exchanged and read on the host (split
          sizes), all_to_all_single, grouped GEMMs, all_to_all_single back, weighted sum. Eager only.
          fp8: the rows quantized per 128 before the shuffle (fp8 bytes and fp32 scales in one row).
  vdev2d  torch.ops.symm_mem.all_to_all_vdev_2d (NVSHMEM, split sizes on the device) into expert-major
          segments, grouped GEMMs, all_to_all_vdev_2d_offset back. Needs the NVSHMEM symmetric-memory
          backend, chosen before any symmetric allocation: run it in a process without epgen. torch's
          op takes at most 16 experts per rank (VDEV2D_MAX_LOCAL_EXPERTS; --experts 16 x world). Any
          failure is recorded with its reason ("error").
Every path's local experts run the same grouped GEMMs (``experts_ffn``): pairs placed per expert, each
expert's group padded to a multiple of GROUP_ALIGN rows (an expert without pairs: an empty group, as the epgen
grouped layout has it, so both place the same rows), torch._grouped_mm on
sm_90 / bf16, else a loop. expert_us times exactly those GEMMs on tokens already in place (the a2a
path's placed rows, which every path's counts equal); comm_us = layer_us - expert_us (same mode: graph
minus graph, eager minus eager; a path is "graph" only when it and the expert GEMMs both captured).
Gate: each path's output against the a2a path's on the same inputs, per-token relative error <=
LAYER_TOL[dtype] (the run stops if epgen fails; a failing vdev2d is recorded).

Ceiling (kind "ceiling"): moving one buffer to the peer rank ((rank + 1) % world), both directions at
once: a copy kernel (16-byte loads and stores, 1024 threads per block, one block per SM asked for;
the blocks' distinct SMs are read back, "distinct_sms") pushing (local loads, stores to the peer's
memory) or pulling (loads from the peer, local stores) at each SM count; the copy engine
(cuMemcpyAsync through the peer mapping, as Tensor.copy_ does) both ways; NCCL all_to_all_single of the
same bytes. The buffers are the runtime's IPC workspace (runtime.ipc.allocate). GB/s = bytes one rank
moves / time (slowest rank's median). Runs last in a process (after --layer-loop / --layer).
"""

from __future__ import annotations

import ctypes
import math
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from generator.abi import LL_MAX_TOKENS

from runtime import EpDispatchCombineConfig, EpDispatchCombineOp

from .accounting import gather_counts, rows_per_destination
from .gate import GateError, identity_gate
from .inputs import QUANT_BLOCK, dequantize_rows, make_input_sets, point_config, quantize_blocks
from .measure import collective_try, eager_time, loop_time, median_us, on_gpu, stats
from .records import meta, ratio
from .tables import latest, md_cell

LOOP_TOKENS = (1, 8, 32, 128, 512, 4096, 8192)
LAYER_TOKENS = (1, 8, 32, 128, 512, 2048, 4096)
LAYER_DTYPES = ("bf16", "fp8")
LAYER_PATHS = ("epgen", "a2a", "vdev2d")
LAYER_TOL = {"bf16": 1e-2, "fp8": 3e-2}  # per-token relative error against the a2a path
CEILING_SMS = (8, 16, 32, 64, 132)
CEILING_THREADS = 1024
GROUP_ALIGN = 16  # rows per expert group: padded to a multiple (0 rows for an expert without pairs)
QBLOCK = QUANT_BLOCK


# --- (i) the layer loop --------------------------------------------------------------------------
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
            "gate": "identity gate (bench.core.identity_gate) passed"}


# --- (ii) the MoE layer --------------------------------------------------------------------------
def grouped_ok(x: torch.Tensor) -> bool:
    """torch._grouped_mm: sm_90, bf16."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) == (9, 0))


def experts_ffn(xs: torch.Tensor, offs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Rows grouped per local expert (group e = rows [offs[e-1], offs[e]), int32 ends) -> expert outputs
    [rows, H]; rows past offs[-1] unspecified. w13 [E, 2I, H], w2 [E, H, I]."""
    if grouped_ok(xs):
        gate, up = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
    out = torch.empty(xs.shape[0], w2.shape[1], dtype=xs.dtype, device=xs.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            gate, up = (xs[start:end] @ w13[e].t()).chunk(2, dim=-1)
            out[start:end] = (F.silu(gate) * up) @ w2[e].t()
        start = end
    return out


def place(e_pair: torch.Tensor, E: int, align: int = GROUP_ALIGN):
    """Slots of (row, expert) pairs in expert-major groups, each padded to a multiple of `align` rows (none
    for an expert without pairs). e_pair [P]: each pair's local expert, E = no local expert. Returns (pos [P]: the pair's
    slot, S - 1 for E; slot_pair [S]: the pair in each slot, 0 for padding; ends int32 [E]; S = P + E *
    align + 1 slots, the last a sink outside every group). Static shapes, no host sync."""
    P, dev = e_pair.numel(), e_pair.device
    S = P + E * align + 1
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, e_pair, torch.ones_like(e_pair))[:E]
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    order = torch.sort(e_pair, stable=True).indices
    se = e_pair[order]
    sec = se.clamp(max=E - 1)
    first = torch.cumsum(counts, 0) - counts  # sorted index of each expert's first pair
    slot = torch.where(se < E, (ends - padded)[sec] + torch.arange(P, device=dev) - first[sec], S - 1)
    pos = torch.empty_like(slot).scatter_(0, order, slot)
    slot_pair = torch.zeros(S, dtype=torch.int64, device=dev).scatter_(0, slot, order)
    return pos, slot_pair, ends.to(torch.int32), S


def pairs_ffn(rows: torch.Tensor, pair_row: torch.Tensor, e_pair: torch.Tensor, w13, w2):
    """Expert outputs per pair [P, H] (pairs without a local expert: unspecified), and the placed rows and
    group ends the GEMMs ran on."""
    pos, slot_pair, ends, _ = place(e_pair, w13.shape[0])
    xs = rows.index_select(0, pair_row.index_select(0, slot_pair))
    return experts_ffn(xs, ends, w13, w2).index_select(0, pos), xs, ends


def pack_rows(x: torch.Tensor, mode: str) -> torch.Tensor:
    """Rows as they cross in the a2a / vdev2d paths: bf16 as is; fp8: per-128 e4m3 bytes then the fp32
    scales, one row of H + H/32 bytes (viewed as bf16)."""
    if mode == "bf16":
        return x
    q, s = quantize_blocks(x, x.shape[1] // QBLOCK)
    return torch.cat([q.view(torch.uint8), s.view(torch.uint8)], dim=1).view(torch.bfloat16)


def unpack_rows(p: torch.Tensor, mode: str, hidden: int) -> torch.Tensor:
    if mode == "bf16":
        return p
    u = p.view(torch.uint8)
    return dequantize_rows(u[:, :hidden].view(torch.float8_e4m3fn), u[:, hidden:].contiguous().view(torch.float32),
                             torch.bfloat16)


def weighted_sum(pairs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[T * k, H] expert outputs in token-major pair order -> sum_j w[t, j] * y[t, j] (float32), bf16."""
    T, k = w.shape
    return (pairs.view(T, k, -1).float() * w[..., None]).sum(1).to(torch.bfloat16)


class Problem:
    """One point's inputs, shared by every path: tokens, router output, this rank's experts."""

    def __init__(self, T, hidden, k, experts, inter, mode, device, weights=None, seed=0):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.T, self.H, self.k, self.E, self.I, self.mode = T, hidden, k, experts, inter, mode
        self.epr = experts // self.world
        g = torch.Generator(device=device).manual_seed(seed * 7919 + self.rank)
        self.x = torch.randn(T, hidden, generator=g, device=device).to(torch.bfloat16)
        gate = (torch.randn(experts, hidden, generator=g, device=device) / hidden ** 0.5).to(torch.bfloat16)
        scores = torch.softmax((self.x @ gate.t()).float(), dim=-1).topk(k, dim=-1)
        self.w = (scores.values / scores.values.sum(-1, keepdim=True)).contiguous()
        self.idx = scores.indices.to(torch.int32).contiguous()
        self.w13, self.w2 = weights if weights is not None else make_weights(self.epr, hidden, inter, device, seed)


def make_weights(epr, hidden, inter, device, seed=0):
    """This rank's experts: w13 [E_local, 2I, H], w2 [E_local, H, I] (bf16, drawn in place)."""
    g = torch.Generator(device=device).manual_seed(10_000 + seed * 7919 + dist.get_rank())
    w13 = torch.empty(epr, 2 * inter, hidden, dtype=torch.bfloat16, device=device).normal_(generator=g)
    w2 = torch.empty(epr, hidden, inter, dtype=torch.bfloat16, device=device).normal_(generator=g)
    return w13.mul_(hidden ** -0.5), w2.mul_(inter ** -0.5)


class EpgenPath:
    name, capturable = "epgen", True

    def __init__(self, p: Problem, backend: str = "native", protocol: str = "bw", grouped_combine: str = "reduce"):
        self.p = p
        self.op = EpDispatchCombineOp(self.config(p, backend, protocol, grouped_combine))

    @staticmethod
    def config(p: Problem, backend: str = "native", protocol: str = "bw",
               grouped_combine: str = "reduce") -> EpDispatchCombineConfig:
        return EpDispatchCombineConfig(rank=p.rank, world_size=p.world, hidden_dim=p.H, max_num_inp_token_per_rank=p.T,
                                       num_experts_per_rank=p.epr, num_experts_per_token=p.k, data_type=torch.bfloat16,
                                       kernel_backend=backend, intranode_protocol=protocol,
                                       dispatch_quant_type="fp8_blockwise" if p.mode == "fp8" else "none",
                                       enable_grouped_layout=True, expert_alignment=GROUP_ALIGN,
                                       grouped_combine=grouped_combine, grouped_dequantize=p.mode == "fp8")

    def __call__(self) -> torch.Tensor:
        p, op = self.p, self.op
        layout, h = op.dispatch_grouped(p.x, p.w, None, p.idx)  # rows grouped per local expert, in generated kernels
        y = experts_ffn(layout.x, layout.offs, p.w13, p.w2)  # fp8: the rows decoded to bf16 as they were placed
        return op.combine_grouped(y, h)[0]  # weighted sum per received row (a kernel) -> combine

    def close(self):
        self.op.close()


def _count_experts(p: Problem):
    flat = p.idx.reshape(-1).long()
    counts = torch.zeros(p.E, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return flat, torch.sort(flat, stable=True).indices, counts


class A2APath:
    name, capturable = "a2a", False

    def __init__(self, p: Problem):
        self.p = p
        self.placed = None  # (rows, group ends) of the last call: the pre-placed tokens of expert_us

    def __call__(self) -> torch.Tensor:
        p = self.p
        _, order, counts = _count_experts(p)  # pairs sorted by expert, hence by destination rank
        send = pack_rows(p.x, p.mode).index_select(0, order // p.k)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)  # [source rank, local expert]
        in_s, out_s = torch.stack([counts.view(p.world, p.epr).sum(1),
                                   recv_counts.view(p.world, p.epr).sum(1)]).tolist()  # host sync: the splits
        n = sum(out_s)
        recv = torch.empty(n, send.shape[1], dtype=send.dtype, device=send.device)
        dist.all_to_all_single(recv, send, output_split_sizes=out_s, input_split_sizes=in_s)
        e_local = torch.repeat_interleave(torch.arange(p.epr, device=send.device).repeat(p.world), recv_counts,
                                          output_size=n)
        y, xs, ends = pairs_ffn(unpack_rows(recv, p.mode, p.H), torch.arange(n, device=send.device), e_local,
                                p.w13, p.w2)
        self.placed = (xs, ends)
        back = torch.empty(p.T * p.k, p.H, dtype=torch.bfloat16, device=send.device)
        dist.all_to_all_single(back, y, output_split_sizes=in_s, input_split_sizes=out_s)
        return weighted_sum(torch.empty_like(back).index_copy_(0, order, back), p.w)

    def close(self):
        pass


_SYMM: dict = {}


def _symm_buffer(name: str, shape: tuple, dtype, device, group_name: str) -> torch.Tensor:
    """A view (at offset 0) of a flat symmetric buffer kept across points (NVSHMEM heap: allocate once,
    grow when a point needs more)."""
    import torch.distributed._symmetric_memory as symm_mem

    n = 1
    for d in shape:
        n *= d
    buf = _SYMM.get(name)
    if buf is None or buf.numel() < n or buf.dtype != dtype:
        buf = _SYMM[name] = symm_mem.empty(n, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group_name)
    return buf[:n].view(shape)


VDEV2D_MAX_LOCAL_EXPERTS = 16  # torch's all_to_all_vdev_2d: experts per rank <= NUM_TILES (512 threads / 32)
VDEV2D_MAX_WORLD = 16  # all_to_all_vdev_2d_offset: world size <= NUM_TILES


def vdev2d_limits(epr: int, world: int) -> str | None:
    """Why torch's all_to_all_vdev_2d / _offset cannot run this shape (their TORCH_CHECKs), or None."""
    if epr > VDEV2D_MAX_LOCAL_EXPERTS:
        return (f"all_to_all_vdev_2d takes at most {VDEV2D_MAX_LOCAL_EXPERTS} experts per rank (torch's NUM_TILES); "
                f"this point has {epr}: run vdev2d with --experts {VDEV2D_MAX_LOCAL_EXPERTS * world} or fewer")
    if world > VDEV2D_MAX_WORLD:
        return (f"all_to_all_vdev_2d_offset takes at most {VDEV2D_MAX_WORLD} ranks (torch's NUM_TILES); "
                f"world size {world}")
    return None


class Vdev2dPath:
    name, capturable = "vdev2d", True

    def __init__(self, p: Problem):
        import torch.distributed._symmetric_memory as symm_mem

        limit = vdev2d_limits(p.epr, p.world)  # before any symmetric allocation: the op would refuse every call
        if limit:
            raise RuntimeError(limit)
        if not symm_mem.is_nvshmem_available():
            raise RuntimeError("NVSHMEM is not available to this torch (libnvshmem_host.so.3 not found)")
        self.p, dev = p, p.x.device
        self.group = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.group)
        P, C = p.T * p.k, pack_rows(p.x[:1], p.mode).shape[1]
        S = p.world * P + p.epr * GROUP_ALIGN  # every rank's pairs to this one, each expert padded
        nsplit = p.world * p.epr
        self.inp = _symm_buffer("inp", (P, C), torch.bfloat16, dev, self.group)
        self.out = _symm_buffer("out", (S, C), torch.bfloat16, dev, self.group)
        self.comb = _symm_buffer("comb", (S, p.H), torch.bfloat16, dev, self.group)
        self.back = _symm_buffer("back", (P, p.H), torch.bfloat16, dev, self.group)
        self.splits = _symm_buffer("splits", (nsplit,), torch.int64, dev, self.group)
        self.out_so = _symm_buffer("out_so", (2, nsplit), torch.int64, dev, self.group)
        self.back_so = _symm_buffer("back_so", (2, nsplit), torch.int64, dev, self.group)
        backend = symm_mem.get_backend(dev)
        if backend not in (None, "NVSHMEM"):
            raise RuntimeError(f"the symmetric-memory backend is {backend!r}, not NVSHMEM (chosen before any symmetric "
                               f"allocation: run vdev2d in a process without epgen)")

    def __call__(self) -> torch.Tensor:
        p = self.p
        _, order, counts = _count_experts(p)
        torch.index_select(pack_rows(p.x, p.mode), 0, order // p.k, out=self.inp)
        self.splits.copy_(counts)
        torch.ops.symm_mem.all_to_all_vdev_2d(self.inp, self.out, self.splits, self.out_so, self.group,
                                             major_align=GROUP_ALIGN)
        # expert-major segments (expert e from source r at out_so[1][e * W + r]); group e ends where e + 1
        # starts; the last one padded as the op pads (a multiple of GROUP_ALIGN, at least one: never empty)
        starts = self.out_so[1].view(p.epr, p.world)[:, 0]
        last = self.out_so[0].view(p.epr, p.world)[-1].sum()
        last = ((last + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN).clamp_min(GROUP_ALIGN)
        ends = torch.cat([starts[1:], (starts[-1] + last).view(1)]).to(torch.int32)
        self.comb.copy_(experts_ffn(unpack_rows(self.out, p.mode, p.H), ends, p.w13, p.w2))
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(self.comb, self.back, self.out_so, self.back_so, self.group)
        return weighted_sum(torch.empty_like(self.back).index_copy_(0, order, self.back), p.w)

    def close(self):
        pass


PATH_CLASSES = {"epgen": EpgenPath, "a2a": A2APath, "vdev2d": Vdev2dPath}


def layer_iters(T: int, base: int) -> int:
    """Fewer timed iterations at large token counts (the layer is milliseconds there)."""
    return max(5, base // 4) if T >= 2048 else base


def run_layer_point(T: int, hidden: int, k: int, experts: int, inter: int, mode: str, paths=("epgen", "a2a"),
                    graph_layers: int = 4, reps: int = 10, eager_iters: int = 20, backend: str = "native",
                    weights=None, protocols=("bw",), grouped_combines=("reduce",)) -> list[dict]:
    """One MoE-layer point, every path on the same problem; collective; one record per path, epgen once per
    intranode wire protocol in `protocols` (field intranode_protocol; "ll" only where the config allows it:
    up to LL_MAX_TOKENS tokens per rank, verbatim payloads, so not the fp8 mode's in-kernel quantization)
    and combine_grouped form in `grouped_combines` (field grouped_combine; "fused" with "bw" only);
    the a2a reference runs first: it gates the others and places the tokens of expert_us."""
    if mode not in LAYER_DTYPES:
        raise ValueError(f"mode must be one of {LAYER_DTYPES}, got {mode!r}")
    dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu")
    p = Problem(T, hidden, k, experts, inter, mode, dev, weights)
    ref_path = A2APath(p)
    ref = ref_path()
    xs, ends = ref_path.placed
    iters = layer_iters(T, eager_iters)
    expert = {"graph": None, "eager": None}
    expert_graph_error = None
    if on_gpu():  # a capture failure is recorded (and every path then reports eager times), never fatal
        ms, expert_graph_error = collective_try(lambda: loop_time(lambda: experts_ffn(xs, ends, p.w13, p.w2),
                                                                  graph_layers, reps)[0])
        if ms:
            expert["graph"] = median_us(ms)[0]
    expert["eager"] = median_us(eager_time([lambda: experts_ffn(xs, ends, p.w13, p.w2)], iters)[0])[0]
    pairs = int(ends[-1]) if ends.numel() else 0
    base = {**meta(dev), "kind": "layer", "dtype": mode, "tokens_per_rank": T, "hidden": hidden, "topk": k,
            "experts": experts, "intermediate": inter, "graph_layers": graph_layers, "graph_reps": reps,
            "eager_iters": iters, "grouped_gemm": "torch._grouped_mm" if grouped_ok(xs) else "loop over experts",
            "placed_rows": pairs, "expert_us": None, "expert_graph_us": expert["graph"],
            "expert_eager_us": expert["eager"], "expert_graph_error": expert_graph_error,
            "dispatch_mode": {"bf16": "bf16 rows", "fp8": "fp8 e4m3 rows with per-128 fp32 scales (epgen: "
                              "dispatch_quant_type=fp8_blockwise, quantized in the kernel; a2a / vdev2d: quantized "
                              "before the shuffle); experts in bf16, combine in bf16"}[mode]}
    records = []
    ll_ok = EpgenPath.config(p, backend).ll_unavailable() is None  # e.g. not above LL_MAX_TOKENS, not fp8_blockwise
    runs = [(name, proto, form) for name in paths
            for proto in ([q for q in protocols if q != "ll" or ll_ok] if name == "epgen" else [None])
            for form in ([f for f in grouped_combines if f == "reduce" or proto == "bw"] if name == "epgen" else [None])]
    for name, proto, form in runs:
        rec = dict(base, path=name, backend=backend if name == "epgen" else "torch.distributed", error=None,
                   intranode_protocol=proto, protocol=None, grouped_combine=form)
        path = ref_path if name == "a2a" else None
        if path is None:
            path, reason = collective_try(lambda: EpgenPath(p, backend, proto, form) if name == "epgen"
                                          else PATH_CLASSES[name](p))
            if reason:
                records.append(_failed(rec, reason))
                continue
        got, reason = collective_try(path)
        if name == "epgen":
            rec["backend"] = path.op.config.resolved_backend  # EPGEN_KERNEL_BACKEND may override
            rec["protocol"] = path.op.last_intranode_protocol  # what ran (None: a backend without protocols)
        if reason:
            path.close()
            records.append(_failed(rec, reason))
            continue
        err = stats([float(_rel_err(got, ref))])[0]  # the largest of every rank's worst token
        rec.update(gate_max_rel_err=err if math.isfinite(err) else None,  # strict JSON: no Infinity / NaN
                   gate_tol=LAYER_TOL[mode], gate="output vs the a2a path's, per token")
        if err > LAYER_TOL[mode]:
            path.close()
            if name == "epgen":
                raise GateError(f"layer gate failed at T={T} {mode}: epgen's output differs from the a2a path's "
                                  f"(largest per-token relative error {err:.3g} > {LAYER_TOL[mode]})")
            records.append(_failed(rec, f"gate: largest per-token relative error {err:.3g} > {LAYER_TOL[mode]}"))
            continue
        layer_graph = None
        if path.capturable and on_gpu():
            ms, reason = collective_try(lambda: loop_time(path, graph_layers, reps)[0])
            layer_graph, rec["graph_error"] = (median_us(ms) if ms else None), reason
        eager = median_us(eager_time([path], iters)[0])
        path.close()
        graph = layer_graph is not None and expert["graph"] is not None  # comm_us: graph minus graph only
        rec.update(graph=graph, graph_modes=(["graph", "eager"] if graph else ["eager"]),
                   layer_graph_us=layer_graph[0] if layer_graph else None,
                   layer_graph_p99_us=layer_graph[1] if layer_graph else None,
                   layer_eager_us=eager[0], layer_eager_p99_us=eager[1],
                   layer_us=layer_graph[0] if graph else eager[0],
                   expert_us=expert["graph"] if graph else expert["eager"])
        rec["comm_us"] = rec["layer_us"] - rec["expert_us"]
        rec["comm_eager_us"] = eager[0] - expert["eager"]
        records.append(rec)
    return records


def _failed(rec: dict, reason: str) -> dict:
    return dict(rec, error=reason, graph=False, graph_modes=[], layer_us=None, layer_graph_us=None,
                layer_eager_us=None, comm_us=None, comm_eager_us=None)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if not got.numel():
        return 0.0
    d = (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1).clamp_min(1e-30)
    return float(d.max()) if bool(torch.isfinite(got.float()).all()) else float("inf")


# --- (iii) the link's ceiling --------------------------------------------------------------------
COPY_KERNEL = r"""
// 16-byte copy, four vectors in flight per thread; block b notes the SM it ran on in smid[b]
extern "C" __global__ void __launch_bounds__(1024) epg_copy16(const int4* __restrict__ src, int4* __restrict__ dst,
                                                              long long n, int* smid) {
  if (threadIdx.x == 0) { int s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); smid[blockIdx.x] = s; }
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    int4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a; dst[i + stride] = b; dst[i + 2 * stride] = c; dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}
"""


def compile_source(arch: str, source: str, name: str = "kernel") -> bytes:
    """A bench-only kernel's code object for `arch`, built from `source` with the target's own toolchain and
    flags (specs/targets.toml; sm_90: nvcc ... sm_90a -cubin)."""
    from generator import toolchain

    from runtime.config import load_specs

    specs = load_specs()
    target = specs.targets[arch]
    tools = toolchain.find(specs.toolchains[target.toolchain])
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d) / f"{name}.cu", Path(d) / f"{name}.cubin"
        src.write_text(source)
        res = toolchain.run(toolchain.compile_command(target, tools, src, out), tools)
        if res.returncode:
            raise RuntimeError(f"{Path(tools.compiler).name} failed: {res.stderr[-2000:]}")
        return out.read_bytes()


def compile_copy_kernel(arch: str) -> bytes:
    """The copy kernel's code object for `arch` (compile_source)."""
    return compile_source(arch, COPY_KERNEL, "copy")


def _time_launches(fn, iters: int, reps: int) -> tuple[float, float]:
    """Slowest rank's median (and p99) microseconds of one fn() among `iters` back-to-back calls (bench's
    eager timing: every round after a barrier, a synchronize and a device all_reduce, so a peer's
    previous method cannot overlap; one untimed round first)."""
    ms = eager_time([lambda: [fn() for _ in range(iters)]], reps, warmup=1)[0]
    return median_us([m / iters for m in ms])


def copy_engine(nbytes: int):
    """A function (dst, src) -> None: cuMemcpyAsync of `nbytes` on torch's current stream. The addresses
    are unified: with one of them a peer's IPC mapping the driver moves the bytes over the link with a
    copy engine (what Tensor.copy_ does between device tensors, without a tensor on the peer's memory)."""
    from cuda.bindings import driver as cu

    from runtime.kernels import current_raw_stream

    def copy(dst: int, src: int) -> None:
        res = cu.cuMemcpyAsync(dst, src, nbytes, current_raw_stream())
        err = res[0] if isinstance(res, tuple) else res
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyAsync failed: {err}")
    return copy


def run_ceiling(sms_list=CEILING_SMS, mib: int = 64, iters: int = 10, reps: int = 10) -> list[dict]:
    """The link's ceiling (see the module docstring); collective; one record per (method, SM count).

    The buffers are the runtime's own IPC workspace (runtime.ipc.allocate: the default allocator of the
    ops, no torch symmetric memory in this process); each method that fails is recorded with its reason."""
    from runtime import ipc
    from runtime.kernels import CudaKernel, device_arch

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    nbytes = mib << 20
    peer, source = (rank + 1) % world, (rank - 1) % world
    torch.cuda.empty_cache()  # what earlier modes left cached goes back: the workspace is a cudaMalloc of its own
    # [A: this rank's data | B: what arrives], zeroed; handle.buffer_ptrs[r]: rank r's buffer as mapped here
    buf, handle = ipc.allocate(2 * nbytes, dev, dist.group.WORLD)
    buf[:nbytes].copy_((torch.arange(nbytes, device=dev) * 7 + rank).to(torch.uint8))
    want = ((torch.arange(nbytes, device=dev) * 7 + source).to(torch.uint8))  # what `source` pushes here
    mine, theirs = int(handle.buffer_ptrs[rank]), int(handle.buffer_ptrs[peer])
    torch.cuda.synchronize()
    dist.barrier()
    n16 = nbytes // 16
    base = {**meta(dev), "kind": "ceiling", "bytes": nbytes, "peer": "(rank + 1) % world, every rank at once",
            "buffers": "runtime.ipc workspace (cudaMalloc + CUDA IPC, peer pointers)"}
    records = []

    def rec(method, sms, us, **kw):
        records.append(dict(base, method=method, sms_used=sms, us=us[0], p99_us=us[1], GBps=nbytes / (us[0] * 1e-6) / 1e9,
                            error=None, **kw))

    def failed(method, sms, reason, **kw):
        records.append(dict(base, method=method, sms_used=sms, us=None, p99_us=None, GBps=None, error=reason, **kw))

    def arrived_ok() -> bool:  # after a push: B holds the source rank's A
        torch.cuda.synchronize()
        dist.barrier()
        ok = bool(torch.equal(buf[nbytes:], want))
        buf[nbytes:].zero_()
        torch.cuda.synchronize()
        dist.barrier()
        return ok

    kern, reason = collective_try(lambda: CudaKernel(compile_copy_kernel(device_arch(dev)), "epg_copy16"))
    if kern is not None:
        smid = torch.zeros(max(sms_list), dtype=torch.int32, device=dev)
        for sms in sms_list:
            for method, src, dst in (("sm_push", mine, theirs + nbytes), ("sm_pull", theirs, mine + nbytes)):
                def launch(src=src, dst=dst, sms=sms):  # (const int4* src, int4* dst, long long n, int* smid)
                    kern.launch(sms, CEILING_THREADS, ctypes.c_uint64(src), ctypes.c_uint64(dst), ctypes.c_int64(n16),
                                ctypes.c_uint64(smid.data_ptr()))
                us, why = collective_try(lambda: _time_launches(launch, iters, reps))
                if why:
                    failed(method, sms, why, threads=CEILING_THREADS)
                    continue
                distinct = len(set(smid[:sms].tolist()))
                ok = arrived_ok() if method == "sm_push" else None
                rec(method, sms, us, threads=CEILING_THREADS, distinct_sms=distinct, data_ok=ok)
        kern.close()
    else:
        failed("sm_push", None, reason)
    copy, reason = collective_try(lambda: copy_engine(nbytes))
    for method, dst, src, note in (("copy_engine_push", theirs + nbytes, mine, "into"),
                                   ("copy_engine_pull", mine + nbytes, theirs, "from")):
        what = f"cuMemcpyAsync {note} the peer's IPC-mapped buffer (copy engine; what Tensor.copy_ does)"
        if copy is None:
            failed(method, None, reason, note=what)
            continue
        us, why = collective_try(lambda: _time_launches(lambda: copy(dst, src), iters, reps))
        if why:
            failed(method, None, why, note=what)
        else:
            rec(method, None, us, note=what, data_ok=arrived_ok() if method == "copy_engine_push" else None)
    send = [nbytes if d == peer else 0 for d in range(world)]
    recv = [nbytes if s == source else 0 for s in range(world)]
    a2a_in, a2a_out = buf[:nbytes].clone(), torch.empty(nbytes, dtype=torch.uint8, device=dev)  # torch's allocator
    what = "all_to_all_single of the same bytes to the same peer (NCCL picks its own SMs)"
    us, why = collective_try(lambda: _time_launches(lambda: dist.all_to_all_single(a2a_out, a2a_in, recv, send),
                                                    iters, reps))
    if why:
        failed("nccl", None, why, note=what)
    else:
        rec("nccl", None, us, note=what)
    torch.cuda.synchronize()
    dist.barrier()  # no peer reads or writes this rank's buffer any more
    buf = None  # its memory is freed next
    handle.close()
    return records


# --- tables --------------------------------------------------------------------------------------
def _x(v) -> str:
    return "–" if v is None else f"{v:.2f}×"


def requested_protocol(r: dict) -> str:
    """The intranode protocol a record's epgen calls asked for ("bw" for records older than the field)."""
    return r.get("intranode_protocol") or "bw"


def layer_column(r: dict) -> str:
    """A layer record's path as tables and plots show it: epgen with the low-latency protocol is "epgen_ll",
    with the fused grouped combine (grouped_combine "fused") "epgen_fused"."""
    if r["path"] == "epgen" and requested_protocol(r) == "ll":
        return "epgen_ll"
    return "epgen_fused" if r["path"] == "epgen" and r.get("grouped_combine") == "fused" else r["path"]


def loop_table(records: list[dict]) -> list[str]:
    """Issue 19's table: per layer µs, epgen (expert -> own tensor / -> combine_in_view) with each intranode
    protocol measured, NCCL, NCCL / epgen."""
    out = ["| tokens/rank | protocol | epgen, expert → own tensor | epgen, expert → combine_in_view | NCCL "
           "| NCCL / epgen (in view) |", "|---|---|---|---|---|---|"]
    for r in latest(records, "layer_loop", lambda r: (r["tokens_per_rank"], requested_protocol(r))):
        out.append(f"| {r['tokens_per_rank']} | {requested_protocol(r)} | {md_cell(r['epgen_own_us'], '.1f')} µs "
                   f"| {md_cell(r['epgen_view_us'], '.1f')} µs | {md_cell(r['nccl_us'], '.1f')} µs "
                   f"| {_x(r.get('nccl_over_epgen_view'))} |")
    return out


def layer_table(records: list[dict]) -> list[str]:
    """Issue 17's table: per (dtype, tokens) the layer and its communication-only time on each path, and
    footnotes naming why a path has no time."""
    recs = latest(records, "layer", lambda r: (r["dtype"], r["tokens_per_rank"], layer_column(r)))
    points: dict = {}
    for r in recs:
        points.setdefault((r["dtype"], r["tokens_per_rank"]), {})[layer_column(r)] = r
    extra = {"epgen_ll": " epgen, low-latency protocol, layer µs (comm) |",
             "epgen_fused": " epgen, fused grouped combine, layer µs (comm) |"}
    columns = list(LAYER_PATHS) + [c for c in extra if any(layer_column(r) == c for r in recs)]
    head = ("| dispatch | tokens/rank | expert GEMMs µs | epgen layer µs (comm) | all_to_all_single layer µs (comm) "
            "| all_to_all_vdev_2d layer µs (comm) |" + "".join(extra[c] for c in columns if c in extra)
            + " a2a / epgen (layer) |")
    out, notes = [head, "|---" * (len(columns) + 4) + "|"], {}
    for (dtype, T) in sorted(points, key=lambda key: (LAYER_DTYPES.index(key[0]) if key[0] in LAYER_DTYPES else 9,
                                                      key[1])):
        row = points[(dtype, T)]
        any_rec = next(iter(row.values()))
        cells = []
        for path in columns:
            r = row.get(path)
            if r is None:
                cells.append("–")
            elif r.get("error"):
                notes.setdefault(r["error"], len(notes) + 1)
                cells.append(f"failed [{notes[r['error']]}]")
            else:
                mode = "" if r.get("graph") else " eager"
                cells.append(f"{md_cell(r['layer_us'], '.1f')} ({md_cell(r['comm_us'], '.1f')}){mode}")
        e, a = row.get("epgen", {}), row.get("a2a", {})
        speedup = ratio(a.get("layer_us"), e.get("layer_us"))
        gemm = any_rec.get("expert_graph_us") or any_rec.get("expert_eager_us")
        out.append(f"| {dtype} | {T} | {md_cell(gemm, '.1f')} | " + " | ".join(cells) + f" | {_x(speedup)} |")
    for reason, n in notes.items():
        out.append(f"\n[{n}] {reason}")
    return out


def ceiling_table(records: list[dict]) -> list[str]:
    out = ["| method | SMs | GB/s per direction | µs | distinct SMs |", "|---|---|---|---|---|"]
    order = {"sm_push": 0, "sm_pull": 1, "copy_engine_push": 2, "copy_engine_pull": 3, "nccl": 4}
    for r in sorted(latest(records, "ceiling", lambda r: (r["method"], r.get("sms_used") or 0)),
                    key=lambda r: (order.get(r["method"], 9), r.get("sms_used") or 0)):
        if r.get("error"):
            out.append(f"| {r['method']} | – | failed: {r['error']} | – | – |")
            continue
        out.append(f"| {r['method']} | {md_cell(r.get('sms_used'), 'd')} | {md_cell(r['GBps'], '.0f')} | {md_cell(r['us'], '.1f')} "
                   f"| {md_cell(r.get('distinct_sms'), 'd')} |")
    return out


# --- entry (bench's --layer-loop / --layer / --ceiling) ----------------------------------
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
                                        protocols=protocols, grouped_combines=getattr(args, "grouped_combine", None)
                                        or ["reduce"]))
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
