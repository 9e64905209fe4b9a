"""Issue 26 (trust, round two), runtime part: op.check() reports a bad expert id even when the
host-mapped words lag behind the kernel (ranks sharing a GPU); every seed-API int field has a declared
range; numpy bools are bools and a wrong type is named exactly.

Every test here failed on 7b1a81d. The device side of op.check() is a stand-in (tests/gpu/
test_ep_check_ids.py runs the real one with ranks sharing a GPU).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from runtime import ConfigError, EpDispatchCombineConfig, EpDispatchCombineOp, InputError, InputWarning
from tests.support.configs import make_config as _cfg
from tests.support.stand_ins import stand_in_native_op

BASE = dict(rank=0, world_size=2, hidden_dim=64, max_num_inp_token_per_rank=16, num_experts_per_rank=4,
            num_experts_per_token=2, kernel_backend="torch")


# ---------------------------------------------------------------------------------------------
# 13: op.check() after a dispatch raises even when the host-mapped words arrive late
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def lagging_op(monkeypatch):
    op, queued, real = stand_in_native_op(monkeypatch, lag=True)
    yield op, queued
    op._backend = real
    op.close()


def test_check_reads_the_device_count_when_the_words_lag(lagging_op):
    op, queued = lagging_op
    with pytest.raises(InputError, match=r"^dispatch: an expert id >= num_experts=2 \(world_size × num_experts_per_rank "
                                         r"= 1 × 2 = 2; valid ids: 0\.\.1, negative = no expert\), found on rank 0 by the dispatch kernel of an earlier call of "
                                         r"this op \(1 such id\(s\);"):
        op.check()
    op.check()  # reported once
    for deliver in queued.late:  # the words arrive now: already reported, so no warning at the next call
        deliver()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op._backend.check(ids="warn")
    assert list(queued.words[5:8]) == [0, 0, 0]


def test_words_that_arrive_are_reported_once(monkeypatch):
    op, queued, real = stand_in_native_op(monkeypatch)
    try:
        with pytest.raises(InputError, match=r"expert id 77 >= num_experts=2"):
            op.check()
        op.check()  # the device count agrees: nothing more
    finally:
        op._backend = real
        op.close()


def test_warned_ids_are_not_raised_again(monkeypatch):
    """The eager call's warning reports the words; the next op.check() re-bases on the device count."""
    op, queued, real = stand_in_native_op(monkeypatch)
    try:
        queued.Stream(1111).synchronize()  # the kernel ran (device count 1, words written)
        with pytest.warns(InputWarning, match="expert id 77"):
            op._backend.check(ids="warn")
        op.check()
    finally:
        op._backend = real
        op.close()


# ---------------------------------------------------------------------------------------------
# 15: every seed-API int field has a declared range
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,most", [
    ("dispatch_block_num", 2 ** 31 - 1), ("combine_block_num", 2 ** 31 - 1), ("warp_num_per_block", 32),
    ("combine_warp_num_per_block", 32), ("num_qp_per_pe", 2 ** 31 - 1), ("dispatch_rdma_block_num", 2 ** 31 - 1),
    ("combine_rdma_block_num", 2 ** 31 - 1), ("max_token_type_size", 2 ** 31 - 1),
])
@pytest.mark.parametrize("excess", [1, 2 ** 31, 2 ** 70])
def test_seed_fields_have_a_declared_range(field, most, excess):
    value = most + excess
    with pytest.raises(ConfigError, match=rf"^{field}={value}: must be at most {most} \(.+\)$"):
        EpDispatchCombineConfig(**{**BASE, field: value})
    EpDispatchCombineConfig(**{**BASE, field: most})


@pytest.mark.parametrize("bucket", [
    (None, 2 ** 31, 1, 1, 1), (None, 1, 33, 1, 1), (None, 1, 1, 2 ** 70, 1), (None, 1, 1, 1, 2 ** 31),
    (2 ** 31, 1, 1, 1, 1), (2 ** 70, 1, 1, 1, 1),
])
def test_schedule_values_have_a_declared_range(bucket):
    with pytest.raises(ConfigError, match=r"^schedule=.+ warps at most 32\)$"):
        EpDispatchCombineConfig(**{**BASE, "schedule": (bucket,)})
    EpDispatchCombineConfig(**{**BASE, "schedule": ((2 ** 31 - 1, 2 ** 31 - 1, 32, 2 ** 31 - 1, 32),)})


# ---------------------------------------------------------------------------------------------
# 16: numpy bools are bools; a wrong type is named exactly
# ---------------------------------------------------------------------------------------------
def test_return_routing_takes_numpy_bools():
    with EpDispatchCombineOp(_cfg(0, 1)) as op:
        x = torch.randn(4, 64, dtype=torch.bfloat16)
        idx = torch.zeros(4, op.config.num_experts_per_token, dtype=torch.int32)
        assert len(op.dispatch(x, None, None, idx, return_routing=np.bool_(True))) == 6
        assert len(op.dispatch(x, None, None, idx, return_routing=np.bool_(False))) == 5
        for value, name in ((np.int64(1), "numpy.int64"), (1, "int"), ("yes", "str"), (torch.tensor(True), "torch.Tensor")):
            with pytest.raises(InputError, match=rf"^dispatch: return_routing must be a bool, got {name}$"):
                op.dispatch(x, None, None, idx, return_routing=value)
