"""The native backend: generated dispatch / gather-combine kernels over peer-mapped memory.

Each rank owns one symmetric workspace (torch.distributed._symmetric_memory) laid out as below;
the kernels address a peer's copy through the peer base pointers. Everything is allocated and
every kernel loaded at construction; dispatch/combine only pack arguments and launch on torch's
current stream (no host sync, no allocation beyond the outputs), so they can be graph-captured.

Workspace (per rank, offsets 256-byte aligned):
  signal [world] int32 | counter [2] int32 | recv_x [R, H] | recv_w [R, k] f32 | recv_idx [R, k] i32 |
  recv_src [R] i32 | comb_x [R, H] | comb_w [R, k] f32          (R = max_recv_tokens, H = hidden)
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from generator.abi import STATE_SIZE, STATE_WORDS

from . import kernels
from .config import EpDispatchCombineConfig, spec_dtype
from .errors import EpgenError, InputError

BLOCK = 512
_ALIGN = 256


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def workspace_layout(cfg: EpDispatchCombineConfig) -> dict[str, int]:
    """Byte offsets of every region, and 'total': the workspace size (same on every rank)."""
    R, H, k = cfg.max_recv_tokens, cfg.hidden_dim, cfg.num_experts_per_token
    elem = torch.empty((), dtype=cfg.dispatch_dtype).element_size()
    sizes = [("signal", 4 * cfg.world_size), ("counter", 8), ("recv_x", R * H * elem), ("recv_w", R * k * 4),
             ("recv_idx", R * k * 4), ("recv_src", R * 4), ("comb_x", R * H * elem), ("comb_w", R * k * 4)]
    out, off = {}, 0
    for name, n in sizes:
        out[name] = off
        off += _align(n)
    out["total"] = off
    return out


class NativeBackend:
    name = "native"

    def __init__(self, config: EpDispatchCombineConfig, group=None):
        if not torch.cuda.is_available():
            raise EpgenError("kernel backend 'native' needs a GPU; use kernel_backend='torch' on CPU")
        if not dist.is_initialized():
            raise EpgenError("kernel backend 'native' needs torch.distributed initialised (NCCL/RCCL)")
        import torch.distributed._symmetric_memory as symm_mem

        cfg = self.config = config
        self.group = group or dist.group.WORLD
        if dist.get_world_size(self.group) != cfg.world_size or dist.get_rank(self.group) != cfg.rank:
            raise EpgenError(f"config says rank {cfg.rank} of {cfg.world_size}, the process group says rank "
                             f"{dist.get_rank(self.group)} of {dist.get_world_size(self.group)}")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.arch = kernels.device_arch(self.device)
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        dname = spec_dtype(cfg.dispatch_dtype).name
        row_bytes = cfg.hidden_dim * torch.empty((), dtype=cfg.dispatch_dtype).element_size()
        if row_bytes % 16:
            raise EpgenError(f"native backend: a row must be a multiple of 16 bytes (hidden_dim={cfg.hidden_dim})")
        # every kernel this op can use, loaded before the first call
        self._dispatch = kernels.load(kernels.select(self.arch, f"dispatch.{dname}.intranode"))
        self._combine = kernels.load(kernels.select(self.arch, f"combine_gather.{dname}.intranode"))
        self.wave = self._dispatch_wave = kernels.gspecs.load().targets[self.arch].wave_size

        self.layout = lay = workspace_layout(cfg)
        self.buf = symm_mem.empty(lay["total"], dtype=torch.uint8, device=self.device)
        self.buf.zero_()
        self.handle = symm_mem.rendezvous(self.buf, self.group.group_name)
        ptrs = getattr(self.handle, "buffer_ptrs_dev", None)
        self.peer_bases = None
        if not ptrs:
            self.peer_bases = torch.tensor(list(self.handle.buffer_ptrs), dtype=torch.int64, device=self.device)
            ptrs = self.peer_bases.data_ptr()
        self.state = torch.zeros(STATE_SIZE, dtype=torch.int32, device=self.device)
        self.total_recv = torch.zeros(1, dtype=torch.int32, device=self.device)
        R, H, k = cfg.max_recv_tokens, cfg.hidden_dim, cfg.num_experts_per_token
        dt = cfg.dispatch_dtype

        def view(region, dtype, shape):
            n = 1
            for s in shape:
                n *= s
            nbytes = n * torch.empty((), dtype=dtype).element_size()
            return self.buf[lay[region]:lay[region] + nbytes].view(dtype).view(shape)

        self.recv_x, self.recv_w = view("recv_x", dt, (R, H)), view("recv_w", torch.float32, (R, k))
        self.recv_idx, self.recv_src = view("recv_idx", torch.int32, (R, k)), view("recv_src", torch.int32, (R,))
        self.comb_x, self.comb_w = view("comb_x", dt, (R, H)), view("comb_w", torch.float32, (R, k))
        self.args = kernels.EpArgs(
            state=self.state.data_ptr(), total_recv=self.total_recv.data_ptr(), peer_bases=ptrs,
            off_signal=lay["signal"], off_counter=lay["counter"], off_recv_x=lay["recv_x"], off_recv_w=lay["recv_w"],
            off_recv_idx=lay["recv_idx"], off_recv_src=lay["recv_src"], off_comb_x=lay["comb_x"],
            off_comb_w=lay["comb_w"], row_bytes=row_bytes, k=k, experts_per_rank=cfg.num_experts_per_rank,
            num_experts=cfg.num_experts, rank=cfg.rank, world=cfg.world_size, max_recv=R,
            max_tokens=cfg.max_num_inp_token_per_rank)
        self._last = None  # "dispatch" / "combine": decides the entry barrier of the next call
        self.check_ids = os.environ.get("EPGEN_CHECK_EXPERT_IDS", "1") != "0"
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    @property
    def capabilities(self) -> dict:
        return {"graph_capture": True, "arch": self.arch, "kernels": (self._dispatch.symbol, self._combine.symbol)}

    def _grid(self, work_items: int) -> int:
        waves = BLOCK // self.wave
        return max(1, min(self.num_sms, -(-work_items // waves)))

    def dispatch(self, x, weights, scales, indices, routing):
        if routing is not None:
            raise EpgenError("routing replay is not built yet for the native backend")
        cfg = self.config
        T, k = x.shape[0], cfg.num_experts_per_token
        if self.check_ids and not torch.cuda.is_current_stream_capturing() and T:
            # eager only: one small reduction read by the host (the kernel also drops and counts them)
            if bool((indices >= cfg.num_experts).any()):
                bad = int(indices.max())
                raise InputError(f"dispatch: expert id {bad} >= num_experts={cfg.num_experts} (valid ids: 0.."
                                 f"{cfg.num_experts - 1}, negative = no expert)")
        slots = torch.empty((T, k), dtype=torch.int32, device=self.device)
        a = self.args
        a.x, a.weights, a.indices, a.slots = x.data_ptr(), weights.data_ptr() if weights is not None else 0, \
            indices.data_ptr(), slots.data_ptr()
        a.num_tokens, a.has_weights = T, int(weights is not None)
        a.entry_barrier = int(self._last == "dispatch")
        self._dispatch.launch(self._grid(T * k), BLOCK, a)
        self._last = "dispatch"
        out_w = self.recv_w if weights is not None else None
        return self.recv_x, out_w, None, self.recv_idx, self.total_recv, {"extra": {"slots": slots}}

    def combine(self, expert_out, weights, indices, routing):
        cfg = self.config
        slots = routing.extra.get("slots")
        if slots is None:
            raise InputError("combine: the routing handle carries no native slot map")
        T, k = slots.shape
        out = torch.empty((T, cfg.hidden_dim), dtype=cfg.combine_dtype, device=self.device)
        out_w = torch.empty((T, k), dtype=torch.float32, device=self.device) if weights is not None else None
        a = self.args
        a.slots, a.num_tokens = slots.data_ptr(), T
        a.out, a.out_weights = out.data_ptr(), out_w.data_ptr() if out_w is not None else 0
        a.expert_out, a.expert_rows = expert_out.data_ptr(), expert_out.shape[0]
        a.expert_weights, a.has_weights = (weights.data_ptr(), 1) if weights is not None else (0, 0)
        a.entry_barrier = int(self._last == "combine")
        # every block takes part in the staging barrier: one block per multiprocessor (co-resident)
        self._combine.launch(self.num_sms, BLOCK, a)
        self._last = "combine"
        return out, out_w

    def combine_in_view(self) -> torch.Tensor:
        return self.comb_x

    def counters(self) -> dict[str, int]:
        """Device error counters (reads the device: not for use inside graph capture)."""
        vals = self.state.tolist()
        return {name: vals[i] for i, name in enumerate(STATE_WORDS)}

    def reset(self) -> None:
        """Collective: clear signals, counters and state on every rank."""
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self.buf[: self.layout["recv_x"]].zero_()
        self.state.zero_()
        self.total_recv.zero_()
        self._last = None
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def close(self) -> None:
        for kern in (self._dispatch, self._combine):
            kern.close()
        self.buf = self.handle = self.peer_bases = None
        self.recv_x = self.recv_w = self.recv_idx = self.recv_src = self.comb_x = self.comb_w = None
