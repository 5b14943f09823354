// CPU kernels of the sharded cross-entropy (shardkit::ce_shard_stats and its backward).
//
// Host loop over class chunks: one GEMM per chunk (at::mm_out -> MKL) into a reused
// [B, chunk] buffer, then a fused pass per row (at::parallel_for over rows) that folds the
// chunk into running [B] statistics (forward) or turns the logits into dlogits in place
// (backward), followed by the dX / dW GEMMs. Extra memory: O(B*chunk + chunk*D).
//
// The row loops are written so that GCC vectorizes them (omp simd reductions, a branch-free
// exp) and are compiled in several ISA versions (target_clones, picked at load time by the
// CPU's features), since the extension itself is built without -march.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "sharded_ce_common.h"

namespace shardkit {
namespace sce {
namespace {

using at::Tensor;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SCE_CLONES __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
#else
#define SCE_CLONES
#endif

// exp(x) for float without libm calls, so loops around it vectorize: Cody-Waite reduction
// x = n ln2 + r, |r| <= ln2/2, degree-7 polynomial (Cephes' expf coefficients), 2^n from the
// exponent bits. Relative error ~2 ulp; returns 0 below -87.3 (results would be denormal).
inline float exp_fast(float x) {
  const float hi = 88.0f, lo = -87.3365478515625f;
  const bool under = x < lo;
  x = x > hi ? hi : (x < lo ? lo : x);
  // Round-to-nearest through the 1.5*2^23 trick (no floor/rint: those need SSE4.1).
  const float magic = 12582912.0f;
  const float fn = (x * 1.44269504088896341f + magic) - magic;
  const float r = (x - fn * 0.693359375f) - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fn) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return under ? 0.0f : p * two_n;
}
inline double exp_fast(double x) { return std::exp(x); }

// z[j] <- s * z[j]; returns max_j z[j] and adds #{j : z[j] > ref} to *count (if count).
SCE_CLONES float scale_max_count_f(float* z, int64_t n, float s, float ref, bool count, int64_t* cnt) {
  float mx = -std::numeric_limits<float>::infinity();
  int32_t c = 0;
  if (count) {
#pragma omp simd reduction(max : mx) reduction(+ : c)
    for (int64_t j = 0; j < n; ++j) {
      const float v = z[j] * s;
      z[j] = v;
      mx = v > mx ? v : mx;
      c += v > ref ? 1 : 0;
    }
  } else {
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < n; ++j) {
      const float v = z[j] * s;
      z[j] = v;
      mx = v > mx ? v : mx;
    }
  }
  *cnt += c;
  return mx;
}

// Returns sum_j exp(z[j] - m); adds sum_j z[j] to *zsum.
SCE_CLONES float expsum_f(const float* z, int64_t n, float m, float* zsum) {
  float se = 0.f, sz = 0.f;
#pragma omp simd reduction(+ : se, sz)
  for (int64_t j = 0; j < n; ++j) {
    se += exp_fast(z[j] - m);
    sz += z[j];
  }
  *zsum += sz;
  return se;
}

// z[j] <- s * (gl * exp(s * z[j] - lse) + gs): dlogit of the plain (non-target) columns.
SCE_CLONES void dlogit_f(float* z, int64_t n, float s, float lse, float gl, float gs) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) z[j] = s * (gl * exp_fast(s * z[j] - lse) + gs);
}

// Generic (double) versions of the three loops.
double scale_max_count_f(double* z, int64_t n, double s, double ref, bool count, int64_t* cnt) {
  double mx = -std::numeric_limits<double>::infinity();
  int64_t c = 0;
  for (int64_t j = 0; j < n; ++j) {
    z[j] *= s;
    mx = z[j] > mx ? z[j] : mx;
    c += (count && z[j] > ref) ? 1 : 0;
  }
  *cnt += c;
  return mx;
}
double expsum_f(const double* z, int64_t n, double m, double* zsum) {
  double se = 0, sz = 0;
  for (int64_t j = 0; j < n; ++j) {
    se += std::exp(z[j] - m);
    sz += z[j];
  }
  *zsum += sz;
  return se;
}
void dlogit_f(double* z, int64_t n, double s, double lse, double gl, double gs) {
  for (int64_t j = 0; j < n; ++j) z[j] = s * (gl * std::exp(s * z[j] - lse) + gs);
}

// Rows [r0, r1) of src (any float dtype, row stride src_stride) -> dst (acc T, contiguous,
// [rows, D]), L2-normalized when normalize; nrm[r] = max(|row|, 1e-12) is kept for backward.
template <typename scalar_t, typename T>
void load_rows(const scalar_t* src, int64_t s0, int64_t s1, int64_t rows, int64_t D, bool normalize,
               T* dst, T* nrm) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1)), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const scalar_t* in = src + r * s0;
      T* out = dst + r * D;
      T ss = 0;
      for (int64_t k = 0; k < D; ++k) {
        const T v = static_cast<T>(in[k * s1]);
        out[k] = v;
        ss += v * v;
      }
      if (normalize) {
        const T nr = std::max(std::sqrt(ss), T(1e-12));
        nrm[r] = nr;
        const T inv = T(1) / nr;
        for (int64_t k = 0; k < D; ++k) out[k] *= inv;
      }
    }
  });
}

// Backward of u = v / max(|v|, eps) for rows: dv = (du - [|v| >= eps] (du . u) u) / nrm,
// written (converted) to out rows.
template <typename scalar_t, typename T>
void normalize_backward_rows(const T* du, const T* u, const T* nrm, int64_t rows, int64_t D, scalar_t* out) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1)), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const T* g = du + r * D;
      const T* uu = u + r * D;
      T dot = 0;
      for (int64_t k = 0; k < D; ++k) dot += g[k] * uu[k];
      if (nrm[r] <= T(1e-12)) dot = 0;  // clamp active: the norm is a constant
      const T inv = T(1) / nrm[r];
      for (int64_t k = 0; k < D; ++k) out[r * D + k] = static_cast<scalar_t>((g[k] - dot * uu[k]) * inv);
    }
  });
}

struct Shard {
  Tensor x;  // [B, D] acc dtype, contiguous, normalized when normalize
  Tensor xnrm;
  Tensor wbuf, wnrm;  // [chunk, D], [chunk]: the current chunk of w in acc dtype
  Tensor lbuf;        // [B * chunk]
  int64_t B, D, C, chunk;
};

Shard prepare(const Tensor& x, const Tensor& w, bool normalize, int64_t chunk_classes) {
  Shard sh;
  sh.B = x.size(0);
  sh.D = x.size(1);
  sh.C = w.size(0);
  sh.chunk = std::max<int64_t>(1, std::min(chunk_classes, sh.C));
  const auto opts = x.options().dtype(acc_dtype(x.scalar_type()));
  sh.x = at::empty({sh.B, sh.D}, opts);
  sh.xnrm = at::empty({sh.B}, opts);
  sh.wbuf = at::empty({sh.chunk, sh.D}, opts);
  sh.wnrm = at::empty({sh.chunk}, opts);
  sh.lbuf = at::empty({sh.B * sh.chunk}, opts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sce_load_x", [&] {
    using T = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    load_rows<scalar_t, T>(x.const_data_ptr<scalar_t>(), x.stride(0), x.stride(1), sh.B, sh.D, normalize,
                           sh.x.mutable_data_ptr<T>(), sh.xnrm.mutable_data_ptr<T>());
  });
  return sh;
}

// Loads w[j0 : j0+n] into sh.wbuf (normalized if asked) and returns the chunk's logits
// x @ w_chunk^T as a contiguous [B, n] view of sh.lbuf.
Tensor chunk_logits(Shard& sh, const Tensor& w, int64_t j0, int64_t n, bool normalize) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "sce_load_w", [&] {
    using T = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    load_rows<scalar_t, T>(w.const_data_ptr<scalar_t>() + j0 * w.stride(0), w.stride(0), w.stride(1), n, sh.D,
                           normalize, sh.wbuf.mutable_data_ptr<T>(), sh.wnrm.mutable_data_ptr<T>());
  });
  Tensor L = sh.lbuf.narrow(0, 0, sh.B * n).view({sh.B, n});
  at::mm_out(L, sh.x, sh.wbuf.narrow(0, 0, n).t());
  return L;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> ce_shard_stats_cpu(const Tensor& x, const Tensor& w,
                                                              const Tensor& labels,
                                                              const c10::optional<Tensor>& target_ref,
                                                              int64_t class_offset, double scale, double m1,
                                                              double m2, double m3, bool normalize,
                                                              int64_t chunk_classes) {
  check_forward(x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes);
  const auto acc = acc_dtype(x.scalar_type());
  const int64_t B = x.size(0), C = w.size(0);
  const auto opts = x.options().dtype(acc);
  Tensor lse = at::full({B}, -std::numeric_limits<double>::infinity(), opts);
  Tensor tgt = at::zeros({B}, opts), lsum = at::zeros({B}, opts);
  Tensor cnt = at::zeros({B}, x.options().dtype(at::kLong));
  if (B == 0 || C == 0) return {lse, tgt, lsum, cnt};
  const Margin mg = make_margin(scale, m1, m2, m3, normalize);
  const bool count = target_ref.has_value() && target_ref->defined();
  const Tensor tref = count ? target_ref->to(acc).contiguous() : Tensor();
  const Tensor lab = labels.contiguous();
  Tensor sexp = at::zeros({B}, opts);  // running sum of exp(z - lse) with lse the running max
  Shard sh = prepare(x, w, normalize, chunk_classes);
  AT_DISPATCH_FLOATING_TYPES(acc, "ce_shard_stats_cpu", [&] {
    using T = scalar_t;
    T* M = lse.mutable_data_ptr<T>();
    T* S = sexp.mutable_data_ptr<T>();
    T* tg = tgt.mutable_data_ptr<T>();
    T* ls = lsum.mutable_data_ptr<T>();
    int64_t* cn = cnt.mutable_data_ptr<int64_t>();
    const int64_t* y = lab.const_data_ptr<int64_t>();
    const T* tr = count ? tref.const_data_ptr<T>() : nullptr;
    const T s = static_cast<T>(mg.scale);
    for (int64_t j0 = 0; j0 < C; j0 += sh.chunk) {
      const int64_t n = std::min(sh.chunk, C - j0);
      Tensor L = chunk_logits(sh, w, j0, n, normalize);
      T* Lp = L.mutable_data_ptr<T>();
      at::parallel_for(0, B, std::max<int64_t>(1, 4096 / n), [&](int64_t b0, int64_t b1) {
        for (int64_t i = b0; i < b1; ++i) {
          T* z = Lp + i * n;
          const int64_t t = y[i] - class_offset - j0;
          const bool has_t = t >= 0 && t < n;
          const T ref = count ? tr[i] : T(0);
          T c_t = 0, psi = 0, dpsi = 0;
          if (has_t) {
            c_t = z[t];
            psi = c_t;
            if (normalize)
              margin_psi<T>(c_t, mg.plain_target, T(mg.m1), T(mg.m2), T(mg.m3), T(mg.c_max), &psi, &dpsi);
            z[t] = psi;  // scaled with the rest of the row below
          }
          int64_t c = 0;
          const T mx = scale_max_count_f(z, n, s, ref, count, &c);
          if (has_t && count) c += (s * c_t > ref ? 1 : 0) - (z[t] > ref ? 1 : 0);  // plain logit counts
          const T m_new = std::max(M[i], mx);
          T zs = 0;
          const T se = expsum_f(z, n, m_new, &zs);
          S[i] = (M[i] == -std::numeric_limits<T>::infinity() ? T(0) : S[i] * std::exp(M[i] - m_new)) + se;
          M[i] = m_new;
          ls[i] += zs;
          cn[i] += c;
          if (has_t) tg[i] = z[t];
        }
      });
    }
  });
  lse.add_(sexp.log_());
  return {lse, tgt, lsum, cnt};
}

std::tuple<Tensor, Tensor> ce_shard_stats_backward_cpu(const Tensor& grad_lse, const Tensor& grad_target,
                                                       const Tensor& grad_sum, const Tensor& x, const Tensor& w,
                                                       const Tensor& labels, const Tensor& lse_in,
                                                       int64_t class_offset, double scale, double m1, double m2,
                                                       double m3, bool normalize, int64_t chunk_classes) {
  check_backward(grad_lse, grad_target, grad_sum, x, w, labels, lse_in, class_offset, scale, m1, m2, m3,
                 normalize, chunk_classes);
  const auto acc = acc_dtype(x.scalar_type());
  const int64_t B = x.size(0), D = x.size(1), C = w.size(0);
  Tensor grad_w = at::empty({C, D}, w.options());
  if (B == 0 || C == 0) return {at::zeros({B, D}, x.options()), grad_w.zero_()};
  const Margin mg = make_margin(scale, m1, m2, m3, normalize);
  const Tensor gl = grad_lse.to(acc).contiguous(), gt = grad_target.to(acc).contiguous(),
               gs = grad_sum.to(acc).contiguous(), lse = lse_in.to(acc).contiguous(), lab = labels.contiguous();
  Shard sh = prepare(x, w, normalize, chunk_classes);
  Tensor dx = at::zeros({B, D}, sh.x.options());  // d/d(normalized x) when normalize
  const bool direct_dw = !normalize && w.scalar_type() == acc;
  Tensor dwbuf = direct_dw ? Tensor() : at::empty({sh.chunk, D}, sh.x.options());
  AT_DISPATCH_FLOATING_TYPES(acc, "ce_shard_stats_backward_cpu", [&] {
    using T = scalar_t;
    const T *pgl = gl.const_data_ptr<T>(), *pgt = gt.const_data_ptr<T>(), *pgs = gs.const_data_ptr<T>(),
            *plse = lse.const_data_ptr<T>();
    const int64_t* y = lab.const_data_ptr<int64_t>();
    const T s = static_cast<T>(mg.scale);
    for (int64_t j0 = 0; j0 < C; j0 += sh.chunk) {
      const int64_t n = std::min(sh.chunk, C - j0);
      Tensor L = chunk_logits(sh, w, j0, n, normalize);
      T* Lp = L.mutable_data_ptr<T>();
      at::parallel_for(0, B, std::max<int64_t>(1, 4096 / n), [&](int64_t b0, int64_t b1) {
        for (int64_t i = b0; i < b1; ++i) {
          T* z = Lp + i * n;
          const int64_t t = y[i] - class_offset - j0;
          const bool has_t = t >= 0 && t < n;
          const T c_t = has_t ? z[t] : T(0);
          dlogit_f(z, n, s, plse[i], pgl[i], pgs[i]);
          if (has_t) {
            T psi = c_t, dpsi = 1;
            if (normalize)
              margin_psi<T>(c_t, mg.plain_target, T(mg.m1), T(mg.m2), T(mg.m3), T(mg.c_max), &psi, &dpsi);
            const T zt = s * psi;
            z[t] = s * dpsi * (pgl[i] * std::exp(zt - plse[i]) + pgs[i] + pgt[i]);
          }
        }
      });
      Tensor Wc = sh.wbuf.narrow(0, 0, n);
      dx.addmm_(L, Wc);
      if (direct_dw) {
        Tensor gw = grad_w.narrow(0, j0, n);
        at::mm_out(gw, L.t(), sh.x);
      } else {
        Tensor dwh = dwbuf.narrow(0, 0, n);
        at::mm_out(dwh, L.t(), sh.x);
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "sce_dw", [&] {
          using S = scalar_t;
          S* out = grad_w.mutable_data_ptr<S>() + j0 * D;
          if (normalize) {
            normalize_backward_rows<S, T>(dwh.const_data_ptr<T>(), Wc.const_data_ptr<T>(),
                                          sh.wnrm.const_data_ptr<T>(), n, D, out);
          } else {
            grad_w.narrow(0, j0, n).copy_(dwh);
          }
        });
      }
    }
    if (normalize) {
      Tensor gx = at::empty({B, D}, dx.options());
      normalize_backward_rows<T, T>(dx.const_data_ptr<T>(), sh.x.const_data_ptr<T>(), sh.xnrm.const_data_ptr<T>(),
                                    B, D, gx.mutable_data_ptr<T>());
      dx = gx;
    }
  });
  return {dx.to(x.scalar_type()), grad_w};
}

}  // namespace
}  // namespace sce
}  // namespace shardkit

TORCH_LIBRARY_IMPL(shardkit, CPU, m) {
  m.impl("ce_shard_stats", &shardkit::sce::ce_shard_stats_cpu);
  m.impl("ce_shard_stats_backward", &shardkit::sce::ce_shard_stats_backward_cpu);
}
