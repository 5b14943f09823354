// Device-generic operators of shardkit.parallel: the cross-device weighted loss reduction
// and the coalesced split of several tensors onto several devices.
//
// Both are CompositeImplicitAutograd: written with differentiable ATen calls only, so
// autograd, double backward, FakeTensor and torch.compile come from ATen, in C++ (no Python
// autograd formula runs per step: the fixed cost matters for small per-device criteria).
// They take tensors that live on DIFFERENT devices (per-device losses; pieces bound for
// other devices), so no single backend kernel could own a call anyway; the backward of a
// device-to-device copy (Tensor::to) sends each gradient back to its tensor's device.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

namespace {

// Asynchronous copies are only safe when the destination is a GPU: the copy is ordered
// on the destination's stream. A non-blocking copy INTO host memory could be read by
// the CPU before it completes, so those copies stay synchronous.
inline bool non_blocking_to(const c10::Device& dst) {
  return dst.is_cuda();
}

// result = sum_k w_k * loss_k / sum_k w_k (normalize) or sum_k w_k * loss_k, on `output_device`.
// losses: K tensors of one shape (usually 0-dim), floating point, on any devices.
// weights: K one-element tensors (counts or weights), any dtype, on any devices (a host
// weight meets a GPU output device by a non-blocking copy; its value is never read here).
at::Tensor weighted_loss_reduce(at::TensorList losses, at::TensorList weights, c10::Device output_device,
                                bool normalize) {
  TORCH_CHECK(!losses.empty(), "argument `losses` must hold at least one tensor");
  TORCH_CHECK(weights.size() == losses.size(), "argument `weights` must hold one weight per loss: got ",
              weights.size(), " weights for ", losses.size(), " losses");
  const auto shape = losses[0].sym_sizes();
  auto out_dtype = losses[0].scalar_type();
  for (size_t k = 0; k < losses.size(); ++k) {
    TORCH_CHECK(at::isFloatingType(losses[k].scalar_type()), "argument `losses` must be floating point, got ",
                losses[k].scalar_type(), " at index ", k);
    TORCH_CHECK(losses[k].sym_sizes() == shape, "argument `losses` must all have one shape: index 0 has ",
                shape, ", index ", k, " has ", losses[k].sym_sizes());
    TORCH_CHECK(weights[k].sym_numel() == 1, "argument `weights` must hold one-element tensors, got shape ",
                weights[k].sym_sizes(), " at index ", k);
    out_dtype = at::promote_types(out_dtype, losses[k].scalar_type());
  }
  // Accumulate half/bfloat16 losses in float: the reduced loss is the one number the
  // optimisation follows, rounding it K times would be wasteful.
  const auto acc_dtype = (out_dtype == at::kHalf || out_dtype == at::kBFloat16) ? at::kFloat : out_dtype;

  // Weights on the output device (one-element host weights stay scalars there when it is
  // the CPU), integers as acc dtype. No host read of a weight: the op must not sync and
  // must trace under FakeTensor.
  auto place_weight = [&](const at::Tensor& w) {
    auto wf = w.reshape({});
    if (!at::isFloatingType(wf.scalar_type())) wf = wf.to(acc_dtype);
    if (wf.device() == output_device) return wf;
    return wf.to(output_device, wf.scalar_type(), non_blocking_to(output_device));
  };

  at::Tensor numerator, denominator;
  for (size_t k = 0; k < losses.size(); ++k) {
    const auto w = place_weight(weights[k]);
    const auto loss = losses[k].to(output_device, acc_dtype, non_blocking_to(output_device));
    // A device whose chunk has nothing to count (every target ignored) reports a NaN mean
    // with weight 0; it must add nothing, as those elements add nothing on one device. The
    // where() also sends it a zero gradient (0/0 = NaN when every weight is 0, as the
    // one-device mean over no elements; the gradients are then all zero).
    const auto term = at::where(w != 0, loss * w, at::zeros({}, loss.options()));
    numerator = numerator.defined() ? numerator + term : term;
    if (normalize) denominator = denominator.defined() ? denominator + w : w;
  }
  at::Tensor result = normalize ? numerator / denominator : numerator;
  return result.to(out_dtype);
}

// Splits every tensor of `tensors` along `dim` into pieces of `split_sizes` and copies
// piece k to devices[k]. Returns the pieces device-major: out[k * N + i] is the k-th piece
// of tensors[i] (N = tensors.size()). Every piece is a fresh contiguous tensor (also when
// it stays on its source device), so outputs never alias inputs.
std::vector<at::Tensor> split_to_devices(at::TensorList tensors, at::IntArrayRef split_sizes, int64_t dim,
                                         const std::vector<c10::Device>& devices) {
  TORCH_CHECK(split_sizes.size() == devices.size(),
              "argument `split_sizes` must hold one size per device: got ", split_sizes.size(), " sizes for ",
              devices.size(), " devices");
  TORCH_CHECK(!devices.empty(), "argument `devices` must hold at least one device");
  int64_t total = 0;
  for (auto s : split_sizes) {
    TORCH_CHECK(s >= 0, "argument `split_sizes` must be non-negative, got ", split_sizes);
    total += s;
  }
  const auto n = static_cast<int64_t>(tensors.size());
  std::vector<int64_t> dims(n);
  for (int64_t i = 0; i < n; ++i) {
    const auto& t = tensors[i];
    TORCH_CHECK(t.dim() > 0, "argument `tensors` must not hold 0-dim tensors (index ", i,
                "): there is no dimension to split");
    dims[i] = c10::maybe_wrap_dim(dim, t.dim());
    TORCH_CHECK(t.sym_size(dims[i]) == total, "argument `tensors`: index ", i, " has size ",
                t.sym_size(dims[i]), " along dim ", dim, " but `split_sizes` ", split_sizes, " sum to ",
                total);
  }
  std::vector<at::Tensor> out(devices.size() * n);
  for (int64_t i = 0; i < n; ++i) {
    const auto pieces = at::split_with_sizes(tensors[i], split_sizes, dims[i]);  // backward: one cat
    for (size_t k = 0; k < devices.size(); ++k) {
      out[k * n + i] = pieces[k].to(pieces[k].options().device(devices[k]), non_blocking_to(devices[k]),
                                    /*copy=*/true, at::MemoryFormat::Contiguous);
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(shardkit, CompositeImplicitAutograd, m) {
  m.impl("weighted_loss_reduce", &weighted_loss_reduce);
  m.impl("split_to_devices", &split_to_devices);
}
