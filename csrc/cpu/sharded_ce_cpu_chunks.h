// The chunk loop of the CPU sharded cross-entropy kernels (included by sharded_ce_cpu.cpp
// only): the embeddings loaded once, one workspace per thread, the fixed split of the class
// chunks over the threads, and the huge-page advice for large fresh buffers.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cpu/sharded_ce_cpu_rows.h"
#include "sharded_ce_common.h"

namespace shardkit {
namespace sce {
namespace {  // included by one translation unit: internal linkage, as for the kernels there

using at::Tensor;

// The embeddings in acc dtype (normalized when asked), shared read-only by all threads.
struct Rows {
  Tensor x, xnrm;  // [B, D] contiguous, [B]
};

Rows load_x(const Tensor& x, bool normalize) {
  const auto opts = x.options().dtype(acc_dtype(x.scalar_type()));
  Rows r{at::empty({x.size(0), x.size(1)}, opts), at::empty({x.size(0)}, opts)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sce_load_x", [&] {
    using T = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    cpu_rows::load_rows<scalar_t, T>(x.const_data_ptr<scalar_t>(), x.stride(0), x.stride(1), x.size(0),
                                     x.size(1), normalize, r.x.mutable_data_ptr<T>(),
                                     r.xnrm.mutable_data_ptr<T>());
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

  // Sets wc to w[j0 : j0+n], loaded into wbuf unless w can be used as is.
  void load(const Tensor& w, int64_t j0, int64_t n, bool normalize) {
    const int64_t D = wbuf.size(1);
    if (!normalize && w.scalar_type() == wbuf.scalar_type()) {
      wc = w.narrow(0, j0, n);
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "sce_load_w", [&] {
      using T = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
      cpu_rows::load_rows<scalar_t, T>(w.const_data_ptr<scalar_t>() + j0 * w.stride(0), w.stride(0),
                                       w.stride(1), n, D, normalize, wbuf.mutable_data_ptr<T>(),
                                       wnrm.mutable_data_ptr<T>());
    });
    wc = wbuf.narrow(0, 0, n);
  }

  // A contiguous [B, n] view of lbuf.
  Tensor chunk_logits(int64_t B, int64_t n) { return lbuf.narrow(0, 0, B * n).view({B, n}); }

  // Loads w[j0 : j0+n] and writes the logits x @ w_chunk^T into `out` (a contiguous [B, n]
  // tensor: lbuf's view, or a slot of the kept logits), which it returns.
  Tensor logits(const Tensor& xacc, const Tensor& w, int64_t j0, int64_t n, bool normalize, Tensor out) {
    load(w, j0, n, normalize);
    at::mm_out(out, xacc, wc.t());
    return out;
  }
};

// Runs body(tid, ws, k, j0, n) over all chunks k inside ONE parallel region: thread tid takes a
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
        body(tid, ws, k, j0, std::min(chunk, C - j0));
      }
    }
  });
}

// Asks Linux for transparent huge pages on a large fresh buffer before its first write (the
// weight gradient, 100 MiB at C=200k, D=128; the kept logits): its page faults then cost ~8 ms
// instead of ~35 ms per 100 MiB. Advice only (ignored where THP is off), and only the 2 MiB-aligned
// interior.
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

}  // namespace
}  // namespace sce
}  // namespace shardkit
