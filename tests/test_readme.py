"""The README's usage example runs as written: its one python block is executed on gloo ranks (torch backend,
CPU), where it checks its own result (combine of the weighted identity experts gives x back)."""

from __future__ import annotations

import re

import pytest

from ep_dist import get_world
from moe_layer_ref import ROOT

README = ROOT / "README.md"


def usage_block() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)
    assert len(blocks) == 1, f"README.md should have one python block (the usage example), found {len(blocks)}"
    return blocks[0]


def scn_readme_usage(rank, world):
    namespace: dict = {"__name__": "readme_usage"}
    exec(compile(usage_block(), "README.md (usage)", "exec"), namespace)
    return tuple(namespace["combined"].shape), int(namespace["total_recv"].reshape(-1)[0])


def test_usage_block_uses_the_public_api():
    code = usage_block()
    assert "from runtime import EpDispatchCombineConfig, EpDispatchCombineOp" in code
    assert all(call in code for call in ("op.dispatch(", "op.combine("))


@pytest.mark.parametrize("world", [1, 2])
def test_usage_block_runs(world):
    results = get_world(world).run(scn_readme_usage, timeout=120)
    for shape, total_recv in results:
        assert shape == (128, 7168)
        assert 128 <= total_recv <= 128 * world  # every token reaches at least one rank, at most each once
