"""Build: render the variant matrix into generated/<arch>/, compile into the cache, verify the ISA."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

import attrs

from . import __version__, render, toolchain
from .cache import Entry, UnsafePath, cache_key, default_dir, sweep_stale, usable_dir
from .model import Variant, enumerate_variants
from .specs import Specs, is_packaged

GENERATED_ENV = "EPGEN_GENERATED_DIR"


def generated_root(specs: Specs) -> Path:
    """Where rendered sources go (and where the runtime reads them): $EPGEN_GENERATED_DIR when set;
    generated/ beside the specs/ folder in use (the project's own, or a copy's); for the specs
    shipped inside an installed package (never written into site-packages): the cache directory,
    ``$EPGEN_CACHE_DIR`` or ``~/.cache/epgen``, under ``generated/<version>-<specs digest>``."""
    env = os.environ.get(GENERATED_ENV)
    if env:
        return Path(env)
    if is_packaged(specs.root):
        return default_dir() / "generated" / f"{__version__}-{specs.digest[:12]}"
    return specs.root.resolve().parent / "generated"


# ---------------------------------------------------------------------------------------------
# Rendering and the manifest (the committed tree always holds the full `all` matrix)
# ---------------------------------------------------------------------------------------------
def manifest_entry(v: Variant, source_sha256: str) -> dict:
    return {
        "family": v.family.name, "dtype": v.dtype.name, "wire_dtype": v.wire.name, "quant": v.quant.name,
        "topology": v.topology.name if v.topology else None, "target": v.target.name,
        "file": v.file, "symbol": v.symbol, "source_sha256": source_sha256,
        "expected_isa": list(v.expected_isa), "forbidden_isa": list(v.forbidden_isa),
    }


def render_target(specs: Specs, arch: str, templates: Path | None = None) -> tuple[dict[str, str], dict]:
    """Render every variant of `arch` in memory: {file name: text} and the manifest dict. Templates come
    from `templates` when the user names a folder (`--templates`), else from the project's templates/
    (never from a folder found beside a spec folder)."""
    env = render.environment(templates or specs.templates)
    variants, _ = enumerate_variants(specs, [arch], "all")
    files: dict[str, str] = {}
    entries = {}
    for v in variants:
        text = render.render(v, env)
        files[v.file] = text
        entries[v.name] = manifest_entry(v, render.sha256(text))
    manifest = {"epgen": __version__, "target": arch, "specs_sha256": specs.digest, "variants": entries}
    files["manifest.json"] = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    return files, manifest


def _owned(specs: Specs, path: Path) -> bool:
    """Files of generated/<arch>/ the generator writes: sources (the toolchains' extensions) and the manifest."""
    return path.suffix in {f".{tc.extension}" for tc in specs.toolchains.values()} or path.name == "manifest.json"


def stale_files(specs: Specs, arch: str, files: dict[str, str], out_root: Path) -> list[Path]:
    """Files of generated/<arch>/ to remove: owned files the specs no longer render, and the temporary
    files of writers that died mid-write."""
    d = out_root / arch
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.is_file() and (render.leftover(p) or _owned(specs, p) and p.name not in files))


def write_target(specs: Specs, arch: str, out_root: Path | None = None,
                 templates: Path | None = None) -> tuple[int, int]:
    """Render into generated/<arch>/, writing only changed files. Returns (written, removed)."""
    out_root = out_root or generated_root(specs)
    files, _ = render_target(specs, arch, templates)
    written = sum(render.write_if_changed(out_root / arch / name, text, out_root) for name, text in sorted(files.items()))
    stale = stale_files(specs, arch, files, out_root)
    for p in stale:
        try:
            render.inside(out_root, p).unlink(missing_ok=True)
        except OSError as e:
            raise render.WriteError(f"cannot remove {str(p)!r}: {e.strerror or e}") from None
    return written, len(stale)


def freshness(specs: Specs, arch: str, out_root: Path | None = None, templates: Path | None = None) -> list[str]:
    """Problems that make generated/<arch>/ differ from what the specs and templates render."""
    out_root = out_root or generated_root(specs)
    files, _ = render_target(specs, arch, templates)
    problems = []
    for name, text in sorted(files.items()):
        p = out_root / arch / name
        if not p.exists():
            problems.append(f"missing {p}")
        elif p.read_text() != text:
            problems.append(f"out of date {p}")
    problems += [f"stale {p}" for p in stale_files(specs, arch, files, out_root)]
    return problems


# ---------------------------------------------------------------------------------------------
# Compile + verify
# ---------------------------------------------------------------------------------------------
@attrs.define
class Result:
    variant: Variant
    status: str = "pending"  # rendered | compiled | cached | failed | missing-toolchain
    verified: bool | None = None
    message: str = ""
    seconds: float = 0.0
    artifact: Path | None = None
    image: bytes | None = attrs.field(default=None, repr=False)  # compile_variant(image=True): the code object
    # a cached verdict this machine could not check (no disassembler): the toolchain the record names
    recorded_by: str | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("compiled", "cached") and self.verified is True


def verify(v: Variant, tools: toolchain.Tools, artifact: Path) -> tuple[bool | None, str]:
    """Disassemble and check the target's expected (and forbidden) mnemonics for this variant: (True, why)
    or (False, why) is a verdict on the code object; (None, why) says the disassembler itself failed
    (killed, timed out, missing): no verdict, so nothing is recorded and the next build tries again."""
    r = toolchain.run(toolchain.disassemble_command(v.target, tools, artifact), tools)
    if r.returncode != 0:
        why = " ".join((r.stderr or r.stdout).split())[:2000]
        how = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
        return None, f"disassembler failed ({how})" + (f": {why}" if why else "")
    ops = toolchain.opcodes(r.stdout, v.target.vendor)
    if not ops:
        return False, "disassembly holds no instructions"
    missing = [m for m in v.expected_isa if not toolchain.has_mnemonic(ops, m)]
    present = [m for m in v.forbidden_isa if toolchain.has_mnemonic(ops, m)]
    if missing or present:
        parts = []
        if missing:
            parts.append(f"expected instructions missing: {', '.join(missing)}")
        if present:
            parts.append(f"forbidden instructions present: {', '.join(present)}")
        return False, "; ".join(parts)
    return True, f"{len(v.expected_isa)} expected instruction(s) found" if v.expected_isa else "no ISA expectation"


def _toolchain_line(tools: toolchain.Tools) -> str:
    """The compiler (and version) and disassembler of a verdict, as its record names them."""
    line = f"{Path(tools.compiler).name} {tools.compiler_version}".strip()
    line += f", {Path(tools.disassembler).name}" if tools.disassembler else ""
    return "".join(c for c in line if c.isprintable())[:500]


def _compile(v: Variant, tools: toolchain.Tools, entry: Entry, code: bytes, source: Path) -> tuple[Path | None, str]:
    """Compile exactly `code` (the source bytes the key hashed) into a temporary artifact of `entry`:
    (its path, "") or (None, the compiler's message). The compiler reads a private copy of the bytes,
    never `source` again, so a concurrent writer of `source` cannot put another object under this key."""
    copy = entry.temp_file(f".{v.toolchain.extension}")
    out = entry.temp_file(f".{v.toolchain.artifact}")
    try:
        copy.write_bytes(code)
        cmd = toolchain.compile_command(v.target, tools, copy, out, unit=source.name)
        r = toolchain.run(cmd, tools)
        if r.returncode != 0 or out.stat().st_size == 0:
            out.unlink(missing_ok=True)
            msg = (r.stderr or r.stdout).strip().replace(str(copy), str(source)) or f"exit {r.returncode}"
            return None, msg
        return out, ""
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    finally:
        copy.unlink(missing_ok=True)


def compile_variant(v: Variant, source: Path, cache_root: Path, tools: toolchain.Tools, image: bool = False) -> Result:
    """Compile (or reuse) one variant's code object and verify it. Never raises for compile errors.
    image=True: also return the code object's bytes (Result.image), the very bytes whose hash matched
    the entry's record under its lock (never read again from the file)."""
    t0 = time.perf_counter()
    res = Result(v)
    isa_key = render.sha256(json.dumps([v.expected_isa, v.forbidden_isa]))
    try:
        code = source.read_bytes()  # read once: the key hashes these bytes and the compiler gets them
        entry = Entry.of(cache_root, v, cache_key(v, tools, render.sha256(code)))
        with entry.lock():
            found = entry.read()
            if found is None:
                entry.clear()
                tmp_path, msg = _compile(v, tools, entry, code, source)
                if tmp_path is None:
                    res.status, res.message = "failed", msg
                    return res
                try:
                    data = tmp_path.read_bytes()
                    rec = entry.publish_artifact(tmp_path, data, {"variant": v.key, "source_sha256": render.sha256(code),
                                                                  "verified": {}})
                finally:
                    tmp_path.unlink(missing_ok=True)
                res.status = "compiled"
            else:
                rec, data = found
                res.status = "cached"
            res.artifact = entry.artifact
            res.image = data if image else None
            done = rec["verified"].get(isa_key)
            if done is None:
                ok, msg = verify(v, tools, entry.artifact)
                if ok is not None:  # a verdict; a failure of the disassembler itself is retried next time
                    rec["verified"][isa_key] = {"ok": ok, "message": msg, "toolchain": _toolchain_line(tools)}
                    entry.write_record(rec)
            else:
                ok, msg = done["ok"], done["message"]
                if tools.disassembler is None:  # the record's verdict: this machine cannot disassemble
                    res.recorded_by = done.get("toolchain") or (f"{_toolchain_line(tools)}, the disassembler "
                                                                "not recorded")
            res.verified, res.message = bool(ok), msg
    except toolchain.ToolchainMissing as e:
        res.status, res.message = "missing-toolchain", str(e)
    except UnsafePath as e:
        res.status, res.message = "failed", str(e)
    except OSError as e:
        res.status, res.message = "failed", f"{type(e).__name__}: {e}"
    finally:
        res.seconds = time.perf_counter() - t0
    return res


def build(specs: Specs, archs: Iterable[str], profile: str = "default", only: str | None = None,
          jobs: int | None = None, compile: bool = True, cache_dir: Path | None = None,
          out_root: Path | None = None, progress: Callable[[int, int, Result], None] | None = None,
          templates: Path | None = None) -> list[Result]:
    if jobs is not None and jobs < 1:
        raise ValueError(f"jobs = {jobs}: at least one compiler runs")
    archs = list(archs)
    out_root = out_root or generated_root(specs)
    for arch in archs:
        write_target(specs, arch, out_root, templates)
    selected, _ = enumerate_variants(specs, archs, profile, only)
    results = [Result(v, status="rendered") for v in selected]
    if not compile:
        return results
    cache_root = usable_dir(cache_dir)
    started = time.time()
    for arch in archs:  # a killed build's temporary files (their entries' locks are free)
        sweep_stale(cache_root, arch, started)

    def work(res: Result) -> Result:
        v = res.variant
        try:
            tools = toolchain.find(v.toolchain)
        except toolchain.ToolchainMissing as e:
            res.status, res.message = "missing-toolchain", str(e)
            return res
        return compile_variant(v, out_root / v.target.name / v.file, cache_root, tools)

    done = 0
    out: list[Result] = []
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as pool:
        try:
            for res in pool.map(work, results):
                done += 1
                out.append(res)
                if progress:
                    progress(done, len(results), res)
        except BaseException:  # KeyboardInterrupt, an error in progress(): stop every compiler now
            pool.shutdown(wait=False, cancel_futures=True)
            toolchain.kill_running()
            raise
    return out
