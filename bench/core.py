"""EP benchmark: native dispatch / combine vs NCCL all_to_all_single of the same rows, graph replay and eager.

torchrun --nproc-per-node 2 -m bench [--tokens 128 4096] [--hidden 7168] [--dtypes bfloat16 float8_e4m3fn]
                                             [--inner 20] [--reps 30] [--eager-iters 50] [--input-sets 0]
                                             [--torch-baseline] [--lowprec] [--out results.jsonl]
                                             [--internode v2 v2_ll auto] [--gpu-per-node G] [--emulate-nodes]
                                             [--launch-blocks B ...] [--launch-threads N ...] [--profile]
                                             [--combine-mode gather scatter]
                                             [--topk 8] [--experts 256] [--lowprec-tokens 128 4096]
                                             [--routing uniform|remote] [--protocol auto ll bw]

With --internode every point also runs internode (gpu_per_node G, default half the world) with each
kernel named, gated and timed the same way (records: topology, gpu_per_node, internode_kernel,
internode_route); --emulate-nodes sets EPGEN_EMULATE_NODES=1 so one host can stand for the nodes.
--protocol runs every intranode point with each intranode wire protocol named (config intranode_protocol:
"bw" bandwidth, the bench default; "ll" low latency; "auto" one per op by the point's token bound; "ll" points above its token
limit are skipped); the records say which one ran (field protocol) and what was asked (intranode_protocol).

--launch-blocks / --launch-threads override the tuning table for every point (config launch_blocks /
launch_threads; the records' dispatch_blocks ... combine_threads show what ran); given several values, every
point runs at each (blocks, threads) pair: the same kernels on a given number of SMs (the link's ceiling at
those SM counts: --ceiling). --combine-mode runs every intranode point with each combine named (config
combine_mode: "gather", the default, each origin reads its rows from the peers; "scatter", each rank pushes
its expert output to the origins; record field combine_mode; "ll" points take the gather only). --profile adds, per
point, the device time of every kernel and collective of a few eager dispatch -> expert -> combine
rounds (torch.profiler; record field "profile", printed by rank 0): where a leg's time goes.
The records say how the eager dispatch checked expert ids (EPGEN_CHECK_EXPERT_IDS: "async" by default,
"sync" costs a device sync per call, "off"): field "expert_id_check".

Per point (tokens per rank x hidden x dtype):

1. Build the op. bfloat16 / float32: a plain payload (data_type = the dtype). float8_e4m3fn: a
   pre-quantized payload, 1 byte per element with one float32 scale per 128 elements
   (dispatch_data_type=float8_e4m3fn, combine_data_type=bfloat16, scale_dim=hidden//128,
   scale_type_size=4; quantized outside the timed region by ``quantize_blocks``).
2. Input sets: ``--input-sets`` (0: enough that their bytes are at least twice the L2 cache, 2..32)
   pre-generated (x, weights, scales, indices), used in turn by the timed dispatches so caches do not
   flatter. Each set has its own payload and weights; its routing (k distinct experts per token,
   uniform over all experts, or with --routing remote over the other ranks' only) is a token permutation of one routing, so every set moves exactly the same rows per
   (source, destination) rank and the byte accounting below holds for every timed iteration.
3. Correctness gate (``identity_gate``), on every input set before any timing: dispatch -> identity
   expert -> combine must give U*x exactly (U = distinct destination ranks of the token; fp8: U times
   the dequantized input), total_recv must equal the rows addressed to the rank, and the received rows
   (payload, scales) must hold exactly those rows (an order-free bitwise checksum). A failure raises
   ``GateError`` on every rank (the run fails).
4. Timing, each leg (dispatch, expert, combine) on its own, plus the whole round as one leg (round_us), device events, the slowest rank's median and p99
   (``_stats``):
   graph: ``_graph_time``: max(--inner, input sets) iterations captured in one CUDA graph, events
       recorded inside the graph, --reps replays (the first iteration of each replay absorbs the
       ranks' start skew and is dropped);
   eager: ``_eager_time``: --eager-iters iterations (after 2 warm-up ones), each after a dist.barrier
       and a device synchronize, events recorded around each call (launch and host work included;
       with few iterations the p99 is close to the maximum).
   The graph is the headline: the unprefixed time fields are graph replays ("graph": true), their
   eager twins carry the prefix ``eager_``; one JSON line per point holds both modes
   ("graph_modes": ["graph", "eager"]). Without graph capture (the torch backend, or a CPU process
   group: the CPU smoke test) the graph fields are null, "graph" is false and "graph_modes" is
   ["eager"]; CPU times are host wall clock.
5. Baselines: ``dist.all_to_all_single`` (NCCL) of exactly the rows dispatch moves (the rank's rows
   per destination as split sizes, dispatch row bytes; nccl_a2a_us) and of the rows combine moves
   back (the transposed splits, combine row bytes; nccl_a2a_combine_us), timed in both modes. Ratios
   *_vs_nccl = NCCL time / our time (> 1: faster than NCCL); combine is compared with the combine-way
   all-to-all (for bf16 both move the same bytes). Optionally the torch reference backend, eager
   (--torch-baseline; *_vs_torch compare it with the graph times, as before).

Accounting (``accounting``, ``bandwidths``; from the writing rank's view, rank 0; "rows_matrix" has
every rank's rows so any other view can be derived). A row is one (token, destination rank) pair: a
token whose several top-k experts live on one rank sends that rank one row; ids < 0 send nothing.
Row bytes are the payload (+ scales) as they cross: bf16 hidden*2; fp8 payload hidden + hidden/128*4
for dispatch and hidden*2 (bf16) for combine; weights, indices and signals are not counted.
  dispatch logical = rows this rank receives (sum over source ranks, its own included) x dispatch row bytes
  dispatch link    = rows this rank sends to other ranks (remote_rows) x dispatch row bytes
  combine logical  = rows that come back to this rank's tokens (one per row it sent) x combine row bytes
  combine link     = those that come back from other ranks (remote_rows) x combine row bytes
each divided by the leg's slowest-rank median time (GB/s = 1e9 bytes/s).

JSON fields (one line per point; run_lowprec adds lines of its own, with a "modes" dict):
  metadata: commit, date, backend, target, gpu, driver (nvidia-smi), cuda_driver_api, torch, world_size,
    dtype, combine_dtype, quant ("none" | "payload_block128_fp32_scales"), scale_dim, tokens_per_rank,
    hidden, topk, experts, routing, graph, graph_modes, input_sets, graph_iters, graph_reps, eager_iters, gate,
    sms, dispatch_blocks, combine_blocks, dispatch_threads, combine_threads (the launch geometry: SMs used),
    launch_override ({"launch_blocks": B, "launch_threads": N, "combine_threads": C} as given by --launch-blocks /
    --launch-threads / --combine-threads,
    null: the tuning table's geometry; the sweep table (docs/BENCH.md) leaves such points out),
    expert_id_check ("async" | "sync" | "off", see runtime.backends.native.id_check_mode), profile (--profile:
    [{name, calls, us_per_round}] per kernel, or null)
  graph times (us): dispatch_us, dispatch_p99_us, combine_us, combine_p99_us, dispatch_combine_us,
    dispatch_replay_us (+ _note), combine_staged_us (+ combine_input), expert_us (the identity expert's
    leg), round_us (+ _note: the three legs as one, no timing events between the kernels)
  eager times (us): eager_dispatch_us, eager_dispatch_p99_us, eager_combine_us, eager_combine_p99_us,
    eager_dispatch_host_us, eager_combine_host_us (host time of the call, slowest rank's median; GPU only)
  accounting: rows_matrix (rows_matrix[s][d]: rows rank s sends to rank d), sent_rows, local_rows,
    remote_rows, recv_rows, recv_remote_rows, dispatch_row_bytes, combine_row_bytes,
    dispatch_logical_bytes, dispatch_link_bytes, combine_logical_bytes, combine_link_bytes
  bandwidths (GB/s): {,eager_}{dispatch,combine}_{logical,link}_GBps
  baselines: nccl_a2a_us, nccl_a2a_p99_us, nccl_a2a_combine_us, nccl_a2a_eager_us,
    nccl_a2a_combine_eager_us, dispatch_vs_nccl, combine_vs_nccl, eager_dispatch_vs_nccl,
    eager_combine_vs_nccl, torch_backend_dispatch_us, torch_backend_combine_us, torch_backend_note,
    dispatch_vs_torch, combine_vs_torch
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time

import torch
import torch.distributed as dist


from runtime import EpDispatchCombineConfig, EpDispatchCombineOp, workspace
from runtime.backends.common import id_check_mode

FP8_PAYLOADS = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
QUANT_BLOCK = 128  # elements per float32 scale of the fp8 payload points
MAX_INPUT_SETS = 32
EAGER_WARMUP = 2


# --- accounting (pure) ---------------------------------------------------------------------------
def destination_mask(indices: torch.Tensor, world_size: int, experts_per_rank: int) -> torch.Tensor:
    """bool [T, world_size]: token t sends rank d a row (one of its ids e >= 0 has e // experts_per_rank == d).

    Ids < 0 mean no expert; an id >= world_size * experts_per_rank is a ValueError.
    """
    if indices.dim() != 2:
        raise ValueError(f"indices must be [tokens, k], got shape {list(indices.shape)}")
    idx = indices.long()
    if idx.numel() and int(idx.max()) >= world_size * experts_per_rank:
        raise ValueError(f"expert id {int(idx.max())} >= {world_size * experts_per_rank} experts")
    dest = torch.where(idx >= 0, idx.div(experts_per_rank, rounding_mode="floor"), world_size)
    mask = torch.zeros(idx.shape[0], world_size + 1, dtype=torch.bool, device=idx.device)
    return mask.scatter_(1, dest, True)[:, :world_size]


def rows_per_destination(indices: torch.Tensor, world_size: int, experts_per_rank: int) -> list[int]:
    """Rows a rank sends to each destination rank: one per (token, distinct destination rank)."""
    return [int(v) for v in destination_mask(indices, world_size, experts_per_rank).sum(0).tolist()]


def accounting(indices: torch.Tensor, rank: int, world_size: int, experts_per_rank: int, row_bytes: int,
               recv_per_source: list[int], combine_row_bytes: int | None = None) -> dict:
    """Rows and bytes one rank's dispatch and combine move (see the module docstring).

    indices: this rank's [T, k] expert ids. recv_per_source[s]: rows this rank receives from rank s,
    i.e. rows_per_destination(rank s's indices)[rank] (the benchmark all-gathers every rank's counts);
    entry `rank` must equal this rank's own rows to itself. row_bytes: bytes of one dispatched row
    (payload + scales); combine_row_bytes: of one combined row (default row_bytes).
    """
    sent = rows_per_destination(indices, world_size, experts_per_rank)
    recv = [int(v) for v in recv_per_source]
    if len(recv) != world_size:
        raise ValueError(f"recv_per_source has {len(recv)} entries, world_size is {world_size}")
    if recv[rank] != sent[rank]:
        raise ValueError(f"recv_per_source[{rank}]={recv[rank]}, but this rank sends itself {sent[rank]} rows")
    crow = row_bytes if combine_row_bytes is None else combine_row_bytes
    sent_rows, local = sum(sent), sent[rank]
    remote = sent_rows - local
    recv_rows = sum(recv)
    return {
        "sent_per_dest": sent, "recv_per_source": recv,
        "sent_rows": sent_rows, "local_rows": local, "remote_rows": remote,
        "recv_rows": recv_rows, "recv_remote_rows": recv_rows - recv[rank],
        "dispatch_row_bytes": row_bytes, "combine_row_bytes": crow,
        "dispatch_logical_bytes": recv_rows * row_bytes, "dispatch_link_bytes": remote * row_bytes,
        "combine_logical_bytes": sent_rows * crow, "combine_link_bytes": remote * crow,
    }


def _gbps(nbytes: int, seconds: float | None) -> float | None:
    if seconds is None:
        return None
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def bandwidths(acc: dict, dispatch_s: float | None, combine_s: float | None) -> dict:
    """GB/s (1e9 bytes/s) of an ``accounting`` dict over the legs' times in seconds (None: not measured
    -> None; a time <= 0 -> 0.0)."""
    return {
        "dispatch_logical_GBps": _gbps(acc["dispatch_logical_bytes"], dispatch_s),
        "dispatch_link_GBps": _gbps(acc["dispatch_link_bytes"], dispatch_s),
        "combine_logical_GBps": _gbps(acc["combine_logical_bytes"], combine_s),
        "combine_link_GBps": _gbps(acc["combine_link_bytes"], combine_s),
    }


def row_bytes(cfg: EpDispatchCombineConfig) -> tuple[int, int]:
    """(dispatch, combine) bytes of one row as it crosses: payload + scales (weights, indices not counted)."""
    H = cfg.hidden_dim
    dq, cq = cfg.dispatch_quant_type, cfg.quant_type
    if dq == "fp8_blockwise":
        d = H + (H // 128) * 4
    elif dq == "fp4_blockwise":
        d = H // 2 + H // 32
    else:  # plain, or a pre-quantized payload (fp4: cols = H/2, one byte each) with its scales
        d = cfg.dispatch_payload_cols * cfg.dispatch_dtype.itemsize + cfg.scale_dim * cfg.scale_type_size
    if cfg.resolved_combine_mode == "scatter" and cq != "none":
        c = {"fp8_direct_cast": H, "fp8_blockwise": H + (H // 128) * 4, "fp4_blockwise": H // 2 + H // 32}[cq]
    else:
        c = H * cfg.combine_dtype.itemsize
    return d, c


# --- payload helpers ---------------------------------------------------------------------------
def quantize_blocks(x: torch.Tensor, scale_dim: int, dtype=torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (fp8 [T, H], float32 scales [T, scale_dim]): one scale per H/scale_dim elements, amax/fp8 max."""
    T, H = x.shape
    blocks = x.float().view(T, scale_dim, H // scale_dim)
    scales = (blocks.abs().amax(-1) / torch.finfo(dtype).max).clamp_min(1e-12)
    return (blocks / scales[..., None]).view(T, H).to(dtype), scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 rows [R, H] and float32 scales [R, s] -> [R, H] dtype: q * scale per block of H/s, in float32."""
    R, H = q.shape
    s = scales.shape[1]
    return (q.float().view(R, s, H // s) * scales.float()[..., None]).view(R, H).to(dtype)


def identity_expert(out: torch.Tensor, out_scales: torch.Tensor | None, dst: torch.Tensor) -> None:
    """The identity expert: dispatch's received rows into the combine input `dst` (in place); a
    pre-quantized payload is dequantized with its received scales."""
    if out_scales is None:
        dst.copy_(out)
    else:
        dst.copy_(dequantize_rows(out, out_scales, dst.dtype))


def identity_expected(ref: torch.Tensor, indices: torch.Tensor, world_size: int, experts_per_rank: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """What combine(identity(dispatch(x))) must return: 0.0 + ref + ref + ... (U[t] times, float32, one
    addition at a time, as the backends add a token's rows) rounded once to dtype; U[t] = distinct
    destination ranks of token t (0 when all its ids are < 0)."""
    U = destination_mask(indices, world_size, experts_per_rank).sum(1)
    xf = ref.float()
    acc = torch.zeros_like(xf)
    for u in range(1, world_size + 1):
        acc = torch.where((U >= u)[:, None], acc + xf, acc)
    return acc.to(dtype)


# --- correctness gate ----------------------------------------------------------------------------
class GateError(RuntimeError):
    """The identity check of a benchmark point failed (raised on every rank alike).

    rank: the rank that raised; point: the point's label; per rank r: wrong_rows[r], its combined token
    rows that differ from U*x; recv_rows[r] / expected_recv_rows[r], its total_recv and the rows
    addressed to it; bad_checksum_columns[r], columns whose checksum over its received rows (payload,
    then scales) differs from that of the rows addressed to it."""

    def __init__(self, message: str, rank: int = -1, point: str = "", wrong_rows=(), recv_rows=(),
                 expected_recv_rows=(), bad_checksum_columns=()):
        super().__init__(message)
        self.rank, self.point = rank, point
        self.wrong_rows, self.recv_rows = list(wrong_rows), list(recv_rows)
        self.expected_recv_rows, self.bad_checksum_columns = list(expected_recv_rows), list(bad_checksum_columns)


def _check_gate_mode(cfg: EpDispatchCombineConfig) -> None:
    if cfg.dispatch_quant_type != "none" or cfg.quant_type != "none":
        raise ValueError(f"identity_gate: in-kernel quantization (dispatch_quant_type={cfg.dispatch_quant_type!r}, "
                         f"quant_type={cfg.quant_type!r}) is lossy; the gate checks plain and pre-quantized fp8 "
                         f"payloads, which are exact")
    if cfg.prequantized and (cfg.dispatch_dtype not in FP8_PAYLOADS or cfg.scale_type_size != 4
                             or cfg.hidden_dim % cfg.scale_dim):
        raise ValueError(f"identity_gate: a {cfg.dispatch_dtype} payload with scale_type_size={cfg.scale_type_size}, "
                         f"scale_dim={cfg.scale_dim}: only fp8 payloads with float32 block scales are checked")


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def row_checksum(parts: list[torch.Tensor], rows: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [sum of columns]: per column, the sum of the rows' bit patterns (as integers) of each part
    ([R, c] tensors, concatenated). Exact and independent of row order: a row moved verbatim leaves it
    unchanged, a single flipped bit changes it. rows: a bool mask of the rows to take (None: all)."""
    sums = []
    for p in parts:
        bits = p.contiguous().view(_INT_OF_SIZE[p.element_size()]).to(torch.int64)
        sums.append((bits if rows is None else bits[rows]).sum(0))
    return torch.cat(sums)


def identity_gate(op: EpDispatchCombineOp, x, w, scales, idx, corrupt=None, point: str = "") -> int:
    """Collective: dispatch -> identity expert (into combine_in_view) -> combine, checked on every rank.

    Each rank checks (and every rank learns every rank's result through one all_reduce):
      * total_recv == the rows addressed to it (one per (source token, this rank); so a receive cap
        that drops rows fails);
      * its received rows [:total_recv] (payload, and scales for an fp8 payload) hold exactly the rows
        addressed to it: ``row_checksum`` of them == the sum over source ranks of the checksum of the
        rows each addresses to it (catches a single flipped bit that the combine's rounding could hide);
      * combine's result == ``identity_expected`` exactly: U*x, x dequantized with `scales` for an fp8
        payload (U = distinct destination ranks of the token).
    `corrupt(out, total_recv)`, if given, runs on dispatch's received rows tensor before the checks and
    the expert (fault injection for tests). Raises GateError on every rank when any rank is wrong
    (naming the point, each failing rank and its count of wrong rows); returns this rank's total_recv.
    Tensors follow the op's device (CPU for the torch backend over gloo, the GPU otherwise).
    """
    cfg = op.config
    _check_gate_mode(cfg)
    world, rank, epr = cfg.world_size, cfg.rank, cfg.num_experts_per_rank
    dev = op.device
    out, _, out_scales, _, total, handle = op.dispatch(x, w, scales, idx, return_routing=True)
    n = int(total.reshape(-1)[0].item())
    if corrupt is not None:
        corrupt(out, n)
    got_sum = row_checksum([out[:n]] + ([out_scales[:n]] if scales is not None else []))
    view = op.combine_in_view()
    identity_expert(out, out_scales, view)
    combined, _ = op.combine(view, routing=handle)
    ref = x if scales is None else dequantize_rows(x, scales, cfg.combine_dtype)
    want = identity_expected(ref, idx, world, epr, cfg.combine_dtype)
    T = x.shape[0]
    if combined.shape == want.shape:
        bad = (combined != want).any(1) if T else torch.zeros(0, dtype=torch.bool, device=dev)
    else:
        bad = torch.ones(T, dtype=torch.bool, device=dev)
    wrong = int(bad.sum())
    first = int(bad.nonzero()[0, 0]) if wrong else -1

    # one all_reduce (sum) over [checksums addressed to each rank | rows addressed to each rank |
    # each rank's (wrong rows, total_recv, first wrong token, tokens) | each rank's received checksum]
    mask = destination_mask(idx, world, epr)
    parts = [x] + ([scales] if scales is not None else [])
    C = got_sum.numel()
    buf = torch.zeros(world * C + world + 4 * world + world * C, dtype=torch.int64, device=dev)
    sent_sums, counts, status, recv_sums = buf.split([world * C, world, 4 * world, world * C])
    for d in range(world):
        sent_sums[d * C:(d + 1) * C] = row_checksum(parts, mask[:, d])
    counts.copy_(mask.sum(0))
    status[4 * rank:4 * rank + 4] = torch.tensor([wrong, n, first, T], dtype=torch.int64, device=dev)
    recv_sums[rank * C:(rank + 1) * C] = got_sum
    if world > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(buf, group=getattr(op._backend, "group", None))
    expected = counts.tolist()
    st = status.view(world, 4).tolist()
    bad_cols = (sent_sums != recv_sums).view(world, C).sum(1).tolist()
    problems = []
    for r, (wr, got, fst, tok) in enumerate(st):
        if got != expected[r]:
            problems.append(f"rank {r}: total_recv {got} != {expected[r]} rows addressed to it")
        if bad_cols[r]:
            problems.append(f"rank {r}: its received rows differ from the rows addressed to it (checksums of "
                            f"{bad_cols[r]} of {C} columns)")
        if wr:
            problems.append(f"rank {r}: {wr} of {tok} combined rows != U*x (first: token {fst})")
    if problems:
        where = f" at {point}" if point else ""
        raise GateError(f"identity gate failed{where} (raised on rank {rank}): " + "; ".join(problems),
                        rank=rank, point=point, wrong_rows=[s[0] for s in st], recv_rows=[s[1] for s in st],
                        expected_recv_rows=expected, bad_checksum_columns=bad_cols)
    return n


# --- timing --------------------------------------------------------------------------------------
def _on_gpu() -> bool:
    """Does the default process group run on GPUs (NCCL)? Decides events vs host clock and where _stats reduces."""
    return dist.is_initialized() and "nccl" in str(dist.get_backend()).lower()


def warm_on_side_stream(fn) -> None:
    """Run fn once on a side stream and wait for it (before a graph capture: lazy setup stays out of the graph)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def _graph_time(legs, inner: int, reps: int) -> list[list[float]]:
    """Per-leg milliseconds of `legs` (callables run in order), captured `inner` times in one graph.

    Each leg is bracketed by timing events recorded inside the graph (external events), so every leg
    is timed on its own, without launch gaps. Returns one list of samples per leg.
    """
    warm_on_side_stream(lambda: [leg() for leg in legs])
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


def _eager_time(legs, iters: int, warmup: int = EAGER_WARMUP, host: list | None = None) -> list[list[float]]:
    """Per-leg milliseconds of `legs` run eagerly in order, `iters` times after `warmup` untimed rounds.

    Every round starts after a dist.barrier and a device synchronize; on GPUs a one-element all_reduce
    on the stream then lines the GPUs up, and each leg is bracketed by device events (host launch work
    included: this is the eager cost), on a CPU process group by the host clock. Returns one list of samples per leg.
    `host`, if given, receives per leg the host milliseconds each call took to return (GPU runs): an eager
    leg slower than its graph replay and its host time is waiting on the peer (the ranks' host skew).
    """
    gpu = _on_gpu()
    out: list[list[float]] = [[] for _ in legs]
    if host is not None and gpu:
        host[:] = [[] for _ in legs]
    align = torch.zeros(1, device="cuda") if gpu else None
    for it in range(warmup + iters):
        dist.barrier()
        if gpu:
            torch.cuda.synchronize()
            # the ranks leave the host barrier at different times; a device-side collective right before
            # the first event starts every GPU's timed region together (else the first leg absorbs the skew)
            dist.all_reduce(align)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(legs) + 1)]
            ev[0].record()
            hs = []
            for leg, end in zip(legs, ev[1:]):
                h0 = time.perf_counter()
                leg()
                hs.append((time.perf_counter() - h0) * 1e3)
                end.record()
            torch.cuda.synchronize()
            ms = [ev[i].elapsed_time(ev[i + 1]) for i in range(len(legs))]
            if host is not None and it >= warmup:
                for i, v in enumerate(hs):
                    host[i].append(v)
        else:
            stamps = [time.perf_counter()]
            for leg in legs:
                leg()
                stamps.append(time.perf_counter())
            ms = [(stamps[i + 1] - stamps[i]) * 1e3 for i in range(len(legs))]
        if it >= warmup:
            for i, v in enumerate(ms):
                out[i].append(v)
    return out


PROFILE_ROUNDS = 5


def _profile(legs, rounds: int = PROFILE_ROUNDS) -> list[dict]:
    """Device time per kernel / collective over `rounds` eager rounds of `legs` (torch.profiler), largest
    first: [{"name", "calls", "us_per_round"}]. This rank's view."""
    from torch.profiler import ProfilerActivity, profile
    for leg in legs:  # warm
        leg()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(rounds):
            for leg in legs:
                leg()
        torch.cuda.synchronize()
    rows = []
    for e in p.key_averages():
        dev_us = getattr(e, "device_time_total", None)
        if dev_us is None:
            dev_us = e.cuda_time_total
        if dev_us > 0:
            rows.append({"name": e.key[:90], "calls": e.count // rounds, "us_per_round": dev_us / rounds})
    return sorted(rows, key=lambda r: -r["us_per_round"])


def format_profile(rec: dict, top: int = 12) -> list[str]:
    """Rank 0's kernel table of a profiled point."""
    what = f"{rec['dtype']} T={rec['tokens_per_rank']} {rec.get('internode_kernel') or 'intranode'}"
    lines = [f"-- profile {what}: device us per dispatch+expert+combine round (eager)"]
    for r in (rec.get("profile") or [])[:top]:
        lines.append(f"{r['us_per_round']:9.1f}  x{r['calls']:<3d} {r['name']}")
    return lines


def _stats(ms: list[float]) -> tuple[float, float]:
    """(median, p99) of these samples, each the maximum over ranks (the slowest rank). Collective."""
    t = torch.tensor(ms, dtype=torch.float32, device="cuda" if _on_gpu() else "cpu")
    med, p99 = t.median(), t.quantile(0.99)
    both = torch.stack([med, p99])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)  # slowest rank
    return float(both[0]), float(both[1])


def _us(stats: tuple[float, float] | None, i: int = 0) -> float | None:
    return None if stats is None else stats[i] * 1e3


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _torch_backend_time(cfg_kw: dict, x, w, idx, iters: int = 10, scales=None) -> tuple[float, float] | str:
    """Eager median (dispatch us, combine us) of the torch reference backend on the same inputs."""
    try:
        cfg = EpDispatchCombineConfig(**{**cfg_kw, "kernel_backend": "torch"})
        with EpDispatchCombineOp(cfg) as op:
            view, held = op.combine_in_view(), {}

            def disp():
                held["h"] = op.dispatch(x, w, scales, idx, return_routing=True)[-1]

            def comb():
                op.combine(view, routing=held["h"])

            d, c = _eager_time([disp, comb], iters)
        return _stats(d)[0] * 1e3, _stats(c)[0] * 1e3
    except Exception as exc:  # the reference backend is a baseline, not the subject
        return f"{type(exc).__name__}: {exc}"


# --- one point -----------------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def point_config(rank: int, world: int, T: int, hidden: int, k: int, num_experts: int, dtype: torch.dtype,
                 backend: str = "native", topology: dict | None = None, geometry: dict | None = None,
                 wave: int = 32) -> dict:
    """Config fields of a benchmark point; an fp8 dtype is a pre-quantized payload with per-128 fp32 scales.
    topology: extra config fields of an internode point ({"gpu_per_node": G, "internode_kernel": kind});
    geometry: launch overrides ({"launch_blocks": B, "launch_threads": N, "combine_threads": C}, zeros: the tuning
    table). A combine thread count of its own goes through the per-role fields (dispatch_block_num /
    warp_num_per_block, combine_block_num / combine_warp_num_per_block: warps of `wave` lanes), since
    launch_threads pins both roles."""
    geometry = dict(geometry or {})
    combine_threads = geometry.pop("combine_threads", 0)
    if combine_threads:
        blocks, threads = geometry.pop("launch_blocks", 0), geometry.pop("launch_threads", 0)
        if threads % wave or combine_threads % wave:
            raise ValueError(f"launch threads {threads} / combine threads {combine_threads}: not whole {wave}-lane waves")
        per_role = dict(dispatch_block_num=blocks, combine_block_num=blocks, warp_num_per_block=threads // wave,
                        combine_warp_num_per_block=combine_threads // wave)
        geometry.update({key: v for key, v in per_role.items() if v})
    kw = dict(rank=rank, world_size=world, hidden_dim=hidden, max_num_inp_token_per_rank=T,
              num_experts_per_rank=num_experts // world, num_experts_per_token=k, kernel_backend=backend,
              **(topology or {}), **geometry)
    if dtype in FP8_PAYLOADS:
        if hidden % QUANT_BLOCK:
            raise ValueError(f"an {dtype_name(dtype)} payload point needs hidden % {QUANT_BLOCK} == 0, got {hidden}")
        kw.update(data_type=torch.bfloat16, dispatch_data_type=dtype, combine_data_type=torch.bfloat16,
                  scale_dim=hidden // QUANT_BLOCK, scale_type_size=4)
    else:
        kw.update(data_type=dtype)
    return kw


ROUTINGS = ("uniform", "remote")


def make_input_sets(cfg: EpDispatchCombineConfig, n_sets: int, seed: int, device,
                    routing: str = "uniform") -> list[dict]:
    """`n_sets` input sets {x, w, scales, idx} of this rank: fresh payloads and weights; routings that
    are token permutations of one routing of k distinct experts per token, so every set moves the same
    rows per (source, destination) rank. routing="uniform": the k experts uniform over all experts;
    "remote": uniform over the other ranks' experts only (no row stays on its rank: the link alone)."""
    T, H, k, E = cfg.max_num_inp_token_per_rank, cfg.hidden_dim, cfg.num_experts_per_token, cfg.num_experts
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    epr = cfg.num_experts_per_rank
    if routing == "remote" and k > E - epr:
        raise ValueError(f"routing='remote' needs k <= the other ranks' experts ({E - epr}), got k={k}")
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(T, E, device=device, generator=g)
    if routing == "remote":
        scores[:, cfg.rank * epr:(cfg.rank + 1) * epr] = -1.0  # never among the top k
    idx0 = scores.topk(k, dim=1).indices.to(torch.int32)
    sets = []
    for _ in range(n_sets):
        perm = torch.randperm(T, device=device, generator=g)
        x = torch.randn(T, H, device=device, generator=g).to(cfg.data_type)
        w = torch.rand(T, k, device=device, generator=g)
        scales = None
        if cfg.prequantized:
            x, scales = quantize_blocks(x, cfg.scale_dim, cfg.dispatch_dtype)
        sets.append({"x": x, "w": w, "scales": scales, "idx": idx0[perm].contiguous()})
    return sets


def auto_input_sets(bytes_per_set: int, device) -> int:
    """Input sets whose bytes together are at least twice the device's L2 (2..MAX_INPUT_SETS); 2 on a CPU."""
    if torch.device(device).type != "cuda":
        return 2
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (50 << 20)
    return max(2, min(MAX_INPUT_SETS, math.ceil(2 * l2 / max(1, bytes_per_set))))


def _gather_counts(sent: list[int], device) -> list[list[int]]:
    """Every rank's rows per destination: matrix[s][d] = rows rank s sends to rank d."""
    mine = torch.tensor(sent, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [[int(v) for v in t.tolist()] for t in every]


def _a2a(send_rows: list[int], recv_rows: list[int], nbytes: int, device):
    """all_to_all_single of rows of `nbytes` bytes with these per-rank split sizes (a baseline leg)."""
    src = torch.zeros(sum(send_rows), nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(sum(recv_rows), nbytes, dtype=torch.uint8, device=device)
    return lambda: dist.all_to_all_single(dst, src, output_split_sizes=recv_rows, input_split_sizes=send_rows)


def require_gpus(prog: str) -> None:
    """Exit with one line, not a traceback, where the GPU tools cannot run: no GPU, or not started by torchrun."""
    module = prog.removeprefix("python -m ")  # "bench", "bench.tune", or "epgen bench" / "epgen tune"
    launch = f"launch one process per GPU: torchrun --nproc-per-node N -m {module} ... (README: Performance)"
    if not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None and torch.version.hip is None
               else "this torch sees no GPU")
        raise SystemExit(f"{prog}: needs GPUs (NVIDIA sm_90; the torch backend alone runs on CPU, in the tests), but "
                         f"{why}; {launch}")
    missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR") if v not in os.environ]
    if missing:
        raise SystemExit(f"{prog}: not started by torchrun (no {', '.join(missing)} in the environment); {launch}")


def _commit() -> str:
    """EPGEN_COMMIT when set (a copied working tree may carry stale git metadata), else git's HEAD,
    marked "+dirty" when tracked files differ from it."""
    if os.environ.get("EPGEN_COMMIT"):
        return os.environ["EPGEN_COMMIT"]
    try:
        git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, timeout=10)  # noqa: E731
        commit = git("rev-parse", "--short", "HEAD").stdout.strip()
        if commit and git("status", "--porcelain", "--untracked-files=no").stdout.strip():
            commit += "+dirty"
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return commit


def _device_info(device) -> dict:
    device = torch.device(device)
    if device.type != "cuda":
        return {"gpu": "cpu", "driver": "", "cuda_driver_api": None, "sms": None, "target": "cpu"}
    driver = ""
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        driver = (res.stdout.strip().splitlines() or [""])[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        api = int(torch._C._cuda_getDriverVersion())
    except Exception:  # noqa: BLE001 - metadata only
        api = None
    props = torch.cuda.get_device_properties(device)
    return {"gpu": props.name, "driver": driver, "cuda_driver_api": api, "sms": props.multi_processor_count,
            "target": op_arch()}


def _wave() -> int:
    """Lanes per wave of this process's GPU target (specs; 32 without a GPU: the torch backend ignores it)."""
    if not _on_gpu():
        return 32
    from runtime.backends.common import device_target
    return device_target("dispatch")[3].wave_size


def run_point(T: int, hidden: int, k: int, num_experts: int, dtype, inner: int, reps: int,
              torch_baseline: bool = False, *, backend: str = "native", eager_iters: int = 50,
              input_sets: int = 0, topology: dict | None = None, geometry: dict | None = None,
              profile: bool = False, routing: str = "uniform", protocol: str = "bw",
              combine_mode: str = "gather") -> dict:
    """One benchmark point (see the module docstring); collective; returns the JSON record (this rank's view).
    protocol: the intranode wire protocol ("auto", "ll", "bw"; config intranode_protocol); combine_mode:
    "gather" or "scatter" (config combine_mode; intranode)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg_kw = point_config(rank, world, T, hidden, k, num_experts, dtype, backend, topology, geometry, _wave())
    if topology is None:
        cfg_kw["intranode_protocol"] = protocol
        cfg_kw["combine_mode"] = combine_mode
    cfg = EpDispatchCombineConfig(**cfg_kw)
    epr = cfg.num_experts_per_rank
    d_row, c_row = row_bytes(cfg)
    name = dtype_name(dtype)
    where = f" internode {cfg.internode_kernel} gpu_per_node={cfg.resolved_gpu_per_node}" if cfg.is_internode else ""
    point = f"T={T} hidden={hidden} dtype={name}{where}"
    with EpDispatchCombineOp(cfg) as op:
        dev = op.device
        graph_ok = dev.type == "cuda" and bool(op.capabilities.get("graph_capture"))
        n_sets = input_sets or auto_input_sets(T * (d_row + 8 * k), dev)
        sets = make_input_sets(cfg, n_sets, seed=1234 + 7919 * rank, device=dev, routing=routing)
        # correctness gate on every set, before any timing (GateError on every rank)
        for i, s in enumerate(sets):
            identity_gate(op, s["x"], s["w"], s["scales"], s["idx"], point=f"{point} input set {i}")
        # accounting: the same for every set (token permutations of one routing)
        sent = rows_per_destination(sets[0]["idx"], world, epr)
        if any(rows_per_destination(s["idx"], world, epr) != sent for s in sets[1:]):
            raise RuntimeError("input sets differ in rows per destination")  # make_input_sets guarantees it
        matrix = _gather_counts(sent, dev)
        acc = accounting(sets[0]["idx"], rank, world, epr, d_row, [matrix[s][rank] for s in range(world)], c_row)

        state, held = {"i": 0}, {}
        view = op.combine_in_view()
        staged = torch.empty_like(view)

        def disp():  # the next input set, in turn
            s = held["set"] = sets[state["i"] % n_sets]
            state["i"] += 1
            held["out"], _, held["os"], _, _, held["h"] = op.dispatch(s["x"], s["w"], s["scales"], s["idx"],
                                                                      return_routing=True)

        def expert():  # the identity expert writes its output straight into the combine buffer
            identity_expert(held["out"], held["os"], view)

        def comb():
            op.combine(view, routing=held["h"])

        def expert_staged():  # expert output in a tensor of its own: combine stages it first
            identity_expert(held["out"], held["os"], staged)

        def comb_staged():
            op.combine(staged, routing=held["h"])

        def disp_replay():  # the same rows again through the handle's slots: no slot claims
            s = held["set"]
            op.dispatch(s["x"], s["w"], s["scales"], s["idx"], routing=held["h"])

        a2a_d = _a2a(acc["sent_per_dest"], acc["recv_per_source"], d_row, dev)
        a2a_c = _a2a(acc["recv_per_source"], acc["sent_per_dest"], c_row, dev)  # the rows going back

        host: list[list[float]] = []
        e_d, _, e_c = _eager_time([disp, expert, comb], eager_iters, host=host)
        eager = {"d": _stats(e_d), "c": _stats(e_c),
                 "hd": _stats(host[0]) if host else None, "hc": _stats(host[2]) if host else None,
                 "nd": _stats(_eager_time([a2a_d], eager_iters)[0]),
                 "nc": _stats(_eager_time([a2a_c], eager_iters)[0])}
        g_inner = max(inner, n_sets) if graph_ok else None
        graph = None
        if graph_ok:
            d_ms, e_ms, c_ms = _graph_time([disp, expert, comb], g_inner, reps)
            _, _, s_ms = _graph_time([disp, expert_staged, comb_staged], g_inner, reps)
            _, r_ms, _, _ = _graph_time([disp, disp_replay, expert, comb], g_inner, reps)
            # a whole round (dispatch, expert, combine) as one leg: no timing events between the kernels
            round_ms = _graph_time([lambda: (disp(), expert(), comb())], g_inner, reps)[0]
            graph = {"d": _stats(d_ms), "c": _stats(c_ms), "s": _stats(s_ms), "r": _stats(r_ms),
                     "round": _stats(round_ms), "e": _stats(e_ms),
                     "nd": _stats(_graph_time([a2a_d], g_inner, reps)[0]),
                     "nc": _stats(_graph_time([a2a_c], g_inner, reps)[0])}
        prof = _profile([disp, expert, comb]) if profile and _on_gpu() else None
        route = op.last_internode_kernel
        ran = op.last_intranode_protocol  # the protocol of the timed calls (auto: by the config's token bound)
        geo = getattr(op._backend, "_geometry", None)
        suffix = "_ll" if ran == "ll" else ""
        launched = {role: geo(role + suffix, T, T * world if role == "dispatch" else T) if geo else (None, None)
                    for role in ("dispatch", "combine")}
    tb = "not run"
    if torch_baseline and backend != "torch":
        s0 = sets[0]
        tb = _torch_backend_time(cfg_kw, s0["x"], s0["w"], s0["idx"], scales=s0["scales"])
    g = graph or {}
    gd, gc = g.get("d"), g.get("c")
    bw = bandwidths(acc, gd[0] * 1e-3 if gd else None, gc[0] * 1e-3 if gc else None)
    ebw = bandwidths(acc, eager["d"][0] * 1e-3, eager["c"][0] * 1e-3)
    info = _device_info(dev)
    rec = {
        "commit": _commit(), "date": time.strftime("%Y-%m-%d", time.gmtime()), "backend": cfg.resolved_backend,
        "workspace": workspace.allocator_name(),
        "target": info["target"], "gpu": info["gpu"], "driver": info["driver"],
        "cuda_driver_api": info["cuda_driver_api"], "torch": torch.__version__, "world_size": world,
        "dtype": name, "combine_dtype": dtype_name(cfg.combine_dtype),
        "topology": "internode" if cfg.is_internode else "intranode", "gpu_per_node": cfg.resolved_gpu_per_node,
        "internode_kernel": cfg.internode_kernel if cfg.is_internode else None, "internode_route": route,
        "intranode_protocol": None if cfg.is_internode else cfg.intranode_protocol, "protocol": ran,
        "quant": "payload_block128_fp32_scales" if cfg.prequantized else "none", "scale_dim": cfg.scale_dim,
        "tokens_per_rank": T, "hidden": hidden, "topk": k, "experts": num_experts, "routing": routing,
        "graph": graph_ok, "graph_modes": ["graph", "eager"] if graph_ok else ["eager"],
        "input_sets": n_sets, "graph_iters": g_inner, "graph_reps": reps if graph_ok else None,
        "eager_iters": eager_iters,
        "expert_id_check": id_check_mode(),
        "profile": prof,
        "gate": "identity expert on every input set before timing: combine == U*x exactly, total_recv == rows "
                "addressed, received rows' checksum == rows addressed (passed)",
        # graph replay (headline)
        "dispatch_us": _us(gd), "dispatch_p99_us": _us(gd, 1),
        "combine_us": _us(gc), "combine_p99_us": _us(gc, 1),
        "dispatch_combine_us": _us(gd) + _us(gc) if graph else None,
        "round_us": _us(g.get("round")), "expert_us": _us(g.get("e")),
        "round_note": "dispatch + identity expert + combine captured as one leg (no timing events between "
                      "the kernels, as in a model's graph); dispatch_us / combine_us each carry one event pair",
        "dispatch_replay_us": _us(g.get("r")),
        "dispatch_replay_note": "routing replay of the same rows right after a dispatch (no slot claims; "
                                "includes the dispatch->dispatch entry barrier)",
        "combine_staged_us": _us(g.get("s")),
        "combine_input": "combine_in_view (zero-copy); combine_staged_us: separate tensor, staged",
        # eager
        "eager_dispatch_us": _us(eager["d"]), "eager_dispatch_p99_us": _us(eager["d"], 1),
        "eager_combine_us": _us(eager["c"]), "eager_combine_p99_us": _us(eager["c"], 1),
        "eager_dispatch_host_us": _us(eager["hd"]), "eager_combine_host_us": _us(eager["hc"]),
        # launch geometry (SMs used)
        "dispatch_blocks": launched["dispatch"][0], "combine_blocks": launched["combine"][0],
        "dispatch_threads": launched["dispatch"][1], "combine_threads": launched["combine"][1],
        "sms": info["sms"],
        "launch_override": {key: v for key, v in (geometry or {}).items() if v} or None,
        "combine_mode": None if cfg.is_internode else cfg.resolved_combine_mode,
        # accounting (this rank's view; rows_matrix has every rank's rows)
        "rows_matrix": matrix,
        **{key: acc[key] for key in ("sent_rows", "local_rows", "remote_rows", "recv_rows", "recv_remote_rows",
                                     "dispatch_row_bytes", "combine_row_bytes", "dispatch_logical_bytes",
                                     "dispatch_link_bytes", "combine_logical_bytes", "combine_link_bytes")},
        **bw, **{f"eager_{key}": v for key, v in ebw.items()},
        # baselines
        "nccl_a2a_us": _us(g.get("nd")), "nccl_a2a_p99_us": _us(g.get("nd"), 1),
        "nccl_a2a_combine_us": _us(g.get("nc")),
        "nccl_a2a_eager_us": _us(eager["nd"]), "nccl_a2a_combine_eager_us": _us(eager["nc"]),
        "dispatch_vs_nccl": _ratio(_us(g.get("nd")), _us(gd)), "combine_vs_nccl": _ratio(_us(g.get("nc")), _us(gc)),
        "eager_dispatch_vs_nccl": _ratio(_us(eager["nd"]), _us(eager["d"])),
        "eager_combine_vs_nccl": _ratio(_us(eager["nc"]), _us(eager["c"])),
        "torch_backend_dispatch_us": tb[0] if isinstance(tb, tuple) else None,
        "torch_backend_combine_us": tb[1] if isinstance(tb, tuple) else None,
        "torch_backend_note": "eager, device events" if isinstance(tb, tuple) else tb,
        "dispatch_vs_torch": _ratio(tb[0], _us(gd)) if isinstance(tb, tuple) else None,
        "combine_vs_torch": _ratio(tb[1], _us(gc)) if isinstance(tb, tuple) else None,
    }
    return rec


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
    xq, scales = quantize_blocks(x, hidden // QUANT_BLOCK)
    deq = dequantize_rows(xq, scales, torch.bfloat16)
    res = {}
    modes = {
        "bf16_gather": dict(),
        "fp8_payload_gather": dict(dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.bfloat16,
                                   scale_dim=hidden // 128, scale_type_size=4),
        "bf16_fp8_scatter": dict(quant_type="fp8_blockwise"),
        "bf16_scatter": dict(combine_mode="scatter"),  # push combine without compression (bytes as gather)
    }
    for name, extra in modes.items():
        cfg = EpDispatchCombineConfig(**base, **extra)
        inp, sc = (xq, scales) if "payload" in name else (x, None)
        with EpDispatchCombineOp(cfg) as op:
            out, ow, os_, _, total, h = op.dispatch(inp, w, sc, idx, return_routing=True)
            expert = out if "payload" not in name else dequantize_rows(out, os_, torch.bfloat16)
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
    return {"commit": _commit(), "kind": "lowprec", "tokens_per_rank": T, "hidden": hidden, "topk": k,
            "experts": num_experts, "graph": True,
            "world_size": world, "target": op_arch(), "gpu": torch.cuda.get_device_properties(0).name,
            "modes": {m: {"dispatch_us": d, "combine_us": c, "rel_err": e} for m, (d, c, e) in res.items()},
            "fp8_dispatch_over_bf16": res["fp8_payload_gather"][0] / res["bf16_gather"][0],
            "fp8_scatter_combine_over_bf16_gather": res["bf16_fp8_scatter"][1] / res["bf16_gather"][1],
            "dispatch_bytes_per_row": {"bf16": hidden * 2, "fp8": hidden + (hidden // 128) * 4}}


def op_arch() -> str:
    from runtime.kernels import device_arch
    return device_arch(torch.device("cuda"))


# --- report --------------------------------------------------------------------------------------
def cell(v, fmt: str, missing: str = "-") -> str:
    """One table cell: `v` formatted, or `missing` for an absent value."""
    return missing if v is None else format(v, fmt)


def _pair(r: dict, a: str, b: str, fmt: str) -> str:
    return f"{cell(r.get(a), fmt)}/{cell(r.get(b), fmt)}"


TABLE_COLUMNS = [("dtype", 13), ("tokens", 6), ("hidden", 6), ("graph us d/c", 15), ("round us", 8), ("eager us d/c", 15),
                 ("host us d/c", 13), ("nccl us d/c", 15), ("vs nccl d/c", 11), ("logical GB/s d/c", 16), ("link GB/s d/c", 13),
                 ("blocks d/c", 10)]


def read_records(path) -> list[dict]:
    """The benchmark records of a JSON-lines file (blank lines skipped)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def sweep_points(records: list[dict], commit: str | None = None) -> tuple[str, list[dict]]:
    """(commit, its sweep points sorted by dtype, hidden descending, tokens): the intranode points of the
    default routing, the gather combine and the tuning table's launch geometry (no launch_override; experiments
    carry a note) of `commit` (default: the commit with the most distinct such points, the newest among
    equals); a point measured twice gives its later record. scripts/sweep_table.py and
    scripts/plot_bench.py show these."""
    pts = [r for r in records if "dispatch_us" in r and r.get("topology", "intranode") == "intranode"
           and r.get("routing", "uniform") == "uniform" and not r.get("note") and not r.get("launch_override")
           and r.get("combine_mode", "gather") == "gather"]
    if commit is None:
        points: dict[str, set] = {}  # distinct (dtype, hidden, tokens) per commit, in order of first record
        for r in pts:
            points.setdefault(r["commit"], set()).add((r["dtype"], r["hidden"], r["tokens_per_rank"]))
        if not points:
            raise ValueError("no intranode benchmark points")
        commit = max(reversed(list(points)), key=lambda c: len(points[c]))
    pts = [r for r in pts if r["commit"] == commit]
    if not pts:
        raise ValueError(f"no intranode benchmark points for commit {commit}")
    latest = {}
    for r in pts:  # a point measured twice: the later record
        latest[(r["dtype"], r["hidden"], r["tokens_per_rank"])] = r
    order = sorted(latest, key=lambda key: (key[0], -key[1], key[2]))
    return commit, [latest[key] for key in order]


def format_table(rows: list[dict]) -> list[str]:
    """The printed summary: a header and one line per point (graph times and bandwidths; eager times)."""
    lines = [" ".join(f"{name:>{w}}" for name, w in TABLE_COLUMNS)]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['dtype']:>13} {r['tokens_per_rank']:>6} {r['hidden']:>6} failed "
                         f"{r.get('launch_override') or ''}: {r['error']}")
            continue
        tag = (f"{r['dtype']}/{r['protocol']}" if r.get("protocol") else r["dtype"]) \
            if r.get("topology", "intranode") == "intranode" else \
            f"{r['dtype']}/{r.get('internode_route') or r.get('internode_kernel')}"
        if r.get("combine_mode") == "scatter":
            tag += "/scatter"
        cells = [tag, str(r["tokens_per_rank"]), str(r["hidden"]),
                 _pair(r, "dispatch_us", "combine_us", ".1f"), cell(r.get("round_us"), ".1f"),
                 _pair(r, "eager_dispatch_us", "eager_combine_us", ".1f"),
                 _pair(r, "eager_dispatch_host_us", "eager_combine_host_us", ".0f"),
                 _pair(r, "nccl_a2a_us", "nccl_a2a_combine_us", ".1f"),
                 _pair(r, "dispatch_vs_nccl", "combine_vs_nccl", ".2f"),
                 _pair(r, "dispatch_logical_GBps", "combine_logical_GBps", ".0f"),
                 _pair(r, "dispatch_link_GBps", "combine_link_GBps", ".0f"),
                 _pair(r, "dispatch_blocks", "combine_blocks", "")]
        lines.append(" ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, TABLE_COLUMNS)))
    return lines


def collective_try(fn):
    """(fn(), None) on every rank, or (None, reason) on every rank when fn raised on any rank (the
    first failing rank's exception, named)."""
    try:
        value, reason = fn(), None
    except Exception as e:  # noqa: BLE001 - recorded, never hidden
        value, reason = None, f"{type(e).__name__}: {e}"[:600]
    reasons: list = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    bad = [(r, m) for r, m in enumerate(reasons) if m]
    return (value, None) if not bad else (None, f"rank {bad[0][0]}: {bad[0][1]}")
