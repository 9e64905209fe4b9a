"""Loads that hold back later loads: in a kernel's sm_90 SASS, a global load whose value is used before a later,
independent load is issued.

    python scripts/load_use.py [--families combine_ll dispatch_ll ...] [--gap 64] [--window 400] [--all]

A warp issues in order and stalls at the first instruction that reads a register a load has not filled yet. When a
load's value is used (a sign extended, an address worked out, a branch decided) before a later load that does not
depend on it, the two round trips run one after the other where they could have overlapped. Two of the one-token
kernels' costs were this (docs/PERF.md, "dispatch_ll's message words" and the combine_ll notes after it): a select
that made ptxas issue each reduce cell's load right behind its own slot's (eight round trips in a row), and a
source token whose sign extension ptxas hoisted ahead of the row's loads.

This builds each family's bf16 intranode variant for sm_90 (the build cache makes a second run cheap), disassembles
it and prints, per kernel, every global or generic load (LDG, LD) whose first use comes within --gap instructions
(before the warp has other work to issue) and before another load that reads nothing derived from it, within
--window instructions in layout order: the load, its first use, the load held back. Layout order is not execution
order (branches, loops), so each row is a place to look, not a verdict. Left out unless --all: loads that poll a flag
in a loop (.STRONG.SYS), and loads whose first use stores the value (a copy loop's batches).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path


def _param_lines():
    """scripts/param_lines.py (the build and the disassembly of each family's kernel), loaded from beside this file."""
    spec = importlib.util.spec_from_file_location("param_lines", Path(__file__).resolve().parent / "param_lines.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FAMILIES = ("dispatch_ll", "combine_ll", "dispatch_direct", "combine_gather", "dispatch_ll_tail")
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_REG = re.compile(r"\bR(\d+)(\.64)?\b")
#: opcodes whose first register operand is read, not written
_NO_DEST = ("ST", "STG", "STS", "STL", "RED", "BRA", "EXIT", "BAR", "MEMBAR", "BSYNC", "BSSY", "WARPSYNC", "CALL",
            "RET", "NOP", "ERRBAR", "CGAERRBAR", "CCTL", "YIELD")
_WIDTH = {"64": 2, "128": 4}


class LoadUseError(Exception):
    pass


class Ins:
    """One SASS instruction: its index (address / 16), opcode (with modifiers), the registers it writes and reads."""

    __slots__ = ("at", "text", "op", "writes", "reads")

    def __init__(self, at: int, text: str):
        self.at, self.text = at, text
        body = re.sub(r"^@!?U?P\w+\s+", "", text)  # the guard predicate
        self.op, _, operands = body.partition(" ")
        base = self.op.split(".")[0]
        regs = []  # (register numbers of one operand) in operand order
        for m in _REG.finditer(operands):
            n = int(m.group(1))
            regs.append([n, n + 1] if m.group(2) else [n])
        self.writes: set[int] = set()
        self.reads: set[int] = set()
        first_is_dest = bool(regs) and base not in _NO_DEST and re.match(r"\s*R\d+", operands) is not None
        for i, r in enumerate(regs):
            (self.writes if first_is_dest and i == 0 else self.reads).update(r)
        if first_is_dest and self.is_load:  # a wide load fills consecutive registers
            width = next((_WIDTH[w] for w in self.op.split(".") if w in _WIDTH), 1)
            self.writes = set(range(regs[0][0], regs[0][0] + width))

    @property
    def is_load(self) -> bool:
        return self.op.split(".")[0] in ("LDG", "LD")

    @property
    def is_poll(self) -> bool:
        return "STRONG.SYS" in self.op


def parse(sass: str) -> list[Ins]:
    return [Ins(int(m.group(1), 16) // 16, m.group(2).strip()) for m in _LINE.finditer(sass)]


def held(ins: list[Ins], window: int = 400, gap: int = 64, everything: bool = False) -> list[tuple[Ins, Ins, Ins]]:
    """(load, its first use, the first later load independent of it) for every load used within `gap` instructions
    and before such a load; with everything, polls and stored values too."""
    out = []
    for k, a in enumerate(ins):
        if not a.is_load or not a.writes or (a.is_poll and not everything):
            continue
        tainted = set(a.writes)
        use = None
        for b in ins[k + 1:k + 1 + window]:
            if b.op.startswith(("EXIT", "RET")):
                break
            reads_taint = bool(b.reads & tainted)
            if use is None and reads_taint:
                use = b
                if b.at - a.at > gap or (not everything and b.op.split(".")[0] in ("ST", "STG", "STS")):
                    break  # used late enough to overlap, or just stored
            elif use is not None and b.is_load and not reads_taint and (everything or not b.is_poll):
                out.append((a, use, b))
                break
            if b.writes:  # taint flows through what reads it; a register written from clean values is clean again
                if reads_taint:
                    tainted |= b.writes
                else:
                    tainted -= b.writes
            if not tainted:
                break
    return out


def table(fam: str, rows: list[tuple[Ins, Ins, Ins]]) -> list[str]:
    out = [f"{fam}: {len(rows)} load(s) used before a later independent load", "",
           "| load | at | first use | at | load held back | at |", "|---|---|---|---|---|---|"]
    out += [f"| `{a.text}` | {a.at} | `{u.text}` | {u.at} | `{b.text}` | {b.at} |" for a, u, b in rows]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--gap", type=int, default=64, help="a first use at most this many instructions after its load "
                   "(default 64)")
    p.add_argument("--window", type=int, default=400, help="instructions after a load to look at (default 400)")
    p.add_argument("--all", action="store_true", help="polling loads (.STRONG.SYS) and stored values too")
    args = p.parse_args(argv)
    for name in ("gap", "window"):
        if not 1 <= getattr(args, name) <= 100000:
            p.error(f"--{name} {getattr(args, name)}: from 1 to 100000")
    try:
        sass = _param_lines().kernel_sass(args.families, LoadUseError)
    except (LoadUseError, OSError) as e:
        print(f"load_use: {e}", file=sys.stderr)
        return 1
    for fam, text in sass.items():
        print("\n".join(table(fam, held(parse(text), args.window, args.gap, args.all))))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
