// The unfused kernels of the sharded cross-entropy's logit passes (bf16 / fp16 / fp32 inputs;
// included by sharded_ce_cuda.cu, whose helpers they use; fp64 runs its simpler row_stats_kernel
// and dlogit_kernel).
//
// Simpler kernels (one block per row, one 4-byte load per thread and step; one element per
// thread) reached ~0.9-1.0 TB/s on an H200 whose copy rate is ~4 TB/s, and at B=256 the
// one-block-per-row statistics fill a quarter of the GPU. These:
//   row_stats_v2: a row is split into `parts` column ranges (a 1-D grid of B * parts blocks,
//     enough for two waves at any B); each thread reads vectors of 4 logits (16 bytes of fp32,
//     8 of 16-bit kept logits), two in flight, and folds 4 logits per online-softmax rescale.
//     parts > 1 leaves per-range partials that merge_parts_kernel folds into the running
//     statistics in a fixed order (deterministic, no atomics);
//   dlogit_v2: 2-D grid (vectors of a row x rows), vector loads of the logits and one 8-byte
//     (16-bit dlogits) or 16-byte (fp32) store per 4 elements; the per-row scalars are read once
//     per row.
// The logits are the fp32 GEMM output, or (memory budget, sharded_ce_kept.cuh) a kept chunk's
// 16-bit raw dots, whose target column then comes from `traw` (fp32) instead.
// A row need not start on a vector boundary (B * n logits, n odd): the columns before the
// first boundary and after the last whole vector are taken one by one (at most 3 each).
// Only float statistics (bf16 / fp16 / fp32 inputs).
#pragma once

#include <cuda_fp16.h>

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

// Four dlogits (aligned to 4 elements) stored with one 16-byte (fp32) or 8-byte (16-bit) write,
// through the store intrinsic with the default write-back policy: a plain store of an aligned
// struct (or of a float4 / uint2) compiled to four / two scalar stores here (nvcc 13.0, PTX).
__device__ __forceinline__ void store4(float* p, const float (&v)[4]) {
  __stwb(reinterpret_cast<float4*>(p), make_float4(v[0], v[1], v[2], v[3]));
}
template <typename h_t>  // c10::BFloat16, c10::Half: element 0 in the low half of the first word
__device__ __forceinline__ void store4(h_t* p, const h_t (&v)[4]) {
  static_assert(sizeof(h_t) == 2, "store4: a 16-bit type");
  uint2 u;
  u.x = static_cast<uint32_t>(v[0].x) | (static_cast<uint32_t>(v[1].x) << 16);
  u.y = static_cast<uint32_t>(v[2].x) | (static_cast<uint32_t>(v[3].x) << 16);
  __stwb(reinterpret_cast<uint2*>(p), u);
}
__device__ __forceinline__ void store4(double* p, const double (&v)[4]) {  // (compiled, never launched)
  for (int k = 0; k < 4; ++k) p[k] = v[k];
}

// Four logits from p (aligned to 4 elements) as floats, in one vector load.
__device__ __forceinline__ void load4(const float* p, float (&o)[4]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  o[0] = a.x;
  o[1] = a.y;
  o[2] = a.z;
  o[3] = a.w;
}
__device__ __forceinline__ void load4(const c10::BFloat16* p, float (&o)[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);  // element 0 in the low half of u.x
  o[0] = __uint_as_float(u.x << 16);
  o[1] = __uint_as_float(u.x & 0xffff0000u);
  o[2] = __uint_as_float(u.y << 16);
  o[3] = __uint_as_float(u.y & 0xffff0000u);
}
__device__ __forceinline__ void load4(const c10::Half* p, float (&o)[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  o[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(u.x & 0xffffu)));
  o[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(u.x >> 16)));
  o[2] = __half2float(__ushort_as_half(static_cast<unsigned short>(u.y & 0xffffu)));
  o[3] = __half2float(__ushort_as_half(static_cast<unsigned short>(u.y >> 16)));
}

// Columns of a row of L (element type T, row i starting at element i * n of a buffer aligned
// to its element size): [0, head) one by one, nvec vectors of 4 elements from column head, the
// rest one by one.
struct RowSplit {
  int64_t head, nvec, tail0;
};

template <typename T>
__device__ __forceinline__ RowSplit split_row(const T* row, int64_t n) {
  const int64_t mis = static_cast<int64_t>((reinterpret_cast<uintptr_t>(row) / sizeof(T)) & 3);
  RowSplit r;
  r.head = mis == 0 ? 0 : (4 - mis < n ? 4 - mis : n);
  r.nvec = (n - r.head) / 4;
  r.tail0 = r.head + 4 * r.nvec;
  return r;
}

// traw (kept 16-bit logits): the target column's value c, fp32 [B], instead of the logit there.
template <typename in_t>
__global__ void row_stats_v2_kernel(const in_t* __restrict__ L, int64_t n, int64_t j0,
                                    const float* __restrict__ rw, const float* __restrict__ traw,
                                    const int64_t* __restrict__ labels, int64_t class_offset,
                                    const float* __restrict__ tref, MarginT<float> mg, int parts, int64_t B,
                                    float* M, float* S, float* LS, float* TG, int64_t* CN, float* pm,
                                    float* ps, float* pz, int64_t* pc) {
  const int64_t i = blockIdx.x / parts;
  const int p = static_cast<int>(blockIdx.x % parts);
  const in_t* row = L + i * n;
  const int64_t t = labels[i] - class_offset - j0;
  const float ref = tref ? tref[i] : 0.f;
  const float traw_i = traw ? traw[i] : 0.f;
  float m = -INFINITY, s = 0.f, zs = 0.f;
  int64_t cnt = 0;
  // The logit of column j from its raw dot (times 1/|w_j| when normalizing): see stat_logit.
  auto logit = [&](float raw, int64_t j) -> float {
    const bool at_t = j == t;
    const float c = traw && at_t ? traw_i : (rw ? raw * rw[j] : raw);
    return stat_logit<float>(c, at_t, tref != nullptr, ref, mg, cnt, zs, TG + i);
  };
  const RowSplit rs = split_row(row, n);
  const int64_t per = (rs.nvec + parts - 1) / parts;
  const int64_t v0 = p * per, v1 = v0 + per < rs.nvec ? v0 + per : rs.nvec;
  const in_t* vec0 = row + rs.head;
  const int64_t step = blockDim.x;
  int64_t v = v0 + threadIdx.x;
  for (; v + step < v1; v += 2 * step) {  // two vector loads in flight
    float a[4], b[4];
    load4(vec0 + 4 * v, a);
    load4(vec0 + 4 * (v + step), b);
    const int64_t ja = rs.head + 4 * v, jb = rs.head + 4 * (v + step);
    const float a0 = logit(a[0], ja), a1 = logit(a[1], ja + 1), a2 = logit(a[2], ja + 2),
                a3 = logit(a[3], ja + 3);
    online_add4(a0, a1, a2, a3, m, s);
    const float b0 = logit(b[0], jb), b1 = logit(b[1], jb + 1), b2 = logit(b[2], jb + 2),
                b3 = logit(b[3], jb + 3);
    online_add4(b0, b1, b2, b3, m, s);
  }
  if (v < v1) {
    float a[4];
    load4(vec0 + 4 * v, a);
    const int64_t ja = rs.head + 4 * v;
    const float a0 = logit(a[0], ja), a1 = logit(a[1], ja + 1), a2 = logit(a[2], ja + 2),
                a3 = logit(a[3], ja + 3);
    online_add4(a0, a1, a2, a3, m, s);
  }
  if (p == 0 && threadIdx.x < rs.head)
    online_add(logit(static_cast<float>(row[threadIdx.x]), threadIdx.x), m, s);
  if (p == parts - 1 && rs.tail0 + threadIdx.x < n) {
    const int64_t j = rs.tail0 + threadIdx.x;
    online_add(logit(static_cast<float>(row[j]), j), m, s);
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

// dlogits of the chunk (see dlogit_kernel for the formula); G may alias L (fp32). L and G must
// sit at the same element phase modulo 4 (their vectors then line up); traw: as in row_stats_v2.
template <typename in_t, typename g_t>
__global__ void dlogit_v2_kernel(const in_t* L, g_t* G, int64_t B, int64_t n, int64_t j0,
                                 const float* __restrict__ rw, const float* __restrict__ traw, bool g_times_r,
                                 const int64_t* __restrict__ labels, int64_t class_offset,
                                 const float* __restrict__ lse, const float* __restrict__ gl,
                                 const float* __restrict__ gt, const float* __restrict__ gs,
                                 MarginT<float> mg) {
  for (int64_t i = blockIdx.y; i < B; i += gridDim.y) {
    const in_t* row = L + i * n;
    g_t* grow = G + i * n;
    const int64_t t = labels[i] - class_offset - j0;
    const float lse_i = lse[i], gl_i = gl[i], gs_i = gs[i], gt_i = gt[i];
    const float traw_i = traw ? traw[i] : 0.f;
    auto dlogit = [&](float raw, int64_t j) -> g_t {
      const float r = rw ? rw[j] : 1.f;
      const bool is_t = j == t;
      const float c = traw && is_t ? traw_i : raw * r;
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
      float a[4];
      load4(row + j, a);
      const g_t out[4] = {dlogit(a[0], j), dlogit(a[1], j + 1), dlogit(a[2], j + 2), dlogit(a[3], j + 3)};
      store4(grow + j, out);
    }
    if (blockIdx.x == 0) {
      if (threadIdx.x < rs.head)
        grow[threadIdx.x] = dlogit(static_cast<float>(row[threadIdx.x]), threadIdx.x);
      const int64_t j = rs.tail0 + threadIdx.x;
      if (j < n) grow[j] = dlogit(static_cast<float>(row[j]), j);
    }
  }
}

}  // namespace
}  // namespace sce
}  // namespace shardkit
