"""Content-addressed cache of compiled code objects.

Key = sha256(toolkit version, target, compiler + version, flags, source sha256). Each entry is
`<target>/<variant name>-<key[:20]>.<artifact>` beside a `.json` record holding the artifact's
sha256 (a truncated or tampered entry is detected and rebuilt) and the verification results.
Writers take a per-entry file lock and publish with an atomic rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import attrs

from . import __version__
from .model import Variant
from .toolchain import Tools


def default_dir() -> Path:
    env = os.environ.get("EPGEN_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "epgen"


def usable_dir(path: Path | None = None) -> Path:
    """The cache dir, or a temporary one (with a warning) when it cannot be written."""
    path = path or default_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return path
    except OSError as e:
        tmp = Path(tempfile.gettempdir()) / f"epgen-cache-{os.getuid()}"
        warnings.warn(f"cache dir {path} is not writable ({e.strerror}); using {tmp}", stacklevel=2)
        tmp.mkdir(parents=True, exist_ok=True)
        return tmp


def cache_key(v: Variant, tools: Tools, source_sha256: str) -> str:
    blob = json.dumps({"epgen": __version__, "target": v.target.name, "compiler": Path(tools.compiler).name,
                       "compiler_version": tools.compiler_version, "flags": list(v.target.flags),
                       "bare": tools.bare_clang, "source": source_sha256}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@attrs.frozen
class Entry:
    artifact: Path
    record: Path

    @classmethod
    def of(cls, root: Path, v: Variant, key: str) -> "Entry":
        d = root / v.target.name
        stem = f"{v.name}-{key[:20]}"
        return cls(d / f"{stem}.{v.toolchain.artifact}", d / f"{stem}.json")

    def load(self) -> dict | None:
        """The record if the entry is complete and its artifact matches its recorded hash."""
        try:
            rec = json.loads(self.record.read_text())
            if rec.get("sha256") == file_sha256(self.artifact):
                return rec
        except (OSError, ValueError):
            pass
        return None

    @contextlib.contextmanager
    def lock(self):
        self.artifact.parent.mkdir(parents=True, exist_ok=True)
        with open(self.artifact.with_suffix(".lock"), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def publish_artifact(self, tmp_artifact: Path, record: dict) -> dict:
        record = dict(record, sha256=file_sha256(tmp_artifact))
        os.replace(tmp_artifact, self.artifact)
        self.write_record(record)
        return record

    def write_record(self, record: dict) -> None:
        tmp = self.record.with_name(f".{self.record.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(tmp, self.record)
