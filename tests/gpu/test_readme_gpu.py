"""The README's python blocks (the usage example, the grouped-GEMM MoE layer), verbatim, under torchrun on GPUs (NCCL, the generated kernels): one rank per GPU,
two where there are two (the README's command), else one.

Run on a GPU machine: python -m pytest -m gpu tests/gpu/test_readme_gpu.py
"""

import re

import pytest
import torch

from tests.support.readme import rank_reports, run_script, run_usage, scripts

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)


def test_usage_block_runs_verbatim_under_torchrun_on_gpus(tmp_path):
    nproc = min(2, torch.cuda.device_count())
    out = run_usage(tmp_path, nproc=nproc, timeout=600)
    lines = rank_reports(out)
    assert sorted(line.split(":")[0] for line in lines) == [f"rank {r}" for r in range(nproc)], out
    assert all(128 <= int(re.search(r"received (\d+) rows", line).group(1)) <= 128 * nproc for line in lines)


def test_grouped_layer_block_runs_verbatim_under_torchrun_on_gpus(tmp_path):
    nproc = min(2, torch.cuda.device_count())
    name, code = scripts()[1]
    out = run_script(tmp_path, name, code, nproc=nproc, timeout=600)
    lines = rank_reports(out)
    assert sorted(line.split(":")[0] for line in lines) == [f"rank {r}" for r in range(nproc)], out
    assert all(float(re.search(r"dense layer ([0-9.eE+-]+)", line).group(1)) < 2e-2 for line in lines), out
