"""docs/ tables of measured figures are what a script prints from committed records (README.md's own tables:
tests/project/test_readme.py). A doc cites its table's command (`python scripts/<name>_table.py <records>`); the table
that follows the citation is that command's output, row for row, run on the records in results/ that it names
(results/<date>-<machine>-<commit>/*.jsonl: the records there are of that commit). In the docs listed in
EVERY_ROW_FROM_RECORDS, a table row with a measured figure that no cited command prints fails."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CITATION = re.compile(r"`python (scripts/\w+_table\.py)((?: [^`\s]+)*)`")
EVERY_ROW_FROM_RECORDS = ("docs/LAYER.md",)
FIGURE = re.compile(r"\|\s*[^|]*\d\.\d")  # a cell with a decimal figure


def _citations(doc: str) -> list[tuple[int, str, list[str]]]:
    """(offset, script, record files) of every committed-records table command the doc cites."""
    text = (ROOT / doc).read_text()
    out = []
    for m in CITATION.finditer(text):
        files = m.group(2).split()
        if all((ROOT / f).is_file() for f in files):  # else a how-to naming a GPU run's output, not a source
            out.append((m.end(), m.group(1), files))
    return out


def _printed(script: str, files: list[str]) -> list[str]:
    r = subprocess.run([sys.executable, script, *files], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{script} {' '.join(files)}: {r.stderr[-2000:]}"
    return [line for line in r.stdout.splitlines() if line.startswith("|")]


def _table_after(text: str, at: int) -> list[str]:
    """The rows of the first markdown table after offset `at` (before the next heading)."""
    rows: list[str] = []
    for line in text[at:].splitlines():
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return rows


DOCS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
CASES = [(doc, at, script, files) for doc in DOCS for at, script, files in _citations(doc)]


def test_the_docs_cite_record_tables():
    cited = {(doc, script) for doc, _, script, _ in CASES}
    assert ("docs/LAYER.md", "scripts/grouped_profile_table.py") in cited
    assert ("docs/BENCH.md", "scripts/sweep_table.py") in cited


@pytest.mark.parametrize("doc,at,script,files", CASES, ids=[f"{d}: {s} {' '.join(f)}" for d, _, s, f in CASES])
def test_a_cited_table_is_what_its_records_make(doc, at, script, files):
    for f in files:
        m = re.fullmatch(r"results/\d{4}-\d\d-\d\d-[^/]+-(\w+)/[^/]+\.jsonl", f)
        assert m, f"{f}: records live in results/<date>-<machine>-<commit>/"
        commits = {json.loads(line).get("commit") for line in (ROOT / f).read_text().splitlines() if line.strip()}
        assert commits == {m.group(1)}, f"{f}: records of {commits}, in the folder of {m.group(1)}"
    shown = _table_after((ROOT / doc).read_text(), at)
    assert shown, f"{doc}: no table after `python {script}`"
    assert shown == _printed(script, files), f"{doc}: the table after `python {script}` is not what it prints"


@pytest.mark.parametrize("doc", EVERY_ROW_FROM_RECORDS)
def test_every_figure_row_comes_from_records(doc):
    made = {row for _, script, files in _citations(doc) for row in _printed(script, files)}
    rows = [line for line in (ROOT / doc).read_text().splitlines() if line.startswith("|") and FIGURE.search(line)]
    assert rows, f"{doc}: no figures to check"
    assert [r for r in rows if r not in made] == [], f"{doc}: figures that no cited records table prints"
