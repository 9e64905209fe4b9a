#!/usr/bin/env bash
# Set up and run the CPU test suite (the README's test command; CI runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
# torch: the CPU build where this machine's package index offers it
python3 -m pip install -q torch==2.13.0 || python3 -m pip install -q torch
python3 -m pip install -q -e ".[test]" nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
python3 -m generator check
# the variant matrix (variant x target: rendered / compiled / verified)
python3 -m generator build --arch all --profile all
python3 -m pytest -q "$@"
