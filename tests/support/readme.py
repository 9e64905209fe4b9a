"""The README's python blocks, each saved under the name its prose gives and run under torchrun as a user would."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def scripts() -> list[tuple[str, str]]:
    """Every python block of the README with the file name its prose saves it as ("save it as `NAME`"), in order."""
    parts = re.split(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)  # prose, code, prose, ...
    named = []
    for prose, code in zip(parts[0::2], parts[1::2]):
        names = re.findall(r"save it as `(\w+\.py)`", prose)
        assert names, f"README.md: the prose before python block {len(named) + 1} names no file (save it as `NAME`)"
        named.append((names[-1], code))
    return named


def usage_block() -> str:
    return scripts()[0][1]


def run_script(tmp_path: Path, name: str, code: str, nproc: int = 2, env: dict | None = None,
               timeout: float = 300) -> str:
    """Save the block as the README says and run `torchrun --nproc-per-node N NAME` from a folder outside the checkout
    (epgen found as installed: the checkout on PYTHONPATH); its output, AssertionError on failure."""
    script = tmp_path / name
    script.write_text(code)
    torchrun = Path(sys.executable).with_name("torchrun")  # this interpreter's (a venv's), else the one on PATH
    torchrun = [str(torchrun)] if torchrun.is_file() else [shutil.which("torchrun") or "torchrun"]
    run_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1", **(env or {})}
    run_env.pop("EPGEN_KERNEL_BACKEND", None)  # the block as a user runs it: the config's default backend
    r = subprocess.run([*torchrun, "--standalone", "--nproc-per-node", str(nproc), script.name], cwd=tmp_path,
                       env=run_env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"torchrun exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return r.stdout


def run_usage(tmp_path: Path, nproc: int = 2, env: dict | None = None, timeout: float = 300) -> str:
    return run_script(tmp_path, *scripts()[0], nproc=nproc, env=env, timeout=timeout)


def rank_reports(out: str) -> list[str]:
    """Each rank's one-line report, "rank N: ...", sorted by rank. The ranks share one pipe, and print() writes the
    text and its newline separately, so two ranks' reports can land on one line: split before every "rank N: "."""
    parts = (p.split("\n")[0].strip() for p in re.split(r"(?=rank \d+: )", out))
    return sorted(p for p in parts if re.match(r"rank \d+: ", p))
