"""The floor of a small-batch EP leg, measured: ``python -m bench --floor`` (records kind "floor").

torchrun --nproc-per-node 2 -m bench --floor [--floor-rounds 1000] [--layers 16] [--floor-blocks 1 0] [--reps 30]

Three methods, each a record (``method``), with the metadata of the other records (commit, date, gpu, driver,
cuda_driver_api, torch, world_size, target, sms):

  pingpong      one thread per rank bounces a flag with its partner (ranks 2i and 2i + 1) inside one kernel:
                store the peer's flag (release, system scope), wait for its own (acquire); after one untimed
                handshake round, `rounds` round trips timed by the device's global timer in the kernel. Fields:
                rounds, round_trip_us (slowest rank's median over --reps launches), one_way_us (half of it). The
                link's latency without any launch cost.
  signal_graph  L one-signal kernels captured in one CUDA graph per rank: each stores its number to the
                partner's flag and waits until its own flag carries it (the shape of a 1-token leg: one
                store to the peer, one wait for the peer). Fields: layers, blocks (the grid: block 0's
                thread 0 signals, the other blocks exit; 0 asks one block per SM), per_kernel_us (replay / L,
                slowest rank's median, bench's eager timing of the replay), kernel_us (the kernel's duration
                inside the replay, kineto, slowest rank's median), gap_us (the idle time between consecutive
                kernels of the replay, kineto median, slowest rank).
  empty_graph   L empty kernels in one graph: the same fields; the launch and the gap alone.
  primitives    what a kernel's own steps cost on this device, timed by block 0's thread 0 with the global timer
                inside one launch of a block of 512 threads (after an untimed launch): sm_clock_ghz (clock64
                against the timer over 20 µs), barrier_ns (a block barrier), l2_load_ns (a dependent load through a
                64 KB pointer chain at device scope: L2, no L1), atomic_ns (a dependent device-scope atomic add),
                fence_sys_ns (a store then __threadfence_system), fence_release_sys_ns (a store then
                fence.acq_rel.sys), timer_read_ns (a global timer read), first_load_ns / first_barrier_ns (the
                launch's first global load and first block barrier), l2_load_sys_ns / l2_load_volatile_ns (the
                chain's loads relaxed at system scope / volatile, as the low-latency protocol polls), hbm_load_ns
                (a dependent load through a 256 MB chain, entered at a new word each launch: past L2),
                store16_volatile_ns / store16_ns (a 16-byte store, volatile as the low-latency protocol's flagged
                vectors / plain, issued back to back by one thread), pause_ns (one epg_pause of the EP kernels'
                waits, __nanosleep(32), back to back), flag_round_tight_ns / flag_round_pause_ns (a flag bounced
                between two waves of the block through device memory, one round trip: polled back to back / with
                a pause after each miss, as the EP kernels' waits do: the difference is what the pause adds to a
                wait); and, from a second kernel (epg_floor_code, one thread), the cost of running code for the
                first time: a straight-line region of code_steps independent integer steps (~3 instructions each,
                eight chains) timed on its first pass after the L2 was flushed (code_cold_ns: a 128 MB write
                between launches), on its first pass right after an identical launch (code_l2_ns) and on its
                second pass in the launch (code_warm_ns: the instructions cached); and (epg_floor_jumps) the same
                steps in code_jumps blocks, each one side of a branch whose other side lies in between, as a
                kernel's hot path jumps over its inlined cold paths: its first pass in a launch
                (code_jumps_first_ns) and its second (code_jumps_second_ns); and (epg_floor_args) what reading
                the launch's arguments costs: args_reads dependent reads of a 3.5 KB argument block 8 bytes apart
                (args_dense_*) and 64 bytes apart (args_sparse_*), on their first pass in a launch and their
                second, and, after one warp instruction that reads a word of every 64-byte line of the block
                (args_prefetch_ns), their first pass (args_*_prefetched_ns); and (epg_floor_drain, a block of
                512) what stores left in flight cost the next step: a shared-memory step of eight rounds (a load
                of another thread's word, a store, a block barrier) with no stores before it (drain_none_ns),
                right after drain_stores 16-byte stores a thread (drain_stored_first_ns, its second pass
                drain_stored_second_ns), and after the stores and a fence (drain_fence_ns, then
                drain_fenced_ns). The terms a 1-token kernel's
                phases are read against (docs/PERF.md).

The kernels are bench-only: CUDA source here, compiled with the target's toolchain (bench.kernels.compile_source,
like the ceiling's copy kernel); the flags live in the runtime's IPC workspace (runtime.ipc.allocate). Every
wait is bounded (--floor-timeout-s): a method that times out, or cannot run (an odd world size above one: at
W = 1 the rank is its own partner, no link in the figures; a target
without these kernels), is a record with its reason (``error``) and the run goes on. ``floor_table`` prints the
table (docs/PERF.md reads every small-batch target against it).
"""

from __future__ import annotations

import ctypes
import statistics

import torch
import torch.distributed as dist

from . import graphprof, records
from .measure import collective_try, on_gpu, stats, warm_on_side_stream
from .tables import latest, md_cell

FLOOR_KERNELS = r"""
// bench-only floor kernels (bench/floor.py): flags between partner GPUs, relaxed system-scope stores and
// loads (the flags carry no data, so nothing needs ordering before them: no fence, the floor)
__device__ __forceinline__ void st_flag(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned ld_flag(const unsigned* p) {
  unsigned v; asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
// wait until *p reaches v (flags only grow; wrapping compare); false past the deadline
__device__ __forceinline__ bool reach(const unsigned* p, unsigned v, unsigned long long deadline) {
  for (unsigned n = 1; (int)(ld_flag(p) - v) < 0; ++n)
    if ((n & 255u) == 0 && now_ns() > deadline) return false;
  return true;
}
// out[0]: ns of `rounds` timed round trips (after one untimed handshake round); out[1]: 0, or the round
// that timed out
extern "C" __global__ void epg_floor_pingpong(unsigned* mine, unsigned* peer, int rounds, int starter, unsigned base,
                                              long long timeout_ns, unsigned long long* out) {
  if (threadIdx.x || blockIdx.x) return;
  const unsigned long long deadline = now_ns() + (unsigned long long)timeout_ns;
  unsigned long long t0 = 0;
  for (int i = 0; i <= rounds; ++i) {
    const unsigned v = base + 1u + (unsigned)i;
    if (starter) st_flag(peer, v);
    if (!reach(mine, v, deadline)) { out[0] = 0; out[1] = (unsigned long long)i + 1; return; }
    if (!starter) st_flag(peer, v);
    if (i == 0) t0 = now_ns();
  }
  out[0] = now_ns() - t0;
  out[1] = 0;
}
// one signal: this kernel's number (counter + 1, kept in *counter: stream order makes the last kernel's
// store visible) to the partner's flag, then wait for the partner's; status[0] = 1 on a timeout
extern "C" __global__ void epg_floor_signal(unsigned* mine, unsigned* peer, unsigned* counter, long long timeout_ns,
                                            unsigned* status) {
  if (threadIdx.x || blockIdx.x) return;
  const unsigned e = *counter + 1u;
  *counter = e;
  st_flag(peer, e);
  if (!reach(mine, e, now_ns() + (unsigned long long)timeout_ns)) status[0] = 1u;
}
extern "C" __global__ void epg_floor_empty() {}
// a kernel's own steps, timed by block 0's thread 0 (the others join the barriers): out[9] ns of the launch's first
// global load (chain[0]) and out[10] of its first block barrier, then out[0] SM cycles and out[1] ns of a 20 us
// spin, then ns of: out[2] reps block barriers, out[3] hops dependent loads through `chain` (relaxed, device
// scope: L2), out[4] hops dependent atomic adds on word[0], out[5] reps (store, __threadfence_system), out[6] reps
// (store, fence.acq_rel.sys), out[7] reps timer reads, out[11] / out[12] hops dependent loads through `chain`
// relaxed at system scope / volatile (the low-latency protocol's polls), out[13] hops dependent loads through
// `big` (far larger than L2) from word `start`, out[14] / out[15] reps 16-byte stores into `scratch` (4096
// vectors), volatile (the low-latency protocol's flagged vectors) / plain, as issued one after another by one
// thread; out[16] reps __nanosleep(32) (the EP kernels' pause between polls); out[17] / out[18] hops round trips of
// a flag between thread 0 and thread 32 (word[2], word[3]), polled back to back / with __nanosleep(32) after each
// miss (0: a wait passed its deadline); out[8] keeps the chains' results live
__device__ __forceinline__ unsigned ld_gpu(const unsigned* p) {
  unsigned v; asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ void st_gpu(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned ld_volatile(const unsigned* p) {
  unsigned v; asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
extern "C" __global__ void epg_floor_primitives(const unsigned* chain, unsigned* word, int hops, int reps,
                                                unsigned long long* out, const unsigned* big, unsigned start,
                                                uint4* scratch) {
  const bool lead = blockIdx.x == 0 && threadIdx.x == 0;
  unsigned long long t0 = now_ns();
  unsigned first = 0;
  if (lead) {
    first = ld_gpu(chain);
    if (first == 0xffffffffu) out[8] = 1;  // a store on the value: the timer below reads after the load is in
  }
  const unsigned long long t1 = now_ns();
  __syncthreads();
  if (lead) {
    out[9] = t1 - t0;
    out[10] = now_ns() - t1;
    t0 = now_ns();
    const long long c0 = clock64();
    while (now_ns() - t0 < 20000ull) {}
    out[0] = (unsigned long long)(clock64() - c0);
    out[1] = now_ns() - t0;
    word[2] = word[3] = 0u;  // the flag bounce's words, seen by thread 32 after the barrier
  }
  __syncthreads();
  t0 = now_ns();
  for (int i = 0; i < reps; ++i) __syncthreads();
  const unsigned long long barriers_ns = now_ns() - t0;  // before the bounce below
  if (blockIdx.x == 0 && (threadIdx.x == 0 || threadIdx.x == 32)) {  // two waves bounce a flag: tight, then paused
    const bool ping = threadIdx.x == 0;
    unsigned* mine = word + (ping ? 3 : 2);
    unsigned* other = word + (ping ? 2 : 3);
    const unsigned long long deadline = now_ns() + 1000000000ull;
    for (unsigned mode = 0; mode < 2; ++mode) {
      bool late = false;
      const unsigned long long s0 = now_ns();
      for (unsigned i = 1; i <= (unsigned)hops && !late; ++i) {
        const unsigned v = mode * (unsigned)hops + i;
        if (ping) st_gpu(other, v);
        for (unsigned n = 1; ld_gpu(mine) != v; ++n) {
          if (mode) __nanosleep(32);
          if ((n & 255u) == 0 && now_ns() > deadline) { late = true; break; }
        }
        if (!ping) st_gpu(other, v);
      }
      if (ping) out[17 + mode] = late ? 0ull : now_ns() - s0;
    }
  }
  if (!lead) return;
  out[2] = barriers_ns;
  unsigned p = 0, v = 0;
  t0 = now_ns();
  for (int i = 0; i < hops; ++i) p = ld_gpu(chain + p);
  out[3] = now_ns() - t0;
  t0 = now_ns();
  for (int i = 0; i < hops; ++i) v = atomicAdd(word, v & 1u);
  out[4] = now_ns() - t0;
  volatile unsigned* w1 = word + 1;
  t0 = now_ns();
  for (int i = 0; i < reps; ++i) { *w1 = (unsigned)i; __threadfence_system(); }
  out[5] = now_ns() - t0;
  t0 = now_ns();
  for (int i = 0; i < reps; ++i) { *w1 = (unsigned)i; asm volatile("fence.acq_rel.sys;" ::: "memory"); }
  out[6] = now_ns() - t0;
  unsigned long long x = 0;
  t0 = now_ns();
  for (int i = 0; i < reps; ++i) x ^= now_ns();
  out[7] = now_ns() - t0;
  unsigned q = 0;
  t0 = now_ns();
  for (int i = 0; i < hops; ++i) q = ld_flag(chain + q);
  out[11] = now_ns() - t0;
  unsigned r = 0;
  t0 = now_ns();
  for (int i = 0; i < hops; ++i) r = ld_volatile(chain + r);
  out[12] = now_ns() - t0;
  unsigned b = start;
  t0 = now_ns();
  for (int i = 0; i < hops; ++i) b = ld_gpu(big + b);
  out[13] = now_ns() - t0;
  t0 = now_ns();
  for (int i = 0; i < reps; ++i) {
    uint4* at = scratch + (i * 37) % 4096;
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(at), "r"(i), "r"(b), "r"(p), "r"(q) : "memory");
  }
  out[14] = now_ns() - t0;
  t0 = now_ns();
  for (int i = 0; i < reps; ++i) {
    uint4* at = scratch + (i * 37) % 4096;
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(at), "r"(i), "r"(b), "r"(p), "r"(q) : "memory");
  }
  out[15] = now_ns() - t0;
  t0 = now_ns();
  for (int i = 0; i < reps; ++i) __nanosleep(32);
  out[16] = now_ns() - t0;
  out[8] = p ^ v ^ x ^ first ^ q ^ r ^ b;
}
// one thread runs a code region twice: out[0] ns of its first pass, out[1] of its second; out[2] keeps the chains
// live. The timer reads are tied to the chains' values (asm inputs), so no step moves across them. Two regions
// (code_kernel below): epg_floor_code, straight-line (CODE_STEPS steps: xorshift and multiply on eight independent
// chains, nothing folds), and epg_floor_jumps, the same steps in JUMP_BLOCKS blocks, each one side of a branch on a
// bit of `sel` (fixed for the launch, so both passes take the same sides): every block's run starts with a jump into
// code laid out past the other side's, as a kernel's hot path jumps over its inlined cold paths.
__device__ __forceinline__ unsigned long long now_after(unsigned dep) {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : "r"(dep)); return t;
}
@CODE_KERNELS@
// one thread reads launch arguments (the constant bank the driver fills per launch) in a dependent chain: each read's
// offset waits for the chain (zero_after: 0 for all but one chain value, which ptxas cannot fold), so every read is
// an LDC issued after the one before returned. ARGS_READS reads 8 bytes apart (dense: a few lines), then ARGS_READS
// reads 64 bytes apart (sparse: a line each, from byte 512 of the block on), each region timed, twice (out[0..3]:
// dense, sparse, dense, sparse). With `warm`, first one warp instruction reads a word of every 64-byte line of the
// block (what a kernel's entry could do for its argument block), timed (out[4]). The EP kernels read their argument
// block's fields (~9 lines of it) as LDCs and constant operands, first in each phase: this is what those reads cost
// the first time in a launch and after.
__device__ __forceinline__ unsigned zero_after(unsigned dep) { return dep == 0x5EEDF00Du ? 1u : 0u; }
struct EpgFloorArgs { unsigned long long w[ARGS_WORDS]; };
extern "C" __global__ void epg_floor_args(unsigned long long* out, unsigned seed, unsigned warm,
                                          const __grid_constant__ EpgFloorArgs blk) {
  if (blockIdx.x || threadIdx.x >= 32) return;
  unsigned a = seed;
  const unsigned long long tw = now_after(a);
  if (warm) {
    const unsigned line = threadIdx.x * 8u;  // lanes 0..31: lines 0..31, then lines 32..55 (lanes past wrap)
    const unsigned v = (unsigned)blk.w[line] ^ (unsigned)blk.w[(line + 256u) % ARGS_WORDS];
    a ^= __reduce_xor_sync(0xffffffffu, v) & 1u;
  }
  if (threadIdx.x) return;
  out[4] = now_after(a) - tw;
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    const unsigned long long t0 = now_after(a);
    a ^= (unsigned)t0;
#pragma unroll
    for (int i = 0; i < ARGS_READS; ++i) a = (a ^ (unsigned)blk.w[zero_after(a) + i]) * 0x9E3779B1u;
    const unsigned long long t1 = now_after(a);
#pragma unroll
    for (int i = 0; i < ARGS_READS; ++i) a = (a ^ (unsigned)blk.w[zero_after(a) + 64 + 8 * i]) * 0x9E3779B1u;
    const unsigned long long t2 = now_after(a);
    out[2 * pass] = t1 - t0;
    out[2 * pass + 1] = t2 - t1;
  }
  out[5] = a;
}
// a block of DRAIN_THREADS threads: each stores `stores` 16-byte vectors, a line apart (as a receive writes rows), then
// the block runs a shared-memory step (DRAIN_ROUNDS rounds of a load of another thread's word, a store of it and a
// block barrier, as a block prefix does) twice, thread 0 timing each pass (out[0], out[1]). mode 0: no stores; 1: the
// stores, then the step at once; 2: the stores, then fence.acq_rel.gpu (out[2]: its time) and a barrier first. What
// the stores a phase leaves in flight cost the next phase's first shared-memory step.
extern "C" __global__ void epg_floor_drain(unsigned long long* out, uint4* scratch, int stores, int mode, unsigned seed) {
  __shared__ unsigned sh[2][DRAIN_THREADS];
  const unsigned tid = threadIdx.x;
  sh[0][tid] = (tid * 2654435761u + seed) % DRAIN_THREADS;
  __syncthreads();
  if (mode) {
    for (int i = 0; i < stores; ++i) {
      uint4* at = scratch + ((unsigned)i * DRAIN_THREADS + tid) * 4u;
      asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(at), "r"(tid), "r"(seed), "r"(i), "r"(mode)
                   : "memory");
    }
  }
  if (mode == 2) {
    const unsigned long long f0 = now_after(tid);
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    if (tid == 0) out[2] = now_after(tid) - f0;
    __syncthreads();
  }
  unsigned v = sh[0][tid];
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    const unsigned long long t0 = now_after(v);
#pragma unroll
    for (int r = 0; r < DRAIN_ROUNDS; ++r) {
      v = sh[r & 1][(v + tid) % DRAIN_THREADS];
      sh[(r + 1) & 1][tid] = v;
      __syncthreads();
    }
    if (tid == 0) out[pass] = now_after(v) - t0;
  }
  if (tid == 0) out[3] = v;
}
"""
CODE_STEPS = 1024  # the code region's steps (~3 SASS instructions each on sm_90: ~48 KB, dispatch_ll's size)
JUMP_BLOCKS = 64  # the branchy region's blocks (CODE_STEPS / JUMP_BLOCKS steps a side, ~0.8 KB of SASS)
JUMP_SEL = 0x5A5A5A5A  # the sides taken: bit (block % 32)


def _step(i: int, salt: int = 0) -> str:
    return f"a{i % 8} = (a{i % 8} ^ (a{i % 8} >> {7 + i % 5}u)) * {0x9E3779B1 + 2 * i + salt}u;"


def _code_kernel(name: str, params: str, body: list[str]) -> str:
    """A one-thread kernel running `body` (lines of steps on the chains a0..a7) twice, each pass timed."""
    chains = "a0 ^ a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7"
    return "\n".join([
        f'extern "C" __global__ void {name}(unsigned long long* out, unsigned seed{params}) {{',
        "  if (threadIdx.x || blockIdx.x) return;",
        "  unsigned a0 = seed, a1 = seed + 1u, a2 = seed + 2u, a3 = seed + 3u, a4 = seed + 4u, a5 = seed + 5u, "
        "a6 = seed + 6u,",
        "           a7 = seed + 7u;",
        "#pragma unroll 1",
        "  for (int pass = 0; pass < 2; ++pass) {",
        f"    const unsigned long long t0 = now_after({chains});",
        "    a0 ^= (unsigned)t0;",
        *body,
        f"    out[pass] = now_after({chains}) - t0;",
        "  }",
        f"  out[2] = {chains};",
        "}"])


def _jump_blocks() -> list[str]:
    per = CODE_STEPS // JUMP_BLOCKS
    out = []
    for b in range(JUMP_BLOCKS):
        taken = " ".join(_step(b * per + j) for j in range(per))
        other = " ".join(_step(b * per + j, 0x10000) for j in range(per))
        out.append(f"    if ((sel >> {b % 32}) & 1u) {{ {taken} }} else {{ {other} }}")
    return out


ARGS_WORDS = 448  # the argument block's 8-byte words (3584 bytes: with the other arguments under the 4 KB limit)
ARGS_READS = 48  # reads per region: dense 8 bytes apart (384 bytes), sparse 64 bytes apart (from byte 512 on)
DRAIN_THREADS, DRAIN_ROUNDS, DRAIN_STORES = 512, 8, 8  # the drain kernel's block, its step's rounds, stores a thread
FLOOR_KERNELS = FLOOR_KERNELS.replace("ARGS_WORDS", str(ARGS_WORDS)).replace("ARGS_READS", str(ARGS_READS))
FLOOR_KERNELS = FLOOR_KERNELS.replace("DRAIN_THREADS", str(DRAIN_THREADS)).replace("DRAIN_ROUNDS", str(DRAIN_ROUNDS))
FLOOR_KERNELS = FLOOR_KERNELS.replace("@CODE_KERNELS@", "\n".join([
    _code_kernel("epg_floor_code", "", [f"    {_step(i)}" for i in range(CODE_STEPS)]),
    _code_kernel("epg_floor_jumps", ", unsigned sel", _jump_blocks())]))
SYMBOLS = ("epg_floor_pingpong", "epg_floor_signal", "epg_floor_empty", "epg_floor_primitives", "epg_floor_code",
           "epg_floor_jumps", "epg_floor_args", "epg_floor_drain")
METHODS = ("pingpong", "signal_graph", "empty_graph", "primitives")
PRIMITIVE_FIELDS = ("sm_clock_ghz", "barrier_ns", "l2_load_ns", "atomic_ns", "fence_sys_ns", "fence_release_sys_ns",
                    "timer_read_ns", "first_load_ns", "first_barrier_ns", "l2_load_sys_ns", "l2_load_volatile_ns",
                    "hbm_load_ns", "store16_volatile_ns", "store16_ns", "pause_ns", "flag_round_tight_ns",
                    "flag_round_pause_ns", "code_steps", "code_cold_ns", "code_l2_ns", "code_warm_ns", "code_jumps",
                    "code_jumps_first_ns", "code_jumps_second_ns", "args_reads", "args_dense_first_ns",
                    "args_dense_second_ns", "args_sparse_first_ns", "args_sparse_second_ns", "args_prefetch_ns",
                    "args_dense_prefetched_ns", "args_sparse_prefetched_ns", "drain_stores", "drain_none_ns",
                    "drain_stored_first_ns", "drain_stored_second_ns", "drain_fence_ns", "drain_fenced_ns")
PRIM_THREADS, PRIM_HOPS, PRIM_REPS, CHAIN_WORDS = 512, 1000, 1000, 16384
BIG_CHAIN_WORDS = 1 << 26  # 256 MB: five times an H200's L2
THREADS = 32
# workspace words (u32): [PING] the ping-pong flag and [SIGNAL] the signal flag, both written by the partner
PING, SIGNAL = 0, 64


def partner(rank: int, world: int) -> int | None:
    """The rank a rank exchanges flags with: 2i <-> 2i + 1; None for the last rank of an odd world larger than
    one. A lone rank (W = 1) is its own partner: it signals its own flag, so every method measures the launch and
    a local flag with no link (the floor of the W = 1 kernel budgets)."""
    if world == 1:
        return rank
    p = rank ^ 1
    return p if p < world else None


def plan(args) -> list[dict]:
    """The floor's measurements in order: the ping-pong, then per grid of --floor-blocks the signal and the
    empty graph."""
    out = [{"method": "pingpong", "rounds": args.floor_rounds}]
    for blocks in args.floor_blocks:
        out += [{"method": "signal_graph", "blocks": blocks, "layers": args.layers},
                {"method": "empty_graph", "blocks": blocks, "layers": args.layers}]
    return out + [{"method": "primitives", "blocks": 1}]


def record(meta: dict, pt: dict, **fields) -> dict:
    """A floor record: the metadata, the planned point and its measured fields (None where not measured),
    error None unless given."""
    empty = {"round_trip_us": None, "one_way_us": None, "per_kernel_us": None, "per_kernel_p99_us": None,
             "kernel_us": None, "gap_us": None, "blocks_launched": None, "error": None,
             **({f: None for f in PRIMITIVE_FIELDS} if pt.get("method") == "primitives" else {})}
    return {**meta, "kind": "floor", **{"rounds": None, "blocks": None, "layers": None}, **pt, **empty, **fields}


class Kernels:
    """The floor kernels of this device, loaded once (a failure to build raises: the caller records it)."""

    def __init__(self, dev):
        from runtime.kernels import CudaKernel, device_arch

        from .kernels import compile_source

        arch = device_arch(dev)
        if not arch.startswith("sm_"):
            raise RuntimeError(f"the floor kernels are CUDA source: no build for {arch}")
        image = compile_source(arch, FLOOR_KERNELS, "floor")
        self.all = tuple(CudaKernel(image, s) for s in SYMBOLS)
        self.pingpong, self.signal, self.empty, self.primitives, self.code, self.jumps, self.args, self.drain = self.all

    def close(self):
        for k in self.all:
            k.close()


def _max_over_ranks(v: float | None) -> float | None:
    """The largest of every rank's value; collective. None (on every rank) when any rank has none (kineto saw
    no kernel there)."""
    t = torch.tensor([0.0 if v is None else v, float(v is None)], dtype=torch.float64,
                     device="cuda" if on_gpu() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return None if float(t[1]) else float(t[0])


class Flags:
    """This rank's flag words and its partner's, in the runtime's IPC workspace; local counter and status."""

    def __init__(self, dev):
        from runtime import ipc

        rank, world = dist.get_rank(), dist.get_world_size()
        self.peer = partner(rank, world)
        self.buf, self.handle = ipc.allocate(4096, dev, dist.group.WORLD)
        self.mine = int(self.handle.buffer_ptrs[rank])
        self.theirs = int(self.handle.buffer_ptrs[self.peer if self.peer is not None else rank])
        self.counter = torch.zeros(1, dtype=torch.int32, device=dev)
        self.status = torch.zeros(1, dtype=torch.int32, device=dev)
        self.out = torch.zeros(2, dtype=torch.int64, device=dev)
        self.launches = 0

    def close(self):
        torch.cuda.synchronize()
        dist.barrier()  # the partner writes this rank's flags no more
        self.buf = None
        self.handle.close()


def measure_pingpong(kern: Kernels, flags: Flags, rounds: int, reps: int, timeout_ns: int) -> dict:
    """--reps ping-pong launches (after a barrier each); the slowest rank's median round trip."""
    rank = dist.get_rank()
    samples = []
    for _ in range(reps + 1):  # the first launch warms up
        base = flags.launches * (rounds + 2)
        flags.launches += 1
        torch.cuda.synchronize()
        dist.barrier()
        kern.pingpong.launch(1, THREADS, ctypes.c_uint64(flags.mine + 4 * PING), ctypes.c_uint64(flags.theirs + 4 * PING),
                             ctypes.c_int32(rounds), ctypes.c_int32(int(rank % 2 == 0)), ctypes.c_uint32(base),
                             ctypes.c_int64(timeout_ns), ctypes.c_uint64(flags.out.data_ptr()))
        ns, failed = (int(v) for v in flags.out.tolist())
        if failed:
            raise RuntimeError(f"ping-pong timed out at round {failed} of {rounds + 1} on rank {rank}")
        samples.append(ns / 1e3 / rounds)
    rt = _max_over_ranks(statistics.median(samples[1:]))
    return {"round_trip_us": rt, "one_way_us": rt / 2}


def measure_graph(kern: Kernels, flags: Flags, method: str, blocks: int, layers: int, reps: int,
                  timeout_ns: int) -> dict:
    """L signal (or empty) kernels captured in one graph: replay time / L and the kineto duration of the kernel
    and gap inside the replays (each the slowest rank's median)."""
    grid = blocks or torch.cuda.get_device_properties(flags.buf.device).multi_processor_count
    if method == "signal_graph":
        args = (ctypes.c_uint64(flags.mine + 4 * SIGNAL), ctypes.c_uint64(flags.theirs + 4 * SIGNAL),
                ctypes.c_uint64(flags.counter.data_ptr()), ctypes.c_int64(timeout_ns),
                ctypes.c_uint64(flags.status.data_ptr()))
        fn = lambda: kern.signal.launch(grid, THREADS, *args)  # noqa: E731
    else:
        fn = lambda: kern.empty.launch(grid, THREADS)  # noqa: E731
    warm_on_side_stream(fn)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(layers):
            fn()
    per_kernel = stats([ms / layers for ms in graphprof.replay_ms(g, reps)])
    events = [e for e in graphprof.graph_kernel_events(g, max(3, reps // 3), sync=dist.barrier) if "epg_floor" in e[0]]
    del g
    if int(flags.status.item()):
        raise RuntimeError(f"a signal kernel timed out on rank {dist.get_rank()}")
    summary = graphprof.summarize(graphprof.split_replays(events, layers))
    k = next(iter(summary["roles"].values()), None)
    return {"per_kernel_us": per_kernel[0] * 1e3, "per_kernel_p99_us": per_kernel[1] * 1e3,
            "kernel_us": _max_over_ranks(k["median_us"] if k else None),
            "gap_us": _max_over_ranks(summary["gap_us"]), "blocks_launched": grid}


def primitive_costs(out: list[int], hops: int, reps: int) -> dict:
    """The primitives kernel's out words -> the record's fields (module docstring)."""
    cycles, spin_ns, barriers, loads, atomics, fences, releases, reads = out[:8]
    return {"sm_clock_ghz": cycles / spin_ns if spin_ns else None, "barrier_ns": barriers / reps,
            "l2_load_ns": loads / hops, "atomic_ns": atomics / hops, "fence_sys_ns": fences / reps,
            "fence_release_sys_ns": releases / reps, "timer_read_ns": reads / reps, "first_load_ns": float(out[9]),
            "first_barrier_ns": float(out[10]), "l2_load_sys_ns": out[11] / hops, "l2_load_volatile_ns": out[12] / hops,
            "hbm_load_ns": out[13] / hops, "store16_volatile_ns": out[14] / reps, "store16_ns": out[15] / reps,
            "pause_ns": out[16] / reps, "flag_round_tight_ns": out[17] / hops if out[17] else None,
            "flag_round_pause_ns": out[18] / hops if out[18] else None}


def cycle(order: torch.Tensor) -> torch.Tensor:
    """int32 next-word table of one cycle visiting the words in `order` (a permutation): chain[order[i]] =
    order[i + 1], the last back to the first."""
    chain = torch.empty(order.numel(), dtype=torch.int32, device=order.device)
    chain[order] = torch.roll(order, -1).to(torch.int32)
    return chain


def measure_primitives(kern: Kernels, dev, reps: int) -> dict:
    """--reps launches of the primitives kernel (after an untimed one that also brings the chain into L2): every
    field the slowest rank's median. The chains: one cycle through CHAIN_WORDS words in a fixed random order, and
    one through BIG_CHAIN_WORDS (made on the device), entered at a different word each launch (its lines are not
    in L2 from the launch before)."""
    g = torch.Generator().manual_seed(7)
    chain = cycle(torch.randperm(CHAIN_WORDS, generator=g)).to(dev)
    big = cycle(torch.randperm(BIG_CHAIN_WORDS, device=dev))
    word = torch.zeros(4, dtype=torch.int32, device=dev)
    out = torch.zeros(19, dtype=torch.int64, device=dev)
    scratch = torch.zeros(4096 * 4, dtype=torch.int32, device=dev)
    samples = []
    for i in range(reps + 1):
        kern.primitives.launch(1, PRIM_THREADS, ctypes.c_uint64(chain.data_ptr()), ctypes.c_uint64(word.data_ptr()),
                               ctypes.c_int32(PRIM_HOPS), ctypes.c_int32(PRIM_REPS), ctypes.c_uint64(out.data_ptr()),
                               ctypes.c_uint64(big.data_ptr()), ctypes.c_uint32(i * 2654435761 % BIG_CHAIN_WORDS),
                               ctypes.c_uint64(scratch.data_ptr()))
        samples.append(primitive_costs([int(v) for v in out.tolist()], PRIM_HOPS, PRIM_REPS))
    code = {**code_costs(kern, dev, reps), **args_costs(kern, dev, reps), **drain_costs(kern, dev, reps)}
    got = {}
    for f in PRIMITIVE_FIELDS:
        if f in code:  # the code kernel's own medians
            got[f] = _max_over_ranks(code[f])
            continue
        vals = [s[f] for s in samples[1:] if s[f] is not None]
        got[f] = _max_over_ranks(statistics.median(vals) if vals else None)
    return {**got, "blocks_launched": 1}


def code_costs(kern: Kernels, dev, reps: int) -> dict:
    """The code kernel (epg_floor_code), --reps times: a launch after a 128 MB write (its code not in L2), then the
    same launch again (its code in L2 from the one before) -> code_cold_ns / code_l2_ns (first passes), code_warm_ns
    (second passes), medians (code_steps: the region's size)."""
    out = torch.zeros(3, dtype=torch.int64, device=dev)
    flush = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    cold, l2, warm = [], [], []
    for i in range(reps + 1):
        flush.fill_(i & 0xFF)
        for seen in (cold, l2):
            kern.code.launch(1, THREADS, ctypes.c_uint64(out.data_ptr()), ctypes.c_uint32(i))
            first, second, _ = (int(v) for v in out.tolist())
            if i:  # the first round brings the module in
                seen.append(float(first))
                warm.append(float(second))
    first, second = [], []
    for i in range(reps + 1):  # the branchy region (epg_floor_jumps), its code in L2 from the launch before
        kern.jumps.launch(1, THREADS, ctypes.c_uint64(out.data_ptr()), ctypes.c_uint32(i), ctypes.c_uint32(JUMP_SEL))
        a, b, _ = (int(v) for v in out.tolist())
        if i:
            first.append(float(a))
            second.append(float(b))
    return {"code_steps": float(CODE_STEPS), "code_cold_ns": statistics.median(cold),
            "code_l2_ns": statistics.median(l2), "code_warm_ns": statistics.median(warm),
            "code_jumps": float(JUMP_BLOCKS), "code_jumps_first_ns": statistics.median(first),
            "code_jumps_second_ns": statistics.median(second)}


def args_costs(kern: Kernels, dev, reps: int) -> dict:
    """The argument-read kernel (epg_floor_args), --reps times each way (after an untimed launch): without the
    prefetch (first and second passes over the dense and the sparse region) and with it (its own time, then the
    first passes) -> medians of the ns per region (args_reads: the reads in each region)."""
    out = torch.zeros(6, dtype=torch.int64, device=dev)
    block = (ctypes.c_uint64 * ARGS_WORDS)(*((i * 2654435761) & 0xFFFFFFFF for i in range(ARGS_WORDS)))
    seen: dict[str, list[float]] = {f: [] for f in ARGS_FIELDS}
    for i in range(reps + 1):
        for warm in (0, 1):
            kern.args.launch(1, THREADS, ctypes.c_uint64(out.data_ptr()), ctypes.c_uint32(i), ctypes.c_uint32(warm),
                             block)
            dense0, sparse0, dense1, sparse1, prefetch, _ = (float(v) for v in out.tolist())
            if not i:
                continue
            if warm:
                seen["args_prefetch_ns"].append(prefetch)
                seen["args_dense_prefetched_ns"].append(dense0)
                seen["args_sparse_prefetched_ns"].append(sparse0)
            else:
                for f, v in zip(ARGS_FIELDS[:4], (dense0, dense1, sparse0, sparse1)):
                    seen[f].append(v)
    return {"args_reads": float(ARGS_READS), **{f: statistics.median(v) for f, v in seen.items()}}


def drain_costs(kern: Kernels, dev, reps: int) -> dict:
    """The drain kernel (epg_floor_drain), --reps times each mode (after an untimed round): its shared-memory step
    with no stores before it (drain_none_ns), right after DRAIN_STORES stores a thread (first and second pass), and
    after those stores and a fence (the fence's own time, then the step) -> medians, ns."""
    out = torch.zeros(4, dtype=torch.int64, device=dev)
    scratch = torch.zeros(DRAIN_STORES * DRAIN_THREADS * 16, dtype=torch.int32, device=dev)  # a 64-byte line a store
    seen: dict[str, list[float]] = {f: [] for f in DRAIN_FIELDS}
    for i in range(reps + 1):
        for mode in (0, 1, 2):
            kern.drain.launch(1, DRAIN_THREADS, ctypes.c_uint64(out.data_ptr()), ctypes.c_uint64(scratch.data_ptr()),
                              ctypes.c_int32(DRAIN_STORES), ctypes.c_int32(mode), ctypes.c_uint32(i))
            first, second, fence, _ = (float(v) for v in out.tolist())
            if not i:
                continue
            if mode == 0:
                seen["drain_none_ns"].append(first)
            elif mode == 1:
                seen["drain_stored_first_ns"].append(first)
                seen["drain_stored_second_ns"].append(second)
            else:
                seen["drain_fence_ns"].append(fence)
                seen["drain_fenced_ns"].append(first)
    return {"drain_stores": float(DRAIN_STORES), **{f: statistics.median(v) for f, v in seen.items()}}


DRAIN_FIELDS = ("drain_none_ns", "drain_stored_first_ns", "drain_stored_second_ns", "drain_fence_ns", "drain_fenced_ns")
ARGS_FIELDS = ("args_dense_first_ns", "args_dense_second_ns", "args_sparse_first_ns", "args_sparse_second_ns",
               "args_prefetch_ns", "args_dense_prefetched_ns", "args_sparse_prefetched_ns")


def run(args, emit=lambda recs: None) -> list[dict]:
    """The floor (module docstring); collective; each record handed to emit() as it is made."""
    dev = torch.device("cuda", torch.cuda.current_device())
    meta = {**records.meta(dev), "partner": "rank ^ 1 (ranks 2i and 2i + 1)", "threads": THREADS,
            "buffers": "runtime.ipc workspace (cudaMalloc + CUDA IPC, peer pointers)"}
    timeout_ns = int(args.floor_timeout_s * 1e9)
    made: list[dict] = []

    def add(rec):
        made.append(rec)
        emit([rec])

    points = plan(args)
    if dist.get_world_size() % 2 and dist.get_world_size() > 1:
        for pt in points:
            add(record(meta, pt, error=f"world_size={dist.get_world_size()}: the floor pairs ranks 2i and 2i + 1"))
        return made
    kern, why = collective_try(lambda: Kernels(dev))
    if kern is None:
        for pt in points:
            add(record(meta, pt, error=why))
        return made
    flags = Flags(dev)
    try:
        for pt in points:
            if pt["method"] == "pingpong":
                got, why = collective_try(lambda: measure_pingpong(kern, flags, pt["rounds"], args.reps, timeout_ns))
            elif pt["method"] == "primitives":
                got, why = collective_try(lambda: measure_primitives(kern, dev, args.reps))
            else:
                got, why = collective_try(lambda: measure_graph(kern, flags, pt["method"], pt["blocks"], pt["layers"],
                                                                args.reps, timeout_ns))
            add(record(meta, pt, **(got or {}), error=why))
    finally:
        flags.close()
        kern.close()
    return made


def floor_table(records: list[dict]) -> list[str]:
    """The floor's table: one line per method (and grid), the latest record of each."""
    out = ["| method | blocks | round trip µs | one way µs | per kernel (replay / L) µs | kernel in graph µs "
           "| gap µs |", "|---|---|---|---|---|---|---|"]
    key = lambda r: (METHODS.index(r["method"]) if r["method"] in METHODS else 9, r.get("blocks") or 0)  # noqa: E731
    prims = []
    for r in latest(records, "floor", key):
        if r["method"] == "primitives":
            prims.append(r)
            continue
        if r.get("error"):
            out.append(f"| {r['method']} | {md_cell(r.get('blocks'), 'd')} | failed: {r['error']} "
                       f"| – | – | – | – |")
            continue
        out.append(f"| {r['method']} | {md_cell(r.get('blocks_launched') or r.get('blocks'), 'd')} "
                   f"| {md_cell(r['round_trip_us'], '.2f')} | {md_cell(r['one_way_us'], '.2f')} "
                   f"| {md_cell(r['per_kernel_us'], '.2f')} | {md_cell(r['kernel_us'], '.2f')} "
                   f"| {md_cell(r['gap_us'], '.2f')} |")
    for r in prims:  # a kernel's own steps, on this device
        out += ["", "| SM clock GHz | block barrier ns | L2 load ns | atomic add ns | store + fence.sc.sys ns "
                "| store + fence.acq_rel.sys ns | timer read ns | a launch's first load ns | its first barrier ns "
                "| L2 load, relaxed.sys ns | L2 load, volatile ns | HBM load ns | 16 B store, volatile ns "
                "| 16 B store ns | pause ns | flag round, tight ns | flag round, paused ns | code steps "
                "| code, first pass, L2 flushed ns | code, first pass ns | code, second pass ns | branchy blocks "
                "| branchy code, first pass ns | branchy code, second pass ns | argument reads a region "
                "| dense arguments, first pass ns | dense, second pass ns | sparse arguments, first pass ns "
                "| sparse, second pass ns | argument lines prefetched ns | dense after it ns | sparse after it ns "
                "| stores a thread | block step, no stores ns | after stores, first pass ns | second pass ns "
                "| fence after stores ns | block step after the fence ns |",
                "|" + "---|" * len(PRIMITIVE_FIELDS)]
        if r.get("error"):
            out.append(f"| failed: {r['error']} |" + " – |" * (len(PRIMITIVE_FIELDS) - 1))
        else:
            out.append("| " + " | ".join(md_cell(r.get(f), ".2f" if f == "sm_clock_ghz" else ".0f")
                                         for f in PRIMITIVE_FIELDS) + " |")
    return out
