"""Issue 26 (trust, round two), spec part: deep nesting, oversized files and strings, two combinations
with one variant name, and numbers that do not render exactly are each one `file:line: message` (or one
line from the CLI), never a traceback, and nothing is rendered.

Every test here failed on 7b1a81d (the deep dotted tables' test on 8d9f429).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from generator import specs as S
from generator import spec_limits as L
from tests.support.spec_edit import LOCATED, line_of, mutate

ROOT = Path(__file__).resolve().parents[2]


def _located(spec_copy, file, line=None) -> str:
    with pytest.raises(S.SpecError) as e:
        S.load(spec_copy)
    text = str(e.value)
    m = LOCATED.fullmatch(text)
    assert m and "\n" not in text and len(text) < 500, text[:500]
    assert m["file"].endswith(file), text
    if line is not None:
        assert int(m["line"]) == line, text
    return m["msg"]


def _cli(spec_copy, *argv, limit_as: int | None = None) -> subprocess.CompletedProcess:
    def limits():
        if limit_as:
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))

    return subprocess.run([sys.executable, "-m", "generator", "--specs", str(spec_copy), *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, preexec_fn=limits)


# ---------------------------------------------------------------------------------------------
# 1: deep nesting is one located line, not a RecursionError
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["[" * 500 + "]" * 500, "{a=" * 2000 + "1" + "}" * 2000,
                                   "[" * (L.MAX_DEPTH + 1) + "]" * (L.MAX_DEPTH + 1)])
def test_deep_nesting_is_located(spec_copy, value):
    path = spec_copy / "profiles.toml"
    path.write_text(path.read_text() + f"\n[profile.deep]\nx = {value}\n")
    msg = _located(spec_copy, "profiles.toml", line_of(path, "x = "))
    assert msg == f"arrays / inline tables nested more than {L.MAX_DEPTH} deep", msg


_DOTTED = ".".join(["a"] * 3000)


@pytest.mark.parametrize("table, line", [(f"[quant.none.{_DOTTED}]\nx = 1", "[quant.none.a.a"),
                                         (f"[[quant.none.{_DOTTED}]]\nx = 1", "[[quant.none.a.a"),
                                         (f"[quant.deep]\n{_DOTTED} = 1", "a.a.a"),
                                         (f"[quant.deep]\nx = {{{_DOTTED} = 1}}", "x = {"),
                                         ("[quant.deep." + ".".join(["b"] * 20) + "]\nx = " + "[" * 15 + "]" * 15,
                                          "x = [")],
                         ids=["header", "array-of-tables", "dotted-key", "inline-table", "header-and-arrays"])
def test_deep_dotted_tables_are_located(spec_copy, table, line):
    """Dotted headers and keys nest tables that the text scan does not count (tomllib reads them without
    recursion; the checks after it recursed once per level)."""
    path = spec_copy / "quant.toml"
    path.write_text(path.read_text() + f"\n{table}\n")
    msg = _located(spec_copy, "quant.toml", line_of(path, line))
    assert msg == f"tables / arrays nested more than {L.MAX_DEPTH} deep (dotted keys count too)", msg


def test_dotted_tables_within_the_limit_are_read(spec_copy):
    path = spec_copy / "quant.toml"
    path.write_text(path.read_text() + "\n[quant.deep." + ".".join(["b"] * (L.MAX_DEPTH - 2)) + "]\nx = 1\n")
    msg = _located(spec_copy, "quant.toml")  # read, then refused by the schema (an unknown key), not for depth
    assert "nested" not in msg and "unknown key 'b'" in msg, msg


def test_nesting_inside_strings_and_comments_is_not_counted(spec_copy):
    path = spec_copy / "profiles.toml"
    deep = "[" * 100
    path.write_text(path.read_text().replace('[profile.all]', f'# {deep}\n[profile.all]', 1))
    mutate(spec_copy / "targets.toml", 'description = "AMD gfx1250"', f'description = "AMD gfx1250 {deep}"')
    S.load(spec_copy)


# ---------------------------------------------------------------------------------------------
# 2: declared limits per file and per string
# ---------------------------------------------------------------------------------------------
def test_sparse_huge_spec_file_is_refused_unread(spec_copy):
    path = spec_copy / "profiles.toml"
    with open(path, "r+b") as f:
        f.truncate(64 << 30)  # a 64 GiB sparse file
    r = _cli(spec_copy, "list", limit_as=4 << 30)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr == f"error: {path}:1: {64 << 30} bytes: a spec file has at most {L.MAX_FILE_BYTES}\n", r.stderr


def test_spec_file_that_is_not_a_regular_file(spec_copy):
    path = spec_copy / "quant.toml"
    path.unlink()
    os.mkfifo(path)
    msg = _located(spec_copy, "quant.toml", 1)
    assert "not a regular file" in msg or "spec file missing" in msg, msg


@pytest.mark.parametrize("field", ["description", "message", "install_hint"])
def test_long_string_is_refused_briefly(spec_copy, field):
    big = "x" * 200_000  # under the file limit, far over the string limit
    site = {"description": ("targets.toml", 'description = "AMD gfx1250"'),
            "message": ("rules.toml", 'message = "combine dtypes are bf16 or fp32"'),
            "install_hint": ("targets.toml", 'install_hint = "the CUDA')}[field]
    old = site[1]
    new = old.replace('"', f'"{big}', 1) if field != "install_hint" else old.replace('"', f'"{big} ', 1)
    mutate(spec_copy / site[0], old, new)
    msg = _located(spec_copy, site[0], line_of(spec_copy / site[0], big[:100]))
    assert len(msg) < 300 and f"characters ('xxxx" in msg and msg.endswith(f"at most {L.MAX_STRING}"), msg


def test_long_table_name_is_refused_briefly(spec_copy):
    name = "p" * 5000
    path = spec_copy / "profiles.toml"
    path.write_text(path.read_text() + f"\n[profile.{name}]\nfamilies = []\n")
    msg = _located(spec_copy, "profiles.toml")
    assert len(msg) < 300 and f"at most {L.MAX_STRING}" in msg, msg


# ---------------------------------------------------------------------------------------------
# 3: two combinations never share a variant name
# ---------------------------------------------------------------------------------------------
def _colliding_quant(spec_copy):
    """A quant named like a dtype: (bf16, wire fp8_e4m3fnuz, quant none) and (bf16, wire same, quant
    fp8_e4m3fnuz) would both be quantize_fp8.bf16.fp8_e4m3fnuz."""
    q = spec_copy / "quant.toml"
    q.write_text(q.read_text() + '\n[quant.fp8_e4m3fnuz]\nwire_kind = "fp8"\nblock = 0\nscale = "none"\n')
    mutate(spec_copy / "kernels.toml", 'wire_dtypes = ["fp8_e4m3fn", "fp8_e4m3fnuz"]\nquants = ["fp8_direct_cast", '
                                       '"fp8_blockwise"]',
           'wire_dtypes = ["fp8_e4m3fn", "fp8_e4m3fnuz", "same"]\nquants = ["fp8_direct_cast", "fp8_blockwise", '
           '"none", "fp8_e4m3fnuz"]')


def test_two_combinations_with_one_name_are_refused(spec_copy, tmp_path):
    _colliding_quant(spec_copy)
    msg = _located(spec_copy, "quant.toml", line_of(spec_copy / "quant.toml", "[quant.fp8_e4m3fnuz]"))
    assert "'fp8_e4m3fnuz'" in msg and "dtype" in msg, msg
    out = tmp_path / "gen"
    r = _cli(spec_copy, "build", "--arch", "gfx950", "--no-compile", "--out", str(out))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert not out.exists()


def test_variant_names_are_unique_even_past_the_loader(specs):
    """The enumeration's own check (behind the loader's), on specs changed in memory."""
    import attrs

    from generator.model import enumerate_variants

    quants = dict(specs.quants, fp8_e4m3fnuz=attrs.evolve(specs.quants["fp8_direct_cast"], name="fp8_e4m3fnuz"))
    fam = attrs.evolve(specs.families["quantize_fp8"], wire_dtypes=("fp8_e4m3fnuz", "same"),
                       quants=("none", "fp8_e4m3fnuz"))
    bad = attrs.evolve(specs, quants=quants, families=dict(specs.families, quantize_fp8=fam))
    with pytest.raises(S.SpecError, match=r"^gfx950/quantize_fp8\.bf16\.fp8_e4m3fnuz: two combinations have this "
                                          r"variant name \(.+\): dtype, quant and topology names must not be "
                                          r"mistaken for one another$"):
        enumerate_variants(bad, ["gfx950"], "all")


# ---------------------------------------------------------------------------------------------
# 4: numbers render exactly in the target's float type, or are refused
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["1e-300", "1e-40", "0.1", "239.99999999"])
def test_fp8_max_that_does_not_render_exactly_is_refused(spec_copy, value):
    mutate(spec_copy / "targets.toml", "fp8_max = 240.0", f"fp8_max = {value}")
    msg = _located(spec_copy, "targets.toml", line_of(spec_copy / "targets.toml", f"fp8_max = {value}"))
    assert msg == (f"[target.gfx942] fp8_max = {float(value)!r}: not exactly a 32-bit float (the kernels' "
                   f"float would hold {L.float32_value(float(value))!r})"), msg


@pytest.mark.parametrize("value", ["240.0", "224.0", "0.5", "1.5"])
def test_exact_fp8_max_is_accepted(spec_copy, value):
    mutate(spec_copy / "targets.toml", "fp8_max = 240.0", f"fp8_max = {value}")
    assert S.load(spec_copy).targets["gfx942"].fp8_max == float(value)


# ---------------------------------------------------------------------------------------------
# 5: a family's launch bounds (max_threads, min_blocks) are range-checked where they stand
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("old,new,message", [
    ("min_blocks = 3", "min_blocks = 33", "min_blocks = 33"),
    ("min_blocks = 3", "min_blocks = -1", "min_blocks = -1"),
    ("max_threads = 256", "max_threads = 384", "max_threads = 384"),
    ("max_threads = 256", "max_threads = 32", "max_threads = 32"),
])
def test_launch_bounds_out_of_range_are_located(spec_copy, old, new, message):
    mutate(spec_copy / "kernels.toml", old, new)
    msg = _located(spec_copy, "kernels.toml", line_of(spec_copy / "kernels.toml", new))
    assert msg.startswith(f"[family.grouped_scale] {message}"), msg


# ---------------------------------------------------------------------------------------------
# a target's programmatic_launch is true or false, nothing else (it decides how the runtime launches)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ['"yes"', "1", "0", "[true]"])
def test_programmatic_launch_must_be_a_boolean(spec_copy, value):
    path = spec_copy / "targets.toml"
    path.write_text(path.read_text().replace("programmatic_launch = true", f"programmatic_launch = {value}", 1))
    msg = _located(spec_copy, "targets.toml", line_of(path, f"programmatic_launch = {value}"))
    assert msg.startswith("[target.sm_90] programmatic_launch: expected true or false"), msg


def test_programmatic_launch_is_refused_on_an_amd_target(spec_copy):
    path = spec_copy / "targets.toml"
    text = path.read_text()
    path.write_text(text.replace('[target.gfx942]\n', '[target.gfx942]\nprogrammatic_launch = true\n', 1))
    line = text.split("\n").index("[target.gfx942]") + 2  # the inserted line, below the table's header
    msg = _located(spec_copy, "targets.toml", line)
    assert msg == "[target.gfx942] programmatic_launch: only nvidia targets launch that way (this one is amd)", msg
