"""Reliability on the CPU side: cross-rank config agreement at op construction (gloo worker
processes, tests/support/ep_dist.py), EpTimeoutError and op.check().

Every rank gathers every rank's config summary before the backend is built; any difference in a
field other than ``rank`` (or a config that does not fit the process group) is a ConfigError on
every rank, naming the field, both values and their ranks. The world stays usable afterwards.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from tests.support.ep_dist import get_world, shutdown_all
from runtime import ClosedError, ConfigError, EpDispatchCombineOp, EpgenError, EpTimeoutError
from runtime import agreement
from runtime import op as rop
from tests.support.configs import make_config as _cfg
from tests.support.rounds import check_round


@pytest.fixture(scope="module", autouse=True)
def _worlds():
    yield
    shutdown_all()


class _NoBackend:
    """Stands in for runtime.backends.make: records whether a backend was requested."""

    def __init__(self):
        self.calls = 0
        self.real = rop.backends.make

    def __call__(self, config, group):
        self.calls += 1
        return self.real(config, group)


def _construct_expecting_error(cfg) -> tuple[str, int]:
    spy = _NoBackend()
    rop.backends.make = spy
    try:
        with pytest.raises(ConfigError) as err:
            EpDispatchCombineOp(cfg)
    finally:
        rop.backends.make = spy.real
    return str(err.value), spy.calls


def scn_mismatch(rank, world, overrides_by_rank):
    """Rank r builds its config with overrides_by_rank[r]; every rank must raise, before any backend
    exists; then a matching op works on the same group."""
    msg, backends = _construct_expecting_error(_cfg(rank, world, **overrides_by_rank[rank]))
    assert backends == 0, "a backend was built before the configs were compared"
    with EpDispatchCombineOp(_cfg(rank, world)) as op:
        assert check_round(op, rank, world, 7, [5] * world) > 0
    return msg


def scn_match(rank, world, overrides):
    with EpDispatchCombineOp(_cfg(rank, world, **overrides)) as op:
        assert op.config.timeout_s == overrides.get("timeout_s", 30.0)
        return check_round(op, rank, world, 11, [3 + r for r in range(world)])


def scn_wrong_rank(rank, world):
    """Every rank's config says rank=0: rank 0's own view fits, the others' do not; all raise."""
    msg, backends = _construct_expecting_error(_cfg(0, world))
    assert backends == 0
    return msg


@pytest.mark.parametrize("field,values", [
    ("hidden_dim", (64, 128)),
    ("data_type", (torch.bfloat16, torch.float32)),
    ("timeout_s", (30.0, 5.0)),
    ("max_num_inp_token_per_rank", (128, 64)),
    ("kernel_backend", ("torch", "native")),  # the field differs although the environment forces 'torch'
])
def test_mismatch_detected_on_every_rank(field, values):
    messages = get_world(2).run(scn_mismatch, [{field: values[0]}, {field: values[1]}])
    for msg in messages:
        assert msg.startswith("config mismatch between ranks: "), msg
        assert f"{field}={values[0]!r} on rank 0, {field}={values[1]!r} on rank 1" in msg, msg
    assert messages[0] == messages[1]


def test_mismatch_message_example():
    msgs = get_world(2).run(scn_mismatch, [{"hidden_dim": 7168}, {"hidden_dim": 4096}])
    assert msgs == ["config mismatch between ranks: hidden_dim=7168 on rank 0, hidden_dim=4096 on rank 1"] * 2


def test_every_differing_field_is_named():
    msgs = get_world(2).run(scn_mismatch, [{}, {"hidden_dim": 128, "data_type": torch.float32}])
    for msg in msgs:
        assert "hidden_dim=64 on rank 0, hidden_dim=128 on rank 1" in msg
        assert "data_type=torch.bfloat16 on rank 0, data_type=torch.float32 on rank 1" in msg


def test_one_odd_rank_of_four():
    msgs = get_world(4).run(scn_mismatch, [{}, {}, {}, {"hidden_dim": 256}])
    assert msgs == ["config mismatch between ranks: hidden_dim=64 on rank 0, hidden_dim=256 on rank 3"] * 4


def test_matching_configs_work():
    assert all(n > 0 for n in get_world(2).run(scn_match, {}))
    assert all(n > 0 for n in get_world(2).run(scn_match, {"timeout_s": 2.5}))


def test_config_rank_must_be_group_rank():
    msgs = get_world(2).run(scn_wrong_rank)
    assert "rank 1 of the process group (world size 2) has a config with world_size=2, rank=0" in msgs[0]
    assert msgs[1] == ("the process group has world size 2 and this process is rank 1, but the config says "
                       "world_size=2, rank=0")


def test_single_process_skips_the_gather(monkeypatch):
    """world_size=1 without torch.distributed: nothing to compare, nothing collective."""
    monkeypatch.delenv("EPGEN_KERNEL_BACKEND", raising=False)
    assert not torch.distributed.is_initialized()
    with EpDispatchCombineOp(_cfg(0, 1, timeout_s=1)) as op:
        assert op.config.timeout_s == 1.0 and isinstance(op.config.timeout_s, float)


def test_summary_covers_every_field_but_is_picklable():
    cfg = _cfg(0, 1, data_type=torch.float32, timeout_s=3)
    s = agreement.config_summary(cfg)
    assert set(s) == set(agreement.FIELDS) | {"resolved_backend"} and s["timeout_s"] == 3.0
    assert pickle.loads(pickle.dumps(s)) == s


def test_timeout_error():
    e = EpTimeoutError(rank=1, peer=0, phase="dispatch.barrier")
    assert isinstance(e, EpgenError) and isinstance(e, RuntimeError)
    assert (e.rank, e.peer, e.phase) == (1, 0, "dispatch.barrier")
    assert str(e) == "rank 1 timed out waiting for rank 0 in dispatch.barrier"
    e2 = pickle.loads(pickle.dumps(EpTimeoutError("custom words", rank=3, peer=None, phase="combine.counter")))
    assert (str(e2), e2.rank, e2.peer, e2.phase) == ("custom words", 3, None, "combine.counter")
    assert str(EpTimeoutError(rank=0, peer=-1, phase="combine staging barrier")) == \
        "rank 0 timed out waiting for its own blocks in combine staging barrier"
    import runtime

    assert runtime.EpTimeoutError is EpTimeoutError and "EpTimeoutError" in runtime.__all__


def test_op_check(monkeypatch):
    """op.check(): the backend's check when it has one (native: reads the error word), else nothing."""
    monkeypatch.delenv("EPGEN_KERNEL_BACKEND", raising=False)
    op = EpDispatchCombineOp(_cfg(0, 1))
    op.check()  # the torch backend has no device-side waits
    # four tokens, k = 4: three name an expert (with repeats and -1s), one names none and sends no row
    ids = torch.tensor([[0, -1, -1, -1], [3, 3, 0, -1], [-1, -1, -1, -1], [-1, 2, -1, 1]], dtype=torch.int32)
    assert check_round(op, 0, 1, 3, [4], indices_fn=lambda n: ids[:n]) == 3
    op.check()

    def expired():
        raise EpTimeoutError(rank=0, peer=1, phase="combine entry barrier")

    monkeypatch.setattr(op._backend, "check", expired, raising=False)
    with pytest.raises(EpTimeoutError, match="rank 0 timed out waiting for rank 1 in combine entry barrier") as e:
        op.check()
    assert (e.value.rank, e.value.peer, e.value.phase) == (0, 1, "combine entry barrier")
    op.close()
    with pytest.raises(ClosedError, match="check: this EpDispatchCombineOp is closed"):
        op.check()
