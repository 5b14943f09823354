// The fused Hopper (sm90) kernels of the sharded cross-entropy: one GEMM per class chunk whose
// epilogue works on the logits tile in registers (CUTLASS / CuTe: TMA loads, warpgroup MMA, a
// persistent kernel, cooperative on [128, 256] tiles: it measured faster than ping-pong on
// [128, 128] tiles at every shape, benchmarks/RESULTS.md).
// No fp32 logits tile reaches global memory:
//   forward:  each tile of logits becomes per-row partial statistics (max, sum of exp(z - max),
//             logit sum, count above the reference) over its columns but the target, in
//             [B, tiles] partials, and the target's cosine is recorded; a merge kernel folds the
//             tiles and the target logit (margin applied);
//   backward: the recomputed tile becomes dlogits in x's dtype, written into the chunk buffer G
//             that the dX / dW GEMMs read (16-byte stores of 8 columns in full tiles, the quad's
//             pairs exchanged by shuffles); a per-row kernel rewrites the target's entry.
// In the forward, full tiles in which no row of a warp has its target column (nearly all at
// large C) take a short form of the epilogue: no target bookkeeping, no masks, no guards
// against infinite maxima where the warp's are finite, no count without a reference.
// SHARDKIT_FUSED_PDL=1 launches each kernel as a programmatic dependent of the previous one
// (its launch overlaps that kernel's tail; it waits for it before touching memory), for measuring.
// Built where CUTLASS's headers are found at build time (setup.py: CUTLASS_PATH, or the
// nvidia-cutlass package) and run only on a compute-capability 9.0 GPU whose code was built for
// sm_90a, bf16 / fp16 x and chunk, D a multiple of 64 up to 1024. Anything else, and
// SHARDKIT_FUSED=0, takes the unfused kernels of sharded_ce_cuda.cu.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

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
  void* g = nullptr;  // [B, n] in x's dtype, row stride ldg
  int64_t ldg = 0;
};

// True when this build has the fused kernels (CUTLASS found at build time).
bool compiled();
// True where the fused kernels can run: x [B, D] and the chunk wc [n, D] (same dtype, bf16 or
// fp16, contiguous, 16-byte aligned), D % 64 == 0 and D <= 1024, on a compute-capability 9.0
// GPU that runs the sm_90a code (probed once per device, on a stream of its own: a first call
// made during CUDA-graph capture takes the fused kernels too).
bool usable(const at::Tensor& x, const at::Tensor& wc);
// SHARDKIT_FUSED: 1 (the default: the fused kernels where usable) or 0 (the unfused kernels, for
// bisecting). Read on every call, so a process can compare both.
bool enabled();
// The running statistics of the rows, [B] each (sharded_ce_cuda.cu's M, S, LS, CN, TG).
struct Running {
  float *M, *S, *LS, *TG;
  int64_t* CN;
};
// Rows and columns of every tile of the fused GEMMs.
constexpr int64_t kRowsPerTile = 128, kColsPerTile = 256;
// n classes rounded down to whole waves of tiles: ceil(B / 128) x (n / tile) a multiple of
// sm_count (every SM busy to the GEMM's end, no tail wave), where n holds such a multiple;
// else to whole tiles where n >= tile; else n.
int64_t whole_waves(int64_t n, int64_t B, int64_t tile, int64_t sm_count);
// Classes per chunk of the fused forward. It holds no logits, only [B, tiles] partials (20 bytes
// per row and tile of `tile` classes), plus, per class, the converted row (mixed: fp32 w,
// `elem`-byte x) and 1 / |w_j| (normalize). So its chunk grows from `chunk` (the backward's
// chunk without overlap, which sizes its [B, chunk] dlogits) while those bytes and its [B] target
// cosines fit in the backward's own dlogits and converted rows of `chunk` classes, at most 131,072
// classes (fewer, larger GEMMs: each launch's tail and the per-chunk host work are paid less
// often), then in whole waves (whole_waves); all of C where that fits.
int64_t forward_chunk(int64_t B, int64_t D, int64_t C, int64_t chunk, int64_t elem, bool mixed,
                      bool normalize, int64_t tile, int64_t sm_count);
// Classes per chunk of the fused backward. Holding no fp32 logits, its chunk buffers take fewer
// bytes per class than the unfused kernels' (B fp32 logits per class fewer): its chunk grows from
// `chunk` (the caller's) while its buffers fit in what the unfused kernels would hold for `chunk`
// classes and in 56 MiB, then in whole waves of tiles `tile` columns wide (whole_waves); all of C
// where that fits. `overlap` (two chunks in flight, SHARDKIT_FUSED_OVERLAP): half of that chunk,
// in whole tiles (halving before the wave rounding lost up to 40% more: 12 chunks where 8 do).
// Larger chunks mean fewer, larger dX / dW GEMMs (the dX GEMM's K is the chunk); the 56 MiB keeps
// the default at B=1024, D=512, bf16 (25,344 classes on 132 SMs) within 64 MiB of working memory.
// `elem` is x's element size.
int64_t backward_chunk(int64_t B, int64_t D, int64_t C, int64_t chunk, int64_t elem, bool mixed,
                       bool normalize, int64_t tile, int64_t sm_count, bool overlap);
class GemmLaunch;  // a fused GEMM's launch state (sharded_ce_fused_launch.cuh)
// Per-call state of the fused kernels of one direction, for chunks of up to max_n classes: the
// forward's partials (none in the backward), the recorded target cosines, the GEMM's launch
// state (its parameters built once per chunk shape), and SHARDKIT_FUSED_PDL read once.
struct Scratch {
  at::Tensor parts, counts, ct;
  bool backward = false, pdl = false;
  std::shared_ptr<GemmLaunch> gemm;
};
Scratch make_scratch(const at::Tensor& x, int64_t max_n, bool backward);
// Folds the chunk wc (x's dtype, [n, D], n <= the scratch's max_n) into the running statistics;
// `first`: sets them from this chunk instead; `last`: M then holds lse = M + log S.
void forward(const at::Tensor& x, const at::Tensor& wc, EpiParams p, const Running& run, Scratch& sc,
             bool first, bool last, cudaStream_t stream);
// Writes the chunk's dlogits into p.g.
void backward(const at::Tensor& x, const at::Tensor& wc, EpiParams p, Scratch& sc, cudaStream_t stream);

}  // namespace fused
}  // namespace sce
}  // namespace shardkit
