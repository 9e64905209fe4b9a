"""Native internode dispatch/combine on one host emulating 2 nodes (EPGEN_EMULATE_NODES=1): 2 x 1 GPU
on 2 GPUs (run so far), 2 x 2 on 4, 2 x 4 on 8.

Run: torchrun --nproc-per-node 2 -m pytest -m multigpu -q tests/gpu/test_ep_internode.py
"""

import os

import pytest
import torch
import torch.distributed as dist

from runtime import EpDispatchCombineOp
from runtime.errors import EpgenError
from runtime import config as rconfig
from tests.support.ep_oracle import expected_received, multiplicity, random_routing
from tests.support.configs import dist_config
from tests.gpu.dist_util import oversubscribed, run_collective

pytestmark = pytest.mark.multigpu

if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
    pytest.skip("needs torchrun and GPUs", allow_module_level=True)

H, TMAX, K, EPR = 2048, 4096, 8, 16


@pytest.fixture(scope="module", autouse=True)
def emulated_nodes():
    os.environ[rconfig.EMULATE_NODES_ENV] = "1"  # on every rank: 2 emulated nodes
    yield
    os.environ.pop(rconfig.EMULATE_NODES_ENV, None)


def _cfg(internode=True, **kw):
    fields = dict(hidden_dim=H, max_num_inp_token_per_rank=TMAX, num_experts_per_rank=EPR, num_experts_per_token=K,
                  data_type=torch.bfloat16)
    if internode:  # two emulated nodes: 2 x 1 GPU on 2 GPUs, 2 x 2 on 4, 2 x 4 on 8
        fields["gpu_per_node"] = max(1, dist.get_world_size() // 2)
    return dist_config(**{**fields, **kw})


def _inputs(seed, T):
    g = torch.Generator().manual_seed(seed * 31 + dist.get_rank())
    x = (torch.randint(-64, 65, (T, H), generator=g).float() / 16).to(torch.bfloat16)
    w = torch.randint(1, 64, (T, K), generator=g).float() / 64
    return x.cuda(), w.cuda(), random_routing(g, T, K, EPR * dist.get_world_size()).cuda()


def _gathered(t):
    """Every rank's tensor (token counts may differ: padded all_gather)."""
    n = torch.tensor([t.shape[0]], device="cuda")
    ns = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(ns, n)
    top = int(max(int(v) for v in ns))
    pad = torch.zeros((top, *t.shape[1:]), dtype=t.dtype, device=t.device)
    pad[: t.shape[0]] = t
    parts = [torch.empty_like(pad) for _ in ns]
    dist.all_gather(parts, pad)
    return [p[: int(v)] for p, v in zip(parts, ns)]


def _check_round(op, T, seed):
    """Identity expert: received rows in (source rank, token) order, and combine == U * x exactly."""
    x, w, idx = _inputs(seed, T)
    out, ow, _, oi, total, h = op.dispatch(x, w, None, idx, return_routing=True)
    xs, ids = _gathered(x), _gathered(idx)
    rows = expected_received([i.cpu() for i in ids], dist.get_rank(), EPR)
    n = int(total.item())
    assert n == len(rows), f"T={T}: total_recv {n}, expected {len(rows)}"
    if n:
        assert torch.equal(out[:n], torch.stack([xs[s][t] for s, t in rows])), f"T={T}: received rows differ"
        assert torch.equal(oi[:n], torch.stack([ids[s][t] for s, t in rows])), f"T={T}: received ids differ"
    comb, _ = op.combine(out, routing=h)
    U = torch.tensor(multiplicity(idx.cpu(), EPR), dtype=torch.float32, device="cuda")
    assert torch.equal(comb, (x.float() * U[:, None]).to(torch.bfloat16)), f"T={T}: identity combine differs"
    return op.last_internode_kernel


@pytest.mark.parametrize("kernel", ["v2", "v2_ll", "auto"])
def test_identity_at_every_size(kernel):
    def check():
        with EpDispatchCombineOp(_cfg(internode_kernel=kernel)) as op:
            for T in (1, 128, 512, 513, 4096):
                route = _check_round(op, T, T)
                want = kernel if kernel != "auto" else ("v2_ll" if T <= 512 else "v2")
                assert route == want, f"T={T}: took {route}, expected {want}"
    run_collective(check)  # its all-gather is the closing barrier


def test_parity_with_intranode_and_weights():
    """A non-trivial expert with weights: internode (both routes) == intranode, bit for bit."""
    def check():
        x, w, idx = _inputs(7, 300)
        res = {}
        for name, cfg in (("intranode", _cfg(internode=False)), ("v2", _cfg(internode_kernel="v2")),
                          ("v2_ll", _cfg(internode_kernel="v2_ll"))):
            with EpDispatchCombineOp(cfg) as op:
                out, ow, _, oi, total, h = op.dispatch(x, w, None, idx, return_routing=True)
                n = int(total.item())
                expert = op.combine_in_view()
                expert[:n] = (out[:n].float() * 3 - 1).to(torch.bfloat16)
                comb, cw = op.combine(expert[:n], weights=ow[:n], routing=h)
                res[name] = (comb.clone(), cw.clone())
            dist.barrier()
        for name in ("v2", "v2_ll"):
            assert torch.equal(res[name][0], res["intranode"][0]), f"{name} combine differs from intranode"
            assert torch.equal(res[name][1], res["intranode"][1]), f"{name} combined weights differ"
    run_collective(check)


def test_fp8_payload_and_cap():
    def check():
        T, cap = 256, 100
        with EpDispatchCombineOp(_cfg(internode_kernel="auto", dispatch_data_type=torch.float8_e4m3fn,
                                      combine_data_type=torch.bfloat16, scale_dim=H // 128, scale_type_size=4,
                                      max_total_recv_tokens=cap)) as op:
            x, w, idx = _inputs(9, T)
            xq = x.to(torch.float8_e4m3fn)
            sc = torch.rand(T, H // 128, device="cuda") + 0.5
            out, ow, os_, oi, total, h = op.dispatch(xq, w, sc, idx, return_routing=True)
            rows = expected_received([i.cpu() for i in _gathered(idx)], dist.get_rank(), EPR)
            n, dropped = int(total.item()), int(op.dropped_count())
            xs, scs = _gathered(xq.view(torch.uint8)), _gathered(sc)  # collectives before any rank may assert
            assert n == min(cap, len(rows)) and n + dropped == len(rows), (n, dropped, len(rows))
            assert torch.equal(out[:n].view(torch.uint8), torch.stack([xs[s][t] for s, t in rows[:n]]))
            assert torch.equal(os_[:n], torch.stack([scs[s][t] for s, t in rows[:n]]))
    run_collective(check)  # its all-gather is the closing barrier


@pytest.mark.parametrize("kernel", ["v2", "v2_ll"])
def test_graph_capture(kernel):
    def check():
        T = 128
        with EpDispatchCombineOp(_cfg(internode_kernel=kernel)) as op:
            x, w, idx = _inputs(11, T)
            sx, sidx = x.clone(), idx.clone()

            def round_trip():
                out, _, _, _, _, h = op.dispatch(sx, None, None, sidx, return_routing=True)
                return op.combine(out, routing=h)[0]

            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                round_trip()
            torch.cuda.current_stream().wait_stream(s)
            dist.barrier()
            g = torch.cuda.CUDAGraph()
            if oversubscribed():  # gloo group: the transport cannot be captured; a clear error says so
                with pytest.raises(EpgenError, match="cannot be captured"):
                    with torch.cuda.graph(g):
                        round_trip()
                return None
            with torch.cuda.graph(g):
                res = round_trip()
            for rep in range(5):
                x, _, idx = _inputs(50 + rep, T)
                sx.copy_(x), sidx.copy_(idx)
                g.replay()
                torch.cuda.synchronize()
                U = torch.tensor(multiplicity(idx.cpu(), EPR), dtype=torch.float32, device="cuda")
                assert torch.equal(res, (x.float() * U[:, None]).to(torch.bfloat16)), f"replay {rep}"
    run_collective(check)  # its all-gather is the closing barrier


def test_bad_expert_id_raises_on_every_rank():
    """The eager count all-gather carries each rank's largest id: the last rank's bad id raises
    InputError on every rank (naming that rank) before anything is sent; the op stays usable."""
    from runtime import InputError

    def check():
        last = dist.get_world_size() - 1
        with EpDispatchCombineOp(_cfg(internode_kernel="v2_ll")) as op:
            x, w, idx = _inputs(41, 64)
            bad = idx.clone()
            if dist.get_rank() == last:
                bad[5, 2] = EPR * dist.get_world_size() + 3
            try:
                op.dispatch(x, w, None, bad)
                return "no InputError"
            except InputError as e:
                if f"passed by rank {last}" not in str(e):
                    return f"unexpected message: {e}"
            _check_round(op, 64, 41)
        return None

    run_collective(check)
