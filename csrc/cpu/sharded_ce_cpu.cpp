// CPU kernels of the sharded cross-entropy (shardkit::ce_shard_stats and its backward).
//
// Loop over class chunks: per chunk one GEMM (at::mm_out -> MKL) into a reused [B, chunk]
// buffer, then a fused pass per row that folds the chunk into running [B] statistics
// (forward) or turns the logits into dlogits in place (backward, followed by the dX / dW
// GEMMs). Each thread takes a block of whole chunks inside ONE parallel region: a chunk's
// GEMM and row pass run in the same core's cache, with no barrier per chunk.
// Extra memory: O(threads * chunk * (B + D)) plus [threads, B, D] for dX.
//
// The float row loops use vector extensions and are compiled in several ISA versions
// (target_clones, picked at load time from the CPU's features), since the extension is
// built without -march.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cpu/sharded_ce_cpu_rows.h"
#include "sharded_ce_common.h"

namespace shardkit {
namespace sce {
namespace {

using at::Tensor;

using namespace cpu_rows;

// The embeddings in acc dtype (normalized when asked), shared read-only by all threads.
struct Rows {
  Tensor x, xnrm;  // [B, D] contiguous, [B]
};

Rows load_x(const Tensor& x, bool normalize) {
  const auto opts = x.options().dtype(acc_dtype(x.scalar_type()));
  Rows r{at::empty({x.size(0), x.size(1)}, opts), at::empty({x.size(0)}, opts)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sce_load_x", [&] {
    using T = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    load_rows<scalar_t, T>(x.const_data_ptr<scalar_t>(), x.stride(0), x.stride(1), x.size(0), x.size(1),
                           normalize, r.x.mutable_data_ptr<T>(), r.xnrm.mutable_data_ptr<T>());
  });
  return r;
}

// One thread's buffers: the current chunk of w in acc dtype (normalized when asked) with its
// row norms, the chunk's [B, n] logits and (backward) the gradient w.r.t. the loaded chunk.
// Memory O(chunk * (B + D)) per thread.
struct Workspace {
  Tensor wbuf, wnrm, lbuf, dwbuf;
  Workspace(const Tensor& xacc, int64_t chunk, bool with_dw)
      : wbuf(at::empty({chunk, xacc.size(1)}, xacc.options())),
        wnrm(at::empty({chunk}, xacc.options())),
        lbuf(at::empty({xacc.size(0) * chunk}, xacc.options())),
        dwbuf(with_dw ? at::empty({chunk, xacc.size(1)}, xacc.options()) : Tensor()) {}

  Tensor wc;  // the chunk of w the GEMMs use: a view of w, or of wbuf after conversion / normalization

  // Loads w[j0 : j0+n] (into wbuf unless w can be used as is) and returns the logits
  // x @ w_chunk^T, a contiguous [B, n] view of lbuf.
  Tensor logits(const Tensor& xacc, const Tensor& w, int64_t j0, int64_t n, bool normalize) {
    const int64_t D = xacc.size(1);
    if (!normalize && w.scalar_type() == xacc.scalar_type()) {
      wc = w.narrow(0, j0, n);
    } else {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "sce_load_w", [&] {
        using T = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
        load_rows<scalar_t, T>(w.const_data_ptr<scalar_t>() + j0 * w.stride(0), w.stride(0), w.stride(1), n,
                               D, normalize, wbuf.mutable_data_ptr<T>(), wnrm.mutable_data_ptr<T>());
      });
      wc = wbuf.narrow(0, 0, n);
    }
    Tensor L = lbuf.narrow(0, 0, xacc.size(0) * n).view({xacc.size(0), n});
    at::mm_out(L, xacc, wc.t());
    return L;
  }
};

// Runs body(tid, ws, j0, n) over all chunks inside ONE parallel region: thread tid takes a
// contiguous block of chunks (a fixed split, so results are bitwise reproducible for a given
// thread count: no barrier per chunk, which costs dearly when the cores are shared), and
// each chunk's GEMM then runs single-threaded in its thread's cache.
template <typename F>
void for_each_chunk(const Tensor& xacc, int64_t C, int64_t chunk, int64_t nthreads, bool with_dw,
                    const F& body) {
  const int64_t nchunks = (C + chunk - 1) / chunk;
  const int64_t per = (nchunks + nthreads - 1) / nthreads;
  at::parallel_for(0, nthreads, 1, [&](int64_t a, int64_t b) {
    // Worker threads do not inherit the caller's grad mode / dispatch-key state: without these
    // guards the out= GEMMs would refuse inputs that require grad (and pay autograd dispatch).
    const at::NoGradGuard no_grad;
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (int64_t tid = a; tid < b; ++tid) {
      Workspace ws(xacc, chunk, with_dw);
      for (int64_t k = tid * per; k < std::min(nchunks, (tid + 1) * per); ++k) {
        const int64_t j0 = k * chunk;
        body(tid, ws, j0, std::min(chunk, C - j0));
      }
    }
  });
}

// Asks Linux for transparent huge pages on a large fresh buffer before its first write (the
// weight gradient, 100 MiB at C=200k, D=128): its page faults then cost ~8 ms instead of
// ~35 ms per step. Advice only (ignored where THP is off), and only the 2 MiB-aligned interior.
void prefer_huge_pages(const Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const auto bytes = static_cast<uintptr_t>(t.nbytes());
  if (bytes < 8 * kHuge) return;
  const auto p = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t a = (p + kHuge - 1) & ~(kHuge - 1), b = (p + bytes) & ~(kHuge - 1);
  if (b > a) (void)madvise(reinterpret_cast<void*>(a), b - a, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}

int64_t threads_for(int64_t C, int64_t chunk) {
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (C + chunk - 1) / chunk));
}

std::tuple<Tensor, Tensor, Tensor, Tensor> ce_shard_stats_cpu(const Tensor& x, const Tensor& w,
                                                              const Tensor& labels,
                                                              const c10::optional<Tensor>& target_ref,
                                                              int64_t class_offset, double scale, double m1,
                                                              double m2, double m3, bool normalize,
                                                              int64_t chunk_classes) {
  check_forward(x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes);
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
  // Per-thread running statistics: max, sum of exp(z - max), sum of z, count.
  Tensor Mt = at::full({nt, B}, -std::numeric_limits<double>::infinity(), opts);
  Tensor St = at::zeros({nt, B}, opts), LSt = at::zeros({nt, B}, opts);
  Tensor CNt = at::zeros({nt, B}, x.options().dtype(at::kLong));
  const Rows xr = load_x(x, normalize);
  AT_DISPATCH_FLOATING_TYPES(acc, "ce_shard_stats_cpu", [&] {
    using T = scalar_t;
    T* tg = tgt.mutable_data_ptr<T>();
    const int64_t* y = lab.const_data_ptr<int64_t>();
    const T* tr = count ? tref.const_data_ptr<T>() : nullptr;
    const T s = static_cast<T>(mg.scale);
    for_each_chunk(xr.x, C, chunk, nt, false, [&](int64_t tid, Workspace& ws, int64_t j0, int64_t n) {
      T* M = Mt.mutable_data_ptr<T>() + tid * B;
      T* S = St.mutable_data_ptr<T>() + tid * B;
      T* ls = LSt.mutable_data_ptr<T>() + tid * B;
      int64_t* cn = CNt.mutable_data_ptr<int64_t>() + tid * B;
      Tensor L = ws.logits(xr.x, w, j0, n, normalize);
      T* Lp = L.mutable_data_ptr<T>();
      for (int64_t i = 0; i < B; ++i) {
        T* z = Lp + i * n;
        const int64_t t = y[i] - class_offset - j0;
        const bool has_t = t >= 0 && t < n;
        const T ref = count ? tr[i] : T(0);
        T c_t = 0, psi = 0, dpsi = 0;
        if (has_t) {
          c_t = z[t];
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
        S[i] = (M[i] == -std::numeric_limits<T>::infinity() ? S[i] : S[i] * std::exp(M[i] - m_new)) + se;
        M[i] = m_new;
        ls[i] += zs;
        cn[i] += c;
        if (has_t) tg[i] = z[t];  // the target column lies in exactly one chunk: no race
      }
    });
  });
  // Merge the threads' statistics (threads without chunks have max -inf and sum 0). Rows
  // whose logits are all -inf get lse = log(0) = -inf, as a shard without classes (and the
  // CUDA kernel): shift by 0 there, not by M (Mt - M would be -inf - -inf = NaN).
  Tensor M = Mt.amax(0);
  const Tensor shift = M.masked_fill(M == -std::numeric_limits<double>::infinity(), 0);
  Tensor lse = M + (St * (Mt - shift).exp_()).sum(0).log_();
  return {lse, tgt, LSt.sum(0), CNt.sum(0)};
}

std::tuple<Tensor, Tensor> ce_shard_stats_backward_cpu(const Tensor& grad_lse, const Tensor& grad_target,
                                                       const Tensor& grad_sum, const Tensor& x,
                                                       const Tensor& w, const Tensor& labels,
                                                       const Tensor& lse_in, int64_t class_offset,
                                                       double scale, double m1, double m2, double m3,
                                                       bool normalize, int64_t chunk_classes) {
  check_backward(grad_lse, grad_target, grad_sum, x, w, labels, lse_in, class_offset, scale, m1, m2, m3,
                 normalize, chunk_classes);
  // Called below autograd (register_autograd handles it); inputs may still require grad,
  // which out= ATen calls refuse.
  const at::NoGradGuard no_grad;
  const auto acc = acc_dtype(x.scalar_type());
  const int64_t B = x.size(0), D = x.size(1), C = w.size(0);
  Tensor grad_w = at::empty({C, D}, w.options());
  if (B == 0 || C == 0) return {at::zeros({B, D}, x.options()), grad_w.zero_()};
  prefer_huge_pages(grad_w);
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
    const int64_t* y = lab.const_data_ptr<int64_t>();
    const T s = static_cast<T>(mg.scale);
    for_each_chunk(xr.x, C, chunk, nt, !direct_dw, [&](int64_t tid, Workspace& ws, int64_t j0, int64_t n) {
      Tensor L = ws.logits(xr.x, w, j0, n, normalize);
      T* Lp = L.mutable_data_ptr<T>();
      for (int64_t i = 0; i < B; ++i) {
        T* z = Lp + i * n;
        const int64_t t = y[i] - class_offset - j0;
        const bool has_t = t >= 0 && t < n;
        const T c_t = has_t ? z[t] : T(0);
        dlogit_f(z, n, s, plse[i], pgl[i], pgs[i]);
        if (has_t) {
          T psi = c_t, dpsi = 1;
          if (normalize) margin_psi<T>(c_t, mg.plain_target, mg.m1, mg.m2, mg.m3, mg.c_max, &psi, &dpsi);
          z[t] = s * dpsi * (pgl[i] * std::exp(s * psi - plse[i]) + pgs[i] + pgt[i]);
        }
      }
      const Tensor& Wc = ws.wc;
      dxt[tid].addmm_(L, Wc);
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

}  // namespace
}  // namespace sce
}  // namespace shardkit

TORCH_LIBRARY_IMPL(shardkit, CPU, m) {
  m.impl("ce_shard_stats", &shardkit::sce::ce_shard_stats_cpu);
  m.impl("ce_shard_stats_backward", &shardkit::sce::ce_shard_stats_backward_cpu);
}
