// CPU kernel of shardkit::normalize_images: uint8 images -> normalized floating images in
// one pass over memory (read 1 byte, write one output element).
//
// Work is split by image rows (n, h) with at::parallel_for. Every inner loop walks a
// contiguous run with compile-time strides so the compiler vectorizes the
// uint8 -> float convert and the multiply-add.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "normalize_common.h"

namespace shardkit {
namespace {

using normalize::Plan;

// Elements per parallel task: large enough to amortize scheduling, small enough that a
// batch of small images still spreads over the cores.
constexpr int64_t kGrainElements = 32768;

// Rounds the fp32 result to the output type. bfloat16 by integer round-to-nearest-even on
// the bits (what c10::BFloat16 does, minus its NaN branch, which blocks vectorization; NaN
// cannot arise here: scale and shift are finite and the input is a byte).
template <typename T, typename acc_t>
inline T to_out(acc_t v) {
  return static_cast<T>(v);
}
template <>
inline c10::BFloat16 to_out<c10::BFloat16, float>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

// One image row of NHWC uint8 to CT channel rows (plane stride HW) of NCHW output.
template <typename T, typename acc_t, int CT>
inline void transpose_row(const uint8_t* __restrict__ src, T* __restrict__ dst, int64_t W, int64_t HW,
                          const acc_t* scale, const acc_t* shift) {
  for (int c = 0; c < CT; ++c) {
    T* __restrict__ d = dst + c * HW;
    const acc_t s = scale[c], b = shift[c];
    for (int64_t w = 0; w < W; ++w) d[w] = to_out<T, acc_t>(static_cast<acc_t>(src[w * CT + c]) * s + b);
  }
}

template <typename T, typename acc_t>
void normalize_rows(const Plan& p, const acc_t* scale, const acc_t* shift) {
  const uint8_t* __restrict__ in = p.input.data_ptr<uint8_t>();
  T* __restrict__ out = p.out4.data_ptr<T>();
  const int64_t C = p.C, H = p.H, W = p.W, WC = W * C;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, WC));
  const bool in_cl = p.in_cl, out_cl = p.out_cl;

  at::parallel_for(0, p.N * H, grain, [&](int64_t begin, int64_t end) {
    // Same layout in and out, channels interleaved: the per-element constants repeat with
    // period C along a row, so expand them once per task into row-long arrays and the
    // inner loop becomes a plain fused multiply-add over contiguous memory.
    std::vector<acc_t> row_scale, row_shift;
    if (in_cl && out_cl) {
      row_scale.resize(WC);
      row_shift.resize(WC);
      for (int64_t i = 0; i < WC; ++i) {
        row_scale[i] = scale[i % C];
        row_shift[i] = shift[i % C];
      }
    }
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = r / H, h = r % H;
      if (in_cl && out_cl) {
        const uint8_t* __restrict__ src = in + r * WC;
        T* __restrict__ dst = out + r * WC;
        const acc_t* __restrict__ rs = row_scale.data();
        const acc_t* __restrict__ rb = row_shift.data();
        for (int64_t i = 0; i < WC; ++i)
          dst[i] = to_out<T, acc_t>(static_cast<acc_t>(src[i]) * rs[i] + rb[i]);
      } else if (in_cl) {  // NHWC -> NCHW: the transpose; reads stride C within one cached row
        const uint8_t* __restrict__ src = in + r * WC;
        T* __restrict__ dst0 = out + (n * C * H + h) * W;  // channel c's row is dst0 + c * H * W
        // Compile-time channel counts let the compiler vectorize the strided reads.
        if (C == 3) {
          transpose_row<T, acc_t, 3>(src, dst0, W, H * W, scale, shift);
        } else if (C == 1) {
          transpose_row<T, acc_t, 1>(src, dst0, W, H * W, scale, shift);
        } else if (C == 4) {
          transpose_row<T, acc_t, 4>(src, dst0, W, H * W, scale, shift);
        } else {
          for (int64_t c = 0; c < C; ++c) {
            T* __restrict__ dst = dst0 + c * H * W;
            const acc_t s = scale[c], b = shift[c];
            const uint8_t* __restrict__ sc = src + c;
            for (int64_t w = 0; w < W; ++w) dst[w] = to_out<T, acc_t>(static_cast<acc_t>(sc[w * C]) * s + b);
          }
        }
      } else if (!out_cl) {  // NCHW -> NCHW: elementwise per channel plane row
        for (int64_t c = 0; c < C; ++c) {
          const int64_t off = ((n * C + c) * H + h) * W;
          const uint8_t* __restrict__ src = in + off;
          T* __restrict__ dst = out + off;
          const acc_t s = scale[c], b = shift[c];
          for (int64_t w = 0; w < W; ++w) dst[w] = to_out<T, acc_t>(static_cast<acc_t>(src[w]) * s + b);
        }
      } else {  // NCHW -> channels_last output: writes stride C within one cached row
        T* __restrict__ dst = out + r * WC;
        for (int64_t c = 0; c < C; ++c) {
          const uint8_t* __restrict__ src = in + ((n * C + c) * H + h) * W;
          const acc_t s = scale[c], b = shift[c];
          T* __restrict__ dc = dst + c;
          for (int64_t w = 0; w < W; ++w) dc[w * C] = to_out<T, acc_t>(static_cast<acc_t>(src[w]) * s + b);
        }
      }
    }
  });
}

at::Tensor normalize_images_cpu(const at::Tensor& images, at::ArrayRef<double> mean, at::ArrayRef<double> std,
                                bool channels_last_input, at::ScalarType out_dtype,
                                bool channels_last_output) {
  TORCH_CHECK(images.device().is_cpu(), "normalize_images: argument `images` must be a CPU tensor here, got ",
              images.device());
  Plan p = normalize::make_plan(images, mean, std, channels_last_input, out_dtype, channels_last_output);
  if (p.out4.numel() == 0) return p.result;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "normalize_images_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    std::vector<acc_t> scale(p.scale.begin(), p.scale.end()), shift(p.shift.begin(), p.shift.end());
    normalize_rows<scalar_t, acc_t>(p, scale.data(), shift.data());
  });
  return p.result;
}

}  // namespace
}  // namespace shardkit

TORCH_LIBRARY_IMPL(shardkit, CPU, m) {
  m.impl("normalize_images", &shardkit::normalize_images_cpu);
}
