"""scripts/hbm_floor.py's parts that need no GPU: the grouped order of its pair rows, the bytes it counts, its
argument checks and its refusal without a GPU."""

import pytest
import torch

from tests.support.scripts import load_script


def _script():
    return load_script("hbm_floor")


@pytest.mark.parametrize("tokens,experts,topk", [(1, 256, 8), (37, 16, 4), (128, 256, 8), (5, 3, 3)])
def test_pairs_sit_by_expert_with_tokens_in_order(tokens, experts, topk):
    m = _script()
    ids, w = m.routing(tokens, experts, topk, torch.device("cpu"), seed=tokens)
    assert ids.dtype == torch.int32 and ids.shape == (tokens, topk) and w.shape == (tokens, topk)
    assert all(len(set(row.tolist())) == topk for row in ids), "a token's experts are distinct"
    pos = m.grouped_positions(ids)
    assert pos.dtype == torch.int32 and sorted(pos.reshape(-1).tolist()) == list(range(tokens * topk))
    by_row = [None] * (tokens * topk)  # (expert, token) of the pair at each grouped row
    for t in range(tokens):
        for j in range(topk):
            by_row[pos[t, j]] = (int(ids[t, j]), t)
    assert by_row == sorted(by_row), "rows go by expert, then by token"


def test_the_bytes_are_the_rows_read_and_written():
    m = _script()
    row = 7168 * 2
    assert m.bytes_moved("expand", 4096, 7168, 8) == 4096 * row * 9
    assert m.bytes_moved("reduce", 4096, 7168, 8) == 4096 * row * 9
    assert m.bytes_moved("copy", 128, 7168, 8) == 128 * row * 2
    assert m.bytes_moved("empty", 0, 7168, 8) == 0


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--hidden", "0"], ["--topk", "9", "--experts", "8"],
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
    assert "needs a CUDA GPU" in capsys.readouterr().err
