"""scripts/train_layer.py on CPU: its core (run) on one gloo rank, epgen on the torch backend, bf16, a tiny shape,
against torchtitan's all-to-all dispatcher where torchtitan imports (CI installs it and requires it): the records'
fields, positive times, the ratios and verdicts made of the times they name, each path's check against the layer in
float32; the leg partition with a clock of known marks; --no-titan's records; the arguments it refuses."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from tests.support import titan_check
from tests.support.ep_dist import get_world

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_layer.py"
TINY = ["--backend", "torch", "--device", "cpu", "--hidden", "32", "--experts", "8", "--topk", "2", "--iters", "3",
        "--warmup", "1", "--warmup-steps", "2"]
_MOD = []


def _script():
    if not _MOD:
        spec = importlib.util.spec_from_file_location("train_layer", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _MOD.append(mod)
    return _MOD[0]


def scn_run(rank, world, argv):
    m = _script()
    return m.run(m.parse_args(argv))


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def _check_timed(rec: dict, m) -> None:
    assert rec["fwd_us"] > 0 and rec["fwd_bwd_us"] > 0, rec
    assert _close(rec["bwd_us"], rec["fwd_bwd_us"] - rec["fwd_us"])
    assert set(rec["check"]) == {"out", "grad_x", "grad_w"}
    assert all(0 <= v <= m.CHECK_TOL for v in rec["check"].values()), rec["check"]  # forward and backward right
    assert rec["check_ok"] is True and rec["check_tol"] == m.CHECK_TOL


def _check_epgen_legs(rec: dict, m) -> None:
    legs = rec["legs_us"]
    assert list(legs) == list(m.LEGS) and all(v > 0 for v in legs.values()), legs
    assert 0.5 < sum(legs.values()) / rec["legs_total_us"] < 2  # medians of a partition: near the median total
    for name, (bwd, fwd) in m.MIRRORS.items():
        assert _close(rec[f"{name}_bwd_over_fwd"], legs[bwd] / legs[fwd])
        assert rec["meets_targets"][f"{name}_bwd_over_fwd"] == (rec[f"{name}_bwd_over_fwd"] <= 1.1)
    assert rec["targets"] == {"vs_titan": 0.2, "bwd_over_fwd": 1.1}
    # the second reading of "the forward leg it mirrors": the forward leg of the same communication
    assert _close(rec["dispatch_bwd_over_combine_fwd"], legs["dispatch_bwd"] / legs["combine_fwd"])
    assert _close(rec["combine_bwd_over_dispatch_fwd"], legs["combine_bwd"] / legs["dispatch_fwd"])
    assert rec["meets_targets_same_communication"] == {
        f: rec[f] <= 1.1 for f in ("dispatch_bwd_over_combine_fwd", "combine_bwd_over_dispatch_fwd")}
    assert rec["backend"] == "torch" and rec["expert_alignment"] == 1
    assert rec["grouped_capacity"] == rec["tokens_per_rank"] * rec["topk"]  # every local pair, no padding (W = 1)
    assert "CUDA events" in rec["leg_method"] and rec["expert"].startswith("identity: rows * 1")


def test_records_of_every_path_and_token_count():
    m = _script()
    recs = get_world(1).run(scn_run, TINY + ["--tokens", "2", "5"], timeout=120)[0]
    assert [(r["tokens_per_rank"], r["path"]) for r in recs] == [(t, p) for t in (2, 5) for p in m.PATHS]
    missing = titan_check.torchtitan_missing()
    if missing and titan_check.env_requires_torchtitan():
        pytest.fail(f"torchtitan is required here ({titan_check.REQUIRE_ENV}) but {missing}")
    for r in recs:
        assert r["kind"] == "train_layer" and r["mode"] == "eager" and r["dtype"] == "bfloat16"
        assert (r["hidden"], r["experts"], r["topk"], r["world_size"], r["iters"], r["warmup"]) == (32, 8, 2, 1, 3, 1)
        for key in ("commit", "gpu", "driver", "torch", "torchtitan", "date", "expert", "titan"):
            assert key in r, key
        assert r["gpu"] == "cpu"
    by = {(r["tokens_per_rank"], r["path"]): r for r in recs}
    for T in (2, 5):
        e, a2a, tep = by[(T, "epgen")], by[(T, "titan_a2a")], by[(T, "titan_epgen")]
        _check_timed(e, m)
        _check_epgen_legs(e, m)
        if missing:  # torchtitan not here and not required: the records say so
            assert a2a["skipped"].startswith("torchtitan is not importable") and tep["skipped"] == a2a["skipped"]
            assert e["vs_titan"] is None and e["meets_targets"]["vs_titan"] is None and e["titan"] == a2a["skipped"]
            continue
        assert e["titan"] == "ran" and e["torchtitan"]
        for r in (a2a, tep):
            _check_timed(r, m)
            assert r["spmd_backend"] == "spmd_types" and "legs_us" not in r
        assert tep["backend"] == "torch"
        assert e["titan_fwd_bwd_us"] == a2a["fwd_bwd_us"] and e["titan_fwd_us"] == a2a["fwd_us"]
        assert _close(e["vs_titan"], e["fwd_bwd_us"] / a2a["fwd_bwd_us"])
        assert _close(e["fwd_vs_titan"], e["fwd_us"] / a2a["fwd_us"])
        assert _close(tep["vs_titan"], tep["fwd_bwd_us"] / a2a["fwd_bwd_us"]) and a2a["vs_titan"] == 1.0
        assert e["meets_targets"]["vs_titan"] == (e["vs_titan"] <= 0.2)
    lines = m.table(recs)
    assert lines[1].startswith("| tokens | epgen fwd | epgen fwd+bwd | titan fwd+bwd | ratio |")
    rows = [ln for ln in lines if ln.startswith("| 2 |") or ln.startswith("| 5 |")]
    assert len(rows) == 4  # the summary and the legs, per token count
    assert f"| 2 | {by[(2, 'epgen')]['fwd_us']:.1f} | {by[(2, 'epgen')]['fwd_bwd_us']:.1f} |" in rows[0]


def test_without_titan_the_records_say_so():
    m = _script()
    recs = get_world(1).run(scn_run, TINY + ["--tokens", "3", "--no-titan"], timeout=120)[0]
    assert [r["path"] for r in recs] == list(m.PATHS)
    e, *titans = recs
    _check_timed(e, m)
    assert all(r["skipped"] == "--no-titan" and "fwd_us" not in r for r in titans)
    assert e["titan"] == "--no-titan" and e["vs_titan"] is None and e["titan_fwd_bwd_us"] is None
    lines = m.table(recs)
    assert lines[3].startswith("| 3 |") and "| – | – |" in lines[3] and lines[-1] == "titan: --no-titan"


def _run_probing(argv, probe):
    """run(argv) with probe() called at the start of every timed epgen step -> (its answers, the records)."""
    m = _script()
    seen = []
    real = m.fwd_bwd_step

    def spy(fwd, inp):
        step = real(fwd, inp)

        def logged():
            seen.append(probe())
            return step()
        return logged
    m.fwd_bwd_step = spy
    try:
        recs = m.run(m.parse_args(argv))
    finally:
        m.fwd_bwd_step = real
    return seen, recs


def scn_engine(rank, world, argv):
    """run(), and whether autograd's multithreading was on inside each epgen step and after the run."""
    seen, recs = _run_probing(argv, torch.autograd.is_multithreading_enabled)
    return seen, recs, torch.autograd.is_multithreading_enabled()


@pytest.mark.parametrize("single", [False, True])
def test_the_engine_setting_holds_for_every_step_and_is_recorded(single):
    """--single-thread-engine: every timed backward with autograd's multithreading off, the setting restored after
    the run, and the records (and the table's head) name the engine and the host's CPU model."""
    m = _script()
    argv = TINY + ["--tokens", "3", "--no-titan"] + (["--single-thread-engine"] if single else [])
    seen, recs, after = get_world(1).run(scn_engine, argv, timeout=120)[0]
    assert seen and set(seen) == {not single} and after is True
    want = "single-thread" if single else "multithreaded"
    assert all(r["engine"] == want for r in recs)
    assert "host_cpu" in recs[0] and (recs[0]["host_cpu"] is None or recs[0]["host_cpu"])
    assert m.table(recs)[0].endswith(f"autograd engine {want}")


def test_profiles_by_own_time_and_the_kernel_table():
    """--host-profile --host-sort own: host_top in descending own time, said in the table; --kernel-profile on a CPU:
    kernel_top is empty (no device events there), and a record's kernel_top is printed as its table."""
    m = _script()
    argv = TINY + ["--tokens", "3", "--no-titan", "--host-profile", "--host-sort", "own", "--kernel-profile"]
    recs = get_world(1).run(scn_run, argv, timeout=120)[0]
    e = recs[0]
    own = [h["own_us"] for h in e["host_top"]]
    assert e["host_sort"] == "own" and len(own) > 5 and own == sorted(own, reverse=True), own
    assert e["kernel_top"] == []
    lines = m.table(recs)
    assert "epgen host profile at 3 tokens (cProfile, µs per step, by own time):" in lines
    e["kernel_top"] = [{"kernel": "epg_grouped_scale__bf16", "calls_per_step": 1.0, "us_per_step": 563.04}]
    lines = m.table(recs)
    at = lines.index("epgen device kernels at 3 tokens (kineto, µs per step, eager fwd+bwd):")
    assert lines[at + 1] == "     563.0 us     1x  epg_grouped_scale__bf16", lines[at + 1]


def test_host_ledger_names_the_step_s_pieces():
    """--host-ledger: a positive host time for every piece the torch backend has (the native backend's own kernels,
    grouped_scale and sum_pairs, are absent there, not zero), the whole step and its backward last, and each piece in
    the table."""
    m = _script()
    recs = get_world(1).run(scn_run, TINY + ["--tokens", "3", "--no-titan", "--host-ledger"], timeout=120)[0]
    led = recs[0]["host_ledger_us"]
    want = ["torch_empty", "torch_mul", "engine_one_node_fwd_bwd", "op_dispatch_grouped", "op_dispatch_grouped_fresh",
            "op_combine_grouped",
            "ag_dispatch_grouped", "ag_combine_grouped", "replay_dispatch", "pair_weights", "combine_back",
            "combine_bwd_work_here", "combine_bwd_work_in_engine", "step_fwd", "step_fwd_bwd", "step_bwd"]
    assert list(led) == want and all(v > 0 for v in led.values()), led
    assert led["step_fwd_bwd"] > led["step_fwd"]
    lines = m.table(recs)
    at = lines.index("epgen host ledger at 3 tokens (µs of host time, each piece alone):")
    assert lines[at + 1].endswith("  torch_empty") and lines[at + len(want)].endswith("  step_bwd")


_TRACE_LINE = re.compile(r"^(T\d+) \+ *(\d+\.\d) +(\d+\.\d)  ((?:  )*)(\S.*)$")  # "thread +start µs  µs  name"


def test_host_trace_outlines_the_last_step_thread_by_thread():
    """--host-trace: kineto's CPU events with Python stacks over 5 steps, the last one's outline: per thread (T0, T1,
    ... in order), the step's own span at +0 on its (main) thread, nesting 2 spaces a level up to 9 levels, events of
    at least 3 µs starting within the step, epgen's Python functions named (dispatch_grouped, combine_grouped and
    their backwards), and the outline in the table under its heading."""
    m = _script()
    recs = get_world(1).run(scn_run, TINY + ["--tokens", "3", "--no-titan", "--host-trace"], timeout=120)[0]
    trace = recs[0]["host_trace"]
    assert isinstance(trace, list) and len(trace) > 10 and all(isinstance(ln, str) for ln in trace), trace
    rows = []
    for ln in trace:
        got = _TRACE_LINE.match(ln)
        assert got, f"not an outline line: {ln!r}"
        tid, start, dur, indent, name = got.groups()
        rows.append((tid, float(start), float(dur), len(indent) // 2, name))
    threads = list(dict.fromkeys(r[0] for r in rows))
    assert threads == [f"T{i}" for i in range(len(threads))], threads  # thread by thread, numbered in order
    assert all(dur >= 3.0 and 0 <= level <= 9 for _, _, dur, level, _ in rows), rows  # min_us, depth
    steps = [r for r in rows if r[4].startswith("epgen_step_")]
    assert len(steps) == 1 and steps[0][4] == "epgen_step_4", steps  # the last of 5 steps, and only it
    main, _, step_us, _, _ = steps[0]
    assert steps[0] == next(r for r in rows if r[0] == main) and steps[0][1:4] == (0.0, step_us, 0), steps[0]
    assert all(0 <= start <= step_us + 0.1 for _, start, _, _, _ in rows)  # every event starts within the step
    for tid in threads:  # a thread's outline opens at level 0 and goes at most one level deeper per line
        levels = [r[3] for r in rows if r[0] == tid]
        assert levels[0] == 0 and all(b <= a + 1 for a, b in zip(levels, levels[1:])), (tid, levels)
    mine = [r for r in rows if r[0] == main]
    assert any(r[3] == 1 and re.fullmatch(r"scripts/train_layer\.py\(\d+\): step", r[4]) for r in mine), mine
    names = [r[4] for r in rows]
    for fn in ("dispatch_grouped", "combine_grouped", "_dispatch_grouped_backward", "_combine_grouped_backward"):
        assert any(re.fullmatch(rf"\S*autograd\.py\(\d+\): {fn}", n) for n in names), (fn, names)
    lines = m.table(recs)
    at = lines.index("epgen host trace at 3 tokens (kineto, one step: thread, +start µs, µs, event):")
    assert lines[at + 1:at + 1 + len(trace)] == ["  " + ln for ln in trace]


_OWN_LINE = re.compile(r"^(T\d+) +(-?\d+\.\d) +(\d+)  (\S.*)$")  # "thread  own µs  calls  name"


def test_host_trace_ranks_events_by_own_time():
    """--host-trace's host_trace_own: at most 25 (thread, event) rows by own time, largest first, non-negative, the
    step's own span counted once at most; the sum of all own times of the step's thread cannot exceed the step's
    duration (children are subtracted from their parents); the table prints them under their heading."""
    m = _script()
    recs = get_world(1).run(scn_run, TINY + ["--tokens", "3", "--no-titan", "--host-trace"], timeout=120)[0]
    rows = [_OWN_LINE.match(ln) for ln in recs[0]["host_trace_own"]]
    assert rows and all(rows) and len(rows) <= 25, recs[0]["host_trace_own"]
    own = [float(r.group(2)) for r in rows]
    assert own == sorted(own, reverse=True) and min(own) >= -0.05, own
    assert all(int(r.group(3)) >= 1 for r in rows)
    step_us = float(_TRACE_LINE.match(recs[0]["host_trace"][0]).group(3))
    main = _TRACE_LINE.match(recs[0]["host_trace"][0]).group(1)
    assert sum(o for r, o in zip(rows, own) if r.group(1) == main) <= step_us + 0.5
    lines = m.table(recs)
    at = lines.index("epgen host trace at 3 tokens, by own time (thread, own µs, calls, event):")
    assert lines[at + 1] == "  " + recs[0]["host_trace_own"][0]


def test_host_trace_depth_cuts_the_outline():
    """--host-trace-depth 2: no line deeper than level 2, and lines at level 2 (the default shows deeper ones)."""
    recs = get_world(1).run(scn_run, TINY + ["--tokens", "3", "--no-titan", "--host-trace", "--host-trace-depth", "2"],
                            timeout=120)[0]
    levels = [len(_TRACE_LINE.match(ln).group(4)) // 2 for ln in recs[0]["host_trace"]]
    assert max(levels) == 2, levels


def scn_order(rank, world, argv):
    """run() with its timers and profilers logging their calls, in order."""
    m = _script()
    seen = []
    real = {n: getattr(m, n) for n in ("warm_up", "wall_us", "legs_us", "host_profile", "kernel_profile",
                                       "host_trace")}

    def logged(name):
        def call(*a, **kw):
            seen.append(name)
            return real[name](*a, **kw)
        return call

    for n in real:
        setattr(m, n, logged(n))
    try:
        recs = m.run(m.parse_args(argv))
    finally:
        for n, f in real.items():
            setattr(m, n, f)
    return seen, recs


def test_the_profilers_run_after_every_timing():
    """cProfile and kineto slow the host for what follows them in the process: every profiler runs after the last
    timing of every token count, and its fields still land in the epgen record of their token count; the warm-up
    runs once, before any timing."""
    argv = TINY + ["--tokens", "2", "3", "--no-titan", "--host-profile", "--kernel-profile", "--host-trace"]
    seen, recs = get_world(1).run(scn_order, argv, timeout=180)[0]
    assert seen[0] == "warm_up" and seen.count("warm_up") == 1, seen
    seen = seen[1:]
    timers = [i for i, n in enumerate(seen) if n in ("wall_us", "legs_us")]
    profilers = [i for i, n in enumerate(seen) if n not in ("wall_us", "legs_us")]
    assert len(profilers) == 6 and len(timers) >= 6 and max(timers) < min(profilers), seen
    epgen = [r for r in recs if r["path"] == "epgen"]
    assert [r["tokens_per_rank"] for r in epgen] == [2, 3]
    assert all(r["host_top"] and r["kernel_top"] is not None and r["host_trace"] for r in epgen), epgen


def scn_titan_fails(rank, world, argv):
    """run() with torchtitan's all-to-all dispatcher failing to build."""
    m = _script()
    real = m.Titan.dispatcher

    def broken(self, path, args, T):
        if path == "titan_a2a":
            raise RuntimeError("no all-to-all here")
        return real(self, path, args, T)

    m.Titan.dispatcher = broken
    try:
        return m.run(m.parse_args(argv))
    finally:
        m.Titan.dispatcher = real


def test_a_failing_titan_path_is_recorded_and_epgen_still_timed():
    if titan_check.torchtitan_missing():
        pytest.skip(f"needs torchtitan: {titan_check.torchtitan_missing()}")
    m = _script()
    e, a2a, tep = get_world(1).run(scn_titan_fails, TINY + ["--tokens", "2"], timeout=120)[0]
    assert a2a["error"] == "RuntimeError: no all-to-all here" and "fwd_us" not in a2a
    _check_timed(e, m)
    _check_timed(tep, m)
    assert e["vs_titan"] is None and tep["vs_titan"] is None and e["meets_targets"]["vs_titan"] is None
    assert m.table([e, a2a, tep])[-1] == "titan_a2a at 2 tokens failed: RuntimeError: no all-to-all here"


class _Ticks:
    """A clock whose marks are the next of known times (µs): the partition's arithmetic, exactly."""
    cuda = False

    def __init__(self, steps):
        self.times = iter(t for step in steps for t in step)

    def start(self):
        pass

    def sync(self):
        pass

    def mark(self):
        return next(self.times)

    def us(self, a, b):
        return b - a


def test_the_legs_partition_each_step():
    m = _script()
    # three steps' marks: nine boundaries each (LEGS' starts and the end)
    steps = [[0, 10, 11, 21, 22, 42, 43, 53, 55], [0, 12, 13, 22, 23, 40, 41, 52, 53], [0, 11, 12, 20, 21, 50, 51,
                                                                                         60, 61]]

    def step(marks):
        for name in m.LEGS:
            marks.mark(name)
        marks.mark("end")

    got = m.legs_us(_Ticks(steps), step, iters=3, warmup=0)
    assert got["dispatch_fwd"] == 11 and got["combine_fwd"] == 9 and got["combine_bwd"] == 20
    assert got["dispatch_bwd"] == 10 and got["legs_total_us"] == 55

    def misordered(marks):
        for name in reversed(m.LEGS):
            marks.mark(name)
        marks.mark("end")

    with pytest.raises(AssertionError, match="another order"):
        m.legs_us(_Ticks(steps), misordered, iters=3, warmup=0)


@pytest.mark.parametrize("argv,message", [
    (["--tokens", "0"], "argument --tokens: must be >= 1, got 0"),
    (["--iters", "many"], "argument --iters: 'many' is not an integer"),
    (["--topk", "9", "--experts", "8"], "--topk 9 exceeds --experts 8"),
    (["--device", "cpu"], "--backend native runs the generated kernels: it needs --device cuda"),
    (["--backend", "nccl"], "argument --backend: invalid choice"),
])
def test_bad_arguments_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _script().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err, err


def test_experts_that_do_not_split_over_the_ranks_are_a_usage_error():
    m = _script()
    args = m.parse_args(TINY + ["--experts", "9"])
    with pytest.raises(m.UsageError, match="--experts 9 do not split evenly over 2 ranks"):
        m.op_config(0, 2, 4, args)


def scn_pair_sum(rank, world, argv):
    """run() with --backward-pair-sum: autograd's one-launch choice inside the steps, and after the run."""
    from runtime import autograd as ag

    real_choice = ag._ONE_LAUNCH_BACKWARD
    seen, recs = _run_probing(argv, lambda: ag._ONE_LAUNCH_BACKWARD)
    return seen, recs, ag._ONE_LAUNCH_BACKWARD is real_choice


def test_backward_pair_sum_holds_for_every_step_and_is_recorded():
    """--backward-pair-sum (the A/B's "before"): every timed step without the one-launch backward, autograd's own
    choice back after the run; every record says which backward ran (the torch backend always sums the pairs)."""
    seen, recs, restored = get_world(1).run(scn_pair_sum, TINY + ["--tokens", "3", "--no-titan",
                                                                  "--backward-pair-sum"], timeout=120)[0]
    assert seen and not any(seen) and restored
    assert all(r["dispatch_backward"] == "pair sum + combine" for r in recs)
