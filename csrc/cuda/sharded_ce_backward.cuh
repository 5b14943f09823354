// The backward's per-chunk pieces of the sharded cross-entropy's CUDA kernels (included by
// sharded_ce_cuda.cu, whose helpers they use): the unfused dlogit kernel (fp64; the fp32-logit one
// is in sharded_ce_v2.cuh), the dW fix-up kernel, the chunk buffers and the chunk's dX / dW.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace shardkit {
namespace sce {
namespace {

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
//   v = w (raw rows, G had the factor rw):      dw = tmp - [|w| > eps] (rw (tmp . w)) (rw w)
//   v = w_hat (hat, G without rw, 16-bit path): dw = rw (tmp - [|w| > eps] (tmp . w_hat) w_hat)
template <typename scalar_t, typename T, typename tmp_t, typename out_t = scalar_t>
__global__ void dw_fixup_kernel(const tmp_t* tmp, const scalar_t* __restrict__ v, int64_t s0, int64_t s1,
                                const T* __restrict__ rw, bool hat, int64_t n, int64_t D, out_t* out) {
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  T coef = 0, post = 1, vscale = 1;
  if (rw) {
    T dot = 0;
    for (int64_t k = lane; k < D; k += 32)
      dot += static_cast<T>(tmp[row * D + k]) * static_cast<T>(v[row * s0 + k * s1]);
    for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    const T r = rw[row];
    // The clamp is active where r == 1/eps (up to the rounding of the approximate division
    // of --use_fast_math); a norm just above eps keeps its projection term, as on the CPU.
    const bool active = r < T(0.999 / kEps);
    // Raw rows: the term r^2 (tmp . w) w is formed as (r (tmp . w)) (r w): r^2 alone leaves
    // float's range for a norm above ~1e19 or below ~1e-19 (r^2 = 0 dropped the projection,
    // a 4% error in dW at |w| = 1e25), while r w is a unit row and r (tmp . w) is tmp's size.
    coef = active ? (hat ? dot : r * dot) : T(0);
    vscale = hat ? T(1) : r;
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
        (static_cast<T>(tmp[row * D + k]) - coef * (vscale * static_cast<T>(v[row * s0 + k * s1]))) * post);
}

// SHARDKIT_FUSED_OVERLAP=1: the fused backward runs chunk k's dX / dW GEMMs on a second stream,
// under chunk k + 1's dlogits GEMM, with two sets of chunk buffers of half the size (events
// order every reuse). Not yet measured on a GPU: off by default.
bool overlap_enabled() {
  return env_flag("SHARDKIT_FUSED_OVERLAP", false, "one stream");
}

// The buffers of one chunk of the backward: its dlogits G ([B, chunk], x's dtype; 16-bit only:
// fp32 / fp64 write them over the logits), the fp32 / fp64 logits (with_logits: the unfused
// kernels), its rows converted to x's dtype (mixed), normalized (16-bit normalize), their inverse
// norms (normalize) and the fp32 dW rows before their fix-up (16-bit, normalized, not mixed; none
// for a frozen w: need_w false).
// G and the logits get `pad` elements more (the memory budget's phase shift).
struct ChunkBuffers {
  Tensor g, logits, wbuf, what, rw, tmp;
};

ChunkBuffers chunk_buffers(const Tensor& x, int64_t chunk, int64_t D, bool with_logits, bool low, bool mixed,
                           bool normalize, bool need_w, const at::TensorOptions& acc_opts, int64_t pad = 0) {
  ChunkBuffers b;
  const int64_t B = x.size(0);
  b.logits = with_logits ? at::empty({B * chunk + pad}, acc_opts) : Tensor();
  b.g = low ? at::empty({B * chunk + pad}, x.options()) : Tensor();
  b.wbuf = mixed ? at::empty({chunk * D}, x.options()) : Tensor();
  b.what = low && normalize ? at::empty({chunk * D}, x.options()) : Tensor();
  b.rw = normalize ? at::empty({chunk}, acc_opts) : Tensor();
  b.tmp = need_w && low && !mixed && normalize ? at::empty({chunk * D}, acc_opts) : Tensor();
  return b;
}

// dX += G v (v: the chunk's rows the GEMM used, or their normalized copy) and the chunk's dW
// rows gw = G^T x_in (fixed up through the normalization), on the current stream. `first`: dx
// is uninitialized and the dX GEMM overwrites it (cuBLAS with beta = 0).
void chunk_grads(const Tensor& G, const Tensor& v, const Tensor& xin, const Tensor& rw, const Tensor& tmpbuf,
                 Tensor& dx, Tensor& dxc, Tensor gw, bool low, bool mixed, bool normalize, bool hat,
                 bool first, int64_t n, int64_t D) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto dt = xin.scalar_type();
  if (!low) {  // fp32 / fp64: G holds the gradient w.r.t. the raw rows' dots (times 1 / |w_j|)
    dx.addmm_(G, v);
    if (!gw.defined()) return;  // a frozen w: no dW
    at::mm_out(gw, G.t(), xin);
    if (normalize) {
      AT_DISPATCH_FLOATING_TYPES(dt, "sce_dw", [&] {
        dw_fixup_kernel<scalar_t, scalar_t, scalar_t>
            <<<(n + kBlock / 32 - 1) / (kBlock / 32), kBlock, 0, stream>>>(
                gw.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(), v.stride(0), v.stride(1),
                rw.const_data_ptr<scalar_t>(), /*hat=*/false, n, D, gw.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
    return;
  }
  if (gemm_dx(v.stride(0), v.stride(1), D, n, G.size(0))) {
    addmm_f32_out(dx, G, v, first ? 0.f : 1.f);
  } else {
    // (addmm with out_dtype wants `self` in the input dtype in some torch versions: GEMM into
    // an fp32 temporary and add, an extra O(B*D) per chunk.)
    if (!dxc.defined()) dxc = at::empty(dx.sizes(), dx.options());
    at::mm_out(dxc, G, v, at::kFloat);
    dx.add_(dxc);
  }
  if (!gw.defined()) return;  // a frozen w: no dW
  if (!mixed && !normalize) {
    // The 16-bit rows written once by the GEMM (fp32 accumulation; split-K partial sums may be
    // reduced in 16 bits where torch allows it, as in nn.Linear's own dW).
    at::mm_out(gw, G.t(), xin);
    return;
  }
  // Mixed: the fp32 GEMM output goes straight into the fp32 grad_w rows (contiguous: a narrow of
  // rows of a fresh [C, D] tensor); with normalize the fix-up then runs in place.
  Tensor tmp = mixed ? gw : tmpbuf.narrow(0, 0, n * D).view({n, D});
  at::mm_out(tmp, G.t(), xin, at::kFloat);
  if (mixed && !normalize) return;  // the GEMM wrote the final dW
  AT_DISPATCH_REDUCED_FLOATING_TYPES(dt, "sce_dw_low", [&] {
    const int blocks = (n + kBlock / 32 - 1) / (kBlock / 32);
    if (mixed)
      dw_fixup_kernel<scalar_t, float, float, float><<<blocks, kBlock, 0, stream>>>(
          tmp.const_data_ptr<float>(), v.const_data_ptr<scalar_t>(), v.stride(0), v.stride(1),
          rw.const_data_ptr<float>(), hat, n, D, gw.mutable_data_ptr<float>());
    else
      dw_fixup_kernel<scalar_t, float, float><<<blocks, kBlock, 0, stream>>>(
          tmp.const_data_ptr<float>(), v.const_data_ptr<scalar_t>(), v.stride(0), v.stride(1),
          rw.const_data_ptr<float>(), hat, n, D, gw.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// The chunk's dlogits into G (unfused): from its fp32 / fp64 logits L, recomputed here (G may
// alias L), or, where `kept` is defined, from that kept chunk's raw dots (memory budget: no GEMM,
// the chunk's norms only; traw: the fp32 target values of 16-bit kept dots).
void unfused_dlogits(const Prepared& p, const Tensor& wc, const Tensor& what, Tensor& L, Tensor& G,
                     Tensor& rw, int64_t n, int64_t j0, bool normalize, bool hat, const Tensor& lab,
                     int64_t class_offset, const Tensor& lse, const Tensor& gl, const Tensor& gt,
                     const Tensor& gs, const Margin& mg, cudaStream_t stream, const Tensor& kept = Tensor(),
                     const float* traw = nullptr) {
  if (kept.defined()) {
    if (normalize) chunk_norms(wc, n, rw, what, stream);
  } else {
    chunk_logits(p, wc, n, normalize, L, rw, what, stream);
  }
  const Tensor& src = kept.defined() ? kept : L;
  const int64_t B = G.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, G.scalar_type(), "sce_dlogit", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      const dim3 grid((n + kBlock - 1) / kBlock, std::min<int64_t>(B, 65535));
      dlogit_kernel<double, double><<<grid, kBlock, 0, stream>>>(
          src.const_data_ptr<double>(), G.mutable_data_ptr<double>(), B, n, j0,
          normalize ? rw.const_data_ptr<double>() : nullptr, /*g_times_r=*/true,
          lab.const_data_ptr<int64_t>(), class_offset, lse.const_data_ptr<double>(),
          gl.const_data_ptr<double>(), gt.const_data_ptr<double>(), gs.const_data_ptr<double>(),
          to_device_margin<double>(mg));
    } else {
      // The vectors of src and G line up: the same element phase (the fresh buffers: 0; a kept
      // slot's G is shifted to the slot's phase).
      TORCH_INTERNAL_ASSERT(element_phase(src) == element_phase(G),
                            "the logits and dlogits of a chunk are not at the same element phase");
      // Vectors of a row across x (at most 8 per thread), rows across y: ~4 waves in all.
      const int64_t gx = std::max<int64_t>(1, (n / 4 + 8 * kBlock - 1) / (8 * kBlock));
      const int64_t gy = std::min<int64_t>({B, 65535, std::max<int64_t>(1, 32 * sm_count() / gx)});
      const auto launch = [&](auto* in) {
        using in_t = std::remove_const_t<std::remove_pointer_t<decltype(in)>>;
        dlogit_v2_kernel<in_t, scalar_t><<<dim3(gx, gy), kBlock, 0, stream>>>(
            in, G.mutable_data_ptr<scalar_t>(), B, n, j0, normalize ? rw.const_data_ptr<float>() : nullptr,
            traw,
            /*g_times_r=*/!hat, lab.const_data_ptr<int64_t>(), class_offset, lse.const_data_ptr<float>(),
            gl.const_data_ptr<float>(), gt.const_data_ptr<float>(), gs.const_data_ptr<float>(),
            to_device_margin<float>(mg));
      };
      // 16-bit kept raw dots are read in their dtype (a type that only 16-bit G instantiates).
      using low_t = std::conditional_t<std::is_same_v<scalar_t, double>, float, scalar_t>;
      if (src.scalar_type() != at::kFloat)
        launch(src.const_data_ptr<low_t>());
      else
        launch(src.const_data_ptr<float>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace sce
}  // namespace shardkit
