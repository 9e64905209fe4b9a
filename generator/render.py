"""Rendering: Variant -> source text, with Jinja in StrictUndefined mode; writes only on change."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import jinja2

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
    """File loader confined to templates/ (no absolute paths, no '..')."""

    def get_source(self, environment, template):
        if template.startswith("/") or ".." in Path(template).parts:
            raise jinja2.TemplateNotFound(f"{template} (template paths must stay inside templates/)")
        return super().get_source(environment, template)


def environment(root: Path = TEMPLATES) -> jinja2.Environment:
    return jinja2.Environment(
        loader=_Loader(str(root)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def render(v: Variant, env: jinja2.Environment | None = None) -> str:
    env = env or environment()
    text = env.get_template("variant.j2").render(
        v=v, abi=abi, family=v.family, dtype=v.dtype, wire=v.wire, quant=v.quant, target=v.target,
        topology=v.topology)
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


def write_if_changed(path: Path, text: str, root: Path) -> bool:
    """Atomically write text to path (which must stay under root) unless it already holds exactly that.
    Returns True if written."""
    inside(root, path)
    data = text.encode()
    try:
        if path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return True
