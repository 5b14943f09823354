"""--amp bf16 on a CPU: torch's oneDNN bf16 convolution leaves the weight gradient of a kernel
tap that sees only zero padding unwritten (garbage: whatever freed memory held, NaN included),
so a run's step depended on what ran before it in the process. The trainer runs those
convolutions in float32 (shardkit.train.cpu_bf16): gradients are exact zeros there and the
same whatever freed memory holds."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardkit.train import cli, loop, setup
from shardkit.train.cpu_bf16 import Float32WhereBf16FailsConv2d, has_padding_only_tap, use_float32_where_bf16_fails

TINY = "--classes 16 --per-class 8 --image-size 16 --batch 32 --val-classes 4 --val-per-class 3 --dim 32".split()
TINY += ["--no-progress", "--ema", "0.9", "--ema-tau", "2", "--amp", "bf16", "--devices", "cpu"]


def _leave_nan_in_freed_memory():
    """What earlier work (a diverged run, a NaN test) leaves in the allocator's free lists."""
    for n in (1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 73728, 147456):
        garbage = torch.full((n,), float("nan"))
        del garbage
        garbage = torch.full((n,), float("nan"), dtype=torch.bfloat16)
        del garbage


@pytest.mark.parametrize(
    "spatial, kernel, stride, padding, want",
    [
        ((1, 1), 3, 2, 1, True),  # the tiny backbone's last stage at --image-size 16
        ((2, 2), 3, 3, 1, True),
        ((2, 2), 3, 2, 1, True),  # the first row and column of taps read padding only
        ((4, 4), 3, 2, 1, False),
        ((1, 1), 3, 1, 1, True),
        ((1, 1), 1, 2, 0, False),
        ((5, 5), 5, 1, "same", False),
        ((1, 1), 3, 1, "same", True),
        ((3, 3), 3, 1, "valid", False),
    ],
)
def test_padding_only_taps_are_found(spatial, kernel, stride, padding, want):
    conv = nn.Conv2d(4, 4, kernel, stride, padding)
    assert has_padding_only_tap(conv, spatial) is want
    assert has_padding_only_tap(nn.Conv2d(4, 4, kernel, stride, 1, padding_mode="reflect"), spatial) is False


@pytest.mark.parametrize(
    "c_in, c_out, size, kernel, stride, padding",
    [(64, 128, 1, 3, 2, 1), (16, 32, 2, 5, 3, 2), (128, 128, 1, 5, 1, 2), (32, 64, 1, 3, 3, 1)],
)
def test_convolutions_with_padding_only_taps_get_exact_gradients_under_bf16(c_in, c_out, size, kernel, stride, padding):
    conv = use_float32_where_bf16_fails(nn.Sequential(nn.Conv2d(c_in, c_out, kernel, stride, padding, bias=False)))[0]
    assert type(conv) is Float32WhereBf16FailsConv2d
    for _ in range(10):
        _leave_nan_in_freed_memory()
        conv.weight.grad = None
        x = torch.randn(8, c_in, size, size).bfloat16().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = conv(x)
        go = torch.randn(y.shape)
        y.backward(go)
        xr, wr = x.detach().double().requires_grad_(), conv.weight.detach().double().requires_grad_()
        F.conv2d(xr, wr, stride=stride, padding=padding).backward(go.double())
        assert torch.isfinite(conv.weight.grad).all() and torch.isfinite(x.grad).all()
        torch.testing.assert_close(conv.weight.grad.double(), wr.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-2, atol=1e-2)  # bf16 input gradient


def test_convolutions_without_padding_only_taps_stay_bf16():
    conv = use_float32_where_bf16_fails(nn.Sequential(nn.Conv2d(8, 8, 3, 1, 1)))[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert conv(torch.randn(2, 8, 6, 6)).dtype == torch.bfloat16
        assert conv(torch.randn(2, 8, 1, 1)).dtype == torch.float32
    assert conv(torch.randn(2, 8, 1, 1)).dtype == torch.float32  # no autocast: as nn.Conv2d


def test_a_bf16_cpu_step_is_the_same_whatever_freed_memory_holds(tmp_path):
    args = cli.parse(TINY + ["--steps", "1", "--out", str(tmp_path)])
    torch.manual_seed(0)
    parts = setup.build(args, loop.World())
    parts.backbone.train()
    grads = []
    for _ in range(4):
        _leave_nan_in_freed_memory()
        parts.backbone.zero_grad(set_to_none=True)
        loop._micro_step(parts, args, parts.batches.get(0, 4))  # the same batch, the same weights: the same gradients
        grads.append({n: p.grad.clone() for n, p in parts.backbone.named_parameters()})
    for name, g in grads[0].items():
        assert torch.isfinite(g).all(), name
        for other in grads[1:]:
            assert torch.equal(other[name], g), name
