// The unfused kernels of the sharded cross-entropy's fp32-logit passes (bf16 / fp16 / fp32 inputs;
// included by sharded_ce_cuda.cu, whose helpers they use; fp64 runs its simpler row_stats_kernel
// and dlogit_kernel).
//
// Simpler kernels (one block per row, one 4-byte load per thread and step; one element per
// thread) reached ~0.9-1.0 TB/s on an H200 whose copy rate is ~4 TB/s, and at B=256 the
// one-block-per-row statistics fill a quarter of the GPU. These:
//   row_stats_v2: a row is split into `parts` column ranges (a 1-D grid of B * parts blocks,
//     enough for two waves at any B); each thread reads 16-byte vectors, two in flight, and
//     folds 4 logits per online-softmax rescale. parts > 1 leaves per-range partials that
//     merge_parts_kernel folds into the running statistics in a fixed order (deterministic,
//     no atomics);
//   dlogit_v2: 2-D grid (vectors of a row x rows), 16-byte loads of the fp32 logits and one
//     8-byte (16-bit dlogits) or 16-byte (fp32, in place) store per 4 elements; the per-row
//     scalars are read once per row.
// A row need not start on a 16-byte boundary (B * n logits, n odd): the columns before the
// first boundary and after the last whole vector are taken one by one (at most 3 each).
// Only float statistics (bf16 / fp16 / fp32 inputs).
#pragma once

#include <cstdint>

namespace shardkit {
namespace sce {
namespace {

// One logit folded into the running (m, s): s counts exp(z - m). As in the first kernel: a
// new maximum adds exactly 1, -inf adds nothing, NaN makes s NaN (and so does a second +inf:
// exp(inf - inf)).
__device__ __forceinline__ void online_add(float z, float& m, float& s) {
  if (z > m) {
    s = s * __expf(m - z) + 1.f;
    m = z;
  } else if (z != -INFINITY) {
    s += __expf(z - m);
  }
}

// Four logits: one rescale to their max (fmaxf skips NaN), then four additions. A +inf among
// them takes the one-by-one path, which keeps the first kernel's +inf / NaN results.
__device__ __forceinline__ void online_add4(float z0, float z1, float z2, float z3, float& m, float& s) {
  const float mx = fmaxf(fmaxf(z0, z1), fmaxf(z2, z3));
  if (mx == INFINITY) {
    online_add(z0, m, s);
    online_add(z1, m, s);
    online_add(z2, m, s);
    online_add(z3, m, s);
    return;
  }
  if (mx > m) {
    s *= __expf(m - mx);  // m = -inf: s * 0 (NaN stays NaN)
    m = mx;
  }
  const float zz[4] = {z0, z1, z2, z3};
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (zz[k] != -INFINITY) s += __expf(zz[k] - m);
}

// Columns of a row of L (float, row i starting at element i * n of a buffer whose base is
// 16-byte aligned): [0, head) one by one, nvec 16-byte vectors from column head, the rest
// one by one.
struct RowSplit {
  int64_t head, nvec, tail0;
};

__device__ __forceinline__ RowSplit split_row(const float* row, int64_t n) {
  const int64_t mis = static_cast<int64_t>((reinterpret_cast<uintptr_t>(row) / sizeof(float)) & 3);
  RowSplit r;
  r.head = mis == 0 ? 0 : (4 - mis < n ? 4 - mis : n);
  r.nvec = (n - r.head) / 4;
  r.tail0 = r.head + 4 * r.nvec;
  return r;
}

__global__ void row_stats_v2_kernel(const float* __restrict__ L, int64_t n, int64_t j0,
                                    const float* __restrict__ rw, const int64_t* __restrict__ labels,
                                    int64_t class_offset, const float* __restrict__ tref, MarginT<float> mg,
                                    int parts, int64_t B, float* M, float* S, float* LS, float* TG,
                                    int64_t* CN, float* pm, float* ps, float* pz, int64_t* pc) {
  const int64_t i = blockIdx.x / parts;
  const int p = static_cast<int>(blockIdx.x % parts);
  const float* row = L + i * n;
  const int64_t t = labels[i] - class_offset - j0;
  const float ref = tref ? tref[i] : 0.f;
  float m = -INFINITY, s = 0.f, zs = 0.f;
  int64_t cnt = 0;
  // The logit of column j from its raw dot (times 1/|w_j| when normalizing): see stat_logit.
  auto logit = [&](float raw, int64_t j) -> float {
    return stat_logit<float>(rw ? raw * rw[j] : raw, j == t, tref != nullptr, ref, mg, cnt, zs, TG + i);
  };
  const RowSplit rs = split_row(row, n);
  const int64_t per = (rs.nvec + parts - 1) / parts;
  const int64_t v0 = p * per, v1 = v0 + per < rs.nvec ? v0 + per : rs.nvec;
  const float4* row4 = reinterpret_cast<const float4*>(row + rs.head);
  const int64_t step = blockDim.x;
  int64_t v = v0 + threadIdx.x;
  for (; v + step < v1; v += 2 * step) {  // two 16-byte loads in flight
    const float4 a = row4[v], b = row4[v + step];
    const int64_t ja = rs.head + 4 * v, jb = rs.head + 4 * (v + step);
    const float a0 = logit(a.x, ja), a1 = logit(a.y, ja + 1), a2 = logit(a.z, ja + 2),
                a3 = logit(a.w, ja + 3);
    online_add4(a0, a1, a2, a3, m, s);
    const float b0 = logit(b.x, jb), b1 = logit(b.y, jb + 1), b2 = logit(b.z, jb + 2),
                b3 = logit(b.w, jb + 3);
    online_add4(b0, b1, b2, b3, m, s);
  }
  if (v < v1) {
    const float4 a = row4[v];
    const int64_t ja = rs.head + 4 * v;
    const float a0 = logit(a.x, ja), a1 = logit(a.y, ja + 1), a2 = logit(a.z, ja + 2),
                a3 = logit(a.w, ja + 3);
    online_add4(a0, a1, a2, a3, m, s);
  }
  if (p == 0 && threadIdx.x < rs.head) online_add(logit(row[threadIdx.x], threadIdx.x), m, s);
  if (p == parts - 1 && rs.tail0 + threadIdx.x < n) {
    const int64_t j = rs.tail0 + threadIdx.x;
    online_add(logit(row[j], j), m, s);
  }
  block_reduce_stats(m, s, zs, cnt);
  if (threadIdx.x != 0) return;
  if (parts == 1) {
    fold_stats(i, m, s, zs, cnt, M, S, LS, CN);
  } else {
    const int64_t k = static_cast<int64_t>(p) * B + i;
    pm[k] = m;
    ps[k] = s;
    pz[k] = zs;
    pc[k] = cnt;
  }
}

// Folds the parts' partials of each row (part 0 first) into its running statistics.
__global__ void merge_parts_kernel(int64_t B, int parts, const float* __restrict__ pm,
                                   const float* __restrict__ ps, const float* __restrict__ pz,
                                   const int64_t* __restrict__ pc, float* M, float* S, float* LS,
                                   int64_t* CN) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= B) return;
  float m = -INFINITY, s = 0.f, z = 0.f;
  int64_t c = 0;
  for (int p = 0; p < parts; ++p) {
    const int64_t k = static_cast<int64_t>(p) * B + i;
    merge_ms(m, s, pm[k], ps[k]);
    z += pz[k];
    c += pc[k];
  }
  fold_stats(i, m, s, z, c, M, S, LS, CN);
}

// Four values of the GEMM dtype stored with one 8-byte (16-bit) or 16-byte (fp32) write.
template <typename g_t>
struct alignas(4 * sizeof(g_t)) Vec4 {
  g_t v[4];
};

// dlogits of the chunk (see dlogit_kernel for the formula); G may alias L (fp32).
template <typename g_t>
__global__ void dlogit_v2_kernel(const float* L, g_t* G, int64_t B, int64_t n, int64_t j0,
                                 const float* __restrict__ rw, bool g_times_r,
                                 const int64_t* __restrict__ labels, int64_t class_offset,
                                 const float* __restrict__ lse, const float* __restrict__ gl,
                                 const float* __restrict__ gt, const float* __restrict__ gs,
                                 MarginT<float> mg) {
  for (int64_t i = blockIdx.y; i < B; i += gridDim.y) {
    const float* row = L + i * n;
    g_t* grow = G + i * n;
    const int64_t t = labels[i] - class_offset - j0;
    const float lse_i = lse[i], gl_i = gl[i], gs_i = gs[i], gt_i = gt[i];
    auto dlogit = [&](float raw, int64_t j) -> g_t {
      const float r = rw ? rw[j] : 1.f;
      const float c = raw * r;
      const bool is_t = j == t;
      float z = scaled_logit(mg.scale, c), dpsi = 1.f;
      if (is_t && mg.normalize) {
        float psi;
        margin_psi<float>(c, mg.plain, mg.m1, mg.m2, mg.m3, mg.c_max, &psi, &dpsi);
        z = scaled_logit(mg.scale, psi);
      }
      const float dz = gl_i * __expf(z - lse_i) + gs_i + (is_t ? gt_i : 0.f);
      return static_cast<g_t>(mg.scale * dpsi * dz * (g_times_r ? r : 1.f));
    };
    const RowSplit rs = split_row(row, n);
    for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < rs.nvec;
         v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t j = rs.head + 4 * v;
      const float4 a = *reinterpret_cast<const float4*>(row + j);
      Vec4<g_t> out;
      out.v[0] = dlogit(a.x, j);
      out.v[1] = dlogit(a.y, j + 1);
      out.v[2] = dlogit(a.z, j + 2);
      out.v[3] = dlogit(a.w, j + 3);
      *reinterpret_cast<Vec4<g_t>*>(grow + j) = out;
    }
    if (blockIdx.x == 0) {
      if (threadIdx.x < rs.head) grow[threadIdx.x] = dlogit(row[threadIdx.x], threadIdx.x);
      const int64_t j = rs.tail0 + threadIdx.x;
      if (j < n) grow[j] = dlogit(row[j], j);
    }
  }
}

}  // namespace
}  // namespace sce
}  // namespace shardkit
