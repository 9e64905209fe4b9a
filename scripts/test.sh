#!/usr/bin/env bash
# Set up and run the CPU test suite (the README's test command; CI runs it).
#   TORCH=VERSION: the torch to test with (default 2.13.0, CI's; pyproject's extras admit 2.11 to 2.14, README
#   "Install" says which ones ran)
#   TORCH_INDEX_URL=URL: where torch comes from (default https://download.pytorch.org/whl/cpu, torch's CPU build, the
#   index README "Install" names; empty: pip's own configured index, e.g. a mirror that serves the CPU build)
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${TORCH:-2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
# torch first, pinned, so resolving the extras below keeps it (and never fetches a CUDA build on its own); only torch
# itself comes from that index (--no-deps: its dependencies come with the extras, from pip's configured indexes, which
# also serve torch where that index cannot be reached, after pip's retries)
python3 -m pip install -q --no-deps "torch==$TORCH" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
python3 -m pip install -q -e ".[test]" nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
# the torchtitan check (tests/runtime/test_torchtitan_dispatcher.py: runtime.integrations.torchtitan against torchtitan's
# own MoE): torchtitan 0.3.0 without its training dependencies (datasets, wandb, ...: pyproject's [torchtitan] extra
# takes them), then what its MoE modules import (TORCHTITAN_CHECK_DEPS); with EPGEN_REQUIRE_TORCHTITAN set, a torchtitan
# that does not import fails the check instead of skipping it
TORCHTITAN_CHECK_DEPS="spmd_types==0.2.3 tyro triton"
python3 -m pip install -q --no-deps "torchtitan==0.3.0"
python3 -m pip install -q $TORCHTITAN_CHECK_DEPS
export EPGEN_REQUIRE_TORCHTITAN=1
python3 -m generator check
# the variant matrix (variant x target: rendered / compiled / verified)
python3 -m generator build --arch all --profile all
python3 -m pytest -q "$@"
