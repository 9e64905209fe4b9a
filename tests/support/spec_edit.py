"""Editing a copy of specs/ in tests: one textual replacement, and where a needle stands."""

import re

LOCATED = re.compile(r"(?P<file>[^\n]+?):(?P<line>\d+): (?P<msg>[^\n]+)")  # one `file:line: message`


def mutate(path, old, new):
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def line_of(path, needle):
    """Line of the last occurrence (a duplicate is reported where it repeats); TOML lines end at \\n only."""
    hits = [i for i, line in enumerate(path.read_text().split("\n"), 1) if needle in line]
    assert hits, needle
    return hits[-1]
