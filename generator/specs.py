"""Spec loader: TOML files under specs/ -> frozen attrs records.

Every problem is reported as one ``file:line: message`` (SpecError) at the line of the value (a specs
folder that does not exist: ``folder: no such folder``), never a traceback: TOML syntax errors, duplicate keys and text that is not UTF-8, unknown keys, missing keys,
wrong types, values outside their field's declared domain, unknown references between files. Spec
text is data only; nothing in it is evaluated. Every field has a domain (below): strings are printable
text on one line (no character str.splitlines() breaks at), names whole C identifiers, values that
become path parts or template paths of a fixed form, compilers known toolchain programs, numbers in
declared ranges. A description may not end in a backslash: descriptions land in a ``//`` comment of
the generated source, where a line break or a line splice would turn the rest into code.
"""

from __future__ import annotations

import functools
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Callable

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

# Numbers: every int/float field of a record (tests/test_trust.py checks none is left out).
_RANGES = {
    (Toolchain, "min_clang"): _Range(0, 999),
    (Target, "fp8_max"): _Range(0, max(_FP8_FORMAT_MAX.values()), above=True),  # and <= its format's max
    (DType, "bits"): _Range(4, 32, pow2=True),  # and one its kind allows
    (DType, "scale_block"): _Range(_LANE_ELEMS, 1024, pow2=True, zero=True),
    (Quant, "block"): _Range(_LANE_ELEMS, 1024, pow2=True, zero=True),  # and whole lanes of one wave
    (Bucket, "max_tokens"): _Range(0, _INT32_MAX),
    (Bucket, "blocks"): _Range(0, _INT32_MAX),
    (Bucket, "threads"): _Range(1, 1024),  # and whole waves of the target
    (Bucket, "world"): _Range(0, _INT32_MAX),
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
    (Rule, "name"): (_IDENT, "a C identifier"),
}


def program_problem(vendor: str | None, kind: str, name: str) -> str | None:
    """Why `name` is not a known compiler/disassembler ("compilers"/"disassemblers") of `vendor` (None: any)."""
    pats = [_PROGRAMS[vendor]] if vendor else list(_PROGRAMS.values())
    pat_of = {"compilers": 0, "disassemblers": 1}[kind]
    if any(p[pat_of].fullmatch(name) for p in pats):
        return None
    return f"{name!r} is not a known {kind[:-1]}" + (f" of {vendor} targets" if vendor else "")


_Line = "int | Callable[[], int]"  # a line number, or a function that finds it (called on error only)


def _check_text(src: "_Source", line: _Line, header: str, key: str, value: str) -> str:
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
# Locating things in the TOML text (tomllib keeps no positions)
# ---------------------------------------------------------------------------------------------
_KEY = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
_KEY_LINE = re.compile(rf"\s*({_KEY}(?:\s*\.\s*{_KEY})*)\s*=")


def _key_path(toml: str) -> tuple[str, ...] | None:
    """The key path a header (`[a."b"]`, `[[a.b]]`) or a `key = 0` line declares, parsed by tomllib itself."""
    try:
        node: Any = tomllib.loads(toml)
    except tomllib.TOMLDecodeError:
        return None
    path: list[str] = []
    while True:
        if isinstance(node, list) and node:
            node = node[-1]
        if not (isinstance(node, dict) and len(node) == 1):
            return tuple(path)
        key, node = next(iter(node.items()))
        path.append(key)


def show(path: tuple[str, ...]) -> str:
    """A key path as TOML writes it (ASCII, one line): target.gfx942, family."quantize_fp8\\n"."""
    return ".".join(k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k) for k in path)


class _Source:
    def __init__(self, path: Path, text: str):
        self.path = path
        # TOML lines end at \n only (tomllib's line numbers count those), not at U+2028 & co
        self.lines = text.split("\n")

    @functools.cached_property
    def entries(self) -> list[tuple[int, tuple[str, ...], bool]]:
        """(line, full key path, is a header) of every table header and key line; found when first asked."""
        entries = []
        table: tuple[str, ...] = ()
        for i, line in enumerate(self.lines, 1):
            if line.lstrip().startswith("["):
                path = _key_path(line)
                if path:
                    table = path
                    entries.append((i, path, True))
                    continue
            m = _KEY_LINE.match(line)
            key = _key_path(m.group(1) + " = 0") if m else None
            if key:
                entries.append((i, table + key, False))
        return entries

    def where(self, line: int) -> str:
        rel = os.path.relpath(self.path)
        return f"{rel if not rel.startswith('..') else self.path}:{line}"

    def table_line(self, header: tuple[str, ...], occurrence: int = 0) -> int:
        """Line of `[header]` (or `[[header]]`, the occurrence-th one), else where the table is first
        defined implicitly (a sub-table or a dotted key); 1 if nowhere."""
        heads = [i for i, p, is_head in self.entries if is_head and p == header]
        if occurrence < len(heads):
            return heads[occurrence]
        return next((i for i, p, _ in self.entries if p[:len(header)] == header), 1)

    def key_line(self, header: tuple[str, ...], key: str, occurrence: int = 0, start: int = 0) -> int:
        """Line of `key =` inside table `header` (also `key.x = ` or a `[header.key]` sub-table), searched
        from the occurrence-th `[header]` (or from line `start`); that line if not found."""
        start = start or self.table_line(header, occurrence)
        want = header + (key,)
        after = [(i, p, h) for i, p, h in self.entries if i > start]
        stop = next((i for i, p, h in after if h and p[:len(want)] != want), len(self.lines) + 1)
        hits = [i for i, p, _ in after if i < stop and p[:len(want)] == want]
        hits = hits or [i for i, p, h in self.entries if h and p[:len(want)] == want]
        return hits[0] if hits else start


def _fail(src: _Source, line: _Line, msg: str) -> SpecError:
    """The located error."""
    return SpecError(f"{src.where(line() if callable(line) else line)}: {msg}")


def _read(path: Path) -> tuple[_Source, dict[str, Any], bytes]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise SpecError(f"{path}:1: cannot read the spec file ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        src = _Source(path, "")
        raise _fail(src, raw[:e.start].count(b"\n") + 1,
                    f"not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    src = _Source(path, text)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
        line = int(m.group(1)) if m else 1
        msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(e))
        raise _fail(src, line, f"invalid TOML: {msg}") from None
    return src, data, raw


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


def _named_tables(src: _Source, data: dict, section: str, cls: type) -> dict[str, Any]:
    unknown = [k for k in data if k != section]
    if unknown:
        raise _fail(src, src.table_line((unknown[0],)),
                    f"unknown top-level table {unknown[0]!r} (expected [{section}.NAME])")
    out = {}
    for name, table in _section(src, data, section, f"[{section}.NAME]").items():
        _check_name(src, (section, name))
        out[name] = _record(cls, src, (section, name), table, name=name)
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


TEMPLATES = (checkout_root() or packaged_root()) / "templates"  # the default templates (the checkout's, else the packaged copy)


TUNING_ENV = "EPGEN_TUNING_FILE"


def user_tuning_file() -> Path | None:
    """The tuned launch geometry of this machine: what ``python -m bench.tune --write`` writes and ``load`` lays
    over the specs' tuning.toml when it exists. $EPGEN_TUNING_FILE (set but empty: none), else
    $XDG_CONFIG_HOME/epgen/tuning.toml (~/.config/epgen/tuning.toml); never a file inside the package."""
    if TUNING_ENV in os.environ:
        return Path(os.environ[TUNING_ENV]) if os.environ[TUNING_ENV] else None
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "epgen" / "tuning.toml"


def tuning_sources(root: Path) -> list[Path]:
    """The tuning files a load of the specs at `root` reads, in order (the later one's tables win)."""
    user = user_tuning_file()
    return [root / "tuning.toml"] + ([user] if user is not None and user.exists() else [])


def merge_tuning(base: dict, new: dict) -> dict:
    """base's buckets with new's laid over: new's buckets of one (target, role) and world size replace base's of
    that (target, role) and world size; every other world's are kept."""
    out = {key: tuple(b) for key, b in base.items()}
    for key, buckets in new.items():
        worlds = {b.world for b in buckets}
        out[key] = tuple(b for b in out.get(key, ()) if b.world not in worlds) + tuple(buckets)
    return out


def read_tuning_overlay(path: Path, targets: dict[str, Target]) -> tuple[dict, dict[str, int]]:
    """A user tuning file's tables (any subset of targets, roles and world sizes), checked like tuning.toml."""
    if not path.is_file():
        raise SpecError(f"{path}:1: the tuning file (${TUNING_ENV}) is not a regular file")
    src, data, _ = _read(path)
    return _load_tuning(src, data, targets, complete=False, fallback=False)


def load(root: Path | str | None = None, tuning_overlay: bool = True) -> Specs:
    """The specs at `root` (default: default_root()); tuning_overlay: lay the user tuning file over tuning.toml."""
    import hashlib

    root = Path(root) if root is not None else default_root()
    if not root.is_dir():
        raise SpecError(f"{root}: no such folder (the specs folder: --specs, ${SPECS_ENV})")
    srcs: dict[str, _Source] = {}
    data: dict[str, dict] = {}
    digest = hashlib.sha256()
    for name in SPEC_FILES:
        path = root / f"{name}.toml"
        if not path.is_file():
            raise SpecError(f"{path}:1: spec file missing")
        srcs[name], data[name], raw = _read(path)
        if name != "tuning":  # launch geometry is runtime data: it changes no generated source
            digest.update(name.encode() + b"\0" + raw + b"\0")

    # targets.toml holds [target.*] and [toolchain.*]
    tsrc, tdata = srcs["targets"], data["targets"]
    for k in tdata:
        if k not in ("target", "toolchain"):
            raise _fail(tsrc, tsrc.table_line((k,)),
                        f"unknown top-level table {k!r} (expected [target.NAME] or [toolchain.NAME])")
    toolchains = {}
    for n, t in _section(tsrc, tdata, "toolchain", "[toolchain.NAME]").items():
        _check_name(tsrc, ("toolchain", n))
        toolchains[n] = _record(Toolchain, tsrc, ("toolchain", n), t, name=n)
    targets = {}
    for n, t in _section(tsrc, tdata, "target", "[target.NAME]").items():
        _check_name(tsrc, ("target", n))
        targets[n] = _record(Target, tsrc, ("target", n), t, name=n)
        _check_target(tsrc, targets[n], toolchains, templates_root(root))
    if not targets:
        raise _fail(tsrc, 1, "no [target.NAME] tables")

    dtypes = _named_tables(srcs["dtypes"], data["dtypes"], "dtype", DType)
    for d in dtypes.values():
        _check_dtype(srcs["dtypes"], d)
    quants = _named_tables(srcs["quant"], data["quant"], "quant", Quant)
    for q in quants.values():
        _check_quant(srcs["quant"], q, dtypes, targets)
    topologies = _named_tables(srcs["topologies"], data["topologies"], "topology", Topology)
    families = _named_tables(srcs["kernels"], data["kernels"], "family", Family)

    ksrc = srcs["kernels"]
    known_conv = {c for t in targets.values() for c, _ in t.isa} | {c for t in targets.values() for c, _ in t.isa_forbidden}
    for fam in families.values():
        hdr = ("family", fam.name)
        for key, pool, values in (("dtypes", dtypes, fam.dtypes), ("wire_dtypes", dtypes, fam.wire_dtypes),
                                  ("quants", quants, fam.quants), ("topologies", topologies, fam.topologies)):
            for v in values:
                if v not in pool and not (key == "wire_dtypes" and v == "same"):
                    raise _fail(ksrc, ksrc.key_line(hdr, key),
                                f"[{show(hdr)}] {key}: unknown {key[:-1]} {v!r} (known: {', '.join(pool)})")
        for x in fam.wire_isa:
            if x not in ("encode", "decode"):
                raise _fail(ksrc, ksrc.key_line(hdr, "wire_isa"), f"[{show(hdr)}] wire_isa: {x!r} must be 'encode' or 'decode'")
        for key, groups in (("isa", fam.isa), ("copy_isa", fam.copy_isa)):
            for c in groups:
                if c not in known_conv:
                    raise _fail(ksrc, ksrc.key_line(hdr, key),
                                f"[{show(hdr)}] {key}: {c!r} is not an [isa] key of any target (known: {', '.join(sorted(known_conv))})")
        if not (templates_root(root) / fam.template).is_file():
            raise _fail(ksrc, ksrc.key_line(hdr, "template"), f"[{show(hdr)}] template {fam.template!r}: no such file in templates/")

    rules = _load_rules(srcs["rules"], data["rules"])
    profiles = _named_tables(srcs["profiles"], data["profiles"], "profile", Profile)
    for p in ("default", "all"):
        if p not in profiles:
            raise _fail(srcs["profiles"], 1, f"profile {p!r} must be declared")

    tuning, ll_max = _load_tuning(srcs["tuning"], data["tuning"], targets, complete=False)
    for path in tuning_sources(root)[1:] if tuning_overlay else ():
        more, more_ll = read_tuning_overlay(path, targets)
        tuning, ll_max = merge_tuning(tuning, more), {**ll_max, **more_ll}
    tuning, ll_max = _complete_tuning(srcs["tuning"], tuning, ll_max, targets)
    return Specs(root=root, targets=targets, toolchains=toolchains, dtypes=dtypes, quants=quants,
                 topologies=topologies, families=families, rules=tuple(rules), profiles=profiles,
                 tuning=tuning, ll_max_tokens=ll_max, digest=digest.hexdigest())


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
    if not (troot / "targets" / f"{t.library}.j2").is_file():
        raise _fail(src, src.key_line(hdr, "library"),
                    f"[{show(hdr)}] library {t.library!r}: no templates/targets/{t.library}.j2")
    fmt_max = _FP8_FORMAT_MAX[t.fp8_e4m3]
    if not t.fp8_max <= fmt_max:
        raise _fail(src, src.key_line(hdr, "fp8_max"), f"[{show(hdr)}] fp8_max = {t.fp8_max!r}: more than "
                                                      f"{fmt_max:g}, the largest finite {t.fp8_e4m3} e4m3 value")
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
