// CUDA kernels of the sharded cross-entropy (shardkit::ce_shard_stats and its backward).
//
// Host loop over class chunks on the current stream: per chunk one cuBLAS GEMM producing fp32
// logits (at::mm_out with out_dtype=float for bf16/fp16 inputs), then a fused kernel:
//   forward:  one block per row folds the chunk into running [B] statistics (online
//             max/sum-exp with warp shuffles, margin at the target column, logit sum, count);
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
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
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
  T ss = 0;
  for (int64_t k = lane; k < D; k += 32) {
    const T v = static_cast<T>(w[row * s0 + k * s1]);
    ss += v * v;
  }
  for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);  // every lane: the sum
  const T rn = T(1) / max(sqrt(ss), T(kEps));
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

// Backward: G[i, j] = d loss / d(cos_ij) (d loss / d(z_ij) without normalization), in the GEMM
// dtype g_t; with g_times_r also times rw[j], which makes G the gradient w.r.t. the dots with
// the RAW weight rows (fp32 / fp64 only: in 16 bits, 1 / |w_j| would overflow fp16 for small
// rows, and inf * 0 in the dX GEMM would turn every row's dX into NaN).
template <typename T, typename g_t>
__global__ void dlogit_kernel(const T* L, g_t* G, int64_t B, int64_t n, int64_t j0,  // G may alias L
                              const T* __restrict__ rw, bool g_times_r, const int64_t* __restrict__ labels,
                              int64_t class_offset, const T* __restrict__ lse, const T* __restrict__ gl,
                              const T* __restrict__ gt, const T* __restrict__ gs, MarginT<T> mg) {
  const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const T r = rw ? rw[j] : T(1);
  const T rg = g_times_r ? r : T(1);
  for (int64_t i = blockIdx.y; i < B; i += gridDim.y) {
    const int64_t idx = i * n + j;
    const T c = L[idx] * r;
    const bool is_t = labels[i] - class_offset - j0 == j;
    T z = scaled_logit(mg.scale, c), dpsi = 1;
    if (is_t && mg.normalize) {
      T psi;
      margin_psi<T>(c, mg.plain, mg.m1, mg.m2, mg.m3, mg.c_max, &psi, &dpsi);
      z = scaled_logit(mg.scale, psi);
    }
    const T dz = gl[i] * dev_exp(z - lse[i]) + gs[i] + (is_t ? gt[i] : T(0));
    G[idx] = static_cast<g_t>(mg.scale * dpsi * dz * rg);  // in place when g_t == T
  }
}

// grad_w rows from tmp = G^T @ X (fp32 or the grad's dtype; may alias out): plain copy /
// convert, or with normalize the projection through w_hat = w / max(|w|, eps):
//   v = w (raw rows, G had the factor rw):      dw = tmp - [|w| > eps] rw^2 (tmp . w) w
//   v = w_hat (hat, G without rw, 16-bit path): dw = rw (tmp - [|w| > eps] (tmp . w_hat) w_hat)
template <typename scalar_t, typename T, typename tmp_t, typename out_t = scalar_t>
__global__ void dw_fixup_kernel(const tmp_t* tmp, const scalar_t* __restrict__ v, int64_t s0, int64_t s1,
                                const T* __restrict__ rw, bool hat, int64_t n, int64_t D, out_t* out) {
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  T coef = 0, post = 1;
  if (rw) {
    T dot = 0;
    for (int64_t k = lane; k < D; k += 32)
      dot += static_cast<T>(tmp[row * D + k]) * static_cast<T>(v[row * s0 + k * s1]);
    for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    const T r = rw[row];
    // The clamp is active where r == 1/eps (up to the rounding of the approximate division
    // of --use_fast_math); a norm just above eps keeps its projection term, as on the CPU.
    const bool active = r < T(0.999 / kEps);
    coef = active ? (hat ? dot : r * r * dot) : T(0);
    post = hat ? r : T(1);
  }
  __syncwarp();
  if (!rw) {  // a plain copy / conversion: w is not read (0 * an inf weight would be NaN)
    for (int64_t k = lane; k < D; k += 32)
      out[row * D + k] = static_cast<out_t>(static_cast<T>(tmp[row * D + k]));
    return;
  }
  for (int64_t k = lane; k < D; k += 32)
    out[row * D + k] = static_cast<out_t>(
        (static_cast<T>(tmp[row * D + k]) - coef * static_cast<T>(v[row * s0 + k * s1])) * post);
}

}  // namespace
}  // namespace sce
}  // namespace shardkit

#include "sharded_ce_v2.cuh"

namespace shardkit {
namespace sce {
namespace {

// The wider statistics / dlogit kernels (sharded_ce_v2.cuh), the dW GEMM written straight in
// a 16-bit gradient's dtype and dX accumulated by the GEMM (beta = 1) in fp32 are the default
// (validated and timed on an H100, benchmarks/RESULTS.md); SHARDKIT_CE_V2=0 selects the first
// kernels (for bisecting and for the benchmark's before/after). Read on every call, so a
// process can compare both.
bool ce_v2_enabled() {
  return env_flag("SHARDKIT_CE_V2", true, "the default (second) kernels run");
}

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

// dx [B, D] (fp32, contiguous) += G [B, n] @ v [n, D] (both 16-bit, rows contiguous): cuBLAS
// with fp32 accumulation and beta = 1, no [B, D] temporary.
void addmm_f32_out(Tensor& dx, const Tensor& G, const Tensor& v) {
  const cudaDataType_t ab = G.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  const float one = 1.f;
  const int64_t rows = G.size(0), n = G.size(1), D = v.size(1);
  TORCH_CUDABLAS_CHECK(cublasGemmEx(at::cuda::getCurrentCUDABlasHandle(), CUBLAS_OP_N, CUBLAS_OP_N,
                                    static_cast<int>(D), static_cast<int>(rows), static_cast<int>(n), &one,
                                    v.const_data_ptr(), ab, static_cast<int>(v.stride(0)), G.const_data_ptr(),
                                    ab, static_cast<int>(G.stride(0)), &one, dx.mutable_data_ptr(),
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
  p.xnrm = at::linalg_vector_norm(xa, 2, {1}, true).clamp_min(kEps);
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

std::tuple<Tensor, Tensor, Tensor, Tensor> ce_shard_stats_cuda(const Tensor& x, const Tensor& w,
                                                               const Tensor& labels,
                                                               const c10::optional<Tensor>& target_ref,
                                                               int64_t class_offset, double scale, double m1,
                                                               double m2, double m3, bool normalize,
                                                               int64_t chunk_classes) {
  check_forward(x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes);
  // Called below autograd (register_autograd handles it); inputs may still require grad,
  // which out= ATen calls refuse.
  const at::NoGradGuard no_grad;
  TORCH_CHECK(x.is_cuda(), "argument `x` must be a CUDA tensor here, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const auto acc = acc_dtype(x.scalar_type());
  const int64_t B = x.size(0), C = w.size(0);
  const auto opts = x.options().dtype(acc);
  Tensor M = at::full({B}, -std::numeric_limits<double>::infinity(), opts);
  Tensor S = at::zeros({B}, opts), LS = at::zeros({B}, opts), TG = at::zeros({B}, opts);
  Tensor CN = at::zeros({B}, x.options().dtype(at::kLong));
  if (B == 0 || C == 0) return {M, TG, LS, CN};
  const Margin mg = make_margin(scale, m1, m2, m3, normalize);
  const bool count = target_ref.has_value() && target_ref->defined();
  const Tensor tref = count ? target_ref->to(acc).contiguous() : Tensor();
  const Tensor lab = labels.contiguous();
  const Prepared p = prepare_x(x, normalize);
  const bool mixed = w.scalar_type() != x.scalar_type();
  const bool fz = acc == at::kFloat && use_fused(p.xin, w, mixed);
  // The fused forward holds no logits: its chunks are larger, within the (fused) backward's
  // memory.
  const int64_t D = w.size(1);
  const int64_t tile_cols = fz ? fused::forward_tile_cols() : 0;  // read once: the chunk and scratch agree
  const int64_t chunk =
      fz ? fused::forward_chunk(B, D, C,
                                fused::backward_chunk(B, D, C, std::min(chunk_classes, C), x.element_size(),
                                                      mixed, normalize, ce_v2_enabled()),
                                x.element_size(), mixed, normalize, tile_cols)
         : std::min(chunk_classes, C);
  Tensor rw = normalize ? at::empty({chunk}, opts) : Tensor();
  // Mixed mode: the chunk's rows converted to x's dtype, [chunk, D].
  const Tensor wbuf = mixed ? at::empty({chunk * w.size(1)}, x.options()) : Tensor();
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (fz) {  // no logits in memory
    const fused::Running run{M.mutable_data_ptr<float>(), S.mutable_data_ptr<float>(),
                             LS.mutable_data_ptr<float>(), TG.mutable_data_ptr<float>(),
                             CN.mutable_data_ptr<int64_t>()};
    const fused::Scratch sc = fused::make_scratch(p.xin, chunk, tile_cols);
    for (int64_t j0 = 0; j0 < C; j0 += chunk) {
      const int64_t n = std::min(chunk, C - j0);
      const Tensor wc = weight_chunk(w, wbuf, j0, n);
      if (normalize) chunk_norms(wc, n, rw, Tensor(), stream);
      fused::EpiParams e = epi_params(mg, lab, class_offset, j0, rw);
      e.tref = count ? tref.const_data_ptr<float>() : nullptr;
      fused::forward(p.xin, wc, e, run, sc, stream);
    }
    Tensor lse = M.add_(S.log_());
    return {lse, TG, LS, CN};
  }
  Tensor lbuf = at::empty({B * chunk}, opts);
  // The wider kernels (float statistics only): per-range partials, [parts, B] each.
  const bool v2 = ce_v2_enabled() && acc == at::kFloat && is_aligned(lbuf.const_data_ptr(), 16);
  const int max_parts = v2 ? row_parts(B, chunk) : 1;
  Tensor part_f = max_parts > 1 ? at::empty({3, max_parts * B}, opts) : Tensor();
  Tensor part_c = max_parts > 1 ? at::empty({max_parts * B}, CN.options()) : Tensor();
  for (int64_t j0 = 0; j0 < C; j0 += chunk) {
    const int64_t n = std::min(chunk, C - j0);
    Tensor L = lbuf.narrow(0, 0, B * n).view({B, n});
    chunk_logits(p, weight_chunk(w, wbuf, j0, n), n, normalize, L, rw, Tensor(), stream);
    if (v2) {
      const int parts = std::min(max_parts, row_parts(B, n));
      float* pf = parts > 1 ? part_f.mutable_data_ptr<float>() : nullptr;
      row_stats_v2_kernel<<<B * parts, kBlock, 0, stream>>>(
          L.const_data_ptr<float>(), n, j0, normalize ? rw.const_data_ptr<float>() : nullptr,
          lab.const_data_ptr<int64_t>(), class_offset, count ? tref.const_data_ptr<float>() : nullptr,
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
      continue;
    }
    AT_DISPATCH_FLOATING_TYPES(acc, "ce_shard_stats_cuda", [&] {
      using T = scalar_t;
      row_stats_kernel<T><<<B, kBlock, 0, stream>>>(
          L.const_data_ptr<T>(), n, j0, normalize ? rw.const_data_ptr<T>() : nullptr,
          lab.const_data_ptr<int64_t>(), class_offset, count ? tref.const_data_ptr<T>() : nullptr,
          to_device_margin<T>(mg), M.mutable_data_ptr<T>(), S.mutable_data_ptr<T>(), LS.mutable_data_ptr<T>(),
          TG.mutable_data_ptr<T>(), CN.mutable_data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  Tensor lse = M.add_(S.log_());
  return {lse, TG, LS, CN};
}

std::tuple<Tensor, Tensor> ce_shard_stats_backward_cuda(const Tensor& grad_lse, const Tensor& grad_target,
                                                        const Tensor& grad_sum, const Tensor& x,
                                                        const Tensor& w, const Tensor& labels,
                                                        const Tensor& lse_in, int64_t class_offset,
                                                        double scale, double m1, double m2, double m3,
                                                        bool normalize, int64_t chunk_classes) {
  check_backward(grad_lse, grad_target, grad_sum, x, w, labels, lse_in, class_offset, scale, m1, m2, m3,
                 normalize, chunk_classes);
  // Called below autograd (register_autograd handles it); inputs may still require grad,
  // which out= ATen calls refuse.
  const at::NoGradGuard no_grad;
  TORCH_CHECK(x.is_cuda(), "argument `x` must be a CUDA tensor here, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const auto acc = acc_dtype(x.scalar_type());
  const auto dt = x.scalar_type();
  const int64_t B = x.size(0), D = x.size(1), C = w.size(0);
  Tensor grad_w = at::empty({C, D}, w.options());
  if (B == 0 || C == 0) return {at::zeros({B, D}, x.options()), grad_w.zero_()};
  const Margin mg = make_margin(scale, m1, m2, m3, normalize);
  const auto opts = x.options().dtype(acc);
  const Tensor gl = grad_lse.to(acc).contiguous(), gt = grad_target.to(acc).contiguous(),
               gs = grad_sum.to(acc).contiguous(), lse = lse_in.to(acc).contiguous(),
               lab = labels.contiguous();
  const Prepared p = prepare_x(x, normalize);
  const bool low = dt != acc;  // bf16 / fp16: dlogits in the input dtype, fp32 temporaries
  // Mixed mode (fp32 w, 16-bit x): w's chunks converted into wbuf (x's dtype); dW is the fp32
  // GEMM output written straight into grad_w (fp32), so no fp32 temporary tbuf.
  const bool mixed = w.scalar_type() != dt;
  // The second kernels (the default; SHARDKIT_CE_V2=0: the first): the wider dlogit kernel; 16-bit plain dW
  // straight from the GEMM in the gradient's dtype (no fp32 temporary, no fix-up); dX accumulated by the GEMM
  // in fp32.
  const bool v2 = ce_v2_enabled() && acc == at::kFloat;
  const bool dw_direct = v2 && low && !mixed && !normalize;
  // The fused kernels write the dlogits straight from the GEMM (no fp32 logits), so their
  // chunks are larger within the same memory.
  const bool fz = acc == at::kFloat && low && use_fused(p.xin, w, mixed);
  const int64_t chunk =
      fz ? fused::backward_chunk(B, D, C, std::min(chunk_classes, C), x.element_size(), mixed, normalize, v2)
         : std::min(chunk_classes, C);
  const Tensor wbuf = mixed ? at::empty({chunk * D}, x.options()) : Tensor();
  const fused::Scratch sc = fz ? fused::make_scratch(p.xin, chunk, /*tile_cols=*/0) : fused::Scratch();
  Tensor lbuf = fz ? Tensor() : at::empty({B * chunk}, opts);
  Tensor gbuf = low ? at::empty({B * chunk}, x.options()) : Tensor();
  Tensor tbuf = low && !mixed && !dw_direct ? at::empty({chunk * D}, opts) : Tensor();
  Tensor dxc;  // [B, D] fp32 chunk product, made on first use (the fp32-accumulating GEMM needs none)
  Tensor rw = normalize ? at::empty({chunk}, opts) : Tensor();
  // 16-bit with normalize: G stays d loss / d cos (bounded like torch's own 16-bit dlogits)
  // and the dX GEMM uses the chunk's normalized rows, [chunk, D] in the input dtype.
  const bool hat = low && normalize;
  Tensor whatbuf = hat ? at::empty({chunk * D}, x.options()) : Tensor();
  Tensor dx = at::zeros({B, D}, opts);  // w.r.t. the GEMM's x (normalized x when normalize)
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (int64_t j0 = 0; j0 < C; j0 += chunk) {
    const int64_t n = std::min(chunk, C - j0);
    const Tensor what = hat ? whatbuf.narrow(0, 0, n * D).view({n, D}) : Tensor();
    const Tensor wc = weight_chunk(w, wbuf, j0, n);  // x's dtype
    Tensor L = fz ? Tensor() : lbuf.narrow(0, 0, B * n).view({B, n});
    Tensor G = low ? gbuf.narrow(0, 0, B * n).view({B, n}) : L;
    if (fz) {
      if (normalize) chunk_norms(wc, n, rw, what, stream);
      fused::EpiParams e = epi_params(mg, lab, class_offset, j0, rw);
      e.lse = lse.const_data_ptr<float>();
      e.gl = gl.const_data_ptr<float>();
      e.gt = gt.const_data_ptr<float>();
      e.gs = gs.const_data_ptr<float>();
      e.g_times_r = !hat;
      e.g = G.mutable_data_ptr();
      e.ldg = n;
      fused::backward(p.xin, wc, e, sc, stream);
    } else {
      chunk_logits(p, wc, n, normalize, L, rw, what, stream);
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dt, "sce_dlogit", [&] {
        using T = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
        if constexpr (std::is_same_v<T, float>) {
          if (v2 && is_aligned(L.const_data_ptr(), 16) &&
              is_aligned(G.const_data_ptr(), 4 * sizeof(scalar_t))) {
            // Vectors of a row across x (at most 8 per thread), rows across y: ~4 waves in all.
            const int64_t gx = std::max<int64_t>(1, (n / 4 + 8 * kBlock - 1) / (8 * kBlock));
            const int64_t gy = std::min<int64_t>({B, 65535, std::max<int64_t>(1, 32 * sm_count() / gx)});
            dlogit_v2_kernel<scalar_t><<<dim3(gx, gy), kBlock, 0, stream>>>(
                L.const_data_ptr<float>(), G.mutable_data_ptr<scalar_t>(), B, n, j0,
                normalize ? rw.const_data_ptr<float>() : nullptr, /*g_times_r=*/!hat,
                lab.const_data_ptr<int64_t>(), class_offset, lse.const_data_ptr<float>(),
                gl.const_data_ptr<float>(), gt.const_data_ptr<float>(), gs.const_data_ptr<float>(),
                to_device_margin<float>(mg));
            C10_CUDA_KERNEL_LAUNCH_CHECK();
            return;
          }
        }
        const dim3 grid((n + kBlock - 1) / kBlock, std::min<int64_t>(B, 65535));
        dlogit_kernel<T, scalar_t><<<grid, kBlock, 0, stream>>>(
            L.const_data_ptr<T>(), G.mutable_data_ptr<scalar_t>(), B, n, j0,
            normalize ? rw.const_data_ptr<T>() : nullptr, /*g_times_r=*/!hat, lab.const_data_ptr<int64_t>(),
            class_offset, lse.const_data_ptr<T>(), gl.const_data_ptr<T>(), gt.const_data_ptr<T>(),
            gs.const_data_ptr<T>(), to_device_margin<T>(mg));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
    Tensor gw = grad_w.narrow(0, j0, n);
    if (low) {
      // (addmm with out_dtype wants `self` in the input dtype in some torch versions: GEMM into
      // an fp32 temporary and add, an extra O(B*D) per chunk.)
      const Tensor& v = hat ? what : wc;  // the rows the dX GEMM and the dW fix-up use
      if (v2 && v.stride(1) == 1 && v.stride(0) >= D && v.stride(0) <= INT32_MAX && n <= INT32_MAX &&
          B <= INT32_MAX) {
        addmm_f32_out(dx, G, v);
      } else {
        if (!dxc.defined()) dxc = at::empty({B, D}, opts);
        at::mm_out(dxc, G, v, acc);
        dx.add_(dxc);
      }
      if (dw_direct) {
        // The 16-bit rows written once by the GEMM (fp32 accumulation; split-K partial sums
        // may be reduced in 16 bits where torch allows it, as in nn.Linear's own dW).
        at::mm_out(gw, G.t(), p.xin);
        continue;
      }
      // Mixed: the fp32 GEMM output goes straight into the fp32 grad_w rows (contiguous: a
      // narrow of rows of a fresh [C, D] tensor); with normalize the fix-up then runs in place.
      Tensor tmp = mixed ? gw : tbuf.narrow(0, 0, n * D).view({n, D});
      at::mm_out(tmp, G.t(), p.xin, acc);
      if (mixed && normalize) {  // (mixed without normalize: the GEMM wrote the final dW)
        AT_DISPATCH_REDUCED_FLOATING_TYPES(dt, "sce_dw_mixed", [&] {
          dw_fixup_kernel<scalar_t, float, float, float>
              <<<(n + kBlock / 32 - 1) / (kBlock / 32), kBlock, 0, stream>>>(
                  tmp.const_data_ptr<float>(), v.const_data_ptr<scalar_t>(), v.stride(0), v.stride(1),
                  rw.const_data_ptr<float>(), hat, n, D, gw.mutable_data_ptr<float>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      } else if (!mixed) {
        AT_DISPATCH_REDUCED_FLOATING_TYPES(dt, "sce_dw_low", [&] {
          dw_fixup_kernel<scalar_t, float, float>
              <<<(n + kBlock / 32 - 1) / (kBlock / 32), kBlock, 0, stream>>>(
                  tmp.const_data_ptr<float>(), v.const_data_ptr<scalar_t>(), v.stride(0), v.stride(1),
                  normalize ? rw.const_data_ptr<float>() : nullptr, hat, n, D,
                  gw.mutable_data_ptr<scalar_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      }
    } else {
      dx.addmm_(G, wc);
      at::mm_out(gw, G.t(), p.xin);
      if (normalize) {
        AT_DISPATCH_FLOATING_TYPES(dt, "sce_dw", [&] {
          dw_fixup_kernel<scalar_t, scalar_t, scalar_t>
              <<<(n + kBlock / 32 - 1) / (kBlock / 32), kBlock, 0, stream>>>(
                  gw.const_data_ptr<scalar_t>(), wc.const_data_ptr<scalar_t>(), wc.stride(0), wc.stride(1),
                  rw.const_data_ptr<scalar_t>(), /*hat=*/false, n, D, gw.mutable_data_ptr<scalar_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      }
    }
  }
  if (normalize) {
    // Through x_hat = x / max(|x|, eps): dx = (dx_hat - [|x| >= eps] (dx_hat . x_hat) x_hat) / nrm.
    const Tensor active = p.xnrm > kEps;
    dx = (dx - (dx * p.xf).sum(1, true) * p.xf * active) / p.xnrm;
  }
  return {dx.to(dt), grad_w};
}

}  // namespace
}  // namespace sce
}  // namespace shardkit

TORCH_LIBRARY_IMPL(shardkit, CUDA, m) {
  m.impl("ce_shard_stats", &shardkit::sce::ce_shard_stats_cuda);
  m.impl("ce_shard_stats_backward", &shardkit::sce::ce_shard_stats_backward_cuda);
}
