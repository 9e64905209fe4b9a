"""scripts/device_run.sh refuses A/B trees it cannot measure before any GPU work (a folder git ignores, such as
.ab, reaches the device machine only when the call carries it): exit 2, one line naming the tree, nothing run."""

import os
import shutil
import subprocess

import pytest

from tests.conftest import ROOT


def _run(tmp_path, **env):
    work = tmp_path / "tree"
    (work / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "device_run.sh", work / "scripts" / "device_run.sh")
    (work / ".ab" / "good" / "scripts").mkdir(parents=True)
    (work / ".ab" / "good" / "scripts" / "device_run.sh").write_text("exit 0\n")
    out = tmp_path / "out"
    # no python3 on PATH: a run that got past the check fails its GPU steps at once instead of using the machine
    path = tmp_path / "bin"
    path.mkdir()
    (path / "bash").symlink_to(shutil.which("bash"))
    for tool in ("dirname", "basename", "mkdir"):
        (path / tool).symlink_to(shutil.which(tool))
    proc = subprocess.run(["bash", "scripts/device_run.sh"], cwd=work, capture_output=True, text=True, timeout=60,
                          env={"PATH": str(path), "OUT": str(out), **env})
    return proc, out


@pytest.mark.parametrize("env", [{"AB_BASE": ".ab/missing"}, {"AB_TREES": ".ab/good .ab/missing"},
                                 {"AB_BASE": ".ab/good", "AB_TREES": ".ab/bad$name"}, {"AB_TREES": ".ab/good/../x y"}])
def test_a_tree_it_cannot_measure_is_refused_before_anything_runs(tmp_path, env):
    proc, out = _run(tmp_path, **env)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "is not a tree to measure" in proc.stderr and "carries it" in proc.stderr, proc.stderr
    assert "nothing run" in proc.stderr
    assert not os.listdir(out), "the refused run wrote into OUT"


def test_trees_it_can_measure_pass_the_check(tmp_path):
    proc, _ = _run(tmp_path, AB_BASE=".ab/good", AB_TREES=".ab/good")
    assert "is not a tree to measure" not in proc.stderr + proc.stdout
    # past the check (no python3 here: the GPU steps fail at once); the stub tree ran and its status is summed up
    assert "tree good 0" in proc.stdout, proc.stdout[-2000:]
