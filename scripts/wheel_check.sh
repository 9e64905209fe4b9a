#!/usr/bin/env bash
# The distribution as a new user gets it: build the wheel, install it with its declared extras only into a
# fresh venv (no system site-packages), then, from a directory outside the checkout, list and build
# variants and run a 2-rank gloo dispatch -> identity -> combine round trip (scripts/wheel_roundtrip.py).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/epgen-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
t0=$SECONDS
step() { echo "== wheel: $1 ($((SECONDS - t0)) s)"; }

step "build"
python3 -m pip wheel -q --no-deps --no-build-isolation . -w "$work/dist"
rm -rf build
whl=$(ls "$work"/dist/epgen-*.whl)
python3 -c 'import sys, zipfile; names = set(zipfile.ZipFile(sys.argv[1]).namelist()); missing = {
    "generator/data/specs/targets.toml", "generator/data/templates/variant.j2", "runtime/backends/native.py",
    "bench/cli.py"} - names; sys.exit(
    f"wheel lacks {sorted(missing)}" if missing else 0)' "$whl"

step "fresh venv"
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -c 'import sys; assert sys.prefix != sys.base_prefix'
# torch: the CPU build where this machine's package index offers it (pinned first, so resolving the
# extra does not fetch a CUDA build)
"$py" -m pip install -q torch==2.13.0 || "$py" -m pip install -q torch
"$py" -m pip install -q "$whl[runtime]"

step "generator from outside the checkout"
mkdir -p "$work/cwd" && cd "$work/cwd"
export EPGEN_CACHE_DIR="$work/cache"
unset EPGEN_SPECS_DIR EPGEN_GENERATED_DIR
"$py" -m generator list --arch gfx950 | tail -1
"$py" -m generator build --arch gfx950 --only 'quantize*' | tail -3
test -f "$EPGEN_CACHE_DIR"/generated/*/gfx950/manifest.json
test ! -e "$work/cwd/generated"

step "2-rank gloo round trip"
cp "$repo/scripts/wheel_roundtrip.py" "$work/cwd/"
"$py" wheel_roundtrip.py
step "done"
