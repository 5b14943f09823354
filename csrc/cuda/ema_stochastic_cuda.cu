// CUDA kernel of ema_update_stochastic_: the update of a bfloat16 EMA with stochastic rounding,
// bit for bit the CPU kernel's: the same arithmetic, each multiply and add rounded on its own
// (the _rn intrinsics, which nvcc never contracts into a fused multiply-add, as the CPU build's
// -ffp-contract=off), and the same counter-based random bits (ema_common.h). One grid-stride
// launch per tensor; ema_update_'s multi-tensor table is not used for this less common layout.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "ema_common.h"

namespace {

using namespace shardkit::ema;

__device__ __forceinline__ float mul_rn(float a, float b) {
  return __fmul_rn(a, b);
}
__device__ __forceinline__ double mul_rn(double a, double b) {
  return __dmul_rn(a, b);
}
__device__ __forceinline__ float add_rn(float a, float b) {
  return __fadd_rn(a, b);
}
__device__ __forceinline__ double add_rn(double a, double b) {
  return __dadd_rn(a, b);
}
__device__ __forceinline__ float sub_rn(float a, float b) {
  return __fsub_rn(a, b);
}
__device__ __forceinline__ double sub_rn(double a, double b) {
  return __dsub_rn(a, b);
}

template <typename M>
__global__ void update_stochastic_kernel(uint16_t* __restrict__ e, const M* __restrict__ m, int64_t n,
                                         double w_d, uint64_t key) {
  using Acc = std::conditional_t<std::is_same_v<M, double>, double, float>;
  const bool low = w_d < 0.5;
  const Acc w = static_cast<Acc>(w_d);
  const Acc d = static_cast<Acc>(1.0 - w_d);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const Acc ev = static_cast<Acc>(__uint_as_float(static_cast<uint32_t>(e[i]) << 16));
    const Acc mv = static_cast<Acc>(m[i]);
    const Acc diff = sub_rn(mv, ev);
    const float v = static_cast<float>(low ? add_rn(ev, mul_rn(w, diff)) : sub_rn(mv, mul_rn(d, diff)));
    e[i] = bf16_round_stochastic(__float_as_uint(v), stochastic_bits(key, i));
  }
}

void ema_update_stochastic_cuda(at::TensorList ema, at::TensorList model, double decay, int64_t seed,
                                int64_t counter) {
  check_stochastic_args(ema, model, decay, seed, counter);
  if (ema.empty()) return;
  TORCH_CHECK(ema[0].is_cuda(), "ema_update_stochastic_: the CUDA kernel got `ema` on ", ema[0].device());
  const c10::cuda::CUDAGuard guard(ema[0].device());
  if (update_at_the_ends(ema, model, decay)) return;
  const double w = model_weight(decay);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t max_blocks =
      8 * static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  constexpr int kThreads = 256;
  for (size_t i = 0; i < ema.size(); ++i) {
    const int64_t n = ema[i].numel();
    if (n == 0) continue;
    const bool flat = flat_compatible(ema[i], model[i]);
    at::Tensor e = flat ? ema[i] : ema[i].contiguous();
    const at::Tensor m = flat ? model[i] : model[i].contiguous();
    const uint64_t key = stochastic_key(seed, counter, static_cast<int64_t>(i));
    const int blocks = static_cast<int>(std::min<int64_t>(max_blocks, (n + kThreads - 1) / kThreads));
    auto* ep = reinterpret_cast<uint16_t*>(e.data_ptr());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, m.scalar_type(), "ema_update_stochastic_", [&] {
      update_stochastic_kernel<scalar_t>
          <<<blocks, kThreads, 0, stream>>>(ep, m.const_data_ptr<scalar_t>(), n, w, key);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (!flat) ema[i].copy_(e);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(shardkit, CUDA, m) {
  m.impl("ema_update_stochastic_", &ema_update_stochastic_cuda);
}
