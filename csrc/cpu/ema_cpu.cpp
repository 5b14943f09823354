// CPU kernels of the ema op family: ema_update_, ema_swap_, ema_unswap_.
//
// All (ema, model) pairs of one call are cut into work items of kCpuChunk elements
// (a tensor smaller than that is one item), and ONE at::parallel_for runs over the items
// of every tensor together, so hundreds of small tensors cost one parallel region rather
// than one each. The inner loops are plain loops over __restrict pointers with the
// conversions written as integer bit operations, which the compiler vectorizes with the
// baseline instruction set (no -march flags) and, for the update, also for AVX2 (see
// EMA_CLONES); the op is memory-bound, and the benchmark (benchmarks/bench_ema.py) compares
// it with torch's own vectorized foreach kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ema_common.h"

namespace {

using namespace shardkit::ema;

// Elements per work item. Tests straddle multiples of it (kept in sync with
// tests/test_ema.py::CPU_CHUNK).
constexpr int64_t kCpuChunk = 1 << 15;
// Below this many elements in total, waking the second thread costs more than it saves.
constexpr int64_t kSerialBelow = 1 << 16;

// ---- storage <-> arithmetic conversions -----------------------------------------------
// bfloat16 is handled as raw uint16_t bits so the loops stay integer/float only (and so
// vectorize); float16 goes through c10::Half's bit-manipulation conversions.
template <typename S>
struct Conv;
template <>
struct Conv<float> {
  using raw = float;
  static inline float ld(raw x) { return x; }
  template <typename A>
  static inline raw st(A v) {
    return static_cast<float>(v);
  }
};
template <>
struct Conv<double> {
  using raw = double;
  static inline double ld(raw x) { return x; }
  template <typename A>
  static inline raw st(A v) {
    return static_cast<double>(v);
  }
};
template <>
struct Conv<c10::Half> {
  using raw = c10::Half;
  static inline float ld(raw x) { return static_cast<float>(x); }
  template <typename A>
  static inline raw st(A v) {
    return c10::Half(static_cast<float>(v));
  }
};
template <>
struct Conv<c10::BFloat16> {
  using raw = uint16_t;
  static inline float ld(raw x) {
    const uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
  template <typename A>
  static inline raw st(A v) {
    // Round to nearest even, NaN kept a (quiet) NaN: the same rule as c10::BFloat16.
    const float f = static_cast<float>(v);
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return static_cast<uint16_t>(f != f ? 0x7FC0u : rounded);
  }
};

// The update loop is also compiled for AVX2 (picked at load time from the CPU's features; the
// extension is built without -march): memory-bound as it is, the 8-lane version still ran
// 2-7% faster than the SSE2 one on a 105M-parameter fp32 model (2-core AMD EPYC), enough to
// move it from just behind torch's AVX2 foreach kernels to just ahead.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define EMA_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define EMA_CLONES
#endif

// One work item of the update: elements [begin, end) of one pair.
using ChunkFn = void (*)(char* e, char* m, int64_t begin, int64_t end, double arg);

template <typename E, typename M>
EMA_CLONES void update_chunk(char* ep, char* mp, int64_t begin, int64_t end, double w_d) {
  // fp32 arithmetic, fp64 when either side is fp64.
  using Acc = std::conditional_t<std::is_same_v<E, double> || std::is_same_v<M, double>, double, float>;
  using ER = typename Conv<E>::raw;
  using MR = typename Conv<M>::raw;
  ER* __restrict e = reinterpret_cast<ER*>(ep) + begin;
  const MR* __restrict m = reinterpret_cast<const MR*>(mp) + begin;
  const int64_t n = end - begin;
  // The two forms of torch.lerp, so decay 1 keeps and decay 0 copies exactly.
  if (w_d < 0.5) {
    const Acc w = static_cast<Acc>(w_d);
    for (int64_t i = 0; i < n; ++i) {
      const Acc ev = static_cast<Acc>(Conv<E>::ld(e[i]));
      const Acc mv = static_cast<Acc>(Conv<M>::ld(m[i]));
      e[i] = Conv<E>::st(ev + w * (mv - ev));
    }
  } else {
    const Acc d = static_cast<Acc>(1.0 - w_d);
    for (int64_t i = 0; i < n; ++i) {
      const Acc ev = static_cast<Acc>(Conv<E>::ld(e[i]));
      const Acc mv = static_cast<Acc>(Conv<M>::ld(m[i]));
      e[i] = Conv<E>::st(mv - d * (mv - ev));
    }
  }
}

template <typename E>
ChunkFn pick_update_model(at::ScalarType m) {
  switch (m) {
    case at::kFloat:
      return &update_chunk<E, float>;
    case at::kDouble:
      return &update_chunk<E, double>;
    case at::kHalf:
      return &update_chunk<E, c10::Half>;
    case at::kBFloat16:
      return &update_chunk<E, c10::BFloat16>;
    default:
      TORCH_INTERNAL_ASSERT(false, "dtype was checked before");
  }
}

ChunkFn pick_update(at::ScalarType e, at::ScalarType m) {
  switch (e) {
    case at::kFloat:
      return pick_update_model<float>(m);
    case at::kDouble:
      return pick_update_model<double>(m);
    case at::kHalf:
      return pick_update_model<c10::Half>(m);
    case at::kBFloat16:
      return pick_update_model<c10::BFloat16>(m);
    default:
      TORCH_INTERNAL_ASSERT(false, "dtype was checked before");
  }
}

template <typename U>
void exchange_chunk(char* ep, char* mp, int64_t begin, int64_t end, double) {
  U* __restrict e = reinterpret_cast<U*>(ep) + begin;
  U* __restrict m = reinterpret_cast<U*>(mp) + begin;
  for (int64_t i = 0; i < end - begin; ++i) {
    const U t = e[i];
    e[i] = m[i];
    m[i] = t;
  }
}

ChunkFn pick_exchange(size_t element_size) {
  switch (element_size) {
    case 1:
      return &exchange_chunk<uint8_t>;
    case 2:
      return &exchange_chunk<uint16_t>;
    case 4:
      return &exchange_chunk<uint32_t>;
    case 8:
      return &exchange_chunk<uint64_t>;
    default:
      return nullptr;  // complex128 etc.: the caller falls back to ATen
  }
}

template <bool kPack>
void bf16_chunk(char* ep, char* mp, int64_t begin, int64_t end, double) {
  uint32_t* __restrict e = reinterpret_cast<uint32_t*>(ep) + begin;
  uint16_t* __restrict m = reinterpret_cast<uint16_t*>(mp) + begin;
  for (int64_t i = 0; i < end - begin; ++i) {
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

struct Job {
  char* e;
  char* m;
  int64_t n;
  ChunkFn fn;
};

// Runs every job's elements through its ChunkFn in one parallel region.
void run_jobs(const std::vector<Job>& jobs, double arg) {
  struct Item {
    int64_t job;
    int64_t begin;
  };
  std::vector<Item> items;
  int64_t total = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    for (int64_t b = 0; b < jobs[j].n; b += kCpuChunk) items.push_back({static_cast<int64_t>(j), b});
    total += jobs[j].n;
  }
  if (items.empty()) return;
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t grain = total < kSerialBelow ? n_items + 1 : 1;
  at::parallel_for(0, n_items, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const Job& job = jobs[items[k].job];
      job.fn(job.e, job.m, items[k].begin, std::min(job.n, items[k].begin + kCpuChunk), arg);
    }
  });
}

void check_cpu(const char* op, at::TensorList ema) {
  if (!ema.empty()) {
    TORCH_CHECK(ema[0].device().is_cpu(), op, ": the CPU kernel got `ema` on ", ema[0].device());
  }
}

void ema_update_cpu(at::TensorList ema, at::TensorList model, double decay) {
  check_update_args(ema, model, decay);
  check_cpu("ema_update_", ema);
  if (update_at_the_ends(ema, model, decay)) return;
  std::vector<Job> jobs;
  jobs.reserve(ema.size());
  for (size_t i = 0; i < ema.size(); ++i) {
    if (ema[i].numel() == 0) continue;
    if (!flat_compatible(ema[i], model[i])) {
      fallback_update(ema[i], model[i], decay);  // strided views: correct, not fused
      continue;
    }
    jobs.push_back({static_cast<char*>(ema[i].data_ptr()), static_cast<char*>(model[i].data_ptr()),
                    ema[i].numel(), pick_update(ema[i].scalar_type(), model[i].scalar_type())});
  }
  run_jobs(jobs, model_weight(decay));
}

// The decay from a tensor: on the CPU it is read here (checked as ema_update_'s), then the same
// kernel runs, so the result is ema_update_'s bit for bit.
void ema_update_device_decay_cpu(at::TensorList ema, at::TensorList model, const at::Tensor& decay) {
  check_device_decay(ema, decay);
  check_update_tensors("ema_update_device_decay_", ema, model);
  const double d = decay.item<double>();
  TORCH_CHECK(std::isfinite(d) && d >= 0.0 && d <= 1.0,
              "ema_update_device_decay_: argument `decay` must lie in [0, 1], got ", d);
  ema_update_cpu(ema, model, d);
}

template <bool kPack>
void ema_swap_impl(const char* op, at::TensorList ema, at::TensorList model) {
  check_lists(op, ema, model);
  check_no_overlap(op, ema, model, /*model_written=*/true);
  check_cpu(op, ema);
  std::vector<Job> jobs;
  for (size_t i = 0; i < ema.size(); ++i) {
    const SwapKind kind = check_swap_pair(op, ema[i], model[i], i);
    if (ema[i].numel() == 0) continue;
    ChunkFn fn = kind == SwapKind::kPackBF16 ? &bf16_chunk<kPack> : pick_exchange(ema[i].element_size());
    if (kind == SwapKind::kExchange && (fn == nullptr || !flat_compatible(ema[i], model[i]))) {
      fallback_exchange(ema[i], model[i]);
      continue;
    }
    jobs.push_back(
        {static_cast<char*>(ema[i].data_ptr()), static_cast<char*>(model[i].data_ptr()), ema[i].numel(), fn});
  }
  run_jobs(jobs, 0.0);
}

void ema_swap_cpu(at::TensorList ema, at::TensorList model) {
  ema_swap_impl<true>("ema_swap_", ema, model);
}
void ema_unswap_cpu(at::TensorList ema, at::TensorList model) {
  ema_swap_impl<false>("ema_unswap_", ema, model);
}

}  // namespace

TORCH_LIBRARY_IMPL(shardkit, CPU, m) {
  m.impl("ema_update_", &ema_update_cpu);
  m.impl("ema_update_device_decay_", &ema_update_device_decay_cpu);
  m.impl("ema_swap_", &ema_swap_cpu);
  m.impl("ema_unswap_", &ema_unswap_cpu);
}
