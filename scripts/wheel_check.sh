#!/usr/bin/env bash
# The distribution as a new user gets it: build the wheel, install it with its declared extras only into a
# fresh venv (no system site-packages), then, from a directory outside the checkout, list and build
# variants (python -m generator and the epgen command), check what the GPU tools and a shadowed package say, and
# run a 2-rank gloo dispatch -> identity -> combine round trip (scripts/wheel_roundtrip.py).
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
    "generator/data/specs/targets.toml", "generator/data/templates/variant.j2", "runtime/backends/native.py", "runtime/seed_compat/tuning_configs.py",
    "bench/cli.py"} - names; sys.exit(
    f"wheel lacks {sorted(missing)}" if missing else 0)' "$whl"

step "fresh venv"
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -c 'import sys; assert sys.prefix != sys.base_prefix'
# torch: the one scripts/test.sh tests, as it installs it (TORCH, default 2.13.0; TORCH_INDEX_URL, default torch's
# CPU-build index as README "Install" says; --no-deps: the extra brings its dependencies), pinned first so resolving
# the extra does not fetch a CUDA build
index=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
"$py" -m pip install -q --no-deps "torch==${TORCH:-2.13.0}" ${index:+--index-url "$index"}
"$py" -m pip install -q "$whl[runtime]"

step "generator from outside the checkout (python -m generator and the epgen command)"
mkdir -p "$work/cwd" && cd "$work/cwd"
export EPGEN_CACHE_DIR="$work/cache" XDG_CONFIG_HOME="$work/config"
unset EPGEN_SPECS_DIR EPGEN_GENERATED_DIR EPGEN_TUNING_FILE
"$py" -m generator list --arch gfx950 | tail -1
"$work/venv/bin/epgen" build --arch gfx950 --only 'quantize*' | tail -3
test -f "$EPGEN_CACHE_DIR"/generated/*/gfx950/manifest.json
test ! -e "$work/cwd/generated"
"$work/venv/bin/epgen" check | tee "$work/check.txt"
grep -q "fresh for gfx950" "$work/check.txt" && grep -q "not built: gfx942" "$work/check.txt"
"$work/venv/bin/epgen" doctor | tee "$work/doctor.txt"
grep -q "(installed copy)" "$work/doctor.txt"
# without GPUs the GPU tools say so in one line (exit 1, no traceback)
if "$work/venv/bin/epgen" bench > "$work/bench.txt" 2>&1; then echo "epgen bench ran without GPUs?"; exit 1; fi
test "$(wc -l < "$work/bench.txt")" -eq 1 && grep -q "needs GPUs" "$work/bench.txt"
# a folder named like one of epgen's packages, where Python starts: epgen names it
mkdir -p "$work/shadow/runtime" && touch "$work/shadow/runtime/__init__.py"
if (cd "$work/shadow" && "$py" -m epgen bench > "$work/shadow.txt" 2>&1); then echo "shadowed runtime not detected"; exit 1; fi
grep -q "is not epgen's" "$work/shadow.txt"

if command -v nvcc > /dev/null; then
  step "the nvidia extra brings the sm_90 disassemblers"
  "$py" -m pip install -q "$whl[nvidia]"
  "$work/venv/bin/epgen" build --arch sm_90 --only 'quantize_fp8*' | tail -1 | tee "$work/sm90.txt"
  grep -q " 0 failed" "$work/sm90.txt"
else
  echo "== wheel: no nvcc here: the sm_90 build from the wheel is not checked"
fi

step "2-rank gloo round trip"
cp "$repo/scripts/wheel_roundtrip.py" "$work/cwd/"
"$py" wheel_roundtrip.py
step "done"
