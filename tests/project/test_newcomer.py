"""A first-time user's commands say what they did and what to do: profiles in --help, real paths, one-line
errors, the missing program named with its package, the GPU tools' requirements, the user tuning file, the
epgen command and a foreign package shadowing one of epgen's generic top-level names (README "Package names")."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

import epgen
from bench import cli as bench_cli, tune
from generator import cli, specs as S, toolchain

ROOT = Path(__file__).resolve().parents[2]


def run_cli(argv, main=cli.main):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def test_help_lists_the_profiles_and_each_command_says_which_it_used(specs):
    rc, out, _ = run_cli(["build", "--help"])
    out = " ".join(out.split())  # argparse wraps the help text
    assert rc == 0 and "(default: default)" in out
    assert all(f"{name}: {' '.join(p.description.split())}" in out for name, p in specs.profiles.items())
    rc, out, _ = run_cli(["list", "--arch", "gfx950"])
    assert rc == 0 and out.rstrip().endswith("(profile all; build's default profile is 'default')")


def test_explain_names_the_rendered_file_where_it_is(tmp_path):
    rc, out, _ = run_cli(["explain", "gfx950/quantize_fp8.bf16.fp8_e4m3fn.fp8_direct_cast"])
    path = out.split("file", 1)[1].split()[0]
    assert rc == 0 and Path(path).is_file() and Path(path).is_absolute()
    rc, out, _ = run_cli(["explain", "gfx950/quantize_fp8.bf16.fp8_e4m3fn.fp8_direct_cast", "--out", str(tmp_path)])
    assert str(tmp_path / "gfx950") in out and "not rendered yet: python -m generator build --arch gfx950" in out


def test_check_of_a_partial_build_names_the_unbuilt_targets_once(tmp_path):
    rc, out, _ = run_cli(["build", "--arch", "gfx950", "--no-compile", "--out", str(tmp_path)])
    assert rc == 0 and f"sources in {tmp_path}" in out
    rc, out, _ = run_cli(["check", "--out", str(tmp_path)])
    assert rc == 0, out
    assert "fresh for gfx950" in out and "not built: gfx942, gfx1250, sm_90" in out and "missing" not in out
    manifest = tmp_path / "gfx950" / "manifest.json"
    manifest.write_text(manifest.read_text() + " ")
    rc, out, _ = run_cli(["check", "--out", str(tmp_path)])
    assert rc == 1 and "out of date" in out and "build --arch gfx950 --no-compile" in out


def test_the_checkout_tree_must_hold_every_target(monkeypatch, spec_copy):
    """Without --out, a checkout's generated/ missing a target is a problem (CI's freshness check)."""
    monkeypatch.delenv("EPGEN_GENERATED_DIR", raising=False)
    rc, out, _ = run_cli(["--specs", str(spec_copy), "check", "--arch", "gfx950"])
    assert rc == 1 and "missing" in out and "not fresh" in out


def test_unwritable_out_and_missing_specs_folder_are_one_line_errors(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc, out, err = run_cli(["build", "--arch", "gfx950", "--no-compile", "--out", str(blocker / "sub")])
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and str(blocker) in err
    assert "Traceback" not in err
    rc, out, err = run_cli(["--specs", str(tmp_path / "nowhere"), "list"])
    assert rc == 2 and err == f"error: {tmp_path / 'nowhere'}: no such folder (the specs folder: --specs, $EPGEN_SPECS_DIR)\n"


def test_a_missing_disassembler_is_named_with_its_package(monkeypatch, specs):
    tc = specs.toolchains["nvidia"]
    monkeypatch.setattr(toolchain, "_pip_nvidia_bins", lambda: [])
    monkeypatch.setattr(toolchain.shutil, "which", lambda name, path=None: "/bin/true" if name in tc.compilers else None)
    tools = toolchain.find.__wrapped__(tc)
    assert tools.disassembler is None
    assert tools.missing.startswith("cuobjdump not found on PATH") and "nvidia-cuda-cuobjdump" in tools.missing
    with pytest.raises(toolchain.ToolchainMissing, match=r"^no disassembler for sm_90: cuobjdump not found .*"
                                                         r"pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"):
        toolchain.disassemble_command(specs.targets["sm_90"], tools, Path("x.cubin"))


def test_gpu_tools_say_what_they_need_in_one_line(monkeypatch):
    monkeypatch.setattr(bench_cli.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        bench_cli.require_gpus("epgen tune")
    msg = str(e.value.code)
    assert "\n" not in msg and "needs GPUs" in msg and "torchrun --nproc-per-node N -m epgen tune" in msg
    monkeypatch.setattr(bench_cli.torch.cuda, "is_available", lambda: True)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit, match=r"python -m bench: not started by torchrun .*-m bench \.\.\."):
        bench_cli.require_gpus("python -m bench")


def test_tune_help_explains_every_option():
    parser = tune.build_parser()
    undocumented = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert undocumented == []
    text = " ".join(parser.format_help().split())
    assert "EPGEN_TUNING_FILE" in text and "torchrun --nproc-per-node N -m bench.tune" in text


def test_tuned_tables_go_to_the_user_file_that_the_loader_lays_over_the_specs(monkeypatch, tmp_path):
    user = tmp_path / "tuning.toml"
    monkeypatch.setenv(S.TUNING_ENV, str(user))
    shipped = S.load(tuning_overlay=False)
    new = {"dispatch": tune.buckets_from({64: (16, 128), 4096: (0, 1024)}, world=2)}
    user.write_text(tune.rewrite_user(user, "sm_90", new))
    user.write_text(tune.rewrite_user(user, "sm_90", {}, ll_max=8))  # a second run keeps the first one's tables
    text = user.read_text()
    assert text.count("[[tuning.sm_90.dispatch]]") == 2 and "gfx950" not in text and "ll_max_tokens = 8" in text
    specs = S.load()
    assert S.geometry(specs, "sm_90", "dispatch", 4096, world=2).threads == 1024
    assert S.buckets_for(specs, "sm_90", "dispatch", 0) == S.buckets_for(shipped, "sm_90", "dispatch", 0)
    assert specs.tuning[("gfx950", "combine")] == shipped.tuning[("gfx950", "combine")]
    assert specs.ll_max_tokens["sm_90"] == 8
    assert S.tuning_sources(specs.root) == [specs.root / "tuning.toml", user]
    user.write_text(text.replace("threads = 1024", "threads = 1000"))
    with pytest.raises(S.SpecError, match=rf"^{user}:\d+: .*threads = 1000: a multiple of the wave size 32"):
        S.load()
    monkeypatch.setenv(S.TUNING_ENV, "")
    assert S.tuning_sources(specs.root) == [specs.root / "tuning.toml"] and S.load().tuning == shipped.tuning


def test_write_specs_is_refused_for_the_installed_copy(monkeypatch):
    monkeypatch.setattr(tune.gspecs, "is_packaged", lambda root: True)
    with pytest.raises(SystemExit, match=r"--write-specs: the specs in use are the copy installed with the package"):
        tune.main(["--write-specs"])


def test_epgen_command_runs_the_generator_and_refuses_unknown_commands():
    rc, out, _ = run_cli(["list", "--arch", "gfx950"], epgen.main)
    assert rc == 0 and "variant(s) (profile all" in out
    rc, out, _ = run_cli(["--help"], epgen.main)
    assert rc == 0 and all(f"epgen {c}" in out for c in ("build", "bench", "tune", "doctor"))
    rc, _, err = run_cli(["bulid"], epgen.main)
    assert rc == 2 and "unknown command 'bulid'" in err


def _foreign(tmp_path: Path, name: str) -> Path:
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    return tmp_path


def test_a_foreign_package_named_like_epgens_is_named(tmp_path):
    """A folder `runtime/` where Python starts shadows epgen's: `python -m epgen bench` says so in one line; a
    foreign `generator/` makes `import runtime` fail with a message naming it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    (tmp_path / "a").mkdir()
    where = _foreign(tmp_path / "a", "runtime")
    r = subprocess.run([sys.executable, "-m", "epgen", "bench"], cwd=where, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"the 'runtime' package Python imports, {where / 'runtime' / '__init__.py'}" in r.stderr
    assert "is not epgen's" in r.stderr
    (tmp_path / "b").mkdir()
    where = _foreign(tmp_path / "b", "generator")
    r = subprocess.run([sys.executable, "-c", "import runtime"], cwd=where, env={**env, "PYTHONPATH": f".:{ROOT}"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "ImportError: epgen's runtime needs epgen's 'generator' package, but Python imports " \
                                 f"another one ({where / 'generator' / '__init__.py'})" in r.stderr, r.stderr
    assert epgen._clash(("generator", "runtime", "bench")) is None  # here: epgen's own


def test_a_generator_only_install_is_told_to_add_the_runtime_extra(monkeypatch):
    import importlib

    import generator

    real = importlib.import_module

    def no_torch(name, *args):
        if name == "runtime":
            raise ImportError("No module named 'torch'", name="torch")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_torch)
    rc, _, err = run_cli(["bench"], epgen.main)
    assert rc == 2 and err.strip().endswith("pip install 'epgen[runtime]')"), err
    assert generator.foreign("generator") is None


def test_version_is_printed_by_the_command_and_by_doctor():
    from generator import __version__

    rc, out, _ = run_cli(["--version"], epgen.main)
    assert rc == 0 and out == f"epgen {__version__}\n"
    rc, out, _ = run_cli(["--help"], epgen.main)
    assert "epgen --version" in out


def test_doctor_of_the_epgen_script_names_a_foreign_generator_in_this_folder(tmp_path):
    """The `epgen` script imports from its own bin/, not the current folder, so a foreign `generator/` here
    is seen only by Python run here (python -m, -c): doctor names it as `python -m epgen doctor` does
    (python -P: the script's sys.path, the current folder left out)."""
    where = _foreign(tmp_path, "generator")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = [sys.executable, "-P", "-c", "import sys, epgen; sys.exit(epgen.main(['doctor']))"]
    for argv in (script, [sys.executable, "-m", "epgen", "doctor"]):
        r = subprocess.run(argv, cwd=where, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stdout.startswith("epgen "), (argv, r.stdout, r.stderr)
        assert r.stderr.count("\n") == 1 and f"'generator' package Python" in r.stderr, (argv, r.stderr)
        assert f"{where / 'generator' / '__init__.py'}, is not epgen's" in r.stderr, (argv, r.stderr)


def test_only_a_foreign_package_in_this_folder_counts_as_shadowing(tmp_path, monkeypatch):
    monkeypatch.chdir(_foreign(tmp_path, "generator"))  # not on sys.path here, as for the epgen script
    assert "is not epgen's" in epgen._shadowed_here("generator")
    (tmp_path / "generator" / "__init__.py").unlink()  # a namespace folder: a regular package later on wins
    assert epgen._shadowed_here("generator") is None
    (tmp_path / "generator" / "__init__.py").write_text((ROOT / "generator" / "__init__.py").read_text())
    assert epgen._shadowed_here("generator") is None  # a copy of epgen's own
    (tmp_path / "bench.py").write_text("")
    assert f"{tmp_path / 'bench.py'}, is not epgen's" in epgen._shadowed_here("bench")


def test_an_explain_rejection_names_what_would_pass():
    rc, out, _ = run_cli(["explain", "--family", "dispatch", "--target", "sm_90", "--dtype", "bf16", "--quant",
                          "fp8_blockwise"])
    assert rc == 1 and "rejected by rule 'quant_fp8_wire'" in out
    assert out.rstrip().endswith("\n  would pass: --wire fp8_e4m3fn")
    rc, out, _ = run_cli(["explain", "--family", "dispatch", "--target", "sm_90", "--dtype", "bf16", "--quant",
                          "fp8_blockwise", "--wire", "fp8_e4m3fn"])  # the flag it named: a variant
    assert rc == 0 and out.startswith("sm_90/dispatch.bf16.fp8_e4m3fn.fp8_blockwise.intranode: variant")
    rc, out, _ = run_cli(["explain", "--family", "quantize_fp8", "--target", "gfx942", "--wire", "fp8_e4m3fn"])
    assert rc == 1 and "--wire fp8_e4m3fnuz" in out.splitlines()[-1] and "--target gfx950" in out.splitlines()[-1]
    rc, out, _ = run_cli(["explain", "gfx942/quantize_fp8.bf16.fp8_e4m3fn.fp8_blockwise"])
    assert rc == 1 and "gfx942/quantize_fp8.bf16.fp8_e4m3fnuz.fp8_blockwise" in out.splitlines()[-1]


def test_a_cached_verdict_without_a_disassembler_says_whose_it_is(monkeypatch, tmp_path):
    """With no disassembler here, a cached entry's ISA verdict is its record's: the build says so and names the
    toolchain the record names (an older record without one: the compiler, the disassembler not recorded)."""
    import json

    import attrs

    from generator import build as B

    argv = ["build", "--arch", "gfx950", "--only", "dequantize_fp4.bf16.*", "--cache-dir", str(tmp_path / "c"),
            "--out", str(tmp_path / "g")]
    rc, out, err = run_cli(argv)
    assert rc == 0 and "(record)" not in out and "no disassembler here" not in err
    real = toolchain.find
    monkeypatch.setattr(B.toolchain, "find", lambda tc: attrs.evolve(real(tc), disassembler=None, missing="none"))
    dis = Path(real(S.load().toolchains["amd"]).disassembler).name
    rc, out, err = run_cli(argv)
    assert rc == 0 and "cached, verified (the cached record's verdict, by " in err and f", {dis}: no disassembler" in err
    assert "yes (record)" in out and "by the cached record's verdict only" in out and "cached, verified (" not in out
    for rec in (tmp_path / "c" / "gfx950").glob("*.json"):  # a record written before verdicts named their toolchain
        data = json.loads(rec.read_text())
        data["verified"] = {k: {"ok": r["ok"], "message": r["message"]} for k, r in data["verified"].items()}
        rec.write_text(json.dumps(data))
    rc, out, err = run_cli(argv)
    assert rc == 0 and "cached, verified" in err and "the disassembler not recorded: no disassembler here" in err
    from generator.cache import valid_record

    rec = json.loads(next((tmp_path / "c" / "gfx950").glob("*.json")).read_text())
    for toolchain_text, ok in (("clang 22, llvm-objdump", True), ("two\nlines", False), ("\x1b[2J", False),
                               ("x" * 501, False), (7, False)):
        rec["verified"] = {"k": {"ok": True, "message": "", "toolchain": toolchain_text}}
        assert valid_record(rec) is ok, toolchain_text  # what a terminal shows: one printable line


def test_an_expert_id_error_shows_the_product_that_made_num_experts():
    """256 experts over 3 ranks at 256 // 3 per rank: the id error shows the truncation (issue 39, item 3)."""
    from runtime import EpDispatchCombineConfig

    cfg = EpDispatchCombineConfig(rank=0, world_size=3, hidden_dim=64, max_num_inp_token_per_rank=8,
                                  num_experts_per_rank=256 // 3, num_experts_per_token=8, kernel_backend="torch")
    assert cfg.expert_id_bound() == ("num_experts=255 (world_size × num_experts_per_rank = 3 × 85 = 255; valid ids: "
                                     "0..254, negative = no expert)")


def test_a_missing_numpy_is_one_line_naming_the_fix():
    """torch imports without numpy (it only warns), but the op's config agreement needs it: `import runtime` says so
    in one line, `epgen bench` too, and `epgen doctor` lists it (issue 39: the wheel installed without [runtime])."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    fix = "pip install 'epgen[runtime]'"

    def run(code):
        return subprocess.run([sys.executable, "-W", "ignore", "-c", f"import sys; sys.modules['numpy'] = None; {code}"],
                              env=env, capture_output=True, text=True, timeout=120)

    r = run("import runtime")
    assert r.returncode == 1 and r.stderr.splitlines()[-1] == (
        f"ImportError: epgen's runtime needs numpy (torch.distributed's object collectives, which every op's "
        f"construction uses), and it is not installed: {fix} (README: Install)"), r.stderr
    r = run("import epgen; sys.exit(epgen.main(['bench']))")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "needs numpy" in r.stderr, r.stderr
    assert r.stderr.count(fix) == 1, r.stderr
    r = run("import epgen; sys.exit(epgen.main(['doctor']))")
    assert f"  runtime    needs numpy: {fix} (README: Install)\n" in r.stdout, r.stdout
    assert f"numpy      not installed (the runtime needs it: {fix})\n" in r.stdout, r.stdout
    import numpy

    _, out, _ = run_cli(["doctor"], epgen.main)

    assert f"numpy      {numpy.__version__}\n" in out
