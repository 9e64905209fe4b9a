"""The seed's tuning tables' interface (``mori.ops.dispatch_combine_v2.tuning_configs``): ``lookup`` and
``_topology``, answered from epgen's own tuning table (specs/tuning.toml) for the current device.

``lookup(world_size, hidden_dim, topk, dtype)`` -> {dispatch_block_num, combine_block_num, warp_num_per_block,
combine_warp_num_per_block, schedule}: the schedule buckets (max tokens inclusive or None, dispatch blocks,
dispatch warps, combine blocks, combine warps) are the union of the dispatch and combine buckets epgen's table
has for this device's target and world size (blocks 0 there, one per multiprocessor, become the
multiprocessor count; warps = threads / the target's wave size); the four single-shot fields are the last
bucket's. epgen's table does not vary with hidden_dim, topk or dtype. Without a GPU (or for a target the specs
do not declare) it answers as the seed does where it finds no device: the untuned fallback, one block per
compute unit of an assumed 80, 16 dispatch warps, 4 combine warps, no schedule.
"""

from __future__ import annotations

import glob

import torch

DEFAULT_CUS = 80  # the seed's fallback compute-unit count when it finds no device
KFD_NODES = "/sys/class/kfd/kfd/topology/nodes/*/properties"


def _topology() -> tuple[int, int, int]:
    """(compute units, gfx_target_version, PCI device id) of the first GPU, as the seed reads them from the AMD
    kernel driver's sysfs; on another vendor's GPU (multiprocessors, 0, 0); (0, 0, 0) without a GPU."""
    for path in sorted(glob.glob(KFD_NODES)):
        try:
            vals = {}
            with open(path) as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 2 and parts[1].lstrip("-").isdigit():
                        vals[parts[0]] = int(parts[1])
        except OSError:
            continue
        simd = vals.get("simd_count", 0)
        if simd > 0:
            return simd // (vals.get("simd_per_cu", 0) or 1), vals.get("gfx_target_version", 0), vals.get("device_id", 0)
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count, 0, 0
    return 0, 0, 0


def _fallback(cus: int) -> dict:
    return dict(dispatch_block_num=cus, combine_block_num=cus, warp_num_per_block=16, combine_warp_num_per_block=4,
                schedule=None)


def _device():
    """(spec target, multiprocessors) of the current GPU, or None."""
    if not torch.cuda.is_available():
        return None
    from ..config import load_specs
    from ..kernels import device_arch

    device = torch.device("cuda", torch.cuda.current_device())
    target = load_specs().targets.get(device_arch(device))
    return None if target is None else (target, torch.cuda.get_device_properties(device).multi_processor_count)


def lookup(world_size, hidden_dim, topk, dtype="fp8") -> dict:
    """The geometry for the current device and shape (see the module docstring)."""
    found = _device()
    if found is None:
        return _fallback(_topology()[0] or DEFAULT_CUS)
    from generator import specs as gspecs

    from ..config import load_specs

    target, sms = found
    specs = load_specs()
    roles = ("dispatch", "combine")
    edges = sorted({b.max_tokens for r in roles for b in gspecs.buckets_for(specs, target.name, r, world_size)
                    if b.max_tokens})
    schedule = []
    for edge in edges + [None]:
        tokens = edge if edge is not None else (edges[-1] + 1 if edges else 1)
        geo = []
        for role in roles:
            b = gspecs.geometry(specs, target.name, role, tokens, world_size)
            geo += [b.blocks or sms, max(1, b.threads // target.wave_size)]
        if schedule and schedule[-1][1:] == tuple(geo):
            schedule[-1] = (edge, *geo)  # the same geometry as the bucket below: one bucket
        else:
            schedule.append((edge, *geo))
    last = schedule[-1]
    return dict(dispatch_block_num=last[1], warp_num_per_block=last[2], combine_block_num=last[3],
                combine_warp_num_per_block=last[4], schedule=tuple(schedule))
