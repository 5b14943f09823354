"""``--amp bf16`` on a CPU: convolutions whose weight gradient torch's bf16 kernel gets wrong
run in float32 instead.

torch's oneDNN bf16 convolution (seen with torch 2.11, oneDNN 3.10, kernel
``jit_bf16:avx512_core_bf16`` backward_weights, on x86 CPUs with AVX-512 bf16) leaves the
weight gradient of a kernel tap that sees only zero padding at every output position
unwritten: it holds whatever that memory held before. A 3x3, stride-2 convolution of a 1x1
feature map is one (the last stage of the tiny backbone at ``--image-size 16``). In a fresh
process that memory is zero and the gradient happens to be right; after other work it is
garbage, NaN included, and the step's weights become NaN ("training diverged") or silently
wrong. The true gradient of such a tap is exactly 0.

:func:`use_float32_where_bf16_fails` makes every ``nn.Conv2d`` of the backbone run in float32
under a CPU bf16 autocast when one of its taps sees only padding for the input at hand (these
are the network's smallest convolutions: a few pixels per map), and in bf16 otherwise. Same
parameters, buffers and state_dict keys.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


@functools.lru_cache(maxsize=1024)
def _padding_only_tap(size: int, kernel: int, stride: int, padding: int, dilation: int) -> bool:
    """Whether a tap of a 1-D convolution over ``size`` inputs (``padding`` zeros on each side)
    reads padding at every output position."""
    outputs = (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    return any(all(not 0 <= o * stride - padding + t * dilation < size for o in range(outputs)) for t in range(kernel))


def has_padding_only_tap(conv: nn.Conv2d, spatial: tuple[int, ...]) -> bool:
    """Whether ``conv`` applied to a map of ``spatial`` (H, W) has a kernel tap that sees only
    its zero padding."""
    if conv.padding_mode != "zeros":  # padded by copies of the input, then convolved without padding
        return False
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return False
        pads = tuple(d * (k - 1) // 2 for k, d in zip(conv.kernel_size, conv.dilation))  # "same": stride 1
    else:
        pads = conv.padding
    return any(
        _padding_only_tap(int(n), k, s, p, d)
        for n, k, s, p, d in zip(spatial, conv.kernel_size, conv.stride, pads, conv.dilation)
    )


class Float32WhereBf16FailsConv2d(nn.Conv2d):
    """``nn.Conv2d`` that leaves a CPU bf16 autocast for inputs where a tap sees only padding
    (see the module notes); the output is then float32."""

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (
            input.device.type == "cpu"
            and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16
            and has_padding_only_tap(self, tuple(input.shape[-2:]))
        ):
            with torch.autocast("cpu", enabled=False):
                bias = None if bias is None else bias.float()
                return super()._conv_forward(input.float(), weight.float(), bias)
        return super()._conv_forward(input, weight, bias)


def use_float32_where_bf16_fails(model: nn.Module) -> nn.Module:
    """Turns every plain ``nn.Conv2d`` of ``model`` into :class:`Float32WhereBf16FailsConv2d`
    in place (the same objects, parameters and buffers); returns ``model``."""
    for module in model.modules():
        if type(module) is nn.Conv2d:
            module.__class__ = Float32WhereBf16FailsConv2d
    return model
