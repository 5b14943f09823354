// Shared by the CPU and CUDA kernels of the sharded cross-entropy: argument checks and the
// margin function psi with its exact derivative.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <limits>

#ifdef __CUDACC__
#define SCE_HD __host__ __device__ __forceinline__
#else
#define SCE_HD inline
#endif

namespace shardkit {
namespace sce {

// Margin parameters, pre-digested on the host so kernels do no per-element branching on them.
struct Margin {
  double scale;
  double m1, m2, m3;
  bool normalize;
  bool plain_target;  // m1 == 1 and m2 == 0: psi(c) = c - m3 (CosFace / plain), no acos
  double c_max;       // psi is linear in c below c_max (where m1*theta + m2 > pi); -2 if never
};

inline Margin make_margin(double scale, double m1, double m2, double m3, bool normalize) {
  Margin mg{scale, m1, m2, m3, normalize, m1 == 1.0 && m2 == 0.0, -2.0};
  const double pi = 3.14159265358979323846;
  const double theta_max = (pi - m2) / m1;
  // theta lies in [0, pi]: only a threshold below pi gives a linear region.
  if (!mg.plain_target && theta_max < pi) mg.c_max = std::cos(theta_max);
  return mg;
}

// psi(c) = cos(m1*acos(c) + m2) - m3 with theta from c clamped to [-1+1e-7, 1-1e-7] (acos is
// not differentiable at +-1), continued linearly with slope 1 below c_max so the target logit
// stays monotone in c when m1*theta + m2 passes pi. dpsi is the exact derivative of that
// function (0 where the clamp is active, as autograd through torch.clamp gives).
// Evaluated in double whatever T: it runs once per row (the target column only), and 1 - 1e-7
// is not representable in float (the clamp would move by 1e-8 and theta by 10%).
template <typename T>
SCE_HD void margin_psi(T c_in, bool plain, double m1, double m2, double m3, double c_max, T* psi, T* dpsi) {
  const double c = c_in;
  if (plain) {
    *psi = static_cast<T>(c - m3);
    *dpsi = T(1);
    return;
  }
  if (c < c_max) {
    *psi = static_cast<T>(-1.0 - m3 + (c - c_max));
    *dpsi = T(1);
    return;
  }
  const double lo = -1.0 + 1e-7, hi = 1.0 - 1e-7;
  const bool inside = c >= lo && c <= hi;
  const double cc = c < lo ? lo : (c > hi ? hi : c);
  const double th = acos(cc);
  const double a = m1 * th + m2;
  *psi = static_cast<T>(cos(a) - m3);
  *dpsi = inside ? static_cast<T>(m1 * sin(a) / sin(th)) : T(0);
}

// The class chunks whose logits a forward keeps for its backward (the memory budget): of
// the shard's ceil(C / chunk) chunks, `keep` spread evenly over the full-size ones (so each
// thread's fixed block of chunks gets its share of skipped recomputes), or all of them when
// `keep` reaches the chunk count. Kept chunk k sits at slot(k) in the kept buffer, slot
// order = chunk order, each slot `chunk` classes wide ([B, n] row-major, n = the chunk's
// classes). The forward and the backward derive the same set from (C, chunk, keep).
struct KeptChunks {
  int64_t chunk = 1, full = 0, keep = 0;
  bool all = false;
  SCE_HD KeptChunks(int64_t C, int64_t chunk_, int64_t keep_) : chunk(chunk_) {
    const int64_t nchunks = (C + chunk - 1) / chunk;
    all = keep_ >= nchunks;  // also C == 0: nothing to keep
    full = C / chunk;
    keep = all ? nchunks : (keep_ < 0 ? 0 : keep_);  // keep < nchunks <= full + 1: keep <= full
  }
  SCE_HD bool kept(int64_t k) const {
    return all || (keep > 0 && k < full && (k + 1) * keep / full > k * keep / full);
  }
  // Kept chunks before chunk k (the telescoping sum of kept(i) for i < k).
  SCE_HD int64_t slot(int64_t k) const { return all ? k : k * keep / full; }
  // Classes held: every class, or `keep` full chunks.
  SCE_HD int64_t classes(int64_t C) const { return all ? C : keep * chunk; }
};

// The kept_logits / kept_target pair a ce_shard_stats_keep returned, as its backward takes it
// back: logits [B * KeptChunks.classes(C)] of `kept_dtype` (the CPU: the statistics' dtype; CUDA:
// x's dtype for 16-bit x), target [B] of `target_dtype` (the statistics'), both contiguous on x's
// device.
inline void check_kept(const at::Tensor& x, const at::Tensor& w, const at::Tensor& logits,
                       const at::Tensor& target, int64_t chunk_classes, int64_t keep_chunks,
                       at::ScalarType kept_dtype, at::ScalarType target_dtype) {
  TORCH_CHECK(keep_chunks >= 0, "argument `keep_chunks` must be >= 0, got ", keep_chunks);
  const KeptChunks set(w.size(0), chunk_classes, keep_chunks);
  const int64_t want = x.size(0) * set.classes(w.size(0));
  TORCH_CHECK(logits.dim() == 1 && logits.size(0) == want && logits.scalar_type() == kept_dtype &&
                  logits.is_contiguous() && logits.device() == x.device(),
              "argument `kept_logits` must be the contiguous [", want, "] ", kept_dtype,
              " tensor ce_shard_stats_keep returned for these arguments, got ", logits.sizes(), " ",
              logits.scalar_type());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == x.size(0) && target.scalar_type() == target_dtype &&
                  target.is_contiguous() && target.device() == x.device(),
              "argument `kept_target` must be the contiguous [", x.size(0), "] ", target_dtype,
              " tensor ce_shard_stats_keep returned, got ", target.sizes(), " ", target.scalar_type());
}

// Dtype of the statistics and of the internal accumulation: fp64 for fp64 inputs (so that
// gradcheck works), fp32 otherwise.
inline at::ScalarType acc_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// True for the mixed dtype pairs: x bf16 / fp16 with w fp32.
inline bool is_mixed(at::ScalarType xt, at::ScalarType wt) {
  return (xt == at::kBFloat16 || xt == at::kHalf) && wt == at::kFloat;
}

inline void check_common(const at::Tensor& x, const at::Tensor& w, const at::Tensor& labels,
                         int64_t class_offset, double scale, double m1, double m2, double m3, bool normalize,
                         int64_t chunk_classes) {
  TORCH_CHECK(x.dim() == 2, "argument `x` must be 2-D [B, D], got shape ", x.sizes());
  const auto xt = x.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kDouble || xt == at::kHalf || xt == at::kBFloat16,
              "argument `x` must be float32, float64, float16 or bfloat16, got ", xt);
  TORCH_CHECK(w.dim() == 2, "argument `w` must be 2-D [C_k, D], got shape ", w.sizes());
  // Mixed mode: fp32 weights with 16-bit embeddings (fp32 master weights under autocast). The
  // kernels convert w chunk by chunk to x's dtype where they need it and write grad_w in fp32,
  // so the caller need not hold a 16-bit copy of the whole shard nor of its gradient.
  TORCH_CHECK(w.scalar_type() == xt || is_mixed(xt, w.scalar_type()),
              "argument `w` must have the dtype of `x` (", xt,
              "), or be float32 when `x` is bfloat16 or float16, got ", w.scalar_type());
  TORCH_CHECK(w.device() == x.device(), "argument `w` must be on the device of `x` (", x.device(), "), got ",
              w.device());
  TORCH_CHECK(w.size(1) == x.size(1), "argument `w` has embedding dim ", w.size(1), " but `x` has ",
              x.size(1));
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == x.size(0), "argument `labels` must have shape [",
              x.size(0), "] (one label per row of `x`), got ", labels.sizes());
  TORCH_CHECK(labels.scalar_type() == at::kLong, "argument `labels` must be int64, got ",
              labels.scalar_type());
  TORCH_CHECK(labels.device() == x.device(), "argument `labels` must be on the device of `x` (", x.device(),
              "), got ", labels.device());
  TORCH_CHECK(class_offset >= 0, "argument `class_offset` must be >= 0, got ", class_offset);
  TORCH_CHECK(chunk_classes >= 1, "argument `chunk_classes` must be >= 1, got ", chunk_classes);
  TORCH_CHECK(std::isfinite(scale), "argument `scale` must be finite, got ", scale);
  // The kernels compute in float unless x is float64: the scale must be a finite float there.
  TORCH_CHECK(xt == at::kDouble || std::fabs(scale) <= static_cast<double>(std::numeric_limits<float>::max()),
              "argument `scale` = ", scale, " is beyond the float32 range the kernels compute in for ", xt,
              " inputs");
  TORCH_CHECK(std::isfinite(m2) && std::isfinite(m3), "arguments `m2` and `m3` must be finite, got ", m2,
              " and ", m3);
  TORCH_CHECK(normalize || (m1 == 1.0 && m2 == 0.0 && m3 == 0.0), "margins (m1, m2, m3) = (", m1, ", ", m2,
              ", ", m3, ") require normalize=True; without normalization use m1=1, m2=0, m3=0");
  TORCH_CHECK(m1 > 0.0 && std::isfinite(m1), "argument `m1` must be a finite number > 0, got ", m1);
}

inline void check_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& labels,
                          const c10::optional<at::Tensor>& target_ref, int64_t class_offset, double scale,
                          double m1, double m2, double m3, bool normalize, int64_t chunk_classes) {
  check_common(x, w, labels, class_offset, scale, m1, m2, m3, normalize, chunk_classes);
  if (target_ref.has_value() && target_ref->defined()) {
    const auto& t = *target_ref;
    TORCH_CHECK(t.dim() == 1 && t.size(0) == x.size(0), "argument `target_ref` must have shape [", x.size(0),
                "], got ", t.sizes());
    TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble,
                "argument `target_ref` must be float32 (or float64), got ", t.scalar_type());
    TORCH_CHECK(t.device() == x.device(), "argument `target_ref` must be on the device of `x` (", x.device(),
                "), got ", t.device());
  }
}

inline void check_backward(const at::Tensor& grad_lse, const at::Tensor& grad_target,
                           const at::Tensor& grad_sum, const at::Tensor& x, const at::Tensor& w,
                           const at::Tensor& labels, const at::Tensor& lse, int64_t class_offset,
                           double scale, double m1, double m2, double m3, bool normalize,
                           int64_t chunk_classes) {
  check_common(x, w, labels, class_offset, scale, m1, m2, m3, normalize, chunk_classes);
  const int64_t B = x.size(0);
  const std::pair<const at::Tensor*, const char*> vecs[] = {
      {&grad_lse, "grad_lse"}, {&grad_target, "grad_target"}, {&grad_sum, "grad_sum"}, {&lse, "lse"}};
  for (const auto& p : vecs) {
    const at::Tensor& t = *p.first;
    TORCH_CHECK(t.dim() == 1 && t.size(0) == B, "argument `", p.second, "` must have shape [", B, "], got ",
                t.sizes());
    TORCH_CHECK(at::isFloatingType(t.scalar_type()), "argument `", p.second, "` must be floating point, got ",
                t.scalar_type());
    TORCH_CHECK(t.device() == x.device(), "argument `", p.second, "` must be on the device of `x` (",
                x.device(), "), got ", t.device());
  }
}

}  // namespace sce
}  // namespace shardkit
