"""Native variant selection on CPU: hits, and misses that name the key, the reason and the way out."""

import pytest

from runtime import kernels
from runtime.errors import VariantMissError


def test_select_hit():
    v = kernels.select("sm_90", "dispatch.bf16.intranode")
    assert v.key == "sm_90/dispatch.bf16.intranode" and v.symbol == "epg_dispatch__bf16__intranode"


def test_miss_unknown_target():
    with pytest.raises(VariantMissError, match=r"sm_80/dispatch\.bf16\.intranode.*'sm_80' is not declared.*gfx942"):
        kernels.select("sm_80", "dispatch.bf16.intranode")


def test_miss_names_the_rule():
    with pytest.raises(VariantMissError, match=r"fp4_conversion_target.*gfx942 lacks"):
        kernels.select("gfx942", "quantize_fp4.bf16.fp4_e2m1.fp4_blockwise")


def test_miss_lists_nearest():
    with pytest.raises(VariantMissError, match=r"nearest available: .*sm_90/dispatch\.bf16\.intranode"):
        kernels.select("sm_90", "dispatch.fp16.intranode")


def test_code_object_is_built_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("EPGEN_CACHE_DIR", str(tmp_path))
    v = kernels.select("gfx950", "combine_gather.bf16.intranode")
    image = kernels.code_object(v)
    assert image[:4] == b"\x7fELF"
    assert kernels.code_object(v) == image
    assert list(tmp_path.glob("gfx950/combine_gather.bf16.intranode-*.hsaco"))
