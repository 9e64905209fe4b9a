"""Reading a spec file: TOML text with the line of every table and key, and the located error.

tomllib keeps no positions, so a _Source keeps the text's lines and finds, when an error needs one,
the line of a table header or a key (table_line, key_line); _fail makes the SpecError that names it
as ``file:line: message``. _read reads one spec file into its _Source and its data, reporting an
unreadable file, text that is not UTF-8 and every TOML syntax error at its line. Nothing here knows
what a spec file may hold.
"""

from __future__ import annotations

import functools
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Callable

from . import spec_limits

class SpecError(Exception):
    """A spec problem, located: str(err) is 'file:line: message'."""


_Line = "int | Callable[[], int]"  # a line number, or a function that finds it (called on error only)


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

    def deepest_line(self, path: tuple[str, ...]) -> int:
        """Line of the first table or key that reaches farthest along `path` (an inline table's keys have
        none of their own: its key's line); 1 if nothing does."""
        for n in range(len(path), 0, -1):
            hit = next((i for i, p, _ in self.entries if p[:n] == path[:n]), None)
            if hit is not None:
                return hit
        return 1

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
        raw = spec_limits.read_bounded(path)  # at most MAX_FILE_BYTES, a regular file, never waited on
    except spec_limits.TooLarge as e:
        raise SpecError(f"{path}:1: {e}") from None
    except OSError as e:
        raise SpecError(f"{path}:1: cannot read the spec file ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        src = _Source(path, "")
        raise _fail(src, raw[:e.start].count(b"\n") + 1,
                    f"not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    src = _Source(path, text)
    deep = spec_limits.too_deep(text)  # before tomllib, which recurses once per level
    if deep is not None:
        raise _fail(src, deep, f"arrays / inline tables nested more than {spec_limits.MAX_DEPTH} deep")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
        line = int(m.group(1)) if m else 1
        msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(e))
        raise _fail(src, line, f"invalid TOML: {msg}") from None
    except RecursionError:  # nesting the scan above did not see (it never should)
        raise _fail(src, 1, "nested too deeply for the TOML parser") from None
    _check_lengths(src, text, data, ())
    return src, data, raw


def _check_lengths(src: _Source, text: str, node: Any, path: tuple[str, ...], depth: int = 0) -> None:
    """Every key and string of the file within MAX_STRING characters (before any message quotes one), at
    the line where it stands (found by its first characters; line 1 if an escape hides them); tables and
    arrays (dotted headers and keys included, which the text scan does not count) at most MAX_DEPTH deep,
    at the line of the first key that goes deeper."""
    if depth > spec_limits.MAX_DEPTH:
        raise _fail(src, lambda: src.deepest_line(path),
                    f"tables / arrays nested more than {spec_limits.MAX_DEPTH} deep (dotted keys count too)")
    items = node.items() if isinstance(node, dict) else ((None, v) for v in node) if isinstance(node, list) else ()
    for key, value in items:
        for s, what in ((key, "table or key name"), (value, f"[{show(path)}] {key}" if key else f"[{show(path)}]")):
            why = spec_limits.string_problem(s) if isinstance(s, str) else None
            if why:
                at = text.find(s[:64])
                raise _fail(src, text.count("\n", 0, at) + 1 if at >= 0 else 1, f"{what}: {why}")
        if isinstance(value, (dict, list)):
            _check_lengths(src, text, value, path + ((key,) if key is not None else ()), depth + 1)
