"""``shardkit.ops.normalize_images``: uint8 images to normalized float images in one pass.

The op (``torch.ops.shardkit.normalize_images``) has CPU and CUDA kernels; this module adds
its fake kernel (so ``torch.compile`` traces it) and the Python-friendly wrapper. It is not
differentiable: its input is uint8.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Any, Sequence

import torch

from shardkit.ops._args import too_large_for_float

__all__ = ["normalize_images"]

_LAYOUTS = ("NHWC", "NCHW")
_OUT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@torch.library.register_fake("shardkit::normalize_images")
def _normalize_images_fake(images, mean, std, channels_last_input, out_dtype, channels_last_output):
    torch._check(
        images.dtype == torch.uint8, lambda: f"normalize_images: argument `images` must be uint8, got {images.dtype}"
    )
    torch._check(
        images.dim() in (3, 4), lambda: f"normalize_images: argument `images` must be 4-D or 3-D, got {images.dim()}-D"
    )
    x4 = images.unsqueeze(0) if images.dim() == 3 else images
    if channels_last_input:
        n, h, w, c = x4.shape
    else:
        n, c, h, w = x4.shape
    fmt = torch.channels_last if channels_last_output else torch.contiguous_format
    out = torch.empty((n, c, h, w), dtype=out_dtype, device=x4.device, memory_format=fmt)
    return out.squeeze(0) if images.dim() == 3 else out


def _as_floats(name: str, values: Any) -> list[float]:
    if isinstance(values, torch.Tensor):
        if values.layout != torch.strided or values.is_nested or values.is_complex() or values.dtype == torch.bool:
            kind = "nested" if values.is_nested else values.layout if values.layout != torch.strided else values.dtype
            raise TypeError(f"argument `{name}` must be a dense real tensor (or a sequence of numbers), got {kind}")
        if values.device.type == "meta":
            raise ValueError(f"argument `{name}` is a meta tensor, which holds no values")
        values = values.detach().cpu().double().flatten().tolist()  # setup time, not the hot path
    # A string is a sequence too: "0.5" would be read character by character; a mapping's
    # iteration gives its keys (a dict {0.5: ...} was taken for its keys) and a set's has no order.
    if isinstance(values, (str, bytes, bytearray, Mapping, AbstractSet)) or not hasattr(values, "__iter__"):
        why = ""
        if isinstance(values, (Mapping, AbstractSet)):
            why = " (a mapping gives its keys, a set no order: give a list, tuple or tensor, one value per channel)"
        raise TypeError(f"argument `{name}` must be a sequence of numbers, got {type(values).__name__} {values!r}{why}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"argument `{name}` must hold numbers, got {type(v).__name__} {v!r} at index {i}")
        try:
            out.append(float(v))
        except OverflowError:
            raise ValueError(f"argument `{name}[{i}]` is {too_large_for_float(v)}") from None
    if not out:
        raise ValueError(f"argument `{name}` must hold one value per channel, got 0 values")
    return out


_FLOAT32_MAX = torch.finfo(torch.float32).max
_MAX_CHANNELS = 64  # the kernels' per-channel constants travel by value (csrc/normalize_common.h)


def _check_options(input_layout: object, dtype: object, memory_format: object) -> None:
    """The options of a normalize call (also checked by ``Normalize`` at construction)."""
    if input_layout not in _LAYOUTS:
        raise ValueError(f"argument `input_layout` must be 'NHWC' or 'NCHW', got {input_layout!r}")
    if memory_format not in (torch.contiguous_format, torch.channels_last):
        raise ValueError(
            f"argument `memory_format` must be torch.contiguous_format or torch.channels_last, got {memory_format}"
        )
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"argument `dtype` must be one of float32, float64, bfloat16, float16, got {dtype}")


def _check_mean_std(mean: list[float], std: list[float], dtype: torch.dtype = torch.float32) -> None:
    """The kernels compute ``x * (1 / (255 std)) - mean / std`` in float32 (float64 for a
    float64 output): the product (up to 255 / (255 std)) and the shift must be finite there
    (a denormal std such as 1e-45 passes
    ``std != 0`` but gives NaN), and the outputs, which lie between ``-mean / std`` and
    ``(1 - mean) / std``, must fit ``dtype`` (65504 for float16)."""
    if len(mean) != len(std):
        raise ValueError(f"arguments `mean` and `std` must have the same length, got {len(mean)} and {len(std)}")
    if len(mean) > _MAX_CHANNELS:
        raise ValueError(f"at most {_MAX_CHANNELS} channels are supported, got {len(mean)} values in `mean`")
    compute_max = _FLOAT32_MAX if dtype != torch.float64 else torch.finfo(torch.float64).max
    top = min(compute_max, torch.finfo(dtype).max)
    for c, (m, s) in enumerate(zip(mean, std)):
        if not math.isfinite(m):
            raise ValueError(f"argument `mean[{c}]` must be finite, got {m}")
        if not math.isfinite(s) or s == 0.0:
            raise ValueError(f"argument `std[{c}]` must be non-zero and finite, got {s}")
        scale = 1.0 / (255.0 * s)
        if not 255.0 * abs(scale) <= compute_max:  # the product x * scale, before the shift is added
            raise ValueError(
                f"argument `std[{c}]` = {s} is too close to zero: 255 / (255 std) is not finite in the "
                f"op's arithmetic; use |std| >= {1.0 / compute_max:.3g}"
            )
        shift = -m / s
        reach = max(abs(shift), abs(255.0 * scale + shift))
        if not reach <= top:
            raise ValueError(
                f"arguments `mean[{c}]` = {m} and `std[{c}]` = {s}: the normalized values reach {reach:.3g}, "
                f"beyond the range of {dtype} ({top:.5g}); check that mean and std are in the 0-1 scale"
            )


def normalize_images(
    images: torch.Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    *,
    input_layout: str = "NHWC",
    dtype: torch.dtype = torch.float32,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> torch.Tensor:
    """Converts uint8 images to normalized floating-point NCHW images in one pass.

    ``out[n, c, h, w] = (images[n, h, w, c] / 255 - mean[c]) / std[c]``, computed in fp32 (fp64
    for ``dtype=torch.float64``) as ``x * scale[c] + shift[c]`` (``scale = 1 / (255 std)``,
    ``shift = -mean / std``: a multiply, then an add), then converted to ``dtype``.

    Args:
        images: uint8 tensor on CPU or CUDA. ``input_layout="NHWC"``: ``[N, H, W, C]`` or a
            single image ``[H, W, C]``; ``"NCHW"``: ``[N, C, H, W]`` or ``[C, H, W]``. Any
            strides: a permuted view of dense memory (e.g. an HWC array permuted to CHW) is
            read in place; other non-contiguous inputs are copied once first.
        mean, std: ``C`` per-channel values in the **0-1 scale** (torchvision's convention,
            e.g. ``mean=(0.485, 0.456, 0.406)``, ``std=(0.229, 0.224, 0.225)``); for values
            in the 0-255 scale divide them by 255. ``std`` entries must be non-zero.
        input_layout: ``"NHWC"`` (channels last, what image decoders produce) or ``"NCHW"``.
        dtype: output dtype: float32, float64, bfloat16 or float16.
        memory_format: ``torch.contiguous_format`` (default) or ``torch.channels_last``; the
            output's logical shape is NCHW either way.

    Returns:
        ``[N, C, H, W]`` (``[C, H, W]`` for a single image) tensor of ``dtype`` on the
        input's device.

    Raises:
        ValueError: bad ``input_layout``/``memory_format``/``dtype``, mean/std lengths, no
            channels or more than 64, a zero or non-finite std, one so small (e.g. 1e-45) that
            1 / (255 std) is not finite in float32, or mean/std whose normalized values would
            not fit ``dtype``.
        TypeError: ``mean``/``std`` not a sequence (or real tensor) of numbers (e.g. a string,
            a dict or a set), a sparse ``images``.
        RuntimeError: from the op: images not uint8, wrong rank, channel count not matching
            ``len(mean)`` (the op repeats every check above for direct ``torch.ops`` callers).
    """
    _check_options(input_layout, dtype, memory_format)
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"argument `images` must be a torch.Tensor, got {type(images).__name__}")
    if images.is_nested or images.layout != torch.strided:
        raise TypeError(f"argument `images` must be a dense (strided) tensor, got layout {images.layout}")
    mean_l, std_l = _as_floats("mean", mean), _as_floats("std", std)
    if not torch.compiler.is_compiling():  # (values may be symbolic there; the op checks them too)
        _check_mean_std(mean_l, std_l, dtype)
    return torch.ops.shardkit.normalize_images(
        images, mean_l, std_l, input_layout == "NHWC", dtype, memory_format == torch.channels_last
    )
