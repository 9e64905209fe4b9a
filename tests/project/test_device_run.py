"""scripts/device_run.sh refuses A/B trees it cannot measure before any GPU work (a folder git ignores, such as
.ab, reaches the device machine only when the call carries it): exit 2, one line naming the tree, nothing run."""

import os
import shutil
import subprocess

import pytest

from tests.conftest import ROOT


def _run(tmp_path, stubs=None, **env):
    """device_run.sh in a tree of its own under tmp_path, with stub A/B trees .ab/<name> (stubs: name -> the stub's
    script; default: .ab/good, which exits 0)."""
    work = tmp_path / "tree"
    (work / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "device_run.sh", work / "scripts" / "device_run.sh")
    for name, script in (stubs or {"good": "exit 0\n"}).items():
        (work / ".ab" / name / "scripts").mkdir(parents=True)
        (work / ".ab" / name / "scripts" / "device_run.sh").write_text(script)
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


def test_each_tree_records_its_own_commit_not_this_trees(tmp_path):
    """The base's and the other trees' runs get a commit of their own (AB_BASE_COMMIT, the tree's folder name), never
    the calling tree's EPGEN_COMMIT: a base record that carried the candidate's commit read as a second candidate."""
    stub = 'echo "commit=$EPGEN_COMMIT" > "$OUT.commit"\nexit 0\n'
    _, out = _run(tmp_path / "a", {"good": stub, "cand": stub}, AB_BASE=".ab/good", AB_TREES=".ab/cand",
                  EPGEN_COMMIT="abc1234", AB_BASE_COMMIT="f00dcafe")
    assert (out / "base.commit").read_text().strip() == "commit=f00dcafe"
    assert (out / "cand.commit").read_text().strip() == "commit=cand"
    _, out = _run(tmp_path / "b", {"good": stub}, AB_BASE=".ab/good", EPGEN_COMMIT="abc1234")
    assert (out / "base.commit").read_text().strip() == "commit=base"


def test_the_jobs_ab_skip_names_run_in_this_tree_only(tmp_path):
    """AB_SKIP="VAR ...": those variables are unset for the base's and the other trees' runs (a job such as TRAIN
    then runs once, in the calling tree); a name that is no variable's is refused before anything runs."""
    stub = 'echo "train=${TRAIN:-unset} phase=${PHASE:-unset}" > "$OUT.env"\nexit 0\n'
    _, out = _run(tmp_path / "a", {"good": stub, "cand": stub}, AB_BASE=".ab/good", AB_TREES=".ab/cand",
                  TRAIN="1", PHASE="1", AB_SKIP="TRAIN")
    assert (out / "base.env").read_text().strip() == "train=unset phase=1"
    assert (out / "cand.env").read_text().strip() == "train=unset phase=1"
    _, out = _run(tmp_path / "b", {"good": stub}, AB_BASE=".ab/good", TRAIN="1")
    assert (out / "base.env").read_text().strip() == "train=1 phase=unset"
    proc, out = _run(tmp_path / "c", AB_BASE=".ab/good", AB_SKIP="TRAIN; rm")
    assert proc.returncode == 2 and "AB_SKIP: TRAIN; is not a variable's name" in proc.stderr, proc.stderr
    assert not os.listdir(out), "the refused run wrote into OUT"
