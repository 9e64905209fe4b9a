"""Shared by the GPU tests: a process started by torchrun joins its process group once, before its first test
(tests.gpu.dist_util.init_dist: NCCL with a GPU per rank, gloo when ranks share GPUs)."""

import faulthandler
import os
import signal

import pytest
import torch

from tests.gpu.dist_util import init_dist


@pytest.fixture(scope="session", autouse=True)
def dist_env():
    if "LOCAL_RANK" in os.environ and torch.cuda.is_available():
        # torchrun ends the other ranks with SIGTERM when one fails: each prints where it stood (a rank waiting in a
        # collective its failed peer never reached shows which one)
        faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
        init_dist()
    yield
