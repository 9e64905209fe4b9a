"""scripts/param_lines.py: the parameter-bank lines each EP kernel reads, and the order search it suggests."""

import re

import pytest

from tests.support.scripts import load_script

pl = load_script("param_lines")


def _names(n):
    return [f"f{i}" for i in range(n)]


def test_offsets_map_to_fields_and_lines():
    sass = ("        /*0010*/   ULDC.64 UR4, c[0x0][0x210] ;\n        /*0020*/   LDC R1, c[0x0][0x28] ;\n"
            "        /*0030*/   IADD3 R2, R3, c[0x0][0x254], RZ ;\n")
    offs = pl.offsets(sass)
    assert offs == {0x210, 0x28, 0x254}
    names = _names(20)
    assert pl.fields_read(offs, names) == {"f0", "f8"}  # 0x28 is below the struct; 0x254 is in field 8's 8 bytes
    assert pl.lines_of(names, {"f0", "f8"}) == {0x200 // 64, 0x240 // 64}
    assert pl.fields_read({0x210 + 8 * 20}, names) == set()  # past the struct


def test_the_search_gathers_a_kernels_fields_and_is_deterministic():
    names = _names(30)
    use = {"combine_ll": {f"f{i}" for i in range(0, 30, 5)}}  # six fields spread over four lines
    before = pl.cost(names, use)
    order = pl.suggest(names, use, rounds=4000)
    assert sorted(order) == sorted(names) and len(order) == len(names)
    assert pl.cost(order, use) < before and pl.cost(order, use) == 0  # six fields fit the descriptor's line
    assert order == pl.suggest(names, use, rounds=4000)


def test_an_order_already_cheapest_comes_back_unchanged():
    names = _names(30)
    use = {"dispatch_ll": {"f0", "f1", "f2"}}  # all on the descriptor's line already
    assert pl.suggest(names, use, rounds=2000) == names


def test_rounds_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        pl.main(["--rounds", "0"])
    assert "at least 1" in capsys.readouterr().err


def test_combine_ll_reads_the_lines_the_build_test_holds(capsys):
    """The real kernel, built and disassembled for sm_90: its row agrees with tests/generator/test_build.py."""
    assert pl.main(["--families", "combine_ll", "dispatch_ll"]) == 0
    out = capsys.readouterr().out
    for fam, most in (("combine_ll", 4), ("dispatch_ll", 5)):
        m = re.search(rf"^\| {fam} \| (\d+) \| (\d+) \| (0x200( 0x[0-9a-f]+)*) \|$", out, re.M)
        assert m, out
        assert int(m.group(1)) > 10 and int(m.group(2)) == len(m.group(3).split()) <= most
