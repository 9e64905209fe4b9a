"""Spec loader: TOML files under specs/ -> frozen attrs records.

Every problem is reported as one ``file:line: message`` (SpecError) at the line of the value (a specs
folder that does not exist: ``folder: no such folder``), never a traceback: TOML syntax errors, duplicate keys and text that is not UTF-8, unknown keys, missing keys,
wrong types, values outside their field's declared domain, unknown references between files. Spec
text is data only; nothing in it is evaluated. Every field has a domain (spec_schema): strings are
printable text on one line (no character str.splitlines() breaks at), names whole C identifiers,
values that become path parts or template paths of a fixed form, compilers known toolchain programs,
numbers in declared ranges. A description may not end in a backslash: descriptions land in a ``//``
comment of the generated source, where a line break or a line splice would turn the rest into code.

This module is the entry: load(), where the specs and templates are (the roots), and the launch
geometry a call takes (buckets_for, geometry); it re-exports the records and names callers use. The
parts: spec_source reads one file and locates errors, spec_schema holds the records and their
fields' domains, spec_checks the checks across fields, records and files.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from .spec_checks import (_check_axis_names, _check_dtype, _check_families, _check_quant, _complete_tuning,
                          _load_rules, _load_targets, _load_tuning)
from .spec_schema import (FACT_SOURCES, LL_THRESHOLD_KEY, TUNING_ROLES, Arg, ArgList, Bucket, DType, Family, Profile, Quant, Rule,
                          Specs, Target, Toolchain, Topology, _named_tables, fact_paths, load_arglists,
                          program_problem)
from .spec_source import SpecError, _fail, _read, _Source, show

__all__ = [  # what callers import from here, the public names of the parts included
    "SPEC_FILES", "TUNING_ROLES", "LL_THRESHOLD_KEY", "SPECS_ENV", "TEMPLATES", "FACT_SOURCES",
    "SpecError", "Toolchain", "Target", "DType", "Quant", "Topology", "Family", "Arg", "ArgList", "Rule", "Profile", "Bucket", "Specs",
    "load", "checkout_root", "packaged_root", "default_root", "is_packaged", "templates_root", "buckets_for",
    "geometry", "program_problem", "fact_paths", "show",
]

SPEC_FILES = ("targets", "dtypes", "quant", "topologies", "kernels", "rules", "profiles", "tuning")


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


def templates_root(root: Path, templates: Path | str | None = None) -> Path:
    """The templates used with the specs folder `root`: the folder the user names (`--templates`), else
    the project's (the checkout's, else the packaged copy). A templates/ folder found beside a spec
    folder is never used unless named: a spec folder is data, a template is code."""
    return Path(templates) if templates is not None else TEMPLATES


def load(root: Path | str | None = None, templates: Path | str | None = None, tuning_overlay: bool = True) -> Specs:
    """The specs of the folder `root` (default: default_root()), checked against the template folder
    `templates` (default: the project's; see templates_root); tuning_overlay: lay the user tuning file over
    tuning.toml."""
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

    troot = templates_root(root, templates)
    targets, toolchains = _load_targets(srcs["targets"], data["targets"], troot)

    dtypes = _named_tables(srcs["dtypes"], data["dtypes"], "dtype", DType)
    for d in dtypes.values():
        _check_dtype(srcs["dtypes"], d)
    quants = _named_tables(srcs["quant"], data["quant"], "quant", Quant)
    for q in quants.values():
        _check_quant(srcs["quant"], q, dtypes, targets)
    topologies = _named_tables(srcs["topologies"], data["topologies"], "topology", Topology)
    _check_axis_names(srcs, dtypes, quants, topologies)
    arglists = load_arglists(srcs["kernels"], data["kernels"].get("args", {}))
    families = _named_tables(srcs["kernels"], data["kernels"], "family", Family, also=("args",), signature=None)
    _check_families(srcs["kernels"], families, dtypes, quants, topologies, targets, troot, arglists)
    limits_of = {n: dict(a.limits) for n, a in arglists.items()}
    families = {n: attrs.evolve(f, signature=arglists[f.args], limits_of=limits_of) for n, f in families.items()}

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
                 topologies=topologies, families=families, arglists=arglists, rules=tuple(rules), profiles=profiles,
                 tuning=tuning, ll_max_tokens=ll_max, digest=digest.hexdigest(),
                 templates=Path(templates) if templates is not None else None)


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
