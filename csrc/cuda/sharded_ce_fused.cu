// Device asserts are calls, and a call in the GEMM kernel serializes its warpgroup MMAs: this
// file is built as a release build whatever the flags (before any header brings <cassert>).
#ifndef NDEBUG
#define NDEBUG
#endif
// The GEMM kernels wait for the previous kernel (griddepcontrol) before touching global memory,
// so that they can be launched as programmatic dependents (SHARDKIT_FUSED_PDL=1); launched
// without it, the wait is free.
#ifndef CUTLASS_ENABLE_GDC_FOR_SM90
#define CUTLASS_ENABLE_GDC_FOR_SM90
#endif
// The fused sm90 kernels of the sharded cross-entropy (see sharded_ce_fused.h): a persistent
// CUTLASS GEMM (CUTLASS 4.2's 3.x API: TMA loads, warpgroup MMA; cooperative, two consumer
// warpgroups on a [128, 256, 64] tile) whose epilogue is ours (sharded_ce_fused_epilogue.cuh),
// and the small per-row kernels around it. The host side builds each GEMM's parameters (TMA
// descriptors included) once per call and chunk shape, and per chunk only points the weight
// descriptor at the chunk.
#include "sharded_ce_fused.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <mutex>
#include <numeric>
#include <vector>

#include "env_flag.h"
#include "sharded_ce_common.h"
#include "sharded_ce_device.cuh"

#ifdef SHARDKIT_WITH_CUTLASS
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "sharded_ce_fused_epilogue.cuh"
#include "sharded_ce_fused_launch.cuh"
#endif

namespace shardkit {
namespace sce {
namespace fused {

bool enabled() {
  return env_flag("SHARDKIT_FUSED", true, "the fused kernels run where they apply");
}

bool pdl_enabled() {
  return env_flag("SHARDKIT_FUSED_PDL", false, "kernels launched without programmatic dependence");
}

int64_t whole_waves(int64_t n, int64_t B, int64_t tile, int64_t sm_count) {
  const int64_t row_tiles = std::max<int64_t>((B + kRowsPerTile - 1) / kRowsPerTile, 1);
  const int64_t sms = std::max<int64_t>(sm_count, 1);
  // Column tiles per chunk for row_tiles x them to be a multiple of the SM count.
  const int64_t unit = tile * (sms / std::gcd(sms, row_tiles));
  if (n >= unit) return n - n % unit;
  return n >= tile ? n - n % tile : n;
}

int64_t forward_chunk(int64_t B, int64_t D, int64_t C, int64_t chunk, int64_t elem, bool mixed,
                      bool normalize, int64_t tile, int64_t sm_count) {
  constexpr int64_t kMaxChunk = 131072, kPartBytes = 20;  // 3 floats and a count
  // The backward's chunk buffers, less the forward's recorded target cosines (4 bytes a row).
  const int64_t budget = chunk * (B * elem + (mixed ? D * elem : 0)) - B * 4;
  // Bytes per forward tile.
  const int64_t per_tile = B * kPartBytes + tile * ((mixed ? D * elem : 0) + (normalize ? 4 : 0));
  int64_t n = std::min(std::max<int64_t>(budget, 0) / std::max<int64_t>(per_tile, 1) * tile, kMaxChunk);
  n = std::max(chunk, n);
  return n >= C ? C : whole_waves(n, B, tile, sm_count);
}

int64_t backward_chunk(int64_t B, int64_t D, int64_t C, int64_t chunk, int64_t elem, bool mixed,
                       bool normalize, int64_t tile, int64_t sm_count, bool overlap) {
  constexpr int64_t kMaxBytes = int64_t(56) << 20;
  // Bytes per class of the backward's chunk buffers (sharded_ce_cuda.cu): the dlogits G, the
  // converted rows (mixed), the fp32 dW rows before their fix-up (normalized, not mixed), the
  // normalized rows and the inverse norms.
  const bool tbuf = !mixed && normalize;
  const int64_t per_class =
      B * elem + (mixed ? D * elem : 0) + (tbuf ? D * 4 : 0) + (normalize ? D * elem + 4 : 0);
  // The unfused kernels hold B fp32 logits per class beside those.
  const int64_t unit = std::max<int64_t>(per_class + 4 * B, 1);
  const int64_t budget = chunk >= kMaxBytes / unit ? kMaxBytes : chunk * unit;
  const int64_t n = std::max(chunk, budget / std::max<int64_t>(per_class, 1));
  const int64_t one = n >= C ? C : whole_waves(n, B, tile, sm_count);
  if (!overlap) return one;
  // Two chunks' buffers in flight (SHARDKIT_FUSED_OVERLAP): each half of one, in whole tiles.
  const int64_t t = std::max<int64_t>(tile, 1);
  return std::max(one / 2 / t * t, std::min(t, one));
}

#ifdef SHARDKIT_WITH_CUTLASS
namespace {

// Waits for the kernel this one was launched as a programmatic dependent of (a no-op otherwise),
// then lets the next kernel start its launch (it waits for this one's end before its accesses).
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// One warp per row: the chunk's tile partials in a fixed order, then the target logit (its
// margin from the recorded cosine), folded into the running statistics; `first`: set them
// instead (the target logit 0 where the target is elsewhere); `last`: M becomes lse = M + log S.
__global__ void merge_tiles_kernel(EpiParams p, int64_t B, int64_t n, int64_t tiles, Running run, bool first,
                                   bool last) {
  wait_for_previous_kernel();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (i >= B) return;
  float m = -INFINITY, s = 0.f, z = 0.f;
  int64_t c = 0;
  for (int64_t k = lane; k < tiles; k += 32) {
    const int64_t q = i * tiles + k;
    merge_ms(m, s, p.part_m[q], p.part_s[q]);
    z += p.part_z[q];
    c += p.part_c[q];
  }
  for (int o = 16; o > 0; o /= 2) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    merge_ms(m, s, m2, s2);
    z += __shfl_xor_sync(0xffffffffu, z, o);
    c += __shfl_xor_sync(0xffffffffu, c, o);
  }
  if (lane != 0) return;
  const int64_t t = p.labels[i] - p.label_shift;
  float zt = 0.f;
  const bool here = t >= 0 && t < n;
  if (here) {
    float dpsi;
    zt = target_logit(p, p.ct[i], &dpsi);
    merge_ms(m, s, zt, 1.f);
    z += zt;
  }
  if (first) {  // as folding into (-inf, 0, 0, 0, 0)
    run.M[i] = m;
    run.S[i] = s;
    run.LS[i] = z;
    run.CN[i] = c;
    run.TG[i] = zt;
  } else {
    if (here) run.TG[i] = zt;
    fold_stats(i, m, s, z, c, run.M, run.S, run.LS, run.CN);
  }
  if (last) run.M[i] += logf(run.S[i]);
}

// The target column's dlogit of each row whose target lies in the chunk (the GEMM wrote a
// plain one there), from the cosine the GEMM recorded.
template <class Elem>
__global__ void fix_target_kernel(EpiParams p, int64_t B, int64_t n) {
  wait_for_previous_kernel();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= B) return;
  const int64_t t = p.labels[i] - p.label_shift;
  if (t < 0 || t >= n) return;
  float dpsi;
  const float z = target_logit(p, p.ct[i], &dpsi);
  const float dz = p.gl[i] * __expf(z - p.lse[i]) + p.gs[i] + p.gt[i];
  store_one(static_cast<Elem*>(p.g) + i * p.ldg + t,
            p.scale * dpsi * dz * (p.g_times_r && p.rw ? p.rw[t] : 1.f));
}

// Set to 1 by the probe where it runs code compiled for sm_90a (the code the driver picked for
// this GPU holds the warpgroup-MMA kernels), to 0 otherwise.
__device__ int arch_probe_flag;
__global__ void arch_probe_kernel() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  arch_probe_flag = 1;
#else
  arch_probe_flag = 0;
#endif
}

// Runs the probe on a stream of its own and waits for that stream alone, with this thread's
// capture mode relaxed meanwhile: a first call made while a stream is captured into a CUDA
// graph (where waiting is refused in the default, global mode) probes outside the graph and
// takes the fused kernels like any other call. 0 where the launch fails (no code for this GPU).
int probe_sm90a(int device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  int flag = 0;
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess) {
    arch_probe_kernel<<<1, 1, 0, stream>>>();
    if (cudaGetLastError() != cudaSuccess ||
        cudaMemcpyFromSymbolAsync(&flag, arch_probe_flag, sizeof(int), 0, cudaMemcpyDeviceToHost, stream) !=
            cudaSuccess ||
        cudaStreamSynchronize(stream) != cudaSuccess)
      flag = 0;
    cudaStreamDestroy(stream);
  }
  (void)cudaGetLastError();  // a failed probe leaves no error behind
  C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  return flag;
}

bool device_runs_sm90a(int device) {
  static std::mutex mu;
  static std::vector<int> known;  // -1 unknown, 0 no, 1 yes
  const std::lock_guard<std::mutex> lock(mu);
  if (known.size() <= static_cast<size_t>(device)) known.resize(device + 1, -1);
  if (known[device] < 0) {
    const auto* prop = at::cuda::getDeviceProperties(device);
    known[device] = prop->major == 9 && prop->minor == 0 ? probe_sm90a(device) : 0;
  }
  return known[device] == 1;
}

// The small kernels after a GEMM, launched as its programmatic dependents where asked.
template <class... Params, class... Args>
void launch_small(void (*kernel)(Params...), int64_t blocks, int threads, bool pdl, cudaStream_t stream,
                  Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(threads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

template <bool kBackward>
std::unique_ptr<GemmLaunch> make_launch(at::ScalarType dt) {
  return dt == at::kBFloat16 ? make_gemm_launch<cutlass::bfloat16_t, kBackward>()
                             : make_gemm_launch<cutlass::half_t, kBackward>();
}

}  // namespace

bool compiled() {
  return true;
}

bool usable(const at::Tensor& x, const at::Tensor& wc) {
  const auto dt = x.scalar_type();
  if ((dt != at::kBFloat16 && dt != at::kHalf) || wc.scalar_type() != dt || !x.is_cuda()) return false;
  const int64_t D = x.size(1);
  if (D % 64 != 0 || D > 1024 || wc.size(1) != D || x.size(0) > INT32_MAX || wc.size(0) > INT32_MAX)
    return false;
  if (!x.is_contiguous() || !wc.is_contiguous()) return false;
  if (reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 ||
      reinterpret_cast<uintptr_t>(wc.const_data_ptr()) % 16)
    return false;
  return device_runs_sm90a(x.get_device());
}

Scratch make_scratch(const at::Tensor& x, int64_t max_n, bool backward) {
  const int64_t B = x.size(0);
  Scratch sc;
  sc.backward = backward;
  sc.pdl = pdl_enabled();
  if (!backward) {
    const int64_t tiles = (max_n + kColsPerTile - 1) / kColsPerTile;
    sc.parts = at::empty({3 * B * tiles}, x.options().dtype(at::kFloat));
    sc.counts = at::empty({B * tiles}, x.options().dtype(at::kLong));
  }
  sc.ct = at::empty({B}, x.options().dtype(at::kFloat));
  sc.gemm = backward ? make_launch<true>(x.scalar_type()) : make_launch<false>(x.scalar_type());
  return sc;
}

void forward(const at::Tensor& x, const at::Tensor& wc, EpiParams p, const Running& run, Scratch& sc,
             bool first, bool last, cudaStream_t stream) {
  TORCH_CHECK(!sc.backward && sc.gemm,
              "shardkit: internal error: the fused forward's scratch was not made for it");
  const int64_t B = x.size(0), n = wc.size(0), tiles = (n + kColsPerTile - 1) / kColsPerTile;
  TORCH_CHECK(sc.parts.numel() >= 3 * B * tiles && sc.ct.numel() >= B,
              "shardkit: internal error: the fused forward's scratch is smaller than its chunk");
  // The partials of this chunk, [B, tiles] each, at the start of the scratch.
  p.part_m = sc.parts.mutable_data_ptr<float>();
  p.part_s = p.part_m + B * tiles;
  p.part_z = p.part_s + B * tiles;
  p.part_c = sc.counts.mutable_data_ptr<int64_t>();
  p.ct = sc.ct.mutable_data_ptr<float>();
  sc.gemm->run(x, wc, p, sc.pdl, stream);
  constexpr int kWarps = 8;
  launch_small(merge_tiles_kernel, (B + kWarps - 1) / kWarps, 32 * kWarps, sc.pdl, stream, p, B, n, tiles,
               run, first, last);
}

void backward(const at::Tensor& x, const at::Tensor& wc, EpiParams p, Scratch& sc, cudaStream_t stream) {
  const int64_t B = x.size(0), n = wc.size(0);
  TORCH_CHECK(sc.backward && sc.gemm && sc.ct.numel() >= B,
              "shardkit: internal error: the fused backward's scratch was not made for it");
  p.ct = sc.ct.mutable_data_ptr<float>();
  sc.gemm->run(x, wc, p, sc.pdl, stream);
  const int64_t blocks = (B + 255) / 256;
  if (x.scalar_type() == at::kBFloat16)
    launch_small(fix_target_kernel<cutlass::bfloat16_t>, blocks, 256, sc.pdl, stream, p, B, n);
  else
    launch_small(fix_target_kernel<cutlass::half_t>, blocks, 256, sc.pdl, stream, p, B, n);
}

#else  // no CUTLASS at build time: never usable

bool compiled() {
  return false;
}
bool usable(const at::Tensor&, const at::Tensor&) {
  return false;
}
Scratch make_scratch(const at::Tensor&, int64_t, bool) {
  TORCH_CHECK(false, "shardkit was built without the fused kernels (no CUTLASS headers at build time)");
  return Scratch();
}
void forward(const at::Tensor&, const at::Tensor&, EpiParams, const Running&, Scratch&, bool, bool,
             cudaStream_t) {
  TORCH_CHECK(false, "shardkit was built without the fused kernels (no CUTLASS headers at build time)");
}
void backward(const at::Tensor&, const at::Tensor&, EpiParams, Scratch&, cudaStream_t) {
  TORCH_CHECK(false, "shardkit was built without the fused kernels (no CUTLASS headers at build time)");
}

#endif

}  // namespace fused
}  // namespace sce
}  // namespace shardkit
