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
  // ---- end ema ----

  // ---- sharded cross-entropy ----------------------------------------------------
  // ---- end sharded cross-entropy ----

  // ---- parallel -----------------------------------------------------------------
  // ---- end parallel ----

  // ---- normalize ----------------------------------------------------------------
  // uint8 images -> normalized float images in one pass: out = (x / 255 - mean[c]) / std[c]
  // (mean/std in the 0-1 scale, as torchvision documents them). images: [N, H, W, C] or
  // [H, W, C] when channels_last_input, else [N, C, H, W] or [C, H, W]; any strides.
  // out: [N, C, H, W] (or [C, H, W]) of out_dtype (float32/float64/bfloat16/float16),
  // contiguous, or in torch.channels_last memory format when channels_last_output.
  m.def("normalize_images(Tensor images, float[] mean, float[] std, bool channels_last_input, "
        "ScalarType out_dtype, bool channels_last_output) -> Tensor");
  // ---- end normalize ----
}

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
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_C",
    "shardkit's compiled operators; import shardkit to register them as torch.ops.shardkit.*", -1, methods,
};

}  // namespace

// Importing shardkit._C loads this shared library, which runs the static
// registrations above (TORCH_LIBRARY and every backend's TORCH_LIBRARY_IMPL).
extern "C" PyObject* PyInit__C(void) { return PyModule_Create(&module_def); }
