// dispatch_direct's histograms in isolation (scripts/hist_probe.py builds this file for sm_90a and runs it).
//
// Every kernel does what dispatch_direct's step 1 does on its launch geometry: block b of G owns the tokens
// [b T / G, (b + 1) T / G) and needs, per bucket (an expert id, then one per rank counting the tokens with a pair
// there), the count over the tokens before its range (pre) and over all tokens (tot). It writes both to
// pre[b][B] and tot[b][B], which the script checks against torch. The forms differ only in how they count:
//   hp_atomic      every block counts every token, one shared atomic per id (main's form: the next token's ids
//                  loaded while this one's are counted, the ids counted branch-free)
//   hp_replicaR    the same with R copies of each counter, a lane counting in copy lane % R (counter e's copies
//                  side by side, so a warp's lanes spread over more banks), the copies summed at the end
//   hp_clusterC    a cluster of C blocks shares the counting: each counts its own range, and 1 / C of the tokens
//                  outside the cluster's range; after a cluster barrier each block sums its cluster's histograms
//                  through distributed shared memory
#include <cooperative_groups.h>

namespace cg = cooperative_groups;

constexpr int HP_MAX_BUCKETS = 320;  // experts + ranks at most (the script refuses more)

struct HpArgs {
  const int* idx;  // [T][K] expert ids
  int* pre;        // [G][B]
  int* tot;        // [G][B]
  int T, K, experts, per_rank, world;
  unsigned rank_magic;  // ceil(2^32 / per_rank): an id's rank as a multiply-high (dispatch_direct's EpgDiv)
};

__device__ __forceinline__ int hp_rank(const HpArgs& a, unsigned e) {
  if (a.per_rank == 1) return (int)e;  // (2^32 has no 32-bit magic)
  unsigned q = __umulhi(e, a.rank_magic);
  if (q * (unsigned)a.per_rank > e) --q;  // (exact below 2^16 ids; kept as the kernel's divider keeps it)
  return (int)q;
}

// Ids [j0, j0 + 8) of token t (-1 past top-k, or all -1 where the token is not `valid`), every load issued first.
__device__ __forceinline__ void hp_ids(const int* idx, long t, bool valid, int K, int j0, int (&e)[8]) {
#pragma unroll
  for (int q = 0; q < 8; ++q) e[q] = valid && j0 + q < K ? idx[t * K + j0 + q] : -1;
}

// Token t's ids (the first eight from `first`, loaded already) counted into h at stride `copies` (copy c), its ranks
// into the rank buckets after the experts'. Ids naming no expert count in the spare bucket B.
__device__ __forceinline__ void hp_token(const HpArgs& a, int* h, int copies, int c, long t, int (&first)[8]) {
  const int B = a.experts + a.world;
  unsigned long long ranks = 0;
  int e[8];
#pragma unroll
  for (int q = 0; q < 8; ++q) e[q] = first[q];
  for (int j0 = 0; j0 < a.K; j0 += 8) {
    if (j0) hp_ids(a.idx, t, true, a.K, j0, e);
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const bool ok = (unsigned)e[q] < (unsigned)a.experts;
      atomicAdd(&h[(ok ? e[q] : B) * copies + c], 1);
      ranks |= (unsigned long long)ok << hp_rank(a, ok ? (unsigned)e[q] : 0u);
    }
  }
  for (int r = 0; ranks; ++r, ranks >>= 1)
    if (ranks & 1ull) atomicAdd(&h[(a.experts + r) * copies + c], 1);
}

// Steps u = start, start + step, ... below end, each counting token tok(u) into lo (tok(u) < split) or hi, the next
// step's first ids in flight while this one's are counted.
template <class Tok>
__device__ __forceinline__ void hp_count(const HpArgs& a, int* lo, int* hi, int copies, int c, long start, long step,
                                         long end, long split, Tok tok) {
  int nx[8];
  hp_ids(a.idx, tok(start), start < end, a.K, 0, nx);
  for (long u = start; u < end; u += step) {
    int first[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) first[q] = nx[q];
    hp_ids(a.idx, tok(u + step), u + step < end, a.K, 0, nx);
    const long t = tok(u);
    hp_token(a, t < split ? lo : hi, copies, c, t, first);
  }
}

struct HpSame {  // the steps are the tokens themselves
  __device__ __forceinline__ long operator()(long u) const { return u; }
};

template <int R>
__device__ void hp_replicated(const HpArgs& a) {
  __shared__ int hb[(HP_MAX_BUCKETS + 1) * R], ht[(HP_MAX_BUCKETS + 1) * R];
  const int B = a.experts + a.world, tid = threadIdx.x, nt = blockDim.x, G = gridDim.x, b = blockIdx.x;
  const long t0 = (long)b * a.T / G;
  for (int i = tid; i < (B + 1) * R; i += nt) hb[i] = ht[i] = 0;
  __syncthreads();
  hp_count(a, hb, ht, R, (tid & 31) % R, tid, nt, a.T, t0, HpSame());
  __syncthreads();
  for (int i = tid; i < B; i += nt) {
    int p = 0, s = 0;
#pragma unroll
    for (int c = 0; c < R; ++c) p += hb[i * R + c], s += ht[i * R + c];
    a.pre[(long)b * B + i] = p;
    a.tot[(long)b * B + i] = p + s;
  }
}

extern "C" __global__ void __launch_bounds__(512) hp_atomic(HpArgs a) { hp_replicated<1>(a); }
extern "C" __global__ void __launch_bounds__(512) hp_replica4(HpArgs a) { hp_replicated<4>(a); }
extern "C" __global__ void __launch_bounds__(512) hp_replica8(HpArgs a) { hp_replicated<8>(a); }
extern "C" __global__ void __launch_bounds__(512) hp_replica16(HpArgs a) { hp_replicated<16>(a); }

template <int C>
__device__ void hp_clustered(const HpArgs& a) {
  // [0]: tokens before the cluster's range (this block's share), [1]: after it (its share), [2]: this block's own range
  __shared__ int h[3][HP_MAX_BUCKETS + 1];
  cg::cluster_group cluster = cg::this_cluster();
  const int B = a.experts + a.world, tid = threadIdx.x, nt = blockDim.x, G = gridDim.x, b = blockIdx.x;
  const int cr = (int)cluster.block_rank(), b0 = b - cr;
  const long t0 = (long)b * a.T / G, t1 = (long)(b + 1) * a.T / G;
  const long c0 = (long)b0 * a.T / G, c1 = (long)(b0 + C) * a.T / G;  // the cluster's range
  for (int i = tid; i < 3 * (HP_MAX_BUCKETS + 1); i += nt) (&h[0][0])[i] = 0;
  __syncthreads();
  // the tokens outside [c0, c1) in C shares (step u over them: token u before the range, c1 + u - c0 after it),
  // then its own range
  hp_count(a, h[0], h[1], 1, 0, (long)cr * nt + tid, (long)C * nt, a.T - (c1 - c0), c0,
           [=](long u) { return u < c0 ? u : c1 + u - c0; });
  hp_count(a, h[2], h[2], 1, 0, t0 + tid, nt, t1, t1, HpSame());
  cluster.sync();  // every block's histograms complete and visible to the cluster
  for (int i = tid; i < B; i += nt) {
    int p = 0, s = 0;
#pragma unroll
    for (int j = 0; j < C; ++j) {
      const int* hj = cluster.map_shared_rank(&h[0][0], j);
      const int before = hj[i], after = hj[(HP_MAX_BUCKETS + 1) + i], own = hj[2 * (HP_MAX_BUCKETS + 1) + i];
      p += before + (j < cr ? own : 0);
      s += after + (j >= cr ? own : 0);
    }
    a.pre[(long)b * B + i] = p;
    a.tot[(long)b * B + i] = p + s;
  }
  cluster.sync();  // no block leaves while another reads its shared memory
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(512) hp_cluster2(HpArgs a) {
  hp_clustered<2>(a);
}
extern "C" __global__ void __cluster_dims__(4, 1, 1) __launch_bounds__(512) hp_cluster4(HpArgs a) {
  hp_clustered<4>(a);
}
