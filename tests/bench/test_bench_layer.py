"""The layer modes (bench/layer.py, bench/moe_layer.py, bench/layer_loop.py, bench/ceiling.py) on CPU: the pair
placement and grouped-expert arithmetic, the fp8 row packing,
the MoE-layer point (epgen on the torch backend and the all_to_all_single shuffle, 2 gloo ranks, gated
against each other), a vdev2d path that cannot run (recorded with its reason, the run goes on), the
layer loop's record, the tables and scripts/layer_table.py."""

from __future__ import annotations

import importlib.util
import json
import shutil
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from tests.support.ep_dist import get_world
from generator.abi import LL_MAX_TOKENS
from bench import ceiling, cli, layer as L, layer_loop, moe_layer as M, tables
from bench.gate import GateError
from bench.inputs import dequantize_rows, quantize_blocks

ROOT = Path(__file__).resolve().parents[2]


def test_place_groups_pairs_per_expert_padded():
    e = torch.tensor([2, 0, 3, 2, 3, 0, 2, 3])  # E = 3: 3 means no local expert
    pos, slot_pair, ends, S = M.place(e, 3, align=4)
    assert S == 8 + 3 * 4 + 1
    assert ends.tolist() == [4, 4, 8]  # expert 0: 2 pairs -> 4 rows; expert 1: none -> 0; expert 2: 3 -> 4
    assert ends.dtype == torch.int32
    assert pos[[1, 5]].tolist() == [0, 1] and pos[[0, 3, 6]].tolist() == [4, 5, 6]  # ascending pair id
    assert all(int(pos[i]) == S - 1 for i in (2, 4, 7))  # the sink
    for i in (0, 1, 3, 5, 6):
        assert int(slot_pair[pos[i]]) == i


def test_experts_ffn_loop_matches_each_expert():
    g = torch.Generator().manual_seed(3)
    w13 = torch.randn(3, 16, 8, generator=g).to(torch.bfloat16)
    w2 = torch.randn(3, 8, 8, generator=g).to(torch.bfloat16)
    xs = torch.randn(12, 8, generator=g).to(torch.bfloat16)
    ends = torch.tensor([4, 4, 10], dtype=torch.int32)
    out = M.experts_ffn(xs, ends, w13, w2)
    gate, up = (xs[4:10] @ w13[2].t()).chunk(2, dim=-1)
    assert torch.equal(out[4:10], (torch.nn.functional.silu(gate) * up) @ w2[2].t())
    assert not M.grouped_ok(xs)


def test_fp8_rows_pack_and_unpack():
    x = torch.randn(5, 256).to(torch.bfloat16)
    p = M.pack_rows(x, "fp8")
    assert p.dtype == torch.bfloat16 and p.shape == (5, (256 + 256 // 32) // 2)
    q, s = quantize_blocks(x, 2)
    assert torch.equal(M.unpack_rows(p, "fp8", 256), dequantize_rows(q, s, torch.bfloat16))
    assert M.pack_rows(x, "bf16") is x


SMALL = dict(hidden=256, k=4, experts=8, inter=64)


def scn_layer(rank, world, mode, paths):
    recs = M.run_layer_point(8, SMALL["hidden"], SMALL["k"], SMALL["experts"], SMALL["inter"], mode, paths,
                             reps=2, eager_iters=2, backend="torch")
    return recs


LAYER_REQUIRED = ("commit", "date", "gpu", "driver", "torch", "world_size", "kind", "path", "dtype", "tokens_per_rank",
                  "hidden", "topk", "experts", "intermediate", "graph", "graph_modes", "layer_us", "layer_eager_us",
                  "expert_us", "expert_eager_us", "comm_us", "comm_eager_us", "gate_max_rel_err", "gate_tol",
                  "dispatch_mode", "grouped_gemm", "error")


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_layer_point_on_cpu_epgen_and_a2a_agree(mode):
    per_rank = get_world(2).run(scn_layer, mode, ["epgen", "a2a", "vdev2d"], timeout=180)
    for recs in per_rank:
        assert [r["path"] for r in recs] == ["epgen", "a2a", "vdev2d"]
        for r in recs[:2]:
            missing = [key for key in LAYER_REQUIRED if key not in r]
            assert not missing, missing
            json.dumps(r, allow_nan=False)
            assert r["error"] is None and r["graph"] is False and r["graph_modes"] == ["eager"]
            assert r["gate_max_rel_err"] <= M.LAYER_TOL[mode]
            assert r["layer_us"] == r["layer_eager_us"] > 0 and r["expert_us"] == r["expert_eager_us"] > 0
            assert r["comm_us"] == pytest.approx(r["layer_us"] - r["expert_us"])
            assert r["grouped_gemm"] == "loop over experts" and r["placed_rows"] > 0
        assert recs[1]["gate_max_rel_err"] == 0.0  # the reference itself
        vdev = recs[2]
        assert vdev["error"] and vdev["layer_us"] is None  # no NVSHMEM on a CPU: recorded, not raised
    assert per_rank[0][2]["error"] == per_rank[1][2]["error"]  # every rank records the same reason
    lines = tables.layer_table(per_rank[0])
    assert any("failed [1]" in line for line in lines) and lines[-1].startswith("\n[1] rank 0:")


def test_vdev2d_limits_are_torch_s():
    assert M.vdev2d_limits(16, 2) is None and M.vdev2d_limits(1, 16) is None
    why = M.vdev2d_limits(128, 2)  # 256 experts on 2 ranks: torch's all_to_all_vdev_2d refuses every call
    assert "at most 16 experts per rank" in why and "--experts 32" in why
    assert "at most 16 ranks" in M.vdev2d_limits(1, 17)
    with pytest.raises(RuntimeError, match="at most 16 experts per rank"):  # before NVSHMEM or any allocation
        M.Vdev2dPath(SimpleNamespace(epr=128, world=2))


def scn_vdev2d_over_limit(rank, world):
    return M.run_layer_point(4, 256, 4, 2 * 17, 64, "bf16", ["a2a", "vdev2d"], reps=2, eager_iters=2)


def test_vdev2d_over_the_expert_limit_is_recorded_with_the_reason():
    per_rank = get_world(2).run(scn_vdev2d_over_limit, timeout=120)
    for recs in per_rank:
        assert [r["path"] for r in recs] == ["a2a", "vdev2d"] and recs[0]["error"] is None
        assert "at most 16 experts per rank" in recs[1]["error"] and recs[1]["layer_us"] is None


class _NanPath:
    """A path whose output is NaN: its gate fails with an infinite error."""
    name, capturable = "vdev2d", False

    def __init__(self, p):
        self.p = p

    def __call__(self):
        return torch.full_like(self.p.x, float("nan"))

    def close(self):
        pass


def scn_gate_failure(rank, world):
    saved = M.PATH_CLASSES["vdev2d"]
    M.PATH_CLASSES["vdev2d"] = _NanPath
    try:
        return M.run_layer_point(4, 256, 4, 8, 64, "bf16", ["a2a", "vdev2d"], reps=2, eager_iters=2)
    finally:
        M.PATH_CLASSES["vdev2d"] = saved


def test_a_failed_gate_is_recorded_as_strict_json():
    per_rank = get_world(2).run(scn_gate_failure, timeout=120)
    for recs in per_rank:
        bad = recs[1]
        assert bad["error"].startswith("gate: largest per-token relative error inf")
        assert bad["gate_max_rel_err"] is None  # not Infinity: the record stays strict JSON
        json.dumps(recs, allow_nan=False)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_copy_kernel_compiles_for_sm90a():
    cubin = ceiling.compile_copy_kernel("sm_90")
    assert cubin[:4] == b"\x7fELF" and b"epg_copy16" in cubin


def scn_loop(rank, world):
    return layer_loop.run_layer_loop(4, 256, 4, 8, layers=3, reps=2, backend="torch")


def test_layer_loop_record_on_cpu():
    recs = get_world(2).run(scn_loop, timeout=120)
    r = recs[0]
    assert (r["kind"], r["layers"], r["graph"], r["tokens_per_rank"], r["dtype"]) == ("layer_loop", 3, False, 4, "bfloat16")
    assert r["epgen_own_us"] > 0 and r["epgen_view_us"] > 0 and r["nccl_us"] > 0
    assert r["nccl_over_epgen_view"] == pytest.approx(r["nccl_us"] / r["epgen_view_us"])
    json.dumps(r, allow_nan=False)
    assert tables.loop_table(recs)[2].startswith("| 4 | ")


def _loop(T, own, view, nccl, **kw):
    return dict(kind="layer_loop", tokens_per_rank=T, epgen_own_us=own, epgen_view_us=view, nccl_us=nccl,
                nccl_over_epgen_view=nccl / view, **kw)


def _layer(path, T, layer, expert, dtype="bf16", error=None, graph=True, **kw):
    return dict(kind="layer", path=path, dtype=dtype, tokens_per_rank=T, layer_us=layer, expert_graph_us=expert,
                expert_eager_us=expert, comm_us=None if layer is None else layer - expert, error=error, graph=graph,
                **kw)


def test_tables_format_the_latest_records():
    recs = [_loop(1, 20.0, 19.0, 19.5), _loop(1, 9.0, 8.5, 19.5), _loop(128, 34.8, 34.1, 43.7),
            _layer("epgen", 8, 120.0, 100.0), _layer("a2a", 8, 300.0, 100.0, graph=False),
            _layer("vdev2d", 8, None, 100.0, error="RuntimeError: no NVSHMEM"),
            _layer("epgen", 8, 90.0, 70.0, dtype="fp8"),
            dict(kind="ceiling", method="sm_push", sms_used=32, GBps=280.0, us=240.0, distinct_sms=32),
            dict(kind="ceiling", method="nccl", sms_used=None, GBps=300.0, us=220.0),
            dict(kind="ceiling", method="sm_pull", sms_used=8, GBps=100.0, us=600.0, distinct_sms=8)]
    loop = tables.loop_table(recs)
    assert loop[2] == "| 1 | bw | 9.0 µs | 8.5 µs | 19.5 µs | 2.29× |" and loop[3].startswith("| 128 | bw | 34.8 µs")
    layer = tables.layer_table(recs)
    assert layer[2] == "| bf16 | 8 | 100.0 | 120.0 (20.0) | 300.0 (200.0) eager | failed [1] | 2.50× |"
    assert layer[3] == "| fp8 | 8 | 70.0 | 90.0 (20.0) | – | – | – |"
    assert layer[4] == "\n[1] RuntimeError: no NVSHMEM"
    assert all(line.count("|") == layer[0].count("|") for line in layer[1:4])
    ceil = tables.ceiling_table(recs)
    assert [c.split("|")[1].strip() for c in ceil[2:]] == ["sm_push", "sm_pull", "nccl"]
    assert ceil[2] == "| sm_push | 32 | 280 | 240.0 | 32 |" and ceil[4] == "| nccl | – | 300 | 220.0 | – |"


def test_tables_with_the_low_latency_protocol():
    """ll records: their own loop rows, and an epgen column of their own in the layer table (the a2a / epgen
    ratio stays the bandwidth protocol's)."""
    recs = [_loop(1, 20.0, 19.0, 19.5, intranode_protocol="bw"), _loop(1, 9.6, 9.2, 19.5, intranode_protocol="ll"),
            _layer("epgen", 8, 120.0, 100.0, intranode_protocol="bw"), _layer("a2a", 8, 300.0, 100.0),
            _layer("epgen", 8, 110.0, 100.0, intranode_protocol="ll")]
    assert tables.loop_table(recs)[2:] == ["| 1 | bw | 20.0 µs | 19.0 µs | 19.5 µs | 1.03× |",
                                      "| 1 | ll | 9.6 µs | 9.2 µs | 19.5 µs | 2.12× |"]
    layer = tables.layer_table(recs)
    assert "low-latency" in layer[0] and layer[0].count("|") == layer[1].count("|") == layer[2].count("|")
    assert layer[2] == "| bf16 | 8 | 100.0 | 120.0 (20.0) | 300.0 (200.0) | – | 110.0 (10.0) | 2.50× |"


def test_tables_with_the_fused_grouped_combine():
    """grouped_combine "fused" records (taken before that form was removed): an epgen column of their own (the
    a2a / epgen ratio stays the reduce form's); the CLI no longer offers the form."""
    recs = [_layer("epgen", 8, 120.0, 100.0, intranode_protocol="bw", grouped_combine="reduce"),
            _layer("a2a", 8, 300.0, 100.0), _layer("epgen", 8, 105.0, 100.0, intranode_protocol="bw", grouped_combine="fused")]
    assert [tables.layer_column(r) for r in recs] == ["epgen", "a2a", "epgen_fused"]
    layer = tables.layer_table(recs)
    assert "fused grouped combine" in layer[0] and layer[0].count("|") == layer[1].count("|") == layer[2].count("|")
    assert layer[2] == "| bf16 | 8 | 100.0 | 120.0 (20.0) | 300.0 (200.0) | – | 105.0 (5.0) | 2.50× |"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--layer", "--grouped-combine", "fused"])
    assert not hasattr(cli.build_parser().parse_args(["--layer"]), "grouped_combine")


def scn_layer_protocols(rank, world):
    return M.run_layer_point(8, SMALL["hidden"], SMALL["k"], SMALL["experts"], SMALL["inter"], "bf16", ["epgen", "a2a"],
                             reps=2, eager_iters=2, backend="torch", protocols=("bw", "ll"))


def test_layer_point_runs_each_protocol():
    """One epgen record per intranode protocol asked for, then the a2a reference's; no combine_grouped form."""
    for recs in get_world(2).run(scn_layer_protocols, timeout=180):
        runs = [(r["path"], r["intranode_protocol"]) for r in recs]
        assert runs == [("epgen", "bw"), ("epgen", "ll"), ("a2a", None)]
        assert not any("grouped_combine" in r for r in recs)
        assert all(r["error"] is None and r["gate_max_rel_err"] <= M.LAYER_TOL["bf16"] for r in recs)


def test_cli_layer_flags():
    args = cli.build_parser().parse_args(["--layer", "--layer-paths", "a2a", "vdev2d", "--tokens", "1", "8"])
    assert (args.layer, args.layer_paths, args.tokens, args.layer_dtypes) == (True, ["a2a", "vdev2d"], [1, 8],
                                                                             ["bf16", "fp8"])
    args = cli.build_parser().parse_args(["--layer-loop", "--ceiling"])
    assert (args.layer_loop, args.layers, args.ceiling, args.ceiling_sms, args.intermediate) == \
        (True, 16, True, [8, 16, 32, 64, 132], 2048)


def test_layer_table_script(tmp_path, capsys):
    src = tmp_path / "layer.jsonl"
    recs = [_loop(8, 21.9, 21.7, 20.5, commit="abc", gpu="NVIDIA H200", world_size=2, driver="570"),
            _layer("epgen", 8, 120.0, 100.0)]
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    spec = importlib.util.spec_from_file_location("layer_table", ROOT / "scripts" / "layer_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(src)]) == 0
    out = capsys.readouterr().out
    assert "| 8 | bw | 21.9 µs | 21.7 µs | 20.5 µs | 0.94× |" in out and "| bf16 | 8 | 100.0 | 120.0 (20.0)" in out
    assert mod.main([str(tmp_path / "missing.jsonl")]) == 1


def scn_run(rank, world, argv):
    emitted = []
    recs = L.run(cli.build_parser().parse_args(argv), emitted.append)
    return recs, emitted


def test_run_emits_each_point_as_it_goes():
    argv = ["--layer", "--layer-loop", "--tokens", "4", "--hidden", "256", "--topk", "4", "--experts", "8",
            "--intermediate", "64", "--layer-dtypes", "bf16", "--layer-iters", "2", "--graph-layers", "2", "--reps", "2",
            "--layers", "2"]
    (recs, emitted), _ = get_world(2).run(scn_run, argv, timeout=180)
    assert [r["kind"] for r in recs] == ["layer_loop", "layer", "layer"]
    assert [[r["kind"] for r in batch] for batch in emitted] == [["layer_loop"], ["layer", "layer"]]
    assert [r["path"] for r in recs[1:]] == ["epgen", "a2a"] and recs[1]["backend"] == "torch"
    assert (recs[0]["intranode_protocol"], recs[1]["intranode_protocol"], recs[2]["intranode_protocol"]) == ("bw", "bw", None)


def test_run_with_both_protocols_records_each_and_skips_ll_past_its_limit():
    """--protocol ll bw: a layer-loop record and an epgen layer record per protocol, where the config allows
    ll (not the fp8 mode's in-kernel quantization; not above LL_MAX_TOKENS tokens per rank)."""
    base = ["--hidden", "256", "--topk", "4", "--experts", "8", "--intermediate", "64", "--layer-iters", "2",
            "--graph-layers", "2", "--reps", "2", "--layers", "2", "--protocol", "ll", "bw"]
    (recs, _), _ = get_world(2).run(scn_run, ["--layer", "--layer-loop", "--tokens", "4", *base], timeout=180)
    assert [(r["kind"], r.get("dtype"), r.get("path"), r["intranode_protocol"]) for r in recs] == [
        ("layer_loop", "bfloat16", None, "ll"), ("layer_loop", "bfloat16", None, "bw"),
        ("layer", "bf16", "epgen", "ll"), ("layer", "bf16", "epgen", "bw"), ("layer", "bf16", "a2a", None),
        ("layer", "fp8", "epgen", "bw"), ("layer", "fp8", "a2a", None)]  # fp8: quantized in the kernel, no ll
    assert all(r.get("error") is None for r in recs)
    T = LL_MAX_TOKENS + 1
    (recs, _), _ = get_world(2).run(scn_run, ["--layer-loop", "--tokens", str(T), *base], timeout=180)
    assert [(r["tokens_per_rank"], r["intranode_protocol"]) for r in recs] == [(T, "bw")]


def scn_gate_stop_keeps_the_ceiling(rank, world):
    saved = L.run_layer_point, L.run_ceiling

    def gate_fails(*a, **kw):
        raise GateError("layer gate failed (test)")

    L.run_layer_point, L.run_ceiling = gate_fails, lambda *a, **kw: [{"kind": "ceiling", "method": "nccl"}]
    emitted = []
    try:
        L.run(cli.build_parser().parse_args(["--layer", "--ceiling", "--hidden", "256", "--experts", "8",
                                               "--intermediate", "64", "--tokens", "4"]), emitted.append)
    except GateError as e:
        return str(e), emitted
    finally:
        L.run_layer_point, L.run_ceiling = saved
    return None, emitted


def test_a_layer_gate_failure_still_runs_the_ceiling_then_raises():
    for err, emitted in get_world(2).run(scn_gate_stop_keeps_the_ceiling, timeout=120):
        assert err == "layer gate failed (test)" and emitted == [[{"kind": "ceiling", "method": "nccl"}]]


def test_plot_of_layer_records(tmp_path):
    import matplotlib  # noqa: F401 - the [test] extra installs it: these tests run, never skip
    recs = [_loop(1, 9.0, 8.5, 19.5), _loop(128, 34.8, 34.1, 43.7),
            _layer("epgen", 8, 120.0, 100.0), _layer("a2a", 8, 300.0, 100.0), _layer("epgen", 128, 220.0, 150.0),
            _layer("vdev2d", 8, None, 100.0, error="no NVSHMEM"),
            dict(kind="ceiling", method="sm_push", sms_used=32, GBps=280.0, us=240.0),
            dict(kind="ceiling", method="sm_push", sms_used=64, GBps=330.0, us=200.0),
            dict(kind="ceiling", method="nccl", sms_used=None, GBps=300.0, us=220.0)]
    src = tmp_path / "layer.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    spec = importlib.util.spec_from_file_location("plot_bench", ROOT / "scripts" / "plot_bench.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    assert plot.main_layer(str(src), str(tmp_path / "layer.png")) == 0
    assert (tmp_path / "layer.png").stat().st_size > 0
    (tmp_path / "empty.jsonl").write_text("")
    assert plot.main_layer(str(tmp_path / "empty.jsonl"), str(tmp_path / "x.png")) == 1


def test_grouped_profile_table_orders_kernels_by_their_time_per_layer():
    spec = importlib.util.spec_from_file_location("grouped_profile", ROOT / "scripts" / "grouped_profile.py")
    gp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gp)
    assert gp._name("void at::native::elementwise_kernel<128, 4>(int)") == "void at::native::elementwise_kernel"
    assert gp._name("Memcpy DtoD (Device -> Device)") == "copy"
    assert gp._name("epg_sm_90_grouped_place_bf16") == "epg_sm_90_grouped_place_bf16"
    rec = {"tokens_per_rank": 1, "grouped_combine": "reduce", "per_layer_us": 20.0, "world_size": 1, "gap_us": 1.5,
           "kernels": {"a": {"per_layer": 1, "median_us": 2.0}, "b": {"per_layer": 2, "median_us": 3.0},
                       "copy": {"per_layer": 1, "median_us": 9.0}}}
    lines = gp.table(rec)
    assert lines[0].startswith("T=1 reduce: 20.0 µs per layer (graph, W=1)")
    assert [ln.split(" | ")[0].lstrip("| ") for ln in lines[3:]] == ["copy", "b", "a"]
    assert lines[4] == "| b | 2 | 3.0 | 6.0 |"


def test_grouped_profile_table_names_legs_and_geometry():
    """scripts/grouped_profile_table.py: a record's forced legs and launch overrides are named in its row; a record
    whose legs field was overwritten by the eager timings (grouped_profile.py before 2c5ebc0) says so."""
    spec = importlib.util.spec_from_file_location("gpt", ROOT / "scripts" / "grouped_profile_table.py")
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    base = {"commit": "abc1234", "tokens_per_rank": 1, "grouped_combine": "reduce", "per_layer_us": 20.0,
            "kernels": {"epg_dispatch_ll": {"per_layer": 1, "median_us": 7.5}}}
    assert "| reduce |" in gpt.row({**base, "legs": "auto"})
    assert "| reduce (one legs) [blocks 8, threads 128] |" in gpt.row({**base, "legs": "one", "launch_blocks": 8,
                                                                        "launch_threads": 128})
    assert "| reduce (legs not recorded) |" in gpt.row({**base, "legs": {"eager_legs_us": 100.0}})
    # a protocol asked for names the one that ran; the op's own choice (and records before the option) names none
    assert "| reduce (ll protocol) |" in gpt.row({**base, "protocol_choice": "ll", "protocol": "ll"})
    assert "| reduce |" in gpt.row({**base, "protocol_choice": "auto", "protocol": "bw"})
    assert gpt.row(base).endswith("| 7.5 | – | – | – | – | – | – | – |")


def test_phase_trace_reads_stamps_relative_to_the_first_entry():
    """scripts/phase_trace.py: raw stamps [kernel][phase][earliest, latest] (ns) -> µs since the kernel's earliest
    entry, None where no block reached a phase or the kernel did not run; medians over calls; the timer's step."""
    spec = importlib.util.spec_from_file_location("phase_trace", ROOT / "scripts" / "phase_trace.py")
    pt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pt)
    U = pt.UNSET
    disp = [[1000, 1500], [2000, 2600], [4000, 4200]] + [[U, 0]] * 9  # trace_phases (12) per kernel
    comb = [[U, 0]] * 12  # combine_ll did not run
    one = pt.relative([disp, comb], pt.KERNELS["plain"])
    assert one["dispatch_ll"][:3] == [(0.0, 0.5), (1.0, 1.6), (3.0, 3.2)]
    assert one["dispatch_ll"][3] is None and len(one["dispatch_ll"]) == len(pt.PHASES["dispatch_ll"])
    assert one["combine_ll"] == [None] * len(pt.PHASES["combine_ll"])
    later = [[[t + 7 if t != U else U for t in pair] if pair[0] != U else pair for pair in disp], comb]
    later[0][2] = [1000 + 5000, 1000 + 5100]  # a slower third phase in the second call
    rows = pt.summarize([one, pt.relative(later, pt.KERNELS["plain"])], pt.KERNELS["plain"])["dispatch_ll"]
    # the second call entered at 1007 ns: its third phase at (6000 - 1007, 6100 - 1007) ns; medians of two
    assert rows[2] == {"phase": "counts posted, rows sent", "calls": 2,
                       "earliest_us": pytest.approx((3.0 + 4.993) / 2), "latest_us": pytest.approx((3.2 + 5.093) / 2)}
    assert rows[3] is None
    assert pt.timer_step([disp, comb]) == 200
    rec = {"tokens_per_rank": 1, "form": "plain", "iters": 2, "timer_step_ns": 200,
           "phases": pt.summarize([one, pt.relative(later, pt.KERNELS["plain"])], pt.KERNELS["plain"])}
    lines = pt.table(rec)
    assert lines[3] == "| dispatch_ll | entry | 0.00 | 0.50 |" and len(lines) == 6
    # the direct form: dispatch_direct's phases in the buffer's first half, combine_gather's in the second, each
    # relative to its own kernel's first entry
    gather = [[9000, 9300], [9800, 9900], [U, 0], [U, 0], [12000, 12500]] + [[U, 0]] * 7
    direct = pt.relative([disp, gather], pt.KERNELS["direct"])
    assert list(direct) == ["dispatch_direct", "combine_gather"]
    assert len(direct["dispatch_direct"]) == len(pt.PHASES["dispatch_direct"])
    assert direct["dispatch_direct"][1] == (1.0, 1.6) and direct["dispatch_direct"][9] is None
    assert direct["combine_gather"] == [(0.0, 0.3), (0.8, 0.9), None, None, (3.0, 3.5), None]
    drec = {**rec, "form": "direct", "phases": pt.summarize([direct], pt.KERNELS["direct"])}
    lines = pt.table(drec)
    assert lines[4] == "| dispatch_direct | histograms counted | 1.00 | 1.60 |" and len(lines) == 9
    assert lines[-1] == "| combine_gather | tokens gathered | 3.00 | 3.50 |"
    # the kernels' per-block slots [kernel][block][phase] (0: not reached) -> [kernel][phase][earliest, latest]
    buf = torch.zeros((2, 3, 8), dtype=torch.int64)
    buf[0, 0, 0], buf[0, 2, 0], buf[0, 2, 1] = 1500, 1000, 2600
    buf[0, 1, 1] = 2000
    got = pt.earliest_latest(buf)
    assert got[0][0] == [1000, 1500] and got[0][1] == [2000, 2600] and got[0][2] == [U, 0]
    assert got[1] == [[U, 0]] * 8
