// The epilogue of the fused sm90 GEMMs of the sharded cross-entropy (sharded_ce_fused.cu): a
// CUTLASS operator-style epilogue run by the consumer warpgroups on the fp32 accumulators of a
// logits tile in registers. Each thread holds R row slots x J columns of them (checked on the host
// by tests/native/fused_layout_check.cu), and the four threads of a quad (lanes 4k..4k+3) hold the
// same rows, so a row's statistics over the tile need two shuffles.
//   forward:  the tile's per-row partial statistics (max, sum of exp(z - max), logit sum, count
//             above the reference) over its columns but the target, and the target's cosine;
//   backward: the tile's dlogits in x's dtype, written into the chunk buffer G (16-byte stores of
//             8 columns in full tiles, the quad's pairs exchanged by shuffles).
// Included by sharded_ce_fused.cu only (device code of a build with CUTLASS).
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/grid_dependency_control.h>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/epilogue/dispatch_policy.hpp>

#include "sharded_ce_common.h"
#include "sharded_ce_fused.h"
#include "sharded_ce_fused_tile.cuh"

namespace shardkit {
namespace sce {
namespace fused {
namespace {

using namespace cute;

using namespace cute;

// The target logit from the cosine c (margin applied; the plain logit without normalization),
// as the unfused kernels compute it (scaled_logit: the product rounded on its own).
__device__ __forceinline__ float target_logit(const EpiParams& p, float c, float* dpsi) {
  if (!p.normalize) {
    *dpsi = 1.f;
    return __fmul_rn(p.scale, c);
  }
  float psi;
  margin_psi<float>(c, p.plain, p.m1, p.m2, p.m3, p.c_max, &psi, dpsi);
  return __fmul_rn(p.scale, psi);
}

__device__ __forceinline__ void store_one(cutlass::bfloat16_t* g, float v) {
  *reinterpret_cast<__nv_bfloat16*>(g) = __float2bfloat16_rn(v);
}
__device__ __forceinline__ void store_one(cutlass::half_t* g, float v) {
  *reinterpret_cast<__half*>(g) = __float2half_rn(v);
}
__device__ __forceinline__ void store_two(cutlass::bfloat16_t* g, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(g) = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void store_two(cutlass::half_t* g, float a, float b) {
  *reinterpret_cast<__half2*>(g) = __floats2half2_rn(a, b);
}
// Two values rounded to the element type, packed as stored (a at the lower address).
__device__ __forceinline__ uint32_t pack_two(cutlass::bfloat16_t*, float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack_two(cutlass::half_t*, float a, float b) {
  const __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}
// A 4 x 4 transpose across the four lanes of a quad: on entry lane q holds w[k] = word q of
// block k, on return w[k] = word k of block q (two butterfly rounds of shuffles).
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int q) {
  const bool odd = q & 1, high = q & 2;
#pragma unroll
  for (int a = 0; a < 4; a += 2) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? w[a] : w[a + 1], 1);
    if (odd)
      w[a] = got;
    else
      w[a + 1] = got;
  }
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, high ? w[a] : w[a + 2], 2);
    if (high)
      w[a] = got;
    else
      w[a + 2] = got;
  }
}

// The epilogue (an operator-style CUTLASS epilogue, run by the consumer warpgroups through
// Sm90TmaWarpSpecializedAdapter): kBackward false writes the tile's row partials, true its
// dlogits.
template <bool kBackward, class Elem>
class SceEpilogue {
 public:
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementC = float;
  using ElementD = float;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  struct ThreadEpilogueOp {};
  struct SharedStorage {
    float rw[kTileN];  // the tile's column scales (normalize)
  };
  using TensorStorage = SharedStorage;
  struct Arguments {
    EpiParams p;
  };
  using Params = Arguments;

  template <class PS>
  static constexpr Params to_underlying_arguments(PS const&, Arguments const& a, void*) {
    return a;
  }
  template <class PS>
  static size_t get_workspace_size(PS const&, Arguments const&) {
    return 0;
  }
  template <class PS>
  static cutlass::Status initialize_workspace(PS const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class PS>
  static bool can_implement(PS const&, Arguments const&) {
    return true;
  }

  CUTLASS_HOST_DEVICE SceEpilogue(Params const& params, SharedStorage const& = SharedStorage())
      : a_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem, BlockShapeMNK, BlockCoordMNKL blk,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char* smem) {
    constexpr int kBM = decltype(size<0>(BlockShapeMNK{}))::value;
    constexpr int kBN = decltype(size<1>(BlockShapeMNK{}))::value;
    constexpr int kThreads = decltype(size(TiledMma{}))::value;  // 256 cooperative, 128 ping-pong
    static_assert(kBN <= kTileN && kBN % kThreads == 0,
                  "the tile's columns fit the column scales and spread evenly over the consumer threads");
    // Launched as a programmatic dependent of the previous kernel (SHARDKIT_FUSED_PDL=1), the
    // kernel's producer waits for it before its loads; the consumers' reads and writes here
    // follow those loads, and this wait (free once resolved) makes their order explicit.
    cutlass::arch::wait_on_dependent_grids();
    const EpiParams& p = a_.p;
    const int M = static_cast<int>(get<0>(problem)), N = static_cast<int>(get<1>(problem));
    const int row0 = static_cast<int>(get<0>(blk)) * kBM, col0 = static_cast<int>(get<1>(blk)) * kBN;
    const int left = N - col0;  // columns of this tile inside the chunk
    auto thr = tiled_mma.get_thread_slice(thread_idx);
    Tensor crd = thr.partition_C(make_identity_tensor(make_shape(Int<kBM>{}, Int<kBN>{})));
    // Writable: the adapter hands this epilogue its own copy of the accumulators, which the passes
    // below overwrite with the cosines.
    Tensor acc = make_tensor(const_cast<float*>(&accumulators(0)), rowcol(accumulators.layout()));
    Tensor pos = make_tensor(crd.data(), rowcol(crd.layout()));
    // The tile's column scales 1 / |w_j| through shared memory (normalize only): one load per
    // thread instead of one per column and thread. The first barrier waits for the previous
    // tile's readers.
    float* srw = reinterpret_cast<SharedStorage*>(smem)->rw;
    if (p.rw) {
      // (Ping-pong: the kernel runs the two warpgroups' epilogues one after the other.)
      cutlass::arch::NamedBarrier::sync(kThreads, 0);
#pragma unroll
      for (int c = thread_idx; c < kBN; c += kThreads) srw[c] = c < left ? p.rw[col0 + c] : 0.f;
      cutlass::arch::NamedBarrier::sync(kThreads, 0);
    }
    Rows<decltype(size<0>(acc))::value> rows;
#pragma unroll
    for (int ri = 0; ri < rows.kR; ++ri) {
      rows.row[ri] = row0 + get<0>(pos(ri, 0));
      rows.live[ri] = rows.row[ri] < M;
      const int64_t t = rows.live[ri] ? p.labels[rows.row[ri]] - p.label_shift - col0 : -1;
      rows.tcol[ri] = t >= 0 && t < kBN ? static_cast<int>(t) : -1;
    }
    // Full tiles (all but a chunk's last column tile and the last row tile) check no column or row.
    // (The forward's row partials: one per tile of kBN columns, tile_n of `tiles`.)
    const int tile_n = static_cast<int>(get<1>(blk));
    const int tiles = static_cast<int>((static_cast<int64_t>(N) + kBN - 1) / kBN);
    if (left >= kBN && row0 + kBM <= M) {
      tile<true>(p, acc, pos, srw, rows, left, col0, tile_n, tiles);
    } else {
      tile<false>(p, acc, pos, srw, rows, left, col0, tile_n, tiles);
    }
  }

 private:
  template <int R>
  struct Rows {
    static constexpr int kR = R;
    int row[R], tcol[R];  // tcol: the target's column in the tile, -1 if elsewhere
    bool live[R];
  };

  static constexpr float kLog2e = 1.4426950408889634f;

  // True when a row of this warp has its target column in the tile (the same in every lane).
  template <class RowsT>
  CUTLASS_DEVICE static bool any_target(RowsT const& rows) {
    bool t = false;
#pragma unroll
    for (int ri = 0; ri < RowsT::kR; ++ri) t |= rows.tcol[ri] >= 0;
    return __any_sync(0xffffffffu, t);
  }

  // 2^v (flushing subnormals: the terms below 2^-126 of a softmax sum are lost in its rounding).
  CUTLASS_DEVICE static float ex2(float v) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
  }

  // One tile, without branches per element: columns past the chunk and rows past the batch (kFull
  // false) and the target column are masked by selects; the target's cosine is kept in a register
  // and stored once.
  template <bool kFull, class Acc, class Pos, class RowsT>
  CUTLASS_DEVICE void tile(const EpiParams& p, Acc& acc, Pos const& pos, const float* srw, RowsT const& rows,
                           int left, int col0, int tile_n, int tiles) {
    constexpr int R = RowsT::kR;
    constexpr int J = decltype(size<1>(acc))::value;
    static_assert(J % 2 == 0, "columns come in adjacent pairs");
    float cts[R];
    bool has_t[R];
#pragma unroll
    for (int ri = 0; ri < R; ++ri) {
      cts[ri] = 0.f;
      has_t[ri] = false;
    }
    if constexpr (kBackward) {
      // (A short form of this epilogue for tiles without a target, like the forward's, measured
      // no faster on an H200: benchmarks/RESULTS.md.)
      dlogits<kFull>(p, acc, pos, srw, rows, left, col0, cts, has_t);
    } else {
      // The reference logits of the count, loaded before pass 1, used after it.
      float ref[R];
#pragma unroll
      for (int ri = 0; ri < R; ++ri) ref[ri] = p.tref && rows.live[ri] ? p.tref[rows.row[ri]] : INFINITY;
      // Full tiles whose warp holds no target column skip the target's bookkeeping (nearly all
      // tiles at large C); where also every row maximum of the warp is finite, pass 2 needs no
      // guard against infinities either.
      float mx[R], s[R], zs[R];
      int cnt[R];
      if constexpr (kFull) {
        const bool no_t = !any_target(rows);
        if (no_t) {
          pass1<true, true>(p, acc, pos, srw, rows, left, cts, has_t, mx);
        } else {
          pass1<true, false>(p, acc, pos, srw, rows, left, cts, has_t, mx);
        }
        bool finite = true;
#pragma unroll
        for (int ri = 0; ri < R; ++ri) finite &= isfinite(mx[ri]);
        if (__all_sync(0xffffffffu, finite && no_t)) {
          if (p.tref) {
            pass2<true, true, true>(acc, pos, rows, left, ref, mx, s, zs, cnt);
          } else {
            pass2<true, true, false>(acc, pos, rows, left, ref, mx, s, zs, cnt);
          }
        } else {
          pass2<true, false, true>(acc, pos, rows, left, ref, mx, s, zs, cnt);
        }
      } else {
        pass1<false, false>(p, acc, pos, srw, rows, left, cts, has_t, mx);
        pass2<false, false, true>(acc, pos, rows, left, ref, mx, s, zs, cnt);
      }
      const bool lead = (threadIdx.x & 3) == 0;
#pragma unroll
      for (int ri = 0; ri < R; ++ri) {
#pragma unroll
        for (int o = 1; o <= 2; o *= 2) {
          s[ri] += __shfl_xor_sync(0xffffffffu, s[ri], o);
          zs[ri] += __shfl_xor_sync(0xffffffffu, zs[ri], o);
          cnt[ri] += __shfl_xor_sync(0xffffffffu, cnt[ri], o);
        }
        if (lead && rows.live[ri]) {
          const int64_t k = static_cast<int64_t>(rows.row[ri]) * tiles + tile_n;
          p.part_m[k] = mx[ri];
          p.part_s[k] = s[ri];
          p.part_z[k] = zs[ri];
          p.part_c[k] = cnt[ri];
        }
      }
    }
#pragma unroll
    for (int ri = 0; ri < R; ++ri)
      if (has_t[ri] && rows.live[ri]) p.ct[rows.row[ri]] = cts[ri];  // one thread of one tile
  }

  // Forward pass 1: the logits into the accumulators and the row maxima over the tile's columns
  // but the target (fmaxf skips NaN, as the unfused max does), reduced over the quad; the
  // target's cosine kept (kNoTarget: no row of the warp has its target here).
  template <bool kFull, bool kNoTarget, class Acc, class Pos, class RowsT>
  CUTLASS_DEVICE static void pass1(const EpiParams& p, Acc& acc, Pos const& pos, const float* srw,
                                   RowsT const& rows, int left, float (&cts)[RowsT::kR],
                                   bool (&has_t)[RowsT::kR], float (&mx)[RowsT::kR]) {
    constexpr int R = RowsT::kR;
    constexpr int J = decltype(size<1>(acc))::value;
    const bool scaled = p.rw != nullptr;
#pragma unroll
    for (int ri = 0; ri < R; ++ri) mx[ri] = -INFINITY;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int lc = get<1>(pos(0, j));
      const bool ok = kFull || lc < left;
      const float r = scaled ? srw[lc] : 1.f;
#pragma unroll
      for (int ri = 0; ri < R; ++ri) {
        const float c = acc(ri, j) * r, z = __fmul_rn(p.scale, c);
        acc(ri, j) = z;
        if constexpr (kNoTarget) {
          mx[ri] = fmaxf(mx[ri], z);
        } else {
          const bool is_t = lc == rows.tcol[ri];
          cts[ri] = is_t ? c : cts[ri];
          has_t[ri] |= is_t;
          mx[ri] = fmaxf(mx[ri], ok && !is_t ? z : -INFINITY);
        }
      }
    }
#pragma unroll
    for (int ri = 0; ri < R; ++ri) {
      mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 1));
      mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 2));
    }
  }

  // Forward pass 2: sum of exp(z - max) and logit sum over the columns of pass 1, and the count
  // of the plain logits above the reference over all of them (the target's too; kCount false:
  // no reference, no count). General form: -inf adds nothing, z == max adds exactly 1 (also
  // for a +inf maximum). kFast (full tile, no target in the warp, finite maxima): one FMA and
  // one exp2 per element, no masks.
  template <bool kFull, bool kFast, bool kCount, class Acc, class Pos, class RowsT>
  CUTLASS_DEVICE static void pass2(Acc const& acc, Pos const& pos, RowsT const& rows, int left,
                                   const float (&ref)[RowsT::kR], const float (&mx)[RowsT::kR],
                                   float (&s)[RowsT::kR], float (&zs)[RowsT::kR], int (&cnt)[RowsT::kR]) {
    constexpr int R = RowsT::kR;
    constexpr int J = decltype(size<1>(acc))::value;
    float nmxl[R];
#pragma unroll
    for (int ri = 0; ri < R; ++ri) {
      s[ri] = 0.f;
      zs[ri] = 0.f;
      cnt[ri] = 0;
      nmxl[ri] = -(mx[ri] * kLog2e);
    }
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int lc = get<1>(pos(0, j));
      const bool ok = kFull || lc < left;
#pragma unroll
      for (int ri = 0; ri < R; ++ri) {
        const float z = acc(ri, j);
        if constexpr (kCount) cnt[ri] += ok && z > ref[ri] ? 1 : 0;
        if constexpr (kFast) {
          s[ri] += ex2(fmaf(z, kLog2e, nmxl[ri]));
          zs[ri] += z;
        } else {
          const bool use = ok && lc != rows.tcol[ri];
          const float e = z == mx[ri] ? 1.f : ex2(fmaf(z, kLog2e, nmxl[ri]));
          zs[ri] += use ? z : 0.f;
          s[ri] += use && z != -INFINITY ? e : 0.f;
        }
      }
    }
  }

  // The backward's dlogits of one tile into G: every column as a plain one, the target column's
  // cosine kept for fix_target_kernel, masks where the tile is partial.
  template <bool kFull, class Acc, class Pos, class RowsT>
  CUTLASS_DEVICE void dlogits(const EpiParams& p, Acc& acc, Pos const& pos, const float* srw,
                              RowsT const& rows, int left, int col0, float (&cts)[RowsT::kR],
                              bool (&has_t)[RowsT::kR]) {
    constexpr int R = RowsT::kR;
    constexpr int J = decltype(size<1>(acc))::value;
    const bool scaled = p.rw != nullptr;
    Elem* G = static_cast<Elem*>(p.g);
    const bool pairs = p.ldg % 2 == 0 && (reinterpret_cast<uintptr_t>(G) & 3) == 0;
    // Full tiles of a 16-byte aligned G whose rows hold a multiple of 8 elements: each quad
    // exchanges its column pairs so that every thread stores 8 adjacent columns at once.
    const bool wide = kFull && p.ldg % 8 == 0 && (reinterpret_cast<uintptr_t>(G) & 15) == 0;
    const int q = threadIdx.x & 3;
    float lsel[R], gl[R], gs[R];
#pragma unroll
    for (int ri = 0; ri < R; ++ri) {
      const int r = rows.live[ri] ? rows.row[ri] : 0;
      lsel[ri] = p.lse[r] * kLog2e;
      gl[ri] = p.gl[r];
      gs[ri] = p.gs[r];
    }
    static_assert(J % 8 == 0, "columns come in blocks of 8 per quad");
#pragma unroll
    for (int j8 = 0; j8 < J; j8 += 8) {
      uint32_t words[R][4];  // this thread's pairs of 4 blocks of 8 columns, per row slot
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        const int j = j8 + 2 * h;
        const int lc = get<1>(pos(0, j));  // columns lc and lc + 1
        const bool ok0 = kFull || lc < left, ok1 = kFull || lc + 1 < left;
        const float r0 = scaled ? srw[lc] : 1.f, r1 = scaled ? srw[lc + 1] : 1.f;
        const float q0 = p.g_times_r ? r0 : 1.f, q1 = p.g_times_r ? r1 : 1.f;
#pragma unroll
        for (int ri = 0; ri < R; ++ri) {
          // Every column as a plain one; fix_target_kernel rewrites the target's entry from its
          // cosine (the margin needs double-precision cos / acos, whose slow path is a call,
          // which would serialize the warpgroup MMAs of this kernel).
          const float c0 = acc(ri, j) * r0, c1 = acc(ri, j + 1) * r1;
          cts[ri] = lc == rows.tcol[ri] ? c0 : (lc + 1 == rows.tcol[ri] ? c1 : cts[ri]);
          has_t[ri] |= lc == rows.tcol[ri] || lc + 1 == rows.tcol[ri];
          const float z0 = __fmul_rn(p.scale, c0), z1 = __fmul_rn(p.scale, c1);
          const float g0 = p.scale * (gl[ri] * ex2(fmaf(z0, kLog2e, -lsel[ri])) + gs[ri]) * q0;
          const float g1 = p.scale * (gl[ri] * ex2(fmaf(z1, kLog2e, -lsel[ri])) + gs[ri]) * q1;
          if (wide) {
            words[ri][h] = pack_two(G, g0, g1);
            continue;
          }
          if (!kFull && !rows.live[ri]) continue;
          Elem* out = G + static_cast<int64_t>(rows.row[ri]) * p.ldg + col0 + lc;
          if (kFull && pairs) {
            store_two(out, g0, g1);
          } else {
            if (ok0) store_one(out, g0);
            if (ok1) store_one(out + 1, g1);
          }
        }
      }
      if (wide) {
        // This thread's own columns of block j8 / 2 start at 8 (j8 / 2) + 2q (checked by
        // tests/native/fused_layout_check.cu); after the exchange it holds block j8 / 2 + q.
        const int lc = get<1>(pos(0, j8)) + 6 * q;
#pragma unroll
        for (int ri = 0; ri < R; ++ri) {
          quad_transpose(words[ri], q);
          *reinterpret_cast<uint4*>(G + static_cast<int64_t>(rows.row[ri]) * p.ldg + col0 + lc) =
              make_uint4(words[ri][0], words[ri][1], words[ri][2], words[ri][3]);
        }
      }
    }
  }

  Params a_;
};

}  // namespace
}  // namespace fused
}  // namespace sce
}  // namespace shardkit
