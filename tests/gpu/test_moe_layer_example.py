"""examples/moe_layer.py on GPUs (native backend, the grouped layout, torch._grouped_mm on sm_90) against the
dense single-process reference of tests/support/moe_layer_ref.py (per-token relative error <= 1e-2, bf16).

Run: torchrun --nproc-per-node 2 -m pytest -m multigpu -q tests/gpu/test_moe_layer_example.py
"""

import os

import pytest
import torch
import torch.distributed as dist

from tests.gpu.dist_util import run_collective
from tests.support.moe_layer_ref import REL_TOL, check_block, load_example

pytestmark = pytest.mark.multigpu

if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
    pytest.skip("needs torchrun and GPUs", allow_module_level=True)


@pytest.mark.parametrize("tokens", [1, 128])
def test_moe_block_matches_dense_reference_at_hidden_7168(tokens):
    def check():
        experts = 16 * dist.get_world_size()
        worst = check_block(7168, experts, 8, 512, tokens, device="cuda")
        print(f"rank {dist.get_rank()}: {tokens} tokens, largest per-token relative error {worst:.2e} (tol {REL_TOL})")
    run_collective(check)  # its all-gather is the closing barrier


def test_grouped_gemm_path_is_taken_on_sm90():
    def check():
        ex = load_example()
        x = torch.zeros(2, 4, 16, dtype=torch.bfloat16, device="cuda")
        cap = torch.cuda.get_device_capability()
        assert ex.grouped_gemm_ok(x) == (cap == (9, 0)), cap
    run_collective(check)
