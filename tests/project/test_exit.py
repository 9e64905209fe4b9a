"""Issue 26, item 17: processes that build an op on 2 gloo ranks, close it and exit end cleanly (no
`terminate called without an active exception`, no SIGABRT), run many times; and a closed op keeps no
process group alive (epgen holds no process-group handle to interpreter exit).

Each run is two fresh processes (rendezvous over a free local port); EPGEN_EXIT_RUNS (default 2) sets
how many runs of each sequence: construct + close, and construct + dispatch + combine + close.

The cause (runtime/collectives.py): gloo's worker thread drops the Python side of a collective's tensors
after the call returned, which needs the GIL; a worker still waiting for it when the process finalizes
aborts the process. HARSH is the sequence that shows it most: 50 small all_to_all_single calls, then the
main thread keeps the GIL until it exits. Without runtime.collectives.run, 16 of 84 such processes aborted
(torch 2.13, CPU, two ranks); through it, none of 90. EPGEN_EXIT_HARSH_RUNS (default 10) pairs run here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
RUNS = int(os.environ.get("EPGEN_EXIT_RUNS", "2"))
HARSH_RUNS = int(os.environ.get("EPGEN_EXIT_HARSH_RUNS", "10"))

SEQUENCE = """
import os, sys
import torch, torch.distributed as dist
from runtime import EpDispatchCombineConfig, EpDispatchCombineOp
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
cfg = EpDispatchCombineConfig(rank=r, world_size=w, hidden_dim=64, max_num_inp_token_per_rank=8,
                              num_experts_per_rank=2, num_experts_per_token=2, kernel_backend="torch")
op = EpDispatchCombineOp(cfg)
if os.environ["ROUND"] == "1":
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    idx = torch.randint(0, cfg.num_experts, (8, 2), dtype=torch.int32)
    out, _, _, _, _, h = op.dispatch(x, None, None, idx, return_routing=True)
    op.combine(out, routing=h)
op.close()
assert op._backend.group is None, "a closed op still holds its process group"
"""


HARSH = """
import sys, time
import torch, torch.distributed as dist
from runtime import collectives
dist.init_process_group("gloo")
keep = []
for _ in range(50):
    a, b = torch.randn(64), torch.empty(64)
    collectives.run(lambda: dist.all_to_all_single(b, a), [a, b], dist.group.WORLD)
    keep.append((a, b))
sys.setswitchinterval(100)  # from here a waiting gloo thread gets the GIL only when finalization lets it go
t0 = time.perf_counter()
while time.perf_counter() - t0 < 0.005:
    pass
"""


def _run_pair(round_trip: bool, script: str = SEQUENCE) -> list[tuple[int, str]]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), ROUND=str(int(round_trip)), OMP_NUM_THREADS="1",
                                       PYTHONPATH=str(ROOT)))
             for r in range(2)]
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        out.append((p.returncode, err))
    return out


@pytest.mark.parametrize("round_trip", [False, True], ids=["construct-close-exit", "with-a-round"])
def test_two_gloo_ranks_exit_cleanly_every_time(round_trip):
    failures = []
    for i in range(RUNS):
        for rank, (rc, err) in enumerate(_run_pair(round_trip)):
            if rc != 0 or "terminate called" in err:
                failures.append(f"run {i} rank {rank}: exit {rc}: {err.strip()[-300:]}")
    assert not failures, "\n".join(failures)


def test_collectives_leave_no_gloo_thread_waiting_at_exit():
    failures = []
    for i in range(HARSH_RUNS):
        for rank, (rc, err) in enumerate(_run_pair(False, HARSH)):
            if rc != 0 or "terminate called" in err:
                failures.append(f"run {i} rank {rank}: exit {rc}: {err.strip()[-300:]}")
    assert not failures, "\n".join(failures)
