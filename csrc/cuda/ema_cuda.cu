// CUDA kernels of the ema op family: ema_update_, ema_swap_, ema_unswap_.
//
// ema_update_ groups the pairs by (ema dtype, model dtype) and launches ONE persistent kernel
// per group over a device-side table of the group's tensors ({ema pointer, model pointer,
// numel, first work unit} per tensor). The table is built on the host and copied to the
// device the first time a given list of tensors is seen, and kept in a small cache keyed by
// (device, stream, dtypes, every pointer and numel): the training loop's repeated updates
// of the same tensors find it there and cost one launch, whatever the tensor count. The
// blocks stride over work units of kUnit elements across all tensors, so a model of many
// small tensors ends in one tail, not one per launch. A cached table is valid whenever its
// key matches (it holds nothing but that key), so tensors freed and reallocated at the same
// addresses are safe. Inside a CUDA-graph capture (where a cached table could be evicted
// while the graph still reads it), and with SHARDKIT_EMA_V1=1 (for bisecting and for the
// benchmark's before/after), the update takes the first launcher instead: the chunked
// multi-tensor launcher of multi_tensor.cuh (a few launches, tensor addresses by value in
// the kernel parameters). Swaps always take that launcher: they run once per evaluation.
//
// Inside a work unit, a block uses 16-byte vector loads when both pointers are aligned to
// the vector width (a property of the tensor's base address: units and chunks start at
// multiples of kUnit / kChunkSize elements), else element-wise loads; the table path keeps
// several vectors in flight per thread (loads first, then the stores). Arithmetic is
// float32 (float64 when either side is float64).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraphsUtils.cuh>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <list>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "ema_common.h"
#include "env_flag.h"
#include "multi_tensor.cuh"

namespace {

using namespace shardkit::ema;
namespace mt = shardkit::mt;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// kUnroll: vectors per thread in flight (loads of all of them first, then the stores); the
// first launcher runs 1, the table path more.
template <typename E, typename M, int kUnroll = 1>
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
      const int64_t step = static_cast<int64_t>(blockDim.x);
      for (int64_t i0 = threadIdx.x; i0 < nv; i0 += step * kUnroll) {
        EV ev[kUnroll];
        MV mv[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = i0 + u * step;
          if (i < nv) {
            ev[u] = reinterpret_cast<const EV*>(e)[i];
            mv[u] = reinterpret_cast<const MV*>(m)[i];
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = i0 + u * step;
          if (i < nv) {
#pragma unroll
            for (int k = 0; k < kVec; ++k) {
              ev[u].v[k] = blend(static_cast<Acc>(ev[u].v[k]), static_cast<Acc>(mv[u].v[k]));
            }
            reinterpret_cast<EV*>(e)[i] = ev[u];
          }
        }
      }
      start = nv * kVec;
    }
    for (int64_t i = start + threadIdx.x; i < n; i += blockDim.x) {
      e[i] = blend(static_cast<Acc>(e[i]), static_cast<Acc>(m[i]));
    }
  }
};

// UpdateOp with the decay read from device memory (ema_update_device_decay_): every block
// reads the one double, derives the weights exactly as the host does for ema_update_ (w =
// 1 - decay, d = 1 - w, in double, then rounded to Acc), and handles the ends as the host's
// update_at_the_ends: decay 1 leaves the EMA as it is, decay 0 copies the model (a
// conversion as copy_ makes it), whatever the values. So a replayed graph gives ema_update_'s
// result bit for bit at every decay.
template <typename E, typename M>
struct DeviceDecayUpdateOp {
  const double* decay;

  __device__ __forceinline__ void operator()(void* const* base, int64_t offset, int64_t n) const {
    using Op = UpdateOp<E, M>;
    using Acc = typename Op::Acc;
    const double dd = __ldg(decay);
    if (dd == 1.0) return;
    if (dd == 0.0) {
      E* e = static_cast<E*>(base[0]) + offset;
      const M* m = static_cast<const M*>(base[1]) + offset;
      // As copy_: the same dtype copies the bits (a NaN keeps its payload: a conversion through
      // float would make it the device's canonical NaN), another converts.
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        if constexpr (std::is_same_v<E, M>)
          e[i] = m[i];
        else
          e[i] = static_cast<E>(static_cast<Acc>(m[i]));
      }
      return;
    }
    const double w = 1.0 - dd;
    Op{static_cast<Acc>(w), static_cast<Acc>(1.0 - w), w < 0.5}(base, offset, n);
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

// ---- the persistent launch over a device-side table ------------------------------------
constexpr int64_t kUnit = 16384;  // elements per work unit (divides mt::kChunkSize)
constexpr int kTableThreads = 512;

// One row of the device table (four int64 words; the table tensor is int64 [n, 4]).
struct Entry {
  int64_t ema;    // address
  int64_t model;  // address
  int64_t numel;
  int64_t first_unit;  // prefix sum of the tensors' units
};
static_assert(sizeof(Entry) == 4 * sizeof(int64_t), "Entry is four int64 words");

template <typename Op>
__global__ void __launch_bounds__(kTableThreads)
    ema_table_kernel(const Entry* __restrict__ table, int n, int64_t units, Op op) {
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    // Largest t with first_unit[t] <= u (every thread of the block reads the same rows).
    int lo = 0;
    int hi = n - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (__ldg(&table[mid].first_unit) <= u) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int64_t offset = (u - __ldg(&table[lo].first_unit)) * kUnit;
    const int64_t left = __ldg(&table[lo].numel) - offset;
    void* ptrs[2] = {reinterpret_cast<void*>(__ldg(&table[lo].ema)),
                     reinterpret_cast<void*>(__ldg(&table[lo].model))};
    op(ptrs, offset, left < kUnit ? left : kUnit);
  }
}

// The cache of device tables. A table is looked up by its whole key (no hashing shortcuts),
// the most recently used first; at most kCacheSize tables are kept (a few hundred bytes of
// device memory each). Never destroyed: freeing CUDA memory from a static destructor at
// exit can run after the CUDA runtime is gone.
struct Table {
  at::Tensor rows;  // int64 [n, 4] on the device, written on the stream of its key
  int n = 0;
  int64_t units = 0;
};

struct TableCache {
  struct Item {
    std::vector<int64_t> key;
    Table table;
  };
  static constexpr size_t kCacheSize = 8;
  std::mutex mu;
  std::list<Item> items;
};

TableCache& table_cache() {
  static auto* cache = new TableCache();
  return *cache;
}

// The device table of one group (tensors on the current device, current stream), from the
// cache or built now: a pinned host copy, sent with a non-blocking copy on the current
// stream (the kernel that reads it is queued after it on that stream).
Table group_table(const Lists& lists) {
  const auto& e = lists[0];
  const auto& m = lists[1];
  const int n = static_cast<int>(e.size());
  const auto stream = at::cuda::getCurrentCUDAStream();
  std::vector<int64_t> key;
  key.reserve(4 + 3 * static_cast<size_t>(n));
  key.push_back(static_cast<int64_t>(stream.device_index()));
  key.push_back(static_cast<int64_t>(stream.id()));
  key.push_back(static_cast<int64_t>(e[0].scalar_type()));
  key.push_back(static_cast<int64_t>(m[0].scalar_type()));
  for (int i = 0; i < n; ++i) {
    key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(e[i].data_ptr())));
    key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(m[i].data_ptr())));
    key.push_back(e[i].numel());
  }
  TableCache& cache = table_cache();
  {
    const std::lock_guard<std::mutex> lock(cache.mu);
    for (auto it = cache.items.begin(); it != cache.items.end(); ++it) {
      if (it->key == key) {
        cache.items.splice(cache.items.begin(), cache.items, it);
        return it->table;  // a copy: the tensor stays alive while this call uses it
      }
    }
  }
  at::Tensor host = at::empty({n, 4}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  auto* rows = reinterpret_cast<Entry*>(host.data_ptr<int64_t>());
  int64_t units = 0;
  for (int i = 0; i < n; ++i) {
    rows[i] = Entry{key[4 + 3 * i], key[5 + 3 * i], key[6 + 3 * i], units};
    units += (key[6 + 3 * i] + kUnit - 1) / kUnit;
  }
  Table out{at::empty({n, 4}, at::TensorOptions().dtype(at::kLong).device(e[0].device())), n, units};
  out.rows.copy_(host, /*non_blocking=*/true);
  {
    const std::lock_guard<std::mutex> lock(cache.mu);
    cache.items.push_front(TableCache::Item{std::move(key), out});
    if (cache.items.size() > TableCache::kCacheSize) cache.items.pop_back();
  }
  return out;
}

template <typename Op>
void launch_table(const Lists& lists, const Op& op) {
  const Table t = group_table(lists);
  if (t.units == 0) return;
  static int per_sm = [] {
    int b = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, ema_table_kernel<Op>, kTableThreads, 0));
    return b > 0 ? b : 1;
  }();
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(t.units, sms * per_sm));
  ema_table_kernel<Op><<<blocks, kTableThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const Entry*>(t.rows.data_ptr<int64_t>()), t.n, t.units, op);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// SHARDKIT_EMA_V1=1: the first launcher for every update (read on every call, so one process
// can time both); unset or 0: the table path.
bool ema_v1_forced() {
  return shardkit::env_flag("SHARDKIT_EMA_V1", false, "the table path runs");
}

template <typename E>
void launch_update(at::ScalarType m, const Lists& lists, double w, bool table) {
  auto run = [&](auto model_tag) {
    using M = decltype(model_tag);
    using Acc = typename UpdateOp<E, M>::Acc;
    const Acc wa = static_cast<Acc>(w), da = static_cast<Acc>(1.0 - w);
    if (table) {
      // Two vectors in flight for the 32-byte fp32 vectors of a 16-bit model, else four.
      constexpr int kUnroll = UpdateOp<E, M>::kVec >= 8 && sizeof(E) >= 4 ? 2 : 4;
      launch_table(lists, UpdateOp<E, M, kUnroll>{wa, da, w < 0.5});
    } else {
      mt::multi_tensor_apply<2>(lists, UpdateOp<E, M>{wa, da, w < 0.5});
    }
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
  const bool table =
      !ema_v1_forced() && at::cuda::currentStreamCaptureStatusMayInitCtx() == at::cuda::CaptureStatus::None;
  for (const auto& [key, lists] : groups) {
    const auto e = static_cast<at::ScalarType>(key.first);
    const auto m = static_cast<at::ScalarType>(key.second);
    switch (e) {
      case at::kFloat:
        launch_update<float>(m, lists, w, table);
        break;
      case at::kDouble:
        launch_update<double>(m, lists, w, table);
        break;
      case at::kHalf:
        launch_update<c10::Half>(m, lists, w, table);
        break;
      case at::kBFloat16:
        launch_update<c10::BFloat16>(m, lists, w, table);
        break;
      default:
        TORCH_INTERNAL_ASSERT(false, "dtype was checked before");
    }
  }
}

// The decay from a device tensor (one float64): always the first launcher (the kernel
// arguments hold the tensor addresses and the decay's address, nothing cached), so the call can
// be captured in a CUDA graph and replayed with another value in the decay tensor. Its range is
// not checked here: that would need the value on the host (a sync); ModelEMA writes a decay it
// computed and checked on the host. Pairs must be flat-compatible (the strided fallback
// needs the decay on the host).
void ema_update_device_decay_cuda(at::TensorList ema, at::TensorList model, const at::Tensor& decay) {
  check_device_decay(ema, decay);
  check_update_tensors("ema_update_device_decay_", ema, model);
  if (ema.empty()) return;
  TORCH_CHECK(ema[0].is_cuda(), "ema_update_device_decay_: the CUDA kernel got `ema` on ", ema[0].device());
  const c10::cuda::CUDAGuard guard(ema[0].device());
  std::map<std::pair<int, int>, Lists> groups;
  for (size_t i = 0; i < ema.size(); ++i) {
    TORCH_CHECK(flat_compatible(ema[i], model[i]), "ema_update_device_decay_: `ema[", i, "]` and `model[", i,
                "]` must be contiguous (or dense with the same strides); use ema_update_ for strided views");
    if (ema[i].numel() == 0) continue;
    Lists& g = groups[{static_cast<int>(ema[i].scalar_type()), static_cast<int>(model[i].scalar_type())}];
    if (g.empty()) g.resize(2);
    g[0].push_back(ema[i]);
    g[1].push_back(model[i]);
  }
  const double* decay_ptr = decay.data_ptr<double>();
  for (const auto& group : groups) {
    const Lists& lists = group.second;
    const auto ema_type = static_cast<at::ScalarType>(group.first.first);
    const auto model_type = static_cast<at::ScalarType>(group.first.second);
    auto run = [&](auto ema_tag) {
      using E = decltype(ema_tag);
      auto with_model = [&](auto model_tag) {
        using M = decltype(model_tag);
        mt::multi_tensor_apply<2>(lists, DeviceDecayUpdateOp<E, M>{decay_ptr});
      };
      switch (model_type) {
        case at::kFloat:
          return with_model(float{});
        case at::kDouble:
          return with_model(double{});
        case at::kHalf:
          return with_model(c10::Half{});
        case at::kBFloat16:
          return with_model(c10::BFloat16{});
        default:
          TORCH_INTERNAL_ASSERT(false, "dtype was checked before");
      }
    };
    switch (ema_type) {
      case at::kFloat:
        run(float{});
        break;
      case at::kDouble:
        run(double{});
        break;
      case at::kHalf:
        run(c10::Half{});
        break;
      case at::kBFloat16:
        run(c10::BFloat16{});
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
  m.impl("ema_update_device_decay_", &ema_update_device_decay_cuda);
  m.impl("ema_swap_", &ema_swap_cuda);
  m.impl("ema_unswap_", &ema_unswap_cuda);
}
