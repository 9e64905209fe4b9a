"""Build cache and generator robustness: concurrent builders, tampered entries, unwritable cache dirs,
spec values as data, C-identifier names, compilers run from argument lists (never a shell).

Each test uses a fresh cache dir and writes generated sources to a temporary tree (a spec copy's
generated/ or ``out_root``), never to the project's generated/. Small ``--only`` globs keep it fast.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

from generator import build as B
from generator import render, toolchain
from generator import specs as S
from generator.cache import file_sha256, usable_dir
from generator.model import enumerate_variants

ROOT = Path(__file__).resolve().parents[2]
ONLY = "quantize_fp8.*"
SMALL = "quantize_fp8.bf16.*"


def cli(spec_root: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "generator", "--specs", str(spec_root), *args]


def entries(cache: Path, variants) -> dict[str, tuple[Path, dict]]:
    """variant key -> (artifact, record); asserts exactly one valid entry per variant, nothing else."""
    out, expected_files = {}, set()
    for v in variants:
        d = cache / v.target.name
        arts = sorted(d.glob(f"{v.name}-*.{v.toolchain.artifact}"))
        recs = sorted(d.glob(f"{v.name}-*.json"))
        assert len(arts) == 1 and len(recs) == 1, (v.key, arts, recs)
        art, rec = arts[0], json.loads(recs[0].read_text())
        assert rec["sha256"] == file_sha256(art), f"{v.key}: recorded sha256 does not match the artifact"
        assert rec["variant"] == v.key and all(r["ok"] for r in rec["verified"].values()), rec
        out[v.key] = (art, rec)
        expected_files |= {art, recs[0], art.with_suffix(".lock")}
    left = {p for p in cache.rglob("*") if p.is_file()} - expected_files
    assert not left, f"leftover files in the cache: {sorted(map(str, left))}"
    return out


# ---------------------------------------------------------------------------------------------
# Concurrency, tampering, unwritable dirs
# ---------------------------------------------------------------------------------------------
def test_concurrent_builders(spec_copy, tmp_path):
    """4 builders of the same variants into one cache: all succeed, each variant compiled exactly once."""
    cache = tmp_path / "cache"
    cmd = cli(spec_copy, "build", "--arch", "gfx950", "--profile", "all", "--only", ONLY, "--cache-dir", str(cache))
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"exit {p.returncode}\n{out}\n{err}"
    variants, _ = enumerate_variants(S.load(spec_copy), ["gfx950"], "all", ONLY)
    assert len(variants) == 4
    entries(cache, variants)
    # the table rows: "<key>  yes  compiled|cached  yes"
    status: dict[str, list[str]] = {v.key: [] for v in variants}
    for out, _ in outs:
        for line in out.splitlines():
            parts = line.split()
            if parts and parts[0] in status:
                assert parts[1] == "yes" and parts[3] == "yes", line
                status[parts[0]].append(parts[2])
    for key, seen in status.items():
        assert sorted(seen) == ["cached"] * 3 + ["compiled"], (key, seen)
    gen = spec_copy.parent / "generated" / "gfx950"
    assert not [p for p in gen.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp")]


@pytest.mark.parametrize("damage", ["artifact_middle", "artifact_truncated", "artifact_missing", "record_garbage",
                                    "record_missing", "record_hash"])
def test_damaged_entry_is_rebuilt(specs, tmp_path, damage):
    kw = dict(only=SMALL, cache_dir=tmp_path / "cache", out_root=tmp_path / "gen")
    first = B.build(specs, ["gfx950"], "all", **kw)
    assert first and {r.status for r in first} == {"compiled"} and all(r.ok for r in first)
    good = {r.variant.key: file_sha256(r.artifact) for r in first}
    victim = first[0]
    art = victim.artifact
    rec = art.with_suffix(".json")
    size = art.stat().st_size
    if damage == "artifact_middle":  # same size, a few bytes flipped in the middle
        data = bytearray(art.read_bytes())
        mid = len(data) // 2
        data[mid:mid + 8] = bytes(b ^ 0xFF for b in data[mid:mid + 8])
        art.write_bytes(bytes(data))
        assert art.stat().st_size == size and file_sha256(art) != good[victim.variant.key]
    elif damage == "artifact_truncated":
        art.write_bytes(art.read_bytes()[:size // 3])
    elif damage == "artifact_missing":
        art.unlink()
    elif damage == "record_garbage":
        rec.write_text('{"sha256": ')
    elif damage == "record_missing":
        rec.unlink()
    elif damage == "record_hash":
        rec.write_text(json.dumps(dict(json.loads(rec.read_text()), sha256="0" * 64)))
    second = B.build(specs, ["gfx950"], "all", **kw)
    by_key = {r.variant.key: r for r in second}
    assert by_key[victim.variant.key].status == "compiled" and by_key[victim.variant.key].ok
    assert {r.status for k, r in by_key.items() if k != victim.variant.key} <= {"cached"}
    assert {k: file_sha256(r.artifact) for k, r in by_key.items()} == good  # the good bytes again
    variants, _ = enumerate_variants(specs, ["gfx950"], "all", SMALL)
    entries(tmp_path / "cache", variants)


def test_builds_are_reproducible(specs, tmp_path):
    """Two fresh caches, same sources: the same bytes (AMD needs a fixed -cuid; nvcc is deterministic)."""
    hashes = []
    for name in ("a", "b"):
        res = B.build(specs, ["gfx950", "sm_90"], "all", only="quantize_fp8.bf16.*direct_cast",
                      cache_dir=tmp_path / name, out_root=tmp_path / "gen")
        assert len(res) == 2 and all(r.ok and r.status == "compiled" for r in res)
        hashes.append({r.variant.key: file_sha256(r.artifact) for r in res})
    assert hashes[0] == hashes[1]


@pytest.mark.parametrize("how", ["parent_is_file", "path_is_file"])
def test_usable_dir_falls_back(tmp_path, monkeypatch, how):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    wanted = blocker / "cache" if how == "parent_is_file" else blocker
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with pytest.warns(UserWarning, match=rf"^cache dir {re.escape(str(wanted))} is not writable \(.+\); using "):
        got = usable_dir(wanted)
    assert got == tmp_path / "tmp" / f"epgen-cache-{os.getuid()}" and got.is_dir()
    assert blocker.read_text() == "not a directory"
    assert usable_dir(tmp_path / "fine") == tmp_path / "fine"  # a writable one is used as is
    assert not list((tmp_path / "fine").iterdir())  # and the write probe is gone


def test_unwritable_cache_build_succeeds(specs, spec_copy, tmp_path, monkeypatch):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    wanted = blocker / "cache"
    fallback = tmp_path / "tmp"
    fallback.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(fallback))
    with pytest.warns(UserWarning, match="is not writable"):
        results = B.build(specs, ["gfx950"], "all", only=SMALL, cache_dir=wanted, out_root=tmp_path / "gen")
    assert results and all(r.ok and r.status == "compiled" for r in results)
    cache = fallback / f"epgen-cache-{os.getuid()}"
    assert all(r.artifact.is_relative_to(cache) for r in results)
    entries(cache, [r.variant for r in results])
    # the CLI: a warning on stderr, exit 0 (TMPDIR points the fallback into this test's tree)
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp2"))
    (tmp_path / "tmp2").mkdir()
    p = subprocess.run(cli(spec_copy, "build", "--arch", "gfx950", "--profile", "all", "--only", SMALL,
                           "--cache-dir", str(wanted)), cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"cache dir {wanted} is not writable" in p.stderr
    assert list((tmp_path / "tmp2" / f"epgen-cache-{os.getuid()}" / "gfx950").glob("*.hsaco"))


# ---------------------------------------------------------------------------------------------
# Specs are data
# ---------------------------------------------------------------------------------------------
EVIL = "__import__('os').system('touch PWNED')"
JINJA = "{{ 7 * 191 }} {% for i in range(3) %}loop{% endfor %} {{ cycler.__init__.__globals__ }}"


def _set_line(path: Path, old: str, new: str) -> int:
    text = path.read_text()
    assert text.count(old) >= 1, old
    path.write_text(text.replace(old, new, 1))
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if new.splitlines()[0] in line)


def test_spec_values_are_never_executed(spec_copy, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _set_line(spec_copy / "kernels.toml",
              'description = "bf16/fp32 rows -> FP8 e4m3, direct cast or per-128 fp32 block scales"',
              f'description = "{EVIL}"')
    _set_line(spec_copy / "targets.toml", 'description = "AMD Instinct MI350/MI355 (CDNA4)"',
              f'description = "{JINJA}"')
    specs = S.load(spec_copy)
    assert specs.families["quantize_fp8"].description == EVIL
    assert specs.targets["gfx950"].description == JINJA
    variants, _ = enumerate_variants(specs, ["gfx950"], "all", SMALL)
    for v in variants:
        text = render.render(v)
        assert f"-- {EVIL}\n" in text and f"({JINJA})" in text  # verbatim, inside the comment lines
        assert "1337" not in text and "looploop" not in text
    results = B.build(specs, ["gfx950"], "all", only=SMALL, cache_dir=tmp_path / "cache")
    assert results and all(r.ok for r in results), [(r.status, r.message) for r in results]
    assert explain_ok(spec_copy)
    for d in (tmp_path, ROOT, spec_copy, spec_copy.parent, Path(tempfile.gettempdir())):
        assert not (d / "PWNED").exists(), d


def explain_ok(spec_root: Path) -> bool:
    from generator.cli import main

    return main(["--specs", str(spec_root), "explain", "gfx950/quantize_fp8.bf16.fp8_e4m3fn.fp8_direct_cast"]) == 0


@pytest.mark.parametrize("value,message", [
    (r"two\nlines", "control characters"),
    (r"x\n__global__ void injected() {}", "control characters"),
    (r"carriage\rreturn", "control characters"),
    ("ends in a backslash \\\\", "must not end with a backslash"),
])
def test_description_cannot_escape_its_comment(spec_copy, value, message):
    """A description is written into a // comment of every generated source: one line, no splice."""
    line = _set_line(spec_copy / "kernels.toml",
                     'description = "bf16/fp32 rows -> FP8 e4m3, direct cast or per-128 fp32 block scales"',
                     f'description = "{value}"')
    with pytest.raises(S.SpecError) as err:
        S.load(spec_copy)
    m = re.match(r"^(.+):(\d+): (.+)$", str(err.value), re.S)
    assert m and m.group(1).endswith("kernels.toml") and int(m.group(2)) == line, str(err.value)
    assert message in m.group(3)


@pytest.mark.parametrize("file,section,old", [
    ("kernels.toml", "family", "quantize_fp8"),
    ("targets.toml", "target", "gfx950"),
    ("dtypes.toml", "dtype", "bf16"),
    ("quant.toml", "quant", "fp8_blockwise"),
])
@pytest.mark.parametrize("bad", ["bad-name", "9lives", "-x"])
def test_names_must_be_c_identifiers(spec_copy, file, section, old, bad):
    path = spec_copy / file
    text = path.read_text()
    assert f"[{section}.{old}]" in text
    path.write_text(text.replace(f"[{section}.{old}]", f"[{section}.{bad}]")
                    .replace(f"[{section}.{old}.", f"[{section}.{bad}."))
    line = next(i for i, s in enumerate(path.read_text().splitlines(), 1) if s.strip() == f"[{section}.{bad}]")
    with pytest.raises(S.SpecError) as err:
        S.load(spec_copy)
    m = re.match(r"^(.+):(\d+): (.+)$", str(err.value))
    assert m, str(err.value)
    assert m.group(1).endswith(file) and int(m.group(2)) == line
    assert m.group(3) == f"name {bad!r} is not a C identifier"


# ---------------------------------------------------------------------------------------------
# Tools run from argument lists
# ---------------------------------------------------------------------------------------------
class _SubprocessSpy(types.ModuleType):
    """Stands in for the subprocess module inside generator.toolchain: records run() and Popen() calls."""

    def __init__(self):
        super().__init__("subprocess")
        self.calls: list[tuple[tuple, dict]] = []

    def __getattr__(self, name):
        return getattr(subprocess, name)

    def run(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return subprocess.run(*args, **kwargs)

    def Popen(self, *args, **kwargs):  # noqa: N802 - the subprocess name
        self.calls.append((args, kwargs))
        return subprocess.Popen(*args, **kwargs)


def test_tools_run_from_argument_lists(specs, tmp_path, monkeypatch):
    spy = _SubprocessSpy()
    monkeypatch.setattr(toolchain, "subprocess", spy)
    toolchain.find.cache_clear()
    toolchain._version.cache_clear()
    try:
        results = B.build(specs, ["gfx950", "sm_90"], "all", only="quantize_fp8.bf16.*direct_cast",
                          cache_dir=tmp_path / "cache", out_root=tmp_path / "gen")
    finally:
        toolchain.find.cache_clear()
        toolchain._version.cache_clear()
    assert {r.variant.target.name for r in results} == {"gfx950", "sm_90"}
    assert all(r.ok and r.status == "compiled" for r in results), [(r.status, r.message) for r in results]
    assert spy.calls
    kinds = set()
    for args, kwargs in spy.calls:
        argv = args[0] if args else kwargs["args"]
        assert type(argv) is list and all(isinstance(a, str) for a in argv), argv
        assert kwargs.get("shell", False) is not True, (argv, kwargs)
        assert Path(argv[0]).is_absolute(), argv  # resolved with shutil.which, not left to a shell's PATH
        kinds.add("version" if argv[1:] == ["--version"] else "compile" if "-o" in argv else "disassemble")
    assert kinds == {"version", "compile", "disassemble"}
    compilers = {Path(args[0][0]).name for args, _ in spy.calls if "-o" in args[0]}
    assert any(c.startswith("nvcc") for c in compilers) and any(c.startswith(("clang", "hipcc", "amdclang")) for c in compilers)


SHELL_CALLS = {("os", "system"), ("os", "popen"), ("os", "execl"), ("os", "execlp"), ("os", "spawnl")}


@pytest.mark.parametrize("package", ["generator", "runtime"])
def test_no_shell_or_eval_in_sources(package):
    """Static check: nothing in the generator or runtime evaluates text or starts a shell."""
    problems = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            if name in ("eval", "exec") and not owner or (owner, name) in SHELL_CALLS:
                problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: {owner + '.' if owner else ''}{name}()")
            for kw in node.keywords:
                if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: shell=...")
    assert not problems, problems
