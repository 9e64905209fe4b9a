"""Helpers of the multi-GPU tests (run under torchrun: one process per GPU, or several per GPU).

With more ranks than GPUs (``torchrun --nproc-per-node N`` with N > GPUs) rank r runs on GPU r mod GPUs
and the group is gloo (NCCL refuses two ranks on one GPU); the runtime then maps its workspaces with
CUDA IPC and stages its host collectives through gloo. The GPU time-slices such ranks: correctness only."""

import os
import traceback

import torch
import torch.distributed as dist

from bench.measure import warm_on_side_stream


def oversubscribed() -> bool:
    """Whether this node runs more ranks than it has GPUs (several ranks share a GPU)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count()


def init_dist() -> None:
    """Bind this process to its GPU and join the group (once per process): NCCL with a GPU per rank,
    gloo when ranks share GPUs."""
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        if oversubscribed():
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("nccl", device_id=device)


def collective_assert(err) -> None:
    """Every rank raises if any rank failed (a lone failing rank would leave its peer in a collective)."""
    errs = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    bad = [f"rank {r}: {e}" for r, e in enumerate(errs) if e]
    assert not bad, "; ".join(bad)


def run_collective(check) -> None:
    """Run check() on every rank; any rank's failure (an assertion, or an error such as EpTimeoutError) fails
    every rank with every rank's message: a rank that raised alone would leave its peers in the next collective."""
    where = ""
    try:
        err = check()
    except AssertionError as e:
        err = str(e) or "assertion failed"
    except Exception as e:  # noqa: BLE001 - reported by every rank below
        err, where = f"{type(e).__name__}: {e}", traceback.format_exc()
    if err:  # printed first: a peer still inside check()'s collectives cannot match the gather below (gloo aborts
        print(f"\nrank {dist.get_rank()} failed: {err}\n{where}", flush=True)  # on a size mismatch: hidden)
    collective_assert(err)


def captured(round_fn):
    """round_fn warmed up once on a side stream, then captured (every rank): -> (graph, what the captured call
    returned)."""
    warm_on_side_stream(round_fn)
    dist.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        res = round_fn()
    return g, res
