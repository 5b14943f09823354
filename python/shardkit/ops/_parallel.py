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
from typing import Any, Sequence

import torch

__all__ = ["weighted_loss_reduce", "split_to_devices"]

DeviceLike = torch.device | str | int


def _device(d: DeviceLike) -> torch.device:
    """A torch.device with an explicit index for CUDA (an int means a CUDA index)."""
    if isinstance(d, torch.device) and (d.type != "cuda" or d.index is not None):
        return d  # already explicit (the per-step callers pass these)
    dev = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def check_weight(w: Any, what: str) -> None:
    """A loss weight is a tensor (its value is not read: no host sync) or a finite,
    non-negative real number (not a bool); ``what`` names it in the errors."""
    if isinstance(w, torch.Tensor):
        if w.numel() != 1:  # its shape is free to read (no host sync); the reduction needs one number
            raise ValueError(f"{what} must be a one-element tensor or a real number, got shape {tuple(w.shape)}")
        return
    if isinstance(w, bool) or not isinstance(w, numbers.Real):
        raise TypeError(f"{what} must be a one-element tensor or a real number, got {type(w).__name__} {w!r}")
    if not (math.isfinite(w) and float(w) >= 0):
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
        losses: K floating tensors of one shape (usually 0-dim), each on any device.
        weights: K weights: one-element tensors on any device (sample or valid-element
            counts computed on the loss's device need no host sync) or Python numbers
            (finite and non-negative; a tensor's value is not checked).
        output_device: where the result lives.
        normalize: divide by ``sum_k w_k``.

    Returns:
        Tensor of the losses' shape and promoted dtype on ``output_device``.
        Differentiable in ``losses``: loss k receives ``grad * w_k / sum w`` on its own
        device and dtype. Weights get no gradient.
    """
    if isinstance(weights, (str, bytes)) or not isinstance(weights, (Sequence, torch.Tensor)):
        raise TypeError(f"argument `weights` must be a list of K weights, got {type(weights).__name__} {weights!r}")
    for k, w in enumerate(weights):
        check_weight(w, f"argument `weights` (index {k})")
    # Python numbers as float64: a float32 tensor would round them (0.1, counts > 2^24)
    # before the reduction of float64 losses.
    ws = [w if isinstance(w, torch.Tensor) else torch.tensor(float(w), dtype=torch.float64) for w in weights]
    return torch.ops.shardkit.weighted_loss_reduce(list(losses), ws, _device(output_device), normalize)


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
        tensors: N tensors (any dtypes, any one source device each) whose size along
            ``dim`` equals ``sum(split_sizes)``.
        split_sizes: K non-negative ints.
        devices: K devices (repeats allowed, e.g. ``["cpu"] * 3``).
        dim: the dimension to split.

    Returns:
        ``pieces[k][i]``: piece k of ``tensors[i]`` on ``devices[k]``, a fresh contiguous
        tensor of size ``split_sizes[k]`` along ``dim``. Differentiable: the gradient of
        ``tensors[i]`` is the pieces' gradients concatenated back on its device.
    """
    devs = [_device(d) for d in devices]
    flat = torch.ops.shardkit.split_to_devices(list(tensors), [int(s) for s in split_sizes], dim, devs)
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
