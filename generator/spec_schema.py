"""The spec schema: the records the spec files load into, what each field may be, and reading one
TOML table into its record.

Each table of a spec file becomes one frozen attrs record (Target, Toolchain, DType, Quant, Topology,
Family, Rule, Profile, Bucket; Specs holds them all). Every string and number field has a declared
domain: an enumeration (_CHOICES), a range (_RANGES) or a fixed form (_PATTERNS: C identifiers,
file-name parts, template paths, known toolchain programs), and every string is printable text on
one line that does not end in a backslash (_check_text). _record reads a table against its class's
fields and domains: unknown, missing and mistyped keys and values out of their domain are each a
SpecError at the value's line. Checks that need more than one field, or other records and files,
are spec_checks'.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs

from .spec_source import _fail, _Line, _Source, show

TUNING_ROLES = ("dispatch", "combine", "dispatch_ll", "combine_ll")
LL_THRESHOLD_KEY = "intranode_ll_max_tokens"  # [tuning.TARGET]: intranode_protocol "auto" picks "ll" up to it


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
    spin_polls: int
    toolchain: str
    flags: tuple[str, ...]
    isa: tuple[tuple[str, tuple[str, ...]], ...] = ()
    programmatic_launch: bool = False
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
    # the most threads per block the kernel is compiled for (its launch bounds: registers are held to what a block
    # of that many threads may use); 1024, the default, leaves the compiler's register choice as it is
    max_threads: int = 1024
    # blocks of max_threads threads the kernel must fit on one multiprocessor at once (NVIDIA's launch bounds'
    # second number: registers are held to what that many blocks may share); 0, the default, asks nothing.
    # The AMD targets take no such hint from it (their flat work-group size is max_threads alone)
    min_blocks: int = 0
    args: str  # the [args.NAME] table of its launch arguments
    signature: "ArgList | None" = attrs.field(default=None, eq=False, repr=False)  # args, resolved by the loader
    # every [args.NAME] table's limits by NAME (a kernel that runs another family's pass in its tail sizes its
    # shared memory by that family's declared limits: one declaration)
    limits_of: dict = attrs.field(factory=dict, eq=False, repr=False)


# The launch argument types: "i64", or a pointer to T (const or not); struct fields are 64-bit "addr" / "i64".
ARG_POINTEES = {"char": "char", "void": "void", "i32": "int", "f32": "float"}  # spec name -> C type
_ARG_TYPE = re.compile(r"i64|(const )?(char|void|i32|f32)\*")
_STRUCT_FIELD_TYPES = ("addr", "i64")
_ARG_KEYS = ("name", "type", "doc", "optional")
_ARGLIST_KEYS = ("fields", "struct", "limits")


@_frozen
class Arg:
    """One launch argument: a name the template's body uses and the runtime passes by, its type, its meaning."""
    name: str
    type: str
    doc: str
    optional: bool = False  # a pointer that may be absent (None: address 0)

    @property
    def pointer(self) -> bool:
        return self.type != "i64"

    @property
    def pointee(self) -> str:
        """char, void, i32 or f32 for a pointer ("" for i64, and for a struct's "addr")."""
        m = _ARG_TYPE.fullmatch(self.type)
        return m.group(2) or "" if m else ""

    def c_param(self, restrict_inputs: bool = True) -> str:
        """The C parameter. Without restrict_inputs (a target with programmatic launch) a const input is not
        __restrict__: const and restrict together let the compiler take its loads as read-only for the kernel's
        lifetime (ld.global.nc) and hoist them above epg_launch_begin's wait, where the kernel before it may still
        be writing them; outputs keep restrict."""
        if not self.pointer:
            return f"epg_i64 {self.name}"
        if self.type.startswith("const "):
            return f"const {ARG_POINTEES[self.pointee]}*{' __restrict__' if restrict_inputs else ''} {self.name}"
        return f"{ARG_POINTEES[self.pointee]}* __restrict__ {self.name}"


@_frozen
class ArgList:
    """A kernel's launch arguments in order ([args.NAME] of kernels.toml): passed one by one, or, when
    `struct` names a C struct, as that one struct of 64-bit fields, by value."""
    name: str
    fields: tuple[Arg, ...]
    struct: str = ""
    limits: tuple[tuple[str, int], ...] = ()  # numbers the template and the runtime share

    def limit(self, name: str) -> int:
        return dict(self.limits)[name]

    def c_params(self, sep: str = ", ", restrict_inputs: bool = True) -> str:
        """The kernel's C parameter list (a struct list: the one struct, by value, named `a`)."""
        if self.struct:
            return f"{self.struct} a"
        return sep.join(a.c_param(restrict_inputs) for a in self.fields)


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
    arglists: dict[str, ArgList]
    rules: tuple[Rule, ...]
    profiles: dict[str, Profile]
    tuning: dict[tuple[str, str], tuple[Bucket, ...]]  # (target, role) -> ascending buckets
    ll_max_tokens: dict[str, int]  # target -> intranode_ll_max_tokens (0: auto never takes "ll")
    digest: str  # sha256 of the spec texts that shape generated sources (all but tuning.toml)
    templates: Path | None = None  # the template folder named with load(templates=...); None: the project's


# ---------------------------------------------------------------------------------------------
# What a value may be: every string and number field has a declared domain
# ---------------------------------------------------------------------------------------------
# Enumerated values (a typo in the spec is an error, not a silently different variant).
_CHOICES = {
    (Target, "vendor"): ("amd", "nvidia"),
    (Target, "wave_size"): (32, 64),
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


@attrs.frozen
class _Range:
    """Numbers lo..hi (lo excluded when `above`), optionally powers of two, optionally also 0."""
    lo: float
    hi: float
    above: bool = False
    pow2: bool = False
    zero: bool = False

    def admits(self, v: float) -> bool:
        if self.zero and v == 0:
            return True
        inside = (self.lo < v if self.above else self.lo <= v) and v <= self.hi  # False for nan
        return inside and (not self.pow2 or (v == int(v) and int(v) & (int(v) - 1) == 0))

    def __str__(self) -> str:
        what = f"{'a power of two ' if self.pow2 else ''}{'>' if self.above else '>='} {self.lo} and at most {self.hi}"
        return f"must be {what}" + (" (or 0)" if self.zero else "")


_INT32_MAX = 2**31 - 1
_FP8_FORMAT_MAX = {"ocp": 448.0, "fnuz": 240.0}  # largest finite e4m3 value of each representation
_DTYPE_BITS = {"float": (16, 32), "fp8": (8,), "fp4": (4,), "int": (32,)}  # storage bits each kind allows
_SCALE_WIRES = {"none": ("none", "fp8"), "fp32": ("fp8",), "e8m0": ("fp4",)}  # wire kinds each scale serves
_LANE_ELEMS = 8  # elements each lane converts: a scale block is whole lanes of one wave
_LIBRARIES = {"amd": ("amd",), "nvidia": ("nvidia",)}  # macro libraries (templates/targets/) per vendor

# Numbers: every int/float field of a record (tests/generator/test_spec_trust.py checks none is left out).
_RANGES = {
    (Toolchain, "min_clang"): _Range(0, 999),
    (Target, "fp8_max"): _Range(0, max(_FP8_FORMAT_MAX.values()), above=True),  # and <= its format's max
    (Target, "spin_polls"): _Range(0, 1 << 20, zero=True),
    (DType, "bits"): _Range(4, 32, pow2=True),  # and one its kind allows
    (DType, "scale_block"): _Range(_LANE_ELEMS, 1024, pow2=True, zero=True),
    (Quant, "block"): _Range(_LANE_ELEMS, 1024, pow2=True, zero=True),  # and whole lanes of one wave
    (Bucket, "max_tokens"): _Range(0, _INT32_MAX),
    (Bucket, "blocks"): _Range(0, _INT32_MAX),
    (Bucket, "threads"): _Range(1, 1024),  # and whole waves of the target
    (Bucket, "world"): _Range(0, _INT32_MAX),
    (Family, "max_threads"): _Range(64, 1024, pow2=True),  # whole waves of every target
    (Family, "min_blocks"): _Range(1, 32, zero=True),  # an SM holds at most 32 blocks (sm_90)
}

# Strings of a fixed form: C identifiers, plain file-name parts, template paths, toolchain programs.
# Compilers and disassemblers are programs found on PATH by these bare names (shutil.which): a spec
# can pick among the known toolchains, never name another program or a path.
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PROGRAMS = {
    "amd": (re.compile(r"hipcc|amdclang\+\+|clang\+\+(-[0-9]{1,3})?"), re.compile(r"llvm-objdump(-[0-9]{1,3})?")),
    "nvidia": (re.compile(r"nvcc"), re.compile(r"cuobjdump")),
}
_PATTERNS = {
    (Toolchain, "compilers"): (re.compile("|".join(c.pattern for c, _ in _PROGRAMS.values())),
                               "a known compiler (clang++, clang++-NN, hipcc, amdclang++, nvcc)"),
    (Toolchain, "disassemblers"): (re.compile("|".join(d.pattern for _, d in _PROGRAMS.values())),
                                   "a known disassembler (llvm-objdump, llvm-objdump-NN, cuobjdump)"),
    (Toolchain, "extension"): (re.compile(r"[A-Za-z0-9]+"), "a file-name extension: letters and digits"),
    (Toolchain, "artifact"): (re.compile(r"[A-Za-z0-9]+"), "a file-name extension: letters and digits"),
    (Target, "library"): (_IDENT, "a C identifier naming templates/targets/<library>.j2"),
    (Target, "flags"): (re.compile(r"-\S+"), "a compiler option: '-' then no spaces"),
    (Target, "isa"): (_IDENT, "a C identifier (an ISA group name)"),
    (Target, "isa_forbidden"): (_IDENT, "a C identifier (an ISA group name)"),
    (DType, "torch"): (_IDENT, "a torch dtype attribute name"),
    (Family, "template"): (re.compile(r"kernels/[A-Za-z_][A-Za-z0-9_]*\.j2"), "kernels/<name>.j2 under templates/"),
    (Family, "args"): (_IDENT, "a C identifier naming an [args.NAME] table"),
    (Rule, "name"): (_IDENT, "a C identifier"),
}


def program_problem(vendor: str | None, kind: str, name: str) -> str | None:
    """Why `name` is not a known compiler/disassembler ("compilers"/"disassemblers") of `vendor` (None: any)."""
    pats = [_PROGRAMS[vendor]] if vendor else list(_PROGRAMS.values())
    pat_of = {"compilers": 0, "disassemblers": 1}[kind]
    if any(p[pat_of].fullmatch(name) for p in pats):
        return None
    return f"{name!r} is not a known {kind[:-1]}" + (f" of {vendor} targets" if vendor else "")


def _check_text(src: _Source, line: _Line, header: str, key: str, value: str) -> str:
    # every character str.splitlines() breaks at (U+2028, U+0085, ...) is also one that is not printable
    if not value.isprintable() or len(f"a{value}a".splitlines()) != 1:
        bad = next(c for c in value if not c.isprintable() or len(f"a{c}a".splitlines()) != 1)
        raise _fail(src, line, f"[{header}] {key}: character U+{ord(bad):04X} is not allowed: spec strings are "
                               f"printable text on one line (no control characters), got {value!r}")
    if value.endswith(("\\", "??/")):
        raise _fail(src, line, f"[{header}] {key}: must not end with a backslash (it would continue a generated "
                               f"source's comment line), got {value!r}")
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
# Typed conversion of one table into a record
# ---------------------------------------------------------------------------------------------
def _check_form(src: _Source, line: _Line, header: str, key: str, cls: type, name: str, value: Any) -> None:
    """The declared domain of a field: enumeration, range or form (one string of a list at a time)."""
    choices = _CHOICES.get((cls, name))
    if choices is not None and value not in choices:
        raise _fail(src, line, f"[{header}] {key} = {value!r}: must be one of {', '.join(repr(c) for c in choices)}")
    rng = _RANGES.get((cls, name))
    if rng is not None and not rng.admits(value):
        raise _fail(src, line, f"[{header}] {key} = {value!r}: {rng}")
    form = _PATTERNS.get((cls, name))
    if form is not None and not form[0].fullmatch(value):
        raise _fail(src, line, f"[{header}] {key}: {value!r} must be {form[1]}")


def _convert(src: _Source, path: tuple[str, ...], key: str, value: Any, tp: Any, occurrence: int,
             cls: type) -> Any:
    def line() -> int:
        return src.key_line(path, key, occurrence)

    header = show(path)
    base = getattr(tp, "__origin__", tp)
    if base is tuple:
        args = getattr(tp, "__args__", (str, ...))
        if args[0] is str:
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise _fail(src, line, f"[{header}] {key}: expected a list of strings, got {value!r}")
            if len(set(value)) != len(value):
                raise _fail(src, line, f"[{header}] {key}: duplicate entries in {value!r}")
            for v in value:
                _check_text(src, line, header, key, v)
                _check_form(src, line, header, key, cls, key, v)
            return tuple(value)
        # mapping: name -> list of strings (isa tables, rule clauses)
        if not isinstance(value, dict):
            raise _fail(src, line, f"[{header}] {key}: expected a table, got {value!r}")
        out = []
        for k in sorted(value):
            def at(k: str = k) -> int:
                return src.key_line(path + (key,), k, start=line())

            v, sub = value[k], f"{key}.{show((k,))}"
            _check_text(src, at, header, f"{key} key", k)
            _check_form(src, at, header, sub, cls, key, k)
            if isinstance(v, str):
                v = [v]
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise _fail(src, at, f"[{header}] {sub}: expected a string or a list of strings, got {v!r}")
            out.append((k, tuple(_check_text(src, at, header, sub, x) for x in v)))
        return tuple(out)
    if tp is bool:
        if not isinstance(value, bool):
            raise _fail(src, line, f"[{header}] {key}: expected true or false, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(src, line, f"[{header}] {key}: expected a number, got {value!r}")
        value = float(value)
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(src, line, f"[{header}] {key}: expected an integer, got {value!r}")
    elif tp is str:
        if not isinstance(value, str):
            raise _fail(src, line, f"[{header}] {key}: expected a string, got {value!r}")
        _check_text(src, line, header, key, value)
    else:
        raise AssertionError(tp)
    _check_form(src, line, header, key, cls, key, value)
    return value


def _record(cls: type, src: _Source, path: tuple[str, ...], table: Any, occurrence: int = 0, **extra: Any) -> Any:
    def line() -> int:
        return src.table_line(path, occurrence)

    header = show(path)
    if not isinstance(table, dict):
        raise _fail(src, line, f"[{header}] must be a table")
    fields = {f.name: f for f in attrs.fields(cls)}
    attrs.resolve_types(cls)
    hints = {f.name: f.type for f in attrs.fields(cls)}
    for key in table:
        if key not in fields or key in extra:
            known = ", ".join(n for n in fields if n not in extra)
            raise _fail(src, src.key_line(path, key, occurrence), f"[{header}] unknown key {key!r} (known: {known})")
    values = dict(extra)
    for name, f in fields.items():
        if name in extra:
            continue
        if name not in table:
            if f.default is attrs.NOTHING:
                raise _fail(src, line, f"[{header}] missing required key {name!r}")
            continue
        values[name] = _convert(src, path, name, table[name], hints[name], occurrence, cls)
    return cls(**values)


def _check_name(src: _Source, path: tuple[str, ...]) -> str:
    """A table name that becomes a C symbol and a file-name part: a C identifier, whole."""
    name = path[-1]
    if not _IDENT.fullmatch(name):
        raise _fail(src, src.table_line(path), f"name {name!r} is not a C identifier")
    return name


def _section(src: _Source, data: dict, section: str, form: str) -> dict:
    """The top-level table `section` (empty if absent); anything else there is an error."""
    value = data.get(section, {})
    if not isinstance(value, dict):
        raise _fail(src, src.table_line((section,)), f"{section!r} must hold {form} tables")
    return value


def _named_tables(src: _Source, data: dict, section: str, cls: type, also: tuple[str, ...] = (),
                  **extra: Any) -> dict[str, Any]:
    """The [section.NAME] tables of one file as records (`also`: other sections the file may hold, read
    elsewhere; `extra`: record fields no table may set)."""
    unknown = [k for k in data if k != section and k not in also]
    if unknown:
        expected = " or ".join(f"[{s}.NAME]" for s in (section, *also))
        raise _fail(src, src.table_line((unknown[0],)), f"unknown top-level table {unknown[0]!r} (expected {expected})")
    out = {}
    for name, table in _section(src, data, section, f"[{section}.NAME]").items():
        _check_name(src, (section, name))
        out[name] = _record(cls, src, (section, name), table, name=name, **extra)
    if not out:
        raise _fail(src, 1, f"no [{section}.NAME] tables")
    return out


# ---------------------------------------------------------------------------------------------
# [args.NAME]: launch argument lists
# ---------------------------------------------------------------------------------------------
def _only_keys(src: _Source, line: _Line, where: str, table: dict, known: tuple[str, ...]) -> None:
    for key in table:
        if key not in known:
            raise _fail(src, line, f"{where}: unknown key {key!r} (known: {', '.join(known)})")


def _arg(src: _Source, path: tuple[str, ...], i: int, entry: Any, struct: bool, seen: set[str]) -> Arg:
    def line() -> int:  # the entry's own line (one inline table a line, as kernels.toml writes them), else the key's
        at = src.key_line(path, "fields")
        starts = []
        for n in range(at, len(src.lines) + 1):
            text = src.lines[n - 1].lstrip()
            if n > at and text.startswith("["):
                break
            starts += [n] * text.count("{ name")
        return starts[i] if i < len(starts) else at

    where = f"[{show(path)}] fields[{i}]"
    if not isinstance(entry, dict):
        raise _fail(src, line, f"{where}: expected an inline table {{ name, type, doc }}, got {entry!r}")
    _only_keys(src, line, where, entry, _ARG_KEYS)
    for key in ("name", "type", "doc"):
        if key not in entry:
            raise _fail(src, line, f"{where}: missing required key {key!r}")
        if not isinstance(entry[key], str):
            raise _fail(src, line, f"{where} {key}: expected a string, got {entry[key]!r}")
        _check_text(src, line, show(path), f"fields[{i}].{key}", entry[key])
    name, tp, optional = entry["name"], entry["type"], entry.get("optional", False)
    where = f"[{show(path)}] argument {name!r}"
    if not _IDENT.fullmatch(name):
        raise _fail(src, line, f"{where}: the name must be a C identifier")
    if name in seen:
        raise _fail(src, line, f"{where}: declared twice")
    seen.add(name)
    if struct and tp not in _STRUCT_FIELD_TYPES:
        raise _fail(src, line, f"{where}: type {tp!r}: a struct's fields are 64 bits, 'addr' or 'i64'")
    if not struct and not _ARG_TYPE.fullmatch(tp):
        raise _fail(src, line, f"{where}: type {tp!r} must be 'i64' or a pointer 'T*' / 'const T*' with T one of "
                               f"{', '.join(ARG_POINTEES)}")
    if not isinstance(optional, bool):
        raise _fail(src, line, f"{where}: optional must be true or false, got {optional!r}")
    if optional and (struct or tp == "i64"):
        raise _fail(src, line, f"{where}: only a pointer argument may be optional")
    return Arg(name=name, type=tp, doc=entry["doc"], optional=optional)


def load_arglists(src: _Source, data: Any) -> dict[str, ArgList]:
    """The [args.NAME] tables of kernels.toml, each checked: keys, names, types, limits."""
    if not isinstance(data, dict):
        raise _fail(src, src.table_line(("args",)), "'args' must hold [args.NAME] tables")
    out = {}
    for name, table in data.items():
        path = ("args", name)
        _check_name(src, path)
        if not isinstance(table, dict):
            raise _fail(src, src.table_line(path), f"[{show(path)}] must be a table")
        _only_keys(src, lambda k=None: src.table_line(path), f"[{show(path)}]", table, _ARGLIST_KEYS)
        struct = table.get("struct", "")
        if not isinstance(struct, str) or (struct and not _IDENT.fullmatch(struct)):
            raise _fail(src, src.key_line(path, "struct"), f"[{show(path)}] struct: {struct!r} must be a C identifier")
        fields = table.get("fields")
        if not isinstance(fields, list) or not fields:
            raise _fail(src, src.key_line(path, "fields") if "fields" in table else src.table_line(path),
                        f"[{show(path)}] fields: expected a non-empty list of {{ name, type, doc }} tables")
        seen: set[str] = set()
        args = tuple(_arg(src, path, i, entry, bool(struct), seen) for i, entry in enumerate(fields))
        limits = table.get("limits", {})
        if not isinstance(limits, dict):
            raise _fail(src, src.key_line(path, "limits"), f"[{show(path)}] limits: expected a table of numbers")
        for key, value in limits.items():
            if not _IDENT.fullmatch(key):
                raise _fail(src, src.key_line(path, "limits"), f"[{show(path)}] limits: {key!r} is not a C identifier")
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _INT32_MAX:
                raise _fail(src, src.key_line(path, "limits"),
                            f"[{show(path)}] limits.{key} = {value!r}: must be an integer >= 1 and at most {_INT32_MAX}")
        out[name] = ArgList(name=name, fields=args, struct=struct, limits=tuple(sorted(limits.items())))
    return out
