#!/usr/bin/env bash
# One call on the lent GPU machine: build the device's variants, run the GPU tests, benchmark, print a table.
#   (via the device tool)  bash scripts/device_run.sh
# Environment: EPGEN_COMMIT (the commit the copied tree holds: its git metadata may be stale), EP_TESTS (test files), NO_TESTS=1 (skip tests), TUNE=1 + TUNE_ARGS (run the tuner, rewrite
# specs/tuning.toml, copy it to $OUT), NO_BENCH=1, BENCH_ARGS (extra runtime.bench arguments),
# NPROC (ranks, default: every GPU), BENCH_INTERNODE=1 (internode v2 / v2_ll vs intranode, 2 emulated nodes), HOST_PROFILE=1 (host time of
# eager calls, scripts/host_profile.py, with the default and the sync expert-id check), SWEEP=1 (the full sweep:
# tokens 1..8192 x hidden 7168/4096 x bf16/fp8 with the torch backend, $OUT/sweep.jsonl; scripts/sweep_table.py prints
# the README table), LL=1 (the low-latency protocol: tests/gpu/test_ep_ll.py and, for the bandwidth protocol's kernels it
# touched, tests/gpu/test_ep_native.py; then bench of --protocol ll bw at tokens 1 8 32 128, bf16,
# $OUT/bench_ll.jsonl; alone: LL=1 NO_TESTS=1 NO_BENCH=1).
set -uo pipefail
cd "$(dirname "$0")/.."
export EPGEN_COMMIT=${EPGEN_COMMIT:-} PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/epgen-out}; mkdir -p "$OUT"
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
NPROC=${NPROC:-$ngpu}  # ranks of the multi-GPU runs: every GPU of the machine (the peer-death script uses 2)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -2
declare -A status
python3 -m generator build --arch sm_90 --profile all > "$OUT/build.log" 2>&1; status[build]=$?
tail -3 "$OUT/build.log"
if [ -z "${NO_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_quant_kernels.py 2>&1 | tee "$OUT/quant.log" | tail -15; status[quant]=${PIPESTATUS[0]}
fi
if [ "$ngpu" -ge 2 ] && [ -z "${NO_TESTS:-}" ]; then
  timeout 400 torchrun --nproc-per-node "$NPROC" -m pytest -q -p no:cacheprovider -m multigpu ${EP_TESTS:-tests/gpu/test_ep_native.py tests/gpu/test_ep_lowprec.py tests/gpu/test_ep_faults.py tests/gpu/test_ep_moe.py tests/gpu/test_ep_internode.py tests/gpu/test_bench_gate.py} 2>&1 | tee "$OUT/ep.log" | grep -vE "^\s*$" | tail -25; status[ep]=${PIPESTATUS[0]}
  timeout 60 torchrun --nproc-per-node 2 tests/gpu/fault_peer_death.py 2>&1 | tee "$OUT/death.log" | grep -E "survivor"; status[death]=${PIPESTATUS[0]}
fi
if [ "$ngpu" -ge 2 ]; then
  if [ -n "${TUNE:-}" ]; then  # measure launch geometries, rewrite specs/tuning.toml (copied to $OUT)
    timeout 300 torchrun --nproc-per-node "$NPROC" -m runtime.tune --write ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log" | grep -vE "^(W|\*)" | tail -30; status[tune]=${PIPESTATUS[0]}
    cp specs/tuning.toml "$OUT/tuning.toml"
  fi
  if [ -n "${BENCH_INTERNODE:-}" ]; then  # internode (2 emulated nodes) vs intranode on the same GPUs
    timeout 200 torchrun --nproc-per-node "$NPROC" -m runtime.bench --tokens 128 4096 --dtypes bfloat16 --internode v2 v2_ll \
      --emulate-nodes --out "$OUT/bench_internode.jsonl" 2>&1 | tee "$OUT/bench_internode.log" | grep -vE "^(W|\*)" | tail -8
    status[internode_bench]=${PIPESTATUS[0]}
  fi
  if [ -n "${HOST_PROFILE:-}" ]; then
    for mode in async sync; do
      EPGEN_CHECK_EXPERT_IDS=$mode timeout 60 torchrun --nproc-per-node "$NPROC" scripts/host_profile.py --iters 300 2>&1 \
        | grep -vE "^(W|\*)" > "$OUT/host_$mode.log"; status[host_$mode]=${PIPESTATUS[0]}; head -1 "$OUT/host_$mode.log"
    done
    timeout 90 torchrun --nproc-per-node "$NPROC" scripts/host_profile.py --iters 100 --internode v2_ll 2>&1 \
      | grep -vE "^(W|\*)" > "$OUT/host_internode.log"; status[host_internode]=${PIPESTATUS[0]}; head -1 "$OUT/host_internode.log"
  fi
  if [ -n "${LL:-}" ]; then  # the low-latency intranode protocol: its GPU tests, then both protocols side by side
    timeout 270 torchrun --nproc-per-node "$NPROC" -m pytest -q -p no:cacheprovider -m multigpu tests/gpu/test_ep_ll.py \
      tests/gpu/test_ep_native.py 2>&1 \
      | tee "$OUT/ll_tests.log" | grep -vE "^\s*$" | tail -15; status[ll_tests]=${PIPESTATUS[0]}
    timeout 200 torchrun --nproc-per-node "$NPROC" -m runtime.bench --tokens 1 8 32 128 --dtypes bfloat16 \
      --protocol ll bw --eager-iters 20 --out "$OUT/bench_ll.jsonl" 2>&1 | tee "$OUT/bench_ll.log" | grep -vE "^(W|\*)" | tail -12
    status[ll_bench]=${PIPESTATUS[0]}
  fi
  if [ -n "${SWEEP:-}" ]; then
    timeout 540 torchrun --nproc-per-node "$NPROC" -m runtime.bench --tokens 1 8 32 128 512 2048 4096 8192 \
      --hidden 7168 4096 --dtypes bfloat16 float8_e4m3fn --torch-baseline --out "$OUT/sweep.jsonl" 2>&1 \
      | tee "$OUT/sweep.log" | grep -vE "^(W|\*)" | tail -34; status[sweep]=${PIPESTATUS[0]}
  fi
  [ -n "${NO_BENCH:-}" ] || timeout 200 torchrun --nproc-per-node "$NPROC" -m runtime.bench --lowprec ${BENCH_ARGS:-} --out "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench.log" | tail -12; status[bench]=${PIPESTATUS[0]}
fi
echo "== summary"
for k in build quant ep death tune internode_bench host_async host_sync host_internode ll_tests ll_bench sweep bench; do printf '%-6s %s\n' "$k" "${status[$k]:-not run}"; done
