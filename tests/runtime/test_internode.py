"""Internode EP on the torch reference backend: 4 gloo processes as 2 emulated nodes x 2 GPUs.

Scenario functions (``scn_*``) run on every rank of a gloo world (tests/support/ep_dist.py). Each parity
round dispatches the same inputs through an intranode op (gpu_per_node 4) and an internode op
(gpu_per_node 2, route v2 / v2_ll / auto) and asserts identical received rows, slots, total_recv,
and bit-identical combine results of a non-linear expert (so the float32 summation order is
checked, not just exact sums), plus the identity round of tests/support/rounds.py.
"""

from __future__ import annotations

import functools
import os
import socket
from contextlib import contextmanager

import pytest
import torch

from tests.support.configs import make_config
from tests.support.ep_dist import get_world, shutdown_all
from tests.support.ep_oracle import make_inputs
from runtime import ConfigError, EpDispatchCombineOp, EpgenError
from runtime import config as rconfig
from tests.support.rounds import check_round

WORLD, GPN = 4, 2
EMU = rconfig.EMULATE_NODES_ENV


_cfg = functools.partial(make_config, world=WORLD, max_num_inp_token_per_rank=520)  # _cfg(rank, **fields)


@contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _expert(out: torch.Tensor) -> torch.Tensor:
    """A non-linear expert whose row sums round (so summation order shows in the result)."""
    f = out.float()
    return (f * 1.37 + f * f * 0.011 - 0.3).to(out.dtype)


def _round(op, rank, seed, counts, dtype, payload=None):
    cfg = op.config
    x, w, idx = make_inputs(seed, rank, counts[rank], cfg.hidden_dim, cfg.num_experts_per_token, cfg.num_experts,
                            dtype)
    scales = None
    if payload is not None:  # pre-quantized fp8 payload with fp32 scales, moved verbatim
        x = x.float().to(payload)
        scales = torch.arange(counts[rank] * cfg.scale_dim, dtype=torch.float32).reshape(-1, cfg.scale_dim) + rank
    out, out_w, out_s, out_i, total, h = op.dispatch(x, w, scales, idx, return_routing=True)
    n = int(total)
    y = op.combine_in_view() if payload is None else torch.zeros(cfg.max_recv_tokens, cfg.hidden_dim,
                                                                   dtype=cfg.combine_dtype)
    y[:n] = _expert(out[:n]) if payload is None else _expert(out[:n].float().to(cfg.combine_dtype))
    comb, comb_w = op.combine(y, out_w, routing=h)
    rows = [out[:n].view(torch.uint8).clone(), out_w[:n].clone(), out_i[:n].clone()]
    if out_s is not None:
        rows.append(out_s[:n].clone())
    return n, h.recv_src.clone(), rows, comb, comb_w, op.dropped_count().item(), h


def scn_parity(rank, world, kernel, plans, max_ll, dtype=torch.bfloat16, extra=None):
    """Intranode vs internode on the same inputs, plus the oracle; -> the routes the calls took."""
    extra = dict(extra or {})
    payload = extra.pop("payload", None)
    routes = []
    with _env(**{EMU: "1"}):
        intra = EpDispatchCombineOp(_cfg(rank, data_type=dtype, **extra))
        inter = EpDispatchCombineOp(_cfg(rank, data_type=dtype, gpu_per_node=GPN, internode_kernel=kernel,
                                         internode_auto_ll_max_tokens=max_ll, **extra))
    assert inter.config.is_internode and not intra.config.is_internode
    assert inter.capabilities["internode"] and inter.last_internode_kernel is None
    for seed, counts in enumerate(plans):
        a = _round(intra, rank, seed, counts, dtype, payload)
        b = _round(inter, rank, seed, counts, dtype, payload)
        route = inter.last_internode_kernel
        routes.append(route)
        assert intra.last_internode_kernel is None
        assert a[0] == b[0] and torch.equal(a[1], b[1]), f"rank {rank}: received set differs ({counts})"
        for ra, rb in zip(a[2], b[2]):
            assert torch.equal(ra, rb), f"rank {rank}: received rows differ ({counts}, {route})"
        assert torch.equal(a[3], b[3]), f"rank {rank}: combine differs ({counts}, {route})"
        assert torch.equal(a[4], b[4]) and a[5] == b[5]
        if payload is None and not extra:  # the identity oracle on the internode op, same route
            check_round(inter, rank, world, 1000 + seed, counts)
            assert inter.last_internode_kernel == route
        # routing replay keeps the plan and the route choice
        x, w, idx = make_inputs(seed + 7, rank, counts[rank], 64, 4, inter.config.num_experts, dtype)
        if payload is None:
            out1 = inter.dispatch(x, w, None, idx, routing=b[6])[0]
            out2 = intra.dispatch(x, w, None, idx, routing=a[6])[0]
            assert torch.equal(out1, out2) and inter.last_internode_kernel == route
    intra.close()
    inter.close()
    return routes


def scn_host_mismatch(rank, world, gpn):
    with _env(**{EMU: None}):
        try:
            EpDispatchCombineOp(_cfg(rank, gpu_per_node=gpn))
        except ConfigError as e:
            return str(e)
    return None


def scn_emulate_on_some_ranks(rank, world):
    with _env(**{EMU: "1" if rank == 1 else None}):
        try:
            EpDispatchCombineOp(_cfg(rank, gpu_per_node=GPN))
        except ConfigError as e:
            return str(e)
    return None


def scn_native_internode(rank, world):
    with _env(**{EMU: "1", rconfig.BACKEND_ENV: None}):
        try:
            EpDispatchCombineOp(_cfg(rank, gpu_per_node=GPN, kernel_backend="native"))
        except EpgenError as e:
            return f"{type(e).__name__}: {e}"
    return None


# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _worlds():
    yield
    shutdown_all()


SMALL = [[1] * WORLD, [7] * WORLD, [128] * WORLD, [0, 1, 7, 128]]


@pytest.mark.parametrize("kernel", ["v2", "v2_ll", "auto"])
def test_parity_small(kernel):
    routes = get_world(WORLD).run(scn_parity, kernel, SMALL, 512)
    want = "v2_ll" if kernel == "auto" else kernel
    assert routes == [[want] * len(SMALL)] * WORLD


@pytest.mark.parametrize("kernel", ["v2", "v2_ll"])
def test_parity_512_513(kernel):
    routes = get_world(WORLD).run(scn_parity, kernel, [[512] * WORLD, [513] * WORLD], 513)
    assert routes == [[kernel, kernel]] * WORLD


def test_auto_switch_at_512_513():
    plans = [[512] * WORLD, [513] * WORLD, [513, 0, 512, 1], [1] * WORLD]
    routes = get_world(WORLD).run(scn_parity, "auto", plans, 512)
    # the call's largest per-rank token count decides, alike on every rank
    assert routes == [["v2_ll", "v2", "v2", "v2_ll"]] * WORLD


@pytest.mark.parametrize("kernel", ["v2", "v2_ll"])
def test_parity_capped_fp32_and_fp8_payload(kernel):
    plans = [[7] * WORLD, [128, 3, 0, 64]]
    get_world(WORLD).run(scn_parity, kernel, plans, 512, torch.float32, {"max_total_recv_tokens": 40})
    get_world(WORLD).run(scn_parity, kernel, plans, 512, torch.bfloat16,
                         {"payload": torch.float8_e4m3fn, "dispatch_data_type": torch.float8_e4m3fn,
                          "combine_data_type": torch.bfloat16, "scale_dim": 2, "scale_type_size": 4})


def test_host_layout_mismatch_without_switch():
    host = socket.gethostname()
    msgs = get_world(WORLD).run(scn_host_mismatch, GPN)
    assert all(m is not None and f"nodes 0, 1 are all on host {host!r}" in m and "EPGEN_EMULATE_NODES=1" in m
               and m.startswith("gpu_per_node=2: the host layout does not match") for m in msgs), msgs
    assert get_world(WORLD).run(scn_host_mismatch, 0) == [None] * WORLD  # one node on one host: fine


def test_emulation_switch_must_agree():
    msgs = get_world(WORLD).run(scn_emulate_on_some_ranks)
    assert all(m == f"{EMU}=1 is set on rank 1 only: set it on every rank or none" for m in msgs), msgs


def test_native_internode_needs_a_gpu_here():
    # the config, rules and host layout pass; the native internode backend then wants its GPU
    msgs = get_world(WORLD).run(scn_native_internode)
    assert all(m and m.startswith("EpgenError: kernel backend 'native' needs a GPU") for m in msgs), msgs


@pytest.mark.parametrize("world,gpn", [(2, 1), (4, 2), (4, 1), (8, 4), (8, 2), (6, 3)])
@pytest.mark.parametrize("route", ["v2", "v2_ll"])
def test_native_exchange_splits_pair_up(world, gpn, route):
    """What every rank sends to a peer in a stage is what that peer expects from it, and the cells
    delivered add up to every source's tokens (each rank receives one cell per (source, token))."""
    from runtime.backends.internode import exchange_splits

    g = torch.Generator().manual_seed(world * 10 + gpn)
    counts = torch.randint(0, 50, (world,), generator=g).tolist()
    sp = [exchange_splits(route, counts, r, gpn) for r in range(world)]
    stages = ["d1"] if route == "v2_ll" else ["d1", "d2"]
    for stage in stages:
        for r in range(world):
            for p in range(world):
                assert sp[r][stage][0][p] == sp[p][stage][1][r], (stage, r, p)
    for r in range(world):
        assert sum(sp[r][stages[-1]][1]) == sum(counts)
        if route == "v2":  # stage 1 stays on the rail, stage 2 inside the node
            assert all(n == 0 or p % gpn == r % gpn for p, n in enumerate(sp[r]["d1"][0]))
            assert all(n == 0 or p // gpn == r // gpn for p, n in enumerate(sp[r]["d2"][0]))


def test_native_record_layout():
    from runtime.backends.internode import record_layout

    lay = record_layout(row_bytes=14336, scale_bytes=56 * 4, k=8, gpn=4)
    assert lay["off_w"] == 14336 + 224 and lay["off_ids"] == lay["off_w"] + 32
    assert lay["off_rows"] == lay["off_ids"] + 32 and lay["off_src"] == lay["off_rows"] + 16
    assert lay["rec"] % 16 == 0 and lay["rec"] >= lay["off_src"] + 4 and lay["rec"] - (lay["off_src"] + 4) < 16
    odd = record_layout(row_bytes=64, scale_bytes=3, k=1, gpn=1)  # e8m0 scales: weights realigned to 4
    assert odd["off_w"] == 68


# --- in-process: configs and switches ----------------------------------------------------------
def test_config_accepts_internode():
    for kernel in rconfig.INTERNODE_KERNELS:
        c = _cfg(0, gpu_per_node=GPN, internode_kernel=kernel)
        assert c.is_internode and c.resolved_gpu_per_node == GPN
    c = _cfg(3, gpu_per_node=GPN, kernel_backend="native")
    assert c.is_internode and c.resolved_backend == "native"
    _cfg(0, gpu_per_node=GPN, dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.float32,
         scale_dim=1, scale_type_size=4)
    _cfg(0, gpu_per_node=GPN, dispatch_data_type=torch.float4_e2m1fn_x2, combine_data_type=torch.bfloat16,
         scale_dim=2, scale_type_size=1)


def test_config_internode_errors():
    with pytest.raises(ConfigError, match=r"^gpu_per_node=3: world_size=4 must be a multiple of gpu_per_node$"):
        _cfg(0, gpu_per_node=3)
    with pytest.raises(ConfigError, match=r"^internode_auto_ll_max_tokens=0: must be positive$"):
        _cfg(0, gpu_per_node=GPN, internode_auto_ll_max_tokens=0)
    rule = "internode_quant_none: internode topologies require quant_type \"none\""
    for kw in (dict(quant_type="fp8_direct_cast"), dict(quant_type="fp8_blockwise", hidden_dim=128),
               dict(dispatch_quant_type="fp8_blockwise", hidden_dim=128),
               dict(dispatch_quant_type="fp4_blockwise")):
        with pytest.raises(ConfigError, match="^" + rule):
            _cfg(0, gpu_per_node=GPN, **kw)
    with pytest.raises(ConfigError, match=r"^combine_mode='scatter': internode \(world_size=4 > gpu_per_node=2\) "
                                          r"combines with combine_mode='gather' only"):
        _cfg(0, gpu_per_node=GPN, combine_mode="scatter")
    with pytest.raises(ConfigError, match="standard-MoE layout conversion is intranode only"):
        _cfg(0, gpu_per_node=GPN, enable_std_moe=True)


def test_native_internode_in_process(monkeypatch):
    monkeypatch.delenv(rconfig.BACKEND_ENV, raising=False)
    with pytest.raises(EpgenError, match=r"^kernel backend 'native' needs a GPU"):
        EpDispatchCombineOp(_cfg(0, gpu_per_node=GPN, kernel_backend="native"))


@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_emulation_switch_values(monkeypatch, value):
    monkeypatch.setenv(EMU, value)
    with pytest.raises(ConfigError, match=rf"^environment {EMU}='{value}': must be '1'"):
        EpDispatchCombineOp(_cfg(0, gpu_per_node=GPN))
