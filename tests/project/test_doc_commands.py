"""Every command README.md and docs/ show (```bash blocks and inline `code` that starts with a command) works as
written. Each case says what it does with its command (plan()):

* run: executed as written, and its exit status checked: every command that needs no GPU and finishes in a
  reasonable time on a small CPU machine (the generator's list / explain / check / build / --help, epgen doctor,
  pip wheel, the CPU run of examples/moe_layer.py on 2 gloo ranks, the scripts that turn committed records into
  tables and plots). Outputs that would land in the checkout go to temporary folders.
* parsed: its flags checked against the parser or script it names (the generator's and bench's argparse
  parsers, the scripts' and examples' own flags and environment variables, pip's extras in pyproject.toml,
  what .ci/run installs), with the reason it is not run: it needs a GPU, installs onto the machine, runs the
  whole suite, names a placeholder, or reads a GPU run's output that is not committed.
"""

from __future__ import annotations

import contextlib
import glob
import io
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STARTS = ("python ", "python3 ", "torchrun ", "pip ", "bash ", "epgen ", "apt-get ", "scripts/")
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
PLACEHOLDER_SCRIPTS = {"your_script.py", "ep_example.py", "moe_example.py"}  # the reader's own script (README: save the block as ...)
GENERATOR_RUN = ("list", "explain", "check")  # cheap: run them, not only parse them


def _commands_of(text: str) -> list[str]:
    out = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.S | re.M):
        if lang in ("bash", "sh", "shell"):
            for line in body.splitlines():
                line = re.sub(r"\s+#\s.*$", "", line).strip()
                if line and not line.startswith("#"):
                    out += [part.strip() for part in line.split("&&")]
    prose = re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)
    for span in re.findall(r"`([^`\n]+)`", prose):
        words = span.split()
        while words and ENV.match(words[0]):
            words = words[1:]
        if len(words) > 1 and (" ".join(words) + " ").startswith(STARTS):
            out += [part.strip() for part in span.split("&&")]
    return out


def all_commands() -> list[tuple[str, str]]:
    return [(doc.relative_to(ROOT).as_posix(), cmd) for doc in DOCS for cmd in _commands_of(doc.read_text())]


def _parses(parser, argv: list[str]) -> None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as e:
        assert e.code == 0, f"{argv}: {err.getvalue().strip().splitlines()[-1]}"


def _script_flags_exist(script: str, argv: list[str], env: list[str]) -> None:
    path = ROOT / script
    assert path.is_file(), f"{script}: no such file"
    source = path.read_text()
    for flag in (a.split("=")[0] for a in argv if a.startswith("--")):
        assert f'"{flag}"' in source or f"'{flag}'" in source or re.search(rf"\s{re.escape(flag)}\b", source) and \
            path.suffix == ".sh", f"{script} has no option {flag}"
    for name in env:
        assert re.search(rf"\b{name}\b", source), f"{script} does not read ${name}"


def _generator(argv: list[str]) -> None:
    from generator import cli

    if not argv or argv[0] not in GENERATOR_RUN or "--help" in argv:
        _parses(cli.parser(), argv)
        return
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli.main(argv)
    assert rc == 0, f"python -m generator {' '.join(argv)}: exit {rc}\n{out.getvalue()[-2000:]}"


def _bench(module: str, argv: list[str]) -> None:
    if module == "bench.tune":
        from bench import tune

        _parses(tune.build_parser(), argv)
    else:
        from bench import cli

        _parses(cli.build_parser(), argv)


def _python_module(module: str, argv: list[str]) -> None:
    if module == "generator":
        _generator(argv)
    elif module in ("bench", "bench.tune"):
        _bench(module, argv)
    elif module == "epgen":
        _epgen(argv)
    elif module == "pip":
        _pip(argv)
    elif module == "pytest":
        markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
        for i, arg in enumerate(argv):
            if arg == "-m":
                assert any(m.startswith(argv[i + 1] + ":") for m in markers), f"no pytest marker {argv[i + 1]!r}"
            elif not arg.startswith("-") and argv[i - 1] != "-m":
                assert (ROOT / arg.split("::")[0]).exists(), f"pytest {arg}: no such test file"
    elif module == "torchtitan.train":
        _torchtitan_train(argv)
    else:
        raise AssertionError(f"python -m {module}: not a module this project documents")


def _torchtitan_train(argv: list[str]) -> None:
    """torchtitan's trainer with epgen's dispatcher (docs/TORCHTITAN.md): --module / --config given, and every
    --override.imports target (``module.function``, kwargs as JSON after ``=``) an @override factory of
    runtime/integrations/torchtitan.py taking those kwargs (read from its source: torchtitan need not be installed)."""
    import ast
    import json

    assert "--module" in argv and "--config" in argv, f"torchtitan.train {argv}: --module and --config are required"
    src = ROOT / "runtime" / "integrations" / "torchtitan.py"
    factories = {node.name: {a.arg for a in node.args.args + node.args.kwonlyargs}
                 for node in ast.parse(src.read_text()).body if isinstance(node, ast.FunctionDef)
                 and any(isinstance(d, ast.Call) and getattr(d.func, "id", "") == "override"
                         for d in node.decorator_list)}
    targets = argv[argv.index("--override.imports") + 1:]
    targets = targets[:next((i for i, a in enumerate(targets) if a.startswith("--")), len(targets))]
    assert targets, f"torchtitan.train {argv}: no --override.imports target"
    entries = [e for t in targets for e in ([t] if "=" in t else t.split(","))]  # torchtitan's parse_cli_imports
    for token in entries:
        target, _, kwargs = token.partition("=")
        module, _, func = target.rpartition(".")
        assert module == "runtime.integrations.torchtitan" and func in factories, \
            f"--override.imports {target}: not an @override of runtime/integrations/torchtitan.py ({sorted(factories)})"
        unknown = set(json.loads(kwargs) if kwargs else {}) - factories[func]
        assert not unknown, f"--override.imports {target}: {func} takes no {sorted(unknown)}"


def _epgen(argv: list[str]) -> None:
    import epgen

    if argv and argv[0] in epgen.BENCH_COMMANDS:
        _bench(epgen.BENCH_COMMANDS[argv[0]].replace(".cli", ""), argv[1:])
    elif argv == ["--version"]:
        with contextlib.redirect_stdout(io.StringIO()):
            assert epgen.main(argv) == 0
    elif argv == ["doctor"]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert epgen.doctor() == 0, out.getvalue()
    else:
        _generator(argv)


def _extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _pip(argv: list[str]) -> None:
    if argv[0] == "wheel":
        _pip_wheel(argv)
        return
    if argv[0] == "download":  # wheels for a machine without an index: exact pins or names, into a folder
        assert "--no-deps" in argv and "-d" in argv, f"pip {' '.join(argv)}: download with --no-deps -d FOLDER"
        return
    assert argv[0] == "install", f"pip {argv[0]}: not documented here"
    for arg in argv[1:]:
        m = re.fullmatch(r"\.\[([\w,]+)\]|[^\s\[]+\.whl\[([\w,]+)\]|\$\(ls [^\s)]*epgen-\*\.whl\)\[([\w,]+)\]", arg)
        assert m or not arg.endswith((".whl", "]")), f"pip install {arg}: not a form this test knows"
        for extra in next(g for g in m.groups() if g).split(",") if m else ():
            assert extra in _extras(), f"pip install {arg}: pyproject.toml has no extra {extra!r}"


WHEELS: dict[str, list[str]] = {}


def _pip_wheel(argv: list[str]) -> None:
    """Run it, as written, in a copy of the checkout's tracked files: exactly epgen's wheel lands in its -w folder."""
    key = " ".join(argv)
    if key not in WHEELS:
        work = _tracked_copy(f"wheel{len(WHEELS)}", skip=("generated/", "results/"))
        r = subprocess.run([sys.executable, "-m", "pip", *argv, "-q"], cwd=work, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, f"pip {key}: {r.stderr[-2000:]}"
        out = argv[argv.index("-w") + 1] if "-w" in argv else "."
        WHEELS[key] = sorted(Path(p).name for p in glob.glob(str(work / out / "*.whl")))
    assert len(WHEELS[key]) == 1 and WHEELS[key][0].startswith("epgen-"), f"pip {key} made {WHEELS[key]}"


def _build(argv: list[str]) -> None:
    """The build as written, its sources and code objects in temporary folders (not the checkout's generated/)."""
    from generator import build

    if not any(shutil.which(c) for c in ("clang++-22", "clang++-21", "clang++-20", "clang++", "hipcc")):
        pytest.skip("no clang: the build would only render (CI installs clang-22)")
    out = Path(_tmp()) / f"build{len(_RAN)}"
    env = {build.GENERATED_ENV: str(out / "generated"), "EPGEN_CACHE_DIR": str(out / "cache")}
    _run([sys.executable, "-m", "generator", *argv], env=env)


def _run(argv: list[str], cwd: Path = ROOT, env: dict | None = None) -> str:
    """Run a command of the docs (once, however many docs show it); this checkout's packages first on the path
    (not an installed copy)."""
    import os

    key = " ".join(argv[1:])
    if key in _RAN:
        return _RAN[key]
    full = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                    os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(argv, cwd=cwd, env=full, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(argv)}: exit {r.returncode}\n{(r.stdout + r.stderr)[-3000:]}"
    _RAN[key] = r.stdout
    return r.stdout


def _tracked_copy(name: str, skip: tuple[str, ...] = ("generated/",)) -> Path:
    """A copy of the checkout's tracked files but those under `skip`, for a command that writes into it."""
    work = Path(_tmp()) / name
    if not work.exists():
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True).stdout.split("\0")
        for f in filter(None, files):
            if (ROOT / f).is_file() and not f.startswith(skip):
                (work / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / f, work / f)
    return work


_TMP: list[str] = []
_RAN: dict[str, str] = {}  # command -> its output


def _tmp() -> str:
    if not _TMP:
        import tempfile

        _TMP.append(tempfile.mkdtemp(prefix="epgen-doc-commands-"))
    return _TMP[0]


def check(cmd: str) -> None:
    words = shlex.split(cmd)
    env = []
    while words and ENV.match(words[0]):
        env.append(words.pop(0).split("=")[0])
    head, argv = words[0], words[1:]
    if head in ("python", "python3"):
        if argv[0] == "-m":
            _python_module(argv[1], argv[2:])
        else:
            _script_flags_exist(argv[0], argv[1:], env)
    elif head == "torchrun":
        i = 0
        while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
            i += 1 if "=" in argv[i] or argv[i] == "--standalone" else 2
        assert i < len(argv), f"{cmd}: torchrun without a script or -m module"
        if argv[i] == "-m":
            _python_module(argv[i + 1], argv[i + 2:])
        elif argv[i] not in PLACEHOLDER_SCRIPTS:
            _script_flags_exist(argv[i], argv[i + 1:], env)
    elif head == "pip":
        _pip(argv)
    elif head == "bash":
        _script_flags_exist(argv[0], argv[1:], env)
    elif head == "epgen":
        _epgen(argv)
    elif head.startswith("scripts/"):
        _script_flags_exist(head, argv, env)
    elif head == "apt-get":
        ci = (ROOT / ".ci" / "run").read_text()
        assert argv[0] in ("update", "install"), cmd
        assert all(p in ci for p in argv[1:] if not p.startswith("-")), f"{cmd}: not what .ci/run installs"
    else:
        raise AssertionError(f"{cmd!r}: a command this test does not know how to check")


GPU_SCRIPTS = ("scripts/device_run.sh", "scripts/host_profile.py", "scripts/grouped_time.py")
RECORD_SCRIPTS = ("scripts/layer_table.py", "scripts/sweep_table.py", "scripts/grouped_profile_table.py",
                  "scripts/plot_bench.py")  # records -> tables and plots
WRITES_RESULTS = ("scripts/plot_bench.py",)  # writes a .png beside its records: run in a copy
CPU_SCRIPTS = ("scripts/memory_table.py",  # tables computed from the specs and the plan: no GPU, no records
               "scripts/host_cost.py",  # the eager legs' host side over stand-ins for the device
               "scripts/load_use.py")  # the EP kernels' sm_90 SASS, built and disassembled here (as tests/generator)


def plan(cmd: str):
    """-> ("run", runner or None: check() itself runs it) or ("parsed", why it is not run)."""
    words = shlex.split(cmd)
    while words and ENV.match(words[0]):
        words.pop(0)
    head, argv = words[0], words[1:]
    if head in ("python", "python3") and argv[:2] == ["-m", "pip"]:
        head, argv = "pip", argv[2:]
    if head == "apt-get":
        return "parsed", "installs system packages"
    if head == "pip":
        return ("run", None) if argv[0] == "wheel" else ("parsed", "installs into the Python environment")
    if head in ("python", "python3") and argv[0] == "-m" and argv[1] == "generator" or head == "epgen":
        sub = argv[2:] if head != "epgen" else argv
        if sub[:1] in (["bench"], ["tune"]):
            return "parsed", "needs a GPU"
        return ("run", lambda: _build(sub)) if sub[:1] == ["build"] else ("run", None)
    script = argv[0] if head in ("python", "python3", "bash") else head
    if head == "torchrun":
        i = 0
        while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
            i += 1 if "=" in argv[i] or argv[i] == "--standalone" else 2
        nproc = argv[argv.index("--nproc-per-node") + 1]
        script, rest = (f"-m {argv[i + 1]}", argv[i + 2:]) if argv[i] == "-m" else (argv[i], argv[i + 1:])
        if not nproc.isdigit() or "--nnodes" in argv:
            return "parsed", "a placeholder for the ranks"
        if script in PLACEHOLDER_SCRIPTS:
            return "parsed", "the reader's own script"
        if script == "examples/moe_layer.py" and "--hidden" in rest or script == "examples/train_moe.py" and \
                "--dtype" not in rest:  # the CPU runs (the GPU ones pick bf16)
            # on a free port of its own (torchrun reads PET_MASTER_PORT as --master-port): the default 29500 of an
            # earlier run (or of another process on the machine) was still taken once, failing a run in the suite
            return "run", lambda: _run([sys.executable, "-m", "torch.distributed.run", *argv],
                                       env={"PET_MASTER_PORT": str(free_port())})
        return "parsed", "needs a GPU"
    if script == "scripts/test.sh":
        return "parsed", "the whole test suite (CI runs it)"
    if head == "python3" and argv[0] == "-m" or head == "python" and argv[0] == "-m" or script in GPU_SCRIPTS:
        return "parsed", "needs a GPU"
    if script in CPU_SCRIPTS:
        return "run", lambda: _run([sys.executable, *argv])
    if script in RECORD_SCRIPTS:
        missing = [a for a in argv[1:] if a.endswith(".jsonl") and not (ROOT / a).is_file()]
        if missing:
            return "parsed", f"reads a GPU run's output, not committed ({missing[0]})"
        writes = script in WRITES_RESULTS
        return "run", lambda: _run([sys.executable, *argv], cwd=_tracked_copy("records") if writes else ROOT)
    raise AssertionError(f"{cmd!r}: neither run nor parsed: say which in plan()")


CASES = [(doc, cmd, *plan(cmd)) for doc, cmd in all_commands()]
RUN = [(doc, cmd, runner) for doc, cmd, kind, runner in CASES if kind == "run"]
PARSED = [(doc, cmd, why) for doc, cmd, kind, why in CASES if kind == "parsed"]


def test_the_docs_show_commands():
    cmds = [c for _, c in all_commands()]
    assert any("pip wheel" in c for c in cmds) and any("-m generator build" in c for c in cmds)
    assert any(c.startswith("torchrun") and "-m bench" in c for c in cmds)


@pytest.mark.parametrize("doc,cmd,runner", RUN, ids=[f"run: {d}: {c}" for d, c, _ in RUN])
def test_documented_command_runs_as_written(doc, cmd, runner):
    check(cmd)  # its flags; the generator's cheap commands, epgen doctor and pip wheel run here
    if runner is not None:
        runner()


@pytest.mark.parametrize("doc,cmd,why", PARSED, ids=[f"parsed ({w}): {d}: {c}" for d, c, w in PARSED])
def test_documented_command_parses(doc, cmd, why):
    check(cmd)


def test_every_command_that_needs_no_gpu_is_run():
    ran = {c for _, c, _ in RUN}
    for cmd in ("python3 -m generator build --arch gfx950", "epgen doctor", "pip wheel --no-deps -w dist .",
                "torchrun --nproc-per-node 2 examples/moe_layer.py --hidden 512 --experts 16 --intermediate 128",
                "torchrun --nproc-per-node 2 examples/train_moe.py --steps 10",
                "python scripts/sweep_table.py", "python scripts/plot_bench.py",
                "python scripts/layer_table.py results/2026-12-01-2xH200-7b1a81d/layer.jsonl"):
        assert cmd in ran, f"{cmd}: documented, needs no GPU, and is not run"
    assert all(why for _, _, why in PARSED)


def test_the_checker_rejects_what_does_not_exist():
    for bad in ("python -m generator build --arch gfx950 --profiles all", "python -m bench --layer-looop",
                "torchrun --nproc-per-node 2 -m torchtitan.train --module m --config c --override.imports runtime.x.f",
                "torchrun --nproc-per-node 2 -m torchtitan.train --module m --config c --override.imports "
                "'runtime.integrations.torchtitan.epgen_dispatcher={\"nope\": 1}'",
                "pip install '.[cuda]'", 'pip install "$(ls dist/epgen-*.whl)[cuda]"', "python scripts/layer_table.py --nope",
                "bash scripts/nothing.sh",
                "python -m generator explain gfx950/no_such_variant", "torchrun --nproc-per-node 2 -m bench.tune --writ"):
        with pytest.raises(AssertionError):
            check(bad)


@pytest.mark.parametrize("doc", [d.relative_to(ROOT).as_posix() for d in DOCS])
def test_python_snippets_compile_and_select_the_device_before_nccl(doc):
    for block in re.findall(r"^```python\n(.*?)^```$", (ROOT / doc).read_text(), flags=re.S | re.M):
        compile(block, doc, "exec")
        if "set_device(" in block and 'init_process_group("nccl"' in block:
            assert block.index("set_device(") < block.index('init_process_group("nccl"'), doc
        # one name, one meaning: the world size is not also the router's weights (`w, idx = ...`)
        sizes = set(re.findall(r"world_size=(\w+)\b", block.replace(" ", "")))
        weights = set(re.findall(r"^\s*(\w+), idx\b", block, flags=re.M) + re.findall(r"\.dispatch\(\w+, (\w+),", block))
        assert not sizes & weights, f"{doc}: {sizes & weights} names both the world size and the weights"
