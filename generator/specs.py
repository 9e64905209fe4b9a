"""Spec loader: TOML files under specs/ -> frozen attrs records.

Every problem is reported as one ``file:line: message`` (SpecError), never a traceback:
TOML syntax errors and duplicate keys (from tomllib), unknown keys, missing keys, wrong types,
unknown references between files. Spec text is data only; nothing in it is evaluated.
Strings are single-line text (no control characters), and a description may not end in a
backslash: descriptions land in a ``//`` comment of the generated source, where a newline or a
line-continuation backslash would turn the rest of the value (or the next line) into code.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any

import attrs

from .abi import LL_MAX_TOKENS

SPEC_FILES = ("targets", "dtypes", "quant", "topologies", "kernels", "rules", "profiles", "tuning")
TUNING_ROLES = ("dispatch", "combine", "dispatch_ll", "combine_ll")
LL_THRESHOLD_KEY = "intranode_ll_max_tokens"  # [tuning.TARGET]: intranode_protocol "auto" picks "ll" up to it


class SpecError(Exception):
    """A spec problem, located: str(err) is 'file:line: message'."""


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------
_frozen = attrs.frozen(kw_only=True)


@_frozen
class Toolchain:
    name: str
    compilers: tuple[str, ...]
    min_clang: int
    extension: str
    artifact: str
    disassemblers: tuple[str, ...]
    install_hint: str


@_frozen
class Target:
    name: str
    vendor: str
    description: str
    library: str
    wave_size: int
    fp8_e4m3: str
    fp8_max: float
    fp4_conversion: str
    toolchain: str
    flags: tuple[str, ...]
    isa: tuple[tuple[str, tuple[str, ...]], ...] = ()
    isa_forbidden: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def expected(self, conversion: str) -> tuple[str, ...]:
        return dict(self.isa).get(conversion, ())

    def forbidden(self, conversion: str) -> tuple[str, ...]:
        return dict(self.isa_forbidden).get(conversion, ())


@_frozen
class DType:
    name: str
    torch: str
    bits: int
    kind: str
    fp8_format: str = ""
    scale_block: int = 0

    @property
    def bytes_per_element(self) -> float:
        return self.bits / 8


@_frozen
class Quant:
    name: str
    wire_kind: str
    block: int
    scale: str


@_frozen
class Topology:
    name: str
    kind: str
    description: str


@_frozen
class Family:
    name: str
    template: str
    role: str
    description: str
    dtypes: tuple[str, ...]
    wire_dtypes: tuple[str, ...]
    quants: tuple[str, ...]
    topologies: tuple[str, ...]
    isa: tuple[str, ...]
    wire_isa: tuple[str, ...] = ()  # "encode"/"decode": add <wire kind>_<x> groups when the variant converts
    copy_isa: tuple[str, ...] = ()  # groups added when the variant moves its payload unconverted
    protocol: str = "bw"  # intranode wire protocol: "bw" (bandwidth) or "ll" (low latency)


@_frozen
class Rule:
    name: str
    message: str
    when: tuple[tuple[str, tuple[str, ...]], ...]
    unless: tuple[tuple[str, tuple[str, ...]], ...] = ()
    where: str = ""  # file:line, for messages about the rule itself


@_frozen
class Profile:
    name: str
    description: str
    families: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    wire_dtypes: tuple[str, ...] = ()
    quants: tuple[str, ...] = ()
    topologies: tuple[str, ...] = ()


@_frozen
class Bucket:
    """Launch geometry for calls of at most max_tokens tokens per rank (0 = no limit)."""
    max_tokens: int
    blocks: int
    threads: int
    rows: str = "wave"  # dispatch: who copies one (token, rank) row, a "wave" or a whole "block"
    world: int = 0  # the ops' rank count these buckets are for; 0: any (the fallback)


@_frozen
class Specs:
    root: Path
    targets: dict[str, Target]
    toolchains: dict[str, Toolchain]
    dtypes: dict[str, DType]
    quants: dict[str, Quant]
    topologies: dict[str, Topology]
    families: dict[str, Family]
    rules: tuple[Rule, ...]
    profiles: dict[str, Profile]
    tuning: dict[tuple[str, str], tuple[Bucket, ...]]  # (target, role) -> ascending buckets
    ll_max_tokens: dict[str, int]  # target -> intranode_ll_max_tokens (0: auto never takes "ll")
    digest: str  # sha256 of the spec texts that shape generated sources (all but tuning.toml)


# Enumerated values (a typo in the spec is an error, not a silently different variant).
_CHOICES = {
    (Target, "vendor"): ("amd", "nvidia"),
    (Target, "fp8_e4m3"): ("ocp", "fnuz"),
    (Target, "fp4_conversion"): ("none", "pairs", "pack8", "software"),
    (Bucket, "rows"): ("wave", "block"),
    (DType, "kind"): ("float", "fp8", "fp4", "int"),
    (DType, "fp8_format"): ("", "ocp", "fnuz"),
    (Quant, "wire_kind"): ("none", "fp8", "fp4"),
    (Quant, "scale"): ("none", "fp32", "e8m0"),
    (Topology, "kind"): ("intranode", "internode"),
    (Family, "role"): ("convert", "dispatch", "combine"),
    (Family, "protocol"): ("bw", "ll"),
}

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # C0 controls but tab, and DEL


def _check_text(src: "_Source", line: int, header: str, key: str, value: str) -> str:
    if _CONTROL.search(value):
        raise _fail(src, line, f"[{header}] {key}: control characters (newlines included) are not allowed in "
                               f"spec strings, got {value!r}")
    if key == "description" and value.endswith("\\"):
        raise _fail(src, line, f"[{header}] {key}: must not end with a backslash (it would continue the "
                               f"generated source's comment line), got {value!r}")
    return value

# Fact namespaces a rule may match on: "<ns>" is the record's name, "<ns>.<field>" a string field.
FACT_SOURCES = {"family": Family, "dtype": DType, "wire": DType, "quant": Quant, "target": Target,
                "topology": Topology}


def fact_paths() -> set[str]:
    paths = set(FACT_SOURCES) | {"convert"}
    for ns, cls in FACT_SOURCES.items():
        attrs.resolve_types(cls)
        paths |= {f"{ns}.{f.name}" for f in attrs.fields(cls) if f.type is str and f.name != "name"}
    return paths


# ---------------------------------------------------------------------------------------------
# Locating things in the TOML text (tomllib keeps no positions)
# ---------------------------------------------------------------------------------------------
class _Source:
    def __init__(self, path: Path, text: str):
        self.path = path
        self.lines = text.splitlines()

    def where(self, line: int) -> str:
        rel = os.path.relpath(self.path)
        return f"{rel if not rel.startswith('..') else self.path}:{line}"

    def table_line(self, header: str, occurrence: int = 0) -> int:
        """Line of `[header]` (or `[[header]]`, the occurrence-th one); 1 if not found."""
        pat = re.compile(r"^\s*\[\[?\s*" + re.escape(header).replace(r"\.", r"\s*\.\s*") + r"\s*\]\]?\s*(#.*)?$")
        seen = 0
        for i, line in enumerate(self.lines, 1):
            if pat.match(line):
                if seen == occurrence:
                    return i
                seen += 1
        return 1

    def key_line(self, header: str, key: str, occurrence: int = 0) -> int:
        """Line of `key =` inside table `header` (also `header.key = ` / inline forms)."""
        start = self.table_line(header, occurrence)
        key_pat = re.compile(r'^\s*("?)' + re.escape(key) + r'\1\s*=')
        sub_pat = re.compile(r"^\s*\[\[?\s*" + re.escape(header + "." + key) + r"\s*\]")
        for i in range(start, len(self.lines) + 1):
            line = self.lines[i - 1]
            if i > start and re.match(r"^\s*\[", line) and not sub_pat.match(line):
                break
            if key_pat.match(line) or sub_pat.match(line):
                return i
        # sub-table declared elsewhere
        for i, line in enumerate(self.lines, 1):
            if sub_pat.match(line):
                return i
        return start


def _fail(src: _Source, line: int, msg: str) -> SpecError:
    return SpecError(f"{src.where(line)}: {msg}")


def _read(path: Path) -> tuple[_Source, dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    src = _Source(path, text)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
        line = int(m.group(1)) if m else 1
        msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(e))
        raise _fail(src, line, f"invalid TOML: {msg}") from None
    return src, data


# ---------------------------------------------------------------------------------------------
# Typed conversion of one table into a record
# ---------------------------------------------------------------------------------------------
def _type_name(tp: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number", tuple: "a list of strings"}.get(tp, str(tp))


def _convert(src: _Source, header: str, key: str, value: Any, tp: Any, occurrence: int) -> Any:
    line = src.key_line(header, key, occurrence)
    base = getattr(tp, "__origin__", tp)
    if base is tuple:
        args = getattr(tp, "__args__", (str, ...))
        if args[0] is str:
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise _fail(src, line, f"[{header}] {key}: expected a list of strings, got {value!r}")
            if len(set(value)) != len(value):
                raise _fail(src, line, f"[{header}] {key}: duplicate entries in {value!r}")
            return tuple(_check_text(src, line, header, key, v) for v in value)
        # mapping: name -> list of strings (isa tables, rule clauses)
        if not isinstance(value, dict):
            raise _fail(src, line, f"[{header}] {key}: expected a table, got {value!r}")
        out = []
        for k in sorted(value):
            v = value[k]
            if isinstance(v, str):
                v = [v]
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise _fail(src, line, f"[{header}] {key}.{k}: expected a string or a list of strings, got {v!r}")
            out.append((k, tuple(_check_text(src, line, header, f"{key}.{k}", x) for x in v)))
        return tuple(out)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(src, line, f"[{header}] {key}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(src, line, f"[{header}] {key}: expected an integer, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise _fail(src, line, f"[{header}] {key}: expected a string, got {value!r}")
        return _check_text(src, line, header, key, value)
    raise AssertionError(tp)


def _record(cls: type, src: _Source, header: str, table: Any, occurrence: int = 0, **extra: Any) -> Any:
    line = src.table_line(header, occurrence)
    if not isinstance(table, dict):
        raise _fail(src, line, f"[{header}] must be a table")
    fields = {f.name: f for f in attrs.fields(cls)}
    attrs.resolve_types(cls)
    hints = {f.name: f.type for f in attrs.fields(cls)}
    for key in table:
        if key not in fields or key in extra:
            known = ", ".join(n for n in fields if n not in extra)
            raise _fail(src, src.key_line(header, key, occurrence), f"[{header}] unknown key '{key}' (known: {known})")
    values = dict(extra)
    for name, f in fields.items():
        if name in extra:
            continue
        if name not in table:
            if f.default is attrs.NOTHING:
                raise _fail(src, line, f"[{header}] missing required key '{name}'")
            continue
        values[name] = _convert(src, header, name, table[name], hints[name], occurrence)
        choices = _CHOICES.get((cls, name))
        if choices is not None and values[name] not in choices:
            raise _fail(src, src.key_line(header, name, occurrence),
                        f"[{header}] {name} = {values[name]!r}: must be one of {', '.join(repr(c) for c in choices)}")
    return cls(**values)


def _named_tables(src: _Source, data: dict, section: str, cls: type) -> dict[str, Any]:
    unknown = [k for k in data if k != section]
    if unknown:
        raise _fail(src, src.table_line(unknown[0]), f"unknown top-level table '{unknown[0]}' (expected [{section}.NAME])")
    out = {}
    for name, table in data.get(section, {}).items():
        if not _IDENT.match(name):
            raise _fail(src, src.table_line(f"{section}.{name}"), f"name {name!r} is not a C identifier")
        out[name] = _record(cls, src, f"{section}.{name}", table, name=name)
    if not out:
        raise _fail(src, 1, f"no [{section}.NAME] tables")
    return out


# ---------------------------------------------------------------------------------------------
# Loading all specs
# ---------------------------------------------------------------------------------------------
SPECS_ENV = "EPGEN_SPECS_DIR"


def checkout_root() -> Path | None:
    """The project checkout this package runs from (specs/ and templates/ beside generator/), or None
    when it runs from an installed distribution."""
    top = Path(__file__).resolve().parent.parent
    if (top / "specs" / "targets.toml").is_file() and (top / "templates" / "variant.j2").is_file():
        return top
    return None


def packaged_root() -> Path:
    """generator/data/: the specs/ and templates/ shipped inside the distribution (pyproject.toml)."""
    import importlib.resources

    return Path(str(importlib.resources.files("generator"))) / "data"


def default_root() -> Path:
    """The specs folder: $EPGEN_SPECS_DIR when set (as --specs), else the checkout's specs/ (a clone
    or an editable install), else the copy shipped in the installed package."""
    env = os.environ.get(SPECS_ENV)
    if env:
        return Path(env)
    return (checkout_root() or packaged_root()) / "specs"


def is_packaged(root: Path) -> bool:
    """Are these the specs shipped inside the installed package (not a checkout's or a copy's)?"""
    return root.resolve() == (packaged_root() / "specs").resolve()


def templates_root(root: Path) -> Path:
    """The templates of a specs folder: templates/ beside it when there is one, else the default
    (the checkout's, else the packaged copy)."""
    beside = root.resolve().parent / "templates"
    if beside.is_dir():
        return beside
    return (checkout_root() or packaged_root()) / "templates"


def load(root: Path | str | None = None) -> Specs:
    import hashlib

    root = Path(root) if root is not None else default_root()
    srcs: dict[str, _Source] = {}
    data: dict[str, dict] = {}
    digest = hashlib.sha256()
    for name in SPEC_FILES:
        path = root / f"{name}.toml"
        if not path.is_file():
            raise SpecError(f"{path}:1: spec file missing")
        srcs[name], data[name] = _read(path)
        if name != "tuning":  # launch geometry is runtime data: it changes no generated source
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")

    # targets.toml holds [target.*] and [toolchain.*]
    tsrc, tdata = srcs["targets"], data["targets"]
    for k in tdata:
        if k not in ("target", "toolchain"):
            raise _fail(tsrc, tsrc.table_line(k), f"unknown top-level table '{k}' (expected [target.NAME] or [toolchain.NAME])")
    toolchains = {n: _record(Toolchain, tsrc, f"toolchain.{n}", t, name=n) for n, t in tdata.get("toolchain", {}).items()}
    targets = {}
    for n, t in tdata.get("target", {}).items():
        if not _IDENT.match(n):
            raise _fail(tsrc, tsrc.table_line(f"target.{n}"), f"name {n!r} is not a C identifier")
        targets[n] = tgt = _record(Target, tsrc, f"target.{n}", t, name=n)
        if tgt.toolchain not in toolchains:
            raise _fail(tsrc, tsrc.key_line(f"target.{n}", "toolchain"),
                        f"[target.{n}] toolchain {tgt.toolchain!r} is not declared (known: {', '.join(toolchains)})")
    if not targets:
        raise _fail(tsrc, 1, "no [target.NAME] tables")

    dtypes = _named_tables(srcs["dtypes"], data["dtypes"], "dtype", DType)
    quants = _named_tables(srcs["quant"], data["quant"], "quant", Quant)
    topologies = _named_tables(srcs["topologies"], data["topologies"], "topology", Topology)
    families = _named_tables(srcs["kernels"], data["kernels"], "family", Family)

    ksrc = srcs["kernels"]
    known_conv = {c for t in targets.values() for c, _ in t.isa} | {c for t in targets.values() for c, _ in t.isa_forbidden}
    for fam in families.values():
        hdr = f"family.{fam.name}"
        for key, pool, values in (("dtypes", dtypes, fam.dtypes), ("wire_dtypes", dtypes, fam.wire_dtypes),
                                  ("quants", quants, fam.quants), ("topologies", topologies, fam.topologies)):
            for v in values:
                if v not in pool and not (key == "wire_dtypes" and v == "same"):
                    raise _fail(ksrc, ksrc.key_line(hdr, key), f"[{hdr}] {key}: unknown {key[:-1]} {v!r} (known: {', '.join(pool)})")
        for x in fam.wire_isa:
            if x not in ("encode", "decode"):
                raise _fail(ksrc, ksrc.key_line(hdr, "wire_isa"), f"[{hdr}] wire_isa: {x!r} must be 'encode' or 'decode'")
        for key, groups in (("isa", fam.isa), ("copy_isa", fam.copy_isa)):
            for c in groups:
                if c not in known_conv:
                    raise _fail(ksrc, ksrc.key_line(hdr, key),
                                f"[{hdr}] {key}: {c!r} is not an [isa] key of any target (known: {', '.join(sorted(known_conv))})")
        troot = templates_root(root).resolve()
        if not (troot / fam.template).resolve().is_relative_to(troot):
            raise _fail(ksrc, ksrc.key_line(hdr, "template"), f"[{hdr}] template {fam.template!r} leaves templates/")

    # Hardware FP4 conversions must name the instructions that prove them.
    for t in targets.values():
        if t.fp4_conversion in ("pairs", "pack8"):
            for conv in ("fp4_encode", "fp4_decode"):
                if not t.expected(conv):
                    raise _fail(tsrc, tsrc.table_line(f"target.{t.name}.isa"),
                                f"[target.{t.name}] fp4_conversion = {t.fp4_conversion!r} needs isa.{conv} mnemonics")

    rules = _load_rules(srcs["rules"], data["rules"])
    profiles = _named_tables(srcs["profiles"], data["profiles"], "profile", Profile)
    for p in ("default", "all"):
        if p not in profiles:
            raise _fail(srcs["profiles"], 1, f"profile {p!r} must be declared")

    tuning, ll_max = _load_tuning(srcs["tuning"], data["tuning"], targets)
    return Specs(root=root, targets=targets, toolchains=toolchains, dtypes=dtypes, quants=quants,
                 topologies=topologies, families=families, rules=tuple(rules), profiles=profiles,
                 tuning=tuning, ll_max_tokens=ll_max, digest=digest.hexdigest())


def _load_rules(src: _Source, data: dict) -> list[Rule]:
    unknown = [k for k in data if k != "rule"]
    if unknown:
        raise _fail(src, src.table_line(unknown[0]), f"unknown top-level table '{unknown[0]}' (expected [[rule]])")
    tables = data.get("rule", [])
    if not isinstance(tables, list):
        raise _fail(src, src.table_line("rule"), "rules must be an array of tables: [[rule]]")
    rules: list[Rule] = []
    known = fact_paths()
    seen: dict[str, int] = {}
    for i, table in enumerate(tables):
        line = src.table_line("rule", i)
        rule = _record(Rule, src, "rule", table, occurrence=i, where=src.where(line))
        if rule.name in seen:
            raise _fail(src, src.key_line("rule", "name", i),
                        f"duplicate rule name {rule.name!r} (first at line {seen[rule.name]})")
        if not rule.when:
            raise _fail(src, line, f"rule {rule.name!r}: 'when' must not be empty")
        for path, _ in rule.when + rule.unless:
            if path not in known:
                raise _fail(src, src.key_line("rule", "when", i),
                            f"rule {rule.name!r}: unknown fact {path!r} (known: {', '.join(sorted(known))})")
        seen[rule.name] = line
        rules.append(rule)
    return rules


def _load_tuning(src: _Source, data: dict, targets: dict[str, Target]) -> tuple[dict, dict[str, int]]:
    unknown = [k for k in data if k != "tuning"]
    if unknown:
        raise _fail(src, src.table_line(unknown[0]), f"unknown top-level table '{unknown[0]}' (expected [[tuning.TARGET.ROLE]])")
    out = {}
    ll_max: dict[str, int] = {}
    for tname, roles in data.get("tuning", {}).items():
        if tname not in targets:
            raise _fail(src, src.table_line(f"tuning.{tname}"), f"tuning for unknown target {tname!r} (known: {', '.join(targets)})")
        wave = targets[tname].wave_size
        roles = dict(roles)
        if LL_THRESHOLD_KEY in roles:
            n = roles.pop(LL_THRESHOLD_KEY)
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= LL_MAX_TOKENS:
                raise _fail(src, src.key_line(f"tuning.{tname}", LL_THRESHOLD_KEY),
                            f"[tuning.{tname}] {LL_THRESHOLD_KEY} = {n!r}: an integer in [0, {LL_MAX_TOKENS}]")
            ll_max[tname] = n
        for role, buckets in roles.items():
            hdr = f"tuning.{tname}.{role}"
            if role not in TUNING_ROLES:
                raise _fail(src, src.table_line(hdr), f"[[{hdr}]]: unknown role {role!r} (known: {', '.join(TUNING_ROLES)})")
            if not isinstance(buckets, list) or not buckets:
                raise _fail(src, src.table_line(hdr), f"{hdr} must be an array of tables: [[{hdr}]]")
            recs = [_record(Bucket, src, hdr, b, occurrence=i) for i, b in enumerate(buckets)]
            recs_of: dict[int, list[Bucket]] = {}  # by world size, in file order
            for i, rec in enumerate(recs):
                line = src.table_line(hdr, i)
                if rec.max_tokens < 0 or rec.blocks < 0 or rec.world < 0:
                    raise _fail(src, line, f"[[{hdr}]] max_tokens, blocks and world must be >= 0")
                if rec.threads <= 0 or rec.threads > 1024 or rec.threads % wave:
                    raise _fail(src, line, f"[[{hdr}]] threads = {rec.threads}: a multiple of the wave size {wave}, at most 1024")
                if rec.rows != "wave" and role != "dispatch":
                    raise _fail(src, src.key_line(hdr, "rows", i), f"[[{hdr}]] rows = {rec.rows!r}: only dispatch copies rows")
                group = recs_of.setdefault(rec.world, [])
                last = all(later.world != rec.world for later in recs[i + 1:])
                of = f" (world = {rec.world})" if rec.world else ""
                if (rec.max_tokens == 0) != last:
                    raise _fail(src, line, f"[[{hdr}]] only the last bucket{of} has max_tokens = 0 (no limit), and it must")
                if group and rec.max_tokens and rec.max_tokens <= group[-1].max_tokens:
                    raise _fail(src, line, f"[[{hdr}]] buckets{of} must ascend: max_tokens {rec.max_tokens} after "
                                           f"{group[-1].max_tokens}")
                group.append(rec)
            if 0 not in recs_of:
                raise _fail(src, src.table_line(hdr), f"[[{hdr}]] needs buckets without `world` (the fallback for any "
                                                      f"world size)")
            out[(tname, role)] = tuple(recs)
    for tname in targets:
        for role in TUNING_ROLES[:2]:
            if (tname, role) not in out:
                raise _fail(src, 1, f"no [[tuning.{tname}.{role}]] buckets")
        for role in TUNING_ROLES[2:]:  # the low-latency kernels take the bandwidth ones' geometry unless given
            out.setdefault((tname, role), out[(tname, role.removesuffix("_ll"))])
        ll_max.setdefault(tname, 0)  # absent: intranode_protocol "auto" never takes "ll"
    return out, ll_max


def buckets_for(specs: Specs, target: str, role: str, world: int = 0) -> tuple[Bucket, ...]:
    """The buckets an op of `world` ranks uses: those measured for that world size, else the fallback
    (the buckets without `world`)."""
    every = specs.tuning[(target, role)]
    return tuple(b for b in every if b.world == world) or tuple(b for b in every if b.world == 0)


def geometry(specs: Specs, target: str, role: str, tokens: int, world: int = 0) -> Bucket:
    """The bucket of specs/tuning.toml that a call of `tokens` tokens per rank takes (ops of `world` ranks)."""
    for b in buckets_for(specs, target, role, world):
        if b.max_tokens == 0 or tokens <= b.max_tokens:
            return b
    raise AssertionError("the loader guarantees an unlimited last bucket")
