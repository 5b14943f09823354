// CPU kernel of ema_update_stochastic_: the update of a bfloat16 EMA with stochastic rounding
// (the rule and the random bits: ema_common.h). The same two forms of torch.lerp as
// ema_update_, in fp32 (fp64 with an fp64 model), so only the final rounding differs.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "ema_common.h"

namespace {

using namespace shardkit::ema;

constexpr int64_t kGrain = 1 << 15;

inline float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <typename M>
void update_stochastic(uint16_t* e, const M* m, int64_t n, double w_d, uint64_t key) {
  using Acc = std::conditional_t<std::is_same_v<M, double>, double, float>;
  const bool low = w_d < 0.5;
  const Acc w = static_cast<Acc>(w_d);
  const Acc d = static_cast<Acc>(1.0 - w_d);
  at::parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const Acc ev = static_cast<Acc>(bf16_value(e[i]));
      const Acc mv = static_cast<Acc>(m[i]);
      const Acc diff = mv - ev;
      const float v = static_cast<float>(low ? ev + w * diff : mv - d * diff);
      uint32_t bits;
      std::memcpy(&bits, &v, sizeof(bits));
      e[i] = bf16_round_stochastic(bits, stochastic_bits(key, i));
    }
  });
}

void ema_update_stochastic_cpu(at::TensorList ema, at::TensorList model, double decay, int64_t seed,
                               int64_t counter, c10::IntArrayRef salts) {
  check_stochastic_args(ema, model, decay, seed, counter, salts);
  if (!ema.empty()) {
    TORCH_CHECK(ema[0].device().is_cpu(), "ema_update_stochastic_: the CPU kernel got `ema` on ",
                ema[0].device());
  }
  if (update_at_the_ends(ema, model, decay)) return;
  const double w = model_weight(decay);
  for (const size_t i : update_the_others(ema, model, decay)) {
    if (ema[i].numel() == 0) continue;
    // Strided pairs run on contiguous copies (the element index is then the logical one).
    const bool flat = flat_compatible(ema[i], model[i]);
    at::Tensor e = flat ? ema[i] : ema[i].contiguous();
    const at::Tensor m = flat ? model[i] : model[i].contiguous();
    const uint64_t key = stochastic_key(seed, counter, salts[i]);
    auto* ep = reinterpret_cast<uint16_t*>(e.data_ptr());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, m.scalar_type(), "ema_update_stochastic_", [&] {
      update_stochastic<scalar_t>(ep, m.const_data_ptr<scalar_t>(), e.numel(), w, key);
    });
    if (!flat) ema[i].copy_(e);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(shardkit, CPU, m) {
  m.impl("ema_update_stochastic_", &ema_update_stochastic_cpu);
}
