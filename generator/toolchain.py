"""Compilers and disassemblers for each target family, found on this machine.

Commands are argument lists (never a shell). A missing tool is reported with the package that
provides it (toolchain.install_hint in specs/targets.toml).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import attrs

from .specs import Target, Toolchain, program_problem


@attrs.frozen
class Tools:
    compiler: str
    compiler_version: str  # first line of --version: part of every cache key
    disassembler: str | None
    env: tuple[tuple[str, str], ...] = ()  # extra environment (PATH for cuobjdump's nvdisasm)
    missing: str = ""  # why there is no disassembler: the programs looked for, where, and what provides them

    @property
    def bare_clang(self) -> bool:
        """Upstream clang without ROCm: compile with -nogpulib -nogpuinc and the project's prelude."""
        name = Path(self.compiler).name
        return name.startswith("clang")


class ToolchainMissing(Exception):
    pass


def _pip_nvidia_bins() -> list[str]:
    """bin/ folders of pip's nvidia-* packages (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)."""
    out = []
    for p in map(Path, sys.path):
        nv = p / "nvidia"
        if nv.is_dir():
            out += [str(b) for b in sorted(nv.glob("*/bin")) if b.is_dir()]
    return out


def _which(name: str, extra: list[str]) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(extra)) if extra else shutil.which(name)


@functools.cache
def _version(exe: str) -> str:
    try:
        r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    text = (r.stdout or r.stderr).strip().splitlines()
    # nvcc prints a banner; its last line names the release
    return (text[-1] if Path(exe).name == "nvcc" else text[0]) if text else ""


def _clang_major(version: str) -> int:
    m = re.search(r"clang version (\d+)", version)
    return int(m.group(1)) if m else 0


@functools.cache
def find(tc: Toolchain) -> Tools:
    # the loader admits only known toolchain programs; a Toolchain built by hand gets the same check
    unknown = [why for kind in ("compilers", "disassemblers") for n in getattr(tc, kind)
               if (why := program_problem(None, kind, n))]
    if unknown:
        raise ToolchainMissing(f"toolchain {tc.name!r}: {'; '.join(unknown)}")
    extra = _pip_nvidia_bins()
    compiler = None
    for name in tc.compilers:
        exe = shutil.which(name)
        if not exe:
            continue
        ver = _version(exe)
        if name.startswith("clang") and _clang_major(ver) < tc.min_clang:
            continue
        compiler = exe
        break
    if compiler is None:
        raise ToolchainMissing(f"no {tc.name} compiler found (tried {', '.join(tc.compilers)}): install {tc.install_hint}")
    dis = next((d for d in (_which(n, extra) for n in tc.disassemblers) if d), None)
    env: tuple[tuple[str, str], ...] = ()
    if dis is not None and extra:
        env = (("PATH", os.pathsep.join([os.environ.get("PATH", "")] + extra)),)
    where = "PATH" + (" and pip's nvidia-*/bin folders" if extra else "")
    missing = "" if dis else (f"{' / '.join(tc.disassemblers)} not found on {where} (the ISA check disassembles "
                              f"every code object): install {tc.install_hint}")
    return Tools(compiler, _version(compiler), dis, env, missing)


def compile_command(target: Target, tools: Tools, src: Path, out: Path, unit: str | None = None) -> list[str]:
    """The compiler's argument list for `src` -> `out`. `unit` names the compilation unit (default: the
    source's file name): it fixes HIP's compilation-unit id, so compiling a copy of a source under
    another name gives the bytes the source itself would."""
    if target.vendor == "amd":
        cmd = [tools.compiler, "-x", "hip", *target.flags, f"--offload-arch={target.name}", "--cuda-device-only",
               "--no-gpu-bundle-output"]
        if tools.bare_clang:
            cmd += ["-nogpulib", "-nogpuinc"]
        # clang's HIP compilation-unit id (symbol __hip_cuid_*) is random per run by default; a fixed
        # one makes builds reproducible: a rebuilt cache entry has the bytes of the one it replaces
        cmd.append(f"-cuid={hashlib.sha256((unit or src.name).encode()).hexdigest()[:16]}")
        return cmd + [str(src), "-o", str(out)]
    return [tools.compiler, *target.flags, "-cubin", str(src), "-o", str(out)]


def disassemble_command(target: Target, tools: Tools, artifact: Path) -> list[str]:
    if tools.disassembler is None:
        raise ToolchainMissing(f"no disassembler for {target.name}: {tools.missing or 'none found'}")
    if target.vendor == "amd":
        return [tools.disassembler, "-d", f"--mcpu={target.name}", str(artifact)]
    return [tools.disassembler, "--dump-sass", str(artifact)]


_running: set[subprocess.Popen] = set()  # the tools running now, each the leader of its own process group
_running_lock = threading.Lock()


def _kill_group(p: subprocess.Popen) -> None:
    """SIGKILL p's process group, unless p was reaped already (its group id may then be reused)."""
    if p.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)


def kill_running() -> None:
    """Kill every tool this process runs now, with whatever they started (their process groups)."""
    with _running_lock:
        running = list(_running)
    for p in running:
        _kill_group(p)


@functools.cache
def _prctl():
    """libc's prctl on Linux (resolved once, before any fork), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int] + [ctypes.c_ulong] * 4
    return fn


def _die_with_parent():
    """A preexec_fn giving the tool SIGKILL when the thread that started it dies, even by SIGKILL (Linux
    PR_SET_PDEATHSIG); None elsewhere."""
    prctl, parent = _prctl(), os.getpid()
    if prctl is None:
        return None

    def preexec():
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os._exit(1)

    return preexec


def run(cmd: list[str], tools: Tools, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a tool from an argument list in a process group of its own: on a timeout, an exception or
    KeyboardInterrupt here (and on kill_running) the whole group is killed, and on Linux the tool dies
    with this process. A timeout is a failed result (returncode -9), not an exception."""
    env = dict(os.environ, **dict(tools.env))
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, start_new_session=True, preexec_fn=_die_with_parent())
    with _running_lock:
        _running.add(p)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(p)
        out, err = p.communicate()
        return subprocess.CompletedProcess(cmd, -signal.SIGKILL, out, f"{Path(cmd[0]).name} timed out after {timeout:g} s")
    except BaseException:
        _kill_group(p)
        p.wait()
        raise
    finally:
        with _running_lock:
            _running.discard(p)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


_AMD_LINE = re.compile(r"^\s+([a-z][a-z0-9_]*)\b([^/]*)")
_SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")


def opcodes(disassembly: str, vendor: str) -> set[str]:
    """The set of instruction opcodes (with modifiers) in a disassembly listing. AMD: also each
    instruction with its operands ("buffer_wbl2 sc0 sc1"), so an expectation can name a scope operand."""
    pat = _AMD_LINE if vendor == "amd" else _SASS_LINE
    out = set()
    for line in disassembly.splitlines():
        m = pat.search(line) if vendor != "amd" else pat.match(line)
        if m:
            out.add(m.group(1))
            if vendor == "amd" and m.group(2).strip():
                out.add(f"{m.group(1)} {' '.join(m.group(2).split())}")
    return out


def has_mnemonic(ops: set[str], mnemonic: str) -> bool:
    """AMD: exact, or with an encoding suffix (_e32/_e64/_sdwa/_dpp); a mnemonic with operands ("buffer_inv
    sc0 sc1") matches an instruction whose operands start with them, and "mnemonic ... operands" one whose
    operands end with them ("flat_store_dwordx4 ... sc0 sc1": the scope bits after the registers).
    NVIDIA: exact or with more modifiers."""
    if " ... " in mnemonic:
        head, tail = mnemonic.split(" ... ", 1)
        return any(op.startswith(head + " ") and op.endswith(" " + tail) for op in ops)
    if " " in mnemonic:
        return any(op == mnemonic or op.startswith(mnemonic + " ") or op.startswith(mnemonic + ",") for op in ops)
    for op in ops:
        if op == mnemonic or op.startswith(mnemonic + ".") or re.fullmatch(re.escape(mnemonic) + r"_(e32|e64|sdwa|dpp)", op):
            return True
    return False
