"""Issue 26 (trust, round two), build-cache part: a cache entry that is not what the writer makes is
rebuilt, never read without bound, never waited on, never a crash; a failing disassembler is no
verdict; the compiler gets exactly the bytes the key hashed; a full disk leaves nothing partial.

Every test here failed on 7b1a81d.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from generator import build as B
from generator import cache as C
from generator import render, toolchain
from generator.model import enumerate_variants

ROOT = Path(__file__).resolve().parents[2]
OTHER = "quantize_fp8.bf16.fp8_e4m3fn.fp8_blockwise"


@pytest.fixture
def tools(variant):
    return toolchain.find(variant.toolchain)


@pytest.fixture
def built(variant, source, tools, tmp_path):
    """(cache root, the entry, the good artifact's bytes) after one clean build."""
    cache = tmp_path / "cache"
    res = B.compile_variant(variant, source, cache, tools)
    assert res.ok and res.status == "compiled", (res.status, res.message)
    entry = C.Entry.of(cache, variant, C.cache_key(variant, tools, render.sha256(source.read_bytes())))
    return cache, entry, entry.artifact.read_bytes()


def _rebuilt(variant, source, tools, cache, entry, good: bytes, timeout: float = 120) -> None:
    """The next build rebuilds the entry (in time) and leaves a good, regular one."""
    out = []
    t = threading.Thread(target=lambda: out.append(B.compile_variant(variant, source, cache, tools)), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the build hangs on the entry"
    (res,) = out
    assert (res.status, res.verified) == ("compiled", True), (res.status, res.message)
    for p in (entry.artifact, entry.record):
        assert p.is_file() and not p.is_symlink()
    assert entry.artifact.read_bytes() == good
    assert C.valid_record(json.loads(entry.record.read_text()))
    again = B.compile_variant(variant, source, cache, tools)
    assert (again.status, again.verified) == ("cached", True), (again.status, again.message)


# ---------------------------------------------------------------------------------------------
# 7, 8: only regular files are read, within a size limit, without blocking
# ---------------------------------------------------------------------------------------------
def test_artifact_linked_to_dev_zero_is_rebuilt(variant, source, tools, built):
    cache, entry, good = built
    entry.artifact.unlink()
    entry.artifact.symlink_to("/dev/zero")
    _rebuilt(variant, source, tools, cache, entry, good)


def test_record_that_is_a_fifo_is_rebuilt_without_hanging(variant, source, tools, built):
    cache, entry, good = built
    entry.record.unlink()
    os.mkfifo(entry.record)
    _rebuilt(variant, source, tools, cache, entry, good)


def test_oversized_record_is_not_read(variant, source, tools, built):
    cache, entry, good = built
    rec = json.loads(entry.record.read_text())
    rec["padding"] = "x" * (C.MAX_RECORD + 1)
    entry.record.write_text(json.dumps(rec))
    _rebuilt(variant, source, tools, cache, entry, good)


def test_read_regular_bounds():
    assert C.read_regular(Path("/dev/zero"), 10) is None  # not a regular file
    assert C.read_regular(Path("/nonexistent/x"), 10) is None


# ---------------------------------------------------------------------------------------------
# 9: a malformed record (its hash matching) or a directory in the entry's place is rebuilt
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("verified", [[], None, {"k": 5}, {"k": {"ok": True}}, {"k": {"ok": "yes", "message": ""}},
                                      "deep", "missing", "sha_list"])
def test_malformed_record_is_rebuilt(variant, source, tools, built, verified):
    cache, entry, good = built
    rec = json.loads(entry.record.read_text())
    if verified == "deep":
        entry.record.write_text('{"sha256": "%s", "verified": %s%s}' % (rec["sha256"], "[" * 100_000, "]" * 100_000))
    else:
        if verified == "missing":
            del rec["verified"]
        elif verified == "sha_list":
            rec["sha256"] = [rec["sha256"]]
        else:
            rec["verified"] = verified
        entry.record.write_text(json.dumps(rec))
    _rebuilt(variant, source, tools, cache, entry, good)


@pytest.mark.parametrize("which", ["record", "artifact"])
def test_directory_in_place_of_a_file_is_rebuilt(variant, source, tools, built, which):
    cache, entry, good = built
    p = getattr(entry, which)
    p.unlink()
    (p / "sub").mkdir(parents=True)
    (p / "sub" / "f").write_text("x")
    _rebuilt(variant, source, tools, cache, entry, good)


# ---------------------------------------------------------------------------------------------
# 10: a failure of the disassembler is not a verdict: it is retried
# ---------------------------------------------------------------------------------------------
def test_disassembler_killed_once_is_retried(variant, source, tools, tmp_path):
    marker = tmp_path / "killed-once"
    fake = tmp_path / "fake-objdump"
    fake.write_text(f"#!/bin/sh\nif [ ! -e {marker} ]; then : > {marker}; kill -9 $$; fi\nexec {tools.disassembler} \"$@\"\n")
    fake.chmod(0o755)
    flaky = toolchain.Tools(tools.compiler, tools.compiler_version, str(fake), tools.env)
    cache = tmp_path / "cache"
    first = B.compile_variant(variant, source, cache, flaky)
    assert (first.status, first.verified) == ("compiled", False)
    assert first.message == "disassembler failed (killed by signal 9)", first.message
    second = B.compile_variant(variant, source, cache, flaky)
    assert (second.status, second.verified) == ("cached", True), (second.status, second.message)
    assert second.message.endswith("expected instruction(s) found") or second.message == "no ISA expectation"
    assert json.loads(second.artifact.with_suffix(".json").read_text())["verified"]  # the verdict, recorded now


# ---------------------------------------------------------------------------------------------
# 11: the compiler compiles exactly the bytes the key hashed
# ---------------------------------------------------------------------------------------------
def test_source_rewritten_during_the_build_cannot_poison_the_entry(specs, variant, source, tools, tmp_path, monkeypatch):
    (other,), _ = enumerate_variants(specs, ["gfx950"], "all", OTHER)
    clean = B.compile_variant(variant, source, tmp_path / "clean", tools)
    assert clean.ok, clean.message
    good = clean.artifact.read_bytes()
    real = toolchain.run

    def racing(cmd, tools, *args, **kwargs):
        if "-o" in cmd:  # the compile: a concurrent render of other specs rewrites the source just now
            source.write_text(render.render(other).replace(other.symbol, variant.symbol))
        return real(cmd, tools, *args, **kwargs)

    monkeypatch.setattr(toolchain, "run", racing)
    code = source.read_bytes()
    res = B.compile_variant(variant, source, tmp_path / "cache", tools)
    assert res.ok, res.message
    assert res.artifact.read_bytes() == good  # the object of the bytes hashed, not of the rewritten file
    assert res.artifact.name.endswith(f"-{C.cache_key(variant, tools, render.sha256(code))[:20]}.hsaco")


def test_compile_errors_name_the_source_not_the_private_copy(variant, tools, tmp_path):
    src = tmp_path / variant.file
    src.write_text(render.render(variant) + "\nthis is not C++;\n")
    res = B.compile_variant(variant, src, tmp_path / "cache", tools)
    assert res.status == "failed" and str(src) in res.message, res.message
    assert not [p for p in (tmp_path / "cache" / "gfx950").iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------------------------------------
# 12: a full filesystem under --out: one line, nothing partial left, and check is not fooled
# ---------------------------------------------------------------------------------------------
def _small_files():
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))  # writes past 20 kB fail (EFBIG), like a full disk


def test_full_filesystem_leaves_nothing_partial(tmp_path):
    out = tmp_path / "gen"
    cmd = [sys.executable, "-m", "generator", "build", "--arch", "gfx950", "--no-compile", "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, preexec_fn=_small_files, timeout=600)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"error: cannot write '{out / 'gfx950'}/") and r.stderr.endswith(": File too large\n")
    assert not [p for p in (out / "gfx950").iterdir() if p.name.startswith(".")]
    check = subprocess.run([sys.executable, "-m", "generator", "check", "--arch", "gfx950", "--out", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert check.returncode == 1 and "not fresh" in check.stdout


def test_a_killed_writers_temporary_file_is_stale(specs, tmp_path):
    out = tmp_path / "gen"
    B.write_target(specs, "gfx950", out)
    assert B.freshness(specs, "gfx950", out) == []
    left = out / "gfx950" / ".manifest.json.999999999.tmp"  # no such pid
    left.write_text("partial")
    live = out / "gfx950" / f".manifest.json.{os.getpid()}.tmp"  # a live writer's: not ours to remove
    live.write_text("in flight")
    assert B.freshness(specs, "gfx950", out) == [f"stale {left}"]
    B.write_target(specs, "gfx950", out)
    assert not left.exists() and live.exists()


def test_write_error_removes_the_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "a.cu"

    def full(self, data):
        with open(self, "wb") as f:
            f.write(data[:3])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(render.WriteError, match=rf"^cannot write '{target}': No space left on device$"):
        render.write_if_changed(target, "int x;\n", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_hash_of_what_is_compiled(variant, source, tools, tmp_path):
    """The record's source hash is the hash of the bytes read (once) for the key."""
    res = B.compile_variant(variant, source, tmp_path / "cache", tools)
    rec = json.loads(res.artifact.with_suffix(".json").read_text())
    assert rec["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
