// Backend-independent pieces of the ema op family: argument checks, the classification
// of (ema, model) pairs, and the ATen fallbacks for tensor pairs whose memory cannot be
// walked as two flat arrays in the same order. Both csrc/cpu/ema_cpu.cpp and
// csrc/cuda/ema_cuda.cu include this header, so both backends accept exactly the same
// inputs and raise exactly the same errors.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <c10/macros/Macros.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace shardkit {
namespace ema {

// Whether `a` and `b` can be processed as flat arrays of numel() elements starting at
// data_ptr(), element k of one matching element k of the other. True for contiguous
// pairs and for dense pairs with identical strides (e.g. two channels_last tensors).
inline bool flat_compatible(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_contiguous() && b.is_contiguous()) return true;
  return a.is_non_overlapping_and_dense() && b.is_non_overlapping_and_dense() && a.strides() == b.strides();
}

// Checks shared by every ema op: equal list lengths, equal shapes, one device for all.
inline void check_lists(const char* op, at::TensorList ema, at::TensorList model) {
  TORCH_CHECK(ema.size() == model.size(), op, ": arguments `ema` and `model` must have the same length, got ",
              ema.size(), " and ", model.size());
  if (ema.empty()) return;
  const auto device = ema[0].device();
  for (size_t i = 0; i < ema.size(); ++i) {
    TORCH_CHECK(ema[i].sizes() == model[i].sizes(), op, ": `ema[", i, "]` and `model[", i,
                "]` must have the same shape, got ", ema[i].sizes(), " and ", model[i].sizes());
    TORCH_CHECK(ema[i].device() == device, op,
                ": every tensor of `ema` must be on one device, `ema[0]` is on ", device, " but `ema[", i,
                "]` is on ", ema[i].device());
    TORCH_CHECK(model[i].device() == device, op, ": `model[", i, "]` is on ", model[i].device(),
                " but `ema` is on ", device, "; move the model tensors (or use ModelEMA(device=...))");
  }
}

// Rejects memory shared between a written tensor and any other tensor of the call (the
// kernels read and write element by element, so an overlap gives a wrong result, not an
// error). Conservative and cheap: each tensor is reduced to the byte range it spans, the
// ranges are sorted (O(N log N) for N tensors, no pairwise loop) and any intersection that
// involves a written tensor raises, including interleaved views such as x[::2] / x[1::2].
// `model_written`: the swap ops write both lists; ema_update_ only reads `model`.
inline void check_no_overlap(const char* op, at::TensorList ema, at::TensorList model, bool model_written) {
  struct Span {
    uintptr_t lo, hi;
    bool is_ema, written;
    size_t index;
  };
  std::vector<Span> spans;
  spans.reserve(ema.size() + model.size());
  auto add = [&](const at::Tensor& t, bool is_ema, bool written, size_t i) {
    if (t.numel() == 0) return;
    int64_t extent = 1;  // elements from the first to one past the last, strides >= 0
    for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
    const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
    spans.push_back({lo, lo + static_cast<uintptr_t>(extent) * t.element_size(), is_ema, written, i});
  };
  for (size_t i = 0; i < ema.size(); ++i) {
    add(ema[i], true, true, i);
    add(model[i], false, model_written, i);
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.lo < b.lo; });
  auto name = [](const Span& s) {
    return std::string(s.is_ema ? "ema[" : "model[") + std::to_string(s.index) + "]";
  };
  const Span* reach_all = nullptr;      // the span reaching furthest so far
  const Span* reach_written = nullptr;  // the written span reaching furthest so far
  for (const Span& s : spans) {
    const Span* other = s.written ? reach_all : reach_written;
    TORCH_CHECK(other == nullptr || s.lo >= other->hi, op, ": `", name(*other), "` and `", name(s),
                "` share memory (their address ranges intersect); the op writes one of them in place, so "
                "every written tensor needs memory of its own (clone the tensors first)");
    if (reach_all == nullptr || s.hi > reach_all->hi) reach_all = &s;
    if (s.written && (reach_written == nullptr || s.hi > reach_written->hi)) reach_written = &s;
  }
}

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// The tensor lists of an update op (`op`: its name in the messages).
inline void check_update_tensors(const char* op, at::TensorList ema, at::TensorList model) {
  check_lists(op, ema, model);
  check_no_overlap(op, ema, model, /*model_written=*/false);
  for (size_t i = 0; i < ema.size(); ++i) {
    TORCH_CHECK(is_supported_float(ema[i].scalar_type()), op, ": argument `ema` must hold floating-point ",
                "tensors (float32/float64/float16/bfloat16), got ", ema[i].scalar_type(), " at index ", i);
    TORCH_CHECK(is_supported_float(model[i].scalar_type()), op,
                ": argument `model` must hold floating-point ",
                "tensors (float32/float64/float16/bfloat16), got ", model[i].scalar_type(), " at index ", i);
  }
}

inline void check_update_args(at::TensorList ema, at::TensorList model, double decay) {
  check_update_tensors("ema_update_", ema, model);
  TORCH_CHECK(std::isfinite(decay) && decay >= 0.0 && decay <= 1.0,
              "ema_update_: argument `decay` must lie in [0, 1], got ", decay);
}

// ema_update_device_decay_'s `decay`: a one-element float64 tensor on the EMA's device (its value
// is read by the kernels, so a captured call takes a new value per replay).
inline void check_device_decay(at::TensorList ema, const at::Tensor& decay) {
  TORCH_CHECK(decay.defined() && decay.numel() == 1 && decay.scalar_type() == at::kDouble,
              "ema_update_device_decay_: argument `decay` must be a one-element float64 tensor, got ",
              decay.defined() ? c10::toString(decay.scalar_type()) : "an undefined tensor", " of ",
              decay.defined() ? decay.numel() : 0, " elements");
  if (!ema.empty()) {
    TORCH_CHECK(decay.device() == ema[0].device(), "ema_update_device_decay_: argument `decay` is on ",
                decay.device(), " but `ema` is on ", ema[0].device(), "; keep the decay on the EMA's device");
  }
}

// The weight of the model in the update, in the arithmetic type of the kernels. Computed
// once in double so that 1 - decay keeps its precision for decay close to 1.
inline double model_weight(double decay) {
  return 1.0 - decay;
}

// Decay 1 and 0 before any arithmetic: 1 leaves the EMA as it is and 0 copies the model,
// whatever the values (the formulas' 0 * (m - e) is NaN when m - e is infinite: a diverged
// EMA would never be reset by a copy phase). Returns true when the update is done.
inline bool update_at_the_ends(at::TensorList ema, at::TensorList model, double decay) {
  if (decay == 1.0) return true;
  if (decay != 0.0) return false;
  for (size_t i = 0; i < ema.size(); ++i) {
    if (ema[i].numel() != 0) ema[i].copy_(model[i]);
  }
  return true;
}

// The update in the kernels' form: e + w (m - e) for w < 0.5, else m - (1 - w)(m - e)
// (the two forms of torch.lerp: decay 1 keeps e and decay 0 copies m exactly).
// This function: the update for a pair that is not flat-compatible (arbitrary strides). Uses the
// same formula and arithmetic type as the kernels, at the cost of temporaries.
inline void fallback_update(const at::Tensor& e, const at::Tensor& m, double decay) {
  const bool wide = e.scalar_type() == at::kDouble || m.scalar_type() == at::kDouble;
  const auto acc = wide ? at::kDouble : at::kFloat;
  auto rounded = [&](double x) { return wide ? x : static_cast<double>(static_cast<float>(x)); };
  const double w = model_weight(decay);
  // Tensor::to returns the tensor itself when it already has dtype `acc`, so `ea` and `ma`
  // may alias `e` and `m`: only out-of-place ops on them (an in-place op on `ma` would
  // overwrite the model's tensor; only `e` may be written, and only by the final copy).
  const at::Tensor ea = e.to(acc);
  const at::Tensor ma = m.to(acc);
  at::Tensor diff = ma.sub(ea);
  const at::Tensor out = w < 0.5 ? ea.add(diff.mul_(rounded(w))) : ma.sub(diff.mul_(rounded(1.0 - w)));
  e.copy_(out);
}

// ---- Stochastic rounding of a bfloat16 EMA (ema_update_stochastic_) -------------------
// The update is computed in fp32 (fp64 with an fp64 model, then rounded to fp32) and rounded
// to bfloat16 up or down in magnitude with the probabilities that make its expected value the
// fp32 one: 16 random bits are added below the bfloat16 mantissa, then the low half is cut.
// Updates far below a bfloat16 ulp (decay 0.9999) then accumulate in expectation instead of
// rounding away. The bits come from a counter-based hash of (seed, counter, tensor index,
// element index): the same on every backend and thread split, so a CUDA update equals the
// CPU one bit for bit, and ranks with the same seed and counter stay equal.
C10_HOST_DEVICE inline uint64_t mix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ull;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The key of tensor `index` of an update with (seed, counter); element k's bits: stochastic_bits.
C10_HOST_DEVICE inline uint64_t stochastic_key(int64_t seed, int64_t counter, int64_t index) {
  const uint64_t base =
      mix64(static_cast<uint64_t>(seed) + 0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(counter) + 1));
  return mix64(base ^ (0xD1B54A32D192ED03ull * (static_cast<uint64_t>(index) + 1)));
}

// 32-bit arithmetic only (murmur3's finalizer over the element index, offset by the key), so
// the CPU loop vectorizes; elements past 2^32 fold their high bits into the offset.
C10_HOST_DEVICE inline uint32_t stochastic_bits(uint64_t key, int64_t element) {
  const uint64_t k = static_cast<uint64_t>(element);
  uint32_t x = static_cast<uint32_t>(k) * 0x9E3779B1u +
               (static_cast<uint32_t>(key) ^ static_cast<uint32_t>(k >> 32) * 0x85EBCA6Bu);
  x ^= static_cast<uint32_t>(key >> 32);
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x >> 16;
}

// `bits`: the fp32 pattern of the value; `r`: 16 random bits. NaN and infinities round to
// nearest (a NaN stays a quiet NaN, an infinity stays itself); a finite value past the bfloat16
// maximum may round to infinity, with its probability.
C10_HOST_DEVICE inline uint16_t bf16_round_stochastic(uint32_t bits, uint32_t r) {
  if ((bits & 0x7F800000u) == 0x7F800000u) {
    return static_cast<uint16_t>((bits & 0x007FFFFFu) ? ((bits >> 16) | 0x0040u) : (bits >> 16));
  }
  return static_cast<uint16_t>((bits + r) >> 16);
}

// ema_update_stochastic_'s arguments: the update's, seed and counter >= 0, one salt per tensor.
inline void check_stochastic_args(at::TensorList ema, at::TensorList model, double decay, int64_t seed,
                                  int64_t counter, c10::IntArrayRef salts) {
  const char* op = "ema_update_stochastic_";
  check_update_tensors(op, ema, model);
  TORCH_CHECK(std::isfinite(decay) && decay >= 0.0 && decay <= 1.0, op,
              ": argument `decay` must lie in [0, 1], got ", decay);
  TORCH_CHECK(seed >= 0, op, ": argument `seed` must be >= 0, got ", seed);
  TORCH_CHECK(counter >= 0, op, ": argument `counter` must be >= 0, got ", counter);
  TORCH_CHECK(salts.size() == ema.size(), op, ": argument `salts` must have one entry per `ema` tensor, got ",
              salts.size(), " for ", ema.size());
}

// The pairs of an ema_update_stochastic_ call that are not bfloat16 EMAs go to ema_update_ (the
// backend's own fused kernel), through the dispatcher; returns the indices of the others.
inline std::vector<size_t> update_the_others(at::TensorList ema, at::TensorList model, double decay) {
  std::vector<at::Tensor> e, m;
  std::vector<size_t> bf16;
  for (size_t i = 0; i < ema.size(); ++i) {
    if (ema[i].scalar_type() == at::kBFloat16) {
      bf16.push_back(i);
    } else {
      e.push_back(ema[i]);
      m.push_back(model[i]);
    }
  }
  if (!e.empty()) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("shardkit::ema_update_", "")
                         .typed<void(at::TensorList, at::TensorList, double)>();
    op.call(e, m, decay);
  }
  return bf16;
}

// ---- The bfloat16 packing of ema.swap for a float32 EMA of a bfloat16 model ----------
// swap:   model <- bf16(e), rounding the 32-bit pattern half-up on its low 16 bits
//         (ties away from zero in magnitude); ema <- (old model bits << 16) | (e & 0xFFFF).
// unswap: lo = ema & 0xFFFF; the high half of e is the model's current bits minus the
//         carry the rounding added (1 exactly when lo >= 0x8000), modulo 2^16.
// Pure integer arithmetic, so unswap(swap(x)) == x bit for bit for every pattern,
// including negative values, infinities and NaNs. What the model sees while swapped:
// finite values rounded to nearest; a value within half a bf16 ulp of the bf16 maximum
// rounds to infinity; a NaN EMA value may show as another NaN or, for payloads with all
// high mantissa bits set, wrap to a signed zero (the restore is still exact).
C10_HOST_DEVICE inline void bf16_pack(uint32_t& ema_bits, uint16_t& model_bits) {
  const uint32_t e = ema_bits;
  const uint32_t m = model_bits;
  model_bits = static_cast<uint16_t>((e + 0x8000u) >> 16);
  ema_bits = (m << 16) | (e & 0xFFFFu);
}

C10_HOST_DEVICE inline void bf16_unpack(uint32_t& ema_bits, uint16_t& model_bits) {
  const uint32_t p = ema_bits;
  const uint32_t lo = p & 0xFFFFu;
  const uint32_t hi = (static_cast<uint32_t>(model_bits) - (lo >> 15)) & 0xFFFFu;
  model_bits = static_cast<uint16_t>(p >> 16);
  ema_bits = (hi << 16) | lo;
}

// The kinds of (ema, model) pair the swap ops handle.
enum class SwapKind { kExchange, kPackBF16 };

inline SwapKind check_swap_pair(const char* op, const at::Tensor& e, const at::Tensor& m, size_t i) {
  if (e.scalar_type() == m.scalar_type()) return SwapKind::kExchange;
  TORCH_CHECK(e.scalar_type() == at::kFloat && m.scalar_type() == at::kBFloat16, op, ": `ema[", i, "]` (",
              e.scalar_type(), ") and `model[", i, "]` (", m.scalar_type(),
              ") must have the same dtype, or be float32 EMA with a bfloat16 model; ",
              "ModelEMA.swap stashes other combinations in host memory");
  TORCH_CHECK(flat_compatible(e, m), op, ": the bfloat16 packing needs `ema[", i, "]` and `model[", i,
              "]` contiguous (or dense with the same strides)");
  return SwapKind::kPackBF16;
}

// Exchange for a same-dtype pair that is not flat-compatible: one temporary of that tensor.
inline void fallback_exchange(const at::Tensor& e, const at::Tensor& m) {
  at::Tensor tmp = m.clone();
  m.copy_(e);
  e.copy_(tmp);
}

}  // namespace ema
}  // namespace shardkit
