"""bench --floor (bench/floor.py) and bench --profile-graph (bench/profile_graph.py) on CPU: the plans, the
per-kernel statistics of profiled replays (bench/graphprof.py), the records' shape, the tables, and both
entries end to end on 2 gloo ranks with the GPU-only calls stubbed; the floor kernels compile for sm_90a."""

from __future__ import annotations

import ctypes
import json
import shutil
import types

import pytest
import torch

from tests.support.ep_dist import get_world
from bench import cli, floor, graphprof, profile_graph as pg
from generator.abi import LL_MAX_TOKENS

META = {"commit": "abc", "date": "2026-12-01", "gpu": "cpu", "driver": "", "cuda_driver_api": None,
        "target": "cpu", "sms": 4, "torch": "x", "world_size": 2}


def _args(argv):
    return cli.build_parser().parse_args(argv)


# --- graphprof -------------------------------------------------------------------------------------
def test_summarize_pools_roles_and_measures_gaps():
    # two replays of [dispatch, copy, combine]; gaps 1.0 and 0.5 in the first, 2.0 and 0.5 in the second
    r1 = [("epg_dispatch_x", 0.0, 7.0), ("Memcpy DtoD", 8.0, 1.0), ("epg_combine_x", 9.5, 6.0)]
    r2 = [("epg_combine_x", 20.5, 4.0), ("epg_dispatch_x", 10.0, 5.0), ("Memcpy DtoD", 17.0, 3.0)]  # any order
    role = lambda n: "dispatch" if "dispatch" in n else "combine" if "combine" in n else "copy"  # noqa: E731
    s = graphprof.summarize([r1, r2], role)
    assert s["roles"]["dispatch"] == {"calls": 1, "median_us": 6.0, "min_us": 5.0, "max_us": 7.0,
                                      "names": ["epg_dispatch_x"]}
    assert s["roles"]["combine"]["median_us"] == 5.0 and s["roles"]["copy"]["max_us"] == 3.0
    assert s["gap_us"] == pytest.approx(0.75)  # median of 1.0, 0.5, 2.0, 0.5
    assert s["busy_us"] == pytest.approx(13.0) and s["span_us"] == pytest.approx(15.0)  # medians of 14/12, 15.5/14.5
    empty = graphprof.summarize([])
    assert empty == {"roles": {}, "gap_us": None, "busy_us": None, "span_us": None}


def test_split_replays_cuts_whole_replays_in_start_order():
    evs = [(f"k{i}", float(10 - i), 0.1) for i in range(7)]
    parts = graphprof.split_replays(evs, 3)
    assert [[e[0] for e in p] for p in parts] == [["k6", "k5", "k4"], ["k3", "k2", "k1"]]  # k0 incomplete: dropped
    with pytest.raises(ValueError, match="per_replay"):
        graphprof.split_replays(evs, 0)


class _NewEvent:  # torch >= 2.13's _KinetoEvent: activity_type(), start_ns()
    def __init__(self, name, dev, kind, start_us, dur_us):
        self._n, self._d, self._k, self._s, self._u = name, dev, kind, start_us, dur_us

    def name(self):
        return self._n

    def device_type(self):
        return f"DeviceType.{self._d}"

    def activity_type(self):
        return self._k

    def start_ns(self):
        return int(self._s * 1000)

    def duration_ns(self):
        return int(self._u * 1000)


class _OldEvent:  # older releases: no activity_type(), times in us, user annotations flagged
    def __init__(self, name, dev, start_us, dur_us, annotation=False):
        self._n, self._d, self._s, self._u, self._a = name, dev, start_us, dur_us, annotation

    def name(self):
        return self._n

    def device_type(self):
        return f"DeviceType.{self._d}"

    def start_us(self):
        return self._s

    def duration_us(self):
        return self._u

    def is_user_annotation(self):
        return self._a


def test_device_events_across_torch_event_apis():
    new = [_NewEvent("epg_b", "CUDA", "kernel", 5.0, 1.0), _NewEvent("cudaLaunchKernel", "CPU", "cuda_runtime", 0.0, 2.0),
           _NewEvent("Memcpy DtoD", "CUDA", "gpu_memcpy", 7.0, 0.5), _NewEvent("ncclDevKernel_AllReduce", "CUDA", "kernel",
                                                                             1.0, 9.0),
           _NewEvent("annot", "CUDA", "gpu_user_annotation", 4.0, 3.0), _NewEvent("epg_a", "CUDA", "kernel", 2.0, 1.5)]
    assert graphprof.device_events(new) == [("epg_a", 2.0, 1.5), ("epg_b", 5.0, 1.0), ("Memcpy DtoD", 7.0, 0.5)]
    old = [_OldEvent("epg_b", "CUDA", 5.0, 1.0), _OldEvent("aten::copy_", "CPU", 0.0, 2.0),
           _OldEvent("annot", "CUDA", 4.0, 3.0, annotation=True), _OldEvent("ncclKernel", "CUDA", 1.0, 1.0),
           _OldEvent("epg_a", "CUDA", 2.0, 1.5)]
    assert graphprof.device_events(old) == [("epg_a", 2.0, 1.5), ("epg_b", 5.0, 1.0)]


# --- floor: plan, records, table -------------------------------------------------------------------------
def test_floor_plan_and_partners():
    args = _args(["--floor", "--floor-rounds", "50", "--layers", "4", "--floor-blocks", "1", "0"])
    assert floor.plan(args) == [
        {"method": "pingpong", "rounds": 50},
        {"method": "signal_graph", "blocks": 1, "layers": 4}, {"method": "empty_graph", "blocks": 1, "layers": 4},
        {"method": "signal_graph", "blocks": 0, "layers": 4}, {"method": "empty_graph", "blocks": 0, "layers": 4},
        {"method": "primitives", "blocks": 1}]
    assert [floor.partner(r, 4) for r in range(4)] == [1, 0, 3, 2]
    assert floor.partner(2, 3) is None
    assert floor.partner(0, 1) == 0  # W = 1: its own partner (the launch and a local flag, no link)


def test_floor_record_shape_and_table():
    ping = floor.record(META, {"method": "pingpong", "rounds": 10}, round_trip_us=2.0, one_way_us=1.0)
    sig = floor.record(META, {"method": "signal_graph", "blocks": 0, "layers": 16}, per_kernel_us=3.5,
                       per_kernel_p99_us=3.9, kernel_us=3.1, gap_us=0.3, blocks_launched=132)
    bad = floor.record(META, {"method": "empty_graph", "blocks": 1, "layers": 16}, error="rank 1: boom")
    for r in (ping, sig, bad):
        assert r["kind"] == "floor" and r["commit"] == "abc" and r["world_size"] == 2
        assert {"rounds", "blocks", "layers", "round_trip_us", "per_kernel_us", "kernel_us", "gap_us", "error"} <= set(r)
        json.dumps(r, allow_nan=False)
    assert ping["error"] is None and ping["kernel_us"] is None and sig["round_trip_us"] is None
    lines = floor.floor_table([sig, bad, ping])
    assert lines[2] == "| pingpong | – | 2.00 | 1.00 | – | – | – |"  # the ping-pong first, whatever the order
    assert lines[3] == "| signal_graph | 132 | – | – | 3.50 | 3.10 | 0.30 |"
    assert lines[4].startswith("| empty_graph | 1 | failed: rank 1: boom")
    assert len(lines) == 5  # no primitives record, no second table


def test_floor_primitives_fields_and_table():
    # out words: 3960 cycles in 2000 ns, then ns of 1000 barriers, 1000 loads, 1000 atomics, 1000 fences x 2, 1000 reads
    got = floor.primitive_costs([3960, 2000, 40000, 600000, 900000, 1500000, 1300000, 30000, 7, 800, 50, 650000,
                                 700000, 2000000, 90000, 20000, 45000, 400000, 1400000], 1000, 1000)
    assert got == {"sm_clock_ghz": 1.98, "barrier_ns": 40.0, "l2_load_ns": 600.0, "atomic_ns": 900.0,
                   "fence_sys_ns": 1500.0, "fence_release_sys_ns": 1300.0, "timer_read_ns": 30.0,
                   "first_load_ns": 800.0, "first_barrier_ns": 50.0, "l2_load_sys_ns": 650.0,
                   "l2_load_volatile_ns": 700.0, "hbm_load_ns": 2000.0, "store16_volatile_ns": 90.0,
                   "store16_ns": 20.0, "pause_ns": 45.0, "flag_round_tight_ns": 400.0, "flag_round_pause_ns": 1400.0}
    assert floor.primitive_costs([0] * 19, 1, 1)["sm_clock_ghz"] is None
    late = floor.primitive_costs([1] * 17 + [0, 0], 1, 1)  # a flag bounce past its deadline: no figure, not 0 ns
    assert late["flag_round_tight_ns"] is None and late["flag_round_pause_ns"] is None
    order = torch.tensor([3, 0, 2, 1])
    assert floor.cycle(order).tolist() == [2, 3, 1, 0]  # 3 -> 0 -> 2 -> 1 -> 3: one cycle through every word
    got.update(code_steps=1024.0, code_cold_ns=9000.0, code_l2_ns=3000.0, code_warm_ns=700.0, code_jumps=64.0,
               code_jumps_first_ns=12000.0, code_jumps_second_ns=800.0, args_reads=48.0, args_dense_first_ns=2500.0,
               args_dense_second_ns=1500.0, args_sparse_first_ns=9000.0, args_sparse_second_ns=1600.0,
               args_prefetch_ns=700.0, args_dense_prefetched_ns=1550.0, args_sparse_prefetched_ns=1650.0,
               drain_stores=8.0, drain_none_ns=900.0, drain_stored_first_ns=2100.0, drain_stored_second_ns=950.0,
               drain_fence_ns=1200.0, drain_fenced_ns=910.0)
    prim = floor.record(META, {"method": "primitives", "blocks": 1}, **got, blocks_launched=1)
    assert set(floor.PRIMITIVE_FIELDS) <= set(prim) and prim["error"] is None
    ping = floor.record(META, {"method": "pingpong", "rounds": 10}, round_trip_us=2.0, one_way_us=1.0)
    assert "l2_load_ns" not in ping  # the primitives' fields are that method's own
    lines = floor.floor_table([prim, ping])
    assert lines[2] == "| pingpong | – | 2.00 | 1.00 | – | – | – |" and lines[3] == ""
    assert lines[4].startswith("| SM clock GHz | block barrier ns | L2 load ns |")
    assert lines[6] == ("| 1.98 | 40 | 600 | 900 | 1500 | 1300 | 30 | 800 | 50 | 650 | 700 | 2000 | 90 | 20 | 45 | 400 "
                        "| 1400 | 1024 | 9000 | 3000 | 700 | 64 | 12000 | 800 | 48 | 2500 | 1500 | 9000 | 1600 | 700 | 1550 "
                        "| 1650 | 8 | 900 | 2100 | 950 | 1200 | 910 |")
    assert lines[4].count("|") == lines[6].count("|")  # a header per field
    bad = floor.record(META, {"method": "primitives", "blocks": 1}, error="no build")
    assert floor.floor_table([bad])[-1].startswith("| failed: no build |")


class _FakeLaunch:
    """A kernel's launch on the host: writes `words(args)` (int64s) where the launch's first argument points."""
    def __init__(self, words):
        self.words, self.calls = words, []

    def launch(self, blocks, threads, out, *args):
        self.calls.append(args)
        vals = self.words(args)
        ctypes.memmove(out.value, (ctypes.c_int64 * len(vals))(*vals), 8 * len(vals))


def test_args_and_drain_costs_fill_each_of_their_fields_from_their_own_words():
    """args_costs / drain_costs through launches faked on the host: each field is the median of its own out word
    over the timed rounds (the untimed first round left out), and the fields are exactly the record's."""
    args = _FakeLaunch(lambda a: [100 + a[0].value, 200, 300, 400, 500 + 10 * a[1].value, 0])  # (round, warm, block)
    drain = _FakeLaunch(lambda a: [1000 * (a[2].value + 1) + a[3].value, 70, 80, 0])  # (scratch, stores, mode, round)
    kern = types.SimpleNamespace(args=args, drain=drain)
    got = floor.args_costs(kern, "cpu", 3)
    assert got == {"args_reads": float(floor.ARGS_READS), "args_dense_first_ns": 102.0, "args_dense_second_ns": 300.0,
                   "args_sparse_first_ns": 200.0, "args_sparse_second_ns": 400.0, "args_prefetch_ns": 510.0,
                   "args_dense_prefetched_ns": 102.0, "args_sparse_prefetched_ns": 200.0}
    assert len(args.calls) == 8  # an untimed round and three timed ones, each without and with the prefetch
    got = floor.drain_costs(kern, "cpu", 3)
    assert got == {"drain_stores": float(floor.DRAIN_STORES), "drain_none_ns": 1002.0, "drain_stored_first_ns": 2002.0,
                   "drain_stored_second_ns": 70.0, "drain_fence_ns": 80.0, "drain_fenced_ns": 3002.0}
    fields = {"code_steps", "code_cold_ns", "code_l2_ns", "code_warm_ns", "code_jumps", "code_jumps_first_ns",
              "code_jumps_second_ns", *floor.ARGS_FIELDS, "args_reads", *floor.DRAIN_FIELDS, "drain_stores"}
    assert set(floor.PRIMITIVE_FIELDS) - set(floor.primitive_costs([1] * 19, 1, 1)) == fields


@pytest.mark.parametrize("argv,msg", [(["--floor-rounds", "0"], "--floor-rounds"), (["--layers", "0"], "--layers"),
                                      (["--floor-blocks", "-1"], "--floor-blocks"),
                                      (["--floor-timeout-s", "0"], "--floor-timeout-s")])
def test_floor_arguments_are_validated(argv, msg):
    with pytest.raises(SystemExit, match=msg):
        cli.main(["--floor", *argv])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_floor_kernels_compile_for_sm90a():
    from bench.kernels import compile_source

    assert floor.CODE_STEPS % floor.JUMP_BLOCKS == 0 and floor.FLOOR_KERNELS.count("if ((sel >> ") == floor.JUMP_BLOCKS
    cubin = compile_source("sm_90", floor.FLOOR_KERNELS, "floor")
    assert cubin[:4] == b"\x7fELF" and all(s.encode() in cubin for s in floor.SYMBOLS)
    # the argument block fits the launch's 4 KB of arguments (out, seed, warm before it), and its sparse region lies
    # past the dense one, every read inside the block
    assert 8 + 4 + 4 + 8 * floor.ARGS_WORDS <= 4096 and floor.ARGS_READS <= 64
    assert 64 + 8 * (floor.ARGS_READS - 1) + 1 < floor.ARGS_WORDS
    assert floor.FLOOR_KERNELS.count("__shared__ unsigned sh[2][%d]" % floor.DRAIN_THREADS) == 1


# --- profile-graph: plan, roles, records, table ------------------------------------------------------------
def test_profile_plan_skips_ll_above_its_limit():
    args = _args(["--profile-graph", "--tokens", "1", str(LL_MAX_TOKENS + 1), "--protocol", "ll", "bw"])
    points, skipped = pg.plan(args)
    assert points == [(1, "ll"), (1, "bw"), (LL_MAX_TOKENS + 1, "bw")]
    assert skipped == [f"T={LL_MAX_TOKENS + 1} with protocol ll (at most {LL_MAX_TOKENS} tokens per rank)"]
    assert pg.plan(_args(["--profile-graph"]))[0] == [(T, "bw") for T in pg.PROFILE_TOKENS]


def test_role_of_names_the_op_kernels_and_the_copy():
    syms = {"epg_dispatch_ll__bf16__intranode": "dispatch", "epg_combine_ll__bf16__intranode": "combine"}
    assert pg.role_of("epg_dispatch_ll__bf16__intranode", syms) == "dispatch"
    assert pg.role_of("void epg_combine_ll__bf16__intranode(EpArgs)", syms) == "combine"
    assert pg.role_of("Memcpy DtoD (Device -> Device)", syms) == "copy"
    assert pg.role_of("void at::native::direct_copy_kernel_cuda(...)", syms) == "copy"
    assert pg.role_of("ncclDevKernel_AllReduce", syms) == "other"


def _summary(d, c, gap):
    return {"roles": {"dispatch": {"calls": 16, "median_us": d, "min_us": d, "max_us": d, "names": ["epg_dispatch"]},
                      "combine": {"calls": 16, "median_us": c, "min_us": c, "max_us": c, "names": ["epg_combine"]},
                      "copy": {"calls": 16, "median_us": 1.0, "min_us": 1.0, "max_us": 1.0, "names": ["Memcpy"]}},
            "gap_us": gap, "busy_us": 200.0, "span_us": 210.0}


def test_profile_record_takes_the_slowest_rank_and_the_table_prints_it():
    per_rank = [_summary(7.0, 6.0, 0.3), _summary(7.5, 5.5, 0.2)]
    r = pg.profile_record(META, 1, 1, "ll", "ll", 16, 10, (14.8, 15.2), per_rank)
    assert (r["kind"], r["tokens_per_rank"], r["protocol"], r["layers"]) == ("kernel_profile", 1, "ll", 16)
    assert (r["dispatch_us"], r["combine_us"], r["copy_us"], r["gap_us"]) == (7.5, 6.0, 1.0, 0.3)
    assert r["roles"] == per_rank[1]["roles"] and r["per_rank"] == per_rank and r["error"] is None
    json.dumps(r, allow_nan=False)
    missing = pg.profile_record(META, 0, 8, "bw", "bw", 16, 10, None, [_summary(1, 1, None), _summary(1, 1, 0.2)])
    assert missing["gap_us"] is None and missing["per_layer_us"] is None
    failed = {"kind": "kernel_profile", "tokens_per_rank": 128, "intranode_protocol": "bw", "error": "rank 0: x"}
    lines = pg.profile_table([r, failed])
    assert lines[2].startswith("| bw | 128 | failed: rank 0: x")
    assert lines[3] == "| ll | 1 | 7.50 | 6.00 | 1.00 | 0.30 | 14.8 |"


# --- both entries end to end on gloo ranks (GPU-only calls stubbed) ------------------------------------------
class _StubKernels:
    def __init__(self, dev):
        pass

    def close(self):
        pass


class _StubFlags:
    def __init__(self, dev):
        self.closed = False

    def close(self):
        self.closed = True


def _stubbed_main(argv, patches):
    """cli.main on a gloo rank with no GPU: the process group exists already, device selection and the metadata
    are stubbed, and so is what `patches` names ((object, attribute, value) triples)."""
    import io
    from contextlib import ExitStack, redirect_stdout
    from unittest import mock

    import torch

    from bench import records

    with ExitStack() as stack:
        for obj, name, value in [(torch.cuda, "set_device", lambda *a: None), (torch.cuda, "current_device", lambda: 0),
                                 (cli.dist, "init_process_group", lambda *a, **kw: None),
                                 (cli.dist, "destroy_process_group", lambda *a, **kw: None),
                                 (cli, "require_gpus", lambda prog: None),
                                 (records, "meta", lambda dev, **kw: dict(META)), *patches]:
            stack.enter_context(mock.patch.object(obj, name, value))
        out = io.StringIO()
        with redirect_stdout(out):
            rc = cli.main(argv)
    return rc, out.getvalue()


def scn_floor_main(rank, world, argv, fail_method):
    def graph(kern, flags, method, blocks, layers, reps, timeout_ns):
        if method == fail_method and rank == 1:
            raise RuntimeError("a signal kernel timed out on rank 1")
        return {"per_kernel_us": 3.0 + blocks, "per_kernel_p99_us": 4.0, "kernel_us": 2.5, "gap_us": 0.3,
                "blocks_launched": blocks or 132}

    return _stubbed_main(argv, [(floor, "Kernels", _StubKernels), (floor, "Flags", _StubFlags),
                                (floor, "measure_pingpong", lambda *a: {"round_trip_us": 1.6, "one_way_us": 0.8}),
                                (floor, "measure_graph", graph),
                                (floor, "measure_primitives", lambda *a: {**floor.primitive_costs(
                                    [3960, 2000, 4e4, 6e5, 9e5, 1.5e6, 1.3e6, 3e4, 0, 800, 50, 6.5e5, 7e5, 2e6, 9e4,
                                     2e4, 4.5e4, 4e5, 1.4e6], 1000, 1000),
                                    "blocks_launched": 1})])


def test_floor_main_writes_a_record_per_method_and_reports_failures(tmp_path):
    out = tmp_path / "floor.jsonl"
    argv = ["--floor", "--floor-rounds", "5", "--layers", "4", "--reps", "2", "--floor-blocks", "1", "--out", str(out)]
    (rc, printed), (rc1, _) = get_world(2).run(scn_floor_main, argv, "empty_graph", timeout=120)
    assert rc == rc1 == 1  # one method failed on rank 1: every rank exits 1
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["kind"], r["method"], bool(r["error"])) for r in recs] == [
        ("floor", "pingpong", False), ("floor", "signal_graph", False), ("floor", "empty_graph", True),
        ("floor", "primitives", False)]
    assert recs[3]["l2_load_ns"] == 600.0 and recs[3]["sm_clock_ghz"] == 1.98
    assert recs[0]["round_trip_us"] == 1.6 and recs[1]["per_kernel_us"] == 4.0 and recs[1]["layers"] == 4
    assert recs[2]["error"].startswith("rank 1: RuntimeError: a signal kernel timed out")
    assert "| pingpong | – | 1.60 | 0.80 |" in printed and "| empty_graph | 1 | failed" in printed
    (rc, _), _ = get_world(2).run(scn_floor_main, argv[:-1] + [str(tmp_path / "ok.jsonl")], None, timeout=120)
    assert rc == 0 and len((tmp_path / "ok.jsonl").read_text().splitlines()) == 4


def scn_profile_main(rank, world, argv):
    def point(T, protocol, args, meta):
        if T == 8 and protocol == "ll":
            raise RuntimeError("gate failed")
        return pg.profile_record(meta, rank, T, protocol, protocol, args.layers, 3, (10.0 + T, 11.0),
                                 [_summary(7.0, 6.0, 0.3), _summary(7.5, 5.5, 0.2)])

    return _stubbed_main(argv, [(pg, "profile_point", point)])


def test_profile_graph_main_records_every_point_and_the_failures(tmp_path):
    out = tmp_path / "prof.jsonl"
    argv = ["--profile-graph", "--tokens", "1", "8", "--protocol", "ll", "bw", "--layers", "16", "--out", str(out)]
    (rc, printed), _ = get_world(2).run(scn_profile_main, argv, timeout=120)
    assert rc == 1
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["tokens_per_rank"], r["intranode_protocol"], bool(r["error"])) for r in recs] == [
        (1, "ll", False), (1, "bw", False), (8, "ll", True), (8, "bw", False)]
    assert recs[0]["dispatch_us"] == 7.5 and recs[0]["per_layer_us"] == 11.0 and recs[0]["layers"] == 16
    assert "| ll | 1 | 7.50 | 6.00 | 1.00 | 0.30 | 11.0 |" in printed and "| ll | 8 | failed: rank 0" in printed


@pytest.mark.parametrize("argv", [["--topk", "9", "--experts", "8"], ["--topk", "0"], ["--layer", "--topk", "300"]])
def test_topk_is_bounded_by_the_experts(argv):
    """k of E experts, 1 <= k <= E (the config refuses more): said before the machine is asked for GPUs."""
    with pytest.raises(SystemExit, match=r"--topk must be in \[1, --experts="):
        cli.main(argv)


def scn_profiled(rank, world, short_tries):
    """pg._profiled over a faked kineto capture: rank 1's first `short_tries` captures miss one dispatch kernel."""
    from unittest import mock
    tries = []

    def capture(g, replays, sync):
        sync()
        tries.append(len(tries))
        n = 2 * replays - (rank == 1 and len(tries) <= short_tries)
        return [("epg_dispatch__bf16__intranode", float(i), 1.0) for i in range(n)] + [("copy", 9.0, 1.0)]

    with mock.patch.object(pg.graphprof, "graph_kernel_events", capture):
        try:
            events = pg._profiled(None, 3, 6, {"epg_dispatch__bf16__intranode": "dispatch"})
        except RuntimeError as e:
            return len(tries), str(e)
    return len(tries), len(events)


@pytest.mark.parametrize("short_tries,want", [(0, (1, 7)), (2, (3, 7)),
                                              (3, (3, "kineto captured [6, 5] dispatch kernels per rank of the 6 "
                                                      "replayed, in 3 tries"))])
def test_a_short_kineto_capture_is_taken_again_on_every_rank(short_tries, want):
    """A capture that missed a graph kernel on any rank is taken again by every rank (the captures are collective);
    still short after the last try: one message naming each rank's count."""
    assert get_world(2).run(scn_profiled, short_tries, timeout=60) == [want, want]
