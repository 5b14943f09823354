// The one TORCH_LIBRARY(shardkit, m): every operator schema of the project lives here.
// Backends register implementations in cpu/<family>_cpu.cpp and cuda/<family>_cuda.cu;
// Python adds fake kernels and autograd in python/shardkit/ops/.
//
// Each op family keeps its schemas in its own section below, so the families can
// evolve independently.

#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(shardkit, m) {
  // ---- ema: fused exponential moving average of model weights -------------------
  // ema[i] <- ema[i] + (1 - decay) * (model[i] - ema[i]), fp32 arithmetic, in place.
  // Floating-point pairs only; dtypes may differ between ema and model.
  m.def("ema_update_(Tensor(a!)[] ema, Tensor[] model, float decay) -> ()");
  // The same with the decay read from a one-element float64 tensor on the EMA's device, so a
  // CUDA graph that captured the call takes a new decay per replay (ModelEMA(cuda_graph=True)).
  m.def("ema_update_device_decay_(Tensor(a!)[] ema, Tensor[] model, Tensor decay) -> ()");
  // ema_update_ with its bfloat16 EMA tensors rounded stochastically (ema_common.h), the others
  // as ema_update_ rounds them; tensor i's random bits hash (seed, counter, salts[i], element),
  // the same on every backend.
  m.def(
      "ema_update_stochastic_(Tensor(a!)[] ema, Tensor[] model, float decay, int seed, int counter, int[] "
      "salts) "
      "-> ()");
  // ema.swap(model): same-dtype pairs exchange contents; a float32 EMA of a bfloat16
  // model packs (model <- bf16(ema), ema <- model bits | low ema bits). ema_unswap_
  // restores both bit-exactly (for same-dtype pairs it is the same exchange).
  m.def("ema_swap_(Tensor(a!)[] ema, Tensor(b!)[] model) -> ()");
  m.def("ema_unswap_(Tensor(a!)[] ema, Tensor(b!)[] model) -> ()");
  // ---- end ema ----

  // ---- sharded cross-entropy ----------------------------------------------------
  // Per-shard softmax statistics of the logits x @ w^T (or scale * cosine with margins),
  // computed chunk by chunk over the shard's classes so [B, C_k] is never materialized.
  // lse/target_logit/logit_sum: fp32 [B] (fp64 for fp64 inputs); greater_count: int64 [B].
  m.def(
      "ce_shard_stats(Tensor x, Tensor w, Tensor labels, Tensor? target_ref, int class_offset, "
      "float scale, float m1, float m2, float m3, bool normalize, int chunk_classes) "
      "-> (Tensor lse, Tensor target_logit, Tensor logit_sum, Tensor greater_count)");
  // Gradients of ce_shard_stats w.r.t. the raw x and w, recomputing each chunk's logits.
  // need_grad_w=False (a frozen w): no [C, D] grad_w is made and no dW GEMM runs; grad_w is
  // then an empty [0] tensor.
  m.def(
      "ce_shard_stats_backward(Tensor grad_lse, Tensor grad_target, Tensor grad_sum, Tensor x, "
      "Tensor w, Tensor labels, Tensor lse, int class_offset, float scale, float m1, float m2, "
      "float m3, bool normalize, int chunk_classes, bool need_grad_w=True) -> (Tensor grad_x, Tensor "
      "grad_w)");
  // The memory-budget pair: ce_shard_stats that also keeps the logits of keep_chunks of its
  // class chunks (spread evenly; all of them when keep_chunks reaches the chunk count) for
  // its backward, which recomputes only the others. kept_logits: [B * kept classes], on the CPU
  // the logits after scale and margin in the statistics' dtype, on CUDA the raw dots (x . w_j),
  // in x's dtype for bf16 / fp16 x, else the statistics' (csrc/cuda/sharded_ce_kept.cuh);
  // kept_target: [B] the raw target logit (cosine or x . w, statistics' dtype) of rows whose
  // target lies in a kept chunk. Same statistics and gradients as the pair above (on CUDA with
  // 16-bit x, within the 16-bit logits' rounding).
  m.def(
      "ce_shard_stats_keep(Tensor x, Tensor w, Tensor labels, Tensor? target_ref, int class_offset, "
      "float scale, float m1, float m2, float m3, bool normalize, int chunk_classes, int keep_chunks) "
      "-> (Tensor lse, Tensor target_logit, Tensor logit_sum, Tensor greater_count, Tensor kept_logits, "
      "Tensor kept_target)");
  m.def(
      "ce_shard_stats_backward_kept(Tensor grad_lse, Tensor grad_target, Tensor grad_sum, Tensor x, "
      "Tensor w, Tensor labels, Tensor lse, Tensor kept_logits, Tensor kept_target, int class_offset, "
      "float scale, float m1, float m2, float m3, bool normalize, int chunk_classes, int keep_chunks, "
      "bool need_grad_w=True) -> (Tensor grad_x, Tensor grad_w)");
  // ---- end sharded cross-entropy ----

  // ---- parallel -----------------------------------------------------------------
  // Device-generic (CompositeExplicitAutograd, csrc/composite/parallel.cpp); autograd and
  // fake kernels in python/shardkit/ops/_parallel.py.
  // sum_k weights[k] * losses[k] (/ sum_k weights[k] when normalize) on output_device;
  // losses: same shape, floating, any devices; weights: one-element tensors.
  m.def(
      "weighted_loss_reduce(Tensor[] losses, Tensor[] weights, Device output_device, bool normalize) -> "
      "Tensor");
  // Splits each tensor along dim by split_sizes and copies piece k to devices[k];
  // returns the pieces device-major (out[k * len(tensors) + i]), fresh and contiguous.
  m.def("split_to_devices(Tensor[] tensors, int[] split_sizes, int dim, Device[] devices) -> Tensor[]");
  // ---- end parallel ----

  // ---- distributed --------------------------------------------------------------
  // PartialFC sampling for one class shard: all positive classes of the (global) batch plus
  // uniform negatives, num_sample in all. Returns (index [num_sample] int64: sorted local
  // class ids kept, remapped_labels [B] int64: each row's position in index, -1 if its class
  // is not in this shard). Random, not differentiable.
  m.def(
      "partial_fc_sample(Tensor labels, int class_offset, int num_local, int num_sample, "
      "Generator? generator=None) -> (Tensor index, Tensor remapped_labels)");
  // ---- end distributed ----

  // ---- normalize ----------------------------------------------------------------
  // uint8 images -> normalized float images in one pass: out = (x / 255 - mean[c]) / std[c]
  // (mean/std in the 0-1 scale, as torchvision documents them). images: [N, H, W, C] or
  // [H, W, C] when channels_last_input, else [N, C, H, W] or [C, H, W]; any strides.
  // out: [N, C, H, W] (or [C, H, W]) of out_dtype (float32/float64/bfloat16/float16),
  // contiguous, or in torch.channels_last memory format when channels_last_output.
  m.def(
      "normalize_images(Tensor images, float[] mean, float[] std, bool channels_last_input, "
      "ScalarType out_dtype, bool channels_last_output) -> Tensor");
  // ---- end normalize ----
}

namespace shardkit {
namespace ema {
// csrc/composite/ema_lists.cpp: ModelEMA's per-update call (Python lists of tensors, no IValues).
PyObject* update_lists_py(PyObject* module, PyObject* const* args, Py_ssize_t nargs);
PyObject* layout_py(PyObject* module, PyObject* const* args, Py_ssize_t nargs);
}  // namespace ema
}  // namespace shardkit

namespace {

PyObject* cuda_built(PyObject*, PyObject*) {
#ifdef SHARDKIT_WITH_CUDA
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

PyMethodDef methods[] = {
    {"cuda_built", cuda_built, METH_NOARGS, "Whether the CUDA kernels were compiled into this build."},
    {"ema_update_lists",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(shardkit::ema::update_lists_py)),
     METH_FASTCALL,
     "ema_update_lists(ema_groups, model_groups, copy_to, copy_from, decay): ModelEMA's update, one "
     "shardkit::ema_update_ per group and a foreach copy; no reference is kept after the call."},
    {"ema_layout", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(shardkit::ema::layout_py)),
     METH_FASTCALL,
     "ema_layout(ema_groups, model_groups, copy_to, copy_from): the addresses, sizes, strides and dtypes "
     "of the tensors as bytes (what a captured update baked in), or None if a pair is not flat-compatible."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "shardkit's compiled operators; import shardkit to register them as torch.ops.shardkit.*",
    -1,
    methods,
};

}  // namespace

// Importing shardkit._C loads this shared library, which runs the static
// registrations above (TORCH_LIBRARY and every backend's TORCH_LIBRARY_IMPL).
extern "C" PyObject* PyInit__C(void) {
  return PyModule_Create(&module_def);
}
