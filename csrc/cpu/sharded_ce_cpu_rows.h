// Row loops of the CPU sharded cross-entropy kernels (included by sharded_ce_cpu.cpp only):
// the vectorized float passes over one row of a chunk's logits, their double versions, and
// the row loads / normalization backward between w (any float dtype) and fp32/fp64 buffers.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "cpu/sharded_ce_cpu_avx2.h"

namespace shardkit {
namespace sce {
namespace cpu_rows {
namespace {  // included by one translation unit: internal linkage, as for the kernels there

// The generic float row loops are written with GCC/Clang vector extensions (16 lanes):
// explicit lane-wise code for any target (SSE2 quadruples on a baseline x86-64 build, NEON on
// ARM), without relying on the auto-vectorizer (which will not if-convert the clamps of exp
// under the default -ftrapping-math). On x86-64 CPUs with AVX2 and FMA the versions in
// sharded_ce_cpu_avx2.h run instead (picked once at run time; see use_avx2 below).
#pragma GCC diagnostic ignored "-Wpsabi"  // vector arguments only cross always_inline calls
constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));

__attribute__((always_inline)) inline vf splat(float v) {
  return vf{} + v;
}
__attribute__((always_inline)) inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// Loads p[0:n] (n < kLanes) padded with fill.
__attribute__((always_inline)) inline vf load_tail(const float* p, int64_t n, float fill) {
  float tmp[kLanes];
  for (int k = 0; k < kLanes; ++k) tmp[k] = k < n ? p[k] : fill;
  return load(tmp);
}
__attribute__((always_inline)) inline float hsum(vf v) {
  float r = 0.f;
  for (int k = 0; k < kLanes; ++k) r += v[k];
  return r;
}
__attribute__((always_inline)) inline float hmax(vf v) {
  float r = v[0];
  for (int k = 1; k < kLanes; ++k) r = v[k] > r ? v[k] : r;
  return r;
}

// exp(x) without libm calls: Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, Cephes' expf
// polynomial, 2^n from the exponent bits. Relative error ~2 ulp; 0 below -87.3 (where results
// would be denormal), arguments above 88 clamp (softmax arguments here are <= ~0).
__attribute__((always_inline)) inline vf exp_vec(vf x) {
  const vf lo = splat(-87.3365478515625f), hi = splat(88.0f);
  const vi under = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // Round to nearest through the 1.5*2^23 trick (no floor/rint: those need SSE4.1).
  const vf magic = splat(12582912.0f);
  const vf fn = (x * 1.44269504088896341f + magic) - magic;
  const vf r = (x - fn * 0.693359375f) - fn * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(fn, vi) + 127) << 23;
  const vf res = p * (vf)bits;
  const vi out = (vi)res & ~under;
  return (vf)out;  // vector casts are bit casts
}

// z[j] <- s * z[j]; returns max_j z[j] and adds #{j : z[j] > ref} to *count (if count).
float scale_max_count_generic(float* z, int64_t n, float s, float ref, bool count, int64_t* cnt) {
  const float ninf = -std::numeric_limits<float>::infinity();
  vf mx = splat(ninf);
  vi c = vi{};
  const vf vref = splat(ref);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const vf v = load(z + j) * s;
    std::memcpy(z + j, &v, sizeof(v));
    mx = v > mx ? v : mx;
    c -= v > vref;  // comparisons give -1 per true lane
  }
  if (j < n) {
    const vf v = load_tail(z + j, n - j, ninf) * s;  // -inf * s: handled by the mask below
    for (int64_t k = 0; k < n - j; ++k) z[j + k] = v[k];
    for (int64_t k = 0; k < n - j; ++k) {
      mx[k] = v[k] > mx[k] ? v[k] : mx[k];
      c[k] += v[k] > ref ? 1 : 0;
    }
  }
  if (count) {
    int64_t total = 0;
    for (int k = 0; k < kLanes; ++k) total += c[k];
    *cnt += total;
  }
  return hmax(mx);
}

// Returns sum_j exp(z[j] - m); adds sum_j z[j] to *zsum.
float expsum_generic(const float* z, int64_t n, float m, float* zsum) {
  vf se = vf{}, sz = vf{}, se2 = vf{}, sz2 = vf{};  // two chains: more work in flight
  int64_t j = 0;
  for (; j + 2 * kLanes <= n; j += 2 * kLanes) {
    const vf v = load(z + j), v2 = load(z + j + kLanes);
    se += exp_vec(v - m);
    se2 += exp_vec(v2 - m);
    sz += v;
    sz2 += v2;
  }
  se += se2;
  sz += sz2;
  for (; j + kLanes <= n; j += kLanes) {
    const vf v = load(z + j);
    se += exp_vec(v - m);
    sz += v;
  }
  if (j < n) {
    se += exp_vec(load_tail(z + j, n - j, -std::numeric_limits<float>::infinity()) - m);
    sz += load_tail(z + j, n - j, 0.f);
  }
  *zsum += hsum(sz);
  return hsum(se);
}

// out[j] <- s * (gl * exp(s_in * z[j] - lse) + gs): dlogit of the plain (non-target) columns,
// from the GEMM's logits (s_in = s, in place) or from kept scaled logits (s_in = 1, exact).
void dlogit_generic(const float* z, float* out, int64_t n, float s_in, float s, float lse, float gl,
                    float gs) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const vf v = (exp_vec(load(z + j) * s_in - lse) * gl + gs) * s;
    std::memcpy(out + j, &v, sizeof(v));
  }
  if (j < n) {
    const vf v = (exp_vec(load_tail(z + j, n - j, 0.f) * s_in - lse) * gl + gs) * s;
    for (int64_t k = 0; k < n - j; ++k) out[j + k] = v[k];
  }
}

// The float loops used: AVX2 + FMA where the CPU has both. The environment variable
// SHARDKIT_CPU_ISA=generic forces the generic versions (to test them, or to rule the AVX2
// code out when chasing a difference); "auto" or unset is the default. Read once.
inline bool use_avx2() {
#ifdef SCE_HAVE_AVX2
  static const bool on = [] {
    const char* isa = std::getenv("SHARDKIT_CPU_ISA");
    if (isa != nullptr && std::strcmp(isa, "generic") == 0) return false;
    if (isa != nullptr && *isa != '\0' && std::strcmp(isa, "auto") != 0)
      TORCH_WARN("SHARDKIT_CPU_ISA=", isa, " is not one of \"auto\" or \"generic\"; using \"auto\"");
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return on;
#else
  return false;
#endif
}

float scale_max_count_f(float* z, int64_t n, float s, float ref, bool count, int64_t* cnt) {
#ifdef SCE_HAVE_AVX2
  if (use_avx2()) return avx2::scale_max_count(z, n, s, ref, count, cnt);
#endif
  return scale_max_count_generic(z, n, s, ref, count, cnt);
}
// A long row is summed in blocks: each block's vector lanes in float, the blocks in double
// (float lanes over a chunk of millions of classes lost ~1e-5 of the sum to rounding).
float expsum_f(const float* z, int64_t n, float m, float* zsum) {
  constexpr int64_t kBlock = 4096;  // a multiple of every vector width here: one tail per row
  double se = 0, sz = 0;
  for (int64_t j = 0; j < n; j += kBlock) {
    const int64_t len = std::min(kBlock, n - j);
    float zb = 0;
#ifdef SCE_HAVE_AVX2
    if (use_avx2()) {
      se += avx2::expsum(z + j, len, m, &zb);
      sz += zb;
      continue;
    }
#endif
    se += expsum_generic(z + j, len, m, &zb);
    sz += zb;
  }
  *zsum += static_cast<float>(sz);
  return static_cast<float>(se);
}
void dlogit_f(const float* z, float* out, int64_t n, float s_in, float s, float lse, float gl, float gs) {
#ifdef SCE_HAVE_AVX2
  if (use_avx2()) return avx2::dlogit(z, out, n, s_in, s, lse, gl, gs);
#endif
  dlogit_generic(z, out, n, s_in, s, lse, gl, gs);
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
void dlogit_f(const double* z, double* out, int64_t n, double s_in, double s, double lse, double gl,
              double gs) {
  for (int64_t j = 0; j < n; ++j) out[j] = s * (gl * std::exp(s_in * z[j] - lse) + gs);
}

// Rows [r0, r1) of src (any float dtype, row stride src_stride) -> dst (acc T, contiguous,
// [rows, D]), L2-normalized when normalize; nrm[r] = max(|row|, 1e-12) is kept for backward.
// The squares are summed in double: a float row of norm above ~1.8e19 does not overflow to inf
// (which would normalize it to a zero row). A norm above the float range is kept as inf, so the
// row's gradient is 0 (its true size, below 1 / 3.4e38, is under the float's normal range).
template <typename scalar_t, typename T>
void load_rows(const scalar_t* src, int64_t s0, int64_t s1, int64_t rows, int64_t D, bool normalize, T* dst,
               T* nrm) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1)), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const scalar_t* in = src + r * s0;
      T* out = dst + r * D;
      double ss = 0;
      for (int64_t k = 0; k < D; ++k) {
        const T v = static_cast<T>(in[k * s1]);
        out[k] = v;
        ss += static_cast<double>(v) * static_cast<double>(v);
      }
      if (normalize) {
        // The norm and the division stay in double: a float row whose norm exceeds the
        // float range (inf as a float) still normalizes to its unit row, rounded once.
        const double nr = std::max(std::sqrt(ss), 1e-12);
        nrm[r] = static_cast<T>(nr);
        const double inv = 1.0 / nr;
        for (int64_t k = 0; k < D; ++k) out[k] = static_cast<T>(static_cast<double>(out[k]) * inv);
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

}  // namespace
}  // namespace cpu_rows
}  // namespace sce
}  // namespace shardkit
