"""Shared by the GPU tests: a process started by torchrun joins its process group once, before its first test
(tests.gpu.dist_util.init_dist: NCCL with a GPU per rank, gloo when ranks share GPUs)."""

import os

import pytest
import torch

from tests.gpu.dist_util import init_dist


@pytest.fixture(scope="session", autouse=True)
def dist_env():
    if "LOCAL_RANK" in os.environ and torch.cuda.is_available():
        init_dist()
    yield
