// CUDA kernels of shardkit::normalize_images: uint8 images -> normalized floating images in
// one pass (each input byte read once, each output element written once).
//
// The hot case is NHWC uint8 (what decoders and DataLoaders produce) to NCHW float. Flatten
// each image's H x W plane to P pixels: out[n][c][p] = in[n][p][c] * scale[c] + shift[c].
// A group of 4 consecutive pixels: a thread reads their 4*C bytes with C aligned 32-bit loads
// (a warp reads one contiguous 128*C-byte span) and writes, per channel, 4 consecutive
// outputs with one vector store (a warp writes one contiguous span per channel); each
// thread handles several groups at once, their loads issued together. Both sides
// are coalesced without a shared-memory transpose. Other layout pairs use a simple
// element-per-thread kernel (output-coalesced).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "normalize_common.h"

namespace shardkit {
namespace {

using normalize::kMaxChannels;
using normalize::Plan;

// Per-channel constants by value in the kernel arguments: no device copy, no sync.
template <typename acc_t>
struct Affine {
  acc_t scale[kMaxChannels];
  acc_t shift[kMaxChannels];
};

constexpr int kThreads = 256;
constexpr int kPix = 4;  // pixels per thread in the vectorized transpose

// 4 consecutive outputs stored at once (16 bytes for float, 8 for half/bf16).
template <typename T>
struct alignas(4 * sizeof(T)) Vec4 {
  T v[4];
};

// NHWC -> NCHW, CT channels known at compile time, P % 4 == 0, input 4-byte aligned. A
// thread takes kGroups groups of 4 pixels per loop turn, blockDim.x groups apart (each of
// its loads is still one coalesced span per warp), and issues all their loads before any
// store: kGroups * CT loads in flight per thread instead of CT.
constexpr int kGroups = 4;

template <typename T, typename acc_t, int CT>
__global__ void nhwc_to_nchw_vec4(const uint8_t* __restrict__ in, T* __restrict__ out,
                                  int64_t groups_per_image, int64_t total_groups, int64_t P,
                                  Affine<acc_t> aff) {
  const int64_t step = blockDim.x;
  for (int64_t g0 = blockIdx.x * step * kGroups + threadIdx.x; g0 < total_groups;
       g0 += static_cast<int64_t>(gridDim.x) * step * kGroups) {
    uint32_t words[kGroups][CT];
    int64_t dst[kGroups];  // n * CT * P + p: the first channel's first output of the group
#pragma unroll
    for (int u = 0; u < kGroups; ++u) {
      const int64_t g = g0 + u * step;
      if (g < total_groups) {
        const int64_t n = g / groups_per_image;
        const int64_t p = (g - n * groups_per_image) * kPix;
        // 4 pixels x CT channels = CT 32-bit words, contiguous and aligned.
        const uint32_t* src = reinterpret_cast<const uint32_t*>(in + (n * P + p) * CT);
#pragma unroll
        for (int k = 0; k < CT; ++k) words[u][k] = __ldg(src + k);
        dst[u] = n * CT * P + p;
      }
    }
#pragma unroll
    for (int u = 0; u < kGroups; ++u) {
      if (g0 + u * step < total_groups) {
        const uint8_t* bytes = reinterpret_cast<const uint8_t*>(words[u]);
#pragma unroll
        for (int c = 0; c < CT; ++c) {
          Vec4<T> o;
#pragma unroll
          for (int j = 0; j < kPix; ++j)
            o.v[j] = static_cast<T>(static_cast<acc_t>(bytes[j * CT + c]) * aff.scale[c] + aff.shift[c]);
          *reinterpret_cast<Vec4<T>*>(out + dst[u] + c * P) = o;
        }
      }
    }
  }
}

// Any layout pair, any channel count: one thread per output element, output-coalesced.
template <typename T, typename acc_t>
__global__ void normalize_generic(const uint8_t* __restrict__ in, T* __restrict__ out, int64_t total,
                                  int64_t C, int64_t P, bool in_cl, bool out_cl, Affine<acc_t> aff) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t n, c, p;
    if (out_cl) {  // i = (n * P + p) * C + c
      c = i % C;
      const int64_t np = i / C;
      p = np % P;
      n = np / P;
    } else {  // i = (n * C + c) * P + p
      p = i % P;
      const int64_t nc = i / P;
      c = nc % C;
      n = nc / C;
    }
    const int64_t src = in_cl ? (n * P + p) * C + c : (n * C + c) * P + p;
    out[i] = static_cast<T>(static_cast<acc_t>(__ldg(in + src)) * aff.scale[c] + aff.shift[c]);
  }
}

int64_t blocks_for(int64_t work) {
  // Enough blocks to fill the GPU several times over; the grid-stride loops cover the rest.
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, sms * 32));
}

template <typename T, typename acc_t, int CT>
bool try_vec4(const Plan& p, const Affine<acc_t>& aff, cudaStream_t stream) {
  if (p.C != CT) return false;
  const int64_t P = p.H * p.W;
  const auto* in = p.input.data_ptr<uint8_t>();
  auto* out = p.out4.data_ptr<T>();
  if (P % kPix != 0 || reinterpret_cast<uintptr_t>(in) % 4 != 0 ||
      reinterpret_cast<uintptr_t>(out) % (kPix * sizeof(T)) != 0)
    return false;
  const int64_t gpi = P / kPix, total = p.N * gpi;
  nhwc_to_nchw_vec4<T, acc_t, CT>
      <<<blocks_for((total + kGroups - 1) / kGroups), kThreads, 0, stream>>>(in, out, gpi, total, P, aff);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

at::Tensor normalize_images_cuda(const at::Tensor& images, at::ArrayRef<double> mean,
                                 at::ArrayRef<double> std, bool channels_last_input, at::ScalarType out_dtype,
                                 bool channels_last_output) {
  TORCH_CHECK(images.is_cuda(), "normalize_images: argument `images` must be a CUDA tensor here, got ",
              images.device());
  c10::cuda::CUDAGuard guard(images.device());
  Plan p = normalize::make_plan(images, mean, std, channels_last_input, out_dtype, channels_last_output);
  if (p.out4.numel() == 0) return p.result;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "normalize_images_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    Affine<acc_t> aff;
    for (int64_t c = 0; c < p.C; ++c) {
      aff.scale[c] = static_cast<acc_t>(p.scale[c]);
      aff.shift[c] = static_cast<acc_t>(p.shift[c]);
    }
    if (p.in_cl && !p.out_cl &&
        (try_vec4<scalar_t, acc_t, 3>(p, aff, stream) || try_vec4<scalar_t, acc_t, 1>(p, aff, stream) ||
         try_vec4<scalar_t, acc_t, 4>(p, aff, stream)))
      return;
    const int64_t total = p.out4.numel();
    normalize_generic<scalar_t, acc_t>
        <<<blocks_for(total), kThreads, 0, stream>>>(p.input.data_ptr<uint8_t>(), p.out4.data_ptr<scalar_t>(),
                                                     total, p.C, p.H * p.W, p.in_cl, p.out_cl, aff);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return p.result;
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_IMPL(shardkit, CUDA, m) {
  m.impl("normalize_images", &shardkit::normalize_images_cuda);
}
