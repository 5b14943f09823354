// Device asserts are calls, and a call in the GEMM kernel serializes its warpgroup MMAs: this
// file is built as a release build whatever the flags (before any header brings <cassert>).
#ifndef NDEBUG
#define NDEBUG
#endif
// The fused sm90 kernels of the sharded cross-entropy (see sharded_ce_fused.h): a persistent
// CUTLASS GEMM (CUTLASS 4.2's 3.x API: TMA loads, warpgroup MMA; cooperative, two consumer
// warpgroups on a [128, 256, 64] tile, the default; or ping-pong, one per [64, 256, 64] tile;
// or ping-pong on [128, 128, 64] tiles, the "square" ones) whose epilogue is ours. The
// epilogue receives the fp32 accumulators of the tile in registers; each thread holds R row
// slots x J columns of them (checked on the host by tests/native/fused_layout_check.cu), and
// the four threads of a quad (lanes 4k..4k+3) hold the same rows, so a row's statistics over
// the tile need two shuffles.
#include "sharded_ce_fused.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "env_flag.h"
#include "sharded_ce_common.h"
#include "sharded_ce_device.cuh"

#ifdef SHARDKIT_WITH_CUTLASS
#include <cutlass/arch/barrier.h>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/epilogue/dispatch_policy.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "sharded_ce_fused_tile.cuh"
#endif

namespace shardkit {
namespace sce {
namespace fused {

bool enabled() {
  return env_flag("SHARDKIT_FUSED", true, "the fused kernels run where they apply");
}

// SHARDKIT_FUSED_FORWARD_TILES=square / SHARDKIT_FUSED_BACKWARD_TILES=square: that GEMM runs
// ping-pong on [128, 128] tiles, one per consumer warpgroup, so that one tile's epilogue runs
// under the other's MMAs with 128-row tiles (the forward's row partials are then per 128
// columns). Not yet run on a GPU: for measuring against the default ("same": the schedule of
// SHARDKIT_FUSED_SCHEDULE).
bool square_backward() {
  return env_choice("SHARDKIT_FUSED_BACKWARD_TILES", "same", "square");
}
int64_t forward_tile_cols() {
  return env_choice("SHARDKIT_FUSED_FORWARD_TILES", "same", "square") ? 128 : 256;
}

int64_t forward_chunk(int64_t B, int64_t D, int64_t C, int64_t chunk, int64_t elem, bool mixed,
                      bool normalize, int64_t tile) {
  constexpr int64_t kMaxChunk = 131072, kPartBytes = 20;  // 3 floats and a count
  // The backward's chunk buffers, less the forward's recorded target cosines (4 bytes a row).
  const int64_t budget = chunk * (B * elem + (mixed ? D * elem : 0)) - B * 4;
  // Bytes per forward tile.
  const int64_t per_tile = B * kPartBytes + tile * ((mixed ? D * elem : 0) + (normalize ? 4 : 0));
  int64_t n = std::min(std::max<int64_t>(budget, 0) / std::max<int64_t>(per_tile, 1) * tile, kMaxChunk);
  return std::min(C, std::max(chunk, n));
}

int64_t backward_chunk(int64_t B, int64_t D, int64_t C, int64_t chunk, int64_t elem, bool mixed,
                       bool normalize, bool v2) {
  constexpr int64_t kMaxBytes = int64_t(56) << 20, kTile = 256;
  // Bytes per class of the backward's chunk buffers (sharded_ce_cuda.cu): the dlogits G, the
  // converted rows (mixed), the fp32 dW rows before their fix-up (16-bit w, unless v2 writes dW
  // straight from the GEMM: plain, not mixed), the normalized rows and the inverse norms.
  const bool tbuf = !mixed && (!v2 || normalize);
  const int64_t per_class =
      B * elem + (mixed ? D * elem : 0) + (tbuf ? D * 4 : 0) + (normalize ? D * elem + 4 : 0);
  // The unfused kernels hold B fp32 logits per class beside those.
  const int64_t unit = std::max<int64_t>(per_class + 4 * B, 1);
  const int64_t budget = chunk >= kMaxBytes / unit ? kMaxBytes : chunk * unit;
  int64_t n = budget / std::max<int64_t>(per_class, 1);
  if (n >= kTile) n -= n % kTile;
  return std::min(C, std::max(chunk, n));
}

#ifdef SHARDKIT_WITH_CUTLASS
namespace {

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
        const bool no_t = p.short_form && !any_target(rows);
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
    const bool wide = kFull && p.wide_stores && p.ldg % 8 == 0 && (reinterpret_cast<uintptr_t>(G) & 15) == 0;
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

template <class Elem, bool kBackward, Sched S>
struct FusedGemm {
  using Mainloop = FusedMainloop<Elem, S>;
  using Epilogue =
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<SceEpilogue<kBackward, Elem>>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static_assert(sizeof(typename Kernel::SharedStorage) <= 232448,
                "the kernel's shared memory exceeds an sm90 SM's");
};

template <class Elem, bool kBackward, Sched S>
void launch_as(const at::Tensor& x, const at::Tensor& wc, const EpiParams& p, cudaStream_t stream) {
  using G = FusedGemm<Elem, kBackward, S>;
  using Dev = typename G::Device;
  const int M = static_cast<int>(x.size(0)), N = static_cast<int>(wc.size(0)),
            K = static_cast<int>(x.size(1));
  typename G::Mainloop::StrideA sa = make_stride(static_cast<int64_t>(K), Int<1>{}, static_cast<int64_t>(0));
  typename G::Mainloop::StrideB sb = make_stride(static_cast<int64_t>(K), Int<1>{}, static_cast<int64_t>(0));
  cutlass::KernelHardwareInfo hw;
  hw.device_id = x.get_device();
  hw.sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  typename Dev::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                               {M, N, K, 1},
                               {reinterpret_cast<const Elem*>(x.const_data_ptr()), sa,
                                reinterpret_cast<const Elem*>(wc.const_data_ptr()), sb},
                               {p},
                               hw};
  Dev gemm;
  TORCH_CHECK(gemm.can_implement(args) == cutlass::Status::kSuccess,
              "shardkit: the fused sharded cross-entropy kernel cannot run on x ", x.sizes(), " and w chunk ",
              wc.sizes(), " (set SHARDKIT_FUSED=0)");
  const size_t ws = Dev::get_workspace_size(args);
  at::Tensor workspace =
      ws ? at::empty({static_cast<int64_t>(ws)}, x.options().dtype(at::kByte)) : at::Tensor();
  const cutlass::Status st = gemm.run(args, ws ? workspace.mutable_data_ptr() : nullptr, stream);
  TORCH_CHECK(
      st == cutlass::Status::kSuccess,
      "shardkit: the fused sharded cross-entropy kernel failed to launch: ", cutlassGetStatusString(st));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// SHARDKIT_FUSED_SCHEDULE=pingpong: the ping-pong kernels (64-row tiles, one consumer
// warpgroup's epilogue under the other's MMAs), for measuring against the default cooperative
// ones (128-row tiles). Slower on an H100 (benchmarks/RESULTS.md): the 64-row tiles read each
// weight tile twice as often.
bool pingpong() {
  return env_choice("SHARDKIT_FUSED_SCHEDULE", "cooperative", "pingpong");
}

// SHARDKIT_FUSED_STORES=pairs: the backward epilogue stores two columns per thread and
// instruction everywhere (as before the 16-byte stores), for measuring against the default
// (wide: 8 columns per store in full tiles, 8% faster per step at B=1024, C=1M on an H100).
bool wide_stores() {
  return !env_choice("SHARDKIT_FUSED_STORES", "wide", "pairs");
}

// SHARDKIT_FUSED_EPILOGUE=general: every tile takes the forward epilogue's general form
// (target bookkeeping, masks, infinity guards), for measuring against the default (short: full
// tiles without a target in the warp's rows take the short form).
bool short_form() {
  return !env_choice("SHARDKIT_FUSED_EPILOGUE", "short", "general");
}

// `square`: the square ping-pong tiles (the backward's from SHARDKIT_FUSED_BACKWARD_TILES, the
// forward's from its scratch, whose partials were sized for them).
template <class Elem, bool kBackward>
void launch(const at::Tensor& x, const at::Tensor& wc, const EpiParams& p, bool square, cudaStream_t stream) {
  if (square) return launch_as<Elem, kBackward, Sched::kSquare>(x, wc, p, stream);
  if (pingpong())
    launch_as<Elem, kBackward, Sched::kPingpong>(x, wc, p, stream);
  else
    launch_as<Elem, kBackward, Sched::kCooperative>(x, wc, p, stream);
}

// One warp per row: the chunk's tile partials in a fixed order, then the target logit (its
// margin from the recorded cosine), folded into the running statistics.
__global__ void merge_tiles_kernel(EpiParams p, int64_t B, int64_t n, int64_t tiles, Running run) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (i >= B) return;
  float m = -INFINITY, s = 0.f, z = 0.f;
  int64_t c = 0;
  for (int64_t k = lane; k < tiles; k += 32) {
    const int64_t q = i * tiles + k;
    merge_ms(m, s, p.part_m[q], p.part_s[q]);
    z += p.part_z[q];
    c += p.part_c[q];
  }
  for (int o = 16; o > 0; o /= 2) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    merge_ms(m, s, m2, s2);
    z += __shfl_xor_sync(0xffffffffu, z, o);
    c += __shfl_xor_sync(0xffffffffu, c, o);
  }
  if (lane != 0) return;
  const int64_t t = p.labels[i] - p.label_shift;
  if (t >= 0 && t < n) {
    float dpsi;
    const float zt = target_logit(p, p.ct[i], &dpsi);
    run.TG[i] = zt;
    merge_ms(m, s, zt, 1.f);
    z += zt;
  }
  fold_stats(i, m, s, z, c, run.M, run.S, run.LS, run.CN);
}

// The target column's dlogit of each row whose target lies in the chunk (the GEMM wrote a
// plain one there), from the cosine the GEMM recorded.
template <class Elem>
__global__ void fix_target_kernel(EpiParams p, int64_t B, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= B) return;
  const int64_t t = p.labels[i] - p.label_shift;
  if (t < 0 || t >= n) return;
  float dpsi;
  const float z = target_logit(p, p.ct[i], &dpsi);
  const float dz = p.gl[i] * __expf(z - p.lse[i]) + p.gs[i] + p.gt[i];
  store_one(static_cast<Elem*>(p.g) + i * p.ldg + t,
            p.scale * dpsi * dz * (p.g_times_r && p.rw ? p.rw[t] : 1.f));
}

// 1 where this kernel was compiled for sm_90a (the code the driver picked for this GPU holds
// the warpgroup-MMA kernels), 0 otherwise.
__global__ void arch_probe_kernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}

bool device_runs_sm90a(int device) {
  static std::mutex mu;
  static std::vector<int> known;  // -1 unknown, 0 no, 1 yes
  const std::lock_guard<std::mutex> lock(mu);
  if (known.size() <= static_cast<size_t>(device)) known.resize(device + 1, -1);
  if (known[device] < 0) {
    const auto* prop = at::cuda::getDeviceProperties(device);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    // The probe waits for the GPU, which a stream being captured into a CUDA graph must not:
    // this call takes the unfused kernels, and the first call outside a capture probes.
    if (capture != cudaStreamCaptureStatusNone) return false;
    int ok = 0;
    if (prop->major == 9 && prop->minor == 0) {
      at::Tensor flag = at::zeros({1}, at::TensorOptions().device(at::kCUDA, device).dtype(at::kInt));
      arch_probe_kernel<<<1, 1, 0, stream>>>(flag.mutable_data_ptr<int>());
      // A build without sm_90a code for this GPU fails the launch: then no fused kernels.
      ok = cudaGetLastError() == cudaSuccess ? flag.item<int>() : 0;
    }
    known[device] = ok;
  }
  return known[device] == 1;
}

}  // namespace

bool compiled() {
  return true;
}

bool usable(const at::Tensor& x, const at::Tensor& wc) {
  const auto dt = x.scalar_type();
  if ((dt != at::kBFloat16 && dt != at::kHalf) || wc.scalar_type() != dt || !x.is_cuda()) return false;
  const int64_t D = x.size(1);
  if (D % 64 != 0 || D > 1024 || wc.size(1) != D || x.size(0) > INT32_MAX || wc.size(0) > INT32_MAX)
    return false;
  if (!x.is_contiguous() || !wc.is_contiguous()) return false;
  if (reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 ||
      reinterpret_cast<uintptr_t>(wc.const_data_ptr()) % 16)
    return false;
  return device_runs_sm90a(x.get_device());
}

Scratch make_scratch(const at::Tensor& x, int64_t max_n, int64_t tile_cols) {
  TORCH_CHECK(tile_cols == 0 || tile_cols == 128 || tile_cols == 256,
              "shardkit: internal error: a fused forward tile of ", tile_cols, " columns");
  const int64_t B = x.size(0);
  Scratch sc;
  sc.tile_cols = tile_cols;
  if (tile_cols) {
    const int64_t tiles = (max_n + tile_cols - 1) / tile_cols;
    sc.parts = at::empty({3 * B * tiles}, x.options().dtype(at::kFloat));
    sc.counts = at::empty({B * tiles}, x.options().dtype(at::kLong));
  }
  sc.ct = at::empty({B}, x.options().dtype(at::kFloat));
  return sc;
}

void forward(const at::Tensor& x, const at::Tensor& wc, EpiParams p, const Running& run, const Scratch& sc,
             cudaStream_t stream) {
  TORCH_CHECK(sc.tile_cols == 128 || sc.tile_cols == 256,
              "shardkit: internal error: the fused forward's scratch was not made for the forward");
  const int64_t B = x.size(0), n = wc.size(0), tiles = (n + sc.tile_cols - 1) / sc.tile_cols;
  TORCH_CHECK(sc.parts.defined() && sc.parts.numel() >= 3 * B * tiles && sc.ct.numel() >= B,
              "shardkit: internal error: the fused forward's scratch is smaller than its chunk");
  // The partials of this chunk, [B, tiles] each, at the start of the scratch.
  p.part_m = sc.parts.mutable_data_ptr<float>();
  p.part_s = p.part_m + B * tiles;
  p.part_z = p.part_s + B * tiles;
  p.part_c = sc.counts.mutable_data_ptr<int64_t>();
  p.ct = sc.ct.mutable_data_ptr<float>();
  p.short_form = short_form();
  const bool square = sc.tile_cols == 128;
  if (x.scalar_type() == at::kBFloat16)
    launch<cutlass::bfloat16_t, false>(x, wc, p, square, stream);
  else
    launch<cutlass::half_t, false>(x, wc, p, square, stream);
  constexpr int kWarps = 8;
  merge_tiles_kernel<<<(B + kWarps - 1) / kWarps, 32 * kWarps, 0, stream>>>(p, B, n, tiles, run);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void backward(const at::Tensor& x, const at::Tensor& wc, EpiParams p, const Scratch& sc,
              cudaStream_t stream) {
  const int64_t B = x.size(0), n = wc.size(0);
  TORCH_CHECK(sc.ct.numel() >= B, "shardkit: internal error: the fused backward's scratch is too small");
  p.ct = sc.ct.mutable_data_ptr<float>();
  p.wide_stores = wide_stores();
  const bool square = square_backward();
  if (x.scalar_type() == at::kBFloat16) {
    launch<cutlass::bfloat16_t, true>(x, wc, p, square, stream);
    fix_target_kernel<cutlass::bfloat16_t><<<(B + 255) / 256, 256, 0, stream>>>(p, B, n);
  } else {
    launch<cutlass::half_t, true>(x, wc, p, square, stream);
    fix_target_kernel<cutlass::half_t><<<(B + 255) / 256, 256, 0, stream>>>(p, B, n);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

#else  // no CUTLASS at build time: never usable

bool compiled() {
  return false;
}
bool usable(const at::Tensor&, const at::Tensor&) {
  return false;
}
Scratch make_scratch(const at::Tensor&, int64_t, int64_t) {
  TORCH_CHECK(false, "shardkit was built without the fused kernels (no CUTLASS headers at build time)");
  return Scratch();
}
void forward(const at::Tensor&, const at::Tensor&, EpiParams, const Running&, const Scratch&, cudaStream_t) {
  TORCH_CHECK(false, "shardkit was built without the fused kernels (no CUTLASS headers at build time)");
}
void backward(const at::Tensor&, const at::Tensor&, EpiParams, const Scratch&, cudaStream_t) {
  TORCH_CHECK(false, "shardkit was built without the fused kernels (no CUTLASS headers at build time)");
}

#endif

}  // namespace fused
}  // namespace sce
}  // namespace shardkit
