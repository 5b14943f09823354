// CUDA kernels of the ema op family: ema_update_, ema_swap_, ema_unswap_, all through
// the chunked multi-tensor launcher of multi_tensor.cuh (a few launches for hundreds of
// tensors, on the current stream, no host synchronization).
//
// ema_update_ groups the pairs by (ema dtype, model dtype) and runs one launcher pass per
// group. Inside a chunk, a block uses 16-byte vector loads when both chunk pointers are
// aligned to the vector width (a property of the tensor's base address: chunks start at
// multiples of kChunkSize elements), else element-wise loads; arithmetic is float32
// (float64 when either side is float64).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <map>
#include <type_traits>
#include <utility>
#include <vector>

#include "ema_common.h"
#include "multi_tensor.cuh"

namespace {

using namespace shardkit::ema;
namespace mt = shardkit::mt;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename E, typename M>
struct UpdateOp {
  using Acc = std::conditional_t<std::is_same_v<E, double> || std::is_same_v<M, double>, double, float>;
  // Elements per vector: 16 bytes of the narrower type (8 for bf16/fp16, 4 for fp32).
  static constexpr int kVec = 16 / (sizeof(E) < sizeof(M) ? sizeof(E) : sizeof(M));
  Acc w;       // 1 - decay
  Acc d;       // decay
  bool small;  // w < 0.5: the two forms of torch.lerp, exact at decay 0 and 1

  __device__ __forceinline__ E blend(Acc e, Acc m) const {
    return static_cast<E>(small ? e + w * (m - e) : m - d * (m - e));
  }

  __device__ __forceinline__ void operator()(void* const* base, int64_t offset, int64_t n) const {
    E* e = static_cast<E*>(base[0]) + offset;
    const M* m = static_cast<const M*>(base[1]) + offset;
    const bool aligned = reinterpret_cast<uintptr_t>(e) % (sizeof(E) * kVec) == 0 &&
                         reinterpret_cast<uintptr_t>(m) % (sizeof(M) * kVec) == 0;
    int64_t start = 0;
    if (aligned) {
      using EV = Vec<E, kVec>;
      using MV = Vec<M, kVec>;
      const int64_t nv = n / kVec;
      for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
        EV ev = reinterpret_cast<const EV*>(e)[i];
        const MV mv = reinterpret_cast<const MV*>(m)[i];
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          ev.v[k] = blend(static_cast<Acc>(ev.v[k]), static_cast<Acc>(mv.v[k]));
        }
        reinterpret_cast<EV*>(e)[i] = ev;
      }
      start = nv * kVec;
    }
    for (int64_t i = start + threadIdx.x; i < n; i += blockDim.x) {
      e[i] = blend(static_cast<Acc>(e[i]), static_cast<Acc>(m[i]));
    }
  }
};

// Swaps run once per evaluation, so plain coalesced element-wise loops are enough.
template <typename U>
struct ExchangeOp {
  __device__ __forceinline__ void operator()(void* const* base, int64_t offset, int64_t n) const {
    U* e = static_cast<U*>(base[0]) + offset;
    U* m = static_cast<U*>(base[1]) + offset;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const U t = e[i];
      e[i] = m[i];
      m[i] = t;
    }
  }
};

template <bool kPack>
struct Bf16Op {
  __device__ __forceinline__ void operator()(void* const* base, int64_t offset, int64_t n) const {
    uint32_t* e = static_cast<uint32_t*>(base[0]) + offset;
    uint16_t* m = static_cast<uint16_t*>(base[1]) + offset;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      uint32_t eb = e[i];
      uint16_t mb = m[i];
      if (kPack) {
        bf16_pack(eb, mb);
      } else {
        bf16_unpack(eb, mb);
      }
      e[i] = eb;
      m[i] = mb;
    }
  }
};

using Lists = std::vector<std::vector<at::Tensor>>;

template <typename E>
void launch_update(at::ScalarType m, const Lists& lists, double w) {
  auto run = [&](auto model_tag) {
    using M = decltype(model_tag);
    using Op = UpdateOp<E, M>;
    using Acc = typename Op::Acc;
    mt::multi_tensor_apply<2>(lists, Op{static_cast<Acc>(w), static_cast<Acc>(1.0 - w), w < 0.5});
  };
  switch (m) {
    case at::kFloat:
      return run(float{});
    case at::kDouble:
      return run(double{});
    case at::kHalf:
      return run(c10::Half{});
    case at::kBFloat16:
      return run(c10::BFloat16{});
    default:
      TORCH_INTERNAL_ASSERT(false, "dtype was checked before");
  }
}

void ema_update_cuda(at::TensorList ema, at::TensorList model, double decay) {
  check_update_args(ema, model, decay);
  if (ema.empty()) return;
  TORCH_CHECK(ema[0].is_cuda(), "ema_update_: the CUDA kernel got `ema` on ", ema[0].device());
  const c10::cuda::CUDAGuard guard(ema[0].device());
  if (update_at_the_ends(ema, model, decay)) return;
  std::map<std::pair<int, int>, Lists> groups;
  for (size_t i = 0; i < ema.size(); ++i) {
    if (ema[i].numel() == 0) continue;
    if (!flat_compatible(ema[i], model[i])) {
      fallback_update(ema[i], model[i], decay);  // strided views: correct, not fused
      continue;
    }
    Lists& g = groups[{static_cast<int>(ema[i].scalar_type()), static_cast<int>(model[i].scalar_type())}];
    if (g.empty()) g.resize(2);
    g[0].push_back(ema[i]);
    g[1].push_back(model[i]);
  }
  const double w = model_weight(decay);
  for (const auto& [key, lists] : groups) {
    const auto e = static_cast<at::ScalarType>(key.first);
    const auto m = static_cast<at::ScalarType>(key.second);
    switch (e) {
      case at::kFloat:
        launch_update<float>(m, lists, w);
        break;
      case at::kDouble:
        launch_update<double>(m, lists, w);
        break;
      case at::kHalf:
        launch_update<c10::Half>(m, lists, w);
        break;
      case at::kBFloat16:
        launch_update<c10::BFloat16>(m, lists, w);
        break;
      default:
        TORCH_INTERNAL_ASSERT(false, "dtype was checked before");
    }
  }
}

template <bool kPack>
void ema_swap_cuda_impl(const char* op, at::TensorList ema, at::TensorList model) {
  check_lists(op, ema, model);
  check_no_overlap(op, ema, model, /*model_written=*/true);
  if (ema.empty()) return;
  TORCH_CHECK(ema[0].is_cuda(), op, ": the CUDA kernel got `ema` on ", ema[0].device());
  const c10::cuda::CUDAGuard guard(ema[0].device());
  // Key: element size for exchanges, 0 for the bf16 packing.
  std::map<int64_t, Lists> groups;
  for (size_t i = 0; i < ema.size(); ++i) {
    const SwapKind kind = check_swap_pair(op, ema[i], model[i], i);
    if (ema[i].numel() == 0) continue;
    const int64_t size = ema[i].element_size();
    if (kind == SwapKind::kExchange &&
        (!flat_compatible(ema[i], model[i]) || !(size == 1 || size == 2 || size == 4 || size == 8))) {
      fallback_exchange(ema[i], model[i]);
      continue;
    }
    Lists& g = groups[kind == SwapKind::kPackBF16 ? 0 : size];
    if (g.empty()) g.resize(2);
    g[0].push_back(ema[i]);
    g[1].push_back(model[i]);
  }
  for (const auto& [key, lists] : groups) {
    switch (key) {
      case 0:
        mt::multi_tensor_apply<2>(lists, Bf16Op<kPack>{});
        break;
      case 1:
        mt::multi_tensor_apply<2>(lists, ExchangeOp<uint8_t>{});
        break;
      case 2:
        mt::multi_tensor_apply<2>(lists, ExchangeOp<uint16_t>{});
        break;
      case 4:
        mt::multi_tensor_apply<2>(lists, ExchangeOp<uint32_t>{});
        break;
      case 8:
        mt::multi_tensor_apply<2>(lists, ExchangeOp<uint64_t>{});
        break;
      default:
        TORCH_INTERNAL_ASSERT(false, "unexpected swap group");
    }
  }
}

void ema_swap_cuda(at::TensorList ema, at::TensorList model) {
  ema_swap_cuda_impl<true>("ema_swap_", ema, model);
}
void ema_unswap_cuda(at::TensorList ema, at::TensorList model) {
  ema_swap_cuda_impl<false>("ema_unswap_", ema, model);
}

}  // namespace

TORCH_LIBRARY_IMPL(shardkit, CUDA, m) {
  m.impl("ema_update_", &ema_update_cuda);
  m.impl("ema_swap_", &ema_swap_cuda);
  m.impl("ema_unswap_", &ema_unswap_cuda);
}
