"""runtime.integrations.torchtitan on the GPU (issue 36, item 4): torchtitan 0.3.0's own MoE module, bf16, built once
with its AllToAllTokenDispatcher and once with EpgenTokenDispatcher on the native backend, the same weights and tokens
(tests/support/titan_check.py): outputs and the gradients of the tokens, the router and the local experts agree within
bf16 rounding (against torchtitan's MoE in float32, epgen is no further off than torchtitan's own bf16 path:
titan_check.low_precision_misses), also
with a rank that receives no token and an expert without pairs, two layers sharing one op, groups padded to 16 rows,
and activation checkpointing (torch's and torchtitan's SelectiveAC, which recompute epgen's dispatch in the backward:
the bandwidth dispatch receives in arrival order, so the recomputation's rows may be laid out differently from the
first forward's; and EpgenSelectiveAC saving epgen's ops), and each layer under torch.compile(fullgraph=True), as
torchtitan compiles its blocks (alone and checkpointed). A failure names each tensor's relative errors, epgen's
and the all-to-all dispatcher's, against float32 (titan_check.low_precision_misses).

Run (2 ranks sharing one H200: the group is gloo, epgen's workspace the runtime's IPC one):
    torchrun --nproc-per-node 2 -m pytest -m multigpu -q -rs tests/gpu/test_torchtitan_gpu.py

Needs torchtitan importable (pip install --no-deps torchtitan==0.3.0 && pip install spmd_types==0.2.3 tyro; a CUDA
torch brings triton): without it the module skips and says why. On torch 2.11 the integration's
install_torch_shims() supplies the torch.compiler._is_non_strict_tracing torchtitan 0.3.0 calls.
"""

import os

import pytest
import torch

from tests.gpu.dist_util import run_collective
from tests.support import titan_check

pytestmark = pytest.mark.multigpu

if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
    pytest.skip("needs torchrun and GPUs", allow_module_level=True)
_missing = titan_check.torchtitan_missing()
if _missing:
    pytest.skip(f"torchtitan is not importable on this machine, so the check cannot run: {_missing}",
                allow_module_level=True)

SHAPE = dict(dim=1024, inter=256, experts_per_rank=8, top_k=4, batch=2, seq=64)
CASES = {"balanced": {}, "starved": dict(starve_rank=True, starve_expert=True),
         "two-layers": dict(layers=2), "padded-16": dict(layers=2, pad_multiple=16),
         "two-layers-checkpointed": dict(layers=2, ac="full"),
         "two-layers-torchtitan-selective-ac": dict(layers=2, ac="selective"),
         "two-layers-epgen-selective-ac": dict(layers=2, ac="selective_epgen"),
         "two-layers-compiled": dict(layers=2, compile=True),
         "two-layers-compiled-checkpointed": dict(layers=2, ac="full", compile=True)}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_bf16_native_matches_all_to_all_dispatcher(case):
    def check():
        errs = titan_check.compare(**SHAPE, dtype=torch.bfloat16, device="cuda", seed=3, **CASES[case])
        print(f"rank {torch.distributed.get_rank()}: {errs}")
        assert errs["backend"] == "native", errs
        bad = titan_check.low_precision_misses(errs, CASES[case].get("layers", 1))
        assert not bad, f"epgen vs torchtitan's all-to-all dispatcher in bf16: {bad} ({errs})"
    run_collective(check)
