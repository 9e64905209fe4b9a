"""The benchmark's accounting, bandwidth arithmetic and correctness gate (bench/accounting.py, bench/gate.py), and
its sweep (bench/sweep.py), on CPU.

Accounting and bandwidths against hand-computed routings; the identity gate on the torch backend
over 2 gloo ranks (tests/support/ep_dist.py): it passes on clean data and raises GateError, on every rank
and naming the right source rank and row count, when one received row is damaged; a CPU smoke run
of a whole benchmark point (eager only: no graphs on CPU) checks the JSON record and that
scripts/plot_bench.py reads it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.support.ep_dist import get_world
from tests.support.ep_oracle import expected_received, experts_per_rank_for, make_inputs, multiplicity
from runtime import EpDispatchCombineConfig, EpDispatchCombineOp
from bench import cli, sweep, tables
from bench.accounting import accounting, bandwidths, row_bytes, rows_per_destination
from bench.gate import GateError, check_gate_mode, identity_expected, identity_gate
from bench.inputs import dequantize_rows, make_input_sets, point_config, quantize_blocks

ROOT = Path(__file__).resolve().parents[2]


def _ids(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------------------------
def test_all_rows_to_one_rank():
    # world 2, 4 experts per rank: every id of rank 0's tokens lives on rank 1
    idx = _ids([[4, 5, 6, 7], [7, 6, 5, 4], [4, 4, 4, 4]])
    assert rows_per_destination(idx, 2, 4) == [0, 3]
    acc = accounting(idx, 0, 2, 4, 14336, recv_per_source=[0, 5])
    assert acc["sent_per_dest"] == [0, 3] and acc["recv_per_source"] == [0, 5]
    assert (acc["sent_rows"], acc["local_rows"], acc["remote_rows"]) == (3, 0, 3)
    assert (acc["recv_rows"], acc["recv_remote_rows"]) == (5, 5)
    assert acc["dispatch_logical_bytes"] == 5 * 14336  # every row rank 0 receives
    assert acc["dispatch_link_bytes"] == 3 * 14336  # every row it sends crosses
    assert acc["combine_logical_bytes"] == acc["combine_link_bytes"] == 3 * 14336  # its 3 rows come back


def test_repeated_experts_on_one_rank_send_one_row():
    # rank 1 of 2, 4 experts per rank: token 0 names 4 experts of rank 0 (one row), token 1 two on each
    # rank (one row each), token 2 the same local expert 4 times (one local row)
    idx = _ids([[0, 1, 2, 3], [0, 5, 1, 6], [5, 5, 5, 5]])
    assert rows_per_destination(idx, 2, 4) == [2, 2]
    acc = accounting(idx, 1, 2, 4, 10, recv_per_source=[7, 2])
    assert (acc["sent_rows"], acc["local_rows"], acc["remote_rows"]) == (4, 2, 2)
    assert (acc["recv_rows"], acc["recv_remote_rows"]) == (9, 7)
    assert (acc["dispatch_logical_bytes"], acc["dispatch_link_bytes"]) == (90, 20)
    assert (acc["combine_logical_bytes"], acc["combine_link_bytes"]) == (40, 20)


def test_negative_ids_send_nothing():
    idx = _ids([[-1, -1, -1, -1], [-1, 3, -1, 3], [-1, -1, 6, -1]])
    assert rows_per_destination(idx, 2, 4) == [1, 1]
    assert rows_per_destination(_ids([[-1, -1], [-5, -1]]), 2, 4) == [0, 0]
    assert rows_per_destination(torch.empty(0, 4, dtype=torch.int32), 2, 4) == [0, 0]
    acc = accounting(idx, 0, 2, 4, 8, recv_per_source=[1, 0])
    assert (acc["sent_rows"], acc["remote_rows"], acc["recv_rows"]) == (2, 1, 1)


def test_world_four():
    # world 4, 2 experts per rank (rank = id // 2), rank 2's view
    idx = _ids([[0, 1, 2],    # ranks {0, 1}
                [4, 5, -1],   # {2}
                [7, 6, 3],    # {3, 1}
                [-1, -1, -1],  # none
                [0, 4, 5]])   # {0, 2}
    assert rows_per_destination(idx, 4, 2) == [2, 2, 2, 1]
    acc = accounting(idx, 2, 4, 2, 100, recv_per_source=[3, 0, 2, 4], combine_row_bytes=200)
    assert (acc["sent_rows"], acc["local_rows"], acc["remote_rows"]) == (7, 2, 5)
    assert (acc["recv_rows"], acc["recv_remote_rows"]) == (9, 7)
    assert (acc["dispatch_row_bytes"], acc["combine_row_bytes"]) == (100, 200)
    assert (acc["dispatch_logical_bytes"], acc["dispatch_link_bytes"]) == (900, 500)
    assert (acc["combine_logical_bytes"], acc["combine_link_bytes"]) == (1400, 1000)


def test_accounting_rejects_inconsistent_counts():
    idx = _ids([[0, 2], [1, 3]])  # world 2, 2 experts per rank: rank 0 sends itself 2 rows
    with pytest.raises(ValueError, match="sends itself 2 rows"):
        accounting(idx, 0, 2, 2, 8, recv_per_source=[1, 3])
    with pytest.raises(ValueError, match="3 entries"):
        accounting(idx, 0, 2, 2, 8, recv_per_source=[2, 3, 0])
    with pytest.raises(ValueError, match="expert id 4 >= 4"):
        rows_per_destination(_ids([[0, 4]]), 2, 2)


def test_row_bytes_bf16_fp32_fp8():
    def cfg(dtype, hidden=7168):
        return EpDispatchCombineConfig(**point_config(0, 2, 16, hidden, 8, 256, dtype, "torch"))

    assert row_bytes(cfg(torch.bfloat16)) == (14336, 14336)
    assert row_bytes(cfg(torch.float32)) == (28672, 28672)
    fp8 = cfg(torch.float8_e4m3fn)
    assert (fp8.dispatch_dtype, fp8.combine_dtype, fp8.scale_dim, fp8.scale_type_size) == \
        (torch.float8_e4m3fn, torch.bfloat16, 56, 4)
    assert row_bytes(fp8) == (7168 + 56 * 4, 14336)  # 1 byte per element + a float32 per 128; bf16 back
    acc = accounting(_ids([[0, 200], [130, 131]]), 0, 2, 128, 7392, recv_per_source=[1, 4], combine_row_bytes=14336)
    assert (acc["dispatch_logical_bytes"], acc["dispatch_link_bytes"]) == (5 * 7392, 2 * 7392)
    assert (acc["combine_logical_bytes"], acc["combine_link_bytes"]) == (3 * 14336, 2 * 14336)
    with pytest.raises(ValueError, match="hidden % 128"):
        point_config(0, 2, 16, 100, 8, 256, torch.float8_e4m3fn)


def test_bandwidth_arithmetic():
    acc = {"dispatch_logical_bytes": 900, "dispatch_link_bytes": 500, "combine_logical_bytes": 1400,
           "combine_link_bytes": 1000}
    bw = bandwidths(acc, 1e-6, 2e-6)
    assert bw == pytest.approx({"dispatch_logical_GBps": 0.9, "dispatch_link_GBps": 0.5,
                                "combine_logical_GBps": 0.7, "combine_link_GBps": 0.5}, rel=1e-12)
    big = bandwidths({k: 14336 * 8192 for k in acc}, 200e-6, 400e-6)  # 117 MB in 200 us = 587 GB/s
    assert big["dispatch_link_GBps"] == pytest.approx(14336 * 8192 / 200e-6 / 1e9)
    assert big["combine_logical_GBps"] == pytest.approx(big["dispatch_logical_GBps"] / 2)
    none = bandwidths(acc, None, 0.0)
    assert none["dispatch_logical_GBps"] is None and none["dispatch_link_GBps"] is None
    assert none["combine_logical_GBps"] == 0.0


def test_identity_expected_is_u_times_x():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.5, -1.0], [1.5, 0.25]], dtype=torch.bfloat16)
    idx = _ids([[0, 2], [1, 1], [-1, -1], [3, 1]])  # world 2, 2 per rank: U = 2, 1, 0, 2
    got = identity_expected(x, idx, 2, 2, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert got.tolist() == [[2.0, 4.0], [3.0, 4.0], [0.0, 0.0], [3.0, 0.5]]


def test_fp8_block_quantization_round_trip():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 256, generator=g) * torch.tensor([1e-3, 1.0, 1e3, 1, 1, 1])[:, None]).to(torch.bfloat16)
    q, s = quantize_blocks(x, 2)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (6, 2)
    assert torch.equal(s, x.float().view(6, 2, 128).abs().amax(-1) / 448.0)
    back = dequantize_rows(q, s, torch.float32)
    assert bool(((back - x.float()).abs() <= x.float().abs() * 2 ** -3 + s.repeat_interleave(128, 1) * 2 ** -9).all())


def test_cli_defaults_and_table():
    args = cli.build_parser().parse_args([])
    assert args.dtypes == ["bfloat16", "float8_e4m3fn"]
    assert (args.tokens, args.hidden, args.inner, args.reps, args.input_sets) == (None, [7168], 20, 30, 0)  # None: 128 4096
    args = cli.build_parser().parse_args(["--tokens", "8", "--hidden", "256", "--dtypes", "bfloat16",
                                            "--torch-baseline", "--lowprec", "--lowprec-tokens", "8",
                                            "--inner", "3", "--reps", "4", "--out", "x.jsonl"])
    assert (args.tokens, args.dtypes, args.torch_baseline, args.lowprec, args.out) == \
        ([8], ["bfloat16"], True, True, "x.jsonl")
    assert (args.launch_blocks, args.launch_threads, args.profile, args.combine_mode, args.combine_threads) == \
        ([0], [0], False, ["gather"], [0])
    args = cli.build_parser().parse_args(["--launch-blocks", "32", "--launch-threads", "1024", "--profile"])
    assert (args.launch_blocks, args.launch_threads, args.profile) == ([32], [1024], True)


def test_combine_threads_of_their_own_go_through_the_per_role_fields():
    """--combine-threads: the combine's block size alone (launch_threads would pin both roles), in warps of
    the target's wave; the grid stays the one asked for, for both roles."""
    for geometry, wave, want in (
            ({"launch_blocks": 24, "launch_threads": 512, "combine_threads": 768}, 32,
             {"dispatch": (24, 512), "combine": (24, 768), "combine_ll": (24, 768)}),
            ({"launch_blocks": 32, "combine_threads": 1024}, 64, {"dispatch": (32, 0), "combine": (32, 1024)}),
            ({"launch_blocks": 24, "launch_threads": 512, "combine_threads": 0}, 32,
             {"dispatch": (24, 512), "combine": (24, 512)})):
        cfg = EpDispatchCombineConfig(**point_config(0, 2, 64, 256, 4, 8, torch.bfloat16, geometry=geometry,
                                                     wave=wave))
        assert {role: cfg.launch_override(role, 64, wave) for role in want} == want
    with pytest.raises(ValueError, match="whole 32-lane waves"):
        point_config(0, 2, 64, 256, 4, 8, torch.bfloat16, geometry={"combine_threads": 100})


def test_plan_points_crosses_geometries_and_combines():
    """--launch-blocks 24 32 --launch-threads 512 1024 --combine-mode gather scatter --protocol ll bw: every
    combination that can run, in order; ll above its token limit or with the scatter combine is named."""
    args = cli.build_parser().parse_args(["--tokens", "128", "4096", "--dtypes", "bfloat16", "--launch-blocks", "24",
                                            "32", "--launch-threads", "512", "1024", "--combine-mode", "gather",
                                            "scatter", "--protocol", "ll", "bw"])
    points, skipped = cli.plan_points(args, [torch.bfloat16], [None])
    got = [(p["T"], p["geometry"]["launch_blocks"], p["geometry"]["launch_threads"], p["protocol"], p["combine_mode"])
           for p in points]
    assert {p["geometry"]["combine_threads"] for p in points} == {0}
    geos = [(24, 512), (24, 1024), (32, 512), (32, 1024)]
    want = [(128, b, t, pr, m) for b, t in geos for pr, m in (("ll", "gather"), ("bw", "gather"), ("bw", "scatter"))]
    want += [(4096, b, t, "bw", m) for b, t in geos for m in ("gather", "scatter")]
    assert got == want
    assert len(skipped) == 4 + 8 and all("ll" in why for why in skipped)
    assert sum("scatter" in why for why in skipped) == 4  # 128: ll with scatter; 4096: ll past its token limit
    assert sum("at most" in why for why in skipped) == 8
    # internode points: bandwidth protocol and gather only
    pts, _ = cli.plan_points(args, [torch.bfloat16], [{"gpu_per_node": 1, "internode_kernel": "v2"}])
    assert {(p["protocol"], p["combine_mode"]) for p in pts} == {("bw", "gather")}


def test_geometry_override_reaches_the_config():
    kw = point_config(0, 2, 64, 256, 4, 8, torch.bfloat16, geometry={"launch_blocks": 32, "launch_threads": 96})
    cfg = EpDispatchCombineConfig(**kw)
    assert (cfg.launch_blocks, cfg.launch_threads) == (32, 96)
    with pytest.raises(Exception, match="launch_threads"):
        EpDispatchCombineConfig(**point_config(0, 2, 64, 256, 4, 8, torch.bfloat16,
                                               geometry={"launch_threads": 100}))


def test_profile_table_lists_the_largest_kernels_first():
    rec = {"dtype": "bfloat16", "tokens_per_rank": 128, "internode_kernel": "v2",
           "profile": [{"name": "pack", "calls": 1, "us_per_round": 50.0},
                       {"name": "ncclDevKernel_SendRecv", "calls": 2, "us_per_round": 20.25}]}
    lines = tables.format_profile(rec)
    assert lines[0].startswith("-- profile bfloat16 T=128 v2")
    assert "50.0" in lines[1] and "pack" in lines[1] and "x2" in lines[2] and "20.2" in lines[2]
    assert len(tables.format_profile(rec, top=1)) == 2


def test_gate_rejects_lossy_modes():
    base = dict(rank=0, world_size=1, hidden_dim=256, max_num_inp_token_per_rank=4, num_experts_per_rank=2,
                num_experts_per_token=2, kernel_backend="torch")
    for extra in (dict(quant_type="fp8_blockwise"), dict(dispatch_quant_type="fp8_blockwise")):
        with pytest.raises(ValueError, match="lossy"):
            check_gate_mode(EpDispatchCombineConfig(**base, **extra))
    with pytest.raises(ValueError, match="float32 block scales"):
        check_gate_mode(EpDispatchCombineConfig(**base, dispatch_data_type=torch.float8_e4m3fn,
                                                       combine_data_type=torch.bfloat16, scale_dim=8,
                                                       scale_type_size=1))


# ---------------------------------------------------------------------------------------------
# The identity gate (torch backend; 2 gloo ranks, and world_size=1 in-process)
# ---------------------------------------------------------------------------------------------
H, T, K, EPR = 256, 16, 4, 3  # EPR at world_size >= 2; one rank holds K experts (_epr)


def _epr(world):
    return experts_per_rank_for(K, world, EPR)


def _gate_inputs(rank: int, world: int, payload: str):
    """(x, w, scales, idx) of `rank`; any process can rebuild any rank's. Tokens 0-2 are pinned: no expert
    (U=0), one rank named by repeated experts (U=1), ranks 0 and 1 (U=2, world > 1); the rest are random
    (repeats, -1)."""
    x, w, idx = make_inputs(11, rank, T, H, K, _epr(world) * world)
    idx[0] = -1
    idx[1] = torch.tensor([0, 1, 0, -1])
    if world > 1:
        idx[2] = torch.tensor([0, EPR, 1, EPR + 1])
    scales = None
    if payload == "fp8":
        x, scales = quantize_blocks(x, H // 128)
    return x, w, scales, idx


def _gate_cfg(rank, world, payload):
    kw = dict(rank=rank, world_size=world, hidden_dim=H, max_num_inp_token_per_rank=T,
              num_experts_per_rank=_epr(world), num_experts_per_token=K, kernel_backend="torch")
    if payload == "fp8":
        kw.update(dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.bfloat16, scale_dim=H // 128,
                  scale_type_size=4)
    return EpDispatchCombineConfig(**kw)


def _flip_low_bit(out, n):  # one bit of one element of the first received row
    bits = out[0:1, 0:1].view(torch.int16 if out.element_size() == 2 else torch.uint8)
    bits.bitwise_xor_(1)


CORRUPT = {
    "none": None,
    "row0": lambda out, n: out[0].fill_(7),
    "low_bit": _flip_low_bit,
    "unused_rows": lambda out, n: out[n:].fill_(7),  # past total_recv: never combined
}


def scn_gate(rank, world, payload, corrupt, corrupt_rank):
    cfg = _gate_cfg(rank, world, payload)
    x, w, scales, idx = _gate_inputs(rank, world, payload)
    with EpDispatchCombineOp(cfg) as op:
        assert op.device.type == "cpu" and x.device.type == "cpu"
        hook = CORRUPT[corrupt] if rank == corrupt_rank else None
        try:
            n = identity_gate(op, x, w, scales, idx, corrupt=hook, point=f"test {payload}/{corrupt}")
        except GateError as e:
            return {"raised": True, "msg": str(e), "rank": e.rank, "point": e.point, "wrong": e.wrong_rows,
                    "recv": e.recv_rows, "expected": e.expected_recv_rows, "bad_cols": e.bad_checksum_columns}
        # the op is still usable, and a clean gate after a failed one passes
        return {"raised": False, "n": n, "R": cfg.max_recv_tokens}


def _all_idx(world, payload="bf16"):
    return [_gate_inputs(r, world, payload)[3] for r in range(world)]


def test_gate_inputs_cover_every_multiplicity():
    # a gate that compared with x, or with k*x, or counted repeated experts twice would fail the clean test
    for idx in _all_idx(2):
        u = multiplicity(idx, EPR)
        assert {0, 1, 2} <= set(u)
        assert any(len(set(int(e) for e in row if e >= 0)) > len({int(e) // EPR for e in row if e >= 0})
                   for row in idx.tolist())  # some token names one rank through several experts


@pytest.mark.parametrize("payload", ["bf16", "fp8"])
def test_gate_passes_on_clean_data(payload):
    res = get_world(2).run(scn_gate, payload, "none", -1)
    all_idx = _all_idx(2, payload)
    for rank, r in enumerate(res):
        assert not r["raised"], r
        assert r["n"] == len(expected_received(all_idx, rank, EPR))


@pytest.mark.parametrize("payload,corrupt", [("bf16", "row0"), ("bf16", "low_bit"), ("fp8", "row0"),
                                             ("fp8", "low_bit")])
@pytest.mark.parametrize("corrupt_rank", [0, 1])
def test_gate_raises_on_one_corrupted_row(payload, corrupt, corrupt_rank):
    res = get_world(2).run(scn_gate, payload, corrupt, corrupt_rank)
    all_idx = _all_idx(2, payload)
    src, token = expected_received(all_idx, corrupt_rank, EPR)[0]  # the torch backend's first received row
    expected_recv = [len(expected_received(all_idx, r, EPR)) for r in range(2)]
    for rank, r in enumerate(res):
        assert r["raised"], f"rank {rank}: the gate passed a corrupted row ({payload}, {corrupt})"
        assert r["rank"] == rank and r["point"] == f"test {payload}/{corrupt}"
        assert f"test {payload}/{corrupt}" in r["msg"]
        assert r["recv"] == r["expected"] == expected_recv
        # the damaged rank's received rows fail their checksum, the other rank's do not
        assert r["bad_cols"][1 - corrupt_rank] == 0 and r["bad_cols"][corrupt_rank] > 0, r
        assert f"rank {corrupt_rank}: its received rows differ from the rows addressed to it" in r["msg"]
        if corrupt == "row0":  # the whole row is wrong: exactly its token comes back wrong, on its source rank
            want_wrong = [0, 0]
            want_wrong[src] = 1
            assert r["wrong"] == want_wrong, r
            assert f"rank {src}: 1 of {T} combined rows != U*x (first: token {token})" in r["msg"]
        else:  # one bit of one element: one checksum column; the combined row may round it away
            assert r["bad_cols"][corrupt_rank] == 1, r
            assert r["wrong"][1 - src] == 0 and r["wrong"][src] <= 1, r
    # the world is healthy afterwards: a clean gate passes
    assert not any(r["raised"] for r in get_world(2).run(scn_gate, payload, "none", -1))


@pytest.mark.parametrize("payload", ["bf16", "fp8"])
def test_gate_ignores_rows_past_total_recv(payload):
    res = get_world(2).run(scn_gate, payload, "unused_rows", 0)
    assert not any(r["raised"] for r in res), res
    assert res[0]["n"] < res[0]["R"]  # there were unused rows to damage


class _Wrapped:
    """An op whose dispatch or combine lies (a broken kernel), for the world_size=1 gate."""

    def __init__(self, op, total_delta=0, scale_combine=1.0):
        self._op, self._backend, self.config, self.device = op, op._backend, op.config, op.device
        self.total_delta, self.scale_combine = total_delta, scale_combine

    def dispatch(self, *a, **kw):
        res = list(self._op.dispatch(*a, **kw))
        res[4] = res[4] + self.total_delta
        return tuple(res)

    def combine_in_view(self):
        return self._op.combine_in_view()

    def combine(self, *a, **kw):
        comb, w = self._op.combine(*a, **kw)
        return (comb.float() * self.scale_combine).to(comb.dtype), w


def test_gate_single_rank_checks_total_recv_and_values():
    cfg = _gate_cfg(0, 1, "bf16")
    x, w, _, idx = _gate_inputs(0, 1, "bf16")
    with EpDispatchCombineOp(cfg) as op:
        n = identity_gate(op, x, w, None, idx)
        assert n == sum(1 for u in multiplicity(idx, cfg.num_experts_per_rank) if u)  # one row per token with an expert
        with pytest.raises(GateError, match=rf"rank 0: total_recv {n + 1} != {n} rows addressed to it") as e:
            identity_gate(_Wrapped(op, total_delta=1), x, w, None, idx, point="p")
        assert e.value.wrong_rows == [0] and e.value.point == "p"
        with pytest.raises(GateError, match="combined rows != U\\*x") as e:
            identity_gate(_Wrapped(op, scale_combine=2.0), x, w, None, idx)
        # every token with U >= 1 and a non-zero row is wrong when combine doubles
        nonzero = sum(1 for t, u in enumerate(multiplicity(idx, cfg.num_experts_per_rank)) if u and bool(x[t].any()))
        assert e.value.wrong_rows == [nonzero] and nonzero > 0


# ---------------------------------------------------------------------------------------------
# A whole benchmark point on CPU (torch backend, gloo, eager only)
# ---------------------------------------------------------------------------------------------
def scn_point(rank, world, dtype_name, combine_mode="gather"):
    return sweep.run_point(8, 256, 4, 8, getattr(torch, dtype_name), 2, 2, backend="torch", eager_iters=3,
                           input_sets=3, combine_mode=combine_mode)


def scn_planned(rank, world, threads):
    args = cli.build_parser().parse_args(["--tokens", "8", "--hidden", "256", "--topk", "4", "--experts", "8",
                                            "--dtypes", "bfloat16", "--launch-threads", str(threads), "--inner", "2",
                                            "--reps", "2", "--eager-iters", "2", "--input-sets", "2"])
    points, _ = cli.plan_points(args, [torch.bfloat16], [None])
    return [cli.run_planned(pt, args) for pt in points]  # the workers run the torch backend


def test_a_failing_point_is_recorded_on_every_rank_and_the_run_goes_on():
    """A geometry the config refuses (100 threads: not whole waves) fails that point alike on every rank:
    a record with the reason, a 'failed' table line; a good point still gives its record."""
    bad = get_world(2).run(scn_planned, 100, timeout=120)
    for recs in bad:
        assert len(recs) == 1 and recs[0]["kind"] == "point_failed" and "launch_threads" in recs[0]["error"]
        assert recs[0]["launch_override"] == {"launch_threads": 100}
        json.dumps(recs[0], allow_nan=False)
    line = tables.format_table(bad[0])[1]
    assert "failed" in line and "launch_threads" in line
    good = get_world(2).run(scn_planned, 0, timeout=120)
    assert all(not recs[0].get("error") and recs[0]["eager_combine_us"] > 0 for recs in good)


def test_scatter_point_is_gated_and_labelled():
    recs = get_world(2).run(scn_point, "bfloat16", "scatter", timeout=120)
    assert all(r["combine_mode"] == "scatter" and r["eager_combine_us"] > 0 for r in recs)
    assert tables.format_table(recs[:1])[1].split()[0] == "bfloat16/scatter"  # the torch backend: no protocol
    points = tables.sweep_points(recs + [dict(recs[0], combine_mode="gather", dispatch_us=1.0)])[1]
    assert points[0]["combine_mode"] == "gather"  # the sweep table keeps the gather combine's points


REQUIRED = ("commit", "backend", "target", "gpu", "driver", "world_size", "dtype", "quant", "tokens_per_rank",
            "hidden", "topk", "experts", "graph", "graph_modes", "dispatch_blocks", "combine_blocks", "dispatch_us",
            "combine_us", "dispatch_link_GBps", "combine_link_GBps", "dispatch_logical_GBps", "combine_logical_GBps",
            "nccl_a2a_us", "dispatch_vs_nccl", "combine_vs_nccl", "dispatch_replay_us", "combine_staged_us",
            "torch_backend_dispatch_us", "torch_backend_combine_us", "torch_backend_note", "eager_dispatch_us",
            "eager_dispatch_p99_us", "eager_combine_us", "eager_combine_p99_us", "eager_dispatch_link_GBps",
            "eager_combine_link_GBps", "eager_dispatch_logical_GBps", "eager_combine_logical_GBps", "rows_matrix",
            "recv_rows", "remote_rows", "input_sets")


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_run_point_record_on_cpu(dtype, tmp_path):
    recs = get_world(2).run(scn_point, dtype, timeout=120)
    m = recs[0]["rows_matrix"]
    assert all(r["rows_matrix"] == m for r in recs)
    for rank, r in enumerate(recs):
        missing = [key for key in REQUIRED if key not in r]
        assert not missing, missing
        json.dumps(r, allow_nan=False)
        assert (r["backend"], r["dtype"], r["graph"], r["graph_modes"], r["input_sets"]) == \
            ("torch", dtype, False, ["eager"], 3)
        assert r["profile"] is None and r["expert_id_check"] in ("async", "sync", "off")
        assert r["quant"] == ("none" if dtype == "bfloat16" else "payload_block128_fp32_scales")
        assert r["dispatch_us"] is None and r["nccl_a2a_us"] is None  # no graphs on CPU
        assert r["recv_rows"] == sum(m[s][rank] for s in range(2)) and r["sent_rows"] == sum(m[rank])
        assert r["remote_rows"] == sum(m[rank]) - m[rank][rank]
        assert r["dispatch_row_bytes"] == (512 if dtype == "bfloat16" else 256 + 2 * 4)
        assert r["combine_row_bytes"] == 512
        for leg, rows in (("dispatch", r["recv_rows"]), ("combine", r["sent_rows"])):
            assert r[f"eager_{leg}_us"] > 0
            want = rows * r[f"{leg}_row_bytes"] / (r[f"eager_{leg}_us"] * 1e-6) / 1e9
            assert r[f"eager_{leg}_logical_GBps"] == pytest.approx(want, rel=1e-5)
            link = r["remote_rows"] * r[f"{leg}_row_bytes"] / (r[f"eager_{leg}_us"] * 1e-6) / 1e9
            assert r[f"eager_{leg}_link_GBps"] == pytest.approx(link, rel=1e-5)
    lines = tables.format_table(recs[:1])
    assert len(lines) == 2 and dtype in lines[1]

    # scripts/plot_bench.py reads the record (graph fields filled in, as a GPU run has them)
    import matplotlib  # noqa: F401 - the [test] extra installs it: these tests run, never skip
    rec = dict(recs[0])
    for key in ("dispatch_us", "combine_us", "dispatch_link_GBps", "combine_link_GBps"):
        rec[key] = rec[f"eager_{key}"]
    rec["nccl_a2a_us"] = rec["nccl_a2a_eager_us"]
    src = tmp_path / "bench.jsonl"
    src.write_text(json.dumps(rec) + "\n" + json.dumps(dict(rec, tokens_per_rank=16)) + "\n")
    spec = importlib.util.spec_from_file_location("plot_bench", ROOT / "scripts" / "plot_bench.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    assert plot.main(str(src), str(tmp_path / "bench.png")) == 0
    assert (tmp_path / "bench.png").stat().st_size > 0


def scn_internode_point(rank, world, kind):
    import os

    os.environ["EPGEN_EMULATE_NODES"] = "1"  # 2 emulated nodes of 1 rank each
    try:
        return sweep.run_point(8, 256, 4, 8, torch.bfloat16, 2, 2, backend="torch", eager_iters=2, input_sets=2,
                               topology={"gpu_per_node": 1, "internode_kernel": kind})
    finally:
        del os.environ["EPGEN_EMULATE_NODES"]


@pytest.mark.parametrize("kind", ["v2", "v2_ll"])
def test_internode_point_is_gated_and_labelled(kind):
    recs = get_world(2).run(scn_internode_point, kind, timeout=120)
    for r in recs:
        assert (r["topology"], r["gpu_per_node"], r["internode_kernel"], r["internode_route"]) == \
            ("internode", 1, kind, kind)
        assert r["gate"].endswith("(passed)") and r["eager_dispatch_us"] > 0
    assert f"bfloat16/{kind}" in tables.format_table(recs[:1])[1]
    assert cli.build_parser().parse_args(["--internode", "v2", "auto", "--emulate-nodes"]).internode == ["v2", "auto"]


@pytest.mark.parametrize("routing,local", [("uniform", True), ("remote", False)])
def test_input_set_routings(routing, local):
    """--routing remote: every token's k distinct experts live on other ranks, so no row stays local
    (the link alone); uniform: top-k of all experts. Every set permutes one routing."""
    cfg = EpDispatchCombineConfig(rank=1, world_size=4, hidden_dim=64, max_num_inp_token_per_rank=200,
                                  num_experts_per_rank=8, num_experts_per_token=6, kernel_backend="torch")
    sets = make_input_sets(cfg, 3, seed=5, device="cpu", routing=routing)
    for s in sets:
        idx = s["idx"]
        assert all(len(set(row)) == 6 for row in idx.tolist())  # k distinct experts
        on_me = ((idx // 8) == 1).any(1)
        assert bool(on_me.any()) == local
        assert rows_per_destination(idx, 4, 8) == rows_per_destination(sets[0]["idx"], 4, 8)
    with pytest.raises(ValueError, match="routing must be one of uniform, remote"):
        make_input_sets(cfg, 1, seed=5, device="cpu", routing="skewed")
    tight = EpDispatchCombineConfig(rank=0, world_size=2, hidden_dim=64, max_num_inp_token_per_rank=8,
                                    num_experts_per_rank=4, num_experts_per_token=5, kernel_backend="torch")
    with pytest.raises(ValueError, match="needs k <= the other ranks' experts \\(4\\), got k=5"):
        make_input_sets(tight, 1, seed=5, device="cpu", routing="remote")


def test_sweep_table_picks_one_commits_default_points():
    """scripts/sweep_table.py: the commit with the most distinct default intranode points; experiments (a note),
    internode, remote-routing and launch-override points left out; a point measured twice shows its later record."""
    spec = importlib.util.spec_from_file_location("sweep_table", ROOT / "scripts" / "sweep_table.py")
    st = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(st)

    def rec(commit, T, us, **kw):
        return dict(commit=commit, dtype="bfloat16", hidden=7168, tokens_per_rank=T, dispatch_us=us, combine_us=us,
                    **kw)

    records = [rec("a", 1, 9.0), rec("a", 128, 10.0), rec("b", 1, 5.0), rec("b", 128, 6.0), rec("b", 128, 7.0),
               rec("b", 4096, 1.0, note="experiment"), rec("b", 8, 1.0, topology="internode"),
               rec("b", 32, 1.0, routing="remote"), dict(rec("b", 8, 2.0), hidden=4096),
               rec("b", 1, 3.0, launch_override={"launch_blocks": 132, "launch_threads": 64}),
               rec("b", 8, 4.0, launch_override=None)] + [rec("c", 1, 1.0)] * 6  # c: many records, one point
    commit, rows = st.sweep_rows(records)
    assert commit == "b"
    assert [(r["hidden"], r["tokens_per_rank"], r["dispatch_us"]) for r in rows] == [(7168, 1, 5.0), (7168, 8, 4.0),
                                                                                    (7168, 128, 7.0), (4096, 8, 2.0)]
    lines = st.table(rows)
    assert len(lines) == 2 + 4 and lines[2].startswith("| bfloat16 | 7168 | 1 | 5.0 | 5.0 | – |")
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|")
    assert st.sweep_rows(records, "a")[1][1]["dispatch_us"] == 10.0
    with pytest.raises(ValueError, match="no intranode benchmark points for commit d"):
        st.sweep_rows(records, "d")


def scn_main(rank, world, argv):
    """bench.main on CPU gloo ranks: the process group exists already (the worker's) and there is no GPU to
    select, so those two calls are stubbed; the workers run the torch backend."""
    import io
    from contextlib import redirect_stdout
    from unittest import mock

    with mock.patch.object(torch.cuda, "set_device", lambda *a: None), \
            mock.patch.object(cli, "require_gpus", lambda prog: None), \
            mock.patch.object(torch.cuda, "current_device", lambda: 0), \
            mock.patch.object(cli.dist, "init_process_group", lambda *a, **kw: None), \
            mock.patch.object(cli.dist, "destroy_process_group", lambda *a, **kw: None):
        out = io.StringIO()
        with redirect_stdout(out):
            rc = cli.main(argv)
    return rc, out.getvalue()


def test_main_runs_the_planned_points_writes_each_record_and_reports_failures(tmp_path):
    """The sweep entry end to end (torch backend): every planned point, one record each, written as made;
    an impossible geometry fails its points with the reason and the run exits 1 after the others ran."""
    out = tmp_path / "b.jsonl"
    argv = ["--tokens", "8", "--hidden", "256", "--topk", "4", "--experts", "8", "--dtypes", "bfloat16",
            "--inner", "2", "--reps", "2", "--eager-iters", "2", "--input-sets", "2", "--combine-mode", "gather",
            "scatter", "--launch-threads", "0", "100", "--out", str(out)]
    (rc, printed), (rc1, _) = get_world(2).run(scn_main, argv, timeout=180)
    assert rc == rc1 == 1
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r.get("launch_override"), r["combine_mode"], bool(r.get("error"))) for r in recs] == [
        (None, "gather", False), (None, "scatter", False),
        ({"launch_threads": 100}, "gather", True), ({"launch_threads": 100}, "scatter", True)]
    assert "2 of 4 points failed" in printed and printed.count("failed") >= 3
    (rc, _), _ = get_world(2).run(scn_main, argv[:-6] + ["--out", str(tmp_path / "ok.jsonl")], timeout=180)
    assert rc == 0 and len((tmp_path / "ok.jsonl").read_text().splitlines()) == 1


def test_main_layer_modes_write_records_and_print_the_tables(tmp_path):
    out = tmp_path / "layer.jsonl"
    argv = ["--layer-loop", "--layer", "--tokens", "4", "--hidden", "256", "--topk", "4", "--experts", "8",
            "--intermediate", "64", "--layer-dtypes", "bf16", "--layer-iters", "2", "--graph-layers", "2", "--reps", "2",
            "--layers", "2", "--protocol", "ll", "bw", "--out", str(out)]
    (rc, printed), _ = get_world(2).run(scn_main, argv, timeout=180)
    assert rc == 0
    kinds = [(r["kind"], r.get("path"), r["intranode_protocol"]) for r in map(json.loads, out.read_text().splitlines())]
    assert kinds == [("layer_loop", None, "ll"), ("layer_loop", None, "bw"), ("layer", "epgen", "ll"),
                     ("layer", "epgen", "bw"), ("layer", "a2a", None)]
    assert "| 4 | ll |" in printed and "| 4 | bw |" in printed and "low-latency protocol" in printed
