"""epgen: one command for the project's tools.

  epgen build | list | explain | check ...   the generator (python -m generator ...)
  epgen bench ...                            the benchmark (python -m bench ...): torchrun, GPUs
  epgen tune ...                             the launch-geometry tuner (python -m bench.tune ...): torchrun, GPUs
  epgen doctor                               where epgen's packages, specs, cache and tools come from
  epgen --version                            epgen's version

`epgen COMMAND --help` describes each. epgen's Python packages are the top-level `generator`, `runtime` and
`bench`; this command first checks that those Python finds are epgen's (README "Package names").
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

GENERATOR_COMMANDS = ("build", "list", "explain", "check")
BENCH_COMMANDS = {"bench": "bench.cli", "tune": "bench.tune"}


def _clash(names: tuple[str, ...]) -> str | None:
    """Why one of epgen's top-level packages Python imports is someone else's, or None."""
    import generator

    if getattr(generator, "__epgen__", None) != "generator":
        where = getattr(generator, "__file__", None) or "a namespace package"
        return (f"the 'generator' package Python imports, {where}, is not epgen's: a package or folder named "
                f"'generator' comes first on sys.path; run from another folder, or install epgen in a venv of its own")
    return next((why for n in names if n != "generator" and (why := generator.foreign(n))), None)


def _shadowed_here(name: str) -> str | None:
    """Why `name` in the current folder shadows epgen's package for Python run here (python -m, python -c), when
    this process does not import from that folder (the `epgen` script's sys.path starts at its own bin/), or None.
    A copy of epgen's own package (its file carries the `__epgen__` mark) is not foreign."""
    here = Path.cwd().resolve()
    if here in {Path(p or ".").resolve() for p in sys.path}:
        return None  # Python imports from here: _clash and generator.foreign see the same package
    found = next((f for f in (here / name / "__init__.py", here / f"{name}.py") if f.is_file()), None)
    try:
        if found is None or f'__epgen__ = "{name}"' in found.read_text(errors="replace"):
            return None
    except OSError:
        pass  # unreadable: Python run here would fail on it too
    return (f"the '{name}' package Python run in this folder imports (python -m, python -c), {found}, is not epgen's: "
            f"a package or folder named '{name}' here comes first on sys.path; run from another folder, or rename it")


def version() -> str:
    """epgen's version: its generator package's, else the installed distribution's."""
    import generator

    if getattr(generator, "__epgen__", None) == "generator":
        return generator.__version__
    import importlib.metadata

    try:
        return importlib.metadata.version("epgen")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (its 'generator' package is shadowed and no epgen distribution is installed)"


def doctor() -> int:
    """Print where everything epgen uses comes from; 1 when one of its packages is shadowed."""
    import importlib
    import importlib.util

    print(f"epgen {version()} (python {sys.version.split()[0]}, {sys.executable})")
    why = _clash(("generator",)) or _shadowed_here("generator")
    if why:
        print(f"epgen: error: {why}", file=sys.stderr)
        return 2
    from generator import build as gbuild, specs as gspecs, toolchain
    from generator.cache import default_dir

    bad = 0
    for name in ("generator", "runtime", "bench"):
        try:
            why = __import__("generator").foreign(name) or _shadowed_here(name)
        except Exception as e:  # noqa: BLE001 - a package that fails to import: say so, go on
            why = f"'{name}' fails to import: {type(e).__name__}: {e}"
        if why and "epgen[runtime]" in why:
            needs = " and ".join(m for m in ("torch", "numpy") if importlib.util.find_spec(m) is None) or "torch"
            print(f"  {name:<10} needs {needs}: pip install 'epgen[runtime]' (README: Install)")
            continue
        bad += why is not None
        print(f"  {name:<10} {why or importlib.import_module(name).__file__}")
    try:
        specs = gspecs.load()
    except gspecs.SpecError as e:
        print(f"specs: error: {e}")
        return 1
    print(f"specs      {specs.root}{' (installed copy)' if gspecs.is_packaged(specs.root) else ''}")
    print(f"tuning     {' over '.join(map(str, reversed(gspecs.tuning_sources(specs.root))))}")
    print(f"generated  {gbuild.generated_root(specs)}")
    print(f"cache      {default_dir()}")
    for tc in specs.toolchains.values():
        targets = ", ".join(t.name for t in specs.targets.values() if t.toolchain == tc.name)
        try:
            tools = toolchain.find(tc)
            dis = tools.disassembler or f"MISSING: {tools.missing}"
            print(f"toolchain {tc.name} ({targets}): compiler {tools.compiler} ({tools.compiler_version}); "
                  f"disassembler {dis}")
        except toolchain.ToolchainMissing as e:
            print(f"toolchain {tc.name} ({targets}): MISSING: {e}")
    try:
        import numpy
    except ImportError:
        print("numpy      not installed (the runtime needs it: pip install 'epgen[runtime]')")
    else:
        print(f"numpy      {numpy.__version__}")
    try:
        import torch
    except ImportError:
        print("torch      not installed (the runtime and bench need it: pip install 'epgen[runtime]')")
    else:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"torch      {torch.__version__}: {gpus} GPU(s)" + ("" if gpus else
              " (the torch backend runs on CPU / gloo; bench and tune need GPUs)"))
    beside = Path(sys.executable).with_name("torchrun")  # this interpreter's (a venv's), else PATH's
    print(f"torchrun   {beside if beside.is_file() else shutil.which('torchrun') or 'not found'}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    cmd = argv[0]
    if cmd == "--version":
        print(f"epgen {version()}")
        return 0
    if cmd == "doctor":
        return doctor()
    if cmd in BENCH_COMMANDS:
        why = _clash(("generator", "runtime", "bench"))
    elif cmd in GENERATOR_COMMANDS or cmd.startswith("--specs"):
        why = _clash(("generator",))
    else:
        print(f"epgen: error: unknown command {cmd!r} (known: {', '.join(GENERATOR_COMMANDS + tuple(BENCH_COMMANDS))}, "
              f"doctor; epgen --help)", file=sys.stderr)
        return 2
    if why:
        print(f"epgen: error: {why}", file=sys.stderr)
        return 2
    if cmd in BENCH_COMMANDS:
        import importlib

        return importlib.import_module(BENCH_COMMANDS[cmd]).main(argv[1:], prog=f"epgen {cmd}")
    from generator.cli import main as generator_main

    return generator_main(argv, prog="epgen")
