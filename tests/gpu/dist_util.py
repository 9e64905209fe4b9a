"""Helpers of the multi-GPU tests (run under torchrun, one process per GPU)."""

import os

import torch
import torch.distributed as dist


def init_dist() -> None:
    """Bind this process to its GPU and join the NCCL group (once per process)."""
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))


def collective_assert(err) -> None:
    """Every rank raises if any rank failed (a lone failing rank would leave its peer in a collective)."""
    errs = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    bad = [f"rank {r}: {e}" for r, e in enumerate(errs) if e]
    assert not bad, "; ".join(bad)


def run_collective(check) -> None:
    """Run check() on every rank; any rank's assertion failure fails every rank (none is left waiting)."""
    try:
        err = check()
    except AssertionError as e:
        err = str(e) or "assertion failed"
    collective_assert(err)
