"""scripts/load_use.py: loads whose value is used before a later, independent load is issued."""

import pytest

from tests.support.scripts import load_script

lu = load_script("load_use")


def _sass(*lines: str) -> str:
    return "".join(f"        /*{16 * i:04x}*/                   {text} ;  /* 0x0 */\n" for i, text in enumerate(lines))


def _found(sass: str, **kw) -> list[tuple[int, int, int]]:
    return [(a.at, u.at, b.at) for a, u, b in lu.held(lu.parse(sass), **kw)]


CASES = {
    # the source token's sign extension ahead of the row's loads (combine_ll's push before 2b0768ef)
    "used before an independent load": (("LD.E R57, desc[UR16][R8.64]", "SHF.R.S32.HI R9, RZ, 0x1f, R57",
                                         "LDG.E R52, desc[UR16][R10.64]", "STG.E desc[UR16][R12.64], R52"), [(0, 1, 2)]),
    "issued together, then used": (("LDG.E R4, desc[UR16][R8.64]", "LDG.E R5, desc[UR16][R8.64+0x4]",
                                    "IADD3 R6, R4, R5, RZ", "STG.E desc[UR16][R12.64], R6"), []),
    # slot, then its cell (depends on it), then the next slot (does not): the select form of 77d64f75
    "a dependent load skipped for the next independent one": (
        ("LDG.E R35, desc[UR18][R94.64]", "IMAD.WIDE R20, R35, 0x10, R40",
         "LDG.E.128.STRONG.SYS R24, desc[UR18][R20.64]", "LDG.E R36, desc[UR18][R94.64+0x4]"), [(0, 1, 3)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_which_loads_hold_back_others(case):
    lines, want = CASES[case]
    assert _found(_sass(*lines)) == want


def test_taint_flows_through_registers_and_ends_where_they_are_rewritten():
    sass = _sass("LDG.E R4, desc[UR16][R8.64]",
                 "IADD3 R6, R4, 0x1, RZ",       # first use; R6 now derived from the load
                 "MOV R6, 0x10",                # R6 rewritten from a constant: clean again
                 "LDG.E R7, desc[UR16][R6.64]")  # its address reads R6, R7: not derived from R4
    assert _found(sass) == [(0, 1, 3)]
    derived = _sass("LDG.E R4, desc[UR16][R8.64]",
                    "IADD3 R6, R4, 0x1, RZ",
                    "LDG.E R7, desc[UR16][R6.64]")  # depends on the first: nothing held back
    assert _found(derived) == []


def test_wide_loads_fill_their_registers_and_pairs_are_read_whole():
    sass = _sass("LDG.E.64 R8, desc[UR16][R6.64]",
                 "IADD3 R2, R9, 0x1, RZ",  # reads the load's second register
                 "LDG.E R3, desc[UR16][R10.64]")
    assert _found(sass) == [(0, 1, 2)]
    ins = lu.parse(_sass("LDG.E.128 R12, desc[UR16][R6.64]", "STG.E desc[UR16][R6.64], R15"))
    assert ins[0].writes == {12, 13, 14, 15} and ins[1].reads == {6, 7, 15} and not ins[1].writes


def test_late_uses_polls_and_stored_values_are_left_out_unless_asked():
    late = _sass("LDG.E R4, desc[UR16][R8.64]", *["NOP"] * 70, "IADD3 R6, R4, 0x1, RZ", "LDG.E R7, desc[UR16][R10.64]")
    assert _found(late) == [] and _found(late, gap=100) == [(0, 71, 72)]
    poll = _sass("LDG.E.STRONG.SYS R4, desc[UR16][R8.64]", "ISETP.NE.AND P0, PT, R4, RZ, PT",
                 "LDG.E R7, desc[UR16][R10.64]")
    assert _found(poll) == [] and _found(poll, everything=True) == [(0, 1, 2)]
    copy = _sass("LDG.E.128 R12, desc[UR16][R6.64]", "STG.E.128 desc[UR16][R8.64], R12",
                 "LDG.E.128 R12, desc[UR16][R6.64+0x200]")
    assert _found(copy) == [] and _found(copy, everything=True) == [(0, 1, 2)]


def test_predicated_instructions_parse_without_their_guard():
    ins = lu.parse(_sass("@!P0 LDG.E R35, desc[UR16][R16.64]", "@P1 BRA 0x100"))
    assert ins[0].op == "LDG.E" and ins[0].writes == {35} and ins[0].reads == {16, 17}
    assert ins[1].op == "BRA" and not ins[1].writes
