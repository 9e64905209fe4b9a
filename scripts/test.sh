#!/usr/bin/env bash
# Set up and run the CPU test suite (the README's test command; CI runs it).
#   TORCH=VERSION: the torch to test with (default 2.13.0, CI's: the CPU build on this machine's package index;
#   pyproject's extras admit 2.6 to 2.14, README "Install" says which ones ran)
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${TORCH:-2.13.0}
# torch first, pinned, so resolving the extras below keeps it (and never fetches a CUDA build on its own)
python3 -m pip install -q "torch==$TORCH"
python3 -m pip install -q -e ".[test]" nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
python3 -m generator check
# the variant matrix (variant x target: rendered / compiled / verified)
python3 -m generator build --arch all --profile all
python3 -m pytest -q "$@"
