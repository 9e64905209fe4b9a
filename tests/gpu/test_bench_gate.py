"""The benchmark's correctness gate (bench.gate.identity_gate) on the native backend, real GPUs.

The gate passes on clean data and raises GateError on every rank when a received row is damaged
(a whole row: exactly its token comes back wrong; one bit: the received rows' checksum), for a bf16
payload and an fp8 payload with per-128 float32 scales; rows past total_recv do not matter. A small
benchmark point (graph + eager) runs end to end.

Run: torchrun --nproc-per-node 2 -m pytest -m multigpu -q tests/gpu/test_bench_gate.py
"""

import os

import pytest
import torch
import torch.distributed as dist

from runtime import EpDispatchCombineOp
from bench import sweep
from bench.gate import GateError, identity_gate
from bench.inputs import quantize_blocks
from tests.support.ep_oracle import random_routing
from tests.support.configs import dist_config
from tests.gpu.dist_util import oversubscribed, run_collective

pytestmark = pytest.mark.multigpu

if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
    pytest.skip("needs torchrun and GPUs", allow_module_level=True)

H, T, K, EPR = 2048, 256, 8, 16
BF16 = torch.bfloat16


def _cfg(payload):
    extra = dict(dispatch_data_type=torch.float8_e4m3fn, combine_data_type=BF16, scale_dim=H // 128,
                 scale_type_size=4) if payload == "fp8" else {}
    return dist_config(hidden_dim=H, max_num_inp_token_per_rank=T, num_experts_per_rank=EPR, num_experts_per_token=K,
                       data_type=BF16, **extra)


def _inputs(payload, seed):
    """(x, w, scales, idx) on the GPU: random rows, routing with repeated experts and -1 ids."""
    g = torch.Generator().manual_seed(seed * 31 + dist.get_rank())
    x = torch.randn(T, H, generator=g).to(BF16)
    w = torch.rand(T, K, generator=g)
    idx = random_routing(g, T, K, EPR * dist.get_world_size())
    scales = None
    if payload == "fp8":
        x, scales = quantize_blocks(x, H // 128)
        scales = scales.cuda()
    return x.cuda(), w.cuda(), scales, idx.cuda()


def _gate_error(op, inputs, hook, point) -> GateError:
    try:
        identity_gate(op, *inputs, corrupt=hook, point=point)
    except GateError as e:
        return e
    raise AssertionError(f"{point}: the gate passed a corrupted row")


def _fill_row0(out, n):  # every byte of the first received row (bf16: 12.06, fp8 e4m3: 2.25)
    out[0].view(torch.uint8).fill_(0x41)


def _flip_bit(out, n):  # the low bit of the first element of the first received row
    out[0:1, 0:1].view(torch.int16 if out.element_size() == 2 else torch.uint8).bitwise_xor_(1)


@pytest.mark.parametrize("payload", ["bf16", "fp8"])
def test_gate_passes_clean_and_raises_on_a_corrupted_row(payload):
    def check():
        me, world = dist.get_rank(), dist.get_world_size()
        with EpDispatchCombineOp(_cfg(payload)) as op:
            inputs = _inputs(payload, 1)
            n = identity_gate(op, *inputs, point="clean")
            assert n > 0

            # a whole received row damaged on rank 0: every rank raises; one token comes back wrong
            err = _gate_error(op, inputs, _fill_row0 if me == 0 else None, "row0")
            assert err.rank == me and err.point == "row0" and "row0" in str(err)
            assert sum(err.wrong_rows) == 1, str(err)
            assert err.bad_checksum_columns[0] > 0 and not any(err.bad_checksum_columns[1:]), str(err)
            assert err.recv_rows == err.expected_recv_rows, str(err)

            # one bit of one element on the last rank: its received rows' checksum catches it
            err = _gate_error(op, inputs, _flip_bit if me == world - 1 else None, "bit")
            assert err.bad_checksum_columns[world - 1] == 1 and not any(err.bad_checksum_columns[:-1]), str(err)
            assert sum(err.wrong_rows) <= 1, str(err)

            # rows past total_recv are never combined: damaging them passes, and so does a clean run
            identity_gate(op, *inputs, corrupt=(lambda out, k: out[k:].view(torch.uint8).fill_(0x41)) if me == 0
                          else None, point="unused rows")
            assert identity_gate(op, *inputs, point="clean again") == n
    run_collective(check)  # its all-gather is the closing barrier


@pytest.mark.skipif(oversubscribed(), reason="ranks share GPUs: a gloo group has no NCCL baseline to time, "
                    "and oversubscribed runs make no performance figures")
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_bench_point_runs_both_modes(dtype):
    def check():
        rec = sweep.run_point(64, H, K, EPR * dist.get_world_size(), getattr(torch, dtype), 2, 2,
                              torch_baseline=True, eager_iters=3, input_sets=2)
        assert rec["graph"] is True and rec["graph_modes"] == ["graph", "eager"], rec
        for key in ("dispatch_us", "combine_us", "combine_staged_us", "dispatch_replay_us", "eager_dispatch_us",
                    "eager_combine_us", "nccl_a2a_us", "nccl_a2a_combine_us", "dispatch_link_GBps",
                    "combine_logical_GBps", "eager_dispatch_logical_GBps"):
            assert isinstance(rec[key], float) and rec[key] > 0, (key, rec[key])
        assert rec["dispatch_blocks"] > 0 and rec["combine_blocks"] > 0
        m = rec["rows_matrix"]
        assert rec["recv_rows"] == sum(row[dist.get_rank()] for row in m)
        assert rec["dispatch_row_bytes"] == (2 * H if dtype == "bfloat16" else H + (H // 128) * 4)
        assert isinstance(rec["torch_backend_dispatch_us"], float), rec["torch_backend_note"]
    run_collective(check)  # its all-gather is the closing barrier
