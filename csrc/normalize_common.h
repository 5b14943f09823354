// Argument checks and layout resolution for shardkit::normalize_images, shared by the CPU
// and CUDA backends so both reject exactly the same inputs with the same messages.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace shardkit {
namespace normalize {

// Per-channel constants travel in a fixed-size kernel argument on CUDA (no device copy,
// no sync per call); the CPU backend enforces the same limit so both accept the same inputs.
constexpr int64_t kMaxChannels = 64;

// What a backend needs to run the kernel: the input as a dense 4-D buffer in a known
// memory layout, the output buffer, and out = x * scale[c] + shift[c].
struct Plan {
  at::Tensor input;   // uint8, dense in memory as NHWC (in_cl) or NCHW
  at::Tensor out4;    // [N, C, H, W], contiguous or channels_last (out_cl)
  at::Tensor result;  // what the op returns (out4, or out4[0] for a single image)
  int64_t N = 0, C = 0, H = 0, W = 0;
  bool in_cl = false, out_cl = false;
  std::vector<double> scale, shift;
};

inline Plan make_plan(const at::Tensor& images, at::ArrayRef<double> mean, at::ArrayRef<double> std,
                      bool channels_last_input, at::ScalarType out_dtype, bool channels_last_output) {
  TORCH_CHECK(images.scalar_type() == at::kByte, "normalize_images: argument `images` must be uint8, got ",
              images.scalar_type());
  TORCH_CHECK(images.dim() == 3 || images.dim() == 4, "normalize_images: argument `images` must be 4-D (",
              channels_last_input ? "N, H, W, C" : "N, C, H, W", ") or 3-D (a single image, ",
              channels_last_input ? "H, W, C" : "C, H, W", "), got ", images.dim(), "-D with shape ",
              images.sizes());
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kDouble || out_dtype == at::kBFloat16 ||
                  out_dtype == at::kHalf,
              "normalize_images: argument `out_dtype` must be float32, float64, bfloat16 or float16, got ",
              out_dtype);
  const bool single = images.dim() == 3;
  at::Tensor x4 = single ? images.unsqueeze(0) : images;
  // Logical NCHW view whatever the caller's layout; its strides tell the memory layout.
  at::Tensor v = channels_last_input ? x4.permute({0, 3, 1, 2}) : x4;
  Plan p;
  p.N = v.size(0);
  p.C = v.size(1);
  p.H = v.size(2);
  p.W = v.size(3);
  TORCH_CHECK(mean.size() == std.size(), "normalize_images: `mean` and `std` must have the same length, got ",
              mean.size(), " and ", std.size());
  TORCH_CHECK(static_cast<int64_t>(mean.size()) == p.C, "normalize_images: `images` has ", p.C,
              " channels (dim ", channels_last_input ? "-1" : (single ? "0" : "1"), " of shape ",
              images.sizes(), ", ", channels_last_input ? "channels-last" : "channels-first",
              " input) but `mean`/`std` have ", mean.size(), " entries");
  TORCH_CHECK(p.C >= 1 && p.C <= kMaxChannels, "normalize_images: at most ", kMaxChannels,
              " channels are supported, got ", p.C);
  p.scale.resize(p.C);
  p.shift.resize(p.C);
  for (int64_t c = 0; c < p.C; ++c) {
    TORCH_CHECK(std[c] != 0.0 && std::isfinite(std[c]), "normalize_images: `std[", c,
                "]` must be non-zero and finite, got ", std[c]);
    TORCH_CHECK(std::isfinite(mean[c]), "normalize_images: `mean[", c, "]` must be finite, got ", mean[c]);
    // (x / 255 - m) / s == x * (1 / (255 s)) + (-m / s): one multiply and one add per element.
    p.scale[c] = 1.0 / (255.0 * std[c]);
    p.shift[c] = -mean[c] / std[c];
    // The outputs of channel c lie between shift and 255 * scale + shift: both must fit the
    // output dtype (a tiny std or a huge mean would otherwise give inf / NaN silently).
    const double reach = std::max(std::fabs(p.shift[c]), std::fabs(255.0 * p.scale[c] + p.shift[c]));
    const double top = out_dtype == at::kDouble  ? std::numeric_limits<double>::max()
                       : out_dtype == at::kHalf  ? 65504.0
                       : out_dtype == at::kFloat ? static_cast<double>(std::numeric_limits<float>::max())
                                                 : 3.3895313892515355e38;  // bfloat16
    TORCH_CHECK(std::isfinite(reach) && reach <= top, "normalize_images: with `mean[", c, "]` = ", mean[c],
                " and `std[", c, "]` = ", std[c], " the outputs reach ", reach, ", beyond the range of ",
                out_dtype, " (", top, ")");
    // The product x * scale comes first, in float (double for a double output): it must not
    // overflow there either, even where adding the shift would bring it back into range.
    const double compute_top = out_dtype == at::kDouble
                                   ? std::numeric_limits<double>::max()
                                   : static_cast<double>(std::numeric_limits<float>::max());
    TORCH_CHECK(255.0 * std::fabs(p.scale[c]) <= compute_top, "normalize_images: `std[", c, "]` = ", std[c],
                " is too close to zero: 255 / (255 std) overflows the op's arithmetic (", compute_top, ")");
  }
  // Use the input in place when it is dense in either layout (a permuted HWC numpy array
  // passed as NCHW is dense NHWC memory); copy only genuinely strided inputs.
  if (v.is_contiguous()) {
    p.in_cl = false;
  } else if (v.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    p.in_cl = true;
  } else {
    p.in_cl = channels_last_input;
    v = v.contiguous(channels_last_input ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
  }
  p.input = v;
  p.out_cl = channels_last_output;
  p.out4 = at::empty({p.N, p.C, p.H, p.W}, images.options().dtype(out_dtype).memory_format(
                                               channels_last_output ? at::MemoryFormat::ChannelsLast
                                                                    : at::MemoryFormat::Contiguous));
  p.result = single ? p.out4.squeeze(0) : p.out4;
  return p;
}

}  // namespace normalize
}  // namespace shardkit
