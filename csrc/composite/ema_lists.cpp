// ModelEMA's per-update entry point from Python: shardkit._C.ema_update_lists.
//
// One update of every device group of a ModelEMA and the copy of its integer buffers, from
// Python lists of tensors that ModelEMA builds once per set of model tensors and reuses.
// Calling torch.ops.shardkit.ema_update_ instead converts both lists into the op's arguments on
// every call (an IValue per tensor): tens of microseconds of host time for a few hundred
// tensors, more than the whole update takes on a GPU for a ResNet-50-sized model. Here a
// tensor costs a subtype check and a pointer read; the op itself runs as always (the Autograd
// kernel, the backend's checks and kernel, the version bumps).
//
// Nothing is kept between calls. A C++ object that held the model's tensors between updates,
// strongly or weakly, made torch.utils.swap_tensors refuse them (it requires the tensor's use
// and weak counts to be its own), e.g. `model.double()` under
// torch.__future__.set_swap_module_params_on_conversion(True). ModelEMA's lists hold the Python
// objects, which a swap keeps, so the next call reads the swapped-in tensors.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include "ema_common.h"

#include <string>
#include <vector>

namespace shardkit {
namespace ema {
namespace {

// Above this many EMA elements on the CPU the update runs without the GIL (other Python threads,
// e.g. a DataLoader's pin-memory thread, keep running through a long CPU update); the tensors are
// then owned for the call (a reference count increment each, ~45 ns per tensor measured, which is
// why a short update borrows them under the GIL instead). On CUDA the op only launches kernels.
constexpr int64_t kReleaseGilAbove = 1 << 20;

// Tensors borrowed from Python objects: no reference count change (that costs more than the rest
// of the unpacking); valid while the GIL is held, as the lists keep the objects alive.
struct Borrowed {
  std::vector<at::Tensor> tensors;
  Borrowed() { tensors.reserve(256); }
  Borrowed(const Borrowed&) = delete;
  Borrowed& operator=(const Borrowed&) = delete;
  ~Borrowed() {
    for (at::Tensor& t : tensors) c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
  }
};

// Appends the tensors of the Python list `list` (argument `arg`, group `group` or -1) to `out`.
void borrow_list(PyObject* list, const char* arg, Py_ssize_t group, Borrowed& out) {
  auto where = [&] { return std::string(arg) + (group >= 0 ? "[" + std::to_string(group) + "]" : ""); };
  TORCH_CHECK_TYPE(PyList_Check(list), "ema_update_lists: argument `", where(),
                   "` must be a list of tensors");
  const Py_ssize_t n = PyList_GET_SIZE(list);
  auto* tensor_type = reinterpret_cast<PyTypeObject*>(THPVariableClass);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(list, i);
    // A subtype check, not isinstance: what THPVariable_Unpack needs, without the metaclass
    // __instancecheck__ call that isinstance makes for a Parameter.
    TORCH_CHECK_TYPE(PyType_IsSubtype(Py_TYPE(item), tensor_type), "ema_update_lists: `", where(), "[", i,
                     "]` is a ", Py_TYPE(item)->tp_name, ", not a tensor");
    out.tensors.push_back(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(THPVariable_Unpack(item)));
  }
}

void run(const std::vector<at::Tensor>& ema, const std::vector<at::Tensor>& model,
         const std::vector<size_t>& ends, const std::vector<at::Tensor>& copy_to,
         const std::vector<at::Tensor>& copy_from, double decay) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("shardkit::ema_update_", "")
                       .typed<void(at::TensorList, at::TensorList, double)>();
  const at::TensorList all_ema(ema), all_model(model);
  size_t begin = 0;
  for (const size_t end : ends) {
    if (end > begin) op.call(all_ema.slice(begin, end - begin), all_model.slice(begin, end - begin), decay);
    begin = end;
  }
  if (!copy_to.empty()) at::_foreach_copy_(copy_to, copy_from);
}

// Borrows the four lists of ema_update_lists / ema_layout (`ends`: where each group ends).
void borrow_all(PyObject* const* args, Borrowed& ema, Borrowed& model, Borrowed& copy_to, Borrowed& copy_from,
                std::vector<size_t>& ends) {
  PyObject* ema_groups = args[0];
  PyObject* model_groups = args[1];
  TORCH_CHECK_TYPE(
      PyList_Check(ema_groups) && PyList_Check(model_groups),
      "ema_update_lists: arguments `ema_groups` and `model_groups` must be lists of lists of tensors");
  const Py_ssize_t n_groups = PyList_GET_SIZE(ema_groups);
  TORCH_CHECK(PyList_GET_SIZE(model_groups) == n_groups,
              "ema_update_lists: `ema_groups` and `model_groups` must hold the same number of groups, got ",
              n_groups, " and ", PyList_GET_SIZE(model_groups));
  for (Py_ssize_t g = 0; g < n_groups; ++g) {
    borrow_list(PyList_GET_ITEM(ema_groups, g), "ema_groups", g, ema);
    borrow_list(PyList_GET_ITEM(model_groups, g), "model_groups", g, model);
    TORCH_CHECK(ema.tensors.size() == model.tensors.size(), "ema_update_lists: `ema_groups[", g,
                "]` and `model_groups[", g, "]` must have the same length");
    ends.push_back(ema.tensors.size());
  }
  borrow_list(args[2], "copy_to", -1, copy_to);
  borrow_list(args[3], "copy_from", -1, copy_from);
  TORCH_CHECK(copy_to.tensors.size() == copy_from.tensors.size(),
              "ema_update_lists: `copy_to` and `copy_from` must have the same length, got ",
              copy_to.tensors.size(), " and ", copy_from.tensors.size());
}

}  // namespace

// ema_update_lists(ema_groups, model_groups, copy_to, copy_from, decay): for every group g,
// ema_update_(ema_groups[g], model_groups[g], decay); then copy_to[i].copy_(copy_from[i]).
PyObject* update_lists_py(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(
      nargs == 5,
      "ema_update_lists takes 5 arguments (ema_groups, model_groups, copy_to, copy_from, decay), "
      "got ",
      nargs);
  const double decay = PyFloat_AsDouble(args[4]);
  if (decay == -1.0 && PyErr_Occurred()) return nullptr;
  Borrowed ema, model, copy_to, copy_from;
  std::vector<size_t> ends;
  borrow_all(args, ema, model, copy_to, copy_from, ends);
  int64_t cpu_elements = 0;
  for (const at::Tensor& t : ema.tensors) cpu_elements += t.is_cpu() ? t.numel() : 0;
  if (cpu_elements <= kReleaseGilAbove) {
    run(ema.tensors, model.tensors, ends, copy_to.tensors, copy_from.tensors, decay);
  } else {
    // owned copies: the Python objects may go while the GIL is released
    const std::vector<at::Tensor> e(ema.tensors), m(model.tensors), to(copy_to.tensors),
        from(copy_from.tensors);
    pybind11::gil_scoped_release no_gil;
    run(e, m, ends, to, from, decay);
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

}  // namespace ema
}  // namespace shardkit

namespace shardkit {
namespace ema {

// ema_layout(ema_groups, model_groups, copy_to, copy_from) -> bytes or None: what a CUDA graph
// that captured the update of these lists baked in, for every tensor (address, element count,
// dtype, device, sizes and strides), packed as int64; None when a pair of a group is not
// flat-compatible (ema_update_device_decay_ refuses those). ModelEMA replays its graph only
// while the lists' layout equals the one captured: then the graph reads and writes exactly the
// memory of the tensors it is given now, whatever happened to the tensors in between.
PyObject* layout_py(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(
      nargs == 4, "ema_layout takes 4 arguments (ema_groups, model_groups, copy_to, copy_from), got ", nargs);
  Borrowed ema, model, copy_to, copy_from;
  std::vector<size_t> ends;
  borrow_all(args, ema, model, copy_to, copy_from, ends);
  for (size_t i = 0; i < ema.tensors.size(); ++i) {
    if (!flat_compatible(ema.tensors[i], model.tensors[i])) Py_RETURN_NONE;
  }
  std::vector<int64_t> words;
  words.reserve(8 * (2 * ema.tensors.size() + 2 * copy_to.tensors.size()) + ends.size() + 4);
  for (const size_t end : ends) words.push_back(static_cast<int64_t>(end));
  for (const Borrowed* list : {&ema, &model, &copy_to, &copy_from}) {
    words.push_back(-1);  // list separator
    for (const at::Tensor& t : list->tensors) {
      words.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr())));
      words.push_back(t.numel());
      words.push_back(static_cast<int64_t>(t.scalar_type()));
      words.push_back(static_cast<int64_t>(t.device().type()) * 1024 + t.device().index());
      words.push_back(t.dim());
      for (const int64_t size : t.sizes()) words.push_back(size);
      for (const int64_t stride : t.strides()) words.push_back(stride);
    }
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(words.data()),
                                   static_cast<Py_ssize_t>(words.size() * sizeof(int64_t)));
  END_HANDLE_TH_ERRORS
}

}  // namespace ema
}  // namespace shardkit
