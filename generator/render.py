"""Rendering: Variant -> source text, with Jinja in StrictUndefined mode; writes only on change."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path

import jinja2
import jinja2.sandbox

from . import abi
from .model import Variant
from .specs import TEMPLATES  # the checkout's templates/, else the copy shipped in the package


class OutsideRoot(ValueError):
    """A path the generator was asked to write or remove resolves outside the folder it owns."""


def inside(root: Path, path: Path) -> Path:
    """`path`, after checking that it resolves (links followed) to a place under `root`: the writer's
    second line of defence behind the loader's checks of every value that becomes a path part."""
    if not path.resolve().is_relative_to(root.resolve()):
        raise OutsideRoot(f"refusing to write {str(path)!r}: it resolves outside {str(root)!r}")
    return path


class _Loader(jinja2.FileSystemLoader):
    """File loader confined to one template folder: no absolute paths, no '..', and no file that resolves
    (links followed) outside the folder."""

    def get_source(self, environment, template):
        if template.startswith("/") or ".." in Path(template).parts:
            raise jinja2.TemplateNotFound(f"{template} (template paths must stay inside templates/)")
        root = Path(self.searchpath[0]).resolve()
        real = (root / template).resolve()
        if not real.is_relative_to(root):
            raise jinja2.TemplateNotFound(f"{template} (it resolves to {str(real)!r}, outside the template folder "
                                          f"{str(root)!r})")
        return super().get_source(environment, template)


def environment(root: Path | None = None) -> jinja2.Environment:
    """The Jinja environment of the template folder `root` (default: the project's templates/). Sandboxed:
    a template reaches only the values given to it, never Python internals (`__globals__`, `__class__`,
    ...) or anything that runs a program, whichever folder it comes from."""
    return jinja2.sandbox.SandboxedEnvironment(
        loader=_Loader(str(root or TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def render(v: Variant, env: jinja2.Environment | None = None) -> str:
    env = env or environment()
    sig = v.family.signature  # the launch arguments: the parameter list, the struct, the shared limits
    text = env.get_template("variant.j2").render(
        v=v, abi=abi, family=v.family, dtype=v.dtype, wire=v.wire, quant=v.quant, target=v.target,
        topology=v.topology, signature=sig, limits=dict(sig.limits),
        params=sig.c_params(",\n" + " " * 4, restrict_inputs=not v.target.programmatic_launch),
        limits_of=v.family.limits_of)
    # normalise: no trailing spaces, exactly one final newline, at most one blank line in a row
    out, blank = [], False
    for line in text.splitlines():
        line = line.rstrip()
        if not line:
            if blank:
                continue
            blank = True
        else:
            blank = False
        out.append(line)
    return "\n".join(out).strip("\n") + "\n"


def sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


class WriteError(ValueError):
    """A generated file could not be written (a full disk, no permission, ...): nothing partial is left."""


_TMP = re.compile(r"\.(.+)\.(\d+)\.tmp")  # write_if_changed's temporary file: .<name>.<pid>.tmp


def leftover(path: Path) -> bool:
    """Is `path` a temporary file of write_if_changed whose writer is gone (killed mid-write)?"""
    m = _TMP.fullmatch(path.name)
    if not m:
        return False
    try:
        os.kill(int(m.group(2)), 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):
        return False  # alive (another user's) or not a pid at all
    return False


def write_if_changed(path: Path, text: str, root: Path) -> bool:
    """Atomically write text to path (which must stay under root) unless it already holds exactly that.
    Returns True if written. A failed write (ENOSPC, EACCES, ...) removes its temporary file and raises
    WriteError, one line naming the file; the old file, if any, is untouched."""
    inside(root, path)
    data = text.encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        try:
            if path.read_bytes() == data:
                return False
        except FileNotFoundError:
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise WriteError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
    return True
