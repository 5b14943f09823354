// CPU kernel of ema_update_stochastic_: the update of a bfloat16 EMA with stochastic rounding
// (the rule and the random bits: ema_common.h). The same two forms of torch.lerp as
// ema_update_, in fp32 (fp64 with an fp64 model), so only the final rounding differs.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <type_traits>
#include <vector>

#include "ema_common.h"

namespace {

using namespace shardkit::ema;

// Elements per work item; all items of all tensors run in ONE parallel region (a model of
// hundreds of small tensors then wakes the threads once, not once per tensor).
constexpr int64_t kChunk = 1 << 15;
constexpr int64_t kSerialBelow = 1 << 16;

inline float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SR_CLONES
#endif

// Elements [begin, end) of one pair; `low`: the lerp form e + w (m - e), else m - d (m - e).
template <typename M>
SR_CLONES void update_stochastic(uint16_t* __restrict e, const M* __restrict m, int64_t begin, int64_t end,
                                 double w_d, uint64_t key) {
  using Acc = std::conditional_t<std::is_same_v<M, double>, double, float>;
  const Acc w = static_cast<Acc>(w_d);
  const Acc d = static_cast<Acc>(1.0 - w_d);
  const bool low = w_d < 0.5;
  for (int64_t i = begin; i < end; ++i) {
    const Acc ev = static_cast<Acc>(bf16_value(e[i]));
    const Acc mv = static_cast<Acc>(m[i]);
    const Acc diff = mv - ev;
    const float v = static_cast<float>(low ? ev + w * diff : mv - d * diff);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    e[i] = bf16_round_stochastic(bits, stochastic_bits(key, i));
  }
}

using Fn = void (*)(uint16_t*, const void*, int64_t, int64_t, double, uint64_t);

template <typename M>
void run(uint16_t* e, const void* m, int64_t begin, int64_t end, double w, uint64_t key) {
  update_stochastic<M>(e, static_cast<const M*>(m), begin, end, w, key);
}

Fn pick(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return &run<float>;
    case at::kDouble:
      return &run<double>;
    case at::kHalf:
      return &run<c10::Half>;
    default:
      return &run<c10::BFloat16>;
  }
}

struct Job {
  uint16_t* e;
  const void* m;
  int64_t n;
  uint64_t key;
  Fn fn;
};

void ema_update_stochastic_cpu(at::TensorList ema, at::TensorList model, double decay, int64_t seed,
                               int64_t counter, c10::IntArrayRef salts) {
  check_stochastic_args(ema, model, decay, seed, counter, salts);
  if (!ema.empty()) {
    TORCH_CHECK(ema[0].device().is_cpu(), "ema_update_stochastic_: the CPU kernel got `ema` on ",
                ema[0].device());
  }
  if (update_at_the_ends(ema, model, decay)) return;
  const double w = model_weight(decay);
  // Strided pairs run on contiguous copies (the element index is then the logical one).
  std::vector<Job> jobs;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;
  std::vector<at::Tensor> keep;
  for (const size_t i : update_the_others(ema, model, decay)) {
    if (ema[i].numel() == 0) continue;
    const bool flat = flat_compatible(ema[i], model[i]);
    at::Tensor e = flat ? ema[i] : ema[i].contiguous();
    at::Tensor m = flat ? model[i] : model[i].contiguous();
    if (!flat) {
      write_back.emplace_back(ema[i], e);
      keep.push_back(m);
    }
    jobs.push_back({reinterpret_cast<uint16_t*>(e.data_ptr()), m.const_data_ptr(), e.numel(),
                    stochastic_key(seed, counter, salts[i]), pick(m.scalar_type())});
  }
  std::vector<std::pair<size_t, int64_t>> items;  // (job, first element)
  int64_t total = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    for (int64_t b = 0; b < jobs[j].n; b += kChunk) items.emplace_back(j, b);
    total += jobs[j].n;
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, n_items, total < kSerialBelow ? n_items + 1 : 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const Job& job = jobs[items[k].first];
      const int64_t begin = items[k].second;
      job.fn(job.e, job.m, begin, std::min(job.n, begin + kChunk), w, job.key);
    }
  });
  for (auto& [dst, src] : write_back) dst.copy_(src);
}

}  // namespace

TORCH_LIBRARY_IMPL(shardkit, CPU, m) {
  m.impl("ema_update_stochastic_", &ema_update_stochastic_cpu);
}
