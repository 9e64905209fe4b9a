"""Trust hardening of the generator (issue 16, defects 1-3 and 6-9): a spec string cannot put code into a
generated source, a spec value cannot become a path outside the generator's folders or name a program
to run, and every bad value is one `file:line: message` naming it, at its own line, never a traceback."""

import attrs
import pytest

from generator import build as B
from generator import render, toolchain
from generator import spec_schema as schema
from generator import specs as S
from generator.cli import main
from generator.model import enumerate_variants
from tests.support.spec_edit import LOCATED, line_of, mutate


def _located(spec_copy, file, needle=None):
    """Load the copy, expect one located error in `file` (at the line of `needle`); return its message."""
    with pytest.raises(S.SpecError) as e:
        S.load(spec_copy)
    text = str(e.value)
    m = LOCATED.fullmatch(text)
    assert m, text
    assert m["file"].endswith(file), text
    if needle is not None:
        assert int(m["line"]) == line_of(spec_copy / file, needle), text
    return m["msg"]


def _cli(spec_copy, *argv, capsys):
    """Run the CLI on the copy: (exit status, stderr lines); never a traceback."""
    try:
        rc = main(["--specs", str(spec_copy), *argv])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err.strip().splitlines()


def _files_under(path):
    return sorted(p for p in path.rglob("*")) if path.exists() else []


# ---------------------------------------------------------------------------------------------
# 1. Unicode line breaks and other non-printable characters in spec strings
# ---------------------------------------------------------------------------------------------
LINE_BREAKS = ["\u2028", "\u2029", "\u0085", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\n", "\r"]
NON_PRINTABLE = ["\u200b", "\u00a0", "\u202e", "\x7f", "\t", "\ue000", "\U000e0041", "\u0378"]

# (file, old text, new text with {c}, needle on the value's line): strings that reach a source, a file
# name or a message
STRING_SITES = [
    ("targets.toml", 'description = "AMD gfx1250"', 'description = "x{c}#error injected"', "#error injected"),
    ("kernels.toml", 'description = "MXFP4 rows + e8m0 scales -> bf16/fp32"',
     'description = "x{c}static int injected = 1;"', "injected"),
    ("topologies.toml", 'description = "all ranks', 'description = "x{c}y all ranks', "x{c}y"),
    ("rules.toml", 'message = "combine dtypes are bf16 or fp32"', 'message = "a{c}b"', "a{c}b"),
    ("targets.toml", 'fp8_encode = ["F2FP.SATFINITE.E4M3"]', 'fp8_encode = ["F2FP{c}.E4M3"]', "F2FP{c}"),
    ("targets.toml", 'install_hint = "the CUDA', 'install_hint = "x{c}the CUDA', "x{c}the"),
    ("profiles.toml", '"route_*",', '"route_*", "r{c}",', "r{c}"),
]


def _escaped(c):
    return f"\\u{ord(c):04X}" if ord(c) < 0x10000 else f"\\U{ord(c):08X}"


@pytest.mark.parametrize("c", LINE_BREAKS + NON_PRINTABLE, ids=lambda c: f"U+{ord(c):04X}")
@pytest.mark.parametrize("file,old,new,needle", STRING_SITES, ids=[f"{s[0]}-{i}" for i, s in enumerate(STRING_SITES)])
def test_line_breaks_and_non_printables_are_rejected(spec_copy, c, file, old, new, needle):
    mutate(spec_copy / file, old, new.format(c=_escaped(c)))
    msg = _located(spec_copy, file, needle.format(c=_escaped(c)))
    assert f"U+{ord(c):04X}" in msg and "printable text on one line" in msg


@pytest.mark.parametrize("c", ["\u2028", "\u2029", "\u0085"])
def test_a_raw_unicode_line_break_is_located_on_its_toml_line(spec_copy, c):
    """TOML lines end at \\n only: a raw U+2028 inside a string does not shift the lines after it."""
    mutate(spec_copy / "targets.toml", 'description = "AMD gfx1250"', f'description = "AMD{c}gfx1250"')
    _located(spec_copy, "targets.toml", f"AMD{c}gfx1250")
    mutate(spec_copy / "targets.toml", f'description = "AMD{c}gfx1250"', f'description = "AMD gfx1250"  # {c}')
    mutate(spec_copy / "targets.toml", 'wave_size = 32\nfp8_e4m3 = "ocp"\nfp8_max = 448.0\nfp4_conversion = "pack8"',
           'wave_size = 33\nfp8_e4m3 = "ocp"\nfp8_max = 448.0\nfp4_conversion = "pack8"')
    _located(spec_copy, "targets.toml", "wave_size = 33")


def test_the_injection_of_the_issue_builds_nothing(spec_copy, capsys):
    mutate(spec_copy / "targets.toml", 'description = "AMD gfx1250"',
           'description = "x\\u2029#error injected\\u2028static int injected = 1;"')
    line = 1 + (spec_copy / "targets.toml").read_text().split("\n").index(
        'description = "x\\u2029#error injected\\u2028static int injected = 1;"')
    rc, err = _cli(spec_copy, "build", "--arch", "gfx1250", "--no-compile", capsys=capsys)
    assert rc == 2 and len(err) == 1 and f"targets.toml:{line}:" in err[0] and "U+2029" in err[0]
    assert _files_under(spec_copy.parent / "generated") == []


@pytest.mark.parametrize("end", ["\\\\", "??/"])
def test_a_description_cannot_continue_its_comment_line(spec_copy, end):
    mutate(spec_copy / "kernels.toml", 'description = "FP8 e4m3 rows (+ optional per-128 fp32 scales) -> bf16/fp32"',
           f'description = "FP8 rows{end}"')
    assert "backslash" in _located(spec_copy, "kernels.toml", f"FP8 rows{end}")


# ---------------------------------------------------------------------------------------------
# 2. Spec values that become paths
# ---------------------------------------------------------------------------------------------
BAD_COMPONENTS = ["hip/../../../../tmp/x/ext2", "../x", "..", ".", "", ".hip", "-hip", "a/b", "a\\\\b",
                  "hi\\u0000p", "hip.x", "h ip", "/tmp"]


@pytest.mark.parametrize("value", BAD_COMPONENTS)
@pytest.mark.parametrize("key,old", [("extension", '"hip"'), ("artifact", '"hsaco"'), ("library", '"amd"')])
def test_path_parts_are_single_plain_components(spec_copy, key, old, value):
    mutate(spec_copy / "targets.toml", f"{key} = {old}", f'{key} = "{value}"')
    msg = _located(spec_copy, "targets.toml", f'{key} = "{value}"')
    assert key in msg


@pytest.mark.parametrize("value", ["variant.j2", "../templates/kernels/quantize.j2", "/etc/passwd",
                                   "kernels/../variant.j2", "targets/amd.j2", "kernels/quantize.j2\\n",
                                   "kernels/.quantize.j2", "kernels/nosuch.j2"])
def test_family_templates_are_kernel_bodies_that_exist(spec_copy, value):
    mutate(spec_copy / "kernels.toml", 'template = "kernels/dequantize.j2"', f'template = "{value}"')
    assert "template" in _located(spec_copy, "kernels.toml", f'template = "{value}"')


def test_an_extension_outside_generated_writes_nothing(spec_copy, tmp_path, capsys):
    outside = tmp_path / "outside"
    mutate(spec_copy / "targets.toml", 'extension = "hip"', f'extension = "hip/../../../../{outside}/ext2"')
    rc, err = _cli(spec_copy, "build", "--arch", "gfx950", "--no-compile", capsys=capsys)
    assert rc == 2 and len(err) == 1 and "extension" in err[0]
    assert _files_under(outside) == [] and _files_under(spec_copy.parent / "generated") == []


def test_the_writer_refuses_a_path_resolving_outside_its_root(spec_copy, tmp_path, capsys):
    """Second line of defence: generated/<arch> (beside the specs in use) is a link to elsewhere."""
    root, elsewhere = spec_copy.parent / "generated", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (root / "gfx950").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="outside"):
        B.write_target(S.load(spec_copy), "gfx950", root)
    assert _files_under(elsewhere) == []
    # and in the CLI: one line, exit status 2
    rc, err = _cli(spec_copy, "build", "--arch", "gfx950", "--no-compile", capsys=capsys)
    assert rc == 2 and len(err) == 1 and "outside" in err[0]
    assert _files_under(elsewhere) == []


# ---------------------------------------------------------------------------------------------
# 3. Names are whole identifiers (a trailing newline does not pass)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("file,header", [
    ("targets.toml", "target.gfx942"), ("targets.toml", "toolchain.nvidia"), ("kernels.toml", "family.quantize_fp8"),
    ("dtypes.toml", "dtype.bf16"), ("quant.toml", "quant.none"), ("topologies.toml", "topology.intranode"),
    ("profiles.toml", "profile.runtime"),
])
@pytest.mark.parametrize("suffix", ["\\n", "\\r\\n", "\\u2028", " ", "-x", ".x", "/x"])
def test_names_must_be_whole_identifiers(spec_copy, capsys, file, header, suffix):
    section, name = header.split(".")
    mutate(spec_copy / file, f"[{header}]", f'[{section}."{name}{suffix}"]')
    msg = _located(spec_copy, file, f'[{section}."{name}{suffix}"]')
    assert "is not a C identifier" in msg and repr(name + suffix.encode().decode("unicode_escape")) in msg
    rc, err = _cli(spec_copy, "build", "--arch", "all", "--profile", "all", "--no-compile", capsys=capsys)
    assert rc == 2 and len(err) == 1
    assert _files_under(spec_copy.parent / "generated") == []


@pytest.mark.parametrize("file,old,new,name", [
    ("targets.toml", "fp8_encode = [\"v_cvt_pk_fp8_f32\"]", '"fp8_encode\\n" = ["v_cvt_pk_fp8_f32"]', "fp8_encode\n"),
    ("targets.toml", "fp8_encode = [\"v_cvt_pk_fp8_f32\"]", '"fp8 encode" = ["v_cvt_pk_fp8_f32"]', "fp8 encode"),
    ("rules.toml", 'name = "combine_dtype"', 'name = "combine_dtype\\n"', "combine_dtype\n"),
    ("rules.toml", 'name = "combine_dtype"', 'name = "combine dtype"', "combine dtype"),
])
def test_group_and_rule_names_must_be_whole_identifiers(spec_copy, file, old, new, name):
    mutate(spec_copy / file, old, new)
    assert repr(name) in _located(spec_copy, file, new)


# ---------------------------------------------------------------------------------------------
# 6. Tracebacks: every one of these is one clear line
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("file,old,new,argv", [
    ("targets.toml", "wave_size = 32", "wave_size = 0", ["list"]),
    ("dtypes.toml", "bits = 16", "bits = 0", ["build", "--arch", "gfx950", "--no-compile"]),
    ("kernels.toml", 'template = "kernels/quantize.j2"', 'template = "variant.j2"', ["build", "--arch", "gfx950", "--no-compile"]),
    ("quant.toml", "block = 128", "block = 0", ["build", "--arch", "gfx950", "--no-compile"]),
])
def test_bad_values_are_one_located_line(spec_copy, capsys, file, old, new, argv):
    mutate(spec_copy / file, old, new)
    rc, err = _cli(spec_copy, *argv, capsys=capsys)
    assert rc == 2 and len(err) == 1, err
    m = LOCATED.fullmatch(err[0].removeprefix("error: "))
    assert m and m["file"].endswith(file) and int(m["line"]) == line_of(spec_copy / file, new), err


def test_a_spec_file_that_is_not_utf8(spec_copy, capsys):
    path = spec_copy / "dtypes.toml"
    data = path.read_bytes().replace(b'torch = "int32"', b'torch = "int\xff32"')
    path.write_bytes(data)
    line = data[:data.index(b"\xff")].count(b"\n") + 1
    rc, err = _cli(spec_copy, "list", capsys=capsys)
    assert rc == 2 and len(err) == 1 and f"dtypes.toml:{line}: not UTF-8" in err[0], err


@pytest.mark.parametrize("argv,words", [
    (["list", "--profile", "nosuch"], "unknown profile 'nosuch'"),
    (["build", "--arch", "gfx950", "--profile", "nosuch"], "unknown profile 'nosuch'"),
    (["build", "--arch", "gfx950", "--jobs", "-1"], "--jobs"),
    (["build", "--arch", "gfx950", "--jobs", "0"], "--jobs"),
])
def test_bad_command_lines_are_one_clear_error(specs, capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err + str(e.value.code)
    assert e.value.code not in (0, None) and words in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# 7. Numbers: every numeric field has a declared range
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("file,old,new", [
    ("targets.toml", "wave_size = 32", "wave_size = -64"),
    ("targets.toml", "wave_size = 32", "wave_size = 48"),
    ("targets.toml", "wave_size = 32", "wave_size = 9223372036854775807"),
    ("targets.toml", "fp8_max = 240.0", "fp8_max = -240.0"),
    ("targets.toml", "fp8_max = 240.0", "fp8_max = 0.0"),
    ("targets.toml", "fp8_max = 240.0", "fp8_max = nan"),
    ("targets.toml", "fp8_max = 240.0", "fp8_max = inf"),
    ("targets.toml", "fp8_max = 240.0", "fp8_max = -inf"),
    ("targets.toml", "fp8_max = 240.0", "fp8_max = 448.0  # gfx942"),  # more than FNUZ's largest value
    ("targets.toml", "min_clang = 20", "min_clang = -1"),
    ("quant.toml", "block = 128", "block = -128"),
    ("quant.toml", "block = 128", "block = 0"),
    ("quant.toml", "block = 128", "block = 96"),
    ("quant.toml", "block = 128", "block = 4"),
    ("quant.toml", "block = 128", "block = 512"),  # more lanes than a 32-wide wave
    ("quant.toml", "block = 32", "block = 64"),  # not the fp4 dtype's scale block
    ("quant.toml", "block = 0\nscale = \"none\"", "block = 16\nscale = \"none\""),
    ("dtypes.toml", "bits = 16", "bits = -16"),
    ("dtypes.toml", "bits = 16", "bits = 0"),
    ("dtypes.toml", "bits = 16", "bits = 8  # bf16"),
    ("dtypes.toml", "bits = 16", "bits = 12"),
    ("dtypes.toml", "scale_block = 32", "scale_block = 0"),
    ("dtypes.toml", "scale_block = 32", "scale_block = 33"),
    ("tuning.toml", "blocks = 0\nthreads = 64", "blocks = -1\nthreads = 64"),
    ("tuning.toml", "blocks = 0\nthreads = 64", "blocks = 2147483648\nthreads = 64"),
    ("tuning.toml", "max_tokens = 128", "max_tokens = 9223372036854775807"),
    ("tuning.toml", "threads = 64", "threads = -64"),
])
def test_absurd_numbers_are_rejected_at_their_line(spec_copy, file, old, new):
    mutate(spec_copy / file, old, new)
    _located(spec_copy, file, new.split("\n")[0])


def test_every_numeric_field_has_a_declared_domain():
    for cls in (S.Toolchain, S.Target, S.DType, S.Quant, S.Topology, S.Family, S.Rule, S.Profile, S.Bucket):
        attrs.resolve_types(cls)
        for f in attrs.fields(cls):
            if f.type in (int, float):
                assert (cls, f.name) in schema._RANGES or (cls, f.name) in schema._CHOICES, (cls.__name__, f.name)


def test_fp8_max_is_rendered_exactly(spec_copy):
    mutate(spec_copy / "targets.toml", "fp8_max = 240.0", "fp8_max = 239.75")
    v = next(v for v in enumerate_variants(S.load(spec_copy), ["gfx942"], "all")[0] if v.wire.kind == "fp8")
    assert "EPG_FP8_MAX = 239.75f;" in render.render(v)


# ---------------------------------------------------------------------------------------------
# 8. Every error names the file and line of the value at fault
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("file,old,new,needle", [
    ("kernels.toml", "[family.quantize_fp8]", '[family."quantize_fp8"]\nbogus = 1', "bogus = 1"),
    ("kernels.toml", "[family.quantize_fp8]", "[ family . 'quantize_fp8' ]\nbogus = 1", "bogus = 1"),
    ("targets.toml", '[target.sm_90]\nvendor = "nvidia"', '[target."sm_90"]\nvendor = "nvidia-x"', "nvidia-x"),
    ("targets.toml", "[target.sm_90.isa]\nfp8_encode", '[target."sm_90".isa]\nbogus_group = 1\nfp8_encode',
     "bogus_group"),
    ("tuning.toml", "[[tuning.gfx942.dispatch]]\nmax_tokens = 0\nblocks = 0\nthreads = 512",
     '[[tuning."gfx942".dispatch]]\nmax_tokens = 0\nblocks = 0\nthreads = 500', "threads = 500"),
    ("kernels.toml", 'template = "kernels/route_count.j2"', 'template = "kernels/route_counts.j2"', "route_counts"),
    ("targets.toml", 'library = "nvidia"', 'library = "nvidai"', "nvidai"),
    ("targets.toml", 'library = "amd"', 'library = "nvidia"  # on gfx942', "# on gfx942"),
    ("targets.toml", "wave_size = 32\nfp8_e4m3 = \"ocp\"\nfp8_max = 448.0\nfp4_conversion = \"software\"",
     "wave_size = 9223372036854775807\nfp8_e4m3 = \"ocp\"\nfp8_max = 448.0\nfp4_conversion = \"software\"",
     "wave_size = 9223372036854775807"),
    ("targets.toml", 'system_sync = ["MEMBAR.SC.SYS"', 'system_sync = ["MEMBAR\\u2028.SC.SYS"', "MEMBAR\\u2028"),
    ("rules.toml", '"target.fp8_e4m3" = "ocp" }', '"target.fp8_e4m3" = "ocp" }\nunless = { "wire.kindd" = "x" }',
     "wire.kindd"),
])
def test_errors_name_the_line_of_the_value(spec_copy, file, old, new, needle):
    mutate(spec_copy / file, old, new)
    _located(spec_copy, file, needle)


# ---------------------------------------------------------------------------------------------
# 9. A spec names no program to run
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,old,value", [
    ("compilers", '["nvcc"]', '["python3"]'),
    ("compilers", '["nvcc"]', '["/usr/bin/nvcc"]'),
    ("compilers", '["nvcc"]', '["./nvcc"]'),
    ("compilers", '["nvcc"]', '["nvcc2"]'),
    ("compilers", '["nvcc"]', '["clang++-22"]'),  # an AMD compiler for an NVIDIA target
    ("disassemblers", '["cuobjdump"]', '["sh"]'),
    ("compilers", '["hipcc", "amdclang++"', '["hipcc", "bash"'),
])
def test_compilers_are_known_toolchain_programs(spec_copy, capsys, tmp_path, key, old, value):
    marker = tmp_path / "ran"
    mutate(spec_copy / "targets.toml", f"{key} = {old}", f"{key} = {value}")
    # flags that are options (they pass), making python3 run code that would leave the marker
    mutate(spec_copy / "targets.toml", 'flags = ["-O3", "-std=c++17", "-gencode',
           f'flags = ["-c", "-0or(open(\'{marker}\',\'w\'))", "-O3", "-std=c++17", "-gencode')
    with pytest.raises(S.SpecError, match=r"targets\.toml:\d+: "):
        S.load(spec_copy)
    toolchain.find.cache_clear()
    try:
        rc, err = _cli(spec_copy, "build", "--arch", "all", "--profile", "all", "--only", "quantize_fp8.bf16.*",
                       "--cache-dir", str(tmp_path / "cache"), capsys=capsys)
    finally:
        toolchain.find.cache_clear()
    assert rc == 2 and len(err) == 1 and not marker.exists()


def test_flags_are_options(spec_copy):
    mutate(spec_copy / "targets.toml", 'flags = ["-O3", "-std=c++17"]', 'flags = ["-O3", "/etc/passwd"]')
    assert "flags" in _located(spec_copy, "targets.toml", '"/etc/passwd"')


def test_a_toolchain_built_by_hand_runs_no_unknown_program(tmp_path):
    marker = tmp_path / "ran"
    tc = S.Toolchain(name="x", compilers=("python3",), min_clang=0, extension="cu", artifact="cubin",
                     disassemblers=("cuobjdump",), install_hint="-")
    toolchain.find.cache_clear()
    try:
        with pytest.raises(toolchain.ToolchainMissing, match="python3"):
            toolchain.find(tc)
    finally:
        toolchain.find.cache_clear()
    assert not marker.exists()
