"""The checks of the specs that one field's domain cannot make: across the fields of one record,
and across records and files.

A target's toolchain, macro library and fp8 limit (_check_target, with _load_targets reading
targets.toml), a dtype's bits, format and scale block (_check_dtype), a quant's block and scale
against its wire kind, the narrowest target's wave and the dtypes of that wire kind (_check_quant),
what each kernel family names: dtypes, quants, topologies, ISA groups, its template
(_check_families), the rules' names and facts (_load_rules) and the launch buckets of
specs/tuning.toml against the targets they tune (_load_tuning). Each failure is a SpecError at the
line of the value it is about.
"""

from __future__ import annotations

import functools
from pathlib import Path

from . import spec_limits
from .abi import LL_MAX_TOKENS
from .spec_schema import (LL_THRESHOLD_KEY, TUNING_ROLES, Bucket, DType, Family, Quant, Rule, Target, Toolchain,
                          Topology, _check_name, _DTYPE_BITS, _FP8_FORMAT_MAX, _LANE_ELEMS, _LIBRARIES, _record,
                          _SCALE_WIRES, _section, fact_paths, program_problem)
from .spec_source import _fail, _Source, show


def _load_targets(src: _Source, data: dict, troot: Path) -> tuple[dict[str, Target], dict[str, Toolchain]]:
    """targets.toml: its [toolchain.NAME] and [target.NAME] tables, each target checked against its
    toolchain and the macro libraries under `troot` (the templates)."""
    for k in data:
        if k not in ("target", "toolchain"):
            raise _fail(src, src.table_line((k,)),
                        f"unknown top-level table {k!r} (expected [target.NAME] or [toolchain.NAME])")
    toolchains = {}
    for n, t in _section(src, data, "toolchain", "[toolchain.NAME]").items():
        _check_name(src, ("toolchain", n))
        toolchains[n] = _record(Toolchain, src, ("toolchain", n), t, name=n)
    targets = {}
    for n, t in _section(src, data, "target", "[target.NAME]").items():
        _check_name(src, ("target", n))
        targets[n] = _record(Target, src, ("target", n), t, name=n)
        _check_target(src, targets[n], toolchains, troot)
    if not targets:
        raise _fail(src, 1, "no [target.NAME] tables")
    return targets, toolchains


# Checks across the fields of one record (each field's own domain is checked as it is read).
def _check_target(src: _Source, t: Target, toolchains: dict[str, Toolchain], troot: Path) -> None:
    hdr = ("target", t.name)
    if t.toolchain not in toolchains:
        raise _fail(src, src.key_line(hdr, "toolchain"),
                    f"[{show(hdr)}] toolchain {t.toolchain!r} is not declared (known: {', '.join(toolchains)})")
    tc = toolchains[t.toolchain]
    for kind in ("compilers", "disassemblers"):
        for prog in getattr(tc, kind):
            why = program_problem(t.vendor, kind, prog)
            if why:
                raise _fail(src, src.key_line(("toolchain", tc.name), kind),
                            f"[toolchain.{tc.name}] {kind}: {why} (toolchain of [{show(hdr)}])")
    if t.library not in _LIBRARIES[t.vendor]:
        raise _fail(src, src.key_line(hdr, "library"), f"[{show(hdr)}] library {t.library!r}: the macro library of "
                                                      f"{t.vendor} targets is {' or '.join(_LIBRARIES[t.vendor])}")
    if t.programmatic_launch and t.vendor != "nvidia":  # cuLaunchKernelEx's attribute, griddepcontrol.wait in the kernels
        raise _fail(src, src.key_line(hdr, "programmatic_launch"), f"[{show(hdr)}] programmatic_launch: only nvidia "
                                                                   f"targets launch that way (this one is {t.vendor})")
    if not (troot / "targets" / f"{t.library}.j2").is_file():
        raise _fail(src, src.key_line(hdr, "library"),
                    f"[{show(hdr)}] library {t.library!r}: no templates/targets/{t.library}.j2")
    fmt_max = _FP8_FORMAT_MAX[t.fp8_e4m3]
    if not t.fp8_max <= fmt_max:
        raise _fail(src, src.key_line(hdr, "fp8_max"), f"[{show(hdr)}] fp8_max = {t.fp8_max!r}: more than "
                                                      f"{fmt_max:g}, the largest finite {t.fp8_e4m3} e4m3 value")
    if not spec_limits.float32_exact(t.fp8_max):  # rendered as `{fp8_max!r}f`: it must mean exactly that
        raise _fail(src, src.key_line(hdr, "fp8_max"), f"[{show(hdr)}] fp8_max = {t.fp8_max!r}: not exactly a 32-bit "
                                                      f"float (the kernels' float would hold "
                                                      f"{spec_limits.float32_value(t.fp8_max)!r})")
    # Hardware FP4 conversions must name the instructions that prove them.
    if t.fp4_conversion in ("pairs", "pack8"):
        for conv in ("fp4_encode", "fp4_decode"):
            if not t.expected(conv):
                raise _fail(src, src.table_line(hdr + ("isa",)),
                            f"[{show(hdr)}] fp4_conversion = {t.fp4_conversion!r} needs isa.{conv} mnemonics")


def _check_dtype(src: _Source, d: DType) -> None:
    hdr = ("dtype", d.name)
    if d.bits not in _DTYPE_BITS[d.kind]:
        raise _fail(src, src.key_line(hdr, "bits"), f"[{show(hdr)}] bits = {d.bits}: a {d.kind!r} dtype has "
                                                    f"{' or '.join(map(str, _DTYPE_BITS[d.kind]))} bits")
    if (d.fp8_format != "") != (d.kind == "fp8"):
        raise _fail(src, src.key_line(hdr, "fp8_format"),
                    f"[{show(hdr)}] fp8_format = {d.fp8_format!r}: an fp8 dtype names its format, no other does")
    if (d.scale_block != 0) != (d.kind == "fp4"):
        raise _fail(src, src.key_line(hdr, "scale_block"),
                    f"[{show(hdr)}] scale_block = {d.scale_block}: an fp4 dtype has one (> 0), no other does")


def _check_quant(src: _Source, q: Quant, dtypes: dict[str, DType], targets: dict[str, Target]) -> None:
    hdr = ("quant", q.name)
    if (q.block == 0) != (q.scale == "none"):
        raise _fail(src, src.key_line(hdr, "block"),
                    f"[{show(hdr)}] block = {q.block} with scale = {q.scale!r}: a scale needs a block > 0, a block a scale")
    if q.wire_kind not in _SCALE_WIRES[q.scale]:
        raise _fail(src, src.key_line(hdr, "scale"), f"[{show(hdr)}] scale = {q.scale!r} does not serve wire_kind = "
                                                     f"{q.wire_kind!r} (it serves {', '.join(_SCALE_WIRES[q.scale])})")
    lanes = min(t.wave_size for t in targets.values())
    if q.block > _LANE_ELEMS * lanes:
        raise _fail(src, src.key_line(hdr, "block"), f"[{show(hdr)}] block = {q.block}: one block is at most one "
                                                     f"wave of {lanes} lanes x {_LANE_ELEMS} elements")
    for d in dtypes.values():
        if d.kind == q.wire_kind and d.scale_block and d.scale_block != q.block:
            raise _fail(src, src.key_line(hdr, "block"), f"[{show(hdr)}] block = {q.block}: dtype {d.name!r} "
                                                         f"shares one scale per {d.scale_block} elements")



def _check_axis_names(srcs: dict[str, _Source], dtypes: dict[str, DType], quants: dict[str, Quant],
                      topologies: dict[str, Topology]) -> None:
    """A variant is named family.dtype[.wire][.quant][.topology] (the wire when it differs from the dtype,
    the quant unless "none", the topology if any): a quant or topology named like a dtype, or a topology
    like a quant, would let two combinations share one name (one source silently replacing another)."""
    for file, section, names, others in (("quant", "quant", quants, (("dtype", dtypes),)),
                                         ("topologies", "topology", topologies, (("dtype", dtypes), ("quant", quants)))):
        for name in names:
            for kind, pool in others:
                if name in pool:
                    raise _fail(srcs[file], srcs[file].table_line((section, name)),
                                f"[{section}.{name}] the name {name!r} is also a {kind}'s: variant names "
                                f"(family.dtype.wire.quant.topology) would be ambiguous")


def _check_families(src: _Source, families: dict[str, Family], dtypes: dict[str, DType], quants: dict[str, Quant],
                    topologies: dict[str, Topology], targets: dict[str, Target], troot: Path,
                    arglists: dict) -> None:
    """What each [family.NAME] of kernels.toml names: declared dtypes, quants and topologies, ISA groups
    some target declares, a template under `troot`, a declared [args.NAME] table."""
    known_conv = {c for t in targets.values() for c, _ in t.isa} | {c for t in targets.values() for c, _ in t.isa_forbidden}
    for fam in families.values():
        hdr = ("family", fam.name)
        for key, pool, values in (("dtypes", dtypes, fam.dtypes), ("wire_dtypes", dtypes, fam.wire_dtypes),
                                  ("quants", quants, fam.quants), ("topologies", topologies, fam.topologies)):
            for v in values:
                if v not in pool and not (key == "wire_dtypes" and v == "same"):
                    raise _fail(src, src.key_line(hdr, key),
                                f"[{show(hdr)}] {key}: unknown {key[:-1]} {v!r} (known: {', '.join(pool)})")
        for x in fam.wire_isa:
            if x not in ("encode", "decode"):
                raise _fail(src, src.key_line(hdr, "wire_isa"), f"[{show(hdr)}] wire_isa: {x!r} must be 'encode' or 'decode'")
        for key, groups in (("isa", fam.isa), ("copy_isa", fam.copy_isa)):
            for c in groups:
                if c not in known_conv:
                    raise _fail(src, src.key_line(hdr, key),
                                f"[{show(hdr)}] {key}: {c!r} is not an [isa] key of any target (known: {', '.join(sorted(known_conv))})")
        if not (troot / fam.template).is_file():
            raise _fail(src, src.key_line(hdr, "template"), f"[{show(hdr)}] template {fam.template!r}: no such file in templates/")
        if fam.args not in arglists:
            raise _fail(src, src.key_line(hdr, "args"), f"[{show(hdr)}] args {fam.args!r}: no [args.{fam.args}] table "
                                                      f"(declared: {', '.join(arglists) or 'none'})")


def _load_rules(src: _Source, data: dict) -> list[Rule]:
    unknown = [k for k in data if k != "rule"]
    if unknown:
        raise _fail(src, src.table_line((unknown[0],)), f"unknown top-level table {unknown[0]!r} (expected [[rule]])")
    tables = data.get("rule", [])
    if not isinstance(tables, list):
        raise _fail(src, src.table_line(("rule",)), "rules must be an array of tables: [[rule]]")
    rules: list[Rule] = []
    known = fact_paths()
    seen: dict[str, int] = {}
    for i, table in enumerate(tables):
        line = src.table_line(("rule",), i)
        rule = _record(Rule, src, ("rule",), table, occurrence=i, where=src.where(line))
        if rule.name in seen:
            raise _fail(src, src.key_line(("rule",), "name", i),
                        f"duplicate rule name {rule.name!r} (first at line {seen[rule.name]})")
        if not rule.when:
            raise _fail(src, line, f"rule {rule.name!r}: 'when' must not be empty")
        for key, clause in (("when", rule.when), ("unless", rule.unless)):
            for path, _ in clause:
                if path not in known:
                    raise _fail(src, src.key_line(("rule",), key, i),
                                f"rule {rule.name!r}: unknown fact {path!r} (known: {', '.join(sorted(known))})")
        seen[rule.name] = line
        rules.append(rule)
    return rules


def _load_tuning(src: _Source, data: dict, targets: dict[str, Target], complete: bool = True,
                 fallback: bool = True) -> tuple[dict, dict[str, int]]:
    """The tables of one tuning file. fallback: each (target, role) has buckets without `world` (a user file may
    tune one world size only); complete: also every target's roles and the defaults (_complete_tuning)."""
    unknown = [k for k in data if k != "tuning"]
    if unknown:
        raise _fail(src, src.table_line((unknown[0],)),
                    f"unknown top-level table {unknown[0]!r} (expected [[tuning.TARGET.ROLE]])")
    out = {}
    ll_max: dict[str, int] = {}
    for tname, roles in _section(src, data, "tuning", "[[tuning.TARGET.ROLE]]").items():
        if tname not in targets:
            raise _fail(src, src.table_line(("tuning", tname)),
                        f"tuning for unknown target {tname!r} (known: {', '.join(targets)})")
        wave = targets[tname].wave_size
        if not isinstance(roles, dict):
            raise _fail(src, src.table_line(("tuning", tname)), f"tuning.{tname} must hold [[tuning.{tname}.ROLE]] tables")
        roles = dict(roles)
        if LL_THRESHOLD_KEY in roles:
            n = roles.pop(LL_THRESHOLD_KEY)
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= LL_MAX_TOKENS:
                raise _fail(src, src.key_line(("tuning", tname), LL_THRESHOLD_KEY),
                            f"[tuning.{tname}] {LL_THRESHOLD_KEY} = {n!r}: an integer in [0, {LL_MAX_TOKENS}]")
            ll_max[tname] = n
        for role, buckets in roles.items():
            path = ("tuning", tname, role)
            hdr = show(path)
            if role not in TUNING_ROLES:
                raise _fail(src, src.table_line(path), f"[[{hdr}]]: unknown role {role!r} (known: {', '.join(TUNING_ROLES)})")
            if not isinstance(buckets, list) or not buckets:
                raise _fail(src, src.table_line(path), f"{hdr} must be an array of tables: [[{hdr}]]")
            recs = [_record(Bucket, src, path, b, occurrence=i) for i, b in enumerate(buckets)]
            recs_of: dict[int, list[Bucket]] = {}  # by world size, in file order
            for i, rec in enumerate(recs):
                line = functools.partial(src.table_line, path, i)
                if rec.threads % wave:
                    raise _fail(src, src.key_line(path, "threads", i),
                                f"[[{hdr}]] threads = {rec.threads}: a multiple of the wave size {wave}, at most 1024")
                if rec.rows != "wave" and role != "dispatch":
                    raise _fail(src, src.key_line(path, "rows", i), f"[[{hdr}]] rows = {rec.rows!r}: only dispatch copies rows")
                group = recs_of.setdefault(rec.world, [])
                last = all(later.world != rec.world for later in recs[i + 1:])
                of = f" (world = {rec.world})" if rec.world else ""
                if (rec.max_tokens == 0) != last:
                    raise _fail(src, line, f"[[{hdr}]] only the last bucket{of} has max_tokens = 0 (no limit), and it must")
                if group and rec.max_tokens and rec.max_tokens <= group[-1].max_tokens:
                    raise _fail(src, line, f"[[{hdr}]] buckets{of} must ascend: max_tokens {rec.max_tokens} after "
                                           f"{group[-1].max_tokens}")
                group.append(rec)
            if 0 not in recs_of and fallback:
                raise _fail(src, src.table_line(path), f"[[{hdr}]] needs buckets without `world` (the fallback for any "
                                                       f"world size)")
            out[(tname, role)] = tuple(recs)
    return _complete_tuning(src, out, ll_max, targets) if complete else (out, ll_max)


def _complete_tuning(src: _Source, out: dict, ll_max: dict[str, int], targets: dict[str, Target]) -> tuple[dict, dict]:
    """Every target has its bandwidth kernels' buckets; the low-latency ones default to them; thresholds to 0."""
    out, ll_max = dict(out), dict(ll_max)
    for tname in targets:
        for role in TUNING_ROLES[:2]:
            if (tname, role) not in out:
                raise _fail(src, 1, f"no [[tuning.{tname}.{role}]] buckets")
        for role in TUNING_ROLES[2:]:  # the low-latency kernels take the bandwidth ones' geometry unless given
            out.setdefault((tname, role), out[(tname, role.removesuffix("_ll"))])
        ll_max.setdefault(tname, 0)  # absent: intranode_protocol "auto" never takes "ll"
    return out, ll_max
