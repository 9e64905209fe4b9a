"""Content-addressed cache of compiled code objects.

Key = sha256(toolkit version, target, compiler + version, flags, source sha256). Each entry is
`<target>/<variant name>-<key[:20]>.<artifact>` beside a `.json` record holding the artifact's
sha256 (a truncated or tampered entry is detected and rebuilt) and the verification results.
Writers take a per-entry file lock and publish with an atomic rename; temporary files of an entry
(`.<stem>.*`) are swept under its lock, so a killed build leaves nothing behind for long.

The cache root is trusted only when it is ours: the fallback under the shared temporary folder is used
only if it is a real directory (not a symlink) owned by this user that no one else can write. Every
path the writer makes is a plain component under the root, checked again after resolving.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import stat
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


class UnsafePath(ValueError):
    """A cache path that is not a plain component, or resolves outside the cache root."""


def private_dir(path: Path) -> str | None:
    """Create `path` (mode 0700) or accept an existing one; None when it is safe to use, else why not:
    it must be a real directory (never a symlink) owned by this user, without group/other write."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        return e.strerror or str(e)
    try:
        st = os.lstat(path)
    except OSError as e:
        return e.strerror or str(e)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return "not a real directory (a symlink or a file)"
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & 0o022:
        return f"writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _writable(path: Path) -> OSError | None:
    try:
        probe = path / f".probe.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return e
    return None


_fresh: dict[Path, Path] = {}  # an unusable cache dir -> the private temporary dir made instead of it
_warned: set[Path] = set()  # unusable cache dirs warned about (once per process)


def usable_dir(path: Path | None = None) -> Path:
    """The cache dir; when it cannot be written, `$TMPDIR/epgen-cache-<uid>` if it is ours (private_dir),
    else a fresh private temporary dir. Warns once per process and unusable dir."""
    path = path or default_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        err = _writable(path)
    except OSError as e:
        err = e
    if err is None:
        return path
    tmp = Path(tempfile.gettempdir()) / f"epgen-cache-{os.getuid()}"
    why = private_dir(tmp) or ("not writable" if _writable(tmp) else None)
    note = f"cache dir {path} is not writable ({err.strerror})"
    if why is not None:
        if path not in _fresh:
            _fresh[path] = Path(tempfile.mkdtemp(prefix="epgen-cache-"))
        note += f" and the fallback {tmp} is unsafe ({why})"
        tmp = _fresh[path]
    if path not in _warned:
        _warned.add(path)
        warnings.warn(f"{note}; using {tmp}", stacklevel=2)
    return tmp


def plain_component(value: str, what: str) -> str:
    """`value` if it can be one path component: no separator, not `.`/`..`, no leading dot or dash,
    nothing non-printable (NUL, line breaks); else UnsafePath."""
    if (not isinstance(value, str) or not value or "/" in value or "\\" in value or value in (".", "..")
            or value[0] in ".-" or not value.isprintable()):
        raise UnsafePath(f"cache: {what} {value!r} is not a plain file name")
    return value


MAX_RECORD = 1 << 20  # bytes: a record holds a hash and a few verification results
MAX_ARTIFACT = 1 << 28  # bytes: a code object (the largest today is well under 1 MiB)


def read_regular(path: Path, limit: int) -> bytes | None:
    """The bytes of `path` if it is a regular file (not a link, a FIFO, a device or a directory) of at
    most `limit` bytes, else None. Opened without following a link and without blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        chunks, n = [], 0
        while n <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - n))
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
        return b"".join(chunks) if n <= limit else None
    except OSError:
        return None
    finally:
        os.close(fd)


def valid_record(rec) -> bool:
    """A record as the writer makes it: a JSON object with the artifact's sha256 (64 hex digits) and
    `verified`, an object of {"ok": bool, "message": str, "toolchain": str} results keyed by ISA-expectation hash
    (toolchain: the compiler and disassembler that gave the verdict, one printable line; absent in older records)."""
    if not isinstance(rec, dict) or not isinstance(rec.get("sha256"), str) or not re.fullmatch(r"[0-9a-f]{64}", rec["sha256"]):
        return False
    verified = rec.get("verified")
    return isinstance(verified, dict) and all(
        isinstance(k, str) and isinstance(r, dict) and set(r) - {"toolchain"} == {"ok", "message"}
        and isinstance(r["ok"], bool) and isinstance(r["message"], str)
        and _line_or_none(r.get("toolchain")) for k, r in verified.items())


def _line_or_none(t) -> bool:
    """None, or one printable line of at most 500 characters (a record's text a terminal shows)."""
    return t is None or isinstance(t, str) and len(t) <= 500 and t.isprintable()


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


def _lock_fd(path: Path) -> int:
    """An open descriptor of the lock file `path` (created if missing; never through a symlink)."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


_TEMP = re.compile(r"\.(.+-[0-9a-f]{20})\..+")  # .<stem>.<anything>: a writer's temporary file


def _outside(root: Path, d: Path) -> Path | None:
    """Where `d` resolves to if that is not strictly inside the resolved `root`, else None."""
    real = d.resolve()
    return real if real == root.resolve() or not real.is_relative_to(root.resolve()) else None


def sweep_stale(root: Path, target: str, before: float) -> int:
    """Remove the temporary files in `root/target` last written before `before` whose entry's lock no
    live process holds (a killed build's leftovers). Returns how many were removed."""
    d = root / target
    if not d.is_dir() or _outside(root, d):
        return 0
    stale: dict[str, list[Path]] = {}
    for p in d.iterdir():
        m = _TEMP.fullmatch(p.name)
        with contextlib.suppress(FileNotFoundError):
            if m and p.lstat().st_mtime < before:
                stale.setdefault(m.group(1), []).append(p)
    removed = 0
    for stem, files in stale.items():
        try:
            fd = _lock_fd(d / f"{stem}.lock")
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: a live writer of this entry
            removed += _unlink(files)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)  # releases the lock
    return removed


def _unlink(paths) -> int:
    n = 0
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            n += 1
    return n


@attrs.frozen
class Entry:
    """One cache entry: `<root>/<target>/<stem>.<artifact>` and `<stem>.json`, locked by `<stem>.lock`;
    its writers' temporary files are `.<stem>.*` beside them."""

    root: Path
    artifact: Path
    record: Path

    @classmethod
    def of(cls, root: Path, v: Variant, key: str) -> "Entry":
        d = root / plain_component(v.target.name, "target name")
        stem = plain_component(f"{v.name}-{key[:20]}", "variant name")
        ext = plain_component(v.toolchain.artifact, "artifact extension")
        return cls(root, d / f"{stem}.{ext}", d / f"{stem}.json")

    @property
    def stem(self) -> str:
        return self.record.stem

    def temp_file(self, suffix: str) -> Path:
        """A new empty temporary file of this entry (created exclusively: never an existing path)."""
        fd, tmp = tempfile.mkstemp(prefix=f".{self.stem}.", suffix=suffix, dir=self.artifact.parent)
        os.close(fd)
        return Path(tmp)

    def read(self) -> tuple[dict, bytes] | None:
        """(record, artifact bytes) if the entry is complete, well formed and those bytes match the
        recorded hash; else None (the entry is rebuilt). The artifact is read once: the bytes hashed are
        the bytes returned. Only regular files are read (never through a link, never a FIFO or a device,
        which could block or never end), each up to its size limit."""
        raw = read_regular(self.record, MAX_RECORD)
        data = read_regular(self.artifact, MAX_ARTIFACT) if raw is not None else None
        if data is None:
            return None
        try:
            rec = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser's depth
            return None
        if valid_record(rec) and rec["sha256"] == hashlib.sha256(data).hexdigest():
            return rec, data
        return None

    def clear(self) -> None:
        """Make room for a rebuild (under the lock): a directory where the artifact or the record goes is
        removed (anything else there is replaced by the atomic rename)."""
        for p in (self.artifact, self.record):
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISDIR(os.lstat(p).st_mode):
                    shutil.rmtree(p)

    def _checked_dir(self) -> Path:
        """The entry's directory, created; UnsafePath if it resolves outside the cache root."""
        d = self.artifact.parent
        d.mkdir(parents=True, exist_ok=True)
        real = _outside(self.root, d)
        if real is not None:
            raise UnsafePath(f"cache: refusing to write in {d}: it resolves to {real}, outside the cache root "
                             f"{self.root.resolve()}")
        return d

    @contextlib.contextmanager
    def lock(self):
        """Hold the entry's lock; its stale temporary files are removed first (no live writer has any)."""
        fd = _lock_fd(self._checked_dir() / f"{self.stem}.lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            _unlink(self.artifact.parent.glob(f".{glob.escape(self.stem)}.*"))
            yield
        finally:
            os.close(fd)  # releases the lock

    def publish_artifact(self, tmp_artifact: Path, data: bytes, record: dict) -> dict:
        """Publish the temporary artifact holding `data` (already read) with a record of its hash."""
        record = dict(record, sha256=hashlib.sha256(data).hexdigest())
        os.replace(tmp_artifact, self.artifact)
        self.write_record(record)
        return record

    def write_record(self, record: dict) -> None:
        tmp = self.temp_file(".tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(tmp, self.record)
