"""A frozen head (weight.requires_grad=False: a frozen lm_head under LoRA, linear probing):
the backward makes no [C, D] weight gradient and runs no dW GEMM, on every path (recompute,
kept logits, margins, mixed fp32 weights under autocast), and the embeddings' gradient is the
trainable head's."""

from __future__ import annotations

import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import shardkit

B, D, C = 48, 40, 3000
CASES = [
    dict(),
    dict(memory_budget="1GiB"),  # every chunk's logits kept
    dict(memory_budget=200_000),  # some kept, some recomputed
    dict(margin=shardkit.ArcFace(32.0, 0.3)),
    dict(margin=shardkit.CosFace(16.0, 0.2), label_smoothing=0.1),
]


def _grads(w, x, y, kwargs, device="cpu", autocast=None):
    x = x.detach().clone().requires_grad_(True)
    kw = dict(kwargs)
    margin = kw.pop("margin", None)
    with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
        loss = shardkit.sharded_cross_entropy(x, [w], y, margin=margin, chunk_memory=64 * 1024, **kw)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    peak = max(e.cpu_memory_usage for e in prof.events() if e.name.startswith("shardkit::ce_shard_stats_backward"))
    return x.grad, peak


@pytest.mark.parametrize("kwargs", CASES, ids=[str(k) for k in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_frozen_head_makes_no_weight_gradient(kwargs, dtype):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    w = (torch.randn(C, D, generator=g) * 0.1).to(dtype)
    x = torch.randn(B, D, generator=g).to(dtype)
    y = torch.randint(0, C, (B,), generator=g)
    gx_frozen, peak_frozen = _grads(w, x, y, kwargs)
    gx_train, peak_train = _grads(w.clone().requires_grad_(), x, y, kwargs)
    torch.testing.assert_close(gx_frozen, gx_train, rtol=0, atol=0)  # the same arithmetic for dX
    weight_bytes = C * D * w.element_size()
    assert peak_train >= weight_bytes
    assert peak_frozen < weight_bytes / 4, (peak_frozen, weight_bytes)


def test_a_frozen_fp32_head_under_bf16_autocast():
    torch.manual_seed(0)
    w = torch.randn(C, D) * 0.1
    x, y = torch.randn(B, D), torch.randint(0, C, (B,))
    gx_frozen, peak_frozen = _grads(w, x, y, {}, autocast=torch.bfloat16)
    gx_train, _ = _grads(w.clone().requires_grad_(), x, y, {}, autocast=torch.bfloat16)
    torch.testing.assert_close(gx_frozen, gx_train, rtol=0, atol=0)
    assert peak_frozen < C * D


def test_the_op_with_need_grad_w_false_returns_an_empty_weight_gradient():
    torch.manual_seed(1)
    x, w, y = (
        torch.randn(5, 8, dtype=torch.float64),
        torch.randn(30, 8, dtype=torch.float64),
        torch.randint(0, 30, (5,)),
    )
    lse, tgt, lsum, _ = shardkit.ops.ce_shard_stats(x, w, y, chunk_classes=7)
    grads = (torch.ones_like(lse), -torch.ones_like(tgt), torch.zeros_like(lsum))
    args = (*grads, x, w, y, lse, 0, 1.0, 1.0, 0.0, 0.0, False, 7)
    gx, gw = torch.ops.shardkit.ce_shard_stats_backward(*args)
    gx0, gw0 = torch.ops.shardkit.ce_shard_stats_backward(*args, False)
    assert torch.equal(gx0, gx) and gw0.shape == (0,) and gw.shape == (30, 8)
    torch.library.opcheck(torch.ops.shardkit.ce_shard_stats_backward.default, (*args, False))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_frozen_head_on_the_gpu_makes_no_weight_gradient(dtype):
    torch.manual_seed(2)
    c, d, b = 200_000, 512, 256
    w = (torch.randn(c, d, device="cuda") * 0.05).to(dtype)
    x, y = torch.randn(b, d, device="cuda", dtype=dtype), torch.randint(0, c, (b,), device="cuda")
    grads, peaks = [], []
    for weight in (w, w.clone().requires_grad_()):
        xx = x.clone().requires_grad_()
        loss = shardkit.sharded_cross_entropy(xx, [weight], y)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        grads.append(xx.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    assert peaks[0] + c * d * w.element_size() // 2 < peaks[1], peaks
