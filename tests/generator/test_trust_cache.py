"""Issue 16 (trust hardening), cache and runtime part: the fallback cache dir must be ours, the code
object loaded is the one verified, the cache writes only under its root, op.check() waits for the op's
queued work, killed builds leave no compilers or temporary files behind, and the runtime config
rejects sizes no tensor can have.

Every test here failed on f521aa3. No GPU: the device side of op.check() is a stand-in stream.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import attrs
import pytest
import torch

from generator import build as B
from generator import cache as C
from generator import render, toolchain
from generator.model import enumerate_variants
from tests.support.stand_ins import stand_in_native_op
from tests.support.variants import SMALL

ROOT = Path(__file__).resolve().parents[2]
def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if not p.is_dir()}


# ---------------------------------------------------------------------------------------------
# Defect 4: the fallback cache dir under the shared temporary folder must be ours
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def unwritable(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(a cache dir that cannot be made, the shared temporary folder of this test)."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    return blocker / "cache", shared


@pytest.mark.parametrize("how", ["symlink", "group_writable", "other_writable", "other_owner", "a_file"])
def test_fallback_cache_dir_that_is_not_ours_is_refused(unwritable, tmp_path, monkeypatch, how):
    wanted, shared = unwritable
    uid = os.getuid()
    if how == "other_owner":  # the dir below is owned by the real uid: pose as another user
        uid += 1
        monkeypatch.setattr(os, "getuid", lambda: uid)
    fallback = shared / f"epgen-cache-{uid}"
    attacker = tmp_path / "attacker"
    (attacker / "gfx950").mkdir(parents=True)
    (attacker / "gfx950" / "forged.hsaco").write_bytes(b"forged")
    if how == "symlink":
        fallback.symlink_to(attacker)
    elif how == "a_file":
        fallback.write_text("x")
    else:
        fallback.mkdir()
        os.chmod(fallback, {"group_writable": 0o770, "other_writable": 0o707, "other_owner": 0o700}[how])
    before = {p: p.read_bytes() for p in _files(attacker)}
    with pytest.warns(UserWarning, match=rf"^cache dir {re.escape(str(wanted))} is not writable \(.+\) and the "
                                         rf"fallback {re.escape(str(fallback))} is unsafe \(.+\); using \S+$"):
        got = C.usable_dir(wanted)
    st = os.lstat(got)
    assert got != fallback and stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert not got.resolve().is_relative_to(attacker.resolve()) and not got.resolve().is_relative_to(fallback)
    assert {p: p.read_bytes() for p in _files(attacker)} == before  # nothing written there
    with warnings.catch_warnings():  # warned once; the same private dir again
        warnings.simplefilter("error")
        assert C.usable_dir(wanted) == got


def test_fallback_cache_dir_is_created_private(unwritable):
    wanted, shared = unwritable
    old = os.umask(0)  # the mode must not depend on the umask
    try:
        with pytest.warns(UserWarning, match=r"is not writable \(.+\); using "):
            got = C.usable_dir(wanted)
    finally:
        os.umask(old)
    assert got == shared / f"epgen-cache-{os.getuid()}"
    assert stat.S_IMODE(os.lstat(got).st_mode) == 0o700


def test_forged_entry_in_a_hijacked_fallback_is_never_used(specs, variant, unwritable, tmp_path):
    """Another user pre-creates the fallback as a symlink to a dir holding a forged, "verified" entry of
    our variant: the build compiles its own object into a private dir instead of loading the forgery."""
    wanted, shared = unwritable
    out_root = tmp_path / "gen"
    B.write_target(specs, "gfx950", out_root)
    tools = toolchain.find(variant.toolchain)
    src_sha = render.sha256((out_root / "gfx950" / variant.file).read_bytes())
    attacker = tmp_path / "attacker"
    forged = C.Entry.of(attacker, variant, C.cache_key(variant, tools, src_sha))
    forged.artifact.parent.mkdir(parents=True)
    forged.artifact.write_bytes(b"another kernel")
    isa_key = render.sha256(json.dumps([variant.expected_isa, variant.forbidden_isa]))
    forged.record.write_text(json.dumps({"sha256": hashlib.sha256(b"another kernel").hexdigest(),
                                         "verified": {isa_key: {"ok": True, "message": "forged"}}}))
    (shared / f"epgen-cache-{os.getuid()}").symlink_to(attacker)
    with pytest.warns(UserWarning) as warned:
        (res,) = B.build(specs, ["gfx950"], "all", only=SMALL, cache_dir=wanted, out_root=out_root)
    assert res.ok and res.status == "compiled", (res.status, res.message)
    assert any("is unsafe" in str(w.message) for w in warned)
    assert not res.artifact.resolve().is_relative_to(attacker.resolve())
    assert res.artifact.read_bytes() != b"another kernel"
    assert forged.artifact.read_bytes() == b"another kernel"


# ---------------------------------------------------------------------------------------------
# Defect 5: code_object returns the bytes it verified, whatever happens to the file after the lock
# ---------------------------------------------------------------------------------------------
def test_code_object_returns_the_verified_bytes(tmp_path, monkeypatch):
    from runtime import config as rconfig
    from runtime import kernels

    monkeypatch.setenv("EPGEN_CACHE_DIR", str(tmp_path / "cache"))
    (v,), _ = enumerate_variants(rconfig.load_specs(), ["gfx950"], "all", SMALL)
    real, verified = B.compile_variant, []

    def racing(*args, **kwargs):
        res = real(*args, **kwargs)
        verified.append((res.artifact.read_bytes(), json.loads(res.artifact.with_suffix(".json").read_text())))
        res.artifact.write_bytes(b"\x7fELF a concurrent writer's other object")  # right after the lock
        return res

    monkeypatch.setattr(B, "compile_variant", racing)
    image = kernels.code_object(v)
    (good, record), = verified
    assert image == good and hashlib.sha256(image).hexdigest() == record["sha256"]


# ---------------------------------------------------------------------------------------------
# Defect 2 (cache side): every cache path is a plain component under the cache root
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("target", "../../escape"), ("target", ".."), ("target", "-x"), ("target", "a\u2028b"),
    ("artifact", "hsaco/../../../escape"), ("artifact", "x\x00y"), ("artifact", ".hidden"),
])
def test_cache_paths_are_plain_components(variant, source, tmp_path, field, value):
    if field == "target":
        bad = attrs.evolve(variant, target=attrs.evolve(variant.target, name=value))
    else:
        bad = attrs.evolve(variant, toolchain=attrs.evolve(variant.toolchain, artifact=value))
    cache = tmp_path / "deep" / "er" / "cache"
    res = B.compile_variant(bad, source, cache, toolchain.find(variant.toolchain))
    name = "target name" if field == "target" else "artifact extension"
    assert (res.status, res.message) == ("failed", f"cache: {name} {value!r} is not a plain file name")
    assert _files(tmp_path) == {source}  # nothing written, inside the cache or out of it


@pytest.mark.parametrize("name", ["", ".", "..", ".x", "-x", "a/b", "a\\b", "a\x00b", "a\nb", "a\u2029b", "a\x85b"])
def test_plain_component_rejects(name):
    with pytest.raises(C.UnsafePath, match=r"^cache: thing .+ is not a plain file name$"):
        C.plain_component(name, "thing")


def test_cache_refuses_to_write_through_a_symlink_out_of_its_root(variant, source, tmp_path):
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    cache.mkdir()
    outside.mkdir()
    (cache / "gfx950").symlink_to(outside)
    res = B.compile_variant(variant, source, cache, toolchain.find(variant.toolchain))
    assert res.status == "failed" and "\n" not in res.message, res.message
    assert res.message.startswith(f"cache: refusing to write in {cache / 'gfx950'}: it resolves to ")
    assert res.message.endswith("outside the cache root " + str(cache.resolve()))
    assert not list(outside.iterdir())


# ---------------------------------------------------------------------------------------------
# Defect 10: op.check() waits for the op's queued work first
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def native_op(monkeypatch):
    op, queued, real = stand_in_native_op(monkeypatch)
    yield op, queued
    op._backend = real
    op.close()


def test_check_waits_for_the_ops_queued_work(native_op):
    from runtime import InputError

    op, queued = native_op
    with pytest.raises(InputError, match=r"^dispatch: expert id 77 >= num_experts=2 "):
        op.check()
    assert sorted(queued.synced) == [1111, 2222]  # the op's stream and the current one (graph replays)
    op.check()  # reported once
    assert sorted(queued.synced) == [1111, 1111, 2222, 2222]


def test_check_without_sync_reads_the_words_as_they_are(native_op):
    from runtime import InputError

    op, queued = native_op
    op.check(sync=False)  # the queued kernel has not run: nothing yet, and no wait
    assert queued.synced == []
    with pytest.raises(InputError, match="expert id 77"):
        op.check()


# ---------------------------------------------------------------------------------------------
# Defect 11: compilers die with the build; their temporary files are swept
# ---------------------------------------------------------------------------------------------
FAKE_CC = """\
import os, subprocess, sys, time
out = sys.argv[sys.argv.index("-o") + 1]
open(out, "wb").write(b"partial")
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
with open(os.environ["FAKECC_PIDS"], "a") as f:
    f.write(f"{os.getpid()} {helper.pid}\\n")
time.sleep(float(os.environ["FAKECC_SLEEP"]))
open(out, "wb").write(b"\\x7fELF fake code object")
"""


@pytest.fixture(autouse=True)
def _no_stray_fakes(tmp_path):
    """Every fake compiler and helper a test started is gone when it ends."""
    yield
    pids = tmp_path / "pids"
    for pid in (int(p) for p in pids.read_text().split()) if pids.exists() else ():
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _fake_tools(tmp_path: Path, sleep: float) -> toolchain.Tools:
    cc = tmp_path / "fakecc"
    cc.write_text(f"#!{sys.executable}\n{FAKE_CC}")
    cc.chmod(0o755)
    return toolchain.Tools(str(cc), "fakecc 1.0", None, (("FAKECC_PIDS", str(tmp_path / "pids")),
                                                         ("FAKECC_SLEEP", str(sleep))))


def _started(tmp_path: Path, n: int = 1, timeout: float = 60) -> list[int]:
    """The pids of the fake compiler and its helper, once n compilers have started."""
    pids = tmp_path / "pids"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = pids.read_text().split("\n")[:-1] if pids.exists() else []
        if len(lines) >= n:
            return [int(p) for line in lines for p in line.split()]
        time.sleep(0.05)
    raise AssertionError("the fake compiler did not start")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except (ProcessLookupError, FileNotFoundError):
        return False


def _all_die(pids: list[int], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="dying with the parent needs Linux prctl")
def test_sigkilled_build_leaves_no_compiler_and_next_build_sweeps(variant, source, tmp_path):
    cache = tmp_path / "cache"
    script = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
              "from pathlib import Path\n"
              "from generator import build as B, specs as S, toolchain\n"
              "from generator.model import enumerate_variants\n"
              f"(v,), _ = enumerate_variants(S.load(), ['gfx950'], 'all', {SMALL!r})\n"
              f"tools = toolchain.Tools({str(tmp_path / 'fakecc')!r}, 'fakecc 1.0', None, "
              f"(('FAKECC_PIDS', {str(tmp_path / 'pids')!r}), ('FAKECC_SLEEP', '120')))\n"
              f"B.compile_variant(v, Path({str(source)!r}), Path({str(cache)!r}), tools)\n")
    _fake_tools(tmp_path, 120)
    build = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        compiler, _helper = _started(tmp_path)
    finally:
        build.send_signal(signal.SIGKILL)
        build.wait()
    assert _all_die([compiler]), "the compiler outlived the build killed by SIGKILL"
    # (the compiler's own children, here `helper`, are beyond reach after a SIGKILL of the build)
    d = cache / "gfx950"
    assert [p for p in d.iterdir() if p.name.startswith(".")], "expected the killed build's temporary file"
    res = B.compile_variant(variant, source, cache, _fake_tools(tmp_path, 0))
    assert res.status == "missing-toolchain", (res.status, res.message)  # compiled; no disassembler to verify
    assert not [p.name for p in d.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp")]


def test_sweep_stale_spares_live_and_new_files(tmp_path):
    d = tmp_path / "gfx950"
    d.mkdir()
    stale, live, new = (f"quantize_fp8.bf16.{n}-{'0123456789abcdef' + n * 4}" for n in ("a", "b", "c"))
    files = {name: [d / f".{name}.x1y2z3.hsaco", d / f".{name}.json.4567.tmp"] for name in (stale, live, new)}
    for paths in files.values():
        for p in paths:
            p.write_bytes(b"x")
    keep = [d / f"{stale}.hsaco", d / f"{stale}.json", d / ".probe.1"]
    for p in keep:
        p.write_bytes(b"x")
    before = time.time() + 1
    for p in files[new]:
        os.utime(p, (before + 5, before + 5))
    with open(d / f"{live}.lock", "a") as held:
        import fcntl

        fcntl.flock(held, fcntl.LOCK_EX)  # a live writer of that entry
        assert C.sweep_stale(tmp_path, "gfx950", before) == 2
    assert not any(p.exists() for p in files[stale])
    assert all(p.exists() for p in files[live] + files[new] + keep)
    other = tmp_path / "other-root"
    other.mkdir()
    (other / "gfx950").symlink_to(d)  # never through a symlink out of the cache root
    assert C.sweep_stale(other, "gfx950", before + 100) == 0
    assert all(p.exists() for p in files[live] + files[new] + keep)


def test_timeout_kills_the_compilers_whole_process_group(tmp_path):
    tools = _fake_tools(tmp_path, 120)
    t0 = time.monotonic()
    r = toolchain.run([tools.compiler, "-o", str(tmp_path / "out")], tools, timeout=3)
    assert time.monotonic() - t0 < 60
    assert (r.returncode, r.stderr) == (-signal.SIGKILL, "fakecc timed out after 3 s")
    assert _all_die(_started(tmp_path)), "a compiler or its helper outlived the timeout"


def test_interrupt_kills_the_compilers_whole_process_group(tmp_path, monkeypatch):
    tools = _fake_tools(tmp_path, 120)
    real = subprocess.Popen.communicate

    def interrupted(self, *args, **kwargs):
        _started(tmp_path)
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess.Popen, "communicate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        toolchain.run([tools.compiler, "-o", str(tmp_path / "out")], tools)
    monkeypatch.setattr(subprocess.Popen, "communicate", real)
    assert _all_die(_started(tmp_path)), "a compiler or its helper outlived KeyboardInterrupt"


def test_interrupted_build_kills_every_running_compiler(specs, tmp_path, monkeypatch):
    """Ctrl-C during a parallel build (compilers in process groups of their own do not see the terminal's
    SIGINT): the build kills every running compiler and raises at once, leaving no temporary file."""
    tools = _fake_tools(tmp_path, 30)
    monkeypatch.setattr(toolchain, "find", lambda tc: tools)
    # raising KeyboardInterrupt in the main thread (the build waits there) once both compilers run
    old = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=lambda: (_started(tmp_path, 2), os.kill(os.getpid(), signal.SIGINT)), daemon=True).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            B.build(specs, ["gfx950"], "all", only="quantize_fp8.bf16.*", jobs=2, cache_dir=tmp_path / "cache",
                    out_root=tmp_path / "gen")
    finally:
        signal.signal(signal.SIGINT, old)
    assert time.monotonic() - t0 < 20, "the build waited for its compilers"
    assert _all_die(_started(tmp_path, 2)), "a compiler outlived the interrupted build"
    assert not [p.name for p in (tmp_path / "cache" / "gfx950").iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------------------------------------
# Defect 7 (runtime part): sizes no tensor can have are ConfigErrors naming the field and its range
# ---------------------------------------------------------------------------------------------
BASE = dict(rank=0, world_size=2, hidden_dim=64, max_num_inp_token_per_rank=16, num_experts_per_rank=4,
            num_experts_per_token=2, kernel_backend="torch")


@pytest.mark.parametrize("field,value", [
    ("hidden_dim", 2 ** 63), ("hidden_dim", 2 ** 31), ("max_num_inp_token_per_rank", 2 ** 31),
    ("num_experts_per_rank", 2 ** 40), ("num_experts_per_token", 2 ** 31), ("world_size", 2 ** 31),
    ("internode_auto_ll_max_tokens", 2 ** 63), ("scale_dim", 2 ** 40), ("max_total_recv_tokens", 2 ** 31),
    ("gpu_per_node", 2 ** 31), ("expert_capacity", 2 ** 31), ("launch_blocks", 2 ** 31),
])
def test_config_int_fields_have_a_declared_range(field, value):
    from runtime import ConfigError, EpDispatchCombineConfig

    with pytest.raises(ConfigError, match=rf"^{field}={value}: must be at most 2147483647 \(.+\)$"):
        EpDispatchCombineConfig(**{**BASE, field: value})


@pytest.mark.parametrize("kw,message", [
    (dict(world_size=2, num_experts_per_rank=2 ** 30),
     r"^num_experts_per_rank=1073741824: num_experts = world_size x num_experts_per_rank = 2147483648: "
     r"expert ids are int32 \(must be < 2\^31\)$"),
    (dict(world_size=1, max_num_inp_token_per_rank=2 ** 31 - 1, num_experts_per_rank=1, num_experts_per_token=1,
          hidden_dim=2 ** 31 - 1, data_type=torch.float32),
     r"^hidden_dim=2147483647: a buffer of 2147483647 rows x hidden_dim x 4 bytes = \d+ bytes: no tensor is "
     r"that large \(< 2\^63\)$"),
])
def test_config_products_no_tensor_can_hold(kw, message):
    from runtime import ConfigError, EpDispatchCombineConfig

    with pytest.raises(ConfigError, match=message):
        EpDispatchCombineConfig(**{**BASE, **kw})
