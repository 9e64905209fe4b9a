"""Bench-only kernels (the ceiling's copy kernel, the floor's flag kernels): CUDA source built into a code
object with the target's own toolchain (``compile_source``)."""

from __future__ import annotations

import tempfile
from pathlib import Path


def compile_source(arch: str, source: str, name: str = "kernel") -> bytes:
    """A bench-only kernel's code object for `arch`, built from `source` with the target's own toolchain and
    flags (specs/targets.toml; sm_90: nvcc ... sm_90a -cubin)."""
    from generator import toolchain

    from runtime.config import load_specs

    specs = load_specs()
    target = specs.targets[arch]
    tools = toolchain.find(specs.toolchains[target.toolchain])
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d) / f"{name}.cu", Path(d) / f"{name}.cubin"
        src.write_text(source)
        res = toolchain.run(toolchain.compile_command(target, tools, src, out), tools)
        if res.returncode:
            raise RuntimeError(f"{Path(tools.compiler).name} failed: {res.stderr[-2000:]}")
        return out.read_bytes()
