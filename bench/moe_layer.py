"""The MoE layer on three EP paths: ``python -m bench --layer`` (one of the layer modes, bench/layer.py;
docs/LAYER.md).

torchrun --nproc-per-node 2 -m bench --layer [--layer-paths epgen a2a] [--layer-dtypes bf16 fp8]
                                              [--intermediate 2048] [--tokens ...]
torchrun --nproc-per-node 2 -m bench --layer --layer-paths a2a vdev2d --experts 32   # own process (NVSHMEM)

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
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime import EpDispatchCombineConfig, EpDispatchCombineOp

from .gate import GateError
from .inputs import QUANT_BLOCK, dequantize_rows, quantize_blocks
from .measure import collective_try, eager_time, loop_time, median_us, on_gpu, stats
from .records import meta

LAYER_TOKENS = (1, 8, 32, 128, 512, 2048, 4096)
LAYER_DTYPES = ("bf16", "fp8")
LAYER_PATHS = ("epgen", "a2a", "vdev2d")
LAYER_TOL = {"bf16": 1e-2, "fp8": 3e-2}  # per-token relative error against the a2a path
GROUP_ALIGN = 16  # rows per expert group: padded to a multiple (0 rows for an expert without pairs)
QBLOCK = QUANT_BLOCK


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

    def __init__(self, p: Problem, backend: str = "native", protocol: str = "bw"):
        self.p = p
        self.op = EpDispatchCombineOp(self.config(p, backend, protocol))

    @staticmethod
    def config(p: Problem, backend: str = "native", protocol: str = "bw") -> EpDispatchCombineConfig:
        return EpDispatchCombineConfig(rank=p.rank, world_size=p.world, hidden_dim=p.H, max_num_inp_token_per_rank=p.T,
                                       num_experts_per_rank=p.epr, num_experts_per_token=p.k, data_type=torch.bfloat16,
                                       kernel_backend=backend, intranode_protocol=protocol,
                                       dispatch_quant_type="fp8_blockwise" if p.mode == "fp8" else "none",
                                       enable_grouped_layout=True, expert_alignment=GROUP_ALIGN,
                                       grouped_dequantize=p.mode == "fp8")

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
                    weights=None, protocols=("bw",)) -> list[dict]:
    """One MoE-layer point, every path on the same problem; collective; one record per path, epgen once per
    intranode wire protocol in `protocols` (field intranode_protocol; "ll" only where the config allows it:
    up to LL_MAX_TOKENS tokens per rank, verbatim payloads, so not the fp8 mode's in-kernel quantization);
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
    runs = [(name, proto) for name in paths
            for proto in ([q for q in protocols if q != "ll" or ll_ok] if name == "epgen" else [None])]
    for name, proto in runs:
        rec = dict(base, path=name, backend=backend if name == "epgen" else "torch.distributed", error=None,
                   intranode_protocol=proto, protocol=None)
        path = ref_path if name == "a2a" else None
        if path is None:
            path, reason = collective_try(lambda: EpgenPath(p, backend, proto) if name == "epgen"
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
