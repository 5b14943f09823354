// The fused Hopper (sm90) kernels of the sharded cross-entropy: one GEMM per class chunk whose
// epilogue works on the logits tile in registers (CUTLASS / CuTe: TMA loads, warpgroup MMA, a
// persistent kernel, cooperative by default, ping-pong with SHARDKIT_FUSED_SCHEDULE=pingpong;
// SHARDKIT_FUSED_FORWARD_TILES=square / SHARDKIT_FUSED_BACKWARD_TILES=square: that GEMM
// ping-pong on [128, 128] tiles, for measuring).
// No fp32 logits tile reaches global memory:
//   forward:  each tile of logits ([128, 256]; [64, 256] ping-pong; [128, 128] square)
//             becomes per-row partial statistics (max, sum of exp(z - max), logit sum, count
//             above the reference) over its columns but the target, in [B, tiles] partials, and
//             the target's cosine is recorded; a merge kernel folds the tiles and the target
//             logit (margin applied);
//   backward: the recomputed tile becomes dlogits in x's dtype, written into the chunk buffer G
//             that the dX / dW GEMMs read (16-byte stores of 8 columns, the quad's pairs
//             exchanged by shuffles; SHARDKIT_FUSED_STORES=pairs: 4-byte stores of 2, for
//             measuring); a per-row kernel rewrites the target's entry.
// In the forward, full tiles in which no row of a warp has its target column (nearly all at
// large C) take a short form of the epilogue: no target bookkeeping, no masks, no guards
// against infinite maxima where the warp's are finite, no count without a reference
// (SHARDKIT_FUSED_EPILOGUE=general: never, for measuring).
// Built where CUTLASS's headers are found at build time (setup.py: CUTLASS_PATH, or the
// nvidia-cutlass package) and run only on a compute-capability 9.0 GPU whose code was built for
// sm_90a, bf16 / fp16 x and chunk, D a multiple of 64 up to 1024. Anything else, and
// SHARDKIT_FUSED=0, takes the unfused kernels of sharded_ce_cuda.cu.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace shardkit {
namespace sce {
namespace fused {

// What the epilogue needs beside the two GEMM operands (device pointers; nullptr where unused).
struct EpiParams {
  const float* rw = nullptr;        // [n] 1 / max(|w_j|, eps) of the chunk's rows (normalize only)
  const int64_t* labels = nullptr;  // [B]
  int64_t label_shift = 0;          // class_offset + j0: row i's target column is labels[i] - label_shift
  float scale = 1.f;
  double m1 = 1, m2 = 0, m3 = 0, c_max = -2;  // the margin (sharded_ce_common.h's margin_psi)
  bool plain = true, normalize = false;
  // Forward (fused::forward fills these: the partials [B, tiles] and the target cosines [B]).
  const float* tref = nullptr;  // [B] reference logits of the count (nullptr: no count)
  float* part_m = nullptr;      // max of the tile's logits but the target
  float* part_s = nullptr;      // sum of exp(z - max) over them
  float* part_z = nullptr;      // sum of z over them
  int64_t* part_c = nullptr;    // plain logits (the target's too) above tref
  float* ct = nullptr;          // [B] the target column's cosine (raw dot without normalization)
  // Backward: G = scale * dpsi * (gl exp(z - lse) + gs + [target] gt) * (g_times_r ? rw : 1)
  // (the target column's entry rewritten after the GEMM, from ct).
  const float *lse = nullptr, *gl = nullptr, *gt = nullptr, *gs = nullptr;
  bool g_times_r = false;
  bool wide_stores = true;  // 16-byte stores of 8 columns in full tiles (SHARDKIT_FUSED_STORES)
  bool short_form = true;   // the forward's short epilogue where it applies (SHARDKIT_FUSED_EPILOGUE)
  void* g = nullptr;        // [B, n] in x's dtype, row stride ldg
  int64_t ldg = 0;
};

// True when this build has the fused kernels (CUTLASS found at build time).
bool compiled();
// True where the fused kernels can run: x [B, D] and the chunk wc [n, D] (same dtype, bf16 or
// fp16, contiguous, 16-byte aligned), D % 64 == 0 and D <= 1024, on a compute-capability 9.0
// GPU that runs the sm_90a code (checked once per device).
bool usable(const at::Tensor& x, const at::Tensor& wc);
// SHARDKIT_FUSED: 1 (the default: the fused kernels where usable) or 0 (the unfused kernels, for
// bisecting). Read on every call, so a process can compare both.
bool enabled();
// The running statistics of the rows, [B] each (sharded_ce_cuda.cu's M, S, LS, CN, TG).
struct Running {
  float *M, *S, *LS, *TG;
  int64_t* CN;
};
// Classes per chunk of the fused forward. It holds no logits, only [B, tiles] partials (20 bytes
// per row and tile of 256 classes; 128 with SHARDKIT_FUSED_FORWARD_TILES=square), plus, per class, the
// converted row (mixed: fp32 w, `elem`-byte x) and 1 / |w_j| (normalize). So its chunk grows from `chunk`
// (the caller's, which sizes the backward's [B, chunk] dlogits) while those bytes and its [B] target cosines
// fit in the backward's own dlogits and converted rows of `chunk` classes, in whole tiles, at most 131,072
// classes (fewer, larger GEMMs: each launch's tail and the per-chunk host work are paid less
// often) and at most C. Never below `chunk` (whose partials, for a chunk of under 10 classes,
// take more than its dlogits: a tile is 128 or 256 classes wide).
// `tile`: forward_tile_cols(), read once by the caller for this and make_scratch.
int64_t forward_chunk(int64_t B, int64_t D, int64_t C, int64_t chunk, int64_t elem, bool mixed,
                      bool normalize, int64_t tile);
// Columns of a forward tile, whose row partials are per tile: 128 with
// SHARDKIT_FUSED_FORWARD_TILES=square, else 256.
int64_t forward_tile_cols();
// Classes per chunk of the fused backward. Holding no fp32 logits, its chunk buffers take fewer
// bytes per class than the unfused kernels' (B fp32 logits per class fewer): its chunk grows from
// `chunk` (the caller's) while its buffers fit in what the unfused kernels would hold for `chunk`
// classes and in 56 MiB (in whole tiles of 256 classes from 256 on); never below `chunk`, at
// most C. Larger chunks mean fewer, larger dX / dW GEMMs (the dX GEMM's K is the chunk); the
// 56 MiB keeps the default at B=1024, D=512, bf16 (28,672 classes) within 64 MiB of working
// memory. `elem` is x's element size, `v2` whether the second unfused kernels' dW path applies
// (SHARDKIT_CE_V2).
int64_t backward_chunk(int64_t B, int64_t D, int64_t C, int64_t chunk, int64_t elem, bool mixed,
                       bool normalize, bool v2);
// Scratch memory of the fused kernels for chunks of up to max_n classes, allocated once per call:
// the forward's partials (tile_cols: the forward's tile width; 0 for the backward, which has
// none) and both directions' recorded target cosines.
struct Scratch {
  at::Tensor parts, counts, ct;
  int64_t tile_cols = 0;  // the forward's: columns per tile of its partials (128 square, else 256)
};
Scratch make_scratch(const at::Tensor& x, int64_t max_n, int64_t tile_cols);
// Folds the chunk wc (x's dtype, [n, D], n <= the scratch's max_n) into the running statistics.
void forward(const at::Tensor& x, const at::Tensor& wc, EpiParams p, const Running& run, const Scratch& sc,
             cudaStream_t stream);
// Writes the chunk's dlogits into p.g.
void backward(const at::Tensor& x, const at::Tensor& wc, EpiParams p, const Scratch& sc, cudaStream_t stream);

}  // namespace fused
}  // namespace sce
}  // namespace shardkit
