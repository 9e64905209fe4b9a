"""examples/train_moe.py on CPU: its torchrun command at 2 gloo ranks (torch backend) for a few steps, the backward on
the calling thread: the loss per step agrees with the dense single-process run of the same model and falls; the loss
curve, and the message without matplotlib."""

from __future__ import annotations

import builtins
import os
import re
import subprocess
import sys

import torch

from tests.support.moe_layer_ref import ROOT, load_example

STEP = re.compile(r"^step +(\d+)  loss ([0-9.]+)  dense ([0-9.]+)  rel\.diff ([0-9.e+-]+)$")


def test_training_at_two_ranks_matches_the_dense_run_and_the_loss_falls(tmp_path):
    png = tmp_path / "loss.png"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", EPGEN_KERNEL_BACKEND="torch")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train_moe.py"), "--steps", "8", "--tokens", "16", "--hidden", "32",
           "--intermediate", "16", "--plot", str(png), "--single-thread-backward"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    steps = [STEP.match(line) for line in res.stdout.splitlines()]
    steps = [m for m in steps if m]
    assert [int(m[1]) for m in steps] == list(range(8)), res.stdout
    ep, dense, rel = ([float(m[i]) for m in steps] for i in (2, 3, 4))
    assert max(rel) <= 1e-4 and all(abs(a - b) <= 1e-4 * b for a, b in zip(ep, dense)), res.stdout
    assert ep[-1] < 0.9 * ep[0], res.stdout  # it learns
    assert f"loss curve written to {png}" in res.stdout and png.stat().st_size > 0
    assert res.stdout.strip().splitlines()[-1].startswith("OK: 2 rank(s), 8 steps: loss "), res.stdout


def test_the_backward_runs_on_the_calling_thread_only_when_asked():
    ex = load_example("train_moe")
    assert ex.parser().parse_args([]).single_thread_backward is False
    assert ex.parser().parse_args(["--single-thread-backward"]).single_thread_backward is True


def test_plot_without_matplotlib_says_so(monkeypatch, tmp_path):
    ex = load_example("train_moe")
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kw):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    path = tmp_path / "x.png"
    assert ex.plot([(2.0, 2.0), (1.0, 1.0)], str(path)) == (f"--plot {path}: matplotlib is not installed (pip install "
                                                            f"matplotlib); no plot written")
    assert not path.exists()


def test_verdict_needs_a_falling_loss_and_agreement():
    ex = load_example("train_moe")
    assert ex.verdict([(2.0, 2.0), (1.0, 1.0)], torch.float32, 2)[0]
    assert not ex.verdict([(1.0, 1.0), (2.0, 2.0)], torch.float32, 2)[0]  # rises
    ok, line = ex.verdict([(2.0, 2.0), (1.0, 1.1)], torch.float32, 2)
    assert not ok and "MISMATCH" in line
    assert ex.verdict([(2.0, None), (1.0, None)], torch.float32, 2)[0]  # --no-check: the fall alone
