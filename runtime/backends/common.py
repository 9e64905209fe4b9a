"""What the native backends (intranode: native.py, internode: internode.py) share: the process-group and
device checks, the target lookup, the expert-id check mode, the routing kernels and the drop accounting."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import errors, kernels
from ..config import EpDispatchCombineConfig, load_specs
from ..errors import EpgenError, InputError


def native_group(cfg: EpDispatchCombineConfig, group):
    """The process group a native backend runs on, after the checks every native backend makes."""
    if not torch.cuda.is_available():
        raise EpgenError("kernel backend 'native' needs a GPU; use kernel_backend='torch' on CPU")
    if not dist.is_initialized():
        raise EpgenError("kernel backend 'native' needs torch.distributed initialised (NCCL/RCCL; gloo where "
                         "several ranks share a GPU)")
    group = group or dist.group.WORLD
    if dist.get_world_size(group) != cfg.world_size or dist.get_rank(group) != cfg.rank:
        raise EpgenError(f"config says rank {cfg.rank} of {cfg.world_size}, the process group says rank "
                         f"{dist.get_rank(group)} of {dist.get_world_size(group)}")
    return group


def device_target(probe: str):
    """(device, arch, multiprocessors, spec target) of the current CUDA/HIP device; a target the specs do
    not declare raises the variant-miss error for `probe` (a kernel name), naming the declared targets."""
    device = torch.device("cuda", torch.cuda.current_device())
    arch = kernels.device_arch(device)
    target = load_specs().targets.get(arch)
    if target is None:
        kernels.select(arch, probe)
    return device, arch, torch.cuda.get_device_properties(device).multi_processor_count, target


ID_CHECK_ENV = "EPGEN_CHECK_EXPERT_IDS"
ID_CHECK_MODES = {"": "async", "async": "async", "1": "sync", "sync": "sync", "0": "off", "off": "off"}


def id_check_mode() -> str:
    """How eager dispatch checks for expert ids >= num_experts (environment EPGEN_CHECK_EXPERT_IDS):
    "async" (default; the intranode kernel notes them in host-mapped memory, the op's next eager call
    warns InputWarning and op.check() raises InputError; no device sync), "sync" (or "1": a device
    reduction read by the host, raised in the offending call), "off" (or "0": dropped and counted only)."""
    value = os.environ.get(ID_CHECK_ENV, "").strip().lower()
    if value not in ID_CHECK_MODES:
        raise EpgenError(f"environment {ID_CHECK_ENV}={value!r}: must be one of async, sync, off (or 1 = sync, "
                         f"0 = off, unset = async)")
    return ID_CHECK_MODES[value]




def check_expert_ids(cfg: EpDispatchCombineConfig, indices: torch.Tensor) -> None:
    """Eager dispatch: InputError for an id >= num_experts (one small reduction read by the host; the
    kernels also drop and count such ids, which is all that happens inside graph capture)."""
    if indices.numel() and bool((indices >= cfg.num_experts).any()):
        raise InputError(f"dispatch: expert id {int(indices.max())} >= {cfg.expert_id_bound()}")


def raise_if_dropped(cfg: EpDispatchCombineConfig, dropped: torch.Tensor) -> None:
    """strict_capacity: CapacityError when this dispatch dropped rows past the cap (reads the device)."""
    n = int(dropped)
    if n:
        raise errors.CapacityError(f"dispatch: {n} received row(s) past max_total_recv_tokens={cfg.max_recv_tokens} "
                                   f"were dropped on rank {cfg.rank}", dropped=n, capacity=cfg.max_recv_tokens)


def local_expert_count(cfg: EpDispatchCombineConfig, recv_idx: torch.Tensor, total_recv: torch.Tensor) -> torch.Tensor:
    """(received row, k) pairs per local expert among the first total_recv rows (device int32, no sync)."""
    epr = cfg.num_experts_per_rank
    rows = torch.arange(recv_idx.shape[0], device=recv_idx.device) < total_recv
    local = recv_idx - cfg.rank * epr
    hit = (local >= 0) & (local < epr) & rows[:, None]
    counts = torch.zeros(epr, dtype=torch.int32, device=recv_idx.device)
    return counts.scatter_add_(0, local.clamp(0, epr - 1).flatten().long(), hit.flatten().int())
