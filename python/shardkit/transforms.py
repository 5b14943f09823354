"""Device-side image transforms: keep images uint8 through the DataLoader and the host-to-
device copy (4x fewer bytes than float32) and convert them on the device in one pass."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from shardkit.ops._normalize import _as_floats, _check_mean_std, _check_options, normalize_images

__all__ = ["Normalize"]


class Normalize(nn.Module):
    """uint8 images in, normalized float NCHW images out, in one pass on the images' device.

    ``out[n, c, h, w] = (x[n, h, w, c] / 255 - mean[c]) / std[c]`` (see
    :func:`shardkit.ops.normalize_images`).

    Args:
        mean, std: ``C`` per-channel values in the 0-1 scale (e.g. ImageNet's
            ``(0.485, 0.456, 0.406)`` / ``(0.229, 0.224, 0.225)``; ``(0.5,) * 3`` twice maps
            [0, 255] to [-1, 1], the usual face-recognition input range).
        input_layout: ``"NHWC"`` (default: ``[N, H, W, C]``, as decoded images and
            :func:`shardkit.train.data.collate_uint8` deliver them) or ``"NCHW"``; single images
            (3-D) are accepted too.
        dtype: output dtype (float32, bfloat16, float16 or float64). Under autocast keep
            float32 or pass the autocast dtype explicitly; the op does not consult autocast.
        memory_format: ``torch.contiguous_format`` or ``torch.channels_last`` (faster
            convolutions on recent GPUs).

    Shapes: input uint8 ``[N, H, W, C]`` (or as ``input_layout`` says) -> ``[N, C, H, W]`` of ``dtype``.

    Raises (at construction, naming the argument): ``TypeError`` for ``mean`` / ``std`` that are
    not sequences of numbers; ``ValueError`` for lengths that differ, a zero or non-finite
    ``std``, values whose output would not fit ``dtype``, or a bad ``input_layout``, ``dtype``
    or ``memory_format`` (see :func:`shardkit.ops.normalize_images`).
    """

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        *,
        input_layout: str = "NHWC",
        dtype: torch.dtype = torch.float32,
        memory_format: torch.memory_format = torch.contiguous_format,
    ):
        super().__init__()
        _check_options(input_layout, dtype, memory_format)
        self.mean = _as_floats("mean", mean)
        self.std = _as_floats("std", std)
        _check_mean_std(self.mean, self.std, dtype)
        self.input_layout = input_layout
        self.dtype = dtype
        # a bool, not the torch.memory_format: torch.save (pickle protocol 2) cannot pickle those
        self._channels_last = memory_format == torch.channels_last

    @property
    def memory_format(self) -> torch.memory_format:
        """The output's memory format (``torch.contiguous_format`` or ``torch.channels_last``)."""
        return torch.channels_last if self._channels_last else torch.contiguous_format

    @memory_format.setter
    def memory_format(self, value: torch.memory_format) -> None:
        _check_options(self.input_layout, self.dtype, value)
        self._channels_last = value == torch.channels_last

    def __setstate__(self, state: dict) -> None:
        # a Normalize pickled before the format was kept as a bool held the torch.memory_format
        fmt = state.pop("memory_format", None)
        super().__setstate__(state)
        if fmt is not None:
            self._channels_last = fmt == torch.channels_last

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``images`` ([N, H, W, C] or as ``input_layout`` says; 3-D for one image) ->
        ``[N, C, H, W]`` (or ``[C, H, W]``) of ``dtype`` on the same device. Errors (naming
        ``images``): not uint8, wrong rank, C not len(mean); see :func:`shardkit.ops.normalize_images`."""
        return normalize_images(
            images,
            self.mean,
            self.std,
            input_layout=self.input_layout,
            dtype=self.dtype,
            memory_format=self.memory_format,
        )

    def extra_repr(self) -> str:
        return f"mean={self.mean}, std={self.std}, input_layout={self.input_layout!r}, dtype={self.dtype}"
