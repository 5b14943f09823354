// CUDA kernel of ema_update_stochastic_: the update of a bfloat16 EMA with stochastic rounding,
// bit for bit the CPU kernel's: the same arithmetic, each multiply and add rounded on its own
// (the _rn intrinsics, which nvcc never contracts into a fused multiply-add, as the CPU build's
// -ffp-contract=off), and the same counter-based random bits (ema_common.h). A launch takes up
// to kMaxTensors tensors of one model dtype, their addresses in the kernel's parameters.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

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

// The tensors of one launch travel by value in the kernel's parameters (under 4 KB): a block
// takes one chunk of kChunk elements of one tensor, found by binary search over the first
// blocks of the tensors, as multi_tensor.cuh does; the tensor's key (its index in the call)
// and the element's index in the tensor make the random bits.
constexpr int kMaxTensors = 48;
constexpr int64_t kChunk = 16384;
constexpr int kThreads = 256;

struct Meta {
  uint16_t* ema[kMaxTensors];
  const void* model[kMaxTensors];
  int64_t numel[kMaxTensors];
  uint64_t key[kMaxTensors];
  int32_t block_start[kMaxTensors + 1];
  int32_t count;
};
static_assert(sizeof(Meta) + 64 <= 4096, "kernel parameters must stay under 4 KB");

template <typename M>
__global__ void __launch_bounds__(kThreads) update_stochastic_kernel(Meta meta, double w_d) {
  using Acc = std::conditional_t<std::is_same_v<M, double>, double, float>;
  const int32_t block = static_cast<int32_t>(blockIdx.x);
  int lo = 0, hi = meta.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (meta.block_start[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t begin = static_cast<int64_t>(block - meta.block_start[lo]) * kChunk;
  const int64_t end = min(meta.numel[lo], begin + kChunk);
  uint16_t* __restrict__ e = meta.ema[lo];
  const M* __restrict__ m = static_cast<const M*>(meta.model[lo]);
  const uint64_t key = meta.key[lo];
  const bool low = w_d < 0.5;
  const Acc w = static_cast<Acc>(w_d);
  const Acc d = static_cast<Acc>(1.0 - w_d);
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const Acc ev = static_cast<Acc>(__uint_as_float(static_cast<uint32_t>(e[i]) << 16));
    const Acc mv = static_cast<Acc>(m[i]);
    const Acc diff = sub_rn(mv, ev);
    const float v = static_cast<float>(low ? add_rn(ev, mul_rn(w, diff)) : sub_rn(mv, mul_rn(d, diff)));
    e[i] = bf16_round_stochastic(__float_as_uint(v), stochastic_bits(key, i));
  }
}

// One (ema, model, key) of the launcher's list; the model tensor's dtype is the group's.
struct Item {
  at::Tensor e, m;
  uint64_t key;
};

template <typename M>
void launch_group(const std::vector<Item>& items, double w, cudaStream_t stream) {
  constexpr int64_t kMaxBlocks = int64_t{1} << 30;
  Meta meta;
  meta.count = 0;
  int64_t blocks = 0;
  auto launch = [&]() {
    if (meta.count == 0) return;
    meta.block_start[meta.count] = static_cast<int32_t>(blocks);
    update_stochastic_kernel<M><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(meta, w);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    meta.count = 0;
    blocks = 0;
  };
  for (const Item& it : items) {
    const int64_t chunks = (it.e.numel() + kChunk - 1) / kChunk;
    TORCH_CHECK(chunks < kMaxBlocks, "ema_update_stochastic_: a tensor of ", it.e.numel(),
                " elements is too large");
    if (meta.count == kMaxTensors || blocks + chunks > kMaxBlocks) launch();
    const int c = meta.count;
    meta.ema[c] = reinterpret_cast<uint16_t*>(it.e.data_ptr());
    meta.model[c] = it.m.const_data_ptr();
    meta.numel[c] = it.e.numel();
    meta.key[c] = it.key;
    meta.block_start[c] = static_cast<int32_t>(blocks);
    meta.count = c + 1;
    blocks += chunks;
  }
  launch();
}

void ema_update_stochastic_cuda(at::TensorList ema, at::TensorList model, double decay, int64_t seed,
                                int64_t counter, c10::IntArrayRef salts) {
  check_stochastic_args(ema, model, decay, seed, counter, salts);
  if (ema.empty()) return;
  TORCH_CHECK(ema[0].is_cuda(), "ema_update_stochastic_: the CUDA kernel got `ema` on ", ema[0].device());
  const c10::cuda::CUDAGuard guard(ema[0].device());
  if (update_at_the_ends(ema, model, decay)) return;
  const double w = model_weight(decay);
  const auto stream = at::cuda::getCurrentCUDAStream();
  // Grouped by the model's dtype (one kernel each); strided pairs run on contiguous copies,
  // written back after (the element index is then the logical one, as on the CPU).
  std::vector<Item> groups[4];
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;
  for (const size_t i : update_the_others(ema, model, decay)) {
    if (ema[i].numel() == 0) continue;
    const bool flat = flat_compatible(ema[i], model[i]);
    at::Tensor e = flat ? ema[i] : ema[i].contiguous();
    at::Tensor m = flat ? model[i] : model[i].contiguous();
    if (!flat) write_back.emplace_back(ema[i], e);
    const auto t = m.scalar_type();
    const int g = t == at::kFloat ? 0 : t == at::kDouble ? 1 : t == at::kHalf ? 2 : 3;
    groups[g].push_back({e, m, stochastic_key(seed, counter, salts[i])});
  }
  launch_group<float>(groups[0], w, stream);
  launch_group<double>(groups[1], w, stream);
  launch_group<c10::Half>(groups[2], w, stream);
  launch_group<c10::BFloat16>(groups[3], w, stream);
  for (auto& [dst, src] : write_back) dst.copy_(src);
}

}  // namespace

TORCH_LIBRARY_IMPL(shardkit, CUDA, m) {
  m.impl("ema_update_stochastic_", &ema_update_stochastic_cuda);
}
