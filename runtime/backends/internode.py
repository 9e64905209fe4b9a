"""The native internode backend: generated record kernels around NCCL/RCCL all_to_all_single.

Transport: ``torch.distributed.all_to_all_single`` on the op's group (NCCL on NVIDIA, RCCL on AMD),
a transport that already runs across hosts. Kernels (specs/kernels.toml, families internode_*) turn
tokens into fixed-size byte records ("cells") and back; the collectives move the cells. The
all-to-alls need every rank's token count on the host: an eager dispatch all-gathers them on the op's
group with each rank's largest expert id and reads them back (one sync); inside graph capture they
cross on the host over a gloo side group instead, so everything captured is stream-ordered and
sync-free and a dispatch -> expert -> combine sequence can be captured in a CUDA graph (the counts are
then fixed for the graph's replays like every shape in it).

Layout (W ranks, G = gpu_per_node, N = W / G nodes, node(r) = r // G, loc(r) = r % G). Receive rows
are numbered in (source rank, token) order (routing.ordered_slots, one small device all-gather of
per-destination counts), so the rows every rank receives, the rows dropped past max_total_recv_tokens
and therefore every result are the same on every run and on both routes.

A cell is payload | scales | weights (k f32) | ids (k i32) | rows (G i32) | source (i32), 16-byte
aligned; rows[g] is the receive row on local rank g of the cell's destination node (-1: none).

* v2_ll: one cell per (destination rank, token): grid [W, T] -> one all_to_all -> unpack.
* v2: one cell per (destination node, token), sent along the rail to the rank of the same local index
  on that node (stage 1, between nodes); the forwarder copies each cell to the grid of every local
  rank it names (internode_forward) and a second all_to_all delivers them inside the node (stage 2).
* combine reverses the dispatch's exchanges: the expert side packs each received cell's row into a
  return cell in arrival order (internode_combine_pack); v2's forwarder regroups the return cells by
  origin (a strided copy) and sends them on, unreduced; the origin sums a token's rows in fp32 in k
  order of first appearance (internode_reduce), the intranode gather's order: identical results.

Cells per (source, destination) pair are the source's whole token count: a row is sent only where the
routing names it, but the cell grid is dense, so the bytes on the wire are W x T records per rank
for v2_ll and N x T for stage 1 of v2 (hence v2_ll for small batches; "auto" picks by token count).
"""

from __future__ import annotations


import atexit
import contextlib
import weakref

import torch
import torch.distributed as dist

from .. import collectives, workspace
from ..config import EpDispatchCombineConfig
from ..plan import KernelSet, internode_roles
from ..errors import EpgenError, InputError
from ..routing import all_gather_counts, ordered_slots
from .common import device_target, id_check_mode, local_expert_count, native_group, raise_if_dropped

WAVES_PER_BLOCK = 8


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def record_layout(row_bytes: int, scale_bytes: int, k: int, gpn: int) -> dict[str, int]:
    """Byte offsets inside one dispatch cell, and its size `rec` (16-byte aligned)."""
    off_w = _align(row_bytes + scale_bytes, 4)
    off_ids = off_w + 4 * k
    off_rows = off_ids + 4 * k
    off_src = off_rows + 4 * gpn
    return {"off_w": off_w, "off_ids": off_ids, "off_rows": off_rows, "off_src": off_src,
            "rec": _align(off_src + 4, 16)}


_HOST_GROUPS: dict[str, tuple] = {}  # group name -> (weakref to the default group it was made under, gloo group)


@atexit.register
def _destroy_host_groups() -> None:
    """The gloo groups made here are this module's own: shut down at exit, with their threads, while
    torch.distributed is whole (not left to the interpreter's teardown)."""
    made = list(_HOST_GROUPS.values())
    _HOST_GROUPS.clear()
    for world, g in made:
        if dist.is_initialized() and world() is workspace.current_world():
            with contextlib.suppress(Exception):
                dist.destroy_process_group(g)


def host_group(group):
    """A gloo group over `group`'s ranks for the host-side token counts, made once per process and
    kept (creating and destroying gloo groups per op can meet a previous group's stale rendezvous)."""
    world, made = workspace.current_world(), _HOST_GROUPS.get(group.group_name)
    if made is None or made[0]() is not world:  # none yet, or made under an earlier init of torch.distributed
        ranks = dist.get_process_group_ranks(group)
        made = _HOST_GROUPS[group.group_name] = (weakref.ref(world), dist.new_group(ranks, backend="gloo",
                                                                        use_local_synchronization=True))
    return made[1]


def exchange_splits(route: str, counts: list[int], rank: int, gpn: int) -> dict[str, list]:
    """Cells each rank sends to / receives from every rank, per stage (the same on every rank's view).

    counts[s] = tokens of source s in this call. Returns {"d1": (send, recv), "d2": (send, recv) (v2),
    "n1": cells this rank forwards (v2)}; combine uses the same lists swapped."""
    W = len(counts)
    T = counts[rank]
    if route == "v2_ll":
        return {"d1": ([T] * W, list(counts))}
    loc, node = rank % gpn, rank // gpn
    rail = [s for s in range(W) if s % gpn == loc]
    send1 = [T if p % gpn == loc else 0 for p in range(W)]
    recv1 = [counts[s] if s in rail else 0 for s in range(W)]
    n1 = sum(counts[s] for s in rail)
    mine = range(node * gpn, (node + 1) * gpn)
    send2 = [n1 if p in mine else 0 for p in range(W)]
    recv2 = [sum(counts[s] for s in range(W) if s % gpn == p % gpn) if p in mine else 0 for p in range(W)]
    return {"d1": (send1, recv1), "d2": (send2, recv2), "n1": n1, "rail": rail}


class NativeInternodeBackend:
    name = "native"

    def __init__(self, config: EpDispatchCombineConfig, group=None):
        cfg = self.config = config
        self.group = native_group(cfg, group)
        if cfg.dispatch_quant_type != "none" or cfg.quant_type != "none":
            raise EpgenError("native internode moves payloads verbatim: dispatch_quant_type and quant_type "
                             "must be 'none' (rule internode_quant_none)")
        if cfg.max_inflight > 1:
            raise EpgenError(f"native internode: max_inflight={cfg.max_inflight} is not built yet (one operation in "
                             f"flight: its buffers are not slotted); use max_inflight=1, or kernel_backend='torch'")
        self.device, self.arch, self.num_sms, target = device_target("internode_pack")
        self.wave = target.wave_size
        # every kernel a call can take, loaded now (runtime/plan.py names them)
        routes = ("v2", "v2_ll") if cfg.internode_kernel == "auto" else (cfg.internode_kernel,)
        self.kern: dict[str, KernelSet] = {}
        for route, roles in internode_roles(cfg, routes).items():
            self.kern[route] = KernelSet(self.arch, roles)
        numbering = self.kern.pop("numbering")
        self._numbering = (numbering["route_count"], numbering["route_slots"])  # routing.ordered_slots
        self._numbering_set = numbering

        self._setup_buffers(self.device)
        # token counts of every rank, exchanged on the host (no device sync, graph-capture safe)
        self.host_group = host_group(self.group)
        # eager calls read every rank's token count back anyway: the largest id rides along ("async" and
        # "sync" alike; the record kernels note nothing for the host)
        self.check_ids = id_check_mode() != "off"
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def _setup_buffers(self, dev: torch.device) -> None:
        """Record layout and every buffer of the op (sizes from the config alone)."""
        cfg = self.config
        W, G, k, H = cfg.world_size, cfg.resolved_gpu_per_node, cfg.num_experts_per_token, cfg.hidden_dim
        self.gpn = G
        self.routes = ("v2", "v2_ll") if cfg.internode_kernel == "auto" else (cfg.internode_kernel,)
        elem = torch.empty((), dtype=cfg.dispatch_dtype).element_size()
        self.row_bytes = cfg.dispatch_payload_cols * elem  # fp4_x2: one byte per element (two values)
        self.scale_bytes = cfg.scale_dim * cfg.scale_type_size if cfg.dispatch_scales_dtype is not None else 0
        self.comb_row = H * torch.empty((), dtype=cfg.combine_dtype).element_size()
        for what, n in (("payload row", self.row_bytes), ("combine row", self.comb_row)):
            if n % 16:
                raise EpgenError(f"native internode: a {what} must be a multiple of 16 bytes, got {n} "
                                 f"(hidden_dim={H})")
        self.lay = record_layout(self.row_bytes, self.scale_bytes, k, G)
        self.brec = _align(self.comb_row + 4 * k, 16)
        R, Tm = cfg.max_recv_tokens, cfg.max_num_inp_token_per_rank
        cells = W * Tm
        u8 = dict(dtype=torch.uint8, device=dev)
        rec, brec = self.lay["rec"], self.brec
        self.send, self.recv = torch.empty(cells * rec, **u8), torch.empty(cells * rec, **u8)
        self.mid = torch.empty(cells * rec, **u8) if "v2" in self.routes else None
        self.back_a, self.back_b = torch.empty(cells * brec, **u8), torch.empty(cells * brec, **u8)
        self.recv_x = torch.empty((R, self.row_bytes), **u8).view(cfg.dispatch_dtype)
        self.recv_scales = None
        if self.scale_bytes:
            self.recv_scales = torch.empty((R, self.scale_bytes), **u8).view(cfg.dispatch_scales_dtype)
        self.recv_w = torch.zeros((R, k), dtype=torch.float32, device=dev)
        self.recv_idx = torch.full((R, k), -1, dtype=torch.int32, device=dev)
        self.recv_src = torch.full((R,), -1, dtype=torch.int32, device=dev)
        self.comb_x = torch.empty((R, H), dtype=cfg.combine_dtype, device=dev)
        self.total_recv = torch.zeros(1, dtype=torch.int32, device=dev)
        self.dropped = torch.zeros((), dtype=torch.int32, device=dev)
        self.bad_ids = torch.zeros((), dtype=torch.int32, device=dev)
        self.last_internode_kernel: str | None = None
        self._grid_slots = None

    # --- facts ---------------------------------------------------------------------------------
    @property
    def capabilities(self) -> dict:
        return {"graph_capture": True, "routing_replay": True, "internode": True, "arch": self.arch,
                "transport": "all_to_all_single (NCCL/RCCL) on the op's group",
                "kernels": tuple(s for route in self.routes for s in self.kern[route].symbols())}

    def check(self) -> None:
        """Nothing to poll: waits happen inside NCCL/RCCL (their own timeouts apply)."""

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _gather_counts(self, cnt: torch.Tensor) -> torch.Tensor:
        """[W] rows per destination of this rank -> [W, W] (row s: source s), on the device."""
        return all_gather_counts(cnt, self.group)

    def _counts(self, T: int, indices: torch.Tensor | None = None) -> list[int]:
        """Every rank's token count of this call.

        Eager: one all-gather on the op's group of (T, largest expert id) read back with one device
        sync; with `indices` (the expert-id check) a rank that passed an id >= num_experts makes every
        rank raise InputError naming it. Inside graph capture: the counts cross on the host over the
        gloo side group (no sync; they are then fixed for the graph's replays) and ids are not checked.
        """
        W = self.config.world_size
        if self._capturing():
            mine = torch.tensor([T], dtype=torch.int64)
            every = [torch.zeros(1, dtype=torch.int64) for _ in range(W)]
            collectives.run(lambda: dist.all_gather(every, mine, group=self.host_group), [mine, *every],
                            self.host_group)
            return [int(c) for c in every]
        top = indices.max().to(torch.int64).view(1) if indices is not None and indices.numel() else \
            torch.full((1,), -1, dtype=torch.int64, device=self.device)
        got = self._gather_pairs(torch.cat([torch.full((1,), T, dtype=torch.int64, device=self.device), top]))
        E = self.config.num_experts
        bad = [(r, m) for r, (_, m) in enumerate(got) if m >= E]
        if indices is not None and bad:
            raise InputError(f"dispatch: expert id {bad[0][1]} >= {self.config.expert_id_bound()}, passed by rank "
                             f"{bad[0][0]} (raised on every rank)")
        return [int(t) for t, _ in got]

    def _gather_pairs(self, mine: torch.Tensor) -> list[list[int]]:
        """[2] int64 of this rank -> every rank's pair, on the op's group (the one device sync of an
        eager dispatch)."""
        W = self.config.world_size
        every = torch.empty(2 * W, dtype=torch.int64, device=self.device)
        workspace.all_gather_single(every, mine, self.group)
        return every.view(W, 2).tolist()

    def _route(self, counts: list[int]) -> str:
        cfg = self.config
        if cfg.internode_kernel != "auto":
            return cfg.internode_kernel
        return "v2_ll" if max(counts) <= cfg.internode_auto_ll_max_tokens else "v2"

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_cells: list[int], in_cells: list[int], size: int):
        workspace.all_to_all_single(out[: sum(out_cells) * size], inp[: sum(in_cells) * size],
                                    [c * size for c in out_cells], [c * size for c in in_cells], self.group)

    def _launch(self, route: str, role: str, items: int, threads: int = 0, **args) -> None:
        """Run kernel `role` of `route` over `items` work items (waves, or threads when `threads` is
        given) with its declared arguments, by name (specs/kernels.toml)."""
        if items <= 0:
            return
        if threads:
            blocks = max(1, min(4 * self.num_sms, -(-items // threads)))
        else:
            threads = WAVES_PER_BLOCK * self.wave
            blocks = max(1, min(4 * self.num_sms, -(-items // WAVES_PER_BLOCK)))
        self.kern[route].launch(role, blocks, threads, **args)

    # --- dispatch / combine --------------------------------------------------------------------
    def dispatch(self, x, weights, scales, indices, routing):
        cfg = self.config
        if self._capturing() and not workspace.device_collectives(self.group):
            raise workspace.capture_unsupported()
        W, G, k, rank = cfg.world_size, self.gpn, cfg.num_experts_per_token, cfg.rank
        T = x.shape[0]
        counts = self._counts(T, indices if self.check_ids and routing is None else None)
        if routing is not None:
            ex = routing.extra
            if tuple(counts) != ex["counts"]:
                raise InputError(f"dispatch: routing replay needs every rank's token count unchanged: the "
                                 f"handle has {list(ex['counts'])}, this call {counts}")
            slots, total, route = ex["slots"], ex["total"], ex["route"]
        else:
            route = self._route(counts)
            slots, total, dropped = ordered_slots(indices, rank, W, cfg.num_experts_per_rank, cfg.num_experts,
                                                  cfg.max_recv_tokens, self._gather_counts, self._numbering)
            self.dropped.copy_(dropped)
            self.bad_ids.add_((indices >= cfg.num_experts).sum().to(torch.int32))
        lay, rec = self.lay, self.lay["rec"]
        offs = {n: lay[n] for n in ("off_w", "off_ids", "off_rows", "off_src")}
        sp = exchange_splits(route, counts, rank, G)
        groups = W if route == "v2_ll" else W // G
        self._launch(route, "pack", groups * T, x=x, scales=scales, weights=weights, indices=indices, slots=slots,
                     cells=self.send, T=T, k=k, world=W, gpn=G, groups=groups, row_bytes=self.row_bytes,
                     scale_bytes=self.scale_bytes, has_weights=int(weights is not None), rec=rec, **offs, rank=rank,
                     max_tokens=cfg.max_num_inp_token_per_rank)
        send1, recv1 = sp["d1"]
        if route == "v2_ll":
            self._a2a(self.recv, self.send, recv1, send1, rec)
        else:
            self._a2a(self.mid, self.send, recv1, send1, rec)  # stage 1: along the rail
            n1 = sp["n1"]
            self._launch(route, "forward", G * n1, in_cells=self.mid, out_cells=self.send, ncells=n1, gpn=G, rec=rec,
                         off_rows=lay["off_rows"])
            send2, recv2 = sp["d2"]
            self._a2a(self.recv, self.send, recv2, send2, rec)  # stage 2: inside the node
        ncells = sum(counts)
        self._launch(route, "unpack", ncells, cells=self.recv, ncells=ncells, recv_x=self.recv_x,
                     recv_scales=self.recv_scales, recv_w=self.recv_w, recv_idx=self.recv_idx, recv_src=self.recv_src,
                     loc=rank % G, k=k, row_bytes=self.row_bytes, scale_bytes=self.scale_bytes, rec=rec, **offs)
        self.total_recv.copy_(total)
        self._grid_slots = slots  # the receive grid now holds this layout (a replay keeps the same object)
        self.last_internode_kernel = route
        if cfg.strict_capacity and not self._capturing():
            raise_if_dropped(cfg, self.dropped)
        out_w = self.recv_w if weights is not None else None
        return self.recv_x, out_w, self.recv_scales, self.recv_idx, self.total_recv, \
            {"extra": {"slots": slots, "total": total, "route": route, "counts": tuple(counts),
                       "recv_src": self.recv_src}}

    def combine(self, expert_out, weights, indices, routing):
        cfg = self.config
        ex = routing.extra
        if "route" not in ex:
            raise InputError("combine: the routing handle carries no internode plan")
        W, G, k, rank = cfg.world_size, self.gpn, cfg.num_experts_per_token, cfg.rank
        slots, route, counts = ex["slots"], ex["route"], list(ex["counts"])
        if slots is not self._grid_slots:
            raise InputError("combine: the native internode backend combines the layout of the last dispatch "
                             "(its receive cells are reused): pass that dispatch's routing handle, or replay this "
                             "handle's dispatch first (dispatch(..., routing=handle))")
        T = slots.shape[0]
        rec, brec = self.lay["rec"], self.brec
        ncells = sum(counts)
        self._launch(route, "cpack", ncells, cells=self.recv, ncells=ncells, expert_out=expert_out, expert_w=weights,
                     has_weights=int(weights is not None), expert_rows=expert_out.shape[0], back=self.back_a,
                     loc=rank % G, k=k, rec=rec, off_rows=self.lay["off_rows"], row_bytes=self.comb_row, brec=brec)
        sp = exchange_splits(route, counts, rank, G)
        send1, recv1 = sp["d1"]
        if route == "v2_ll":
            self._a2a(self.back_b, self.back_a, send1, recv1, brec)  # the dispatch exchange reversed
        else:
            send2, recv2 = sp["d2"]
            n1 = sp["n1"]
            self._a2a(self.back_b, self.back_a, send2, recv2, brec)  # stage 2 reversed: [local d][n1 cells]
            # regroup by origin: [d][rail source s][T_s] -> [s][d][T_s], unreduced
            by_d = self.back_b[: G * n1 * brec].view(G, n1, brec)
            off, parts = 0, []
            for s in sp["rail"]:
                parts.append(by_d[:, off:off + counts[s]].reshape(-1))
                off += counts[s]
            if parts:
                torch.cat(parts, out=self.back_a[: G * n1 * brec])
            self._a2a(self.back_b, self.back_a, [G * n for n in send1], [G * n for n in recv1], brec)
        out = torch.empty((T, cfg.hidden_dim), dtype=cfg.combine_dtype, device=self.device)
        out_w = torch.empty((T, k), dtype=torch.float32, device=self.device) if weights is not None else None
        self._launch(route, "reduce", T * (self.comb_row // 16), threads=256, back=self.back_b, slots=slots, T=T, k=k,
                     world=W, out=out, out_w=out_w, has_weights=int(weights is not None), row_bytes=self.comb_row,
                     brec=brec)
        self.last_internode_kernel = route
        return out, out_w

    def combine_in_view(self) -> torch.Tensor:
        return self.comb_x

    # --- MoE integration, lifecycle ------------------------------------------------------------
    def dropped_count(self) -> torch.Tensor:
        return self.dropped

    def local_expert_count(self) -> torch.Tensor:
        return local_expert_count(self.config, self.recv_idx, self.total_recv)

    def counters(self) -> dict[str, int]:
        return {"bad_ids": int(self.bad_ids), "dropped": int(self.dropped)}

    def memory_report(self) -> dict:
        named = {"send_cells": self.send, "recv_cells": self.recv, "forward_cells": self.mid,
                 "return_cells_a": self.back_a, "return_cells_b": self.back_b, "recv_x": self.recv_x,
                 "recv_scales": self.recv_scales, "recv_w": self.recv_w, "recv_idx": self.recv_idx,
                 "recv_src": self.recv_src, "combine_in_view": self.comb_x}
        sizes = {n: t.numel() * t.element_size() for n, t in named.items() if t is not None}
        return {"symmetric_workspace": 0, "regions": sizes, "other_device_buffers": {"total_recv": 4},
                "total_device_bytes": sum(sizes.values()) + 4, "pinned_host_bytes": 0,
                "cell_bytes": self.lay["rec"], "return_cell_bytes": self.brec}

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self.total_recv.zero_()
        self.dropped.zero_()
        self.bad_ids.zero_()
        self._grid_slots = None
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        for kset in (*self.kern.values(), self._numbering_set):
            kset.close()
        self.kern, self._numbering, self._numbering_set = {}, (), None
        self.host_group = self.group = None  # host_group: shared by every op on this group, kept there
        self.send = self.recv = self.mid = self.back_a = self.back_b = None
        self.recv_x = self.recv_scales = self.recv_w = self.recv_idx = self.recv_src = self.comb_x = None
        self.total_recv = self.dropped = self.bad_ids = None
