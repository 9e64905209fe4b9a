"""Which lines of sm_90's parameter bank each EP kernel reads, and a field order that keeps them few.

    python scripts/param_lines.py [--families combine_ll dispatch_ll ...] [--suggest] [--rounds 60000]

The EP kernels take one struct, EpArgs (specs/kernels.toml [args.ep]), which sm_90 places in the kernel's
constant bank at c[0x0][0x210]; every 64-byte line of the bank a kernel reads costs it a constant-cache miss on its
path at each launch (docs/PERF.md, "The parameter block's lines"), so the order of the fields is a cost. This builds
each family's bf16 intranode variant for sm_90 (the build cache makes a second run cheap), disassembles it and
prints, per kernel, the fields its SASS reads and the lines they fall on (the line at 0x200 also holds the driver's
descriptor at 0x208, which every kernel reads first: it is counted, and costs nothing more). tests/generator/
test_build.py holds the low-latency kernels' counts.

--suggest searches for an order (seeded swaps from the declared one: the same answer every run) that lowers the sum
over kernels of WEIGHTS x lines read, and prints it line by line, each line's fields in their declared order: where
to put a new field once the test says a kernel reads one line more.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from generator import build as B  # noqa: E402
from generator import specs as S  # noqa: E402
from generator import toolchain  # noqa: E402

ARGS_AT = 0x210  # sm_90: the kernel's first parameter in c[0x0]
LINE = 64  # bytes of a constant-cache line
FREE = 0x200 // LINE  # the line with the driver's descriptor (0x208): read by every kernel whatever the order
FAMILIES = ("combine_ll", "dispatch_ll", "dispatch_direct", "combine_gather", "dispatch_ll_tail", "dispatch",
            "combine_scatter")
#: what a line costs in each kernel, relative: the one-token kernels' misses are on their whole path, the bandwidth
#: kernels' are a smaller share of a longer kernel, the rest run where the layout's forms do not matter as much
WEIGHTS = {"combine_ll": 3.0, "dispatch_ll": 3.0, "dispatch_direct": 1.0, "combine_gather": 1.0,
           "dispatch_ll_tail": 0.5, "dispatch": 0.3, "combine_scatter": 0.3}
_OPERAND = re.compile(r"c\[0x0\]\[(0x[0-9a-f]+)\]")


class LinesError(Exception):
    pass


def offsets(sass: str) -> set[int]:
    """The c[0x0] offsets a disassembly reads (immediate operands of LDC / ULDC and of any instruction)."""
    return {int(m, 16) for m in _OPERAND.findall(sass)}


def lines_read(offs: set[int]) -> set[int]:
    """The bank's lines (numbered by LINE-byte blocks of c[0x0]) those offsets touch from the descriptor's line on."""
    return {o // LINE for o in offs if o >= FREE * LINE}


def fields_read(offs: set[int], names: list[str]) -> set[str]:
    """The struct's fields those offsets fall in (8 bytes each from ARGS_AT)."""
    return {names[(o - ARGS_AT) // 8] for o in offs if ARGS_AT <= o < ARGS_AT + 8 * len(names)}


def lines_of(order: list[str], fields: set[str]) -> set[int]:
    """The bank's lines (numbered by LINE-byte blocks of c[0x0]) that `fields` take in struct order `order`."""
    at = {n: i for i, n in enumerate(order)}
    return {(ARGS_AT + 8 * at[n]) // LINE for n in fields}


def cost(order: list[str], use: dict[str, set[str]]) -> float:
    return sum(WEIGHTS.get(k, 1.0) * len(lines_of(order, f) - {FREE}) for k, f in use.items())


def suggest(names: list[str], use: dict[str, set[str]], rounds: int = 60000, seed: int = 0) -> list[str]:
    """An order of `names` no costlier than the declared one: a walk of random swaps from it, each kept when it
    costs no more (seeded: deterministic), the cheapest order it met kept, then every line's fields in their
    declared order. Where nothing cheaper turns up, the declared order itself (no churn for nothing)."""
    rng, walk = random.Random(seed), list(names)
    walk_cost = best_cost = cost(walk, use)
    best = list(names)
    for _ in range(rounds):
        i, j = rng.sample(range(len(walk)), 2)
        walk[i], walk[j] = walk[j], walk[i]
        c = cost(walk, use)
        if c <= walk_cost:
            walk_cost = c
            if c < best_cost:
                best, best_cost = list(walk), c
        else:
            walk[i], walk[j] = walk[j], walk[i]
    line = {n: (ARGS_AT + 8 * i) // LINE for i, n in enumerate(best)}
    declared = {n: i for i, n in enumerate(names)}
    return sorted(names, key=lambda n: (line[n], declared[n]))


def kernel_sass(families: list[str], error=LinesError, specs=None) -> dict[str, str]:
    """-> each family's sm_90 bf16 intranode kernel's SASS (one build for all: the cache answers for those built
    before); failures raise `error` with one line that says which variant and why (scripts/load_use.py uses it too)."""
    specs = specs or S.load()
    built = {r.variant.key: r for r in B.build(specs, ["sm_90"], "all", only="sm_90/*.bf16.intranode")}
    out = {}
    for fam in families:
        key = f"sm_90/{fam}.bf16.intranode"
        r = built.get(key)
        if r is None:
            raise error(f"{key}: no such variant")
        if not r.ok or r.artifact is None:
            raise error(f"{key}: the build failed: {r.status} {r.message}".strip())
        tools = toolchain.find(r.variant.toolchain)
        res = toolchain.run(toolchain.disassemble_command(r.variant.target, tools, r.artifact), tools)
        if res.returncode != 0:
            raise error(f"{key}: the disassembler failed: {(res.stderr or res.stdout).strip()[:300]}")
        out[fam] = res.stdout
    return out


def kernel_reads(families: list[str]) -> tuple[list[str], dict[str, set[str]]]:
    """-> (the declared field names, the fields each family's sm_90 bf16 intranode kernel reads)."""
    specs = S.load()
    sig = specs.arglists.get("ep")
    if sig is None:
        raise LinesError("specs/kernels.toml has no [args.ep]")
    names = [f.name for f in sig.fields]
    return names, {fam: fields_read(offsets(sass), names) for fam, sass in kernel_sass(families, specs=specs).items()}


def table(names: list[str], use: dict[str, set[str]]) -> list[str]:
    rows = ["| kernel | fields read | lines read | lines |", "|---|---|---|---|"]
    for fam, fields in use.items():
        lines = sorted(lines_of(names, fields) | {FREE})
        rows.append(f"| {fam} | {len(fields)} | {len(lines)} | {' '.join(hex(n * LINE) for n in lines)} |")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--suggest", action="store_true", help="print a field order with fewer lines read")
    p.add_argument("--rounds", type=int, default=60000, help="swaps the search tries (--suggest)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: at least 1")
    try:
        names, use = kernel_reads(args.families)
    except (LinesError, OSError) as e:
        print(f"param_lines: {e}", file=sys.stderr)
        return 1
    print("\n".join(table(names, use)))
    if args.suggest:
        order = suggest(names, use, args.rounds)
        if order == names:
            print(f"\nthe declared order is the cheapest of {args.rounds} swaps tried (weighted lines {cost(names, use):g})")
            return 0
        print(f"\nsuggested order (weighted lines {cost(names, use):g} -> {cost(order, use):g}):")
        print("\n".join(table(order, use)))
        for i, n in enumerate(order):
            if i == 0 or (ARGS_AT + 8 * i) % LINE == 0:
                print(f"# line {hex((ARGS_AT + 8 * i) // LINE * LINE)}")
            print(f"  {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
