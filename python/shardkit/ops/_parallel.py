"""Functional ops of ``shardkit.parallel``: the cross-device weighted loss reduction and the
coalesced split of tensors onto devices, with fake kernels and autograd.

Both ops are device-generic C++ (``csrc/composite/parallel.cpp``): they move data between
devices and do a few multiply-adds, which ATen does on every backend, and their inputs
span several devices at once. split_to_devices is CompositeImplicitAutograd (autograd,
FakeTensor and compile from ATen); weighted_loss_reduce has a C++ autograd node (no Python
formula runs per step) and its fake kernel here.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Iterable, Sequence

import torch

from shardkit.ops._args import bool_arg, int_arg
from shardkit.ops._devices import visible_gpus

__all__ = ["weighted_loss_reduce", "split_to_devices"]

DeviceLike = torch.device | str | int


def _cuda_count() -> int:
    # torch caches the count once CUDA is initialized (every step after the first): no driver
    # query per call on the hot path
    return torch.cuda.device_count() if torch.cuda.is_initialized() else visible_gpus()


def _device(d: DeviceLike, what: str) -> torch.device:
    """A torch.device with an explicit index for CUDA (an int means a CUDA index); ``what``
    names the argument in the errors: not a device (TypeError), a misspelled one or a CUDA
    device this process cannot see (ValueError, instead of the driver's message)."""
    if isinstance(d, torch.device):
        dev = d  # the per-step callers pass these
    elif isinstance(d, str):
        try:
            dev = torch.device(d)
        except RuntimeError:
            raise ValueError(f"{what} must name a device such as 'cpu' or 'cuda:0', got {d!r}") from None
    elif isinstance(d, numbers.Integral) and not isinstance(d, bool):
        index = operator.index(d)
        if index < 0:
            raise ValueError(f"{what} must be a CUDA index >= 0, got {index}")
        dev = torch.device("cuda", index)
    else:
        raise TypeError(
            f"{what} must be a torch.device, a string such as 'cuda:0' or a CUDA index, got {type(d).__name__} {d!r}"
        )
    if dev.type == "cuda":
        if not torch.compiler.is_compiling():  # (traced: the devices were checked when eager)
            count = _cuda_count()
            if count == 0:
                raise ValueError(f"{what} is {dev}, but no CUDA device is visible on this machine")
            if dev.index is not None and dev.index >= count:
                raise ValueError(f"{what} is {dev}, but only {count} CUDA device(s) are visible on this machine")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _tensor_list(name: str, tensors: Any) -> list[torch.Tensor]:
    """``tensors`` as a list of tensors: a single Tensor (iterated, it would be taken for a list
    of its rows), a string or a non-tensor entry is a TypeError naming ``name``."""
    if isinstance(tensors, (torch.Tensor, str, bytes)) or not isinstance(tensors, Iterable):
        raise TypeError(f"argument `{name}` must be a list of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"argument `{name}` (index {i}) must be a tensor, got {type(t).__name__} {t!r}")
        _check_dense(f"argument `{name}` (index {i})", t)
    return tensors


def _check_dense(what: str, t: torch.Tensor) -> None:
    # no sparse backend: the op's ATen calls gave "Could not run 'aten::as_strided' with arguments
    # from the 'SparseCPU' backend", naming no argument
    if t.layout != torch.strided or t.is_nested:
        raise TypeError(f"{what} must be a dense (strided) tensor, got layout {'nested' if t.is_nested else t.layout}")


def _sequence(name: str, values: Any) -> list[Any]:
    # a string would be read character by character ("22" as [2, 2], "cpu" as three devices)
    if isinstance(values, (torch.Tensor, str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"argument `{name}` must be a list, got {type(values).__name__} {values!r}")
    return list(values)


def _sizes(split_sizes: Any) -> list[Any]:  # ints (SymInts when traced)
    if isinstance(split_sizes, torch.Tensor) and split_sizes.dim() == 1 and not split_sizes.is_floating_point():
        _check_dense("argument `split_sizes`", split_sizes)  # a sparse one: "Cannot access data pointer"
        split_sizes = split_sizes.tolist()  # a 1-D integer tensor of sizes (a host read)
    sizes = _sequence("split_sizes", split_sizes)
    for k, s in enumerate(sizes):  # not int(): 1.9 was 1, "2" was 2 (negative sizes: the op's error)
        if type(s) is int or isinstance(s, torch.SymInt):
            continue  # the per-step case first: no ABC check
        integer_tensor = isinstance(s, torch.Tensor) and s.dim() == 0
        integer_tensor = integer_tensor and not (s.is_floating_point() or s.dtype == torch.bool)
        if isinstance(s, bool) or not (isinstance(s, numbers.Integral) or integer_tensor):
            raise TypeError(f"argument `split_sizes` (index {k}) must be an int, got {type(s).__name__} {s!r}")
        sizes[k] = operator.index(s)  # numpy ints, 0-dim integer tensors
    return sizes


def _refuse_meta(name: str, tensors: Sequence[torch.Tensor], purpose: str) -> None:
    # A meta tensor has a shape but no data: reduced or copied onto a real device it gave
    # uninitialized memory (weighted_loss_reduce) or torch's "Cannot copy out of meta tensor".
    for i, t in enumerate(tensors):
        if t.is_meta:
            raise ValueError(f"argument `{name}` (index {i}) is a meta tensor, which holds no data {purpose}")


def check_weight(w: Any, what: str) -> None:
    """A loss weight is a tensor (its value is not read: no host sync) or a finite,
    non-negative real number (not a bool); ``what`` names it in the errors."""
    if isinstance(w, torch.Tensor):
        _check_dense(what, w)
        if w.is_complex() or w.dtype == torch.bool:  # complex: "cannot be converted to type double"
            raise TypeError(f"{what} must be a real (not {w.dtype}) one-element tensor or a real number")
        if w.numel() != 1:  # its shape is free to read (no host sync); the reduction needs one number
            raise ValueError(f"{what} must be a one-element tensor or a real number, got shape {tuple(w.shape)}")
        return
    if isinstance(w, bool) or not isinstance(w, numbers.Real):
        raise TypeError(f"{what} must be a one-element tensor or a real number, got {type(w).__name__} {w!r}")
    try:
        value = float(w)
    except OverflowError:  # an int past float64 (10**400): OverflowError naming nothing (its digits not printed)
        kind = type(w).__name__
        article = "an" if kind[:1].lower() in "aeiou" else "a"
        raise ValueError(f"{what} must be finite, got {article} {kind} too large for a float") from None
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{what} must be finite and non-negative, got {w!r}")


def weighted_loss_reduce(
    losses: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor | float | int],
    output_device: DeviceLike,
    normalize: bool = True,
) -> torch.Tensor:
    """Weighted mean (or sum) of per-device losses, on one device.

    ``result = sum_k w_k * losses[k] / sum_k w_k`` (``normalize=True``), or
    ``sum_k w_k * losses[k]`` (``normalize=False``), computed on ``output_device``.

    Args:
        losses: K floating tensors of one shape (usually 0-dim), each on any device (not
            meta: a meta tensor has no value to reduce, ValueError naming it).
        weights: K weights: one-element tensors on any device (sample or valid-element
            counts computed on the loss's device need no host sync) or Python numbers
            (finite and non-negative; a tensor's value is not checked). With ``normalize``,
            Python numbers must not all be 0 (ValueError: the mean would be 0/0 = NaN); tensor
            weights are not read (that would be a host sync), so all-zero tensor weights give
            NaN, as a mean over no elements does on one device.
        output_device: where the result lives: a torch.device, a string or a CUDA index
            (ValueError naming it for a CUDA device this process cannot see).
        normalize: divide by ``sum_k w_k`` (a Python bool).

    Returns:
        Tensor of the losses' shape and promoted dtype on ``output_device``.
        Differentiable in ``losses``: loss k receives ``grad * w_k / sum w`` on its own
        device and dtype. Weights get no gradient.
    """
    if isinstance(weights, (str, bytes)) or not isinstance(weights, (Sequence, torch.Tensor)):
        raise TypeError(f"argument `weights` must be a list of K weights, got {type(weights).__name__} {weights!r}")
    losses = _tensor_list("losses", losses)
    normalize = bool_arg("normalize", normalize)
    for k, w in enumerate(weights):
        check_weight(w, f"argument `weights` (index {k})")
    device = _device(output_device, "argument `output_device`")
    if device.type != "meta":
        _refuse_meta("losses", losses, f"to reduce onto {device}")
        for k, w in enumerate(weights):
            if isinstance(w, torch.Tensor) and w.is_meta:
                raise ValueError(f"argument `weights` (index {k}) is a meta tensor, which holds no data to weigh by")
    if normalize and len(weights) > 0 and not any(isinstance(w, torch.Tensor) or w for w in weights):
        raise ValueError(
            f"argument `weights` sums to 0 ({list(weights)}): the normalized mean would be 0/0 = NaN; "
            "give at least one positive weight (or normalize=False for the weighted sum)"
        )
    # Python numbers as float64: a float32 tensor would round them (0.1, counts > 2^24)
    # before the reduction of float64 losses.
    ws = [w if isinstance(w, torch.Tensor) else torch.tensor(float(w), dtype=torch.float64) for w in weights]
    return torch.ops.shardkit.weighted_loss_reduce(losses, ws, device, normalize)


def split_to_devices(
    tensors: Sequence[torch.Tensor],
    split_sizes: Sequence[int],
    devices: Sequence[DeviceLike],
    dim: int = 0,
) -> list[list[torch.Tensor]]:
    """Splits several tensors by the same sizes and copies piece k of each to ``devices[k]``.

    One operator call for all tensors (inputs, targets and keyword tensors of a step):
    copies to GPUs are non-blocking (ordered on the destination's current stream).

    Args:
        tensors: N tensors (any dtypes, any one source device each, not meta unless every
            device is) whose size along ``dim`` equals ``sum(split_sizes)``.
        split_sizes: K non-negative ints (numpy ints too; not floats, strings or bools).
        devices: K devices (repeats allowed, e.g. ``["cpu"] * 3``): torch.devices, strings or
            CUDA indices (ValueError naming the entry for a CUDA device this process cannot see).
        dim: the dimension to split (an int, in range for every tensor).

    Returns:
        ``pieces[k][i]``: piece k of ``tensors[i]`` on ``devices[k]``, a fresh contiguous
        tensor of size ``split_sizes[k]`` along ``dim``. Differentiable: the gradient of
        ``tensors[i]`` is the pieces' gradients concatenated back on its device.
    """
    tensors = _tensor_list("tensors", tensors)
    sizes = _sizes(split_sizes)
    devs = [_device(d, f"argument `devices` (index {k})") for k, d in enumerate(_sequence("devices", devices))]
    dim = int_arg("dim", dim)
    for i, t in enumerate(tensors):
        if t.dim() > 0 and not -t.dim() <= dim < t.dim():
            raise ValueError(
                f"argument `dim` = {dim} is out of range for `tensors` (index {i}) of {t.dim()} dimensions "
                f"(expected in [{-t.dim()}, {t.dim() - 1}])"
            )
    real = [d for d in devs if d.type != "meta"]
    if real:
        _refuse_meta("tensors", tensors, f"to copy to {real[0]}")
    flat = torch.ops.shardkit.split_to_devices(tensors, sizes, dim, devs)
    n = len(tensors)
    return [flat[k * n : (k + 1) * n] for k in range(len(devs))]


@torch.library.register_fake("shardkit::weighted_loss_reduce")
def _weighted_loss_reduce_fake(losses, weights, output_device, normalize):
    torch._check(len(losses) > 0, lambda: "argument `losses` must hold at least one tensor")
    torch._check(len(weights) == len(losses), lambda: "argument `weights` must hold one weight per loss")
    dtype = losses[0].dtype
    for t in losses[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return losses[0].new_empty(losses[0].shape, dtype=dtype, device=output_device)
