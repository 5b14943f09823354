// CUDA kernels of the sharded cross-entropy (shardkit::ce_shard_stats and its backward).
//
// Host loop over class chunks on the current stream: per chunk one cuBLAS GEMM producing fp32
// logits (at::mm_out with out_dtype=float for bf16/fp16 inputs), then a fused kernel:
//   forward:  column ranges of each row fold the chunk into running [B] statistics (online
//             max/sum-exp, margin at the target column, logit sum, count; sharded_ce_v2.cuh);
//   backward: an elementwise kernel turns the logits into dlogits, written in the GEMM input
//             dtype, then dX += G @ W_chunk (fp32 accumulation) and dW_chunk = G^T @ X written
//             straight into grad_w (through a fix-up kernel for normalization / dtype).
// With normalize=True the forward never copies the weights: logits of the raw chunk are
// scaled by 1 / |w_j| in the fused kernel. The fp32/fp64 backward folds 1 / |w_j| into the
// dlogits too; the 16-bit one cannot (fp16 dlogits would overflow for small rows) and uses a
// normalized copy of the chunk instead. The normalization backward is applied per chunk.
// Mixed mode (fp32 w, bf16/fp16 x): each chunk of w is first converted into a chunk-sized
// buffer in x's dtype, and the computation is the 16-bit one on that chunk, except that
// dW_chunk is written in fp32 straight into the fp32 grad_w (the GEMM's fp32 output).
// Extra memory: O(B * chunk + chunk * D).
// On compute-capability 9.0 GPUs, builds with CUTLASS run 16-bit chunks (D % 64 == 0, up to
// 1024) through the fused kernels of sharded_ce_fused.cu instead (SHARDKIT_FUSED=0: not): the
// forward's GEMM epilogue folds each logits tile into row statistics, the backward's writes the
// dlogits, so no fp32 logits buffer exists; the dX / dW GEMMs and fix-ups below are shared.
// Holding no fp32 logits, the fused backward walks larger chunks (fused::backward_chunk) within
// the memory the unfused chunk takes (and 56 MiB), and the fused forward larger ones still
// (fused::forward_chunk) within the memory the fused backward's chunk takes.
// SHARDKIT_FUSED_OVERLAP=1 runs the fused backward's dX / dW GEMMs of chunk k on a second stream
// under chunk k + 1's dlogits GEMM (two sets of half-size chunk buffers, events between).
// The backward's per-chunk pieces (buffers, dlogits of the unfused kernels, dX / dW and their
// fix-ups) are in sharded_ce_backward.cuh.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAException.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/ScopeExit.h>
#include <torch/library.h>

#include <limits>

#include "sharded_ce_common.h"
#include "env_flag.h"
#include "sharded_ce_device.cuh"
#include "sharded_ce_fused.h"

namespace shardkit {
namespace sce {
namespace {

using at::Tensor;

constexpr int kBlock = 256;
constexpr double kEps = 1e-12;

// The logit scale * c rounded on its own (never fused into a following subtraction): the
// statistics and the backward must see the same rounded logit, or exp(logit - lse) can exceed 1
// at large scales (nvcc contracts a * b - c into one fma by default).
__device__ __forceinline__ float scaled_logit(float s, float c) {
  return __fmul_rn(s, c);
}
__device__ __forceinline__ double scaled_logit(double s, double c) {
  return __dmul_rn(s, c);
}

template <typename T>
struct MarginT {
  T scale;
  double m1, m2, m3, c_max;  // margin_psi works in double
  bool plain, normalize;
};

template <typename T>
MarginT<T> to_device_margin(const Margin& mg) {
  return {T(mg.scale), mg.m1, mg.m2, mg.m3, mg.c_max, mg.plain_target, mg.normalize};
}

// 1 / max(|w_j|, eps) for the chunk's rows (one warp per row) and, if what is given, the
// normalized rows w_j / max(|w_j|, eps) in w's dtype, contiguous [n, D].
template <typename scalar_t, typename T>
__global__ void inv_row_norm_kernel(const scalar_t* __restrict__ w, int64_t s0, int64_t s1, int64_t n,
                                    int64_t D, T* __restrict__ rnorm, scalar_t* __restrict__ what) {
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  double ss = 0;  // in double: a float row of norm above ~1.8e19 must not overflow to inf
  for (int64_t k = lane; k < D; k += 32) {
    const double v = static_cast<double>(w[row * s0 + k * s1]);
    ss += v * v;
  }
  for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);  // every lane: the sum
  const T rn = static_cast<T>(1.0 / max(sqrt(ss), kEps));
  if (lane == 0) rnorm[row] = rn;
  if (what)
    for (int64_t k = lane; k < D; k += 32)
      what[row * D + k] = static_cast<scalar_t>(static_cast<T>(w[row * s0 + k * s1]) * rn);
}

// One logit of the statistics from c (the raw dot, or the cosine when normalizing): z = scale c,
// counted against the reference (the plain logit, also at the target column), the margin
// applied at the target column, whose value goes to *tg (the target lies in one chunk and one
// block only: no race), and added to the logit sum zs. Returns z.
template <typename T>
__device__ __forceinline__ T stat_logit(T c, bool at_target, bool count, T ref, const MarginT<T>& mg,
                                        int64_t& cnt, T& zs, T* tg) {
  T z = scaled_logit(mg.scale, c);
  if (count) cnt += z > ref ? 1 : 0;
  if (at_target) {
    if (mg.normalize) {
      T psi, dpsi;
      margin_psi<T>(c, mg.plain, mg.m1, mg.m2, mg.m3, mg.c_max, &psi, &dpsi);
      z = scaled_logit(mg.scale, psi);
    }
    *tg = z;
  }
  zs += z;
  return z;
}

// Block reduction of every thread's (m, s, zs, cnt): warps by shuffles, then the warps'
// partials through shared memory, in a fixed order. Thread 0 ends with the block's values
// (the other threads' values are partial). Every thread of the block must call it.
template <typename T>
__device__ __forceinline__ void block_reduce_stats(T& m, T& s, T& zs, int64_t& cnt) {
  for (int o = 16; o > 0; o /= 2) {
    const T m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    merge_ms(m, s, m2, s2);
    zs += __shfl_xor_sync(0xffffffffu, zs, o);
    cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
  }
  __shared__ T sm[32], ss[32], sz[32];
  __shared__ int64_t sc[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
    sz[warp] = zs;
    sc[warp] = cnt;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int k = 1; k < nwarps; ++k) {
      merge_ms(m, s, sm[k], ss[k]);
      zs += sz[k];
      cnt += sc[k];
    }
  }
}

// Forward: row i = blockIdx.x of the chunk's logits L [B, n] (raw dots; times rw[j] when
// normalizing) folded into the running statistics M (max), S (sum exp(z - M)), LS, CN, TG.
template <typename T>
__global__ void row_stats_kernel(const T* __restrict__ L, int64_t n, int64_t j0, const T* __restrict__ rw,
                                 const int64_t* __restrict__ labels, int64_t class_offset,
                                 const T* __restrict__ tref, MarginT<T> mg, T* M, T* S, T* LS, T* TG,
                                 int64_t* CN) {
  const int64_t i = blockIdx.x;
  const T* row = L + i * n;
  const int64_t t = labels[i] - class_offset - j0;
  const T ref = tref ? tref[i] : T(0);
  T m = -std::numeric_limits<T>::infinity(), s = 0, zs = 0;
  int64_t cnt = 0;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const T z =
        stat_logit<T>(rw ? row[j] * rw[j] : row[j], j == t, tref != nullptr, ref, mg, cnt, zs, TG + i);
    if (z > m) {
      s = s * dev_exp(m - z) + T(1);
      m = z;
    } else if (z != -std::numeric_limits<T>::infinity()) {  // -inf adds 0; exp(-inf - -inf) is NaN
      s += dev_exp(z - m);
    }
  }
  block_reduce_stats(m, s, zs, cnt);
  if (threadIdx.x == 0) fold_stats(i, m, s, zs, cnt, M, S, LS, CN);
}

}  // namespace
}  // namespace sce
}  // namespace shardkit

#include "sharded_ce_v2.cuh"
#include "sharded_ce_kept.cuh"

namespace shardkit {
namespace sce {
namespace {

bool is_aligned(const void* ptr, size_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

int64_t sm_count() {
  return at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

// Column ranges per row for row_stats_v2: enough blocks for two waves of 8 blocks per SM at
// this batch, at least two 16-byte vectors per thread in each range, at most 64 ranges.
int row_parts(int64_t B, int64_t n) {
  const int64_t want = (16 * sm_count() + B - 1) / B;
  const int64_t most = std::max<int64_t>(1, n / 4 / (2 * kBlock));
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({want, most, 64})));
}

// Whether addmm_f32_out takes rows v of strides (s0, s1), [n, D], and G [B, n].
bool gemm_dx(int64_t s0, int64_t s1, int64_t D, int64_t n, int64_t B) {
  return s1 == 1 && s0 >= D && s0 <= INT32_MAX && n <= INT32_MAX && B <= INT32_MAX;
}

// dx [B, D] (fp32, contiguous) = G [B, n] @ v [n, D] + beta dx (G and v 16-bit, rows
// contiguous): cuBLAS with fp32 accumulation, no [B, D] temporary.
void addmm_f32_out(Tensor& dx, const Tensor& G, const Tensor& v, float beta) {
  const cudaDataType_t ab = G.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  const float one = 1.f;  // alpha
  const int64_t rows = G.size(0), n = G.size(1), D = v.size(1);
  TORCH_CUDABLAS_CHECK(cublasGemmEx(at::cuda::getCurrentCUDABlasHandle(), CUBLAS_OP_N, CUBLAS_OP_N,
                                    static_cast<int>(D), static_cast<int>(rows), static_cast<int>(n), &one,
                                    v.const_data_ptr(), ab, static_cast<int>(v.stride(0)), G.const_data_ptr(),
                                    ab, static_cast<int>(G.stride(0)), &beta, dx.mutable_data_ptr(),
                                    CUDA_R_32F, static_cast<int>(dx.stride(0)), CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
}

// The fused sm90 kernels for this call (sharded_ce_fused.h): built, SHARDKIT_FUSED not 0, and
// usable for x and every chunk (w contiguous: its chunks are then aligned as its first is; the
// GEMM's N is an int, so at most INT32_MAX classes). In mixed mode the chunks are converted into
// a fresh, contiguous buffer in x's dtype (the allocator aligns it), so x, of that dtype,
// contiguous and aligned, stands for them in the check.
bool use_fused(const Tensor& xin, const Tensor& w, bool mixed) {
  if (!fused::compiled() || !fused::enabled() || !w.is_contiguous() || w.size(0) > INT32_MAX) return false;
  return fused::usable(xin, mixed ? xin : w);
}

fused::EpiParams epi_params(const Margin& mg, const Tensor& lab, int64_t class_offset, int64_t j0,
                            const Tensor& rw) {
  fused::EpiParams e;
  e.rw = rw.defined() ? rw.const_data_ptr<float>() : nullptr;
  e.labels = lab.const_data_ptr<int64_t>();
  e.label_shift = class_offset + j0;
  e.scale = static_cast<float>(mg.scale);
  e.m1 = mg.m1;
  e.m2 = mg.m2;
  e.m3 = mg.m3;
  e.c_max = mg.c_max;
  e.plain = mg.plain_target;
  e.normalize = mg.normalize;
  return e;
}

struct Prepared {
  Tensor xin;   // GEMM input [B, D]: x, or x normalized (input dtype), contiguous
  Tensor xf;    // fp32/fp64 normalized x (normalize only)
  Tensor xnrm;  // [B, 1] max(|x|, eps) (normalize only)
};

Prepared prepare_x(const Tensor& x, bool normalize) {
  Prepared p;
  if (!normalize) {
    p.xin = x.contiguous();
    return p;
  }
  const auto acc = acc_dtype(x.scalar_type());
  const Tensor xa = x.to(acc);
  // The norm in double (no overflow of a float row's squares), kept in acc.
  p.xnrm = at::linalg_vector_norm(xa, 2, {1}, true, at::kDouble).clamp_min(kEps).to(acc);
  p.xf = xa / p.xnrm;
  p.xin = p.xf.to(x.scalar_type()).contiguous();
  return p;
}

// The chunk w[j0 : j0+n] in x's dtype: a view of w, or (mixed mode, wbuf defined) w's rows
// converted into wbuf, [n, D] contiguous. The copy runs on the current stream.
Tensor weight_chunk(const Tensor& w, const Tensor& wbuf, int64_t j0, int64_t n) {
  const Tensor wc = w.narrow(0, j0, n);
  if (!wbuf.defined()) return wc;
  Tensor out = wbuf.narrow(0, 0, n * w.size(1)).view({n, w.size(1)});
  out.copy_(wc);
  return out;
}

// The chunk's inverse row norms into rw and, if what is defined, its normalized rows into what
// (x's dtype, [n, D] contiguous).
void chunk_norms(const Tensor& wc, int64_t n, Tensor& rw, const Tensor& what, cudaStream_t stream) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, wc.scalar_type(), "sce_inv_norm", [&] {
    using T = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const int rows_per_block = kBlock / 32;
    inv_row_norm_kernel<scalar_t, T><<<(n + rows_per_block - 1) / rows_per_block, kBlock, 0, stream>>>(
        wc.const_data_ptr<scalar_t>(), wc.stride(0), wc.stride(1), n, wc.size(1), rw.mutable_data_ptr<T>(),
        what.defined() ? what.mutable_data_ptr<scalar_t>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// Logits of the chunk wc ([n, D], x's dtype) into L (acc dtype, [B, n] contiguous), and
// chunk_norms when normalizing.
void chunk_logits(const Prepared& p, const Tensor& wc, int64_t n, bool normalize, Tensor& L, Tensor& rw,
                  const Tensor& what, cudaStream_t stream) {
  const auto acc = L.scalar_type();
  if (normalize) chunk_norms(wc, n, rw, what, stream);
  if (wc.scalar_type() == acc)
    at::mm_out(L, p.xin, wc.t());
  else
    at::mm_out(L, p.xin, wc.t(), acc);  // bf16/fp16 inputs, fp32 accumulation and output
}

// The per-chunk statistics of the unfused kernels over L [B, n] (fp32 logits, or a kept chunk's
// raw dots in their dtype), folded into the running [B] statistics.
template <typename in_t>
void row_stats_v2(const Tensor& L, int64_t n, int64_t j0, const Tensor& rw, const float* traw,
                  const Tensor& lab, int64_t class_offset, const Tensor& tref, const Margin& mg, int parts,
                  int max_parts, Tensor& part_f, Tensor& part_c, Tensor& M, Tensor& S, Tensor& LS, Tensor& TG,
                  Tensor& CN, cudaStream_t stream) {
  const int64_t B = L.size(0);
  float* pf = parts > 1 ? part_f.mutable_data_ptr<float>() : nullptr;
  row_stats_v2_kernel<in_t><<<B * parts, kBlock, 0, stream>>>(
      L.const_data_ptr<in_t>(), n, j0, rw.defined() ? rw.const_data_ptr<float>() : nullptr, traw,
      lab.const_data_ptr<int64_t>(), class_offset, tref.defined() ? tref.const_data_ptr<float>() : nullptr,
      to_device_margin<float>(mg), parts, B, M.mutable_data_ptr<float>(), S.mutable_data_ptr<float>(),
      LS.mutable_data_ptr<float>(), TG.mutable_data_ptr<float>(), CN.mutable_data_ptr<int64_t>(), pf,
      pf ? pf + max_parts * B : nullptr, pf ? pf + 2 * max_parts * B : nullptr,
      parts > 1 ? part_c.mutable_data_ptr<int64_t>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (parts > 1) {
    merge_parts_kernel<<<(B + kBlock - 1) / kBlock, kBlock, 0, stream>>>(
        B, parts, pf, pf + max_parts * B, pf + 2 * max_parts * B, part_c.const_data_ptr<int64_t>(),
        M.mutable_data_ptr<float>(), S.mutable_data_ptr<float>(), LS.mutable_data_ptr<float>(),
        CN.mutable_data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// The forward of both ops (arguments checked): kept == nullptr keeps nothing, else the chunks
// kept->set names write their GEMM into kept->logits (unfused kernels for every chunk).
std::tuple<Tensor, Tensor, Tensor, Tensor> stats_forward(const Tensor& x, const Tensor& w,
                                                         const Tensor& labels,
                                                         const c10::optional<Tensor>& target_ref,
                                                         int64_t class_offset, double scale, double m1,
                                                         double m2, double m3, bool normalize,
                                                         int64_t chunk_classes, KeptLogits* kept) {
  // Called below autograd (register_autograd handles it); inputs may still require grad,
  // which out= ATen calls refuse.
  const at::NoGradGuard no_grad;
  TORCH_CHECK(x.is_cuda(), "argument `x` must be a CUDA tensor here, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const auto acc = acc_dtype(x.scalar_type());
  const int64_t B = x.size(0), C = w.size(0);
  const auto opts = x.options().dtype(acc);
  if (B == 0 || C == 0) {
    Tensor z = at::zeros({B}, opts);
    return {at::full({B}, -std::numeric_limits<double>::infinity(), opts), z, z.clone(),
            at::zeros({B}, x.options().dtype(at::kLong))};
  }
  const Margin mg = make_margin(scale, m1, m2, m3, normalize);
  const bool count = target_ref.has_value() && target_ref->defined();
  const Tensor tref = count ? target_ref->to(acc).contiguous() : Tensor();
  const Tensor lab = labels.contiguous();
  const Prepared p = prepare_x(x, normalize);
  const bool mixed = w.scalar_type() != x.scalar_type();
  const bool fz = kept == nullptr && acc == at::kFloat && use_fused(p.xin, w, mixed);
  // The fused kernels' first chunk sets the statistics and their last turns M into lse: no fills
  // before, no log and add after.
  Tensor M = fz ? at::empty({B}, opts) : at::full({B}, -std::numeric_limits<double>::infinity(), opts);
  Tensor S = fz ? at::empty({B}, opts) : at::zeros({B}, opts);
  Tensor LS = fz ? at::empty({B}, opts) : at::zeros({B}, opts);
  Tensor TG = fz ? at::empty({B}, opts) : at::zeros({B}, opts);
  Tensor CN =
      fz ? at::empty({B}, x.options().dtype(at::kLong)) : at::zeros({B}, x.options().dtype(at::kLong));
  // The fused forward holds no logits: its chunks are larger, within the (fused) backward's
  // memory.
  const int64_t D = w.size(1);
  const int64_t chunk =
      fz ? fused::forward_chunk(
               B, D, C,
               fused::backward_chunk(B, D, C, std::min(chunk_classes, C), x.element_size(), mixed, normalize,
                                     fused::kColsPerTile, sm_count(), /*overlap=*/false),
               x.element_size(), mixed, normalize, fused::kColsPerTile, sm_count())
         : std::min(chunk_classes, C);
  Tensor rw = normalize ? at::empty({chunk}, opts) : Tensor();
  // Mixed mode: the chunk's rows converted to x's dtype, [chunk, D].
  const Tensor wbuf = mixed ? at::empty({chunk * w.size(1)}, x.options()) : Tensor();
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (fz) {  // no logits in memory
    const fused::Running run{M.mutable_data_ptr<float>(), S.mutable_data_ptr<float>(),
                             LS.mutable_data_ptr<float>(), TG.mutable_data_ptr<float>(),
                             CN.mutable_data_ptr<int64_t>()};
    fused::Scratch sc = fused::make_scratch(p.xin, chunk, /*backward=*/false);
    for (int64_t j0 = 0; j0 < C; j0 += chunk) {
      const int64_t n = std::min(chunk, C - j0);
      const Tensor wc = weight_chunk(w, wbuf, j0, n);
      if (normalize) chunk_norms(wc, n, rw, Tensor(), stream);
      fused::EpiParams e = epi_params(mg, lab, class_offset, j0, rw);
      e.tref = count ? tref.const_data_ptr<float>() : nullptr;
      fused::forward(p.xin, wc, e, run, sc, /*first=*/j0 == 0, /*last=*/j0 + n == C, stream);
    }
    return {M, TG, LS, CN};  // M holds lse
  }
  if (kept != nullptr) fill_kept_target(*kept, p.xin, w, lab, class_offset, normalize, stream);
  // The fp32 / fp64 logits of the chunks not kept (none when every chunk is).
  const Tensor lbuf = kept == nullptr || !kept->set.all ? at::empty({B * chunk}, opts) : Tensor();
  // The wider kernels (float statistics; double runs row_stats_kernel): per-range partials, [parts, B] each.
  const bool v2 = acc == at::kFloat;
  TORCH_INTERNAL_ASSERT(!v2 || !lbuf.defined() || is_aligned(lbuf.const_data_ptr(), 16),
                        "the logits buffer is not 16-byte aligned");
  const int max_parts = v2 ? row_parts(B, chunk) : 1;
  Tensor part_f = max_parts > 1 ? at::empty({3, max_parts * B}, opts) : Tensor();
  Tensor part_c = max_parts > 1 ? at::empty({max_parts * B}, CN.options()) : Tensor();
  int64_t k = 0;
  for (int64_t j0 = 0; j0 < C; j0 += chunk, ++k) {
    const int64_t n = std::min(chunk, C - j0);
    const bool keep = kept != nullptr && kept->set.kept(k);
    // A kept chunk's GEMM writes its slot (in the kept dtype): the statistics read it there.
    Tensor L = keep ? kept->slot(k, n) : lbuf.narrow(0, 0, B * n).view({B, n});
    chunk_logits(p, weight_chunk(w, wbuf, j0, n), n, normalize, L, rw, Tensor(), stream);
    if (v2) {
      const int parts = std::min(max_parts, row_parts(B, n));
      const float* traw = keep ? kept->target_override() : nullptr;
      const auto run = [&](auto tag) {
        row_stats_v2<decltype(tag)>(L, n, j0, rw, traw, lab, class_offset, tref, mg, parts, max_parts, part_f,
                                    part_c, M, S, LS, TG, CN, stream);
      };
      if (L.scalar_type() == at::kBFloat16)
        run(c10::BFloat16());
      else if (L.scalar_type() == at::kHalf)
        run(c10::Half());
      else
        run(float());
      continue;
    }
    using T = double;
    row_stats_kernel<T><<<B, kBlock, 0, stream>>>(
        L.const_data_ptr<T>(), n, j0, normalize ? rw.const_data_ptr<T>() : nullptr,
        lab.const_data_ptr<int64_t>(), class_offset, count ? tref.const_data_ptr<T>() : nullptr,
        to_device_margin<T>(mg), M.mutable_data_ptr<T>(), S.mutable_data_ptr<T>(), LS.mutable_data_ptr<T>(),
        TG.mutable_data_ptr<T>(), CN.mutable_data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  Tensor lse = M.add_(S.log_());
  return {lse, TG, LS, CN};
}

}  // namespace
}  // namespace sce
}  // namespace shardkit

#include "sharded_ce_backward.cuh"

namespace shardkit {
namespace sce {
namespace {

// The backward of both ops (arguments checked): kept == nullptr recomputes every chunk, else
// the chunks kept->set names form their dlogits from kept->logits (unfused kernels for every
// chunk).
std::tuple<Tensor, Tensor> stats_backward(const Tensor& grad_lse, const Tensor& grad_target,
                                          const Tensor& grad_sum, const Tensor& x, const Tensor& w,
                                          const Tensor& labels, const Tensor& lse_in, int64_t class_offset,
                                          double scale, double m1, double m2, double m3, bool normalize,
                                          int64_t chunk_classes, const KeptLogits* kept, bool need_w) {
  // Called below autograd (register_autograd handles it); inputs may still require grad,
  // which out= ATen calls refuse.
  const at::NoGradGuard no_grad;
  TORCH_CHECK(x.is_cuda(), "argument `x` must be a CUDA tensor here, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const auto acc = acc_dtype(x.scalar_type());
  const auto dt = x.scalar_type();
  const int64_t B = x.size(0), D = x.size(1), C = w.size(0);
  // A frozen w (need_w false): no [C, D] gradient and no dW GEMM, only an empty [0] result.
  Tensor grad_w = need_w ? at::empty({C, D}, w.options()) : at::empty({0}, w.options());
  if (B == 0 || C == 0) return {at::zeros({B, D}, x.options()), grad_w.zero_()};
  const Margin mg = make_margin(scale, m1, m2, m3, normalize);
  const auto opts = x.options().dtype(acc);
  const Tensor gl = grad_lse.to(acc).contiguous(), gt = grad_target.to(acc).contiguous(),
               gs = grad_sum.to(acc).contiguous(), lse = lse_in.to(acc).contiguous(),
               lab = labels.contiguous();
  const Prepared p = prepare_x(x, normalize);
  const bool low = dt != acc;  // bf16 / fp16: dlogits in the input dtype, fp32 temporaries
  // Mixed mode (fp32 w, 16-bit x): w's chunks converted into wbuf (x's dtype); dW is the fp32
  // GEMM output written straight into grad_w (fp32), so no fp32 temporary.
  const bool mixed = w.scalar_type() != dt;
  // The fused kernels write the dlogits straight from the GEMM (no fp32 logits), so their
  // chunks are larger within the same memory.
  const bool fz = kept == nullptr && acc == at::kFloat && low && use_fused(p.xin, w, mixed);
  const bool overlap = fz && overlap_enabled();
  const int64_t chunk = fz ? fused::backward_chunk(B, D, C, std::min(chunk_classes, C), x.element_size(),
                                                   mixed, normalize, fused::kColsPerTile, sm_count(), overlap)
                           : std::min(chunk_classes, C);
  fused::Scratch sc = fz ? fused::make_scratch(p.xin, chunk, /*backward=*/true) : fused::Scratch();
  // 16-bit with normalize: G stays d loss / d cos (bounded like torch's own 16-bit dlogits)
  // and the dX GEMM uses the chunk's normalized rows, [chunk, D] in the input dtype.
  const bool hat = low && normalize;
  // The fp32 / fp64 logits buffer: for the unfused kernels' recomputed chunks, and for the fp32 /
  // fp64 dlogits of kept chunks (which must not overwrite what was kept: a retained graph's second
  // backward reads it again). A kept chunk's dlogits start at its slot's element phase (the
  // vectorized kernel's loads and stores line up), hence 3 elements more.
  const bool with_logits = !fz && (kept == nullptr || !kept->set.all || !low);
  const int64_t pad = kept != nullptr ? 3 : 0;
  ChunkBuffers bufs[2];
  for (int k = 0; k < (overlap ? 2 : 1); ++k)
    bufs[k] = chunk_buffers(x, chunk, D, with_logits, low, mixed, normalize, need_w, opts, pad);
  // w.r.t. the GEMM's x (normalized x when normalize): where cuBLAS accumulates every chunk's dX
  // into it, the first chunk's GEMM initializes it.
  const bool own_rows = hat || mixed;  // the dX GEMM's rows: a contiguous buffer, or w's own
  const bool dx_by_gemm = low && gemm_dx(own_rows ? D : w.stride(0), own_rows ? 1 : w.stride(1), D, chunk, B);
  Tensor dx = dx_by_gemm ? at::empty({B, D}, opts) : at::zeros({B, D}, opts);
  Tensor dxc;  // [B, D] fp32 chunk product, made on first use (the fp32-accumulating GEMM needs none)
  const at::cuda::CUDAStream main = at::cuda::getCurrentCUDAStream();
  const at::cuda::CUDAStream side = overlap ? at::cuda::getStreamFromPool(false, x.get_device()) : main;
  at::cuda::CUDAEvent ready[2], released[2];
  // The caller's stream waits for the side stream before dx is read, and in any case (an error
  // on the way) before the buffers above return to the allocator (destroyed after this guard).
  bool joined = !overlap;
  const auto join_side = [&] {
    if (joined) return;
    joined = true;
    at::cuda::CUDAEvent done;
    done.record(side);
    done.block(main);
  };
  const auto join_guard = c10::make_scope_exit(join_side);
  const cudaStream_t stream = main.stream();
  int64_t k = 0;
  for (int64_t j0 = 0; j0 < C; j0 += chunk, ++k) {
    const int64_t n = std::min(chunk, C - j0);
    const int slot = overlap ? static_cast<int>(k % 2) : 0;
    ChunkBuffers& b = bufs[slot];
    if (overlap && k >= 2)
      released[slot].block(main);  // the side stream is done with this slot's chunk k - 2
    const Tensor what = hat ? b.what.narrow(0, 0, n * D).view({n, D}) : Tensor();
    const Tensor wc = weight_chunk(w, b.wbuf, j0, n);  // x's dtype
    const bool keep = kept != nullptr && kept->set.kept(k);
    const Tensor KL = keep ? kept->slot(k, n) : Tensor();  // the kept raw dots (read only)
    const int64_t ph = keep ? element_phase(KL) : 0;
    Tensor L = fz || keep ? Tensor() : b.logits.narrow(0, 0, B * n).view({B, n});
    Tensor G =
        low ? b.g.narrow(0, ph, B * n).view({B, n}) : (keep ? b.logits.narrow(0, ph, B * n).view({B, n}) : L);
    if (fz) {
      if (normalize) chunk_norms(wc, n, b.rw, what, stream);
      fused::EpiParams e = epi_params(mg, lab, class_offset, j0, b.rw);
      e.lse = lse.const_data_ptr<float>();
      e.gl = gl.const_data_ptr<float>();
      e.gt = gt.const_data_ptr<float>();
      e.gs = gs.const_data_ptr<float>();
      e.g_times_r = !hat;
      e.g = G.mutable_data_ptr();
      e.ldg = n;
      fused::backward(p.xin, wc, e, sc, stream);
    } else {
      unfused_dlogits(p, wc, what, L, G, b.rw, n, j0, normalize, hat, lab, class_offset, lse, gl, gt, gs, mg,
                      stream, KL, keep ? kept->target_override() : nullptr);
    }
    const Tensor& v = hat ? what : wc;  // the rows the dX GEMM and the dW fix-up use
    if (overlap) {
      ready[slot].record(main);
      ready[slot].block(side);
    }
    {
      const c10::cuda::CUDAStreamGuard on(side);
      chunk_grads(G, v, p.xin, b.rw, b.tmp, dx, dxc, need_w ? grad_w.narrow(0, j0, n) : Tensor(), low, mixed,
                  normalize, hat, /*first=*/j0 == 0 && dx_by_gemm, n, D);
    }
    if (overlap) released[slot].record(side);
  }
  join_side();
  if (normalize) {
    // Through x_hat = x / max(|x|, eps): dx = (dx_hat - [|x| >= eps] (dx_hat . x_hat) x_hat) / nrm.
    const Tensor active = p.xnrm > kEps;
    dx = (dx - (dx * p.xf).sum(1, true) * p.xf * active) / p.xnrm;
  }
  return {dx.to(dt), grad_w};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> ce_shard_stats_cuda(const Tensor& x, const Tensor& w,
                                                               const Tensor& labels,
                                                               const c10::optional<Tensor>& target_ref,
                                                               int64_t class_offset, double scale, double m1,
                                                               double m2, double m3, bool normalize,
                                                               int64_t chunk_classes) {
  check_forward(x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes);
  return stats_forward(x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes,
                       nullptr);
}

std::tuple<Tensor, Tensor> ce_shard_stats_backward_cuda(const Tensor& grad_lse, const Tensor& grad_target,
                                                        const Tensor& grad_sum, const Tensor& x,
                                                        const Tensor& w, const Tensor& labels,
                                                        const Tensor& lse, int64_t class_offset, double scale,
                                                        double m1, double m2, double m3, bool normalize,
                                                        int64_t chunk_classes, bool need_grad_w) {
  check_backward(grad_lse, grad_target, grad_sum, x, w, labels, lse, class_offset, scale, m1, m2, m3,
                 normalize, chunk_classes);
  return stats_backward(grad_lse, grad_target, grad_sum, x, w, labels, lse, class_offset, scale, m1, m2, m3,
                        normalize, chunk_classes, nullptr, need_grad_w);
}

// The memory-budget pair (sharded_ce_kept.cuh): the chunks KeptChunks(C, chunk, keep_chunks) names
// keep their raw dots from the forward to the backward.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> ce_shard_stats_keep_cuda(
    const Tensor& x, const Tensor& w, const Tensor& labels, const c10::optional<Tensor>& target_ref,
    int64_t class_offset, double scale, double m1, double m2, double m3, bool normalize,
    int64_t chunk_classes, int64_t keep_chunks) {
  check_forward(x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes);
  TORCH_CHECK(keep_chunks >= 0, "argument `keep_chunks` must be >= 0, got ", keep_chunks);
  TORCH_CHECK(x.is_cuda(), "argument `x` must be a CUDA tensor here, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t B = x.size(0), C = w.size(0);
  const KeptChunks set(C, std::max<int64_t>(1, std::min(chunk_classes, C)), keep_chunks);
  KeptLogits kept{set, at::empty({B * set.classes(C)}, x.options().dtype(kept_dtype(x.scalar_type()))),
                  at::zeros({B}, x.options().dtype(acc_dtype(x.scalar_type()))), B, is_low(x.scalar_type())};
  auto [lse, tgt, lsum, cnt] = stats_forward(x, w, labels, target_ref, class_offset, scale, m1, m2, m3,
                                             normalize, chunk_classes, &kept);
  return {lse, tgt, lsum, cnt, kept.logits, kept.target};
}

std::tuple<Tensor, Tensor> ce_shard_stats_backward_kept_cuda(
    const Tensor& grad_lse, const Tensor& grad_target, const Tensor& grad_sum, const Tensor& x,
    const Tensor& w, const Tensor& labels, const Tensor& lse, const Tensor& kept_logits,
    const Tensor& kept_target, int64_t class_offset, double scale, double m1, double m2, double m3,
    bool normalize, int64_t chunk_classes, int64_t keep_chunks, bool need_grad_w) {
  check_backward(grad_lse, grad_target, grad_sum, x, w, labels, lse, class_offset, scale, m1, m2, m3,
                 normalize, chunk_classes);
  const int64_t chunk = std::max<int64_t>(1, std::min(chunk_classes, w.size(0)));
  check_kept(x, w, kept_logits, kept_target, chunk, keep_chunks, kept_dtype(x.scalar_type()),
             acc_dtype(x.scalar_type()));
  const KeptLogits kept{KeptChunks(w.size(0), chunk, keep_chunks), kept_logits, kept_target, x.size(0),
                        is_low(x.scalar_type())};
  return stats_backward(grad_lse, grad_target, grad_sum, x, w, labels, lse, class_offset, scale, m1, m2, m3,
                        normalize, chunk_classes, &kept, need_grad_w);
}

}  // namespace
}  // namespace sce
}  // namespace shardkit

TORCH_LIBRARY_IMPL(shardkit, CUDA, m) {
  m.impl("ce_shard_stats", &shardkit::sce::ce_shard_stats_cuda);
  m.impl("ce_shard_stats_backward", &shardkit::sce::ce_shard_stats_backward_cuda);
  m.impl("ce_shard_stats_keep", &shardkit::sce::ce_shard_stats_keep_cuda);
  m.impl("ce_shard_stats_backward_kept", &shardkit::sce::ce_shard_stats_backward_kept_cuda);
}
