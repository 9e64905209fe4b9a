"""hipify-torch as a lint: torch.utils.hipify run over every generated HIP source must find nothing to
translate. The kernel bodies are portable (templates/targets/*.j2 map each primitive per vendor); a
CUDA name that leaks into an AMD variant (a runtime type, a warp intrinsic, a launch) is what hipify
would rewrite, so any rewrite is a failure. The one edit hipify makes to every kernel file, inserting
`#include "hip/hip_runtime.h"` at the top (our sources are compiled freestanding, see
templates/targets/amd.j2), is not a translation and is ignored.

What it can catch is what hipify maps: CUDA runtime and driver API names and types (cudaStream_t,
CUstream, __nv_bfloat16, cuda_runtime.h, ...). The *_sync warp intrinsics (__shfl_xor_sync,
__ballot_sync, __syncwarp) are not in its map (HIP accepts them), so a leak of those passes here.
"""

from __future__ import annotations

import difflib
import shutil
from pathlib import Path

import pytest

hipify_python = pytest.importorskip("torch.utils.hipify.hipify_python")

ROOT = Path(__file__).resolve().parents[2]
HIP_SOURCES = sorted(ROOT.glob("generated/gfx*/*.hip"))
HEADER = '#include "hip/hip_runtime.h"'


def translations(sources: list[Path], work: Path) -> dict[str, list[str]]:
    """{source name: the lines hipify changed or added, as unified-diff lines} for every source it would
    translate (a copy of each goes to `work`; hipify writes its output beside the copy)."""
    names = {}
    for src in sources:
        name = f"{src.parent.name}__{src.name}"
        shutil.copyfile(src, work / name)
        names[str((work / name).resolve())] = name
    results = hipify_python.hipify(project_directory=str(work), output_directory=str(work), extensions=(".hip",),
                                   includes=["*"], show_progress=False, is_pytorch_extension=True)
    changed = {}
    for path, res in results.items():
        if path not in names or not res.hipified_path or res.hipified_path == path:
            continue
        before = Path(path).read_text().splitlines()
        after = [line for line in Path(res.hipified_path).read_text().splitlines() if line != HEADER]
        diff = [d for d in difflib.unified_diff(before, after, lineterm="", n=0)
                if d[:1] in "+-" and not d.startswith(("+++", "---"))]
        if diff:
            changed[names[path]] = diff
    return changed


def test_every_target_has_hip_sources():
    targets = {p.parent.name for p in HIP_SOURCES}
    assert {"gfx942", "gfx950", "gfx1250"} <= targets


def test_generated_hip_sources_have_nothing_to_translate(tmp_path):
    changed = translations(HIP_SOURCES, tmp_path)
    report = "\n".join(f"{name}:\n  " + "\n  ".join(diff[:6]) for name, diff in sorted(changed.items())[:10])
    assert not changed, f"hipify would translate CUDA names in {len(changed)} generated HIP source(s):\n{report}"


@pytest.mark.parametrize("leak, hip_name", [
    ("cudaStream_t stream = 0;", "hipStream_t"),
    ("typedef __nv_bfloat16 bf16_leak;", "__hip_bfloat16"),
    ("CUstream leaked_stream;", "hipStream_t"),
    ("cudaDeviceSynchronize();", "hipDeviceSynchronize"),
    ("#include <cuda_runtime.h>", "hip/hip_runtime.h"),
])
def test_lint_catches_an_injected_cuda_name(tmp_path, leak, hip_name):
    """The check can fail: a CUDA name put into a real generated kernel body is reported."""
    src = next(p for p in HIP_SOURCES if p.parent.name == "gfx950" and p.name.startswith("dispatch."))
    lines = src.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "__global__" in line or "extern \"C\"" in line)
    bad = tmp_path / "in" / "gfx950" / src.name
    bad.parent.mkdir(parents=True)
    bad.write_text("\n".join(lines[:at] + [leak] + lines[at:]) + "\n")
    work = tmp_path / "work"
    work.mkdir()
    changed = translations([bad], work)
    assert list(changed) == [f"gfx950__{src.name}"]
    assert any(hip_name in d for d in changed[f"gfx950__{src.name}"] if d.startswith("+")), changed
