// CPU kernels of the sharded cross-entropy (shardkit::ce_shard_stats and its backward, and
// the memory-budget pair ce_shard_stats_keep / ce_shard_stats_backward_kept).
//
// Loop over class chunks: per chunk one GEMM (at::mm_out -> MKL) into a reused [B, chunk]
// buffer, then a fused pass per row that folds the chunk into running [B] statistics
// (forward) or turns the logits into dlogits (backward, followed by the dX / dW GEMMs).
// Each thread takes a block of whole chunks inside ONE parallel region: a chunk's GEMM and
// row pass run in the same core's cache, with no barrier per chunk.
// Extra memory: O(threads * chunk * (B + D)) plus [threads, B, D] for dX.
//
// With a memory budget the forward writes the GEMM of the chunks it keeps (KeptChunks) into
// the kept buffer instead, and leaves there the logits the row pass made (scaled, the target
// with its margin), plus each row's raw target logit; the backward forms those chunks'
// dlogits from them and recomputes only the others. Kept or recomputed, the dlogits are the
// same numbers: the kept values are the forward's rounded logits, which the recompute rounds
// alike.
//
// The float row loops have generic vector-extension versions and AVX2+FMA ones picked at run
// time (sharded_ce_cpu_rows.h), since the extension is built without -march.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/sharded_ce_cpu_chunks.h"
#include "cpu/sharded_ce_cpu_rows.h"
#include "sharded_ce_common.h"

namespace shardkit {
namespace sce {
namespace {

using at::Tensor;

using namespace cpu_rows;

using Stats = std::tuple<Tensor, Tensor, Tensor, Tensor>;

// The kept logits of one forward: [B * KeptChunks.classes(C)] in acc dtype, and the raw
// target logit (cosine, or x . w) of each row whose target lies in a kept chunk, [B].
struct Kept {
  KeptChunks set;
  Tensor logits, target_raw;
};

Kept make_kept(const Tensor& x, int64_t C, int64_t chunk, int64_t keep_chunks) {
  TORCH_CHECK(keep_chunks >= 0, "argument `keep_chunks` must be >= 0, got ", keep_chunks);
  const KeptChunks set(C, std::max<int64_t>(chunk, 1), keep_chunks);
  const auto opts = x.options().dtype(acc_dtype(x.scalar_type()));
  Kept kept{set, at::empty({x.size(0) * set.classes(C)}, opts), at::zeros({x.size(0)}, opts)};
  prefer_huge_pages(kept.logits);
  return kept;
}

// The forward of both ops: kept == nullptr keeps nothing.
Stats stats_forward(const Tensor& x, const Tensor& w, const Tensor& labels,
                    const c10::optional<Tensor>& target_ref, int64_t class_offset, double scale, double m1,
                    double m2, double m3, bool normalize, int64_t chunk_classes, Kept* kept) {
  // Called below autograd (register_autograd handles it); inputs may still require grad,
  // which out= ATen calls refuse.
  const at::NoGradGuard no_grad;
  const auto acc = acc_dtype(x.scalar_type());
  const int64_t B = x.size(0), C = w.size(0);
  const auto opts = x.options().dtype(acc);
  Tensor tgt = at::zeros({B}, opts);
  if (B == 0 || C == 0)
    return {at::full({B}, -std::numeric_limits<double>::infinity(), opts), tgt, at::zeros({B}, opts),
            at::zeros({B}, x.options().dtype(at::kLong))};
  const Margin mg = make_margin(scale, m1, m2, m3, normalize);
  const bool count = target_ref.has_value() && target_ref->defined();
  const Tensor tref = count ? target_ref->to(acc).contiguous() : Tensor();
  const Tensor lab = labels.contiguous();
  const int64_t chunk = std::min(chunk_classes, C);
  const int64_t nt = threads_for(C, chunk);
  // Per-thread running statistics: max, sum of exp(z - max), sum of z, count. The sums run
  // over every chunk of the shard (a million classes in chunks of ~100: ~10^4 additions a
  // row), so they are kept in double: in float their rounding reached ~1e-5 of the loss.
  Tensor Mt = at::full({nt, B}, -std::numeric_limits<double>::infinity(), opts);
  const auto opts64 = x.options().dtype(at::kDouble);
  Tensor St = at::zeros({nt, B}, opts64), LSt = at::zeros({nt, B}, opts64);
  Tensor CNt = at::zeros({nt, B}, x.options().dtype(at::kLong));
  const Rows xr = load_x(x, normalize);
  AT_DISPATCH_FLOATING_TYPES(acc, "ce_shard_stats_cpu", [&] {
    using T = scalar_t;
    T* tg = tgt.mutable_data_ptr<T>();
    T* raw = kept != nullptr ? kept->target_raw.mutable_data_ptr<T>() : nullptr;
    const int64_t* y = lab.const_data_ptr<int64_t>();
    const T* tr = count ? tref.const_data_ptr<T>() : nullptr;
    const T s = static_cast<T>(mg.scale);
    for_each_chunk(
        xr.x, C, chunk, nt, false, [&](int64_t tid, Workspace& ws, int64_t k, int64_t j0, int64_t n) {
          T* M = Mt.mutable_data_ptr<T>() + tid * B;
          double* S = St.mutable_data_ptr<double>() + tid * B;
          double* ls = LSt.mutable_data_ptr<double>() + tid * B;
          int64_t* cn = CNt.mutable_data_ptr<int64_t>() + tid * B;
          const bool keep = kept != nullptr && kept->set.kept(k);
          // A kept chunk's GEMM writes straight into its slot: the row pass below leaves there the
          // logits the backward needs.
          Tensor out = keep ? kept->logits.narrow(0, kept->set.slot(k) * chunk * B, B * n).view({B, n})
                            : ws.chunk_logits(B, n);
          Tensor L = ws.logits(xr.x, w, j0, n, normalize, out);
          T* Lp = L.mutable_data_ptr<T>();
          for (int64_t i = 0; i < B; ++i) {
            T* z = Lp + i * n;
            const int64_t t = y[i] - class_offset - j0;
            const bool has_t = t >= 0 && t < n;
            const T ref = count ? tr[i] : T(0);
            T c_t = 0, psi = 0, dpsi = 0;
            if (has_t) {
              c_t = z[t];
              if (keep) raw[i] = c_t;  // the target lies in one chunk: no race
              psi = c_t;
              if (normalize) margin_psi<T>(c_t, mg.plain_target, mg.m1, mg.m2, mg.m3, mg.c_max, &psi, &dpsi);
              z[t] = psi;  // scaled with the rest of the row below
            }
            int64_t c = 0;
            const T mx = scale_max_count_f(z, n, s, ref, count, &c);
            if (has_t && count) c += (s * c_t > ref ? 1 : 0) - (z[t] > ref ? 1 : 0);  // plain logit counts
            const T m_new = std::max(M[i], mx);
            T zs = 0;
            // All logits so far -inf: exp(z - m) would be exp(-inf - -inf) = NaN; any finite
            // reference gives the right sum, 0 (NaN logits, skipped by the max, still give NaN).
            const T se = expsum_f(z, n, m_new == -std::numeric_limits<T>::infinity() ? T(0) : m_new, &zs);
            // While the max is -inf, S is 0, or NaN from a NaN logit (the max skips NaN): keep it.
            S[i] = (M[i] == -std::numeric_limits<T>::infinity()
                        ? S[i]
                        : S[i] * std::exp(double(M[i]) - double(m_new))) +
                   double(se);
            M[i] = m_new;
            ls[i] += double(zs);
            cn[i] += c;
            if (has_t) tg[i] = z[t];  // the target column lies in exactly one chunk: no race
          }
        });
  });
  // Merge the threads' statistics (threads without chunks have max -inf and sum 0). Rows
  // whose logits are all -inf get lse = log(0) = -inf, as a shard without classes (and the
  // CUDA kernel): shift by 0 there, not by M (Mt - M would be -inf - -inf = NaN).
  const Tensor M = Mt.amax(0).to(at::kDouble);
  const Tensor shift = M.masked_fill(M == -std::numeric_limits<double>::infinity(), 0);
  const Tensor lse = M + (St * (Mt.to(at::kDouble) - shift).exp_()).sum(0).log_();
  return {lse.to(acc), tgt, LSt.sum(0).to(acc), CNt.sum(0)};
}

Stats ce_shard_stats_cpu(const Tensor& x, const Tensor& w, const Tensor& labels,
                         const c10::optional<Tensor>& target_ref, int64_t class_offset, double scale,
                         double m1, double m2, double m3, bool normalize, int64_t chunk_classes) {
  check_forward(x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes);
  return stats_forward(x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes,
                       nullptr);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> ce_shard_stats_keep_cpu(
    const Tensor& x, const Tensor& w, const Tensor& labels, const c10::optional<Tensor>& target_ref,
    int64_t class_offset, double scale, double m1, double m2, double m3, bool normalize,
    int64_t chunk_classes, int64_t keep_chunks) {
  check_forward(x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes);
  Kept kept = make_kept(x, w.size(0), std::min(chunk_classes, w.size(0)), keep_chunks);
  auto [lse, tgt, lsum, cnt] = stats_forward(x, w, labels, target_ref, class_offset, scale, m1, m2, m3,
                                             normalize, chunk_classes, &kept);
  return {lse, tgt, lsum, cnt, kept.logits, kept.target_raw};
}

// The backward of both ops: kept == nullptr recomputes every chunk.
std::tuple<Tensor, Tensor> stats_backward(const Tensor& grad_lse, const Tensor& grad_target,
                                          const Tensor& grad_sum, const Tensor& x, const Tensor& w,
                                          const Tensor& labels, const Tensor& lse_in, int64_t class_offset,
                                          double scale, double m1, double m2, double m3, bool normalize,
                                          int64_t chunk_classes, const Kept* kept, bool need_w) {
  // Called below autograd (register_autograd handles it); inputs may still require grad,
  // which out= ATen calls refuse.
  const at::NoGradGuard no_grad;
  const auto acc = acc_dtype(x.scalar_type());
  const int64_t B = x.size(0), D = x.size(1), C = w.size(0);
  // A frozen w (need_w false): no [C, D] gradient and no dW GEMM, only an empty [0] result.
  Tensor grad_w = need_w ? at::empty({C, D}, w.options()) : at::empty({0}, w.options());
  if (B == 0 || C == 0) return {at::zeros({B, D}, x.options()), grad_w.zero_()};
  if (need_w) prefer_huge_pages(grad_w);
  const Margin mg = make_margin(scale, m1, m2, m3, normalize);
  const Tensor gl = grad_lse.to(acc).contiguous(), gt = grad_target.to(acc).contiguous(),
               gs = grad_sum.to(acc).contiguous(), lse = lse_in.to(acc).contiguous(),
               lab = labels.contiguous();
  const int64_t chunk = std::min(chunk_classes, C);
  const int64_t nt = threads_for(C, chunk);
  const Rows xr = load_x(x, normalize);
  // Per-thread d/dx (d/d normalized x when normalize), summed at the end.
  Tensor dxt = at::zeros({nt, B, D}, xr.x.options());
  const bool direct_dw = !normalize && w.scalar_type() == acc;
  AT_DISPATCH_FLOATING_TYPES(acc, "ce_shard_stats_backward_cpu", [&] {
    using T = scalar_t;
    const T *pgl = gl.const_data_ptr<T>(), *pgt = gt.const_data_ptr<T>(), *pgs = gs.const_data_ptr<T>(),
            *plse = lse.const_data_ptr<T>();
    const T* raw = kept != nullptr ? kept->target_raw.const_data_ptr<T>() : nullptr;
    const int64_t* y = lab.const_data_ptr<int64_t>();
    const T s = static_cast<T>(mg.scale);
    for_each_chunk(
        xr.x, C, chunk, nt, need_w && !direct_dw,
        [&](int64_t tid, Workspace& ws, int64_t k, int64_t j0, int64_t n) {
          // A kept chunk: its scaled logits are read from the kept buffer (not written: a second
          // backward of a retained graph reads them again), its dlogits go to the workspace.
          const bool keep = kept != nullptr && kept->set.kept(k);
          const T* Kp = keep ? kept->logits.const_data_ptr<T>() + kept->set.slot(k) * chunk * B : nullptr;
          Tensor L = ws.chunk_logits(B, n);
          if (keep)
            ws.load(w, j0, n, normalize);
          else
            ws.logits(xr.x, w, j0, n, normalize, L);
          T* Lp = L.mutable_data_ptr<T>();
          for (int64_t i = 0; i < B; ++i) {
            T* z = Lp + i * n;
            const int64_t t = y[i] - class_offset - j0;
            const bool has_t = t >= 0 && t < n;
            const T c_t = has_t ? (keep ? raw[i] : z[t]) : T(0);
            if (keep)
              dlogit_f(Kp + i * n, z, n, T(1), s, plse[i], pgl[i], pgs[i]);
            else
              dlogit_f(z, z, n, s, s, plse[i], pgl[i], pgs[i]);
            if (has_t) {
              T psi = c_t, dpsi = 1;
              if (normalize) margin_psi<T>(c_t, mg.plain_target, mg.m1, mg.m2, mg.m3, mg.c_max, &psi, &dpsi);
              z[t] = s * dpsi * (pgl[i] * std::exp(s * psi - plse[i]) + pgs[i] + pgt[i]);
            }
          }
          const Tensor& Wc = ws.wc;
          dxt[tid].addmm_(L, Wc);
          if (!need_w) return;
          Tensor gw = grad_w.narrow(0, j0, n);
          if (direct_dw) {
            at::mm_out(gw, L.t(), xr.x);
            return;
          }
          // Gradient w.r.t. the loaded (converted / normalized) chunk, then through the load.
          Tensor dwh = ws.dwbuf.narrow(0, 0, n);
          at::mm_out(dwh, L.t(), xr.x);
          AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "sce_dw", [&] {
            if (normalize)
              normalize_backward_rows<scalar_t, T>(dwh.const_data_ptr<T>(), Wc.const_data_ptr<T>(),
                                                   ws.wnrm.const_data_ptr<T>(), n, D,
                                                   grad_w.mutable_data_ptr<scalar_t>() + j0 * D);
            else
              gw.copy_(dwh);
          });
        });
  });
  Tensor dx = nt == 1 ? dxt[0] : dxt.sum(0);
  if (normalize) {
    Tensor gx = at::empty({B, D}, dx.options());
    AT_DISPATCH_FLOATING_TYPES(acc, "sce_dx_norm", [&] {
      using T = scalar_t;
      normalize_backward_rows<T, T>(dx.const_data_ptr<T>(), xr.x.const_data_ptr<T>(),
                                    xr.xnrm.const_data_ptr<T>(), B, D, gx.mutable_data_ptr<T>());
    });
    dx = gx;
  }
  return {dx.to(x.scalar_type()), grad_w};
}

std::tuple<Tensor, Tensor> ce_shard_stats_backward_cpu(const Tensor& grad_lse, const Tensor& grad_target,
                                                       const Tensor& grad_sum, const Tensor& x,
                                                       const Tensor& w, const Tensor& labels,
                                                       const Tensor& lse, int64_t class_offset, double scale,
                                                       double m1, double m2, double m3, bool normalize,
                                                       int64_t chunk_classes, bool need_grad_w) {
  check_backward(grad_lse, grad_target, grad_sum, x, w, labels, lse, class_offset, scale, m1, m2, m3,
                 normalize, chunk_classes);
  return stats_backward(grad_lse, grad_target, grad_sum, x, w, labels, lse, class_offset, scale, m1, m2, m3,
                        normalize, chunk_classes, nullptr, need_grad_w);
}

std::tuple<Tensor, Tensor> ce_shard_stats_backward_kept_cpu(
    const Tensor& grad_lse, const Tensor& grad_target, const Tensor& grad_sum, const Tensor& x,
    const Tensor& w, const Tensor& labels, const Tensor& lse, const Tensor& kept_logits,
    const Tensor& kept_target, int64_t class_offset, double scale, double m1, double m2, double m3,
    bool normalize, int64_t chunk_classes, int64_t keep_chunks, bool need_grad_w) {
  check_backward(grad_lse, grad_target, grad_sum, x, w, labels, lse, class_offset, scale, m1, m2, m3,
                 normalize, chunk_classes);
  const int64_t chunk = std::max<int64_t>(1, std::min(chunk_classes, w.size(0)));
  const auto acc = acc_dtype(x.scalar_type());
  check_kept(x, w, kept_logits, kept_target, chunk, keep_chunks, acc, acc);
  const Kept kept{KeptChunks(w.size(0), chunk, keep_chunks), kept_logits, kept_target};
  return stats_backward(grad_lse, grad_target, grad_sum, x, w, labels, lse, class_offset, scale, m1, m2, m3,
                        normalize, chunk_classes, &kept, need_grad_w);
}

}  // namespace
}  // namespace sce
}  // namespace shardkit

TORCH_LIBRARY_IMPL(shardkit, CPU, m) {
  m.impl("ce_shard_stats", &shardkit::sce::ce_shard_stats_cpu);
  m.impl("ce_shard_stats_backward", &shardkit::sce::ce_shard_stats_backward_cpu);
  m.impl("ce_shard_stats_keep", &shardkit::sce::ce_shard_stats_keep_cpu);
  m.impl("ce_shard_stats_backward_kept", &shardkit::sce::ce_shard_stats_backward_kept_cpu);
}
