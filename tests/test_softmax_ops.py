"""CPU tests of the per-shard ops shardkit::ce_shard_stats / ce_shard_stats_backward against
a float64 full-logit reference (tests/softmax_reference.py); the GPU ones are in
test_softmax_ops_gpu.py, the shared checks in tests/softmax_checks.py."""

import math

import pytest
import torch
import torch.nn.functional as F
from softmax_checks import (
    MARGINS,
    check_against_reference,
    check_large_scale,
    check_low_precision,
    check_plain_by_rows,
    kw,
    make_case,
    opcheck_samples,
    rel,
)

import shardkit
from shardkit.ops import ce_shard_stats, chunk_classes_for_budget


@pytest.mark.parametrize("name", list(MARGINS))
@pytest.mark.parametrize(
    "B,D,C,off,chunk",
    [(37, 29, 300, 50, 64), (8, 128, 1000, 0, None), (1, 3, 17, 0, 7), (6, 1, 40, 3, 1), (11, 5, 23, 2, 100)],
)
def test_matches_reference(name, B, D, C, off, chunk):
    x, w, labels = make_case(B, D, C, off)
    # D = 1 with an angular margin: every cosine is exactly +-1, at the clamp of acos, where
    # psi has infinite slope (psi' jumps from 0 to ~m1 sin(m2) / 4.5e-4): fp32 rounding of
    # x / |x| (cos = 1 - 1.2e-7 instead of 1) moves the target logit by up to ~1e-4 of
    # itself, and the exact gradients are 0 (the normalization projects everything out) but
    # rounding leaves ~psi' * eps of the rest. Tolerances 1e-3 there.
    _, m1, m2, _, _ = MARGINS[name]
    tol = 1e-3 if D == 1 and (m1, m2) != (1.0, 0.0) else 1e-5
    check_against_reference(x, w, labels, off, name, chunk, tol=tol)


@pytest.mark.parametrize("name", ["plain", "arcface"])
@pytest.mark.parametrize("C", [0, 1])
def test_tiny_shards(name, C):
    x, w, labels = make_case(5, 7, C, 4)
    check_against_reference(x, w, labels, 4, name, 3)


def test_labels_outside_shard_have_no_target():
    x, w, _ = make_case(9, 6, 20, 100)
    labels = torch.tensor([-100, 0, 99, 120, 121, 5000, 100, 119, 110])
    lse, t, s, _ = ce_shard_stats(x, w, labels, class_offset=100, chunk_classes=6, **kw("arcface"))
    inside = (labels >= 100) & (labels < 120)
    assert (t[~inside] == 0).all() and (t[inside] != 0).all()
    check_against_reference(x, w, labels, 100, "arcface", 6)


@pytest.mark.parametrize("name", ["arcface", "combined"])
def test_theta_plus_m2_past_pi(name):
    # Rows anti-parallel to their target's weight: theta ~ pi, so m1*theta + m2 > pi and psi
    # is on its linear continuation.
    B, D, C = 12, 16, 50
    w = torch.randn(C, D)
    labels = torch.randint(0, C, (B,))
    x = -w[labels] + 0.05 * torch.randn(B, D)
    c = torch.nn.functional.cosine_similarity(x.double(), w[labels].double())
    s, m1, m2, m3, _ = MARGINS[name]
    assert (m1 * torch.acos(c) + m2 > math.pi).all()
    check_against_reference(x, w, labels, 0, name, 16)


def test_noncontiguous_inputs():
    x = torch.randn(64, 40)[::2, ::2]  # [32, 20], strided
    w = torch.randn(20, 90).t()  # [90, 20], transposed
    labels = torch.randint(0, 90, (32,))
    assert not x.is_contiguous() and not w.is_contiguous()
    for name in ("plain", "combined"):
        check_against_reference(x, w, labels, 0, name, 17)


def test_chunking_does_not_change_results():
    x, w, labels = make_case(10, 12, 101, 0)
    outs = [ce_shard_stats(x, w, labels, chunk_classes=c, **kw("cosface")) for c in (1, 7, 50, 101, 1000)]
    for o in outs[1:]:
        for a, b in zip(o[:3], outs[0][:3]):
            assert rel(a, b) <= 1e-6


@pytest.mark.parametrize("chunk", [28, 1 << 22])
def test_float32_sums_over_millions_of_classes_keep_torchs_precision(chunk):
    # The running sums were float: over 2M classes in chunks of 28 (the CPU's default chunk at
    # B=8192) or in one chunk, lse was off by 2e-5 to 2e-4, 40-200x torch's own logsumexp.
    torch.manual_seed(8)
    B, D, C = 4, 8, 2_000_000
    x, w = torch.randn(B, D), torch.randn(C, D)
    w[:, 0] += 3.0  # logits of a positive mean, as a trained head's
    x[:, 0] = x[:, 0].abs() + 1
    y = torch.randint(0, C, (B,))
    lse, _, logit_sum, _ = ce_shard_stats(x, w, y, chunk_classes=chunk)
    z = x.double() @ w.double().t()
    torch_err = (torch.logsumexp(x @ w.t(), 1).double() - torch.logsumexp(z, 1)).abs().max()
    assert (lse.double() - torch.logsumexp(z, 1)).abs().max() <= 2 * torch_err + 1e-6
    assert ((logit_sum.double() - z.sum(1)).abs() / z.sum(1).abs()).max() <= 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["plain", "arcface"])
def test_low_precision_within_2x_torch_error(dtype, name):
    check_low_precision("cpu", dtype, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "name,shape,margin",
    [
        ("arcface", (300, 128, 5000), None),
        ("combined", (300, 128, 5000), None),
        ("cosface64", (260, 256, 4100), (64.0, 1.0, 0.0, 0.35, True)),
    ],
)
def test_low_precision_at_the_fused_tests_shapes(dtype, name, shape, margin):
    # The GPU fused tests' larger shapes with a normalized margin, where the softmax term is
    # 0.2-5% of a random mix of the statistics' gradients: each statistic's gradient checked alone
    # (a backward without the softmax term passed the mixed check here, in bf16).
    check_low_precision("cpu", dtype, name, margin=margin, chunk=1000, shape=shape)


def test_gradcheck_float64():
    B, D, C = 3, 4, 7
    for name in MARGINS:
        x = torch.randn(B, D, dtype=torch.float64, requires_grad=True)
        w = torch.randn(C, D, dtype=torch.float64, requires_grad=True)
        labels = torch.tensor([1, 9, 6])  # class_offset 2: rows 0 and 2 in the shard, row 1 not
        coef = torch.randn(3, B, dtype=torch.float64)

        def fn(x, w, off):
            lse, t, s, _ = ce_shard_stats(x, w, labels, class_offset=off, chunk_classes=3, **kw(name))
            return coef[0] * lse + coef[1] * t + coef[2] * s

        assert torch.autograd.gradcheck(lambda x, w: fn(x, w, 0), (x, w))
        assert torch.autograd.gradcheck(lambda x, w: fn(x, w, 2), (x, w))


def test_opcheck_forward():
    for x, w, labels, tref, *rest in opcheck_samples():
        for rg in (False, True):
            args = (x.clone().requires_grad_(rg), w.clone().requires_grad_(rg), labels, tref, *rest)
            torch.library.opcheck(torch.ops.shardkit.ce_shard_stats.default, args)


def test_opcheck_backward():
    for x, w, labels, tref, off, s, m1, m2, m3, norm, chunk in opcheck_samples():
        lse = torch.ops.shardkit.ce_shard_stats(x, w, labels, tref, off, s, m1, m2, m3, norm, chunk)[0]
        B = x.shape[0]
        grads = [torch.randn(B) for _ in range(3)]
        args = (*grads, x, w, labels, lse, off, s, m1, m2, m3, norm, chunk)
        torch.library.opcheck(torch.ops.shardkit.ce_shard_stats_backward.default, args)


def test_float64_outputs_and_target_ref_dtypes():
    x, w, labels = make_case(4, 3, 10, 0, dtype=torch.float64)
    out = ce_shard_stats(x, w, labels, target_ref=torch.zeros(4, dtype=torch.float64))
    assert out[0].dtype == torch.float64 and out[3].dtype == torch.int64


def test_errors_name_the_argument():
    # (Device mismatches are checked in test_cuda_device_errors: without a GPU the only other
    # device is "meta", which dispatches to the fake kernel instead.)
    x, w, labels = make_case(4, 8, 10, 0)
    op = torch.ops.shardkit.ce_shard_stats

    def bad(match, *, x=x, w=w, labels=labels, tref=None, off=0, s=1.0, m=(1.0, 0.0, 0.0), norm=False, chunk=4):
        with pytest.raises(RuntimeError, match=match):
            op(x, w, labels, tref, off, s, *m, norm, chunk)

    bad(r"argument `x` must be 2-D", x=x[0])
    bad(r"argument `x` must be float32, float64, float16 or bfloat16, got Long", x=x.long())
    bad(r"argument `w` must be 2-D", w=w[0])
    bad(r"argument `w` must have the dtype of `x`", w=w.double())
    bad(r"argument `w` has embedding dim 64 but `x` has 8", w=torch.randn(10, 64))
    bad(r"argument `labels` must have shape \[4\]", labels=labels[:3])
    bad(r"argument `labels` must be int64, got Int", labels=labels.int())
    bad(r"argument `class_offset` must be >= 0, got -1", off=-1)
    bad(r"argument `chunk_classes` must be >= 1, got 0", chunk=0)
    bad(r"argument `scale` must be finite", s=math.inf)
    bad(r"margins \(m1, m2, m3\) = \(1, 0.5, 0\) require normalize=True", m=(1.0, 0.5, 0.0))
    bad(r"argument `m1` must be a finite number > 0, got 0", m=(0.0, 0.0, 0.0), norm=True)
    bad(r"argument `target_ref` must have shape \[4\]", tref=torch.zeros(3))
    bad(r"argument `target_ref` must be float32 \(or float64\), got Half", tref=torch.zeros(4).half())
    lse = torch.zeros(4)
    back = torch.ops.shardkit.ce_shard_stats_backward
    with pytest.raises(RuntimeError, match=r"argument `grad_sum` must have shape \[4\]"):
        back(lse, lse, lse[:2], x, w, labels, lse, 0, 1.0, 1.0, 0.0, 0.0, False, 4)
    with pytest.raises(RuntimeError, match=r"argument `lse` must be floating point, got Long"):
        back(lse, lse, lse, x, w, labels, lse.long(), 0, 1.0, 1.0, 0.0, 0.0, False, 4)


def test_chunk_classes_for_budget():
    assert chunk_classes_for_budget(256, 64 << 20, embedding_dim=128) == (64 << 20) // (256 * 4 + 1024) // 64 * 64
    assert chunk_classes_for_budget(256, 1 << 20, embedding_dim=128, dtype=torch.bfloat16) % 64 == 0
    assert chunk_classes_for_budget(1 << 30, 1) == 1
    assert chunk_classes_for_budget(8, 1 << 20, num_classes=5) == 5
    with pytest.raises(ValueError, match="argument `budget_bytes` must be > 0"):
        chunk_classes_for_budget(8, 0)
    with pytest.raises(ValueError, match="argument `batch` must be >= 0"):
        chunk_classes_for_budget(-1)
    with pytest.raises(ValueError, match="argument `embedding_dim` must be >= 0"):
        chunk_classes_for_budget(8, embedding_dim=-2)


def test_compile_traces_the_op():
    x, w, labels = make_case(6, 5, 30, 0)
    fn = torch.compile(
        lambda x, w: ce_shard_stats(x, w, labels, chunk_classes=8, **kw("arcface"))[0].sum(),
        backend="aot_eager",
        fullgraph=True,
    )
    assert rel(fn(x, w), ce_shard_stats(x, w, labels, chunk_classes=8, **kw("arcface"))[0].sum()) <= 1e-6


def test_plain_reference_by_rows_matches_the_op():
    # The row-block reference of the large GPU test below, checked here against the op.
    x, w, _ = make_case(70, 6, 300, 0)
    labels = torch.randint(0, 300, (70,))
    check_plain_by_rows(x, w, labels, 0.7, 64)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_minus_inf_logits_add_nothing(device):
    # Logits that overflow to -inf in fp32 (x . w = -1e40) among finite ones: exp(-inf) adds 0
    # to the softmax sum. On the GPU each thread's first logits are -inf, so a fold starting
    # from max = -inf must not form exp(-inf - -inf) = NaN.
    B, C = 5, 1000
    x = torch.full((B, 1), 1e20)
    w = torch.randn(C, 1) * 1e-19  # logits around +-10
    w[:300] = -1e20
    labels = torch.randint(300, C, (B,))
    ref = torch.logsumexp(0.7 * (x.double() @ w.double().t()), 1)
    lse, t, _, _ = ce_shard_stats(x.to(device), w.to(device), labels.to(device), scale=0.7, chunk_classes=512)
    assert torch.isfinite(lse).all()
    assert rel(lse.cpu(), ref) <= 1e-5
    assert rel(t.cpu(), 0.7 * (x.double() * w.double()[labels]).sum(1)) <= 1e-5


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_of_minus_inf_logits_has_minus_inf_lse(device, dtype):
    # Row 0's logits all overflow to -inf: lse = log(0) = -inf (as for a shard without
    # classes), not NaN, on every device and whatever the chunk / thread split; the other
    # rows are unaffected.
    C = 50
    w = -1e20 * (1.0 + torch.rand(C, 1, dtype=torch.float64))
    x = torch.tensor([[1e300 if dtype == torch.float64 else 1e20], [1e-21], [-1e-20]], dtype=torch.float64)
    labels = torch.tensor([3, 17, C + 4])
    assert torch.isneginf(x[:1].to(dtype) @ w.to(dtype).t()).all()
    ref = torch.logsumexp(x[1:] @ w.t(), 1)
    for chunk in (1, 8, C):
        lse, t, s, _ = ce_shard_stats(x.to(device, dtype), w.to(device, dtype), labels.to(device), chunk_classes=chunk)
        assert lse.dtype == dtype
        assert torch.isneginf(lse[0]) and torch.isneginf(t[0]) and torch.isneginf(s[0])
        assert rel(lse[1:].cpu(), ref) <= 1e-5 and t[2] == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", ["plain", "arcface"])
def test_empty_batch(device, name):
    # B = 0 (the module refuses it, the op must not): [0] statistics, zero weight gradient.
    x = torch.randn(0, 6, device=device, requires_grad=True)
    w = torch.randn(11, 6, device=device, requires_grad=True)
    labels = torch.zeros(0, dtype=torch.long, device=device)
    lse, t, s, cnt = ce_shard_stats(x, w, labels, chunk_classes=4, **kw(name))
    assert lse.shape == t.shape == s.shape == cnt.shape == (0,) and lse.dtype == torch.float32
    gx, gw = torch.autograd.grad(lse.sum() + t.sum() + s.sum(), (x, w))
    assert gx.shape == (0, 6) and gw.shape == (11, 6) and (gw == 0).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_nan_logit_among_minus_inf_gives_nan(device):
    # A NaN logit (a NaN weight row) in a row whose other logits are all -inf: the max skips
    # NaN, and the NaN must still reach lse (never a silent -inf), whichever thread holds it.
    C = 300
    w = -1e20 * (1.0 + torch.rand(C, 1))
    w[C // 2 + 7] = math.nan
    x = torch.tensor([[1e20], [1e-21]])
    for chunk in (1, 64, C):
        lse = ce_shard_stats(x.to(device), w.to(device), torch.tensor([0, 1], device=device), chunk_classes=chunk)[0]
        assert torch.isnan(lse).all(), lse


# ---- second-order gradients: refused with a clear error, never a silent zero -------------


def _penalty_case():
    torch.manual_seed(0)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 7, (5,))
    return x, w, y


def test_double_backward_through_the_sharded_loss_raises():
    x, w, y = _penalty_case()
    # What a gradient penalty gets from torch's own loss: a non-zero second-order term.
    (gx_ref,) = torch.autograd.grad(F.cross_entropy(x @ w.T, y), x, create_graph=True)
    (gw_ref,) = torch.autograd.grad(gx_ref.pow(2).sum(), w)
    assert gw_ref.abs().max() > 0
    head = shardkit.ShardedSoftmaxLoss(4, 7, devices=["cpu"] * 2, dtype=torch.float64)
    shardkit.import_full_weight(head, w.detach())
    for loss in (
        shardkit.sharded_cross_entropy(x, [w[:3], w[3:]], y),
        head(x, y),
    ):
        with pytest.raises(RuntimeError, match=r"shardkit.ce_shard_stats does not support double backward \(create_gr"):
            torch.autograd.grad(loss, x, create_graph=True)
    # first-order gradients with create_graph=False still equal torch's
    (gx,) = torch.autograd.grad(shardkit.sharded_cross_entropy(x, [w[:3], w[3:]], y), x)
    torch.testing.assert_close(gx, gx_ref.detach())


def test_double_backward_of_the_op_raises_also_with_graph_only_through_the_weights():
    x, w, y = _penalty_case()
    lse, *_ = shardkit.ops.ce_shard_stats(x.detach(), w, y)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(lse.sum(), w, create_graph=True)


@pytest.mark.parametrize("scale", [1e3, 1e5, 1e7, 1e9, 1e11])
@pytest.mark.parametrize("m", [0.0, 0.2])
def test_large_scales_keep_the_gradient_of_the_rounded_logits(scale, m):
    check_large_scale(scale, m, "cpu")
