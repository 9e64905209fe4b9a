"""The spec loader: valid specs load; every malformed spec gives one located error."""

import re

import pytest

from generator import specs as S
from generator.cli import main
from tests.support.spec_edit import line_of as _line_of
from tests.support.spec_edit import mutate as _mutate


def test_specs_load(specs):
    assert set(specs.targets) == {"gfx942", "gfx950", "gfx1250", "sm_90"}
    assert specs.targets["gfx1250"].wave_size == 32 and specs.targets["gfx942"].wave_size == 64
    assert specs.targets["gfx942"].fp8_e4m3 == "fnuz" and specs.targets["gfx942"].fp8_max == 240.0
    assert specs.dtypes["fp4_e2m1"].scale_block == 32
    assert specs.quants["fp8_blockwise"].block == 128 and specs.quants["fp4_blockwise"].scale == "e8m0"
    assert {"default", "all"} <= set(specs.profiles)


@pytest.mark.parametrize("file,old,new,needle,message", [
    ("targets.toml", "wave_size = 64\n", "wave_size = 64\nwave_sise = 64\n", "wave_sise", "unknown key 'wave_sise'"),
    ("targets.toml", "wave_size = 32\n", 'wave_size = "32"\n', 'wave_size = "32"', "expected an integer"),
    ("targets.toml", 'fp8_e4m3 = "fnuz"', 'fp8_e4m3 = "fnux"', "fnux", "must be one of"),
    ("targets.toml", 'toolchain = "nvidia"\n', 'toolchain = "cuda"\n', 'toolchain = "cuda"', "is not declared"),
    ("dtypes.toml", "bits = 16\n", "bits = 16\nbits = 17\n", "bits = 17", "invalid TOML"),
    ("kernels.toml", 'dtypes = ["bf16", "fp32"]', 'dtypes = ["bf16", "fp64"]', "fp64", "unknown dtype 'fp64'"),
    ("kernels.toml", 'isa = ["vector_copy"]', 'isa = ["vector_cpy"]', "vector_cpy", "vector_cpy"),
    ("rules.toml", '"target.fp4_conversion" = "none"', '"target.fp4_conv" = "none"', '"target.fp4_conv" = "none"', "unknown fact"),
    ("rules.toml", 'name = "fp8_native_fnuz"', 'name = "fp8_native_ocp"', 'name = "fp8_native_ocp"', "duplicate rule name"),
    ("quant.toml", "block = 128\n", "block = 128.5\n", "block = 128.5", "expected an integer"),
    ("profiles.toml", 'dtypes = ["bf16"]', 'dtypes = "bf16"', 'dtypes = "bf16"', "expected a list of strings"),
])
def test_malformed_spec_is_located(spec_copy, file, old, new, needle, message):
    path = spec_copy / file
    _mutate(path, old, new)
    with pytest.raises(S.SpecError) as e:
        S.load(spec_copy)
    text = str(e.value)
    m = re.match(r"^(.+):(\d+): (.+)$", text)
    assert m, text
    assert m.group(1).endswith(file)
    assert message in m.group(3)
    # occurrence-sensitive: the duplicate/unknown is reported where it stands
    assert int(m.group(2)) == _line_of(path, needle), text


def test_missing_spec_file(spec_copy):
    (spec_copy / "quant.toml").unlink()
    with pytest.raises(S.SpecError, match=r"quant\.toml:1: spec file missing"):
        S.load(spec_copy)


def test_cli_reports_one_line_not_a_traceback(spec_copy, capsys):
    _mutate(spec_copy / "targets.toml", "wave_size = 64\n", "wave_size = 64\nbogus = 1\n")
    assert main(["--specs", str(spec_copy), "list"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "targets.toml:" in err[0] and "unknown key 'bogus'" in err[0]
    assert "Traceback" not in "".join(err)


def test_template_outside_templates_rejected(spec_copy):
    _mutate(spec_copy / "kernels.toml", 'template = "kernels/quantize.j2"', 'template = "../../etc/passwd"')
    with pytest.raises(S.SpecError, match=r"must be kernels/<name>\.j2 under templates/"):
        S.load(spec_copy)
