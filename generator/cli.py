"""python -m generator {build,list,explain,check} (also: epgen build / list / explain / check)"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import jinja2

from . import build as B
from . import render
from . import specs as S
from .cache import default_dir
from .model import combination_facts, enumerate_variants, rejecting_rule

STATUS = {"compiled": "compiled", "cached": "cached", "failed": "FAILED", "missing-toolchain": "NO TOOLCHAIN",
          "rendered": "rendered"}


def _archs(specs: S.Specs, arch: str) -> list[str]:
    if arch == "all":
        return list(specs.targets)
    if arch not in specs.targets:
        raise SystemExit(f"error: unknown target {arch!r} (known: {', '.join(specs.targets)}, all)")
    return [arch]


def _profile(specs: S.Specs, profile: str) -> str:
    if profile not in specs.profiles:
        raise SystemExit(f"error: unknown profile {profile!r} (known: {', '.join(specs.profiles)})")
    return profile


def _jobs(text: str) -> int:
    """--jobs: a whole number of parallel compilers, at least 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return n


def _templates(args) -> Path | None:
    """--templates: a folder holding variant.j2, named explicitly; None: the project's templates/."""
    if args.templates is None:
        return None
    root = Path(args.templates)
    if not (root / "variant.j2").is_file():
        raise SystemExit(f"error: --templates {args.templates!r}: no variant.j2 in that folder")
    return root


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def cmd_build(specs: S.Specs, args) -> int:
    _profile(specs, args.profile)
    archs = _archs(specs, args.arch)
    t0 = time.perf_counter()

    def progress(i: int, n: int, r: B.Result) -> None:
        state = STATUS[r.status] + ("" if r.verified is None else (", verified" if r.verified else ", VERIFY FAILED"))
        state += f" (the cached record's verdict, by {r.recorded_by}: no disassembler here)" if r.recorded_by else ""
        print(f"[{i:>{len(str(n))}}/{n}] {r.variant.key:<60} {state} ({r.seconds:.2f}s)", file=sys.stderr, flush=True)

    out_root = Path(args.out) if args.out else B.generated_root(specs)
    results = B.build(specs, archs, args.profile, args.only, args.jobs, not args.no_compile,
                      Path(args.cache_dir) if args.cache_dir else None, progress=progress, out_root=out_root,
                      templates=_templates(args))
    if not results:
        print(f"no variant of profile {args.profile!r} matches" + (f" --only {args.only!r}" if args.only else ""))
        return 1
    print(_table([[r.variant.key, "yes", STATUS[r.status] if r.status != "rendered" else "-",
                   {None: "-", True: "yes", False: "NO"}[r.verified] + (" (record)" if r.recorded_by else "")]
                  for r in results],
                 ["variant", "rendered", "compiled", "verified"]))
    failed = [r for r in results if r.status != "rendered" and not r.ok]
    n_ok = len(results) - len(failed)
    print(f"\n{len(results)} variant(s) for {', '.join(archs)} (profile {args.profile}): {n_ok} ok, "
          f"{len(failed)} failed, {time.perf_counter() - t0:.1f}s; sources in {out_root}" +
          ("" if args.no_compile else f"; code objects in {Path(args.cache_dir) if args.cache_dir else default_dir()}"))
    recorded = sorted({r.recorded_by for r in results if r.recorded_by})
    if recorded:
        n = sum(bool(r.recorded_by) for r in results)
        print(f"  verified: {n} cached variant(s) by the cached record's verdict only (by {'; '.join(recorded)}): "
              f"this machine has no disassembler to check them (epgen doctor names what is missing)")
    missing = sorted({r.message for r in failed if r.status == "missing-toolchain"})
    for m in missing:
        print(f"  toolchain: {m}")
    for r in failed:
        if r.status == "missing-toolchain":
            continue
        msg = "\n      ".join(r.message.splitlines()[:25])
        print(f"  FAILED {r.variant.key}: {msg}")
    return 1 if failed else 0


def cmd_list(specs: S.Specs, args) -> int:
    variants, _ = enumerate_variants(specs, _archs(specs, args.arch), _profile(specs, args.profile), args.only)
    rows = [[v.key, v.family.name, v.dtype.name, v.wire.name, v.quant.name, v.topology.name if v.topology else "-",
             " ".join(v.expected_isa) or "-"] for v in variants]
    print(_table(rows, ["variant", "family", "dtype", "wire", "quant", "topology", "expected isa"]))
    print(f"\n{len(rows)} variant(s) (profile {args.profile}; build's default profile is 'default')")
    return 0


def cmd_explain(specs: S.Specs, args) -> int:
    if args.key:
        target, _, name = args.key.partition("/")
        if target not in specs.targets:
            raise SystemExit(f"error: {args.key!r}: unknown target {target!r} (known: {', '.join(specs.targets)})")
        variants, rejected = enumerate_variants(specs, [target], "all")
        for v in variants:
            if v.key == args.key:
                return _explain_variant(v, _out_root(specs, args))
        for r in rejected:
            if r.key == args.key:
                fix = _passing_keys(specs, target, name)
                print(f"{args.key}: rejected by rule '{r.rule.name}' ({r.rule.where})\n  {r.rule.message}" +
                      (f"\n  would pass: {' or '.join(fix)}" if fix else ""))
                return 1
        print(f"{args.key}: not a combination of any family's declared axes; try: python -m generator list --arch {target}")
        return 1
    if not (args.family and args.target):
        raise SystemExit("error: explain needs a KEY (target/name) or --family and --target")
    pools = {"family": specs.families, "dtype": specs.dtypes, "wire": specs.dtypes, "quant": specs.quants,
             "target": specs.targets, "topology": specs.topologies}
    picked = {}
    for ns, pool in pools.items():
        val = getattr(args, ns)
        if val is None:
            continue
        if val not in pool:
            raise SystemExit(f"error: unknown {ns} {val!r} (known: {', '.join(pool)})")
        picked[ns] = pool[val]
    fam = picked["family"]
    picked.setdefault("quant", specs.quants[fam.quants[0]] if len(fam.quants) == 1 else None)
    for ns, axis in (("dtype", fam.dtypes), ("wire", fam.wire_dtypes), ("quant", fam.quants), ("topology", fam.topologies)):
        rec = picked.get(ns)
        if rec is not None and axis and rec.name not in axis and not (ns == "wire" and "same" in axis):
            print(f"family '{fam.name}' does not declare {ns} '{rec.name}' (declares: {', '.join(axis)}; specs/kernels.toml)")
            return 1
    rule = rejecting_rule(specs.rules, combination_facts(**{k: v for k, v in picked.items() if v is not None}))
    if rule is not None:
        fix = _passing_flags(specs, picked)
        print(f"rejected by rule '{rule.name}' ({rule.where})\n  {rule.message}" +
              (f"\n  would pass: {' or '.join(fix)}" if fix else ""))
        return 1
    match = _matching(enumerate_variants(specs, [args.target], "all")[0], picked)
    if not match:
        print("no variant matches")
        return 1
    for v in match:
        _explain_variant(v, _out_root(specs, args))
    return 0


AXES = ("dtype", "wire", "quant", "topology")  # explain's flags besides --family and --target


def _matching(variants, picked: dict) -> list:
    """The variants of picked's family (and target, when picked) that agree with every axis picked names."""
    return [v for v in variants if v.family.name == picked["family"].name and all(
        getattr(v, ns) is None or picked.get(ns) is None or getattr(v, ns).name == picked[ns].name
        for ns in ("target", *AXES))]


def _passing_flags(specs: S.Specs, picked: dict, most: int = 4) -> list[str]:
    """The fewest flags (`--wire fp8_e4m3fn`; two or three where no one flag does) that turn a rejected combination into a
    variant: axes set or changed to values some variant of the family has, the rest as picked; at most `most`."""
    variants, _ = enumerate_variants(specs, specs.targets, "all")
    mine = [v for v in variants if v.family.name == picked["family"].name]
    given = {k: v for k, v in picked.items() if v is not None}
    values = {ns: [r for r in dict.fromkeys(getattr(v, ns) for v in mine)
                   if r is not None and (ns not in given or r.name != given[ns].name)] for ns in ("target", *AXES)}
    for n in (1, 2, 3):
        flags = []
        for axes in itertools.combinations(values, n):
            for recs in itertools.product(*(values[ns] for ns in axes)):
                trial = {**given, **dict(zip(axes, recs))}
                if rejecting_rule(specs.rules, combination_facts(**trial)) is None and _matching(mine, trial):
                    flags.append(" ".join(f"--{ns} {r.name}" for ns, r in zip(axes, recs)))
        if flags:
            return flags[:most] + (["..."] if len(flags) > most else [])
    return []


def _passing_keys(specs: S.Specs, target: str, name: str, most: int = 4) -> list[str]:
    """Variants one step from a rejected key: the same name on another target, or one part of the name changed on
    this one (at most `most`)."""
    parts = name.split(".")
    variants, _ = enumerate_variants(specs, specs.targets, "all")
    near = [v.key for v in variants if v.name == name and v.target.name != target or v.target.name == target and
            len(p := v.name.split(".")) == len(parts) and p[0] == parts[0] and sum(a != b for a, b in zip(p, parts)) == 1]
    return near[:most] + (["..."] if len(near) > most else [])


def _out_root(specs: S.Specs, args) -> Path:
    return Path(args.out) if getattr(args, "out", None) else B.generated_root(specs)


def _explain_variant(v, out_root: Path) -> int:
    source = out_root / v.target.name / v.file
    built = "" if source.is_file() else f" (not rendered yet: python -m generator build --arch {v.target.name})"
    print(f"{v.key}: variant\n  file     {source}{built}\n  symbol   {v.symbol}\n"
          f"  expects  {' '.join(v.expected_isa) or '-'}\n  forbids  {' '.join(v.forbidden_isa) or '-'}")
    return 0


def cmd_check(specs: S.Specs, args) -> int:
    """Specs valid, and every target's rendered folder what the specs render. The checkout's committed
    generated/ must hold every target; elsewhere (installed, --out, $EPGEN_GENERATED_DIR) a target never
    built is named once, not counted stale."""
    out_root = _out_root(specs, args)
    committed = not (args.out or os.environ.get(B.GENERATED_ENV) or S.is_packaged(specs.root))
    problems, unbuilt, fresh, stale = [], [], [], []
    for arch in _archs(specs, args.arch):
        if not (out_root / arch).is_dir() and not committed:
            unbuilt.append(arch)
            continue
        found = B.freshness(specs, arch, out_root, _templates(args))
        problems += found
        (stale if found else fresh).append(arch)
    if problems:
        print("\n".join(problems[:50]) + (f"\n... {len(problems) - 50} more" if len(problems) > 50 else ""))
        print(f"\n{out_root} is not fresh ({len(problems)} problem(s)); run: python -m generator build --arch "
              f"{stale[0] if len(stale) == 1 else 'all'} --no-compile")
        return 1
    n = sum(len(enumerate_variants(specs, [a], "all")[0]) for a in fresh)
    print(f"specs valid ({len(specs.rules)} rule(s)); {out_root}: " +
          (f"fresh for {', '.join(fresh)} ({n} variant(s))" if fresh else "nothing built yet") +
          (f"; not built: {', '.join(unbuilt)} (python -m generator build --arch NAME)" if unbuilt else ""))
    return 0


def _profile_help(profiles: dict[str, str] | None, default: str) -> str:
    listed = ("; ".join(f"{n}: {d}" for n, d in profiles.items()) if profiles else
              "names in specs/profiles.toml")
    return f"variant filter of specs/profiles.toml (default: {default}). Profiles: {listed}"


def parser(prog: str = "python -m generator", profiles: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The command line; `profiles` ({name: description}) lists the profiles in --help."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("--specs", help="specs folder (default: $EPGEN_SPECS_DIR, else the checkout's specs/, else the "
                                   "copy installed with the package)")
    p.add_argument("--templates", help="template folder (default: the project's templates/, the checkout's or the copy "
                                       "installed with the package; never one found beside --specs)")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="render, compile and ISA-verify variants (profile 'default' unless --profile)")
    b.add_argument("--arch", required=True, help="target name or 'all'")
    b.add_argument("--profile", default="default", help=_profile_help(profiles, "default"))
    b.add_argument("--only", help="glob over variant names / keys")
    b.add_argument("--jobs", type=_jobs, default=None, help="parallel compilers (default: the CPU count)")
    b.add_argument("--no-compile", action="store_true", help="render and write the manifest only")
    b.add_argument("--cache-dir", help="code-object cache (default $EPGEN_CACHE_DIR or ~/.cache/epgen)")
    b.add_argument("--out", help="where rendered sources go (default $EPGEN_GENERATED_DIR, else generated/ beside "
                                 "the specs folder; installed package: <cache dir>/generated/<version>-<digest>)")
    ls = sub.add_parser("list", help="list the variants of a target / profile (profile 'all' unless --profile)")
    ls.add_argument("--arch", default="all", help="target name or 'all' (default)")
    ls.add_argument("--profile", default="all", help=_profile_help(profiles, "all"))
    ls.add_argument("--only", help="glob over variant names / keys")
    e = sub.add_parser("explain", help="which variant a combination is, or which rule rejects it")
    e.add_argument("key", nargs="?", help="target/name, e.g. gfx942/quantize_fp4.bf16.fp4_e2m1.fp4_blockwise")
    for opt in ("family", "dtype", "wire", "quant", "target", "topology"):
        e.add_argument(f"--{opt}")
    e.add_argument("--out", help="the generated folder the file is named in (default: as build)")
    c = sub.add_parser("check", help="specs valid and generated/ fresh")
    c.add_argument("--arch", default="all")
    c.add_argument("--out", help="the generated folder to check (default: as build)")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m generator") -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--specs")
    pre.add_argument("--templates")
    pre_args = pre.parse_known_args(argv)[0]
    specs_arg = pre_args.specs
    try:
        specs: S.Specs | None = S.load(specs_arg, pre_args.templates)
    except (S.SpecError, render.OutsideRoot, jinja2.TemplateError):
        specs = None  # reported below, after the arguments are parsed (--help still works)
    profiles = {n: pr.description for n, pr in specs.profiles.items()} if specs else None
    args = parser(prog, profiles).parse_args(argv)
    try:
        specs = specs if specs is not None and args.templates is None else S.load(args.specs, _templates(args))
        return {"build": cmd_build, "list": cmd_list, "explain": cmd_explain, "check": cmd_check}[args.cmd](specs, args)
    except (S.SpecError, render.OutsideRoot, render.WriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except jinja2.TemplateError as e:
        print(f"error: template: {_template_where(e)}{e.message}", file=sys.stderr)
        return 2
    except OSError as e:  # an --out / --cache-dir that cannot be written, a full disk
        what = f"{e.filename}: " if e.filename else ""
        print(f"error: {what}{e.strerror or e} (check --out / --cache-dir and their environment variables)",
              file=sys.stderr)
        return 2


def _template_where(e: jinja2.TemplateError) -> str:
    """`templates/<file>:<line>: ` of a template error: its own (syntax errors) or the innermost template
    frame of its traceback (Jinja rewrites the frames of a render error to template lines)."""
    if getattr(e, "lineno", None):
        return f"templates/{e.name}:{e.lineno}: "
    where, tb = "", e.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name.endswith(".j2"):
            parts = Path(name).parts
            rel = "/".join(parts[parts.index("templates") + 1:]) if "templates" in parts else Path(name).name
            where = f"templates/{rel}:{tb.tb_lineno}: "
        tb = tb.tb_next
    return where
