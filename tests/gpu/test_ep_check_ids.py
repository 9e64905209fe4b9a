"""op.check() after a dispatch with out-of-range expert ids raises on every rank, whatever the ranks'
placement (one per GPU, or several sharing a GPU on a gloo group), and reports each bad dispatch once.

Run (2 ranks sharing one H200): RANKS_PER_GPU=2 ONE_GPU=1 EP_TESTS=tests/gpu/test_ep_check_ids.py \
    bash scripts/device_run.sh
"""

import os
import warnings

import pytest
import torch
import torch.distributed as dist

from runtime import EpDispatchCombineOp, InputError, InputWarning
from tests.support.configs import dist_config
from tests.gpu.dist_util import run_collective

pytestmark = pytest.mark.multigpu

if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
    pytest.skip("needs torchrun and GPUs", allow_module_level=True)

ROUNDS = 20


def _cfg(T_max=64, hidden=2048, k=4, epr=8, **kw):
    return dist_config(hidden_dim=hidden, max_num_inp_token_per_rank=T_max, num_experts_per_rank=epr,
                       num_experts_per_token=k, **kw)


def _bad_rounds(op, cfg, T):
    """Every round: a dispatch whose ids are all num_experts, then op.check() must raise (no device sync
    by the test in between: op.check() waits itself), once; the next eager call warns nothing."""
    x = torch.randn(T, cfg.hidden_dim, dtype=cfg.data_type, device="cuda")
    bad = torch.full((T, cfg.num_experts_per_token), cfg.num_experts, dtype=torch.int32, device="cuda")
    for i in range(ROUNDS):
        op.dispatch(x, None, None, bad)
        try:
            op.check()
        except InputError as e:
            assert f">= num_experts={cfg.num_experts}" in str(e), str(e)
        else:
            b = op._backend
            raise AssertionError(f"round {i}: op.check() did not raise (error words {list(b._error_words)}, device "
                                 f"bad-id count {b.counters()['bad_ids']}, reported {b._bad_seen})")
        op.check()  # reported once
        with warnings.catch_warnings():
            warnings.simplefilter("error", InputWarning)  # not reported again by the next eager call
            good = torch.zeros_like(bad)
            out, _, _, oi, _, h = op.dispatch(x, None, None, good, return_routing=True)
            op.combine(out, routing=h)
        op.check()
        dist.barrier()


@pytest.mark.parametrize("capped", [False, True])
def test_check_raises_after_a_bad_dispatch_on_every_rank(monkeypatch, capped):
    monkeypatch.delenv("EPGEN_CHECK_EXPERT_IDS", raising=False)
    kw = dict(max_total_recv_tokens=dist.get_world_size() * 32) if capped else {}
    cfg = _cfg(**kw)
    with EpDispatchCombineOp(cfg) as op:
        assert op._backend.id_check == "async"
        run_collective(lambda: _bad_rounds(op, cfg, 48))


def test_check_raises_after_a_bad_low_latency_dispatch(monkeypatch):
    monkeypatch.delenv("EPGEN_CHECK_EXPERT_IDS", raising=False)
    cfg = _cfg(intranode_protocol="ll")
    with EpDispatchCombineOp(cfg) as op:
        run_collective(lambda: _bad_rounds(op, cfg, 16))
