"""The native backend: generated dispatch / combine kernels over peer-mapped memory.

Each rank owns one peer-mapped workspace (runtime/ipc.py, or torch's _symmetric_memory: see
runtime/workspace.py); the kernels address a peer's copy through the peer base pointers. Everything is allocated and every kernel loaded at
construction; dispatch/combine only pack arguments and launch on torch's current stream (no host
sync, no allocation beyond the outputs; under a receive cap dispatch first numbers the slots: route_count,
one all-gather of the counts on the op's group, route_slots), so they can be graph-captured.

The intranode wire protocol of an op is "bw" (bandwidth: dispatch / combine_gather / combine_scatter) or
"ll" (low latency: dispatch_ll / combine_ll, runtime/ll.py), one for all its calls, decided at construction
from the config and the target alone (ll.resolve: config intranode_protocol; "auto" by the config's token
bound) and checked equal on every rank; a combine takes its routing handle's protocol.

The op's kernels, its workspace regions and its other buffers come from its plan (runtime/plan.py: one
table for the allocation and the memory report); the kernels launch by role with their declared arguments.
"""

from __future__ import annotations

import ctypes
import math
import warnings

import torch
import torch.distributed as dist

from generator import specs as gspecs
from generator.abi import ERROR_WORDS, PHASES, STATE_SIZE, STATE_WORDS

from .. import collectives, errors, grouped, kernels, workspace
from ..config import EpDispatchCombineConfig, load_specs
from ..errors import ConfigError, EpgenError, InputError
from ..plan import DIRECT_MAX_GRID, Plan, direct_call, slot_name
from ..routing import all_gather_counts, ordered_slots
from .common import (check_expert_ids, device_target, id_check_mode, local_expert_count, native_group,
                     raise_if_dropped)

PHASE_BOTH, PHASE_SEND, PHASE_RECV = 0, 1, 2  # the EP kernels' a.phase (specs/kernels.toml [args.ep])
BLOCK = 512  # threads per block of the std-MoE and grouped-layout kernels (the EP kernels take specs/tuning.toml)


def bad_id_message(cfg: EpDispatchCombineConfig, bad: int | None, seen: int) -> str:
    """The report of `seen` expert ids >= num_experts a dispatch kernel noted (`bad`: the first, if known)."""
    first = f"expert id {bad}" if bad is not None else "an expert id"
    return (f"dispatch: {first} >= {cfg.expert_id_bound()}, "
            f"found on rank {cfg.rank} by the dispatch kernel of an earlier call of this op ({seen} "
            f"such id(s); their (token, k) pairs were dropped and nothing else changed: the op stays usable)")


def check_rows(cfg: EpDispatchCombineConfig, plan: Plan) -> None:
    """The row shapes the native kernels handle: whole 16-byte vectors, 8 elements at a time."""
    if cfg.hidden_dim % 8:  # the kernels convert, scatter and reduce 8 elements at a time
        raise EpgenError(f"native backend: hidden_dim must be a multiple of 8, got {cfg.hidden_dim}")
    for what, n in (("x row", plan.in_row), ("received row", plan.wire_row), ("combine row", plan.comb_row)):
        if n % 16:
            raise EpgenError(f"native backend: a {what} must be a multiple of 16 bytes, got {n} "
                             f"(hidden_dim={cfg.hidden_dim})")


def check_same_protocol(protocol: str, arch: str, group) -> None:
    """Collective: every rank's op resolved the same intranode protocol (their configs are checked equal; their
    targets' thresholds could still differ), or ConfigError on every rank naming each rank's."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    everyone = collectives.gather_objects((protocol, arch), group)
    if len({p for p, _ in everyone}) > 1:
        raise ConfigError("intranode_protocol resolved differently across ranks (every rank must take the same "
                          "protocol): " + ", ".join(f"rank {r}: {p!r} on {a}" for r, (p, a) in enumerate(everyone)))


EP_ROLES = ("dispatch", "combine", "dispatch_ll", "combine_ll")  # the kernels specs/tuning.toml gives geometry to
_TUNED_AS = {"dispatch_ll_tail": "dispatch_ll"}  # kernels launched on another role's tuned geometry


def ep_kernels(backend) -> tuple:
    """(tuning role, kernel) of every EP kernel a native backend launches (low-latency ones when loaded; a kernel
    launched on another role's geometry under that role)."""
    return tuple((role, backend.k[role]) for role in EP_ROLES if role in backend.k) + \
        tuple((tuned, backend.k[role]) for role, tuned in _TUNED_AS.items() if role in backend.k)


def check_plan(cfg: EpDispatchCombineConfig, plan: Plan) -> None:
    """What the native kernels cannot take, said before anything is loaded or allocated."""
    check_rows(cfg, plan)
    if cfg.enable_std_moe and (cfg.dispatch_data_type is not None or cfg.dispatch_quant_type != "none"):
        raise EpgenError("enable_std_moe with fp8/fp4 payloads is not built yet in the native backend")
    if cfg.enable_grouped_layout:
        most = load_specs().arglists[load_specs().families["grouped_place"].args].limit("max_experts")
        if cfg.num_experts_per_rank > most:
            raise EpgenError(f"native backend: the grouped layout takes at most {most} experts per rank (its "
                             f"placement kernel keeps the group bounds in shared memory), got {cfg.num_experts_per_rank}")


class SlotMap:
    """One dispatch's slot map (int32 [T, k]: position * world + destination rank per pair, -1 none) and row count
    (int32 [1]), which its routing handle keeps past later dispatches (replays, backwards): the device addresses the
    kernels take (slots_ptr, total_ptr) and, made when asked for, the tensors (slots, total). It holds the memory
    they lie in: a row of a SlotMaps batch, or tensors of their own (SlotMap.of)."""

    __slots__ = ("T", "k", "slots_ptr", "total_ptr", "_held", "_row")

    def __init__(self, held: torch.Tensor, row: int, T: int, k: int, ptr: int):
        """Row `row` of batch `held` (int32 [n, T * k + 1]), whose device address is `ptr`."""
        self.T, self.k, self.slots_ptr, self.total_ptr = T, k, ptr, ptr + 4 * T * k
        self._held, self._row = held, row

    @classmethod
    def of(cls, slots: torch.Tensor, total: torch.Tensor) -> "SlotMap":
        """A slot map over tensors of its own (contiguous int32 [T, k] and [1]: a numbering under a receive cap, a
        handle the seed's API rebuilt from tensors)."""
        m = cls.__new__(cls)
        m.T, m.k = slots.shape
        m.slots_ptr, m.total_ptr, m._held, m._row = slots.data_ptr(), total.data_ptr(), (slots, total), None
        return m

    @property
    def slots(self) -> torch.Tensor:
        if self._row is None:
            return self._held[0]
        return self._held[self._row, :self.T * self.k].view(self.T, self.k)

    @property
    def total(self) -> torch.Tensor:
        if self._row is None:
            return self._held[1]
        return self._held[self._row, self.T * self.k:]


class SlotMaps:
    """Each dispatch's own SlotMap, cut from batches: one allocation per batch of calls (up to BATCH calls, about
    BATCH_BYTES each) and no tensor per call (the kernels take addresses; a handle's tensors are made when asked
    for), where a call of its own took an allocation and three views (~15 us of an eager dispatch's host time on
    the lent H200 host). Every map handed out is memory no other call gets; a batch is freed by torch once no map of
    it is held. A batch serves the calls of the stream it was allocated on (torch's allocator hands a freed block
    back to that stream alone: a batch used on another stream could be reused there while that stream's kernels
    still write it). Inside graph capture every call allocates its own, from the graph's pool: a captured kernel
    writes its slot map at every replay, so that memory must live as long as the graph, not as long as a batch's
    handles."""

    BATCH, BATCH_BYTES, KEYS = 64, 1 << 20, 16

    def __init__(self, device: torch.device):
        self.device = device
        # (stream, T, k) -> [batch, next row, rows, its address, bytes per row]
        self._batches: dict[tuple[int, int, int], list] = {}

    def take(self, T: int, k: int, capturing: bool = False, stream: int | None = None) -> SlotMap:
        """The slot map of a call of T tokens of top-k; capturing: the call is being captured into a graph; stream:
        the call's current stream (the driver's handle), if the caller has it."""
        if capturing:
            held = torch.empty((1, T * k + 1), dtype=torch.int32, device=self.device)
            return SlotMap(held, 0, T, k, held.data_ptr())
        if stream is None:
            stream = kernels.current_raw_stream(self.device.index) if self.device.type == "cuda" else 0
        key = (stream, T, k)
        batch = self._batches.get(key)
        if batch is None or batch[1] == batch[2]:
            n = max(1, min(self.BATCH, self.BATCH_BYTES // (4 * (T * k + 1))))
            block = torch.empty((n, T * k + 1), dtype=torch.int32, device=self.device)
            if key not in self._batches and len(self._batches) >= self.KEYS:  # many streams or token counts
                del self._batches[next(iter(self._batches))]  # the oldest goes
            batch = self._batches[key] = [block, 0, n, block.data_ptr(), 4 * (T * k + 1)]
        row = batch[1]
        batch[1] = row + 1
        return SlotMap(batch[0], row, T, k, batch[3] + row * batch[4])


def _layout_ptrs(*tensors) -> tuple:
    """Device addresses of a layout's outputs, in _aim_tail's order (0 for None)."""
    return tuple(0 if t is None else t.data_ptr() for t in tensors)


class NativeBackend:
    name = "native"

    def __init__(self, config: EpDispatchCombineConfig, group=None):
        cfg = self.config = config
        self.group = native_group(cfg, group)
        if cfg.world_size > 64:
            raise EpgenError(f"native intranode backend supports at most 64 ranks, got {cfg.world_size}")
        self.device, self.arch, self.num_sms, target = device_target("dispatch")
        self.wave = target.wave_size
        plan = self.plan = Plan.of(cfg, target)
        check_plan(cfg, plan)
        # the op's protocol, the same on every rank (never a rank-local token count), and the low-latency
        # buffers when it is "ll"
        self.protocol, self.ll_tokens, self.capped = plan.protocol, plan.ll_tokens, plan.capped
        self.k = plan.load(self.arch)  # every kernel this op can use, loaded before the first call
        check_same_protocol(self.protocol, self.arch, self.group)
        self.protocols = (self.protocol,)
        self.last_protocol: str | None = None  # the protocol of the last dispatch or combine
        self._dispatch_converts = self.k["dispatch"].variant.converts  # quantizes in flight: rows copied by waves only
        self._numbering = (self.k["route_count"], self.k["route_slots"]) if self.capped else ()

        self._check_geometry()
        self._geo_memo: dict[tuple, tuple[int, int, bool]] = {}
        self._steady_how: dict[tuple, tuple] = {}  # steady_dispatch's decisions per (tokens, capturing, fresh, ...)
        self._site_memo: dict[tuple, tuple] = {}  # _combine_site's per (protocol, tokens, staged)
        self._combine_shape = (cfg.hidden_dim, cfg.combine_dtype, cfg.max_recv_tokens)  # (hidden, dtype, rows R)
        # a combine's output rows [T, hidden] as empty_like of a template of that shape (_combine_outputs)
        self._out_like: dict[int, torch.Tensor] = {}
        peer_bases = self._setup_workspace()
        self._trace = None  # trace_phases()'s buffer (diagnostics)
        self._slots: list[dict] = []  # per workspace slot (config max_inflight): the values of SLOT_ATTRS
        for slot in range(cfg.max_inflight):
            self._setup_slot(slot, peer_bases)
        self.slot = 0
        self._load_slot(0)
        self.one_kernel = "auto"  # grouped legs as one kernel each: "auto" | "always" | "never" (one_kernel_legs)
        self.direct = "auto"  # dispatch_grouped's direct kernel: "auto" | "always" | "never" (direct_dispatch)
        self._stream: int | None = None  # the stream of the last dispatch/combine launch (wait() syncs it)
        self.id_check = id_check_mode()  # "async" | "sync" | "off"
        self._bad_seen: int | None = 0  # the device's bad-id count already reported (None: unknown, re-based)
        self._late_words = 0  # ids synced_check reported before their host-mapped words arrived
        self._slot_maps = SlotMaps(self.device)
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    # Everything of one workspace slot (config max_inflight): one operation in flight owns it from its send
    # half to its receive half (runtime/pending.py). select_slot() swaps these attributes, so every method works
    # on the selected slot; with max_inflight = 1 there is one slot, always selected.
    SLOT_ATTRS = ("_slot_lay", "state", "total_recv", "recv_x", "recv_scales", "recv_w", "recv_idx", "recv_src",
                  "comb_x", "dargs", "cargs", "_had_weights", "_std", "_grp", "_last", "_placed")

    def _setup_slot(self, slot: int, peer_bases: int) -> None:
        cfg = self.config
        self._slot_lay = self.plan.slot_layout(self.layout, slot)
        self.state = torch.zeros(STATE_SIZE, dtype=torch.int32, device=self.device)
        self.total_recv = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._setup_views()
        self._setup_argument_blocks(peer_bases)
        self._had_weights = False  # whether the last dispatch carried weights (std-MoE packing uses them)
        self._std = self._std_moe_setup() if cfg.enable_std_moe else None
        self._grp = self._grouped_setup() if cfg.enable_grouped_layout else None
        if self._grp is not None:
            self._grp.update(self._grouped_launchers(self._grp))
            self._grouped_tail_fields(self._grp)
        self._placed = False  # whether this slot's last dispatch placed the grouped layout in its kernel
        self._last = None  # "dispatch" / "combine" (host order; the kernels keep their own in state "last")
        self._slots.append({name: getattr(self, name) for name in self.SLOT_ATTRS})

    def _load_slot(self, slot: int) -> None:
        for name, value in self._slots[slot].items():
            setattr(self, name, value)

    def trace_phases(self, buf: torch.Tensor | None) -> None:
        """Diagnostics (scripts/phase_trace.py): from now on the low-latency kernels, the direct grouped dispatch and
        the gather combine stamp their phases into `buf`, an int64 tensor [2, trace_blocks, trace_phases] on this
        op's device (dispatch_ll's or dispatch_direct's, then combine_ll's or combine_gather's: per
        block and phase the device's global timer in ns when that block reached it; the caller zeroes each call's
        entries first: a zero is a phase the block did not reach), or stop (None). Every workspace slot's argument
        blocks."""
        limits = self.k["dispatch"].limits
        if buf is not None:
            want = (2, limits["trace_blocks"], limits["trace_phases"])
            if not isinstance(buf, torch.Tensor) or buf.dtype != torch.int64 or tuple(buf.shape) != want \
                    or not buf.is_contiguous() or buf.device != self.device:
                raise InputError(f"trace_phases: buf must be a contiguous int64 tensor {list(want)} on {self.device}")
        at_dispatch, at_combine = (0, 0) if buf is None else (buf[0].data_ptr(), buf[1].data_ptr())
        for store in self._slots:
            store["dargs"].trace = at_dispatch
            store["cargs"].trace = at_combine
        self._trace = buf  # kept alive while the kernels may write it

    def select_slot(self, slot: int) -> None:
        """Work on workspace slot `slot` from now on (the op selects the slot of each call's operation)."""
        if slot == self.slot:
            return
        self._slots[self.slot].update((name, getattr(self, name)) for name in ("_had_weights", "_last", "_placed"))
        self.slot = slot
        self._load_slot(slot)

    def _setup_workspace(self) -> int:
        """The peer-mapped workspace laid out by the plan, the state words, the host-mapped error word;
        returns the device address of the peers' base pointers."""
        self.layout = self.plan.layout(self.config)
        self._ws = workspace.acquire(self.layout["total"], self.device, self.group)  # pooled: runtime/workspace.py
        self.buf, self.handle = self._ws.buf, self._ws.handle
        ptrs = getattr(self.handle, "buffer_ptrs_dev", None)
        self.peer_bases = None
        if not ptrs:
            self.peer_bases = torch.tensor(list(self.handle.buffer_ptrs), dtype=torch.int64, device=self.device)
            ptrs = self.peer_bases.data_ptr()
        # the error word lives in pinned host memory the kernels write through their mapping: the host reads
        # it without a device sync (check() before and after every call, and op.check() after graph replays)
        self.error = torch.zeros(ERROR_WORDS, dtype=torch.int32, pin_memory=True)
        self._error_words = (ctypes.c_int32 * ERROR_WORDS).from_address(self.error.data_ptr())
        return ptrs

    def _view(self, region: str, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """A workspace region as a tensor (fp4_x2: 1 byte per element)."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        raw = self.buf[self._slot_lay[region]:self._slot_lay[region] + nbytes]
        return (raw if dtype == torch.uint8 else raw.view(dtype)).view(shape)

    def _setup_views(self) -> None:
        """The receive buffers (and the gather combine's input) as tensors over the workspace."""
        cfg, plan, view = self.config, self.plan, self._view
        R, H, k = cfg.max_recv_tokens, cfg.hidden_dim, cfg.num_experts_per_token
        self.recv_x = view("recv_x", plan.out_dtype, (R, plan.out_cols))
        self.recv_scales = view("recv_scales", plan.scales_dtype, (R, plan.scale_cols)) if plan.scales_dtype else None
        self.recv_w, self.recv_idx = view("recv_w", torch.float32, (R, k)), view("recv_idx", torch.int32, (R, k))
        self.recv_src = view("recv_src", torch.int32, (R,))
        if plan.scatter:
            self.comb_x = torch.empty((R, H), dtype=cfg.combine_dtype, device=self.device)  # pushed from directly
        else:
            self.comb_x = view("comb_x", cfg.combine_dtype, (R, H))

    def _setup_argument_blocks(self, peer_bases: int) -> None:
        """The EP kernels' argument structs (specs/kernels.toml [args.ep]): dispatch's and combine's, filled with
        everything a call does not change."""
        cfg, plan, lay = self.config, self.plan, self._slot_lay
        R, H, k = cfg.max_recv_tokens, cfg.hidden_dim, cfg.num_experts_per_token
        common = dict(state=self.state.data_ptr(), total_recv=self.total_recv.data_ptr(), peer_bases=peer_bases,
                      error_word=kernels.host_mapped_pointer(self.error),
                      timeout_ns=min(max(int(cfg.timeout_s * 1e9), 1), 1 << 62),
                      off_signal=lay["signal"], off_counter=lay["counter"], off_recv_x=lay["recv_x"],
                      off_recv_scales=lay["recv_scales"], off_recv_w=lay["recv_w"], off_recv_idx=lay["recv_idx"],
                      off_recv_src=lay["recv_src"], hidden=H, k=k, experts_per_rank=cfg.num_experts_per_rank,
                      num_experts=cfg.num_experts, rank=cfg.rank, world=cfg.world_size, max_recv=R,
                      max_tokens=cfg.max_num_inp_token_per_rank, ll_tokens=self.ll_tokens,
                      ll_row_bytes=plan.ll_row, ll_cell_bytes=plan.ll_cell,
                      **({f"off_{n}": lay[n] for n in ("ll_cnt", "ll_x", "ll_c", "ll_map")} if self.ll_tokens else {}))
        self.dargs = self.k.struct("dispatch", **common, row_bytes=plan.in_row, wire_row_bytes=plan.wire_row,
                                   scale_row_bytes=plan.scale_row)
        comb = dict(off_scat_x=lay["scat_x"], off_scat_s=lay["scat_s"], off_scat_w=lay["scat_w"],
                    wire_row_bytes=plan.scat_row, scale_row_bytes=plan.scat_scale_row) if plan.scatter else \
            dict(off_comb_x=lay["comb_x"], off_comb_w=lay["comb_w"], wire_row_bytes=plan.comb_row)
        self.cargs = self.k.struct("combine", **common, row_bytes=plan.comb_row, **comb)

    @property
    def dispatch_out_dtype(self) -> torch.dtype:
        return self.plan.out_dtype

    @property
    def wire_dtype(self) -> torch.dtype:
        """The target's FP8 e4m3 (float8_e4m3fnuz on gfx942) used by in-kernel quantization."""
        return self.plan.fp8_dtype

    @property
    def capabilities(self) -> dict:
        return {"graph_capture": True, "arch": self.arch, "intranode_protocols": self.protocols,
                "ll_max_tokens": self.ll_tokens,
                "kernels": self.k.symbols(*EP_ROLES)}

    def _check_geometry(self, roles=None) -> None:
        """Every thread count this op can launch with (tuning table or config) fits its kernels (roles: (role,
        kernel) pairs, default ep_kernels): raise now, before any memory is allocated, rather than at a launch."""
        cfg = self.config
        if cfg.launch_threads % self.wave:
            raise EpgenError(f"launch_threads: {cfg.launch_threads} threads per block is not a whole number of "
                             f"{self.wave}-lane waves on {self.arch}")
        for role, kern in roles or ep_kernels(self):
            pinned = cfg.launch_thread_overrides(role, self.wave)
            counts = pinned or {b.threads for b in gspecs.buckets_for(load_specs(), self.arch, role, cfg.world_size)}
            too_many = sorted(t for t in counts if t > kern.max_threads)
            if too_many:
                where = "the config's launch geometry" if pinned else f"specs/tuning.toml [tuning.{self.arch}.{role}]"
                raise EpgenError(f"{where}: {too_many[-1]} threads per block, but {kern.symbol} launches with at "
                                 f"most {kern.max_threads} on this device (its registers per thread decide)")

    def _geometry(self, role: str, tokens: int, work_items: int, kern=None) -> tuple[int, int]:
        """(blocks, threads) from specs/tuning.toml for this call's token count, or the config's override.

        Grids are capped at what the device keeps resident at once (multiprocessors x the kernel's
        occupancy at that block size): the barriers of both kernels wait for every block. Dispatch grids
        also never exceed one wave per work item (one block per item when a block copies a row).
        """
        cfg = self.config
        tuned = _TUNED_AS.get(role, role)  # dispatch_ll_tail: dispatch_ll's table, capped by its own occupancy
        b = gspecs.geometry(load_specs(), self.arch, tuned, tokens, cfg.world_size)
        blocks, threads = cfg.launch_override(tuned, tokens, self.wave)
        threads = threads or b.threads
        blocks = blocks or b.blocks or self.num_sms
        if kern is None:
            kern = self.k[role]
        blocks = min(blocks, self.num_sms * kern.blocks_per_sm(threads))
        if role != "dispatch":
            return blocks, threads
        per_block = 1 if self._block_rows(tokens) else threads // self.wave
        return max(1, min(blocks, -(-work_items // per_block))), threads

    def _launch_geometry(self, role: str, tokens: int, work_items: int) -> tuple[int, int, bool]:
        """(blocks, threads, block rows) of a call, worked out once per (role, tokens) (host time)."""
        key = (role, tokens, work_items)
        geo = self._geo_memo.get(key)
        if geo is None:
            geo = self._geo_memo[key] = (*self._geometry(role, tokens, work_items),
                                         role == "dispatch" and self._block_rows(tokens))
        return geo

    def _resident(self, role: str, threads: int) -> int:
        """Every block the device keeps resident at once: the grid of an EP kernel that also runs the grouped
        layout's passes (their copies and sums want the whole GPU; the dispatch's own grid is sized to its rows)."""
        return self.num_sms * self.k[role].blocks_per_sm(threads)

    def _block_rows(self, tokens: int) -> bool:
        """Does a whole block copy each dispatch row (tuning table `rows`, or the config's launch_rows)?
        Never for a dispatch that quantizes in flight: its quantizer works per wave."""
        if self._dispatch_converts:
            return False
        cfg = self.config
        rows = cfg.launch_rows or gspecs.geometry(load_specs(), self.arch, "dispatch", tokens, cfg.world_size).rows
        return rows == "block"

    def wait(self) -> None:
        """Wait for this op's queued kernels: the stream of its last dispatch/combine and torch's current
        stream (graph replays run there), so that check() sees what they wrote. Nothing inside capture."""
        if torch.cuda.is_current_stream_capturing():
            return
        for stream in {kernels.current_raw_stream(), self._stream} - {None}:
            torch.cuda.ExternalStream(stream, device=self.device).synchronize()
        torch.cuda.synchronize(self.device)  # and every other stream of this process on the device

    def synced_check(self) -> None:
        """op.check() after wait(): check(), then the device's own count of expert ids >= num_experts.

        The host-mapped words can lag behind the kernel that wrote them (seen with ranks sharing a GPU:
        the words showed the id only at the op's next call); the count in device memory, read after the
        wait, cannot. Ids already reported by the words are not reported again."""
        if torch.cuda.is_current_stream_capturing():
            self.check()
            return
        bad = int(self.state[STATE_WORDS.index("bad_ids")])  # a device read: op.check() has waited already
        seen, self._bad_seen = self._bad_seen, bad
        self.check()  # the words first: a timeout, or the id itself when its words have arrived
        if self.id_check == "off" or seen is None or bad <= seen:
            return
        self._late_words = bad - seen  # the words of these ids may still arrive: they are reported here, once
        raise InputError(bad_id_message(self.config, None, bad - seen))


    def check(self, ids: str = "raise") -> None:
        """Raise EpTimeoutError if a kernel of this op gave up waiting; report an expert id >= num_experts
        a dispatch kernel noted since the last report: ids="raise" (op.check()) raises InputError, "warn"
        (the eager calls: raising on one rank between collective calls would leave its peers waiting)
        warns InputWarning, "skip" leaves it for later. Reads pinned host memory only."""
        words = self._error_words  # pinned host memory, read through ctypes (no torch indexing)
        if words[0] == 0 and (words[7] == 0 or ids == "skip"):
            return
        if words[0] == 0:  # a dispatch kernel noted an expert id >= num_experts
            bad, seen = words[6], words[5]
            words[5] = words[6] = words[7] = 0
            late, self._late_words = self._late_words, 0
            if self.id_check == "off" or 0 < seen <= late:  # synced_check reported these from the device count
                return
            msg = bad_id_message(self.config, bad, seen)
            if ids == "warn":
                self._bad_seen = None  # reported without reading the device count: synced_check re-bases
                warnings.warn(msg, errors.InputWarning, stacklevel=4)
                return
            raise InputError(msg)
        rank, peer, phase = (int(v) for v in self.error[1:4])
        what = PHASES.get(phase, f"phase {phase}")
        on = "its own blocks" if peer < 0 else f"rank {peer}"
        raise errors.EpTimeoutError(
            f"EP kernel timed out on rank {rank} waiting for {on} in the {what} (timeout_s="
            f"{self.config.timeout_s}); the op needs reset() on every rank, or a rebuild if a "
            f"peer process died", rank=rank, peer=peer, phase=what)

    @property
    def fuses_layout(self) -> bool:
        """Does this op's dispatch kernel place the grouped layout in its tail (dispatch_grouped: one kernel)?
        Every grouped op but the dequantizing ones (their placement decodes rows: grouped_place_fp8 / _fp4)."""
        return self._grp is not None and "tail" in self._grp

    def one_kernel_legs(self, protocol: str, leg: str = "dispatch", capturing: bool | None = None) -> bool:
        """Does a grouped leg ("dispatch" / "combine") of this protocol run as one kernel (grouped_tail.j2, combine_ll's
        push) rather than the EP kernel and the separate passes? self.one_kernel: "always" / "never" (tests,
        scripts/grouped_profile.py) or "auto":
        - combine_grouped: one kernel under both protocols where the op can stage (grouped_staged: not a scatter
          combine, not a dequantizing layout). combine_ll forms each row from its pairs as it pushes it
          (7.7 µs against 6.3 + 2.9 for combine_ll and grouped_reduce at one token, 8.2 against 7.2 + 3.3 at eight,
          results/2026-12-04-1xH200-W1-one-kernel-combine-d70606d/); the gather combine stages each row from its
          pairs with 128 bytes of loads in flight per thread (25dc3de): per layer in a graph 66.1 against 68.1 µs
          at 128 tokens, 120.2 against 120.9 at 512, 603.2 against 599.9 at 4096 (its kernel alone 16.6 / 33.6 /
          176.5 against grouped_reduce + gather 14.7 / 33.5 / 170.0), eager 111.1 / 135.4 / 622.9 against 127.6 /
          137.6 / 627.5 (one launch less), results/2026-12-04-1xH200-W1-staged-combine-25dc3de/; W = 1, one H200;
        - dispatch_grouped: a low-latency one only eager: inside a graph its tail (a grid barrier, then the passes on
          the EP grid) is slower than the separate passes (16.6 against 7.7 + 6.3 µs at one token), while an eager
          1-token layer is bound by the host's launches. The bandwidth protocol's never (results/2026-12-03-1xH200-
          W1-2b65c38/); its direct kernel (direct_dispatch) has no passes to fold."""
        if self.one_kernel != "auto":
            return self.one_kernel == "always"
        if leg == "combine":
            return True
        if capturing is None:  # (a dispatch's caller knows it already: _dispatch_prepare's "capturing")
            capturing = torch.cuda.is_current_stream_capturing()
        return protocol == "ll" and not capturing

    # --- dispatch: one launch (phase both), or a send launch and a receive launch (runtime/pending.py) ------
    def direct_dispatch(self, call: dict, layout_out) -> bool:
        """Does this dispatch_grouped call take the direct kernel (templates/kernels/dispatch_direct.j2: counts first,
        then every kept pair's row stored straight into its group on the destination; no receive buffer, no
        grouped_count / grouped_place)? Where the plan allows it (plan.direct_grouped: the op's grouped buffers are
        in the workspace), on bandwidth-protocol calls of the op's own layout (not fresh) with no routing handle
        given: "always" takes it wherever it is allowed, "never" nowhere, "auto" (the default) at world sizes up to
        plan.DIRECT_AUTO_MAX_WORLD (plan.direct_call). One kernel where there were three, faster at every size
        measured: 15.8 against 19.6 µs of kernels at 128 tokens and 181.6 against 207.5 at 4096, W = 1 on one H200
        (results/2026-12-04-1xH200-W1-direct-tagged-86351a9/, …-direct-auto-ac9e2c2/; eager host time 49.6 against
        69.7 µs per call at 128 tokens). Above two ranks its time is not yet measured (correct at 4 and 8 ranks
        sharing one GPU; docs/PERF.md): those ops keep the three kernels until it is."""
        return direct_call(self.direct, self.plan.direct, call["protocol"], layout_out is not None,
                           bool(call["replay"]), self.config.world_size)

    def dispatch(self, x, weights, scales, indices, routing, layout: bool = False, layout_out=None):
        """layout=True (fuses_layout ops): the dispatch kernel may also place the grouped layout (one_kernel_legs;
        one-call launches only), into layout_out (fresh_grouped()'s tensors) when given."""
        call = self._dispatch_prepare(x, weights, scales, indices, routing)
        call["direct"] = layout and self.direct_dispatch(call, layout_out)
        call["layout"] = layout and not call["direct"] and self.one_kernel_legs(call["protocol"],
                                                                                capturing=call["capturing"])
        call["layout_out"] = layout_out
        self._dispatch_launch(call, PHASE_BOTH)
        return self._dispatch_outputs(call["weights"], call["map"], call["protocol"])

    # --- the steady path (op._steady_dispatch / _steady_combine and their grouped forms) ------------------------
    def steady_ready(self, routing=None) -> bool:
        """May the next call take the steady path? Not while an error word is up (the full path reports it), nor where
        a dispatch numbers its slots first (a receive cap under the bandwidth protocol) or checks ids on the host;
        a combine's routing must carry this backend's slot map."""
        words = self._error_words
        return not (words[0] or words[7]) and self.id_check != "sync" and \
            not (self.capped and self.protocol == "bw") and \
            (routing is None or isinstance(routing.extra.get("map"), SlotMap))

    def steady_dispatch(self, x, weights, indices, T: int, out: dict | None = None, stream: int | None = None,
                        grouped: bool = True, routing=None):
        """dispatch(x, weights, None, indices, routing, layout=grouped and fuses_layout, layout_out=out) of a call the
        op checked (steady_ready(routing) held): the same launch and state, its decisions (direct kernel, placing
        tail, geometry) made once per (token count, capture, fresh layout, grouped, protocol, replay, modes) and the
        argument block's changing fields alone written; stream: the call's current stream (op._follow's), or None
        to look it up; routing: a replay's handle (its slot map and protocol), or None."""
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if routing is None:
            protocol, replay = self.protocol, 0
        else:
            protocol, replay = routing.extra["protocol"], 1
        modes, key = (self.one_kernel, self.direct), (T, capturing, out is not None, grouped, protocol, replay)
        how = self._steady_how.get(key)
        if how is None or how[0] != modes:
            layout = grouped and self.fuses_layout
            direct = layout and direct_call(self.direct, self.plan.direct, protocol, out is not None, bool(replay),
                                            self.config.world_size)
            placed = layout and not direct and self.one_kernel_legs(protocol, capturing=capturing)
            how = self._steady_how[key] = (modes, direct, placed,
                                           self._dispatch_site(protocol, T, PHASE_BOTH, placed, direct))
        _, direct, placed, site = how
        sm = self._slot_maps.take(T, self.config.num_experts_per_token, capturing, stream) if routing is None else \
            routing.extra["map"]
        self._had_weights = weights is not None
        self._launch_dispatch(x, weights, None, indices, sm, replay, PHASE_BOTH, protocol, placed, direct, out, site,
                              stream)
        return self._dispatch_outputs(weights, sm, protocol)

    def steady_combine(self, expert_out, weights, routing, stream: int | None = None,
                       pair_pos: torch.Tensor | None = None, apply_weights: bool = False):
        """combine(expert_out, weights, None, routing), or with pair_pos (a layout's pair map)
        combine_grouped_staged(expert_out, routing, apply_weights, pair_pos), of a call the op checked
        (steady_ready(routing), and grouped_staged with pair_pos, held): the same launch and state through the full
        path's writer; stream: as steady_dispatch's."""
        sm = routing.extra["map"]
        out, out_w = self._combine_outputs(sm, weights)
        stage = 0 if pair_pos is None else pair_pos.data_ptr()
        apply = int(stage != 0 and apply_weights and self._had_weights)
        self._launch_combine(expert_out, weights, sm, out, out_w, stage, apply, routing.extra.get("protocol", "bw"),
                             PHASE_BOTH, stream)
        return out, out_w

    def _dispatch_site(self, protocol: str, T: int, phase: int, placed: bool, direct: bool) -> tuple:
        """(role, grid, threads, block_rows or None) of a dispatch launch: the direct kernel on every resident block
        (up to one per multiprocessor), dispatch_ll on its own grid (dispatch_ll_tail where it places the layout: the
        same grid, few pairs), the bandwidth dispatch on its tuned grid, every resident block where it places the
        layout, one block for its receive half (block 0's wait for the arrivals alone, templates/kernels/dispatch.j2)."""
        if direct:
            threads = self.k["dispatch_direct"].max_threads
            grid = min(self.num_sms, self._resident("dispatch_direct", threads), DIRECT_MAX_GRID)
            return "dispatch_direct", grid, threads, None
        if protocol == "ll":
            role = "dispatch_ll_tail" if placed else "dispatch_ll"
            return (role, *self._launch_geometry(role, T, T)[:2], None)
        blocks, threads, block_rows = self._launch_geometry("dispatch", T, T * self.config.world_size)
        blocks = self._resident("dispatch", threads) if placed else blocks
        return "dispatch", 1 if phase == PHASE_RECV else blocks, threads, int(block_rows)

    def _combine_site(self, protocol: str, T: int, staged: bool) -> tuple:
        """(role, grid, threads) of a combine launch, worked out once per (protocol, tokens, staged): a grouped staging
        (staged) runs the gather combine on every resident block (its staging pass sums pairs), the low-latency one
        on its own grid (each pushing wave sums its row's pairs)."""
        site = self._site_memo.get((protocol, T, staged))
        if site is None:
            role = "combine_ll" if protocol == "ll" else "combine"
            blocks, threads, _ = self._launch_geometry(role, T, T)
            site = self._site_memo[(protocol, T, staged)] = \
                (role, self._resident(role, threads) if staged and role == "combine" else blocks, threads)
        return site

    def dispatch_send(self, x, weights, scales, indices, routing) -> dict:
        """The send half: the rows leave for their destinations (both protocols), nothing waits for them;
        -> the call, for dispatch_receive."""
        call = self._dispatch_prepare(x, weights, scales, indices, routing)
        self._dispatch_launch(call, PHASE_SEND)
        return call

    def dispatch_receive(self, call: dict):
        """The receive half of a dispatch_send call (its slot selected): waits for every peer's rows, publishes
        total_recv; -> what dispatch returns."""
        self.check(ids="warn")
        self._dispatch_launch(call, PHASE_RECV)
        return self._dispatch_outputs(call["weights"], call["map"], call["protocol"])

    def _dispatch_prepare(self, x, weights, scales, indices, routing) -> dict:
        self.check(ids="warn")
        cfg = self.config
        T, k = x.shape[0], cfg.num_experts_per_token
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()  # asked once per call
        if self.id_check == "sync" and routing is None and not capturing:
            check_expert_ids(cfg, indices)
        protocol = routing.extra["protocol"] if routing is not None else self.protocol
        if routing is not None:  # replay: the handle's slots and row count, no claims
            sm = routing.extra["map"]
        elif self.capped and protocol == "bw":  # below the worst case: (source rank, token) order decides who is dropped
            sm = SlotMap.of(*self._ordered_slots(indices))
        else:  # the low-latency dispatch numbers its rows in (source rank, token) order itself
            sm = self._slot_maps.take(T, k, capturing)
        self._had_weights = weights is not None
        return {"x": x, "weights": weights, "scales": scales, "indices": indices, "map": sm,
                "protocol": protocol, "replay": int(routing is not None or (self.capped and protocol == "bw")),
                "capturing": capturing}

    def _dispatch_launch(self, call: dict, phase: int) -> None:
        layout = call.get("layout", False) and phase == PHASE_BOTH
        direct = bool(call.get("direct")) and phase == PHASE_BOTH  # counts, then the rows straight into the groups
        site = self._dispatch_site(call["protocol"], call["x"].shape[0], phase, layout, direct)
        self._launch_dispatch(call["x"], call["weights"], call["scales"], call["indices"], call["map"], call["replay"],
                              phase, call["protocol"], layout, direct, call.get("layout_out"), site)

    def _launch_dispatch(self, x, weights, scales, indices, sm: SlotMap, replay: int, phase: int, protocol: str,
                         placed: bool, direct: bool, out: dict | None, site: tuple, stream: int | None = None) -> None:
        """Write a dispatch's changing fields into the argument block (dargs) and launch it at `site`
        (_dispatch_site): the full path's and the steady path's one writer. placed: the tail places the layout
        into the op's buffers, or into `out` (a fresh layout's: every row and pair then); direct: the direct kernel
        writes the op's buffers; stream: the call's, or None to look it up."""
        a = self.dargs
        a.x, a.indices, a.slots, a.replay_total, a.replay = x.data_ptr(), indices.data_ptr(), sm.slots_ptr, \
            sm.total_ptr, replay
        a.weights, a.has_weights = (0, 0) if weights is None else (weights.data_ptr(), 1)
        a.scales = 0 if scales is None else scales.data_ptr()
        a.num_tokens, a.phase = x.shape[0], phase
        if placed or direct:  # (a direct call never has a fresh layout: plan.direct_call)
            self._aim_tail(self._grp["tail"] if out is None else _layout_ptrs(*self._fresh_outputs(out)))
            if placed:
                a.grp_zero_padding = int(out is not None)
        else:
            a.grp_x, a.aimed = 0, None
        role, grid, threads, block_rows = site
        if block_rows is not None:
            a.block_rows = block_rows
        self._stream = self.k.launch_struct(role, grid, threads, a, stream)
        if phase != PHASE_SEND:
            self._placed = placed or direct
            self._last, self.last_protocol = "dispatch", protocol
        if self._error_words[0]:  # a kernel gave up waiting (check's own test, without the call)
            self.check(ids="skip")

    def _dispatch_outputs(self, weights, sm: SlotMap, protocol: str):
        cfg = self.config
        if cfg.strict_capacity and not torch.cuda.is_current_stream_capturing():
            raise_if_dropped(cfg, self.dropped_count())
        out_w = self.recv_w if weights is not None else None
        return self.recv_x, out_w, self.recv_scales, self.recv_idx, self.total_recv, \
            {"extra": {"map": sm, "protocol": protocol, "recv_src": self.recv_src}}

    def _ordered_slots(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots under a receive cap: rows numbered in (source rank, token) order (routing.ordered_slots),
        so the same rows are kept and dropped on every run; the counts cross ranks in one small
        all-gather on the op's group. The kernel then runs in replay mode on these slots."""
        cfg = self.config
        slots, total, dropped = ordered_slots(indices, cfg.rank, cfg.world_size, cfg.num_experts_per_rank,
                                              cfg.num_experts, cfg.max_recv_tokens,
                                              lambda counts: all_gather_counts(counts, self.group), self._numbering)
        self.state[STATE_WORDS.index("dropped")].copy_(dropped)
        self.state[STATE_WORDS.index("bad_ids")].add_((indices >= cfg.num_experts).sum().to(torch.int32))
        return slots, total

    def _std_moe_setup(self) -> dict:
        """Standard-MoE buffers and kernels (bf16/fp32 payloads), made at construction."""
        cfg = self.config
        E, C, H, R, k = (cfg.num_experts_per_rank, cfg.resolved_expert_capacity, cfg.hidden_dim,
                         cfg.max_recv_tokens, cfg.num_experts_per_token)
        dev = self.device
        return {
            "x": torch.empty((E, C, H), dtype=cfg.data_type, device=dev),
            "count": torch.zeros(E, dtype=torch.int32, device=dev),
            "src": torch.full((E, C), -1, dtype=torch.int32, device=dev),
            "w": torch.zeros((E, C), dtype=torch.float32, device=dev),
            "pair_pos": torch.full((R * k,), -1, dtype=torch.int32, device=dev),
            "dropped": torch.zeros(E, dtype=torch.int32, device=dev),
        }

    def convert_dispatch_output(self):
        """-> (packed_x [E, C, H], packed_count [E], packed_src [E, C] = row*k+j or -1, packed_weights [E, C]).

        Buckets are ordered by (received row, k); rows of packed_x past packed_count are not written.
        """
        st, cfg = self._std, self.config
        self.k.launch("std_moe_pack", cfg.num_experts_per_rank, BLOCK, recv_x=self.recv_x, recv_idx=self.recv_idx,
                      recv_w=self.recv_w, total_recv=self.total_recv, packed_x=st["x"], packed_count=st["count"],
                      packed_src=st["src"], packed_w=st["w"], pair_pos=st["pair_pos"], dropped=st["dropped"],
                      k=cfg.num_experts_per_token, first_expert=cfg.rank * cfg.num_experts_per_rank,
                      capacity=cfg.resolved_expert_capacity, row_bytes=self.plan.in_row,
                      has_weights=int(self._had_weights))
        return st["x"], st["count"], st["src"], st["w"]

    def _combine_dst(self, st: dict) -> torch.Tensor:
        """Where a conversion writes the combine input: this op's combine buffer (zero-copy), except right
        after a combine, whose peers may still be reading that buffer (only the next dispatch orders their
        reads before this rank's writes): then a tensor of its own, which combine stages after its entry
        barrier."""
        if self._last != "combine":
            return self.comb_x
        if "restage" not in st:
            st["restage"] = torch.empty_like(self.comb_x)
        return st["restage"]

    def _rows_grid(self) -> int:
        """Blocks of a kernel with one thread per (received row, 8 elements), grid-stride."""
        items = self.config.max_recv_tokens * self.config.hidden_dim // 8
        return max(1, min(8 * self.num_sms, -(-items // BLOCK)))

    def _reduce_grid(self) -> int:
        """Blocks of a grouped_reduce launch: enough for its small-batch form (specs/kernels.toml [args.grouped_reduce]
        limits: small_items (row, 8 elements) items per block, one pair per thread of an item's column) to cover
        every receivable row, up to the blocks the device keeps resident at once (past them its blocks would run in
        turns, each turn a row load's latency: the kernel takes the row loop when its rows need more)."""
        items = self.config.max_recv_tokens * self.config.hidden_dim // 8
        kern = self.k["grouped_reduce"]
        resident = self.num_sms * kern.blocks_per_sm(BLOCK)
        return max(self._rows_grid(), min(resident, -(-items // kern.limits["small_items"])))

    def convert_combine_input(self, expert_out, routing):
        """Weighted expert outputs [E, C, H] -> combine input rows (see _combine_dst for where)."""
        st, cfg = self._std, self.config
        dst = self._combine_dst(st)
        self.k.launch("std_moe_unpack", self._rows_grid(), BLOCK, expert_out=expert_out, recv_idx=self.recv_idx,
                      pair_pos=st["pair_pos"], packed_w=st["w"], total_recv=self.total_recv, out=dst,
                      k=cfg.num_experts_per_token, first_expert=cfg.rank * cfg.num_experts_per_rank,
                      num_local=cfg.num_experts_per_rank, hidden=cfg.hidden_dim)
        return dst

    # --- the grouped-GEMM layout (runtime/grouped.py; kernels grouped_count / grouped_place / grouped_reduce)
    def _grouped_setup(self) -> dict:
        """Grouped-layout buffers and kernels, made at construction: P = resolved_grouped_capacity rows."""
        cfg, plan, dev = self.config, self.plan, self.device
        E, P, Rk = cfg.num_experts_per_rank, cfg.resolved_grouped_capacity, cfg.max_recv_tokens * cfg.num_experts_per_token
        i32 = dict(dtype=torch.int32, device=dev)
        if cfg.grouped_dequantize:  # the rows decoded into data_type as they are placed: no scales in the layout
            x = torch.empty((P, cfg.hidden_dim), dtype=cfg.data_type, device=dev)
            scales, x_view, scales_view = None, x, None
        elif plan.direct:  # in the workspace: the direct dispatch's peers write them (no scales on that path)
            x = self._view("grouped_x", torch.uint8, (P, plan.wire_row))
            scales, scales_view = None, None
            x_view = x.view(plan.out_dtype) if plan.out_dtype != torch.uint8 else x
        else:
            x = torch.empty((P, plan.wire_row), dtype=torch.uint8, device=dev)
            scales = torch.empty((P, plan.scale_row), dtype=torch.uint8, device=dev) if plan.scales_dtype else None
            x_view = x.view(plan.out_dtype) if plan.out_dtype != torch.uint8 else x
            scales_view = None if scales is None else (scales.view(plan.scales_dtype)
                                                       if plan.scales_dtype != torch.uint8 else scales)
        rows = self._grouped_direct_rows() if plan.direct else {
            "src": torch.full((P,), -1, **i32), "m_indices": torch.full((P,), -1, **i32),
            "weights": torch.zeros(P, dtype=torch.float32, device=dev), "pair_pos": torch.full((Rk,), -1, **i32)}
        return {
            "x": x, "scales": scales, "x_view": x_view, "scales_view": scales_view,
            "out_row": x.shape[1] * x.element_size(),
            "offs": torch.zeros(E, **i32), "counts": torch.zeros(E, **i32), "raw_counts": torch.zeros(E, **i32),
            "dropped": torch.zeros(1, **i32), "pair_rel": torch.zeros(Rk, **i32), **rows,
        }

    def _grouped_direct_rows(self) -> dict:
        """With the direct dispatch (plan.direct) the per-row buffers its peers write, as views of the workspace: each
        grouped row's pair id, local expert and weight, and the pair map, marked empty as the local ones start."""
        cfg, view = self.config, self._view
        P, Rk = cfg.resolved_grouped_capacity, cfg.max_recv_tokens * cfg.num_experts_per_token
        rows = view("grouped_rows", torch.int32, (3, P))
        src, m_indices, weights = rows[0], rows[1], rows[2].view(torch.float32)
        src.fill_(-1)
        m_indices.fill_(-1)
        weights.zero_()
        pair_pos = view("grouped_map", torch.int32, (Rk,))
        pair_pos.fill_(-1)
        return {"src": src, "m_indices": m_indices, "weights": weights, "pair_pos": pair_pos}

    def _grouped_launchers(self, g: dict) -> dict:
        """The grouped layout's kernels with the op's persistent buffers and sizes bound once (host time per call:
        only the arguments that change are checked and written), and the layout's drop-count view."""
        cfg, plan = self.config, self.plan
        k, first = cfg.num_experts_per_token, cfg.rank * cfg.num_experts_per_rank
        # a small batch's pairs are numbered by every placing block itself (no grouped_count launch before it)
        g["count_here"] = cfg.max_recv_tokens * k <= self.k["grouped_place"].limits["small_pairs"]
        placing = dict(  # what every placement reads, and its sizes
            recv_x=self.recv_x, recv_scales=self.recv_scales, recv_w=self.recv_w, recv_idx=self.recv_idx,
            total_recv=self.total_recv, pair_rel=g["pair_rel"], counts=g["raw_counts"], k=k, first_expert=first,
            num_local=cfg.num_experts_per_rank, align=cfg.expert_alignment, capacity=cfg.resolved_grouped_capacity,
            row_bytes=plan.wire_row, scale_bytes=plan.scale_row if plan.scales_dtype else 0, out_row_bytes=g["out_row"],
            max_recv=cfg.max_recv_tokens, count_here=int(g["count_here"]))
        return {
            "count_launch": self.k["grouped_count"].bind(recv_idx=self.recv_idx, total_recv=self.total_recv,
                                                         pair_rel=g["pair_rel"], counts=g["raw_counts"], k=k,
                                                         first_expert=first),
            "place_launch": self.k["grouped_place"].bind(
                **placing, pair_pos=g["pair_pos"], out_scales=g["scales"], offs=g["offs"], kept_counts=g["counts"],
                src=g["src"], m_indices=g["m_indices"], weights=g["weights"], dropped=g["dropped"],
                grouped_end=self.state[STATE_WORDS.index("grouped_end")].view(1)),
            # a fresh layout's (fresh_grouped): the outputs named per launch; the op's own rows untouched
            "place_fresh": self.k["grouped_place"].bind(**placing, zero_padding=1, grouped_end=None),
            "reduce_launch": self.k["grouped_reduce"].bind(pair_pos=g["pair_pos"], recv_w=self.recv_w,
                                                           total_recv=self.total_recv, k=k, hidden=cfg.hidden_dim,
                                                           pair_w=None, out_w=None),
            "dropped_view": g["dropped"][0],
        }

    def _grouped_tail_fields(self, g: dict) -> None:
        """The layout's buffers in the EP argument blocks (specs/kernels.toml [args.ep] grp_*), written once: a
        dispatch_grouped sets grp_x to run the placement in its dispatch kernel's tail, a combine_grouped sets
        grp_pair_pos to stage each received row as the weighted sum of its pairs (one kernel per leg). Not for
        the dequantizing layouts (their placement decodes) nor for the scatter combine (it pushes staged rows)."""
        cfg = self.config
        if cfg.grouped_dequantize:
            return
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        a = self.dargs
        a.grp_pair_rel, a.grp_counts = ptr(g["pair_rel"]), ptr(g["raw_counts"])
        a.grp_align, a.grp_capacity = cfg.expert_alignment, cfg.resolved_grouped_capacity
        if self.plan.direct:  # the direct dispatch's count table (its peers' at the same offset)
            a.grp_cnt = self.buf.data_ptr() + self._slot_lay["grouped_cnt"]
        g["tail"] = _layout_ptrs(g["x"], g["scales"], g["pair_pos"], g["offs"], g["counts"], g["src"], g["m_indices"],
                                 g["weights"], g["dropped"])
        self._aim_tail(g["tail"])
        if not self.plan.scatter:
            g["stage"] = g["pair_pos"].data_ptr()

    def _aim_tail(self, ptrs: tuple) -> None:
        """Point the dispatch tail's layout outputs (dargs grp_*) at the op's buffers or a fresh layout's."""
        a = self.dargs
        if a.__dict__.get("aimed") is ptrs:  # the op's own buffers again (the eager loop): nine fields unchanged
            return
        (a.grp_x, a.grp_scales, a.grp_pair_pos, a.grp_offs, a.grp_kept, a.grp_src, a.grp_m_indices, a.grp_weights,
         a.grp_dropped) = ptrs
        a.aimed = ptrs

    def fresh_grouped(self, out_x: torch.Tensor | None = None) -> dict:
        """The tensors of a layout of the call's own (op.dispatch_grouped(fresh=True)): x (out_x, else a new one),
        scales, and one int32 block holding offs, counts, src, m_indices, dropped and the pair map
        (grouped.block_parts), weights float32 [P]: three or four allocations, written whole by the placing
        kernel (no stale entry: zero_padding), so nothing is copied out of the op's buffers afterwards. Made before
        the call's slot is selected: nothing here is a slot's (_fresh_outputs names the kernels' targets then)."""
        cfg, g = self.config, self._grp
        E, P = cfg.num_experts_per_rank, cfg.resolved_grouped_capacity
        x = torch.empty_like(g["x_view"]) if out_x is None else out_x
        scales = torch.empty_like(g["scales_view"]) if g["scales_view"] is not None else None
        block = torch.empty(grouped.block_size(E, P, cfg.max_recv_tokens * cfg.num_experts_per_token),
                            dtype=torch.int32, device=self.device)
        weights = torch.empty(P, dtype=torch.float32, device=self.device)
        return {"x": x, "scales": scales, "block": block, "weights": weights,
                "parts": grouped.block_parts(block, E, P)}

    def _fresh_outputs(self, out: dict) -> tuple:
        """What the placing kernels write for fresh layout `out`, in _aim_tail's order: its tensors."""
        offs, counts, src, m_idx, dropped, pair_pos = out["parts"]
        return out["x"], out["scales"], pair_pos, offs, counts, src, m_idx, out["weights"], dropped

    def grouped_layout(self, seq: int = 0, out: dict | None = None) -> grouped.GroupedLayout:
        """The layout the last dispatch placed in its kernel (dispatch_grouped), or two launches on the current
        stream, sized by the device's total_recv (no host sync); seq: the op's number of that dispatch. out: a
        fresh_grouped() layout the rows and every other output go to, written whole (the dispatch that placed
        them in its kernel was given the same one: op.dispatch_grouped(fresh=True))."""
        g = self._grp
        if not self._placed:
            if not g["count_here"]:
                g["count_launch"].launch(self.config.num_experts_per_rank, BLOCK)
            if out is None:
                g["place_launch"].launch(2 * self.num_sms, BLOCK, has_weights=int(self._had_weights), out_x=g["x"],
                                         zero_padding=0)
            else:
                x, scales, pair_pos, offs, counts, src, m_idx, weights, dropped = self._fresh_outputs(out)
                g["place_fresh"].launch(2 * self.num_sms, BLOCK, has_weights=int(self._had_weights), out_x=x,
                                        out_scales=scales, pair_pos=pair_pos, offs=offs, kept_counts=counts,
                                        src=src, m_indices=m_idx, weights=weights, dropped=dropped)
        if out is None:
            return grouped.GroupedLayout(x=g["x_view"], scales=g["scales_view"], offs=g["offs"], counts=g["counts"],
                                         src=g["src"], m_indices=g["m_indices"], weights=g["weights"],
                                         dropped=g["dropped_view"], pair_pos=g["pair_pos"], seq=seq)
        self._placed = False  # the op's buffers do not hold this layout: a later grouped_layout() places again
        offs, counts, src, m_idx, dropped, pair_pos = out["parts"]
        return grouped.GroupedLayout(x=out["x"], scales=out["scales"], offs=offs, counts=counts, src=src,
                                     m_indices=m_idx, weights=out["weights"], dropped=dropped.view(()),
                                     pair_pos=pair_pos, seq=seq, block=out["block"])

    def grouped_reduce(self, expert_out, apply_weights: bool, pair_pos: torch.Tensor | None = None) -> torch.Tensor:
        """Grouped expert outputs [P, H] -> combine input rows (see _combine_dst for where), one launch; pair_pos:
        the layout's pair map (a fresh layout's own; None: the op's buffer)."""
        g = self._grp
        dst = self._combine_dst(g)
        apply = int(apply_weights and self._had_weights)
        if pair_pos is None or pair_pos.data_ptr() == g["pair_pos"].data_ptr():
            g["reduce_launch"].launch(self._reduce_grid(), BLOCK, expert_out=expert_out, out=dst, apply_weights=apply)
        else:
            cfg = self.config
            self.k["grouped_reduce"].launch(self._reduce_grid(), BLOCK, expert_out=expert_out, pair_pos=pair_pos,
                                            recv_w=self.recv_w, total_recv=self.total_recv, out=dst,
                                            k=cfg.num_experts_per_token, hidden=cfg.hidden_dim, apply_weights=apply,
                                            pair_w=None, out_w=None)
        return dst

    def sum_pairs(self, grouped_rows: torch.Tensor, pair_pos: torch.Tensor,
                  pair_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows in the grouped layout [P, H] (combine dtype) -> ([R, H] combine dtype: every received row the float32
        sum, in ascending column, of its pairs' rows under the pair map `pair_pos` [R * k] (a saved one: -1 no
        pair), rounded once, as combine_grouped's reduce without weights; with pair_w [P] float32, [R, k] float32:
        each pair's grouped row's value, 0 without a pair, else None), one launch of the grouped_reduce kernel over
        all R rows (dispatch's backward, runtime/autograd.py)."""
        cfg, g = self.config, self._grp
        R, k = cfg.max_recv_tokens, cfg.num_experts_per_token
        if "all_rows" not in g:
            g["all_rows"] = torch.full((1,), R, dtype=torch.int32, device=self.device)
        out = torch.empty((R, cfg.hidden_dim), dtype=cfg.combine_dtype, device=self.device)
        out_w = torch.empty((R, k), dtype=torch.float32, device=self.device) if pair_w is not None else None
        self.k["grouped_reduce"].launch(self._reduce_grid(), BLOCK, expert_out=grouped_rows, pair_pos=pair_pos,
                                        recv_w=self.recv_w, total_recv=g["all_rows"], out=out, k=k,
                                        hidden=cfg.hidden_dim, apply_weights=0, pair_w=pair_w, out_w=out_w)
        return out, out_w

    def grouped_scale(self, x: torch.Tensor, src: torch.Tensor, w: torch.Tensor | None = None,
                      y: torch.Tensor | None = None, k: int = 0,
                      pair_pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Grouped rows row by row, one launch (templates/kernels/grouped_scale.j2), under the pair ids `src` [P]
        (-1: a padding row) -> (a fresh [P, H]: each filled row's x row times its weight w [P] float32 (one
        rounding), or copied without w; [P] float32 <y, x row> per filled row, or None without y), padding rows
        0 in both, their inputs never read. x row of grouped row p: x[p] (k = 0, x [P, H]) or x[src[p] // k]
        (k = experts per token, x the received rows [R, H] its pairs came from). combine_grouped's backward
        (runtime/autograd.py): x the replayed gradient rows, y the expert rows, w their weights. pair_pos (k > 0:
        the pair map [R * k] inverse to src, every entry defined, as a fresh layout's) takes the token-major form
        where k allows (limits.max_topk): each x row read once for all its pairs, the same bits."""
        P, H = src.shape[0], x.shape[1]
        out = torch.empty((P, H), dtype=x.dtype, device=self.device)
        dot = torch.empty((P,), dtype=torch.float32, device=self.device) if y is not None else None
        kern = self.k["grouped_scale"]  # blocks of the threads its family is compiled for (specs max_threads)
        if pair_pos is not None and not 0 < k <= kern.limits["max_topk"]:
            pair_pos = None  # the row-major form: every k
        recv_rows = pair_pos.numel() // k if pair_pos is not None else 0
        kern.launch(max(1, min(max(P, recv_rows), 8 * self.num_sms)), kern.variant.family.max_threads, x=x, y=y, w=w,
                    src=src, out=out, dot=dot, rows=P, hidden=H, apply_weights=int(w is not None),
                    want_dot=int(y is not None), k=k, pair_pos=pair_pos, recv_rows=recv_rows)
        return out, dot

    def std_moe_dropped(self) -> torch.Tensor:
        """(row, k) pairs past an expert's capacity in the last conversion (device int32 scalar)."""
        return self._std["dropped"].sum(dtype=torch.int32)

    def dropped_count(self) -> torch.Tensor:
        """Rows this rank dropped past the receive cap in the last dispatch (device int32 scalar)."""
        return self.state[STATE_WORDS.index("dropped")]

    def local_expert_count(self) -> torch.Tensor:
        """(received row, k) pairs per local expert after the last dispatch (device int32, no host sync)."""
        return local_expert_count(self.config, self.recv_idx, self.total_recv)

    def memory_report(self) -> dict:
        """Bytes of every workspace region (see docs/RUNTIME.md, Memory: the formula) plus the op's other device buffers."""
        lay = self.layout
        names = [n for n in lay if n != "total"]
        ordered = sorted(names, key=lambda n: lay[n])
        regions = {n: (lay[ordered[i + 1]] if i + 1 < len(ordered) else lay["total"]) - lay[n]
                   for i, n in enumerate(ordered)}
        extra = {}
        for slot, held in enumerate(self._slots):  # every workspace slot's own buffers (slot s > 0: NAME@s)
            named = {"state": held["state"].numel() * 4, "total_recv": 4}
            if self.plan.scatter:
                named["combine_in_view"] = held["comb_x"].numel() * held["comb_x"].element_size()
            for prefix, bufs in (("std_moe", held["_std"]), ("grouped", held["_grp"])):
                for name, t in (bufs or {}).items():
                    in_ws = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.buf.untyped_storage().data_ptr()
                    if isinstance(t, torch.Tensor) and not name.endswith("_view") and not in_ws:
                        named[f"{prefix}_{name}"] = t.numel() * t.element_size()
            extra.update((slot_name(n, slot), b) for n, b in named.items())
        return {"symmetric_workspace": lay["total"], "regions": regions, "other_device_buffers": extra,
                "total_device_bytes": lay["total"] + sum(extra.values()),
                "pinned_host_bytes": self.error.numel() * 4}

    def grouped_staged(self, routing) -> bool:
        """Does combine_grouped take one combine kernel for this routing (combine_grouped_staged)? Not where this
        op cannot (see _grouped_tail_fields), nor where one_kernel_legs says no: combine_grouped reduces first."""
        return self._grp is not None and "stage" in self._grp and \
            self.one_kernel_legs(routing.extra.get("protocol", "bw"), "combine")

    def combine_grouped_staged(self, expert_out, routing, apply_weights: bool, pair_pos: torch.Tensor | None = None):
        """Grouped expert outputs [P, H] -> combined rows in one combine kernel (gather or low-latency): its
        staging forms each received row from its pairs' grouped rows (grouped_tail.j2), so there is no reduce
        pass (grouped_staged(routing) holds); pair_pos: as grouped_reduce's."""
        call = self._combine_prepare(expert_out, None, routing)
        stage = self._grp["stage"] if pair_pos is None else pair_pos.data_ptr()
        call["stage"] = (stage, int(apply_weights and self._had_weights))
        self._combine_launch(call, PHASE_BOTH)
        return call["out"], call["out_w"]

    def combine_pairs(self, grouped_rows: torch.Tensor, routing, pair_pos: torch.Tensor,
                      pair_w: torch.Tensor | None = None):
        """dispatch_grouped's backward in one combine kernel (runtime/autograd.py; grouped_staged(routing) holds):
        rows in the grouped layout [P, H] (combine dtype) -> combine of every received row's float32 sum, in
        ascending column, of its pairs' rows under the saved pair map `pair_pos` [R * k], rounded once (the staging
        of combine_grouped_staged without weights), and with pair_w [P] float32 each pair's weight its grouped row's
        value, 0 without one (grp_pair_w). The same numbers as sum_pairs() then combine(), without the [R, H] rows
        between them. -> (out [T, H], out_w [T, k] float32 or None)."""
        call = self._combine_prepare(grouped_rows, pair_w, routing)  # (pair_w given: out_w [T, k] is allocated)
        call["weights"] = None  # the weights come from pair_w, per pair
        call["stage"] = (pair_pos.data_ptr(), 0)
        call["pair_w"] = 0 if pair_w is None else pair_w.data_ptr()
        self._combine_launch(call, PHASE_BOTH)
        return call["out"], call["out_w"]

    # --- combine: one launch (phase both), or a send launch and a receive launch (runtime/pending.py) -------
    def combine(self, expert_out, weights, indices, routing):
        call = self._combine_prepare(expert_out, weights, routing)
        self._combine_launch(call, PHASE_BOTH)
        return call["out"], call["out_w"]

    def combine_send(self, expert_out, weights, indices, routing) -> dict:
        """The send half: the low-latency combine pushes its rows to their origins; the gather combine stages
        them in this rank's combine buffer (its peers read them in their receive half). A scatter combine is
        not split yet: nothing launches here and its receive half runs the one-call kernel ("deferred")."""
        call = self._combine_prepare(expert_out, weights, routing)
        call["deferred"] = call["protocol"] == "bw" and self.plan.scatter
        if not call["deferred"]:
            self._combine_launch(call, PHASE_SEND)
        return call

    def combine_receive(self, call: dict):
        """The receive half of a combine_send call (its slot selected): -> what combine returns."""
        self.check(ids="warn")
        self._combine_launch(call, PHASE_BOTH if call["deferred"] else PHASE_RECV)
        return call["out"], call["out_w"]

    def _combine_prepare(self, expert_out, weights, routing) -> dict:
        self.check(ids="warn")
        cfg = self.config
        sm = routing.extra.get("map")
        if not isinstance(sm, SlotMap):
            raise InputError("combine: the routing handle carries no native slot map")
        out, out_w = self._combine_outputs(sm, weights)
        # the protocol of the dispatch: its slots and buffers
        return {"expert_out": expert_out, "weights": weights, "map": sm, "out": out, "out_w": out_w,
                "protocol": routing.extra.get("protocol", "bw"), "deferred": False}

    def _combine_outputs(self, sm: SlotMap, weights) -> tuple:
        """A combine's outputs: rows [T, H] of the combine dtype, weights [T, k] float32 where it has weights."""
        like = self._out_like.get(sm.T)
        if like is None:  # the template: one element expanded to [T, hidden], no memory of its own
            if len(self._out_like) >= 64:  # many token counts: start over
                self._out_like.clear()
            hidden, dtype, _ = self._combine_shape
            like = self._out_like[sm.T] = torch.empty((1, 1), dtype=dtype, device=self.device).expand(sm.T, hidden)
        # empty_like of a template skips torch.empty's parsing of a shape, a dtype and a device (~1 us of an eager
        # combine's host time); the template is no dense tensor, so the rows come out contiguous, as asked
        out = torch.empty_like(like, memory_format=torch.contiguous_format)
        return out, None if weights is None else torch.empty((sm.T, sm.k), dtype=torch.float32, device=self.device)

    def _combine_launch(self, call: dict, phase: int) -> None:
        stage, apply = call.get("stage", (0, 0))
        self._launch_combine(call["expert_out"], call["weights"], call["map"], call["out"], call["out_w"], stage, apply,
                             call["protocol"], phase, pair_w=call.get("pair_w", 0))

    def _launch_combine(self, expert_out, weights, sm: SlotMap, out, out_w, stage: int, apply: int, protocol: str,
                        phase: int, stream: int | None = None, pair_w: int = 0) -> None:
        """Write a combine's changing fields into the argument block (cargs) and launch it: the full path's and the
        steady path's one writer. A grouped staging (stage: the pair map's address; apply: weigh the pairs) reads
        expert_out [P, H] standing for the R received rows; the gather combine then runs on every resident block
        (its staging pass sums pairs), the low-latency one on its own grid (each pushing wave sums its row's pairs)
        (_combine_site); pair_w: with a staging, the address of a value per grouped row sent as each pair's weight
        (combine_pairs), 0 otherwise."""
        a, T = self.cargs, sm.T
        a.slots, a.num_tokens = sm.slots_ptr, T
        a.out, a.out_weights = out.data_ptr(), 0 if out_w is None else out_w.data_ptr()
        a.grp_pair_pos, a.grp_apply_weights = stage, apply
        a.expert_out, a.expert_rows = expert_out.data_ptr(), self._combine_shape[2] if stage else expert_out.shape[0]
        a.expert_weights, a.has_weights = (0, 0) if weights is None else (weights.data_ptr(), 1)
        a.grp_pair_w = pair_w
        if pair_w:
            a.has_weights = 1
        a.phase = phase
        self._stream = self.k.launch_struct(*self._combine_site(protocol, T, bool(stage)), a, stream)
        if phase != PHASE_SEND:
            self._last, self.last_protocol = "combine", protocol
        if self._error_words[0]:  # a kernel gave up waiting
            self.check(ids="skip")

    def combine_in_view(self) -> torch.Tensor:
        return self.comb_x

    def counters(self) -> dict[str, int]:
        """Device error counters (reads the device: not for use inside graph capture)."""
        vals = self.state.tolist()
        return {name: vals[i] for i, name in enumerate(STATE_WORDS)}

    def reset(self) -> None:
        """Collective: clear signals, counters, state and the error word on every rank.

        After a timeout this restores a usable op when every rank is alive (waits end within timeout_s).
        """
        torch.cuda.synchronize(self.device)  # kernels that gave up have exited by now
        dist.barrier(group=self.group)
        for slot, held in enumerate(self._slots):  # every slot's flags and counters (its regions before recv_x)
            lay = held["_slot_lay"]
            self.buf[lay["signal"]:lay["recv_x"]].zero_()
            held["state"].zero_()  # grouped_end too: every grouped row is marked padding again
            held["total_recv"].zero_()
            held["_last"], held["_placed"] = None, False
            if held["_grp"] is not None:
                held["_grp"]["src"].fill_(-1)
                held["_grp"]["m_indices"].fill_(-1)
                held["_grp"]["weights"].zero_()
        torch.cuda.synchronize(self.device)
        self.error.zero_()
        self._last, self._placed = None, False
        self._bad_seen, self._late_words = 0, 0
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def close(self) -> None:
        """Unload the kernels, free the op's device buffers and give the workspace back to the pool."""
        torch.cuda.synchronize(self.device)  # nothing of this op still runs on the workspace
        self.k.close()
        workspace.release(self._ws)
        self._slots = []
        self._ws = self._std = self._grp = self.dargs = self.cargs = self._slot_lay = None
        self._numbering = ()
        self.buf = self.handle = self.peer_bases = self.state = self.error = self.total_recv = None
        self._error_words = self.group = None  # a closed op keeps no process group alive
        self.recv_x = self.recv_scales = self.recv_w = self.recv_idx = self.recv_src = self.comb_x = None
