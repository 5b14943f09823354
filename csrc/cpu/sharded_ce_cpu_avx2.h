// AVX2 + FMA versions of the float row loops of the CPU sharded cross-entropy (included by
// sharded_ce_cpu_rows.h only, which picks them at run time when the CPU has both).
//
// Written with intrinsics on 8-lane registers: the 16-lane vector-extension versions compile
// to ymm pairs under AVX2 and spill, running several times slower than these. Same results
// as the generic versions up to the order of the sums and exp's last bits: NaN logits are
// skipped by the max and propagate through exp and the sums; arguments above 88 clamp; -inf
// gives 1.2e-38 here (0 in the generic versions), see exp8.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SCE_HAVE_AVX2 1
#include <immintrin.h>

#include <cstdint>
#include <limits>

namespace shardkit {
namespace sce {
namespace cpu_rows {
namespace avx2 {
namespace {

#define SCE_AVX2 __attribute__((target("avx2,fma")))
#define SCE_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline

// exp(x): Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6 polynomial for
// e^r (coefficients fitted for minimax relative error on that interval: 7e-8 evaluated in
// float32, about 1 ulp, like Cephes' expf) and 2^n from the exponent bits. Inputs are clamped
// to [-87.34, 88]: below, the result is the smallest normal float (1.2e-38) rather than 0,
// which changes no softmax sum (every row holds a term >= 1) and costs no mask; max/min take
// x second so that NaN passes through.
SCE_AVX2_INLINE __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.3365478515625f), x));
  const __m256 fn = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.3836845755577087e-3f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.374815806746483e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166822507977486e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666419804096222e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.9999991059303284e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fn), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// p[0:n] (0 < n < 8) padded with fill.
SCE_AVX2_INLINE __m256 load_tail8(const float* p, int64_t n, float fill) {
  alignas(32) float tmp[8];
  for (int k = 0; k < 8; ++k) tmp[k] = k < n ? p[k] : fill;
  return _mm256_load_ps(tmp);
}

SCE_AVX2_INLINE float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Max over lanes; NaN lanes never get in (the running max skips them).
SCE_AVX2_INLINE float hmax8(__m256 v) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  float r = t[0];
  for (int k = 1; k < 8; ++k) r = t[k] > r ? t[k] : r;
  return r;
}

// z[j] <- s * z[j]; returns max_j z[j] (NaN skipped) and adds #{j : z[j] > ref} to *cnt (if count).
// The plain loss (scale 1, no count): the max alone, without rewriting the row.
SCE_AVX2 float max_only(const float* z, int64_t n) {
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), mx2 = mx;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    mx = _mm256_max_ps(_mm256_loadu_ps(z + j), mx);  // returns mx where z is NaN
    mx2 = _mm256_max_ps(_mm256_loadu_ps(z + j + 8), mx2);
  }
  float m = hmax8(_mm256_max_ps(mx2, mx));
  for (; j < n; ++j) m = z[j] > m ? z[j] : m;
  return m;
}

SCE_AVX2 float scale_max_count(float* z, int64_t n, float s, float ref, bool count, int64_t* cnt) {
  if (s == 1.0f && !count) return max_only(z, n);
  const __m256 vs = _mm256_set1_ps(s), vref = _mm256_set1_ps(ref);
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), mx2 = mx;
  __m256i c = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(z + j), vs);
    const __m256 v2 = _mm256_mul_ps(_mm256_loadu_ps(z + j + 8), vs);
    _mm256_storeu_ps(z + j, v);
    _mm256_storeu_ps(z + j + 8, v2);
    mx = _mm256_max_ps(v, mx);  // returns mx where v is NaN
    mx2 = _mm256_max_ps(v2, mx2);
    c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(v, vref, _CMP_GT_OQ)));
    c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(v2, vref, _CMP_GT_OQ)));
  }
  float m = hmax8(_mm256_max_ps(mx2, mx));
  int64_t total = 0;
  alignas(32) int32_t ct[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(ct), c);
  for (int k = 0; k < 8; ++k) total += ct[k];
  for (; j < n; ++j) {
    const float v = z[j] * s;
    z[j] = v;
    m = v > m ? v : m;
    total += v > ref ? 1 : 0;
  }
  if (count) *cnt += total;
  return m;
}

// Returns sum_j exp(z[j] - m); adds sum_j z[j] to *zsum.
SCE_AVX2 float expsum(const float* z, int64_t n, float m, float* zsum) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 se0 = _mm256_setzero_ps(), se1 = se0, se2 = se0, se3 = se0, sz0 = se0, sz1 = se0;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {  // four independent exp chains keep the FMA units busy
    const __m256 a = _mm256_loadu_ps(z + j), b = _mm256_loadu_ps(z + j + 8);
    const __m256 c = _mm256_loadu_ps(z + j + 16), d = _mm256_loadu_ps(z + j + 24);
    se0 = _mm256_add_ps(se0, exp8(_mm256_sub_ps(a, vm)));
    se1 = _mm256_add_ps(se1, exp8(_mm256_sub_ps(b, vm)));
    se2 = _mm256_add_ps(se2, exp8(_mm256_sub_ps(c, vm)));
    se3 = _mm256_add_ps(se3, exp8(_mm256_sub_ps(d, vm)));
    sz0 = _mm256_add_ps(sz0, _mm256_add_ps(a, b));
    sz1 = _mm256_add_ps(sz1, _mm256_add_ps(c, d));
  }
  for (; j + 8 <= n; j += 8) {
    const __m256 a = _mm256_loadu_ps(z + j);
    se0 = _mm256_add_ps(se0, exp8(_mm256_sub_ps(a, vm)));
    sz0 = _mm256_add_ps(sz0, a);
  }
  if (j < n) {
    se1 = _mm256_add_ps(
        se1, exp8(_mm256_sub_ps(load_tail8(z + j, n - j, -std::numeric_limits<float>::infinity()), vm)));
    sz1 = _mm256_add_ps(sz1, load_tail8(z + j, n - j, 0.f));
  }
  *zsum += hsum8(_mm256_add_ps(sz0, sz1));
  return hsum8(_mm256_add_ps(_mm256_add_ps(se0, se1), _mm256_add_ps(se2, se3)));
}

// The logit s * z is rounded before lse is subtracted, as the forward rounded it when it built
// lse: a fused s * z - lse differs from it by up to |s z| 2^-24, which at large scales turns
// exp(logit - lse) into a probability above 1 (and the gradient into inf, then NaN). Kept
// logits were rounded by the forward already: s_in = 1 multiplies exactly.
SCE_AVX2_INLINE __m256 dlogit8(__m256 v, __m256 vs_in, __m256 vs, __m256 vl, __m256 vgl, __m256 vgs) {
  return _mm256_mul_ps(_mm256_fmadd_ps(exp8(_mm256_sub_ps(_mm256_mul_ps(v, vs_in), vl)), vgl, vgs), vs);
}

// out[j] <- s * (gl * exp(s_in * z[j] - lse) + gs); out may be z.
SCE_AVX2 void dlogit(const float* z, float* out, int64_t n, float s_in, float s, float lse, float gl,
                     float gs) {
  const __m256 vi = _mm256_set1_ps(s_in), vs = _mm256_set1_ps(s), vl = _mm256_set1_ps(lse),
               vgl = _mm256_set1_ps(gl), vgs = _mm256_set1_ps(gs);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256 a = dlogit8(_mm256_loadu_ps(z + j), vi, vs, vl, vgl, vgs);
    const __m256 b = dlogit8(_mm256_loadu_ps(z + j + 8), vi, vs, vl, vgl, vgs);
    _mm256_storeu_ps(out + j, a);
    _mm256_storeu_ps(out + j + 8, b);
  }
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, dlogit8(_mm256_loadu_ps(z + j), vi, vs, vl, vgl, vgs));
  if (j < n) {
    alignas(32) float t[8];
    _mm256_store_ps(t, dlogit8(load_tail8(z + j, n - j, 0.f), vi, vs, vl, vgl, vgs));
    for (int64_t k = 0; k < n - j; ++k) out[j + k] = t[k];
  }
}

#undef SCE_AVX2
#undef SCE_AVX2_INLINE

}  // namespace
}  // namespace avx2
}  // namespace cpu_rows
}  // namespace sce
}  // namespace shardkit

#endif
