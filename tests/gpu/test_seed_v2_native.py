"""The seed's EPv2 test call sequences (tests/support/seed_v2_calls.py: its op test matrix, asymmetric dtypes,
lifecycle, backend parity, bench gate) through runtime.seed_compat on the native backend, on GPUs.

Run (2 ranks; ranks sharing one GPU are fine, correctness only):
  torchrun --nproc-per-node 2 -m pytest -m multigpu -q tests/gpu/test_seed_v2_native.py
"""

import os

import pytest
import torch
import torch.distributed as dist

from tests.support import seed_v2_calls as calls
from tests.gpu.dist_util import run_collective

pytestmark = pytest.mark.multigpu

if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
    pytest.skip("needs torchrun and GPUs", allow_module_level=True)


@pytest.fixture(autouse=True)
def _native(monkeypatch):
    monkeypatch.delenv("EPGEN_KERNEL_BACKEND", raising=False)
    monkeypatch.delenv("MORI_V2_KERNEL_BACKEND", raising=False)


def _run(fn, *args):
    def check():
        lines = fn(dist.get_rank(), dist.get_world_size(), *args, dev="cuda")
        assert lines and all(line.endswith("PASS") for line in lines), lines
    run_collective(check)


@pytest.mark.parametrize("case", list(calls.MATRIX) + list(calls.EXTRA))
def test_seed_op_matrix_native(case):
    _run(calls.op_matrix_case, {**calls.MATRIX, **calls.EXTRA}[case])


@pytest.mark.parametrize("disp", ["fp8", "fp4"])
def test_seed_asym_dtype_native(disp):
    _run(calls.asym_case, disp)


def test_seed_lifecycle_native():
    _run(calls.lifecycle_case)


def test_seed_backend_parity_native():
    _run(calls.parity_case)


@pytest.mark.parametrize("disp, combine_in", [("bf16", "inplace"), ("bf16", "staged"), ("fp8", "inplace")])
def test_seed_bench_gate_native(disp, combine_in):
    _run(calls.bench_gate_case, disp, combine_in)


def test_the_seed_names_run_on_the_native_backend():
    from runtime.seed_compat import EpDispatchCombineConfig, EpDispatchCombineOp

    def check():
        cfg = EpDispatchCombineConfig(rank=dist.get_rank(), world_size=dist.get_world_size(), hidden_dim=256,
                                      max_num_inp_token_per_rank=8, num_experts_per_rank=2, num_experts_per_token=2,
                                      kernel_backend="hip")
        with EpDispatchCombineOp(cfg, None) as op:
            assert (op.backend_name, op.epgen_backend) == ("hip", "native")
    run_collective(check)


def test_seed_bench_graph_mode_native():
    """bench_ep.py's graph mode: one CUDA graph for dispatch (return_routing=True) and one for the combine captured
    against that handle, replayed in alternation; after a replay of both the output is U * input."""
    from runtime.seed_compat import EpDispatchCombineConfig, EpDispatchCombineOp

    def check():
        rank, world = dist.get_rank(), dist.get_world_size()
        H, K, EPR, ct = 256, 4, 4, 32
        g = torch.Generator().manual_seed(1234 + rank)
        inp = torch.randn(ct, H, generator=g).to(torch.bfloat16).cuda()
        wts = torch.rand(ct, K, generator=g).cuda()
        idx = torch.stack([torch.randperm(world * EPR, generator=g)[:K] for _ in range(ct)]).to(torch.int32).cuda()
        U = torch.zeros(ct, world, dtype=torch.bool).scatter_(1, idx.cpu().long() // EPR, True).sum(1)
        cfg = EpDispatchCombineConfig(rank=rank, world_size=world, hidden_dim=H, max_num_inp_token_per_rank=ct,
                                      num_experts_per_rank=EPR, num_experts_per_token=K, kernel_backend="hip")
        with EpDispatchCombineOp(cfg, None) as op:
            *_, total_t, r = op.dispatch(inp, wts, None, idx, return_routing=True)
            torch.cuda.synchronize()
            dist.barrier()
            total = int(total_t.cpu().item())
            buf = op.combine_in_view()[:total]
            buf.copy_(op.recv_tokens()[:total])
            op.combine(buf, routing=r)
            torch.cuda.synchronize()
            dist.barrier()
            gd = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gd):
                *_, r_cap = op.dispatch(inp, wts, None, idx, return_routing=True)
            torch.cuda.synchronize()
            dist.barrier()
            gc = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gc):
                out, _ = op.combine(buf, routing=r_cap)
            torch.cuda.synchronize()
            dist.barrier()
            for _ in range(3):
                gd.replay()
                torch.cuda.synchronize()
                dist.barrier()
                buf.copy_(op.recv_tokens()[:total])  # the identity expert, between the legs
                gc.replay()
                torch.cuda.synchronize()
                dist.barrier()
            exp = (U.view(ct, 1).float() * inp.float().cpu()).to(torch.bfloat16)
            assert torch.allclose(out.float().cpu(), exp.float(), atol=2e-2, rtol=2e-2), "graph replay: out != U * input"
    run_collective(check)


def test_seed_graph_capture_native():
    """test_graph_capture.py: a whole dispatch -> identity expert -> combine step captured in one CUDA graph (after
    warm-up on a side stream); every replay reproduces U * input."""
    from runtime.seed_compat import EpDispatchCombineConfig, EpDispatchCombineOp
    from runtime.seed_compat.cco import Communicator

    def check():
        rank, world = dist.get_rank(), dist.get_world_size()
        H, K, EPR, ct = 256, 8, 16, 64
        g = torch.Generator().manual_seed(1234 + rank)
        inp = torch.randn(ct, H, generator=g).to(torch.bfloat16).cuda()
        idx = torch.randint(0, world * EPR, (ct, K), generator=g, dtype=torch.int32).cuda()
        wts = torch.rand(ct, K, generator=g).cuda()
        obj = [Communicator.get_unique_id() if rank == 0 else None]
        dist.broadcast_object_list(obj, src=0)
        with Communicator.init(world, rank, obj[0], per_rank_vmm=1 << 28) as comm:
            cfg = EpDispatchCombineConfig(rank=rank, world_size=world, hidden_dim=H, max_num_inp_token_per_rank=ct,
                                          num_experts_per_rank=EPR, num_experts_per_token=K)
            op = EpDispatchCombineOp(cfg, comm)
            comm.barrier()

            def step():
                recv_x, _w, _s, _i, _total, routing = op.dispatch(inp, wts, None, idx, return_routing=True)
                return op.combine(recv_x, routing=routing)[0]

            U = torch.tensor([len({int(i) // EPR for i in row}) for row in idx.cpu()], dtype=torch.float32)
            exp = (U.view(ct, 1) * inp.float().cpu()).to(torch.bfloat16).float()
            assert torch.allclose(step().float().cpu(), exp, atol=1e-2, rtol=1e-2), "eager step"
            torch.cuda.synchronize()
            comm.barrier()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            comm.barrier()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = step()
            for i in range(3):
                comm.barrier()
                graph.replay()
                torch.cuda.synchronize()
                comm.barrier()
                assert torch.allclose(captured.float().cpu(), exp, atol=1e-2, rtol=1e-2), f"replay {i}"
            op.close()
    run_collective(check)
