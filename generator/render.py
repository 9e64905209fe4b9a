"""Rendering: Variant -> source text, with Jinja in StrictUndefined mode; writes only on change."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import jinja2

from . import abi
from .model import Variant
from .specs import checkout_root, packaged_root

# the checkout's templates/, else the copy shipped in the installed package (generator/data/templates)
TEMPLATES = (checkout_root() or packaged_root()) / "templates"


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


def write_if_changed(path: Path, text: str) -> bool:
    """Atomically write text to path unless it already holds exactly that. Returns True if written."""
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
