"""ShardedSoftmaxLoss / sharded_cross_entropy numerics against the float64 full-logit
reference (tests/softmax_reference.py): margins, reductions, shards, smoothing, top-k, low
precision, autocast, gradcheck; then the same on the GPU (marked ``gpu``). Repeated "cpu"
devices exercise the multi-device path. Module API, checkpoints and errors:
test_softmax_api.py."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from softmax_checks import LOSS_MARGINS as MARGINS
from softmax_checks import assert_matches_reference, check_module_low_precision, grads_of, make_labels, rel
from softmax_reference import (
    margin_kwargs,
    reference_correct,
    reference_loss,
    reference_loss_and_grads,
    reference_lse,
    split_rows,
)
from torch.utils.checkpoint import checkpoint

import shardkit


@pytest.mark.parametrize("margin_name", list(MARGINS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("num_shards", [1, 2, 5])
def test_matches_reference(margin_name, reduction, num_shards):
    margin = MARGINS[margin_name]
    batch, dim, classes = 13, 7, 61  # 61 classes: not divisible by 2 or 5
    loss_fn = shardkit.ShardedSoftmaxLoss(
        dim, classes, margin=margin, devices=["cpu"] * num_shards, reduction=reduction, label_smoothing=0.1
    )
    x = torch.randn(batch, dim)
    y = make_labels(batch, classes, ignore=(3,))
    assert_matches_reference(loss_fn, x, y, margin, reduction=reduction, label_smoothing=0.1)


@pytest.mark.parametrize("margin_name", list(MARGINS))
@pytest.mark.parametrize("shard_sizes", [[40, 0, 3, 18], [1, 60], [0.5, 0.3, 0.2]])
def test_uneven_shards_and_small_chunks(margin_name, shard_sizes):
    margin = MARGINS[margin_name]
    loss_fn = shardkit.ShardedSoftmaxLoss(
        5, 61, margin=margin, shard_sizes=shard_sizes, devices=["cpu"] * len(shard_sizes), chunk_memory=256
    )
    if all(isinstance(s, int) for s in shard_sizes):
        assert list(loss_fn.shard_sizes) == shard_sizes
    assert sum(loss_fn.shard_sizes) == 61 and loss_fn.class_offsets[0] == 0
    x = torch.randn(9, 5)
    assert_matches_reference(loss_fn, x, make_labels(9, 61), margin)


@pytest.mark.parametrize(
    "batch,dim,margin_name", [(1, 3, "arcface"), (1, 1, "plain"), (6, 1, "plain"), (11, 33, "cosface")]
)
def test_odd_sizes_and_noncontiguous(batch, dim, margin_name):
    margin = MARGINS[margin_name]
    loss_fn = shardkit.ShardedSoftmaxLoss(dim, 17, margin=margin, devices=["cpu"] * 3, label_smoothing=0.2)
    x = torch.randn(dim, batch).t()  # non-contiguous [batch, dim]
    y = make_labels(batch, 17)
    assert_matches_reference(loss_fn, x, y, margin, label_smoothing=0.2)


def test_smoothing_and_ignore_index_variants():
    weight = torch.randn(30, 6)
    x = torch.randn(10, 6)
    for eps, ignore in [(0.0, 29), (1.0, -100), (0.37, 29), (0.2, 1000)]:
        y = make_labels(10, 29)
        y[[0, 4]] = ignore
        loss = shardkit.sharded_cross_entropy(
            x, split_rows(weight, [11, 19]), y, label_smoothing=eps, ignore_index=ignore
        )
        assert rel(loss, reference_loss(x, weight, y, label_smoothing=eps, ignore_index=ignore)) <= 1e-5
    # An ignore_index that is a class id: those rows get no margin in lse either.
    margin = MARGINS["arcface"]
    y = make_labels(10, 30)
    y[y == 3] = 4
    y[[1, 6]] = 3
    out = shardkit.sharded_cross_entropy(
        x, split_rows(weight, [11, 19]), y, ignore_index=3, margin=margin, return_details=True
    )
    expected = reference_lse(x, weight, torch.where(y == 3, -1, y), **margin_kwargs(margin))
    assert rel(out.lse, expected) <= 1e-5 and int(out.num_valid) == 8
    assert rel(out.loss, reference_loss(x, weight, y, ignore_index=3, **margin_kwargs(margin))) <= 1e-5
    # Every row ignored: "mean" is NaN and "sum" is 0, as in F.cross_entropy.
    all_ignored = torch.full((4,), -100)
    assert torch.isnan(shardkit.sharded_cross_entropy(x[:4], [weight], all_ignored))
    assert shardkit.sharded_cross_entropy(x[:4], [weight], all_ignored, reduction="sum") == 0


def test_same_loss_whatever_the_shard_count():
    weight = torch.randn(47, 9)
    x, y = torch.randn(12, 9), make_labels(12, 47)
    losses = []
    for n in range(1, 6):
        loss_fn = shardkit.ShardedSoftmaxLoss(9, 47, margin=MARGINS["arcface"], devices=["cpu"] * n)
        loss_fn.load_state_dict({"weight": weight})
        losses.append(loss_fn(x, y))
    for loss in losses[1:]:
        assert rel(loss, losses[0]) <= 1e-6


def test_functional_form_with_permuted_offsets():
    weight = torch.randn(25, 4)
    x, y = torch.randn(8, 4), make_labels(8, 25)
    parts = split_rows(weight, [10, 7, 8])
    ours = shardkit.sharded_cross_entropy(
        x, [parts[2], parts[0], parts[1]], y, class_offsets=[17, 0, 10], margin=MARGINS["cosface"], reduction="none"
    )
    ref = reference_loss(x, weight, y, reduction="none", **margin_kwargs(MARGINS["cosface"]))
    assert rel(ours, ref) <= 1e-5
    with pytest.raises(ValueError, match="`class_offsets`.*must tile"):
        shardkit.sharded_cross_entropy(x, parts, y, class_offsets=[0, 9, 17])
    with pytest.raises(ValueError, match="`class_offsets` has 2 entries"):
        shardkit.sharded_cross_entropy(x, parts, y, class_offsets=[0, 10])


def test_lse_and_topk_match_reference():
    margin = MARGINS["combined"]
    loss_fn = shardkit.ShardedSoftmaxLoss(6, 40, margin=margin, devices=["cpu"] * 3, topk=(1, 2, 5))
    x, y = torch.randn(50, 6), make_labels(50, 40, ignore=(7, 8))
    out = loss_fn(x, y, return_details=True)
    full = loss_fn.full_weight()
    assert rel(out.lse, reference_lse(x, full, y, **margin_kwargs(margin))) <= 1e-5
    assert int(out.num_valid) == 48
    bounds = reference_correct(x, full, y, (1, 2, 5), **margin_kwargs(margin))
    assert sorted(out.correct) == [1, 2, 5]
    for k, (lo, hi) in bounds.items():
        assert lo <= int(out.correct[k]) <= hi
    # lse is differentiable (z-loss).
    (out.loss + 1e-2 * out.lse.pow(2).mean()).backward()
    assert all(p.grad is not None for p in loss_fn.weight_shards)
    plain = shardkit.sharded_cross_entropy(x, [full[:13], full[13:]], y, return_details=True, topk=3)
    bounds = reference_correct(x, full, y, (3,))
    assert bounds[3][0] <= int(plain.correct[3]) <= bounds[3][1]


@pytest.mark.parametrize("margin", [None, "arcface"])
def test_topk_in_float64_counts_no_class_above_its_own_target(margin):
    # The float64 threshold (target logit + 1e-9 of its bound) must be built in float64: made
    # in float32 it can fall below the target's own float64 logit, which then counts as a
    # class "above" the target. One class: every non-ignored row is top-1 by definition.
    mg = None if margin is None else shardkit.ArcFace(64.0, 0.5)
    for _ in range(20):
        head = shardkit.ShardedSoftmaxLoss(17, 1, margin=mg, dtype=torch.float64)
        x = torch.randn(9, 17, dtype=torch.float64)
        out = head(x, torch.zeros(9, dtype=torch.long), return_details=True, topk=(1,))
        assert int(out.correct[1]) == 9
    # Several classes: within the float64 reference's bracket.
    head = shardkit.ShardedSoftmaxLoss(6, 40, margin=mg, devices=["cpu"] * 3, dtype=torch.float64, topk=(1, 3))
    x, y = torch.randn(50, 6, dtype=torch.float64), make_labels(50, 40)
    out = head(x, y, return_details=True)
    for k, (lo, hi) in reference_correct(x, head.full_weight(), y, (1, 3), tol=1e-12, **margin_kwargs(mg)).items():
        assert lo <= int(out.correct[k]) <= hi


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topk_low_precision(dtype):
    # The target must never rank above itself, whatever rounding the kernels apply.
    margin = shardkit.CosFace(s=64.0, m=0.35)
    loss_fn = shardkit.ShardedSoftmaxLoss(32, 300, margin=margin, devices=["cpu"] * 2, dtype=dtype, topk=(1, 5))
    x = torch.randn(64, 32).to(dtype)
    y = make_labels(64, 300)
    with torch.no_grad():  # make about half the rows top-1 correct
        x[::2] = F.normalize(loss_fn.full_weight()[y[::2]].float(), dim=1).to(dtype) + 0.02 * x[::2]
    out = loss_fn(x, y, return_details=True)
    bounds = reference_correct(x, loss_fn.full_weight(), y, (1, 5), abs_tol=2 * 64 * 2.0**-8, **margin_kwargs(margin))
    for k, (lo, hi) in bounds.items():
        assert lo <= int(out.correct[k]) <= hi
    assert int(out.correct[1]) >= 32


def test_gradient_accumulation_equals_full_batch():
    loss_fn = shardkit.ShardedSoftmaxLoss(8, 33, margin=MARGINS["arcface"], devices=["cpu"] * 2)
    x, y = torch.randn(12, 8), make_labels(12, 33)
    loss_fn(x, y).backward()
    full_grads = [p.grad.clone() for p in loss_fn.weight_shards]
    loss_fn.zero_grad()
    for rows in (slice(0, 5), slice(5, 6), slice(6, 12)):  # uneven micro-batches
        n = rows.stop - rows.start
        (loss_fn(x[rows], y[rows]) * n / 12).backward()
    for p, g in zip(loss_fn.weight_shards, full_grads):
        assert rel(p.grad, g) <= 1e-5


def test_checkpointed_backbone():
    backbone = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    loss_fn = shardkit.ShardedSoftmaxLoss(8, 29, margin=MARGINS["cosface"], devices=["cpu"] * 2)
    inputs, y = torch.randn(6, 10), make_labels(6, 29)
    params = list(backbone.parameters()) + list(loss_fn.parameters())
    plain = torch.autograd.grad(loss_fn(backbone(inputs), y), params)
    ckpt = torch.autograd.grad(loss_fn(checkpoint(backbone, inputs, use_reentrant=False), y), params)
    for a, b in zip(plain, ckpt):
        assert rel(b, a) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_2x_torch_error(dtype):
    batch, dim, classes = 64, 48, 300
    loss_fn = shardkit.ShardedSoftmaxLoss(dim, classes, devices=["cpu"] * 3, dtype=dtype, reduction="none")
    x, y = torch.randn(batch, dim).to(dtype), make_labels(batch, classes)
    weight = loss_fn.full_weight()
    g = torch.rand(batch)
    ref = reference_loss_and_grads(x, weight, y, g, reduction="none")
    xl, wl = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    t_loss = F.cross_entropy(F.linear(xl, wl).float(), y, reduction="none")
    t_gx, t_gw = torch.autograd.grad(t_loss, (xl, wl), g)
    loss, gx, gw, _ = grads_of(loss_fn, x, y, grad_out=g)
    assert gx.dtype == dtype and gw.dtype == dtype and loss.dtype == torch.float32
    assert rel(loss, ref.loss) <= 2 * rel(t_loss, ref.loss)
    assert rel(gx, ref.grad_x) <= 2 * rel(t_gx, ref.grad_x)
    assert rel(gw, ref.grad_w) <= 2 * rel(t_gw, ref.grad_w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("margin_name", ["plain", "arcface", "combined"])
@pytest.mark.parametrize("mixed", [False, True])
def test_cpu_module_loss_16bit_within_twice_torch(dtype, margin_name, mixed):
    # The module's own loss (label smoothing: the statistics weighted 1, -0.9, -0.1 / C) and its
    # gradients against float64, within 2x torch's own 16-bit error (a wrong softmax gradient
    # fails it), 16-bit weights or fp32 ones under autocast.
    check_module_low_precision("cpu", dtype, margin_name, shape=(48, 64, 777), mixed=mixed)


def test_float64_head_under_autocast_stays_float64():
    # torch's autocast never casts float64 (F.linear of float64 operands stays float64 under
    # it): a float64 head ran in bf16 there, with bf16's error in a float64 loss.
    torch.manual_seed(3)
    head = shardkit.ShardedSoftmaxLoss(
        24, 37, devices=["cpu"] * 2, dtype=torch.float64, margin=shardkit.ArcFace(s=16, m=0.3)
    )
    x = torch.randn(5, 24, dtype=torch.float64, requires_grad=True)
    y = make_labels(5, 37)
    eager = head(x, y)
    (gx,) = torch.autograd.grad(eager, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = head(x, y)
    (ax,) = torch.autograd.grad(auto, x)
    assert auto.dtype == torch.float64
    assert (auto - eager).abs().item() <= 1e-12 and (ax - gx).abs().max().item() <= 1e-12


def test_cpu_autocast_bf16():
    # Per-row losses (reduction="none"): a single scalar's rounding error is too noisy to
    # compare against torch's.
    batch, dim, classes = 32, 40, 200
    loss_fn = shardkit.ShardedSoftmaxLoss(dim, classes, devices=["cpu"] * 2, reduction="none")
    x, y = torch.randn(batch, dim), make_labels(batch, classes)
    g = torch.rand(batch)
    ref = reference_loss_and_grads(x, loss_fn.full_weight(), y, g, reduction="none")
    xr = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(xr, y)
        t_x = x.clone().requires_grad_(True)
        t_w = loss_fn.full_weight().requires_grad_(True)
        t_loss = F.cross_entropy(F.linear(t_x, t_w), y, reduction="none")
    assert loss.dtype == torch.float32
    gx, *gw = torch.autograd.grad(loss, [xr, *loss_fn.weight_shards], g)
    t_gx, t_gw = torch.autograd.grad(t_loss, (t_x, t_w), g)
    assert gw[0].dtype == torch.float32  # master weights keep their dtype
    assert rel(loss, ref.loss) <= 2 * rel(t_loss, ref.loss)
    assert rel(gx, ref.grad_x) <= 2 * rel(t_gx, ref.grad_x)
    assert rel(torch.cat(gw), ref.grad_w) <= 2 * rel(t_gw, ref.grad_w)


def test_arcface_past_pi_is_continuous_and_monotone():
    # Targets placed on both sides of theta = pi - m: the loss is a smooth, monotone
    # function of the target cosine (no jump at the threshold).
    margin = shardkit.ArcFace(s=4.0, m=0.5)
    weight = torch.randn(5, 2, dtype=torch.float32)
    weight[0] = torch.tensor([1.0, 0.0])
    angles = torch.linspace(math.pi - 0.9, math.pi - 0.1, 41)
    x = torch.stack([torch.cos(angles), torch.sin(angles)], dim=1)
    y = torch.zeros(41, dtype=torch.long)
    x_req = x.clone().requires_grad_(True)
    loss = shardkit.sharded_cross_entropy(x_req, [weight[:2], weight[2:]], y, margin=margin, reduction="none")
    ref = reference_loss(x, weight, y, reduction="none", **margin_kwargs(margin))
    assert rel(loss, ref) <= 1e-5
    (gx,) = torch.autograd.grad(loss.sum(), x_req)
    ref_gx = reference_loss_and_grads(x, weight, y, torch.ones(41), reduction="none", **margin_kwargs(margin)).grad_x
    assert rel(gx, ref_gx) <= 1e-5


def test_gradcheck_float64_full_module_path():
    for margin in (None, MARGINS["combined"]):
        loss_fn = shardkit.ShardedSoftmaxLoss(
            3, 7, margin=margin, devices=["cpu"] * 3, dtype=torch.float64, label_smoothing=0.2, chunk_memory=64
        )
        x, y = torch.randn(4, 3, dtype=torch.float64, requires_grad=True), make_labels(4, 7, ignore=(1,))

        def fn(x, *shards):
            return shardkit.sharded_cross_entropy(
                x, shards, y, margin=margin, label_smoothing=0.2, reduction="none", chunk_memory=64
            )

        assert torch.autograd.gradcheck(fn, (x, *loss_fn.weight_shards))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("margin_name", ["cosface", "arcface", "combined"])
def test_huge_finite_norms_normalize_like_small_ones(device, dtype, margin_name):
    # A float row of norm above ~1.8e19 overflowed its sum of squares to inf and was normalized
    # to a zero row: the loss of an all-zero embedding and a zero gradient, silently. The
    # cosine logits do not depend on the norms: the loss must not change, and the gradients
    # scale by 1 / norm. D = 128, a multiple of 64: the fused kernels where a GPU has them.
    torch.manual_seed(7)
    head = shardkit.ShardedSoftmaxLoss(128, 300, margin=MARGINS[margin_name], devices=[device, device]).to(dtype)
    x = torch.randn(9, 128, device=device).to(dtype)
    y = make_labels(9, 300).to(device)
    tol = 1e-5 if dtype == torch.float32 else 2e-2

    def run(sx, sw):
        xx = (x.double() * sx).to(dtype).requires_grad_()
        with torch.no_grad():
            for w in head.weight_shards:
                w.mul_(sw)
        head.zero_grad()
        loss = head(xx, y)
        loss.backward()
        grads = [xx.grad.double() * sx] + [w.grad.double() * sw for w in head.weight_shards]
        with torch.no_grad():
            for w in head.weight_shards:
                w.div_(sw)
        return loss.double(), grads

    base, base_grads = run(1.0, 1.0)
    for sx, sw in [(1e20, 1.0), (1.0, 1e25), (3e30, 3e30)]:
        loss, grads = run(sx, sw)
        assert rel(loss.cpu(), base.cpu()) <= tol, (sx, sw)
        for g, g0 in zip(grads, base_grads):
            assert rel(g.cpu(), g0.cpu()) <= 10 * tol, (sx, sw)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("margin_name", ["cosface", "arcface"])
def test_norms_beyond_the_float_range_normalize(device, dtype, margin_name):
    # Every element finite, the row's norm above the float's largest value (inf as a float):
    # the row was normalized to zeros (a wrong loss, zero gradients). The loss and the other
    # side's gradients equal those of the same rows scaled down by 2^100 (exact in floats); the
    # huge rows' own gradient is below 1 / 3.4e38, i.e. 0 in floats.
    torch.manual_seed(11)
    head = shardkit.ShardedSoftmaxLoss(64, 50, margin=MARGINS[margin_name], devices=[device]).to(dtype)
    y = make_labels(6, 50).to(device)
    x = torch.randn(6, 64, device=device).sign() * (2.0 + torch.rand(6, 64, device=device)) * 1e38
    x = x.to(dtype)
    assert torch.isfinite(x).all() and torch.isinf(x.float().norm(dim=1)).all()
    small = x * 2.0**-100
    losses, wgrads = [], []
    for inp in (x, small):
        xx = inp.clone().requires_grad_()
        head.zero_grad()
        loss = head(xx, y)
        loss.backward()
        losses.append(loss.double())
        wgrads.append(head.weight_shards[0].grad.double())
        if inp is x:
            assert torch.isfinite(xx.grad).all() and xx.grad.abs().max() <= 1e-30
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.isfinite(losses[0]) and rel(losses[0].cpu(), losses[1].cpu()) <= tol
    assert rel(wgrads[0].cpu(), wgrads[1].cpu()) <= 10 * tol


def _cuda_case(devices):
    margin = shardkit.ArcFace(s=32.0, m=0.5)
    loss_fn = shardkit.ShardedSoftmaxLoss(
        64, 3001, margin=margin, devices=devices, shard_sizes=None, label_smoothing=0.1
    )
    x = torch.randn(37, 64, device=devices[0])
    y = make_labels(37, 3001, ignore=(4,)).to(devices[0])
    loss, gx, gw, g = grads_of(loss_fn, x, y)
    assert loss.device == x.device and gx.device == x.device
    assert [p.device for p in loss_fn.weight_shards] == [torch.device(d) for d in devices]
    ref = reference_loss_and_grads(
        x.cpu(), loss_fn.full_weight("cpu"), y.cpu(), g.cpu(), label_smoothing=0.1, **margin_kwargs(margin)
    )
    tol = 1e-5  # fp32 (torch's default: no TF32), other summation orders than the CPU's
    assert rel(loss.cpu(), ref.loss) <= tol and rel(gx.cpu(), ref.grad_x) <= tol
    assert rel(gw.cpu(), ref.grad_w) <= tol


@pytest.mark.gpu
def test_cuda_one_device():
    _cuda_case(["cuda:0", "cuda:0"])


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs torch.cuda.device_count() >= 2 (shards on cuda:0 and cuda:1)"
)
def test_cuda_two_devices():
    _cuda_case(["cuda:0", "cuda:1"])


@pytest.mark.gpu
def test_cuda_autocast_bf16_module_moves_with_to():
    loss_fn = shardkit.ShardedSoftmaxLoss(
        64, 999, margin=shardkit.CosFace(), shard_sizes=[400, 599], reduction="none"
    ).cuda()
    assert [p.device.type for p in loss_fn.weight_shards] == ["cuda", "cuda"]
    x, y = torch.randn(48, 64, device="cuda"), make_labels(48, 999).cuda()
    kw = margin_kwargs(loss_fn.margin)
    w = loss_fn.full_weight("cuda")
    ref = reference_loss(x.cpu(), w.cpu(), y.cpu(), reduction="none", **kw)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_fn(x, y)
        # torch's own bf16 path: the cosine logits by F.linear under autocast.
        cos = F.linear(F.normalize(x, dim=1), F.normalize(w, dim=1))
    loss.sum().backward()
    assert loss.dtype == torch.float32 and all(p.grad.dtype == torch.float32 for p in loss_fn.weight_shards)
    m = loss_fn.margin  # CosFace: target logit s * (cos - m3)
    torch_own = F.cross_entropy(m.scale * (cos.float() - m.m3 * F.one_hot(y, 999)), y, reduction="none")
    assert rel(loss.cpu(), ref) <= 2 * rel(torch_own.cpu(), ref)
    # Top-k under bf16: rows built to be top-1 correct must count as such (the bracket from
    # the bf16-rounded inputs the kernels see, taken AFTER the rows are rebuilt).
    with torch.no_grad():
        x[::2] = F.normalize(w[y[::2]], dim=1) + 0.02 * x[::2]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = loss_fn(x, y, return_details=True, topk=(1, 5))
    x16, w16 = x.cpu().bfloat16(), w.cpu().bfloat16()
    bounds = reference_correct(x16, w16, y.cpu(), (1, 5), abs_tol=2 * 64 * 2.0**-8, **kw)
    for k, (lo, hi) in bounds.items():
        assert lo <= int(out.correct[k]) <= hi
    assert int(out.correct[1]) >= 24


@pytest.mark.gpu
def test_cuda_step_has_no_host_sync():
    # With check_inputs=False the forward and backward never wait for the GPU.
    loss_fn = shardkit.ShardedSoftmaxLoss(
        64, 5000, margin=shardkit.ArcFace(), devices=["cuda:0"] * 2, check_inputs=False
    ).cuda()
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    y = make_labels(32, 5000).cuda()
    loss_fn(x, y, return_details=True).loss.backward()  # warm-up (lazy inits may sync)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = loss_fn(x, y, return_details=True)
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert torch.isfinite(out.loss).item() and x.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_16bit_weights_scale_64(dtype):
    # 16-bit weights (no autocast) with CosFace at s = 64: the loss and both gradients within
    # 2x the error of torch's own computation at that dtype (normalize, GEMM, then fp32).
    margin = shardkit.CosFace(s=64.0, m=0.35)
    loss_fn = shardkit.ShardedSoftmaxLoss(
        48,
        700,
        margin=margin,
        devices=["cuda:0"] * 2,
        shard_sizes=[0.6, 0.4],
        dtype=dtype,
        reduction="none",
        chunk_memory="16KiB",
    )
    x, y = torch.randn(40, 48, device="cuda").to(dtype), make_labels(40, 700, ignore=(5,)).cuda()
    w = loss_fn.full_weight()
    g = torch.rand(40, device="cuda")
    ref = reference_loss_and_grads(x.cpu(), w.cpu(), y.cpu(), g.cpu(), reduction="none", **margin_kwargs(margin))
    xt, wt = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    cos = F.linear(F.normalize(xt, dim=1), F.normalize(wt, dim=1)).float()
    onehot = F.one_hot(torch.where(y < 0, 0, y), 700) * (y >= 0)[:, None]
    t_loss = F.cross_entropy(margin.scale * (cos - margin.m3 * onehot), y, reduction="none")
    t_gx, t_gw = torch.autograd.grad(t_loss, (xt, wt), g)
    loss, gx, gw, _ = grads_of(loss_fn, x, y, grad_out=g)
    assert gx.dtype == dtype and gw.dtype == dtype and torch.isfinite(gw).all() and torch.isfinite(gx).all()
    assert rel(loss.cpu(), ref.loss) <= 2 * rel(t_loss.cpu(), ref.loss)
    assert rel(gx.cpu(), ref.grad_x) <= 2 * rel(t_gx.cpu(), ref.grad_x)
    assert rel(gw.cpu(), ref.grad_w) <= 2 * rel(t_gw.cpu(), ref.grad_w)


@pytest.mark.gpu
def test_cuda_check_inputs_raise_named_errors():
    # check_inputs=True on CUDA: one sync, then the same ValueErrors as on the CPU.
    loss_fn = shardkit.ShardedSoftmaxLoss(4, 10, devices=["cuda:0"] * 2)
    x, y = torch.randn(5, 4, device="cuda"), make_labels(5, 10).cuda()
    bad_labels = y.clone()
    bad_labels[1] = 10
    with pytest.raises(ValueError, match=r"`labels` has class ids >= num_classes=10"):
        loss_fn(x, bad_labels)
    bad_x = x.clone()
    bad_x[3, 2] = math.nan
    with pytest.raises(ValueError, match=r"`embeddings` contains NaN or infinite values"):
        loss_fn(bad_x, y)
    with pytest.raises(ValueError, match=r"`labels` is on cpu but `embeddings` is on cuda:0"):
        loss_fn(x, y.cpu())
    assert torch.isfinite(loss_fn(x, y))


@pytest.mark.gpu
def test_cuda_async_check_asserts_on_the_device():
    # check_inputs="async" never syncs: a bad label surfaces later (at the next sync at the
    # latest) as a device-side assert, which ends the process's CUDA context: a child process.
    code = textwrap.dedent("""
        import torch, shardkit
        loss_fn = shardkit.ShardedSoftmaxLoss(4, 10, devices=["cuda:0"], check_inputs="async")
        loss = loss_fn(torch.randn(5, 4, device="cuda"), torch.tensor([0, 1, 10, 2, 3], device="cuda"))
        print("ENQUEUED", flush=True)
        torch.cuda.synchronize()
        print("NOT REACHED", flush=True)
    """)
    package_root = os.path.dirname(os.path.dirname(shardkit.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    # (The sticky CUDA error may already surface at a kernel launch after the assert ran,
    # before "ENQUEUED": only its kind is checked, and that no host-side check raised.)
    assert proc.returncode != 0 and "NOT REACHED" not in proc.stdout, (proc.stdout, proc.stderr[-2000:])
    assert "device-side assert" in proc.stderr and "ValueError" not in proc.stderr, proc.stderr[-2000:]


def test_default_check_is_the_async_assert_while_a_cuda_graph_is_captured(monkeypatch):
    # A host read cannot be captured into a CUDA graph (it failed the capture): while the
    # embeddings' stream is captured, check_inputs=True takes the asynchronous assert, as under
    # torch.compile. On the CPU the assert raises at once, a RuntimeError where the synchronous
    # check raises its ValueError naming the argument; the capture query is simulated here.
    from shardkit.softmax import checks

    loss_fn = shardkit.ShardedSoftmaxLoss(4, 10)
    x, bad = torch.randn(5, 4), torch.tensor([0, 1, 10, 2, 3])
    with pytest.raises(ValueError, match="`labels` has class ids >= num_classes=10"):
        loss_fn(x, bad)
    monkeypatch.setattr(checks, "_capturing", lambda t: True)
    with pytest.raises(RuntimeError, match="out of \\[0, num_classes\\)") as err:
        loss_fn(x, bad)
    assert not isinstance(err.value, ValueError)
    assert torch.isfinite(loss_fn(x, torch.tensor([0, 1, 9, 2, 3])))
