"""A small pool of gloo worker processes (one per rank) that stays up across tests.

``world.run(fn, *args)`` runs module-level ``fn(rank, world_size, *args)`` on every rank and
returns the per-rank results; a failure on any rank raises AssertionError with every rank's
traceback. A world that failed or timed out is shut down; ``get_world`` then starts a fresh one.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from datetime import timedelta

COLLECTIVE_TIMEOUT_S = 20  # gloo: a rank left alone in a collective fails after this
RUN_TIMEOUT_S = 60
AFTER_FAILURE_WAIT_S = 5


def _worker(rank: int, world_size: int, init_method: str, conn) -> None:
    import torch
    import torch.distributed as dist

    os.environ["EPGEN_KERNEL_BACKEND"] = "torch"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        while (msg := conn.recv()) is not None:
            module, name, args = msg
            try:
                fn = getattr(importlib.import_module(module), name)
                conn.send(("ok", fn(rank, world_size, *args)))
            except BaseException:  # noqa: BLE001 - reported to the parent
                conn.send(("error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class ProcessWorld:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.tmp = tempfile.mkdtemp(prefix="epgen-gloo-")
        init_method = f"file://{os.path.join(self.tmp, 'rendezvous')}"
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world_size, init_method, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.alive = True

    def run(self, fn, *args, timeout: float = RUN_TIMEOUT_S) -> list:
        assert self.alive, "this world was shut down"
        for conn in self.conns:
            conn.send((fn.__module__, fn.__name__, args))
        deadline = time.monotonic() + timeout
        results: list = [None] * self.world_size
        errors: dict[int, str] = {}
        for rank, conn in enumerate(self.conns):
            # after a failure the others may be stuck in a collective: wait only briefly
            limit = deadline if not errors else min(deadline, time.monotonic() + AFTER_FAILURE_WAIT_S)
            if not conn.poll(max(0.0, limit - time.monotonic())):
                errors[rank] = f"no answer within {timeout:.0f} s (hung in a collective?)"
                continue
            status, value = conn.recv()
            if status == "ok":
                results[rank] = value
            else:
                errors[rank] = value
        if errors:
            self.shutdown()
            report = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise AssertionError(f"{fn.__name__} failed on {len(errors)} of {self.world_size} ranks:\n{report}")
        return results

    def shutdown(self) -> None:
        if not self.alive:
            return
        self.alive = False
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(self.tmp, ignore_errors=True)


_WORLDS: dict[int, ProcessWorld] = {}


def get_world(world_size: int) -> ProcessWorld:
    """A live world of this size (started on first use, restarted after a failure)."""
    world = _WORLDS.get(world_size)
    if world is None or not world.alive:
        world = _WORLDS[world_size] = ProcessWorld(world_size)
    return world


@atexit.register
def shutdown_all() -> None:
    for world in _WORLDS.values():
        world.shutdown()
    _WORLDS.clear()
