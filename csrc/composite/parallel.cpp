// Device-generic operators of shardkit.parallel: the cross-device weighted loss reduction
// and the coalesced split of several tensors onto several devices.
//
// They take tensors that live on DIFFERENT devices (per-device losses; pieces bound for
// other devices), so no single backend kernel could own a call: both are written with
// ATen calls, which work on every backend.
//
// split_to_devices is CompositeImplicitAutograd: differentiable ATen calls only, so its
// autograd (double backward included), FakeTensor and torch.compile support come from ATen.
// weighted_loss_reduce runs once per step on a handful of scalars, where ATen's per-call
// cost is the whole cost: its forward (CompositeExplicitAutograd) runs below autograd, and
// ONE C++ autograd node (registered for the Autograd key) gives each loss its scaled
// gradient on its own device. The fake kernel is registered in Python
// (python/shardkit/ops/_parallel.py).

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/library.h>

#include <limits>
#include <vector>

namespace {

// Asynchronous copies are only safe when the destination is a GPU: the copy is ordered
// on the destination's stream. A non-blocking copy INTO host memory could be read by
// the CPU before it completes, so those copies stay synchronous.
inline bool non_blocking_to(const c10::Device& dst) {
  return dst.is_cuda();
}

// A one-element weight as a 0-dim tensor on `device` (integers as `dtype`; a host weight
// meets a GPU by a non-blocking copy: its value is never read on the host).
at::Tensor place_weight(const at::Tensor& w, const c10::Device& device, at::ScalarType dtype) {
  auto wf = w.reshape({});
  if (!at::isFloatingType(wf.scalar_type())) wf = wf.to(dtype);
  if (wf.device() == device) return wf;
  return wf.to(device, wf.scalar_type(), non_blocking_to(device));
}

// True when every tensor is a plain one-element host tensor (not a FakeTensor, a functional
// wrapper or any other subclass, and no dispatch mode active, as while torch.compile traces):
// the reduction is then a few double operations in C++ (reading host values needs no
// device sync), not a dozen ATen calls.
bool host_scalars(at::TensorList a, at::TensorList b) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) return false;
  const auto wrapped = c10::DispatchKeySet(
      {c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot, c10::DispatchKey::Functionalize});
  for (const auto* list : {&a, &b}) {
    for (const auto& t : *list) {
      if (t.key_set().has_any(wrapped) || !t.device().is_cpu() || t.layout() != at::kStrided ||
          t.numel() != 1)
        return false;
    }
  }
  return true;
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

  if (output_device.is_cpu() && host_scalars(losses, weights)) {
    double numerator = 0, denominator = 0;
    for (size_t k = 0; k < losses.size(); ++k) {
      const double w = weights[k].item<double>();
      if (w != 0) numerator += losses[k].item<double>() * w;  // see the comment below on w = 0
      denominator += w;
    }
    return at::full(losses[0].sizes(), normalize ? numerator / denominator : numerator,
                    losses[0].options().dtype(out_dtype));
  }
  at::Tensor numerator, denominator;
  for (size_t k = 0; k < losses.size(); ++k) {
    const auto w = place_weight(weights[k], output_device, acc_dtype);
    const auto loss = losses[k].to(output_device, acc_dtype, non_blocking_to(output_device));
    // A device whose chunk has nothing to count (every target ignored) reports a NaN mean
    // with weight 0; it must add nothing, as those elements add nothing on one device
    // (0/0 = NaN when every weight is 0, as the one-device mean over no elements).
    const auto term = at::where(w != 0, loss * w, 0);
    numerator = numerator.defined() ? numerator.add_(term) : term;
    if (normalize) denominator = denominator.defined() ? denominator + w : w;
  }
  at::Tensor result = normalize ? numerator / denominator : numerator;
  return result.to(out_dtype);
}

// The autograd node of weighted_loss_reduce: loss k receives grad * w_k / sum w (or grad * w_k
// without normalize; 0 where w_k = 0, and 0 for all when every weight is 0), in its own
// device and dtype. The scales are computed in the gradient's precision, at least float32.
// Written with differentiable ATen calls, so it has a double backward.
class WeightedLossReduceFn : public torch::autograd::Function<WeightedLossReduceFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList losses,
                            at::TensorList weights, c10::Device output_device, bool normalize) {
    std::vector<at::Tensor> devices_dtypes;  // 0-dim tensors carrying each loss's device and dtype
    devices_dtypes.reserve(losses.size());
    for (const auto& l : losses) devices_dtypes.push_back(at::empty({0}, l.options()));
    ctx->saved_data["n"] = static_cast<int64_t>(losses.size());
    ctx->saved_data["normalize"] = normalize;
    ctx->saved_data["meta"] = devices_dtypes;
    ctx->save_for_backward(weights.vec());
    at::AutoDispatchBelowADInplaceOrView below;
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("shardkit::weighted_loss_reduce", "")
                               .typed<at::Tensor(at::TensorList, at::TensorList, c10::Device, bool)>();
    return op.call(losses, weights, output_device, normalize);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto n = ctx->saved_data["n"].toInt();
    const bool normalize = ctx->saved_data["normalize"].toBool();
    const auto meta = ctx->saved_data["meta"].toTensorVector();
    const auto weights = ctx->get_saved_variables();
    const at::Tensor& grad = grads[0];
    torch::autograd::variable_list out(2 * n + 2);  // losses, weights (none), device, normalize
    if (!grad.defined()) return out;
    if (grad.device().is_cpu() && host_scalars(weights, {})) {  // scales as doubles
      std::vector<double> w(n);
      double total = 0;
      for (int64_t k = 0; k < n; ++k) total += (w[k] = weights[k].item<double>());
      for (int64_t k = 0; k < n; ++k) {
        const double scale = normalize ? (w[k] != 0 ? w[k] / total : 0.0) : w[k];
        out[k] = (grad * scale).to(meta[k].device(), meta[k].scalar_type());
      }
      return out;
    }
    const auto dtype = at::promote_types(grad.scalar_type(), at::kFloat);
    std::vector<at::Tensor> ws;
    at::Tensor total;
    for (int64_t k = 0; k < n; ++k) {
      ws.push_back(place_weight(weights[k], grad.device(), dtype));
      if (normalize) total = total.defined() ? total + ws.back() : ws.back();
    }
    for (int64_t k = 0; k < n; ++k) {
      const auto scale = normalize ? at::where(ws[k] != 0, ws[k] / total, 0) : ws[k];
      out[k] = (grad * scale).to(meta[k].device(), meta[k].scalar_type(), non_blocking_to(meta[k].device()));
    }
    return out;
  }
};

at::Tensor weighted_loss_reduce_autograd(at::TensorList losses, at::TensorList weights,
                                         c10::Device output_device, bool normalize) {
  return WeightedLossReduceFn::apply(losses, weights, output_device, normalize);
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
    TORCH_CHECK(s <= std::numeric_limits<int64_t>::max() - total, "argument `split_sizes` ", split_sizes,
                " sums past the int64 range");
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

TORCH_LIBRARY_IMPL(shardkit, CompositeExplicitAutograd, m) {
  m.impl("weighted_loss_reduce", &weighted_loss_reduce);
}
TORCH_LIBRARY_IMPL(shardkit, Autograd, m) {
  m.impl("weighted_loss_reduce", &weighted_loss_reduce_autograd);
}
TORCH_LIBRARY_IMPL(shardkit, CompositeImplicitAutograd, m) {
  m.impl("split_to_devices", &split_to_devices);
}
