// Device helpers of the sharded cross-entropy shared by its unfused (sharded_ce_cuda.cu,
// sharded_ce_v2.cuh) and fused (sharded_ce_fused.cu) kernels: merging softmax partials and
// folding a row's statistics into the running ones.
#pragma once

#include <cstdint>
#include <limits>

namespace shardkit {
namespace sce {

template <typename T>
__device__ __forceinline__ T dev_exp(T v) {
  return exp(v);
}
template <>
__device__ __forceinline__ float dev_exp<float>(float v) {
  return __expf(v);
}

// Merges the softmax partial (m2, s2) into (m, s): s counts exp(z - m).
template <typename T>
__device__ __forceinline__ void merge_ms(T& m, T& s, T m2, T s2) {
  const T mn = m > m2 ? m : m2;
  if (mn == -std::numeric_limits<T>::infinity()) {
    // Both hold only -inf logits: s and s2 are 0, or NaN from a NaN logit (which the max
    // skips), and that NaN must survive the merge from either side, as on the CPU.
    s += s2;
    return;
  }
  s = s * dev_exp(m - mn) + s2 * dev_exp(m2 - mn);
  m = mn;
}

// Folds a row's partial statistics into the running ones of row i.
template <typename T>
__device__ __forceinline__ void fold_stats(int64_t i, T m, T s, T zs, int64_t cnt, T* M, T* S, T* LS,
                                           int64_t* CN) {
  T Mi = M[i], Si = S[i];
  merge_ms(Mi, Si, m, s);
  M[i] = Mi;
  S[i] = Si;
  LS[i] += zs;
  CN[i] += cnt;
}

}  // namespace sce
}  // namespace shardkit
