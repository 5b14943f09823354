// Autograd-level kernels of the ema op family: torch's rules for in-place ops.
//
// The schemas declare the mutations (Tensor(a!)[]), but a custom op gets no generated
// autograd or ADInplaceOrView kernel, so nothing bumped the version counters of the
// written tensors (autograd then silently used modified saved tensors), nothing refused a
// write into a leaf that requires grad, and a call mixing a meta tensor with CPU tensors
// was sent to the fake kernel and did nothing. One kernel per op at the Autograd key
// (every backend) does what VariableType does for ATen's in-place ops: check, run the
// backend kernel below autograd, bump the versions of the written tensors. Cost: a loop
// over the tensor lists on the host, no device work. Under torch.inference_mode the
// Autograd keys are skipped (inference tensors have no version counter); the backend
// kernels' checks (shapes, devices, overlap) still run.

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <utility>
#include <vector>

#include "ema_common.h"

namespace {

// The device rule of every ema op, checked before dispatch (the dispatcher would pick one
// backend for a mix and a meta tensor would reach the no-op fake kernel).
void check_devices(const char* op, at::TensorList ema, at::TensorList model) {
  if (ema.empty()) return;
  const auto device = ema[0].device();
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), op, ": tensors on ", device,
              " are not supported (CPU and CUDA kernels only); `ema[0]` is on ", device);
  for (size_t i = 0; i < ema.size(); ++i) {
    TORCH_CHECK(ema[i].device() == device, op, ": every tensor must be on one device, `ema[0]` is on ",
                device, " but `ema[", i, "]` is on ", ema[i].device());
    if (i < model.size()) {
      TORCH_CHECK(model[i].device() == device, op, ": `model[", i, "]` is on ", model[i].device(),
                  " but `ema` is on ", device, "; move the model tensors (or use ModelEMA(device=...))");
    }
  }
}

// torch's check_inplace, with the argument named: a written tensor must not be part of a
// graph while grad mode is on (the ops are not differentiable).
void check_writable(const char* op, const char* arg, at::TensorList tensors) {
  if (!c10::GradMode::is_enabled()) return;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (!t.requires_grad()) continue;
    TORCH_CHECK(!t.is_leaf(), op,
                ": a leaf Variable that requires grad is being used in an in-place operation (`", arg, "[", i,
                "]`); call it under torch.no_grad() or pass detached tensors");
    TORCH_CHECK(false, op, ": `", arg, "[", i, "]` requires grad, but the op is not differentiable and ",
                "writes it in place; call it under torch.no_grad() or pass detached tensors");
  }
}

void bump(at::TensorList tensors) {
  for (const at::Tensor& t : tensors) torch::autograd::impl::bump_version(t);
}

void ema_update_autograd(c10::DispatchKeySet ks, at::TensorList ema, at::TensorList model, double decay) {
  check_devices("ema_update_", ema, model);
  check_writable("ema_update_", "ema", ema);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("shardkit::ema_update_", "")
                       .typed<void(at::TensorList, at::TensorList, double)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatch(ks & c10::after_ADInplaceOrView_keyset, ema, model, decay);
  }
  bump(ema);
}

void ema_update_device_decay_autograd(c10::DispatchKeySet ks, at::TensorList ema, at::TensorList model,
                                      const at::Tensor& decay) {
  check_devices("ema_update_device_decay_", ema, model);
  // before dispatch too: a decay on another device would pick the backend (a meta one, the
  // no-op fake kernel)
  shardkit::ema::check_device_decay(ema, decay);
  check_writable("ema_update_device_decay_", "ema", ema);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("shardkit::ema_update_device_decay_", "")
                       .typed<void(at::TensorList, at::TensorList, const at::Tensor&)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatch(ks & c10::after_ADInplaceOrView_keyset, ema, model, decay);
  }
  bump(ema);
}

void ema_update_stochastic_autograd(c10::DispatchKeySet ks, at::TensorList ema, at::TensorList model,
                                    double decay, int64_t seed, int64_t counter, c10::IntArrayRef salts) {
  check_devices("ema_update_stochastic_", ema, model);
  check_writable("ema_update_stochastic_", "ema", ema);
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("shardkit::ema_update_stochastic_", "")
          .typed<void(at::TensorList, at::TensorList, double, int64_t, int64_t, c10::IntArrayRef)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatch(ks & c10::after_ADInplaceOrView_keyset, ema, model, decay, seed, counter, salts);
  }
  bump(ema);
}

template <bool kSwap>
void ema_swap_autograd(c10::DispatchKeySet ks, at::TensorList ema, at::TensorList model) {
  const char* name = kSwap ? "ema_swap_" : "ema_unswap_";
  check_devices(name, ema, model);
  check_writable(name, "ema", ema);
  check_writable(name, "model", model);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(kSwap ? "shardkit::ema_swap_" : "shardkit::ema_unswap_", "")
                       .typed<void(at::TensorList, at::TensorList)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatch(ks & c10::after_ADInplaceOrView_keyset, ema, model);
  }
  bump(ema);
  bump(model);
}

}  // namespace

TORCH_LIBRARY_IMPL(shardkit, Autograd, m) {
  m.impl("ema_update_", &ema_update_autograd);
  m.impl("ema_update_device_decay_", &ema_update_device_decay_autograd);
  m.impl("ema_update_stochastic_", &ema_update_stochastic_autograd);
  m.impl("ema_swap_", &ema_swap_autograd<true>);
  m.impl("ema_unswap_", &ema_swap_autograd<false>);
}
