"""scripts/hist_probe.py's parts that need no GPU: its reference histograms (against a plain loop), its forms and
argument struct against scripts/hist_probe.cu, its argument checks, its refusal without a GPU, and the .cu built
for sm_90 where nvcc is installed."""

import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.scripts import load_script

CU = Path(__file__).resolve().parents[2] / "scripts" / "hist_probe.cu"


def _script():
    return load_script("hist_probe")


def _loop(ids: list[list[int]], experts: int, world: int, blocks: int):
    """(pre, tot) per block by a plain loop: pairs per expert, tokens with a pair per rank."""
    T, per_rank = len(ids), experts // world
    counts = []  # counts[t]: the buckets token t adds to
    for row in ids:
        c = [0] * (experts + world)
        for e in row:
            c[e] += 1
        for r in {e // per_rank for e in row}:
            c[experts + r] += 1
        counts.append(c)
    pre = [[sum(counts[t][i] for t in range(b * T // blocks)) for i in range(experts + world)] for b in range(blocks)]
    tot = [[sum(counts[t][i] for t in range(T)) for i in range(experts + world)]] * blocks
    return pre, tot


@pytest.mark.parametrize("tokens,experts,topk,world,blocks", [(37, 16, 4, 1, 4), (37, 16, 4, 2, 8), (5, 12, 3, 4, 8),
                                                              (64, 32, 8, 2, 12), (3, 8, 2, 2, 4)])
def test_the_reference_counts_what_a_loop_counts(tokens, experts, topk, world, blocks):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.rand((tokens, experts), generator=g).topk(topk, dim=1).indices.to(torch.int32)
    pre, tot = _script().expected(ids, experts, world, blocks)
    want_pre, want_tot = _loop(ids.tolist(), experts, world, blocks)
    assert pre.dtype == tot.dtype == torch.int32
    assert pre.tolist() == want_pre and tot.tolist() == want_tot


def test_the_forms_and_the_argument_struct_are_the_cu_files():
    m, src = _script(), CU.read_text()
    kernels = re.findall(r'extern "C" __global__ void (?:__\w+\([^)]*\) )*(hp_\w+)\(HpArgs a\)', src)
    assert kernels and sorted(kernels) == sorted(m.FORMS)
    body = re.search(r"struct HpArgs \{(.*?)\};", src, re.S).group(1)
    decls = [line.split("//")[0].strip().rstrip(";") for line in body.splitlines() if ";" in line.split("//")[0]]
    names = [re.findall(r"\w+", piece)[-1] for decl in decls for piece in decl.split(",")]
    assert names == [f for f, _ in m.HpArgs._fields_]
    assert re.search(r"HP_MAX_BUCKETS = (\d+);", src).group(1) == str(m.MAX_BUCKETS)


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--topk", "9", "--experts", "8"], ["--world", "3"],
                                  ["--experts", "318", "--world", "3"], ["--blocks", "6"], ["--threads", "1024"],
                                  ["--launches", "0"], ["--reps", "0"], ["--tokens", "x"]])
def test_bad_arguments_are_one_clear_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _script().parse(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_without_a_gpu_it_says_so(capsys, monkeypatch):
    m = _script()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert m.main(["--tokens", "1"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: the sm_90 build is not checked here")
def test_the_cu_file_builds_for_sm_90(tmp_path):
    image = _script().build(tmp_path)
    assert image[:4] == b"\x7fELF"
    for form in _script().FORMS:
        assert form.encode() in image


def test_a_missing_compiler_is_one_message(monkeypatch, tmp_path):
    from generator import toolchain

    def missing(tc):
        raise toolchain.ToolchainMissing("nvcc not found")

    monkeypatch.setattr(toolchain, "find", missing)
    with pytest.raises(RuntimeError, match="no compiler for sm_90: nvcc not found"):
        _script().build(tmp_path)
