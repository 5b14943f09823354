"""The ema op family: the fused in-place EMA update and the swap/unswap pair used by
``ModelEMA.swap``. The kernels live in csrc/cpu/ema_cpu.cpp and csrc/cuda/ema_cuda.cu;
this module adds the fake (meta) kernels so ``torch.compile`` traces the ops, and the
Python entry points with their argument checks.
"""

import numbers
from typing import Any, Iterable, List, Sequence, Tuple

import torch

from shardkit import _C

__all__ = ["ema_update_", "ema_update_device_decay_", "ema_swap_", "ema_unswap_", "swap_pairs_", "unswap_pairs_"]

# The dtypes the kernels average (csrc/ema_common.h, is_supported_float).
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _as_list(name: str, tensors: Any) -> list[Any]:
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"argument `{name}` must be a list or tuple of tensors, got a single Tensor")
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Iterable):  # None, an int
        raise TypeError(f"argument `{name}` must be a list or tuple of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"argument `{name}` must hold tensors, got {type(t).__name__} at index {i}")
    return tensors


def _check_dense(op: str, name: str, tensors: Sequence[torch.Tensor]) -> None:
    """Every tensor strided (not sparse, not nested): the kernels have no such backend, and the
    dispatcher's "Could not run ... from the 'SparseCPU' backend" named no tensor."""
    for i, t in enumerate(tensors):
        if t.layout != torch.strided or t.is_nested:
            layout = "nested" if t.is_nested else t.layout
            raise TypeError(f"{op}: `{name}[{i}]` must be a dense (strided) tensor, got layout {layout}")


def _check_written(op: str, name: str, tensors: Sequence[torch.Tensor]) -> None:
    """A tensor the op writes must be strided with memory of its own per element: an expanded
    (zero-stride) view gave torch's "more than one element of the written-to tensor refers to a
    single memory location" naming no tensor, where the kernels name ``ema[i]`` for overlaps
    between tensors. Shapes and strides only (host metadata, no sync)."""
    _check_dense(op, name, tensors)
    for i, t in enumerate(tensors):
        if not t.is_contiguous() and any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
            raise ValueError(
                f"{op}: `{name}[{i}]` overlaps itself: several of its elements are at one memory location (a zero "
                f"stride, e.g. a view made by expand()); the op writes it in place, so every element needs memory "
                f"of its own (clone the tensor first)"
            )


def _check_floating(op: str, ema_tensors: Sequence[torch.Tensor], model_tensors: Sequence[torch.Tensor]) -> None:
    # ema_update_'s dtype rule (its kernel's message), for the swap pair: an int64, complex or
    # float8 pair was exchanged without a word although no EMA of it can exist.
    for i, (e, m) in enumerate(zip(ema_tensors, model_tensors)):
        for name, t in (("ema", e), ("model", m)):
            if t.dtype not in _FLOATS:
                raise TypeError(
                    f"{op}: argument `{name}` must hold floating-point tensors (float32/float64/float16/bfloat16), "
                    f"got {t.dtype} at index {i}"
                )


def _paired_lists(ema_tensors, model_tensors):
    """Both arguments as lists of tensors of the same length (TypeError / ValueError naming them)."""
    ema_tensors = _as_list("ema_tensors", ema_tensors)
    model_tensors = _as_list("model_tensors", model_tensors)
    if len(ema_tensors) != len(model_tensors):
        raise ValueError(
            f"arguments `ema_tensors` and `model_tensors` must have the same length, "
            f"got {len(ema_tensors)} and {len(model_tensors)}"
        )
    return ema_tensors, model_tensors


def ema_update_(ema_tensors: Sequence[torch.Tensor], model_tensors: Sequence[torch.Tensor], decay: float) -> None:
    """In place, for every i: ``ema[i] <- ema[i] + (1 - decay) * (model[i] - ema[i])``.

    One pass over memory (read ema, read model, write ema) for all tensors together. On
    CUDA: one launch per (ema dtype, model dtype) pair over a device-side table of the
    tensors, built the first time a list of tensors is seen and cached (keyed by device,
    stream, dtypes and every address and size, so reallocated tensors are never
    mistaken); inside a CUDA-graph capture, or with the environment variable
    ``SHARDKIT_EMA_V1=1``, the first launcher (addresses in the kernel arguments, a launch
    per 96 tensors). On the CPU: one multi-threaded vectorized loop.

    Args:
        ema_tensors: list of N floating tensors (float32, float64, float16 or bfloat16),
            updated in place.
        model_tensors: list of N floating tensors, ``model_tensors[i].shape ==
            ema_tensors[i].shape``, on the same device as the EMA; the dtype may differ
            from the EMA's (e.g. a float32 EMA of a bfloat16 model).
        decay: float in [0, 1]; 0 copies the model, 1 leaves the EMA unchanged. The op
            takes a host scalar (the decay travels in the kernel's arguments); a tensor
            is read with ``float()``, which for a CUDA tensor waits for the device, so
            keep schedules on the host as ``ModelEMA`` does.

    Arithmetic is float32 (float64 when either side of a pair is float64), with one
    rounding to the EMA dtype at the store, in torch.lerp's two forms (``e + w (m - e)``
    for ``w = 1 - decay < 0.5``, else ``m - decay (m - e)``). Decay 1 keeps the EMA and decay
    0 copies the model exactly, before any arithmetic: also where ``m - e`` is infinite or
    NaN (a diverged EMA is reset by a copy). Contiguous pairs, and dense pairs with equal
    strides (e.g. both channels_last), are fused; other strided pairs are still updated
    correctly, through ATen temporaries (slower). Any number of tensors; empty lists are
    a no-op.

    In-place semantics are torch's (csrc/composite/ema_inplace.cpp): the version counter of
    every written tensor is bumped, so autograd detects a saved tensor modified by the op.

    Raises:
        TypeError: naming ``decay``: not a real number; naming the tensor list: not a list of
            tensors; naming ``ema[i]`` or ``model[i]``: a sparse (not strided) tensor.
        ValueError: naming ``decay``: outside [0, 1] (NaN included); naming ``ema[i]``: an
            EMA tensor with several elements at one address (an expanded view).
        RuntimeError: naming the argument: lengths, shapes or devices that do not match, a
            non-floating tensor, tensors on a device type other than CPU/CUDA (e.g. meta), a
            written tensor that requires grad while grad mode is on (torch's "a leaf Variable
            that requires grad is being used in an in-place operation"), memory shared by an
            EMA tensor and any other tensor of the call.
    """
    ema_tensors, model_tensors = _paired_lists(ema_tensors, model_tensors)
    if isinstance(decay, (bool, str)) or not isinstance(decay, (numbers.Real, torch.Tensor)):
        raise TypeError(f"argument `decay` must be a float in [0, 1], got {type(decay).__name__} {decay!r}")
    if isinstance(decay, torch.Tensor) and (decay.numel() != 1 or decay.is_complex() or decay.dtype == torch.bool):
        raise TypeError(f"argument `decay` must be a float in [0, 1] (or a one-element real tensor), got {decay!r}")
    try:
        decay = float(decay)
    except OverflowError:  # an int beyond the float range
        raise ValueError(f"argument `decay` must lie in [0, 1], got an int of {len(str(decay))} digits") from None
    if not 0.0 <= decay <= 1.0:  # also rejects NaN
        raise ValueError(f"argument `decay` must lie in [0, 1], got {decay}")
    _check_written("ema_update_", "ema", ema_tensors)
    _check_dense("ema_update_", "model", model_tensors)
    if not ema_tensors:
        return  # the dispatcher needs a tensor to pick a backend
    torch.ops.shardkit.ema_update_(ema_tensors, model_tensors, decay)


def ema_update_device_decay_(
    ema_tensors: Sequence[torch.Tensor], model_tensors: Sequence[torch.Tensor], decay: torch.Tensor
) -> None:
    """:func:`ema_update_` with the decay in a tensor that the kernel reads: a call captured in
    a CUDA graph then takes the tensor's value at each replay (``ModelEMA(cuda_graph=True)``).

    Args:
        ema_tensors, model_tensors: as for :func:`ema_update_`, except that on CUDA every pair
            must be contiguous or dense with equal strides (RuntimeError naming the pair).
        decay: one-element float64 tensor on the EMA's device, in [0, 1]. On the CPU it is
            read and checked like ``ema_update_``'s; on CUDA it is not checked (that would need
            the value on the host, a sync): keep it in range.

    The result is ``ema_update_``'s with ``decay.item()``, bit for bit (same arithmetic, decay
    1 keeps and decay 0 copies exactly). On CUDA the first launcher runs (a launch per 96
    tensors, the addresses in the kernel arguments, nothing cached), so the call can be
    captured; a replay does not bump the version counters (the capture did).
    """
    ema_tensors, model_tensors = _paired_lists(ema_tensors, model_tensors)
    if not isinstance(decay, torch.Tensor):
        raise TypeError(f"argument `decay` must be a one-element float64 tensor, got {type(decay).__name__}")
    if decay.layout != torch.strided or decay.is_nested:
        raise TypeError(f"argument `decay` must be a dense (strided) one-element float64 tensor, got {decay.layout}")
    _check_written("ema_update_device_decay_", "ema", ema_tensors)
    _check_dense("ema_update_device_decay_", "model", model_tensors)
    if ema_tensors:
        torch.ops.shardkit.ema_update_device_decay_(ema_tensors, model_tensors, decay)


def _swap_lists(
    op: str, ema_tensors: Sequence[torch.Tensor], model_tensors: Sequence[torch.Tensor], floating: bool
) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    ema_list, model_list = _paired_lists(ema_tensors, model_tensors)
    if floating:
        _check_floating(op, ema_list, model_list)
    _check_written(op, "ema", ema_list)  # the swap ops write both lists
    _check_written(op, "model", model_list)
    return ema_list, model_list


def ema_swap_(ema_tensors: Sequence[torch.Tensor], model_tensors: Sequence[torch.Tensor]) -> None:
    """Puts the EMA weights into the model in place; :func:`ema_unswap_` undoes it exactly.

    Per pair (same shape, same device): equal dtypes exchange contents; a float32 EMA of
    a bfloat16 model is *packed*: the model gets the EMA value rounded to bfloat16 (half
    up on the low 16 bits of the float32 pattern, i.e. ties away from zero), and the
    float32 EMA buffer keeps the model's 16 bits plus the EMA's low 16 bits. While
    swapped the EMA buffer holds no meaningful values and the model must not be written.
    Other dtype pairs raise (``ModelEMA.swap`` stashes those in host memory instead).
    Non-finite values: restore is bit-exact for every bit pattern; while swapped a NaN
    EMA value may show in the model as another NaN or a signed zero, and a value within
    half a bfloat16 ulp of its maximum as infinity. Both lists are written: the same
    in-place rules as :func:`ema_update_` apply to both (version bump, grad-mode refusal,
    no shared memory).

    Raises:
        TypeError: the dtypes :func:`ema_update_` refuses (integer, bool, complex, float8: no
            EMA of them exists), naming the list and the index; a sparse tensor, naming it.
        ValueError: naming ``ema[i]`` or ``model[i]``: a tensor with several elements at one
            address (an expanded view), which the exchange would write.
        RuntimeError: from the op, naming the tensors: shapes, devices, dtype pairs, overlaps.
    """
    ema_list, model_list = _swap_lists("ema_swap_", ema_tensors, model_tensors, floating=True)
    if ema_list:
        torch.ops.shardkit.ema_swap_(ema_list, model_list)


def ema_unswap_(ema_tensors: Sequence[torch.Tensor], model_tensors: Sequence[torch.Tensor]) -> None:
    """Inverse of :func:`ema_swap_` on the same lists: restores both bit-exactly.

    Args:
        ema_tensors, model_tensors: the two lists given to :func:`ema_swap_`, unchanged
            (floating tensors, pairwise of one shape and device; dtypes may differ).

    Raises ``TypeError`` / ``ValueError`` naming the argument, as :func:`ema_swap_`."""
    ema_list, model_list = _swap_lists("ema_unswap_", ema_tensors, model_tensors, floating=True)
    if ema_list:
        torch.ops.shardkit.ema_unswap_(ema_list, model_list)


def swap_pairs_(ema_tensors: Sequence[torch.Tensor], model_tensors: Sequence[torch.Tensor]) -> None:
    """``ModelEMA.swap``'s exchange: :func:`ema_swap_` without its dtype rule, because a
    model's integer buffers (BatchNorm's ``num_batches_tracked``) are exchanged with the EMA's
    copies too. Not exported: outside ModelEMA use ``shardkit.ops.ema_swap_``."""
    ema_list, model_list = _swap_lists("ema_swap_", ema_tensors, model_tensors, floating=False)
    if ema_list:
        torch.ops.shardkit.ema_swap_(ema_list, model_list)


def unswap_pairs_(ema_tensors: Sequence[torch.Tensor], model_tensors: Sequence[torch.Tensor]) -> None:
    """Inverse of :func:`swap_pairs_` (``ModelEMA.swap``'s restore)."""
    ema_list, model_list = _swap_lists("ema_unswap_", ema_tensors, model_tensors, floating=False)
    if ema_list:
        torch.ops.shardkit.ema_unswap_(ema_list, model_list)


# ModelEMA's per-update call (csrc/composite/ema_inplace.cpp): for every group g,
# ema_update_(ema_groups[g], model_groups[g], decay), then torch._foreach_copy_(copy_to,
# copy_from); arguments are Python lists of tensors (no IValue conversion) and nothing is kept
# after the call. Internal: ModelEMA gives it lists it built and checked.
update_lists = _C.ema_update_lists
# its four argument lists: (ema_groups, model_groups, copy_to, copy_from)
UpdateLists = Tuple[List[List[torch.Tensor]], List[List[torch.Tensor]], List[torch.Tensor], List[torch.Tensor]]
# What a CUDA graph capturing ema_update_lists' work bakes in (addresses, sizes, strides, dtypes
# of every tensor, as bytes), or None when a pair cannot be captured (not flat-compatible).
update_layout = _C.ema_layout


# Fake kernels: the ops mutate their inputs in place and return nothing, so the fake
# implementations only need to exist (shapes and dtypes do not change).
@torch.library.register_fake("shardkit::ema_update_")
def _ema_update_fake(ema, model, decay):
    return None


@torch.library.register_fake("shardkit::ema_update_device_decay_")
def _ema_update_device_decay_fake(ema, model, decay):
    return None


@torch.library.register_fake("shardkit::ema_update_stochastic_")
def _ema_update_stochastic_fake(ema, model, decay, seed, counter, salts):
    return None


@torch.library.register_fake("shardkit::ema_swap_")
def _ema_swap_fake(ema, model):
    return None


@torch.library.register_fake("shardkit::ema_unswap_")
def _ema_unswap_fake(ema, model):
    return None
