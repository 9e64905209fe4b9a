#!/usr/bin/env bash
# One call on the lent GPU machine: build the device's variants, run the GPU tests, benchmark, print a table.
#   (via the device tool)  bash scripts/device_run.sh
# Environment: EPGEN_COMMIT (the commit the copied tree holds: its git metadata may be stale), EP_TESTS (test files), NO_TESTS=1 (skip tests), TUNE=1 + TUNE_ARGS (run the tuner, rewrite
# specs/tuning.toml, copy it to $OUT), NO_BENCH=1, BENCH_ARGS (extra bench arguments),
# EP_PYTEST (pytest options of the EP suite; oversubscribed: -v -o faulthandler_timeout=$FH_TIMEOUT, else -q),
# W1_TESTS (test files also run at one rank on GPU 0, W = 1: the paths a kernel takes with no peer, which the multi-rank
# suites never reach; $OUT/ep_w1.log), NPROC (ranks, default: every GPU x RANKS_PER_GPU),
# RANKS_PER_GPU (default 1; above 1 the ranks share GPUs: gloo
# group, IPC workspace, correctness only: every bench is skipped), ONE_GPU=1 (only GPU 0 visible), WS_AB=1 (bench
# 128/4096 tokens with EPGEN_WORKSPACE=symmetric and ipc in the same run, $OUT/bench_ws.jsonl), BENCH_INTERNODE=1 (internode v2 / v2_ll vs intranode, 2 emulated nodes), HOST_PROFILE=1 (host time of
# eager calls, scripts/host_profile.py, with the default and the sync expert-id check), SWEEP=1 (the full sweep:
# tokens 1..8192 x hidden 7168/4096 x bf16/fp8 with the torch backend, $OUT/sweep.jsonl; scripts/sweep_table.py prints
# the sweep table of docs/BENCH.md), LAYER=1 (docs/LAYER.md: the layer loop, the MoE layer on epgen and the all_to_all_single shuffle
# and the link's ceiling, $OUT/layer.jsonl, epgen with each protocol in LAYER_PROTOCOLS (default: ll bw); then at 16 experts per rank epgen, all_to_all_single and all_to_all_vdev_2d
# (in a process of its own: NVSHMEM), $OUT/layer_vdev2d.jsonl; the tables (scripts/layer_table.py) and the example's GPU test),
# SMS=1 (equal SMs: 4096 tokens at 24/32/128 blocks, combine at 512/768/1024 threads, gather and scatter, $OUT/bench_sms.jsonl,
# and the ceiling at those SM counts, $OUT/ceiling_sms.jsonl), LL=1 (bench of the low-latency and bandwidth protocols, --protocol ll bw at tokens 1 8 32 128, bf16,
# $OUT/bench_ll.jsonl; its GPU tests, tests/gpu/test_ep_ll.py, are in the default EP suite), TUNE_LL=1 (bench.tune
# --ll-threshold --write-specs: the low-latency threshold of this target, specs/tuning.toml copied to $OUT), FLOOR=1 (bench
# --floor: flag ping-pong in one kernel, one-signal and empty kernels in a graph, $OUT/floor.jsonl), PROFILE=1 (bench
# --profile-graph: kernel durations inside a graph replay of 16 layers, tokens 1 8 32 128, protocols ll bw,
# $OUT/kernel_profile.jsonl; the GPU tests of both, tests/gpu/test_floor.py, are in the default EP suite), LAYER1=1 (the
# layer loop and the MoE layer at one rank on GPU 0, W = 1: the glue's cost with no link in it, $OUT/layer_w1.jsonl; never
# a 2-GPU figure), GPROF=1 (scripts/grouped_profile.py: every kernel of the grouped layer's dispatch_grouped ->
# identity expert -> combine_grouped in a graph, at one rank on GPU 0 (W = 1) unless GPROF_NPROC;
# GPROF_ARGS: its options; $OUT/grouped_profile.jsonl; GPROF_PLAIN=1: again with EPGEN_PROGRAMMATIC_LAUNCH=0 into
# $OUT/grouped_profile_plain.jsonl), FLOOR1=1 (bench --floor at one rank on GPU 0, W = 1: the rank is
# its own partner, so the launch and a local flag with no link; $OUT/floor_w1.jsonl), OVERLAP=1 (scripts/overlap_profile.py at
# one rank on GPU 0: each leg's send half, a GEMM, its receive half under kineto, records of kind "overlap";
# OVERLAP_ARGS: its options; $OUT/overlap.jsonl), TITAN=1 (docs/TORCHTITAN.md: torchtitan's own MoE with its
# all-to-all dispatcher against epgen's, bf16, 2 ranks on GPU 0, tests/gpu/test_torchtitan_gpu.py, $OUT/titan.log; torchtitan
# installed first from the wheels in TITAN_WHEELS, default .titan-wheels, when that folder is there: the machine has no
# index; pip download --no-deps -d .titan-wheels torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring_parser typeguard typing_extensions
# makes it here, and the device tool carries it), TRAIN=1 (docs/TRAINING.md "Measured": scripts/train_layer.py at one rank on
# GPU 0, W = 1 unless TRAIN_NPROC: the MoE layer's forward + backward, eager, epgen against torchtitan's all-to-all dispatcher, records of kind
# "train_layer"; TRAIN_ARGS: its options; $OUT/train_layer.jsonl; torchtitan installed as for TITAN=1 when it does not import),
# TRAIN_AB=1 (scripts/train_layer.py at W = 1 twice, --backward-pair-sum then --one-launch-backward: dispatch_grouped's backward as
# a pair-sum launch and a combine, then as one combine launch, on one host; TRAIN_AB_ARGS: its options (default: 1, 128
# and 4096 tokens, no torchtitan, the kernel profile); $OUT/train_ab.jsonl, each record's dispatch_backward says which),
# HOST_AB=1 (scripts/grouped_profile.py at W = 1 twice, EPGEN_STEADY_PATH=0 then 1: the eager legs' host time on the full
# path and on the steady path, on one host; HOST_AB_ARGS: its options; $OUT/host_ab.jsonl, each record's steady_path says which),
# SPIN_AB=1 (at W = 1, scripts/grouped_profile.py (SPIN_AB_ARGS), bench --floor and scripts/phase_trace.py
# (SPIN_AB_PHASE_ARGS) built with sm_90's spin_polls = 0 (each wait pausing after every miss), then with
# SPIN_AB_POLLS (default 64) back-to-back polls first; $OUT/spin_ab*.jsonl, every record's spin_polls says which),
# AB_BASE=DIR (a copy of another commit's tree, e.g. `git archive BASE | tar -x -C DIR`: the same benchmark jobs run
# there first, without tests, into $OUT/base/, then here: an A/B on one machine; its records' commit is AB_BASE_COMMIT
# (default "base": never this tree's EPGEN_COMMIT), each AB_TREES tree's its folder's name; more than 8 files under $OUT are
# packed at the end, the logs into $OUT/rest.tar.gz (the records stay files where they fit), NO_PACK=1 leaves them),
# AB_TREES="DIR ..." (more trees measured in the same call, each as AB_BASE, after it, into $OUT/<the folder's name>/:
# several candidates against one base on one machine; e.g. `git archive BRANCH | tar -x -C .ab/NAME --exclude=generated
# --exclude=results`, carrying `.ab`; each tree builds its own sm_90 variants), AB_SKIP="VAR ..." (jobs the A/B trees do
# not run, e.g. AB_SKIP="TRAIN PHASE": those variables unset for AB_BASE and AB_TREES, so the jobs run once, in this
# tree), PHASE=1 (scripts/phase_trace.py at
# one rank on GPU 0, W = 1: dispatch_ll's and combine_ll's phase stamps, and dispatch_direct's with --forms direct, records of kind
# "phase_trace"; PHASE_ARGS: its options; $OUT/phase_trace.jsonl), NCU=1 (scripts/ncu_legs.py under Nsight Compute at one rank
# on GPU 0, W = 1, once per token count in NCU_TOKENS (default 1): the epg_ kernels' launches NCU_SKIP.. (default 24, 6 of
# them: NCU_COUNT), stall reasons and the per-instruction source page; NCU_ARGS: the script's other options, NCU_OPTS: more
# ncu options (e.g. --cache-control none); $OUT/ncu_t<T>/: ncu.ncu-rep.gz, ncu_details.csv, ncu_raw.csv.gz,
# ncu_source.csv.gz, the folder scripts/ncu_table.py reads; its table printed), HBM_FLOOR=1 (scripts/hbm_floor.py at one
# rank on GPU 0: the memory's floor of the grouped legs, plain Triton kernels in a graph, records of kind "hbm_floor";
# HBM_FLOOR_ARGS: its options; $OUT/hbm_floor.jsonl), HIST_PROBE=1 (scripts/hist_probe.py on GPU 0: dispatch_direct's
# histograms alone in several forms, scripts/hist_probe.cu, records of kind "hist_probe"; HIST_PROBE_ARGS: its options;
# $OUT/hist_probe.jsonl).
set -uo pipefail
cd "$(dirname "$0")/.."
export EPGEN_COMMIT=${EPGEN_COMMIT:-} PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/epgen-out}; mkdir -p "$OUT"
# the A/B trees are checked before any GPU work: a folder git ignores (such as .ab) reaches the device machine only
# when the call carries it, and a missing tree found after the base's run has cost the call's minutes for nothing
for tree in ${AB_BASE:-} ${AB_TREES:-}; do
  name=$(basename "$tree")
  if ! [[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*$ ]] || [ ! -f "$tree/scripts/device_run.sh" ]; then
    echo "== AB_BASE / AB_TREES: $tree is not a tree to measure (a folder holding scripts/device_run.sh, named [A-Za-z0-9_.-]; a folder git ignores travels only when the device call carries it): nothing run" >&2
    exit 2
  fi
done
[ -n "${ONE_GPU:-}" ] && export CUDA_VISIBLE_DEVICES=0
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
RANKS_PER_GPU=${RANKS_PER_GPU:-1}
NPROC=${NPROC:-$((ngpu * RANKS_PER_GPU))}  # ranks of the multi-rank runs (more than GPUs: ranks share GPUs)
OVERSUB=; [ "$NPROC" -gt "$ngpu" ] && { OVERSUB=1; echo "== $NPROC ranks on $ngpu GPU(s): oversubscribed, correctness only (no benches)"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -2
declare -A status
ab_skip=()  # the variables the A/B trees' runs have unset (AB_SKIP)
for v in ${AB_SKIP:-}; do
  if ! [[ "$v" =~ ^[A-Z][A-Z0-9_]*$ ]]; then echo "== AB_SKIP: $v is not a variable's name ([A-Z][A-Z0-9_]*): nothing run" >&2; exit 2; fi
  ab_skip+=("$v")
done
if [ -n "${AB_BASE:-}" ]; then  # an A/B on one machine: the same jobs in the base tree first (no tests), into $OUT/base
  (cd "$AB_BASE" && unset ${ab_skip[@]+"${ab_skip[@]}"} && AB_BASE= AB_TREES= EPGEN_COMMIT="${AB_BASE_COMMIT:-base}" OUT="$OUT/base" NO_TESTS=1 NO_PACK=1 bash scripts/device_run.sh) 2>&1 | sed 's/^/[base] /' | tail -40
  status[base]=${PIPESTATUS[0]}
fi
trees=()
for tree in ${AB_TREES:-}; do  # more candidates, each measured as the base is (no tests), into $OUT/<its folder's name>
  name=$(basename "$tree")
  if [ "$name" = base ]; then  # (names and folders checked at the top)
    echo "== AB_TREES: $tree is not a tree to measure (its name is the base's folder)"
    status[tree_$name]=2; trees+=("$name"); continue
  fi
  (cd "$tree" && unset ${ab_skip[@]+"${ab_skip[@]}"} && AB_BASE= AB_TREES= EPGEN_COMMIT="$name" OUT="$OUT/$name" NO_TESTS=1 NO_PACK=1 bash scripts/device_run.sh) 2>&1 | sed "s/^/[$name] /" | tail -40
  status[tree_$name]=${PIPESTATUS[0]}; trees+=("$name")
done
python3 -m generator build --arch sm_90 --profile all > "$OUT/build.log" 2>&1; status[build]=$?
tail -3 "$OUT/build.log"
if [ -z "${NO_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_quant_kernels.py tests/gpu/test_readme_gpu.py tests/gpu/test_slot_maps.py 2>&1 | tee "$OUT/quant.log" | tail -15; status[quant]=${PIPESTATUS[0]}
fi
if [ "$NPROC" -ge 2 ] && [ -z "${NO_TESTS:-}" ]; then
  # oversubscribed runs name each test as it ends and dump every rank's Python stacks when one outlasts FH_TIMEOUT s
  EP_PYTEST=${EP_PYTEST:-$([ -n "$OVERSUB" ] && echo "-v -o faulthandler_timeout=${FH_TIMEOUT:-150}" || echo -q)}
  timeout ${EP_TIMEOUT:-400} torchrun --nproc-per-node "$NPROC" -m pytest $EP_PYTEST -p no:cacheprovider -m multigpu ${EP_TESTS:-tests/gpu/test_ep_native.py tests/gpu/test_ep_ll.py tests/gpu/test_ep_lowprec.py tests/gpu/test_ep_faults.py tests/gpu/test_ep_moe.py tests/gpu/test_ep_grouped.py tests/gpu/test_ep_autograd.py tests/gpu/test_ep_internode.py tests/gpu/test_bench_gate.py tests/gpu/test_floor.py} 2>&1 | tee "$OUT/ep.log" | grep -vE "^\s*$" | tail -25; status[ep]=${PIPESTATUS[0]}
  timeout 90 torchrun --nproc-per-node "$NPROC" tests/gpu/fault_peer_death.py 2>&1 | tee "$OUT/death.log" | grep -E "survivor"; status[death]=${PIPESTATUS[0]}
fi
if [ -n "${W1_TESTS:-}" ] && [ -z "${NO_TESTS:-}" ]; then  # the W = 1 paths, which no multi-rank run takes: one rank on GPU 0
  CUDA_VISIBLE_DEVICES=0 timeout ${EP_TIMEOUT:-400} torchrun --nproc-per-node 1 -m pytest -q -p no:cacheprovider -m multigpu $W1_TESTS 2>&1 \
    | tee "$OUT/ep_w1.log" | grep -vE "^\s*$" | tail -8; status[ep_w1]=${PIPESTATUS[0]}
fi
if [ "$ngpu" -ge 2 ] && [ -z "$OVERSUB" ]; then
  if [ -n "${WS_AB:-}" ]; then  # the two workspace allocators, same run, same points
    for ws in symmetric ipc; do
      EPGEN_WORKSPACE=$ws timeout 120 torchrun --nproc-per-node "$NPROC" -m bench --tokens 128 4096 --dtypes bfloat16 \
        --out "$OUT/bench_ws.jsonl" 2>&1 | grep -vE "^(W|\*)" | tail -4 | sed "s/^/[$ws] /"; status[ws_$ws]=${PIPESTATUS[0]}
    done
  fi
  if [ -n "${TUNE:-}" ]; then  # measure launch geometries, rewrite specs/tuning.toml (copied to $OUT)
    timeout 300 torchrun --nproc-per-node "$NPROC" -m bench.tune --write-specs ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log" | grep -vE "^(W|\*)" | tail -30; status[tune]=${PIPESTATUS[0]}
    cp specs/tuning.toml "$OUT/tuning.toml"
  fi
  if [ -n "${TUNE_LL:-}" ]; then  # the low-latency protocol's threshold (intranode_ll_max_tokens), rewritten in specs/tuning.toml
    timeout 240 torchrun --nproc-per-node "$NPROC" -m bench.tune --ll-threshold --write-specs 2>&1 | tee "$OUT/tune_ll.log" \
      | grep -vE "^(W|\*)" | tail -12; status[tune_ll]=${PIPESTATUS[0]}
    cp specs/tuning.toml "$OUT/tuning.toml"
  fi
  if [ -n "${BENCH_INTERNODE:-}" ]; then  # internode (2 emulated nodes) vs intranode on the same GPUs
    timeout 200 torchrun --nproc-per-node "$NPROC" -m bench --tokens 128 4096 --dtypes bfloat16 --internode v2 v2_ll \
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
  if [ -n "${LL:-}" ]; then  # the low-latency intranode protocol and the bandwidth one side by side
    timeout 200 torchrun --nproc-per-node "$NPROC" -m bench --tokens 1 8 32 128 --dtypes bfloat16 \
      --protocol ll bw --eager-iters 20 --out "$OUT/bench_ll.jsonl" 2>&1 | tee "$OUT/bench_ll.log" | grep -vE "^(W|\*)" | tail -12
    status[ll_bench]=${PIPESTATUS[0]}
  fi
  if [ -n "${FLOOR:-}" ]; then  # the link's floor: what every small-batch leg is read against (docs/PERF.md)
    timeout 150 torchrun --nproc-per-node "$NPROC" -m bench --floor --out "$OUT/floor.jsonl" 2>&1 \
      | tee "$OUT/floor.log" | grep -vE "^(W|\*)" | tail -10; status[floor]=${PIPESTATUS[0]}
  fi
  if [ -n "${PROFILE:-}" ]; then  # kernel durations inside graph replays of the layer loop (kineto)
    timeout 240 torchrun --nproc-per-node "$NPROC" -m bench --profile-graph --tokens 1 8 32 128 --protocol ll bw \
      --out "$OUT/kernel_profile.jsonl" 2>&1 | tee "$OUT/kernel_profile.log" | grep -vE "^(W|\*)" | tail -14
    status[profile]=${PIPESTATUS[0]}
  fi
  if [ -n "${SMS:-}" ]; then  # equal SMs (docs/BENCH.md): 4096 tokens, bf16, grids of 24/32/128 blocks, dispatch 512
    # threads, combine 512/768/1024 threads (as many as its registers allow), gather and scatter; then the link's
    # ceiling (copy kernel push / pull) at those SM counts
    timeout 360 torchrun --nproc-per-node "$NPROC" -m bench --tokens 4096 --dtypes bfloat16 --launch-blocks 24 32 128 \
      --launch-threads 512 --combine-threads 512 768 1024 --combine-mode gather scatter --reps 20 --eager-iters 10 \
      --out "$OUT/bench_sms.jsonl" 2>&1 \
      | tee "$OUT/bench_sms.log" | grep -vE "^(W|\*)" | tail -16; status[sms]=${PIPESTATUS[0]}
    timeout 120 torchrun --nproc-per-node "$NPROC" -m bench --ceiling --ceiling-sms 24 32 128 \
      --out "$OUT/ceiling_sms.jsonl" 2>&1 | tee "$OUT/ceiling_sms.log" | grep -vE "^(W|\*)" | tail -12; status[ceiling_sms]=${PIPESTATUS[0]}
  fi
  if [ -n "${SWEEP:-}" ]; then
    timeout 540 torchrun --nproc-per-node "$NPROC" -m bench --tokens 1 8 32 128 512 2048 4096 8192 \
      --hidden 7168 4096 --dtypes bfloat16 float8_e4m3fn --torch-baseline --out "$OUT/sweep.jsonl" 2>&1 \
      | tee "$OUT/sweep.log" | grep -vE "^(W|\*)" | tail -34; status[sweep]=${PIPESTATUS[0]}
  fi
  if [ -n "${LAYER:-}" ]; then
    timeout 300 torchrun --nproc-per-node "$NPROC" -m bench --layer-loop --ceiling --layer --protocol ${LAYER_PROTOCOLS:-ll bw} --out "$OUT/layer.jsonl" \
      2>&1 | tee "$OUT/layer.log" | grep -vE "^(W|\*)" | tail -50; status[layer]=${PIPESTATUS[0]}
    # torch's all_to_all_vdev_2d takes at most 16 experts per rank: the three paths meet at 16 per rank, in a file of
    # their own (epgen and all_to_all_single here, then all_to_all_vdev_2d in a process of its own: NVSHMEM)
    VEXP=$((16 * NPROC))
    timeout 150 torchrun --nproc-per-node "$NPROC" -m bench --layer --experts "$VEXP" --layer-paths epgen a2a \
      --out "$OUT/layer_vdev2d.jsonl" 2>&1 | tee "$OUT/layer_e16.log" | grep -vE "^(W|\*)" | tail -25; status[layer_e16]=${PIPESTATUS[0]}
    TORCH_SYMMMEM=NVSHMEM NVSHMEM_SYMMETRIC_SIZE=12G timeout 150 torchrun --nproc-per-node "$NPROC" -m bench --layer \
      --experts "$VEXP" --layer-paths a2a vdev2d --out "$OUT/layer_vdev2d.jsonl" 2>&1 | tee "$OUT/layer_vdev2d.log" \
      | grep -vE "^(W|\*)" | tail -25; status[layer_vdev2d]=${PIPESTATUS[0]}
    { python3 scripts/layer_table.py "$OUT/layer.jsonl"
      printf '\n## %s experts (16 per rank: the most all_to_all_vdev_2d takes)\n\n' "$VEXP"
      python3 scripts/layer_table.py "$OUT/layer_vdev2d.jsonl"; } > "$OUT/layer_table.md"; cat "$OUT/layer_table.md"
    python3 scripts/plot_bench.py --layer "$OUT/layer.jsonl" "$OUT/layer.png" || echo "plot skipped (matplotlib?)"
    timeout 120 torchrun --nproc-per-node "$NPROC" -m pytest -q -p no:cacheprovider -m multigpu tests/gpu/test_moe_layer_example.py \
      2>&1 | tee "$OUT/layer_example.log" | grep -vE "^\s*$" | tail -6; status[layer_example]=${PIPESTATUS[0]}
  fi
  [ -n "${NO_BENCH:-}" ] || timeout 200 torchrun --nproc-per-node "$NPROC" -m bench --lowprec ${BENCH_ARGS:-} --out "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench.log" | tail -12; status[bench]=${PIPESTATUS[0]}
fi
if [ -n "${LAYER1:-}" ]; then  # one rank on GPU 0 (W = 1): the layer's glue with no link in the way, never a 2-GPU figure
  CUDA_VISIBLE_DEVICES=0 timeout 300 torchrun --nproc-per-node 1 -m bench --layer-loop --layer --protocol ${LAYER_PROTOCOLS:-ll bw} \
    --out "$OUT/layer_w1.jsonl" 2>&1 | tee "$OUT/layer_w1.log" \
    | grep -vE "^(W|\*)" | tail -30; status[layer_w1]=${PIPESTATUS[0]}
  python3 scripts/layer_table.py "$OUT/layer_w1.jsonl" > "$OUT/layer_w1_table.md" && cat "$OUT/layer_w1_table.md"
fi
if [ -n "${FLOOR1:-}" ]; then  # the floor at one rank (W = 1: its own partner): launch and local flag, no link
  CUDA_VISIBLE_DEVICES=0 timeout 150 torchrun --nproc-per-node 1 -m bench --floor --out "$OUT/floor_w1.jsonl" 2>&1 \
    | tee "$OUT/floor_w1.log" | grep -vE "^(W|\*)" | tail -10; status[floor_w1]=${PIPESTATUS[0]}
fi
if [ -n "${OVERLAP:-}" ]; then  # split-phase legs around a GEMM at one rank (W = 1): epgen kernels between the halves
  CUDA_VISIBLE_DEVICES=0 timeout 200 torchrun --nproc-per-node 1 scripts/overlap_profile.py ${OVERLAP_ARGS:-} \
    --out "$OUT/overlap.jsonl" 2>&1 | tee "$OUT/overlap.log" | grep -vE "^(W|\*)" | tail -12; status[overlap]=${PIPESTATUS[0]}
fi
if [ -n "${PHASE:-}" ]; then  # where a leg's time goes inside its kernels (phase stamps), W = 1
  CUDA_VISIBLE_DEVICES=0 timeout 200 torchrun --nproc-per-node 1 scripts/phase_trace.py ${PHASE_ARGS:-} \
    --out "$OUT/phase_trace.jsonl" 2>&1 | tee "$OUT/phase_trace.log" | grep -vE "^(W|\*)" | tail -60; status[phase]=${PIPESTATUS[0]}
fi
if [ -n "${HBM_FLOOR:-}" ]; then  # the memory's floor of what the grouped legs move, on this card (W = 1)
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 scripts/hbm_floor.py ${HBM_FLOOR_ARGS:-} --out "$OUT/hbm_floor.jsonl" 2>&1 \
    | tee "$OUT/hbm_floor.log" | tail -14; status[hbm_floor]=${PIPESTATUS[0]}
fi
if [ -n "${HIST_PROBE:-}" ]; then  # dispatch_direct's histograms alone, each form checked against torch, then timed
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 scripts/hist_probe.py ${HIST_PROBE_ARGS:-} --out "$OUT/hist_probe.jsonl" 2>&1 \
    | tee "$OUT/hist_probe.log" | tail -12; status[hist_probe]=${PIPESTATUS[0]}
fi
gprof_run() {  # scripts/grouped_profile.py into $OUT/$1.jsonl and .log; the rest: environment settings for the run
  local name=$1; shift
  CUDA_VISIBLE_DEVICES=$([ "${GPROF_NPROC:-1}" -gt 1 ] && echo "${CUDA_VISIBLE_DEVICES:-0,1}" || echo 0) env "$@" timeout 240 \
    torchrun --nproc-per-node ${GPROF_NPROC:-1} scripts/grouped_profile.py ${GPROF_ARGS:-} --out "$OUT/$name.jsonl" 2>&1 \
    | tee "$OUT/$name.log" | grep -vE "^(W|\*)" | tail -60
  return "${PIPESTATUS[0]}"
}
if [ -n "${GPROF:-}" ]; then  # where the grouped layer's communication time goes, kernel by kernel
  gprof_run grouped_profile; status[gprof]=$?
  if [ -n "${GPROF_PLAIN:-}" ]; then  # the same again with plain launches: one tree, both forms
    gprof_run grouped_profile_plain EPGEN_PROGRAMMATIC_LAUNCH=0; status[gprof_plain]=$?
  fi
fi
if [ -n "${NCU:-}" ]; then  # the grouped layer's kernels under Nsight Compute at one rank (W = 1): stall reasons, per instruction
  ncu_sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section SourceCounters --section InstructionStats --section MemoryWorkloadAnalysis"
  for t in ${NCU_TOKENS:-1}; do  # one folder per token count, $OUT/ncu_t<T>/: the report and its exports
    d="$OUT/ncu_t$t"; mkdir -p "$d"
    CUDA_VISIBLE_DEVICES=0 RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=${NCU_PORT:-29533} timeout 300 \
      ncu --clock-control none --target-processes all --kernel-name regex:'^epg_' --launch-skip ${NCU_SKIP:-24} \
      --launch-count ${NCU_COUNT:-6} $ncu_sections ${NCU_OPTS:-} -f -o "$d/ncu" python3 scripts/ncu_legs.py --tokens "$t" \
      ${NCU_ARGS:-} 2>&1 | tee "$d/ncu.log" | grep -E "^(==PROF== Profiling|tokens|==ERROR)" | tail -12; rc=${PIPESTATUS[0]}
    status[ncu]=$(( ${status[ncu]:-0} | rc ))
    if [ -f "$d/ncu.ncu-rep" ]; then
      ncu -i "$d/ncu.ncu-rep" --page details --csv > "$d/ncu_details.csv" 2>&1
      ncu -i "$d/ncu.ncu-rep" --page raw --csv > "$d/ncu_raw.csv" 2>&1
      ncu -i "$d/ncu.ncu-rep" --page source --csv --print-source sass > "$d/ncu_source.csv" 2>&1
      python3 scripts/ncu_table.py "$d" | sed "s/^/[T=$t] /"
      gzip -f "$d/ncu_raw.csv" "$d/ncu_source.csv" "$d/ncu.ncu-rep"
    fi
  done
fi
if [ -n "${HOST_AB:-}" ]; then  # the eager legs' host time with the steady path off, then on, on one host (W = 1)
  for steady in 0 1; do
    CUDA_VISIBLE_DEVICES=0 EPGEN_STEADY_PATH=$steady timeout 200 torchrun --nproc-per-node 1 scripts/grouped_profile.py \
      ${HOST_AB_ARGS:---tokens 1 128 --reps 5 --eager-iters 300 --host-profile} --out "$OUT/host_ab.jsonl" 2>&1 \
      | tee "$OUT/host_ab_$steady.log" | grep -E "^T=|eager legs" | tail -8; rc=${PIPESTATUS[0]}
    status[host_ab]=$(( ${status[host_ab]:-0} | rc ))
  done
fi
if [ -n "${TRAIN_AB:-}" ]; then  # dispatch_grouped's backward as two launches, then as one, on one host (W = 1)
  for form in --backward-pair-sum --one-launch-backward; do
    CUDA_VISIBLE_DEVICES=0 timeout 240 torchrun --nproc-per-node 1 scripts/train_layer.py \
      ${TRAIN_AB_ARGS:---tokens 1 128 4096 --no-titan --kernel-profile} $form --out "$OUT/train_ab.jsonl" 2>&1 \
      | tee "$OUT/train_ab${form//-/_}.log" | grep -vE "^(W|\*)" | tail -14; rc=${PIPESTATUS[0]}
    status[train_ab]=$(( ${status[train_ab]:-0} | rc ))
  done
fi
if [ -n "${SPIN_AB:-}" ]; then  # the EP kernels' waits pausing after every miss (spin_polls 0), then after SPIN_AB_POLLS, W = 1
  cp specs/targets.toml "${TMPDIR:-/tmp}/epgen_targets.toml.keep"
  for polls in 0 ${SPIN_AB_POLLS:-64}; do  # the same tree with sm_90's spin_polls set, rebuilt (records' spin_polls say which)
    sed -i "/^\[target\.sm_90\]$/,/^\[/ s/^spin_polls = .*/spin_polls = $polls/" specs/targets.toml
    python3 -m generator build --arch sm_90 --profile all > "$OUT/build_spin$polls.log" 2>&1 || { status[spin_ab]=1; break; }
    CUDA_VISIBLE_DEVICES=0 timeout 200 torchrun --nproc-per-node 1 scripts/grouped_profile.py \
      ${SPIN_AB_ARGS:---tokens 1 128 --reps 10 --eager-iters 50} --out "$OUT/spin_ab.jsonl" 2>&1 \
      | tee "$OUT/spin_ab_$polls.log" | grep -vE "^(W|\*)" | tail -24; rc=${PIPESTATUS[0]}
    status[spin_ab]=$(( ${status[spin_ab]:-0} | rc ))
    CUDA_VISIBLE_DEVICES=0 timeout 150 torchrun --nproc-per-node 1 -m bench --floor --out "$OUT/spin_ab_floor.jsonl" 2>&1 \
      | tee "$OUT/spin_ab_floor_$polls.log" | grep -vE "^(W|\*)" | tail -6
    CUDA_VISIBLE_DEVICES=0 timeout 200 torchrun --nproc-per-node 1 scripts/phase_trace.py ${SPIN_AB_PHASE_ARGS:---tokens 1 --forms one plain} \
      --out "$OUT/spin_ab_phase.jsonl" 2>&1 | tee "$OUT/spin_ab_phase_$polls.log" | grep -vE "^(W|\*)" | tail -30
  done
  cp "${TMPDIR:-/tmp}/epgen_targets.toml.keep" specs/targets.toml
  python3 -m generator build --arch sm_90 --profile all > /dev/null 2>&1  # the specs' own build again, for what follows
fi
titan_install() {  # torchtitan from the carried wheels (the machine has no index), where it does not import yet
  python3 -c 'import runtime.integrations.torchtitan' 2>/dev/null && return 0
  local wheels=${TITAN_WHEELS:-.titan-wheels}
  if [ -d "$wheels" ]; then python3 -m pip install -q --no-index --no-deps "$wheels"/*.whl 2>&1 | tail -3; fi
}
if [ -n "${TRAIN:-}" ]; then  # the MoE layer's forward + backward, eager, against torchtitan's all-to-all dispatcher (W = 1)
  titan_install
  CUDA_VISIBLE_DEVICES=$([ "${TRAIN_NPROC:-1}" -gt 1 ] && echo "${CUDA_VISIBLE_DEVICES:-0,1}" || echo 0) timeout 240 \
    torchrun --nproc-per-node ${TRAIN_NPROC:-1} scripts/train_layer.py ${TRAIN_ARGS:-} \
    --out "$OUT/train_layer.jsonl" 2>&1 | tee "$OUT/train_layer.log" | grep -vE "^(W|\*)" | tail -24; status[train]=${PIPESTATUS[0]}
fi
if [ -n "${TITAN:-}" ]; then  # the torchtitan check (a CUDA torch brings triton; the shim covers torch 2.11)
  titan_install
  CUDA_VISIBLE_DEVICES=0 timeout 300 torchrun --nproc-per-node 2 -m pytest -q -rs -p no:cacheprovider -m multigpu \
    tests/gpu/test_torchtitan_gpu.py 2>&1 | tee "$OUT/titan.log" | grep -vE "^\s*$" | tail -14; status[titan]=${PIPESTATUS[0]}
fi
# The device tool brings back at most 8 files from $OUT: where there are more, the records (*.jsonl, an A/B base's
# in base/ too) stay files and the rest (logs) goes into $OUT/rest.tar.gz; where those records are more than 7, only
# this tree's stay files (the base's are packed too); where even those are more than 7, everything is packed.
pack_out() {
  local n
  n=$(find "$OUT" -type f | wc -l)
  [ "$n" -le 8 ] && return 0
  (cd "$OUT" && if [ "$(find . -maxdepth 2 -type f -name '*.jsonl' | wc -l)" -le 7 ]; then
      find . -type f ! -path ./rest.tar.gz \( ! -name '*.jsonl' -o -path './*/*/*' \) -print0
    elif [ "$(find . -maxdepth 1 -type f -name '*.jsonl' | wc -l)" -le 7 ]; then
      find . -type f ! -path ./rest.tar.gz \( ! -name '*.jsonl' -o -path './*/*' \) -print0
    else
      find . -type f ! -path ./rest.tar.gz -print0
    fi | tar --null -czf rest.tar.gz -T - --remove-files)
  echo "== $n files under OUT: $(find "$OUT" -type f | wc -l) come back, the rest packed in rest.tar.gz"
}
[ -z "${NO_PACK:-}" ] && pack_out
echo "== summary"
for k in base build quant ep death ep_w1 floor floor_w1 overlap profile ws_symmetric ws_ipc tune tune_ll internode_bench host_async host_sync host_internode ll_bench sms ceiling_sms sweep layer layer_e16 layer_vdev2d layer_example layer_w1 gprof gprof_plain hbm_floor hist_probe host_ab phase train train_ab spin_ab titan bench; do printf '%-6s %s\n' "$k" "${status[$k]:-not run}"; done
for name in ${trees[@]+"${trees[@]}"}; do printf '%-6s %s\n' "tree $name" "${status[tree_$name]}"; done
