"""Every command README.md and docs/ show (```bash blocks and inline `code` that starts with a command) runs as
written: the cheap ones are run (pip wheel, the generator's list / explain / check / --help, epgen doctor), the
others have their flags checked against the parser or script they name (the generator's and bench's argparse
parsers, the scripts' and examples' own flags and environment variables, pip's extras in pyproject.toml)."""

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

ROOT = Path(__file__).resolve().parent.parent
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
    else:
        raise AssertionError(f"python -m {module}: not a module this project documents")


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
        work = Path(_tmp()) / f"wheel{len(WHEELS)}"
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True).stdout.split("\0")
        for f in filter(None, files):
            if (ROOT / f).is_file() and not f.startswith(("generated/", "results/")):
                (work / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / f, work / f)
        r = subprocess.run([sys.executable, "-m", "pip", *argv, "-q"], cwd=work, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, f"pip {key}: {r.stderr[-2000:]}"
        out = argv[argv.index("-w") + 1] if "-w" in argv else "."
        WHEELS[key] = sorted(Path(p).name for p in glob.glob(str(work / out / "*.whl")))
    assert len(WHEELS[key]) == 1 and WHEELS[key][0].startswith("epgen-"), f"pip {key} made {WHEELS[key]}"


_TMP: list[str] = []


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


def test_the_docs_show_commands():
    cmds = [c for _, c in all_commands()]
    assert any("pip wheel" in c for c in cmds) and any("-m generator build" in c for c in cmds)
    assert any(c.startswith("torchrun") and "-m bench" in c for c in cmds)


@pytest.mark.parametrize("doc,cmd", all_commands(), ids=lambda v: v if "/" not in v or " " in v else v)
def test_documented_command_runs_as_written(doc, cmd):
    check(cmd)


def test_the_checker_rejects_what_does_not_exist():
    for bad in ("python -m generator build --arch gfx950 --profiles all", "python -m bench --layer-looop",
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
