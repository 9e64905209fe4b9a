"""The declared size limits of spec input, checked where it enters (before tomllib sees it): bytes per
spec file, characters per string or key, nesting depth of arrays and inline tables; and whether a
number renders exactly in the target's float type. Pure functions: the loader turns each `why` into
one `file:line: message`."""

from __future__ import annotations

import math
import os
import stat
import struct
from pathlib import Path

MAX_FILE_BYTES = 1 << 20  # a spec file (the largest today is under 8 KiB)
MAX_STRING = 1024  # characters of one string value or key (the longest today: under 300)
MAX_DEPTH = 32  # arrays / inline tables inside each other (the specs use 3)


class TooLarge(ValueError):
    """A spec file over MAX_FILE_BYTES, or one that is not a regular file."""


def read_bounded(path: Path, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them; TooLarge (its message says why) for
    a larger file (a sparse one too: its size is checked before anything is read) or one that is not a
    regular file (a FIFO, a device: never read without bound, never waited on). OSError as the OS says."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TooLarge("not a regular file")
        if st.st_size > limit:
            raise TooLarge(f"{st.st_size} bytes: a spec file has at most {limit}")
        chunks, n = [], 0
        while n <= limit:
            chunk = os.read(fd, limit + 1 - n)
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
        if n > limit:  # grew while read
            raise TooLarge(f"more than {limit} bytes: a spec file has at most {limit}")
        return b"".join(chunks)
    finally:
        os.close(fd)


def too_deep(text: str, limit: int = MAX_DEPTH) -> int | None:
    """The line where arrays / inline tables nest more than `limit` deep (outside strings and comments),
    else None. A scan of the TOML text, so that tomllib never recurses that deep."""
    depth, line, i, n = 0, 1, 0, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
        elif c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        elif c in "\"'":
            quote = c * 3 if text.startswith(c * 3, i) else c
            j = i + len(quote)
            while j < n and not text.startswith(quote, j):
                if text[j] == "\\" and c == '"':
                    j += 1
                elif text[j] == "\n" and len(quote) == 1:
                    break  # an unterminated one-line string: tomllib reports it
                j += 1
            line += text.count("\n", i, j)
            i = j + len(quote)
            continue
        elif c in "[{":
            depth += 1
            if depth > limit:
                return line
        elif c in "]}":
            depth = max(0, depth - 1)
        i += 1
    return None


def string_problem(value: str, limit: int = MAX_STRING) -> str | None:
    """Why the string `value` is too long to be a spec value or key (never quoting it whole), else None."""
    if len(value) > limit:
        return f"a string of {len(value)} characters ({value[:20]!r}...): at most {limit}"
    return None


def float32_value(x: float) -> float | None:
    """The value a C `float` holds for the literal `{x!r}f` (the float32 nearest x), None past its range."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return None


def float32_exact(x: float) -> bool:
    """Does `x` render exactly as a C `float` literal (`{x!r}f`): is the nearest float32 x itself?"""
    return math.isfinite(x) and float32_value(x) == x
