"""The variant model: one frozen record per kernel variant, everything else derived from it."""

from __future__ import annotations

import fnmatch
import itertools
from typing import Iterable, Iterator

import attrs

from .specs import DType, Family, Profile, Quant, Rule, SpecError, Specs, Target, Toolchain, Topology

SYMBOL_PREFIX = "epg_"


@attrs.frozen
class Variant:
    family: Family
    dtype: DType
    wire: DType
    quant: Quant
    target: Target
    topology: Topology | None
    toolchain: Toolchain = attrs.field(eq=False, repr=False)

    # --- derived names -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """family.dtype[.wire][.quant][.topology] -- unique within a target."""
        parts = [self.family.name, self.dtype.name]
        if self.wire.name != self.dtype.name:
            parts.append(self.wire.name)
        if self.quant.name != "none":
            parts.append(self.quant.name)
        if self.topology is not None:
            parts.append(self.topology.name)
        return ".".join(parts)

    @property
    def key(self) -> str:
        """Manifest key: target/name."""
        return f"{self.target.name}/{self.name}"

    @property
    def symbol(self) -> str:
        """The kernel's extern "C" symbol (a C identifier: spec names are checked to be identifiers)."""
        return SYMBOL_PREFIX + self.name.replace(".", "__")

    @property
    def file(self) -> str:
        return f"{self.name}.{self.toolchain.extension}"

    @property
    def pytest_id(self) -> str:
        return self.key.replace("/", "-")

    @property
    def converts(self) -> bool:
        return self.wire.name != self.dtype.name

    @property
    def isa_groups(self) -> tuple[str, ...]:
        """The family's ISA groups, plus the wire conversion groups when this variant converts."""
        extra = tuple(f"{self.wire.kind}_{x}" for x in self.family.wire_isa) if self.converts else self.family.copy_isa
        return self.family.isa + extra

    @property
    def expected_isa(self) -> tuple[str, ...]:
        return tuple(m for c in self.isa_groups for m in self.target.expected(c))

    @property
    def forbidden_isa(self) -> tuple[str, ...]:
        return tuple(m for c in self.isa_groups for m in self.target.forbidden(c))

    def facts(self) -> dict[str, str]:
        return combination_facts(self.family, self.dtype, self.wire, self.quant, self.target, self.topology)


def record_facts(ns: str, record) -> dict[str, str]:
    out = {ns: record.name}
    for f in attrs.fields(type(record)):
        v = getattr(record, f.name)
        if isinstance(v, str) and f.name != "name":
            out[f"{ns}.{f.name}"] = v
    return out


def combination_facts(family=None, dtype=None, wire=None, quant=None, target=None, topology=None) -> dict[str, str]:
    """Facts of a (possibly partial) combination; absent parts contribute no facts.

    "convert" is derived: "same" when the wire carries the dtype itself, else e.g. "float_to_fp8".
    """
    facts: dict[str, str] = {}
    for ns, rec in (("family", family), ("dtype", dtype), ("wire", wire), ("quant", quant),
                    ("target", target), ("topology", topology)):
        if rec is not None:
            facts.update(record_facts(ns, rec))
    if dtype is not None and wire is not None:
        facts["convert"] = "same" if wire.name == dtype.name else f"{dtype.kind}_to_{wire.kind}"
    return facts


def _clause_matches(clause, facts: dict[str, str]) -> bool:
    return all(path in facts and facts[path] in values for path, values in clause)


def rejecting_rule(rules: Iterable[Rule], facts: dict[str, str]) -> Rule | None:
    """The first rule that rejects these facts, or None. A rule whose facts are absent does not apply."""
    for rule in rules:
        if _clause_matches(rule.when, facts) and not (rule.unless and _clause_matches(rule.unless, facts)):
            return rule
    return None


@attrs.frozen
class Rejection:
    """A combination of declared axes that a rule excludes."""
    key: str
    rule: Rule


def _family_combos(specs: Specs, fam: Family, target: Target) -> Iterator[tuple]:
    wires = fam.wire_dtypes or ("same",)
    topos = fam.topologies or (None,)
    seen = set()
    for d, w, q, t in itertools.product(fam.dtypes, wires, fam.quants, topos):
        w = d if w == "same" else w  # "same" and the dtype's own name are one combination
        if (d, w, q, t) in seen:
            continue
        seen.add((d, w, q, t))
        yield specs.dtypes[d], specs.dtypes[w], specs.quants[q], (specs.topologies[t] if t else None)


def _glob_ok(value: str | None, patterns: tuple[str, ...]) -> bool:
    return not patterns or (value is not None and any(fnmatch.fnmatchcase(value, p) for p in patterns))


def in_profile(v: Variant, profile: Profile) -> bool:
    return (_glob_ok(v.family.name, profile.families) and _glob_ok(v.dtype.name, profile.dtypes)
            and _glob_ok(v.wire.name, profile.wire_dtypes) and _glob_ok(v.quant.name, profile.quants)
            and _glob_ok(v.topology.name if v.topology else None, profile.topologies))


def _combo(v: Variant) -> str:
    return (f"family {v.family.name!r}, dtype {v.dtype.name!r}, wire {v.wire.name!r}, quant {v.quant.name!r}"
            + (f", topology {v.topology.name!r}" if v.topology else ""))


def _unique(named: dict[str, Variant], v: Variant) -> None:
    """Two combinations may never share a variant name (one source and one manifest entry would silently
    replace the other): SpecError naming both. The loader keeps the names of the axes apart; this is the
    check of the names themselves."""
    first = named.setdefault(v.key, v)
    if first is not v:
        raise SpecError(f"{v.key}: two combinations have this variant name ({_combo(first)}; {_combo(v)}): "
                        f"dtype, quant and topology names must not be mistaken for one another")


def enumerate_variants(specs: Specs, targets: Iterable[str], profile: str = "all",
                       only: str | None = None) -> tuple[list[Variant], list[Rejection]]:
    """Product over every family's declared axes for each target, filtered by the rules.

    Returns the admitted variants (sorted by key) and the rejected combinations with their rule.
    """
    prof = specs.profiles[profile]
    named: dict[str, Variant] = {}  # every combination of every family (any profile): one name each
    variants: list[Variant] = []
    rejected: list[Rejection] = []
    for tname in targets:
        target = specs.targets[tname]
        toolchain = specs.toolchains[target.toolchain]
        for fam in specs.families.values():
            for dtype, wire, quant, topo in _family_combos(specs, fam, target):
                v = Variant(fam, dtype, wire, quant, target, topo, toolchain)
                _unique(named, v)
                if not in_profile(v, prof) or (only and not fnmatch.fnmatchcase(v.name, only)
                                               and not fnmatch.fnmatchcase(v.key, only)):
                    continue
                rule = rejecting_rule(specs.rules, v.facts())
                if rule is None:
                    variants.append(v)
                else:
                    rejected.append(Rejection(v.key, rule))
    variants.sort(key=lambda v: v.key)
    rejected.sort(key=lambda r: r.key)
    return variants, rejected
