"""A small generated variant to build (gfx950's fp8 quantize kernel) and its rendered source, as fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from generator import render
from generator.model import enumerate_variants

SMALL = "quantize_fp8.bf16.fp8_e4m3fn.fp8_direct_cast"


@pytest.fixture
def variant(specs):
    (v,), _ = enumerate_variants(specs, ["gfx950"], "all", SMALL)
    return v


@pytest.fixture
def source(variant, tmp_path) -> Path:
    src = tmp_path / "src" / variant.file
    src.parent.mkdir()
    src.write_text(render.render(variant))
    return src
