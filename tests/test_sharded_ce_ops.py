"""Tests of the per-shard ops shardkit::ce_shard_stats / ce_shard_stats_backward against a
float64 full-logit reference (tests/sce_reference.py)."""

import math

import pytest
import torch

import shardkit
from sce_reference import full_logits, margin_psi
from shardkit.ops import ce_shard_stats, chunk_classes_for_budget

# name -> (scale, m1, m2, m3, normalize)
MARGINS = {
    "plain": (0.7, 1.0, 0.0, 0.0, False),
    "cosine": (16.0, 1.0, 0.0, 0.0, True),
    "cosface": (30.0, 1.0, 0.0, 0.35, True),
    "arcface": (30.0, 1.0, 0.5, 0.0, True),
    "combined": (20.0, 1.1, 0.3, 0.2, True),
}


def rel(a, b, floor=1e-30):
    """||a - b|| / max(||b||, floor); the floor covers references that are exactly zero in
    theory (e.g. d/dx through the normalization when D == 1) and rounding noise in practice."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(floor)).item()


def kw(name):
    s, m1, m2, m3, norm = MARGINS[name]
    return dict(scale=s, m1=m1, m2=m2, m3=m3, normalize=norm)


def ref_stats(x, w, labels, class_offset, *, scale, m1, m2, m3, normalize):
    """float64 (lse, target, sum, plain logits) of one shard from its full logits."""
    local = labels - class_offset  # outside [0, C_k): no target in this shard (no margin)
    plain = full_logits(x, w, local, scale=scale, normalize=normalize, margin_on_target=False)
    C = w.shape[0]
    if C == 0:
        zero = torch.zeros(x.shape[0], dtype=torch.float64)
        return torch.full_like(zero, -math.inf), zero, zero, plain
    z = full_logits(x, w, local, scale=scale, m1=m1, m2=m2, m3=m3, normalize=normalize)
    inside = (local >= 0) & (local < C)
    tgt = torch.where(inside, z.gather(1, torch.where(inside, local, 0)[:, None])[:, 0], 0.0)
    return torch.logsumexp(z, 1), tgt, z.sum(1), plain


def count_bracket(plain, tref, tol=1e-4):
    band = tol * tref.double().abs().clamp_min(1.0)
    t = tref.double()[:, None]
    return (plain > t + band[:, None]).sum(1), (plain > t - band[:, None]).sum(1)


def make_case(B, D, C, class_offset, dtype=torch.float32, device="cpu", spread=None):
    x = torch.randn(B, D, dtype=dtype, device=device)
    w = torch.randn(C, D, dtype=dtype, device=device)
    if D == 1:  # normalization divides rounding noise by |x| (exact gradient 0): keep |x| away from 0
        x = x.sign() * (x.abs() + 0.5)
        w = w.sign() * (w.abs() + 0.5)
    spread = spread or (class_offset + C + 5)
    labels = torch.randint(0, spread, (B,), device=device)
    if C > 0 and B > 1:  # make sure some rows have their target in this shard
        labels[: B // 2] = class_offset + torch.randint(0, C, (B // 2,), device=device)
    return x, w, labels


def check_against_reference(x, w, labels, class_offset, name, chunk, tol=1e-5, grad_tol=None):
    k = kw(name)
    B = x.shape[0]
    xr = x.detach().double().cpu().requires_grad_()
    wr = w.detach().double().cpu().requires_grad_()
    r_lse, r_t, r_s, plain = ref_stats(xr, wr, labels.cpu(), class_offset, **k)
    tref = (r_t.detach() + 0.3 * torch.randn(B, dtype=torch.float64)).float()
    xx = x.detach().clone().requires_grad_()
    ww = w.detach().clone().requires_grad_()
    lse, t, s, cnt = ce_shard_stats(xx, ww, labels, class_offset=class_offset, chunk_classes=chunk,
                                    target_ref=tref.to(x.device), **k)
    assert lse.dtype == torch.float32 and cnt.dtype == torch.int64 and lse.shape == (B,)
    if w.shape[0] == 0:
        assert torch.isneginf(lse).all() and (t == 0).all() and (s == 0).all() and (cnt == 0).all()
    else:
        assert rel(lse.cpu(), r_lse) <= tol
        assert rel(t.cpu(), r_t) <= tol or r_t.abs().max() == 0 and (t == 0).all()
        assert rel(s.cpu(), r_s) <= max(tol, 1e-6 * r_s.abs().max().item() / r_s.norm().clamp_min(1e-30).item())
    lo, hi = count_bracket(plain.detach(), tref)
    assert ((cnt.cpu() >= lo) & (cnt.cpu() <= hi)).all()
    # Gradients of a random combination of the three differentiable outputs.
    g = [torch.randn(B, dtype=torch.float64) for _ in range(3)]
    loss = sum((o * gg.to(o.device, o.dtype)).sum() for o, gg in zip((lse, t, s), g) if torch.isfinite(o).all())
    if w.shape[0] == 0:
        gx, gw = torch.autograd.grad(loss + xx.sum() * 0 + ww.sum() * 0, (xx, ww))
        assert (gx == 0).all() and gw.shape == w.shape
        return
    gx, gw = torch.autograd.grad(loss, (xx, ww))
    r_loss = sum((o * gg).sum() for o, gg in zip((r_lse, r_t, r_s), g))
    rgx, rgw = torch.autograd.grad(r_loss, (xr, wr))
    assert gx.dtype == x.dtype and gw.dtype == w.dtype
    # Floor: the size of the logit gradients (scale * sqrt(B)). It only matters where the exact
    # gradient vanishes: with D == 1 and normalize, d/dx and d/dw are 0 in theory but fp32
    # rounding of x / |x| leaves ~1e-7 of the unprojected gradient.
    floor = k["scale"] * math.sqrt(B)
    assert rel(gx.cpu(), rgx, floor) <= (grad_tol or tol)
    assert rel(gw.cpu(), rgw, floor) <= (grad_tol or tol)


@pytest.mark.parametrize("name", list(MARGINS))
@pytest.mark.parametrize("B,D,C,off,chunk", [(37, 29, 300, 50, 64), (8, 128, 1000, 0, None), (1, 3, 17, 0, 7),
                                             (6, 1, 40, 3, 1), (11, 5, 23, 2, 100)])
def test_matches_reference(name, B, D, C, off, chunk):
    x, w, labels = make_case(B, D, C, off)
    check_against_reference(x, w, labels, off, name, chunk)


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["plain", "arcface"])
def test_low_precision_within_2x_torch_error(dtype, name):
    check_low_precision("cpu", dtype, name)


def torch_low_precision_stats(x, w, labels, scale, m1, m2, m3, normalize):
    """What plain torch computes at the inputs' dtype: GEMM (and normalization) in that dtype,
    the rest in float32 (as an fp32 loss would)."""
    if normalize:
        x = torch.nn.functional.normalize(x, dim=1)
        w = torch.nn.functional.normalize(w, dim=1)
    z = (x @ w.t()).float()
    if normalize:
        zt = z.gather(1, labels[:, None])
        z = z.scatter(1, labels[:, None], margin_psi(zt, m1, m2, m3))
    z = scale * z
    return torch.logsumexp(z, 1), z.gather(1, labels[:, None])[:, 0], z.sum(1)


def check_low_precision(device, dtype, name):
    k = kw(name)
    B, D, C = 33, 64, 257
    x32, w32, labels = make_case(B, D, C, 0)
    labels = torch.randint(0, C, (B,))
    x = x32.to(device, dtype).requires_grad_()
    w = w32.to(device, dtype).requires_grad_()
    g = [torch.randn(B, dtype=torch.float64) for _ in range(3)]
    xr = x.detach().double().cpu().requires_grad_()
    wr = w.detach().double().cpu().requires_grad_()
    ref = ref_stats(xr, wr, labels, 0, **k)[:3]
    rg = torch.autograd.grad(sum((o * gg).sum() for o, gg in zip(ref, g)), (xr, wr))
    xt = x.detach().clone().requires_grad_()
    wt = w.detach().clone().requires_grad_()
    tor = torch_low_precision_stats(xt, wt, labels.to(device), **k)
    tg = torch.autograd.grad(sum((o * gg.to(device).float()).sum() for o, gg in zip(tor, g)), (xt, wt))
    ours = ce_shard_stats(x, w, labels.to(device), chunk_classes=60, **k)[:3]
    og = torch.autograd.grad(sum((o * gg.to(device).float()).sum() for o, gg in zip(ours, g)), (x, w))
    assert og[0].dtype == dtype and og[1].dtype == dtype
    for a, b, r in zip(list(ours) + list(og), list(tor) + list(tg), list(ref) + list(rg)):
        err_ours, err_torch = rel(a.cpu(), r), rel(b.cpu(), r)
        assert err_ours <= 2 * err_torch + 1e-6, (err_ours, err_torch)


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


def _opcheck_samples():
    samples = []
    for name, (B, D, C, off, chunk) in [("plain", (5, 8, 13, 0, 4)), ("arcface", (4, 3, 9, 2, 100)),
                                        ("combined", (1, 5, 6, 0, 1)), ("cosface", (3, 2, 0, 0, 2))]:
        s, m1, m2, m3, norm = MARGINS[name]
        x, w, labels = make_case(B, D, C, off)
        tref = torch.randn(B) if name != "arcface" else None
        samples.append((x, w, labels, tref, off, s, m1, m2, m3, norm, chunk))
    return samples


def test_opcheck_forward():
    for x, w, labels, tref, *rest in _opcheck_samples():
        for rg in (False, True):
            args = (x.clone().requires_grad_(rg), w.clone().requires_grad_(rg), labels, tref, *rest)
            torch.library.opcheck(torch.ops.shardkit.ce_shard_stats.default, args)


def test_opcheck_backward():
    for x, w, labels, tref, off, s, m1, m2, m3, norm, chunk in _opcheck_samples():
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
    fn = torch.compile(lambda x, w: ce_shard_stats(x, w, labels, chunk_classes=8, **kw("arcface"))[0].sum(),
                       backend="aot_eager", fullgraph=True)
    assert rel(fn(x, w), ce_shard_stats(x, w, labels, chunk_classes=8, **kw("arcface"))[0].sum()) <= 1e-6


# ---- GPU (run on the device machine) ----------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MARGINS))
@pytest.mark.parametrize("B,D,C,off,chunk", [(37, 29, 300, 50, 64), (256, 128, 5000, 7, 1024), (1, 3, 17, 0, 7),
                                             (9, 5, 0, 0, 4), (5, 16, 1, 3, 1), (300, 64, 777, 0, None)])
def test_cuda_matches_reference(name, B, D, C, off, chunk):
    assert shardkit.cuda_built(), "this build has no CUDA kernels"
    x, w, labels = make_case(B, D, C, off, device="cuda")
    check_against_reference(x, w, labels, off, name, chunk)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["plain", "arcface", "combined"])
def test_cuda_low_precision(dtype, name):
    check_low_precision("cuda", dtype, name)


@pytest.mark.gpu
def test_cuda_theta_past_pi_and_noncontiguous():
    w = torch.randn(80, 33, device="cuda")[::2]  # [40, 33], strided rows
    labels = torch.randint(0, 40, (10,), device="cuda")
    x = (-w[labels] + 0.05 * torch.randn(10, 33, device="cuda"))
    check_against_reference(x, w, labels, 0, "arcface", 16)
    check_against_reference(x.t().contiguous().t(), w, labels, 0, "combined", 5)


@pytest.mark.gpu
def test_cuda_opcheck():
    for x, w, labels, tref, *rest in _opcheck_samples():
        args = (x.cuda().requires_grad_(), w.cuda().requires_grad_(), labels.cuda(),
                None if tref is None else tref.cuda(), *rest)
        torch.library.opcheck(torch.ops.shardkit.ce_shard_stats.default, args)


@pytest.mark.gpu
def test_cuda_device_errors():
    x, w, labels = make_case(4, 8, 10, 0, device="cuda")
    op = torch.ops.shardkit.ce_shard_stats
    with pytest.raises(RuntimeError, match=r"argument `w` must be on the device of `x`"):
        op(x, w.cpu(), labels, None, 0, 1.0, 1.0, 0.0, 0.0, False, 4)
    with pytest.raises(RuntimeError, match=r"argument `labels` must be on the device of `x`"):
        op(x, w, labels.cpu(), None, 0, 1.0, 1.0, 0.0, 0.0, False, 4)
    with pytest.raises(RuntimeError, match=r"argument `target_ref` must be on the device of `x`"):
        op(x, w, labels, torch.zeros(4), 0, 1.0, 1.0, 0.0, 0.0, False, 4)
    lse = torch.zeros(4, device="cuda")
    with pytest.raises(RuntimeError, match=r"argument `grad_lse` must be on the device of `x`"):
        torch.ops.shardkit.ce_shard_stats_backward(lse.cpu(), lse, lse, x, w, labels, lse, 0, 1.0, 1.0, 0.0, 0.0,
                                                    False, 4)


def plain_reference_by_rows(x, w, labels, scale, g, rows=64):
    """float64 (lse, target, sum) of the plain logits z = scale * x @ w.T (labels all inside
    the shard) and the gradients of sum(g[0] * lse + g[1] * target + g[2] * sum) w.r.t. x and
    w, in blocks of rows: for shards whose full float64 logit matrix would not fit in memory."""
    xd, wd = x.double(), w.double()
    B = x.shape[0]
    lse, tgt, zsum = (torch.empty(B, dtype=torch.float64, device=x.device) for _ in range(3))
    gx, gw = torch.empty_like(xd), torch.zeros_like(wd)
    for r0 in range(0, B, rows):
        r = slice(r0, min(B, r0 + rows))
        z = scale * (xd[r] @ wd.t())
        lse[r] = torch.logsumexp(z, 1)
        tgt[r] = z.gather(1, labels[r, None])[:, 0]
        zsum[r] = z.sum(1)
        dz = torch.exp(z - lse[r, None]).mul_(g[0][r, None]).add_(g[2][r, None])
        dz.scatter_add_(1, labels[r, None], g[1][r, None])
        gx[r] = scale * (dz @ wd)
        gw += scale * (dz.t() @ xd[r])
    return lse, tgt, zsum, gx, gw


def check_plain_by_rows(x, w, labels, scale, chunk):
    g = [torch.randn(x.shape[0], dtype=torch.float64, device=x.device) for _ in range(3)]
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    lse, t, s, _ = ce_shard_stats(xx, ww, labels, scale=scale, chunk_classes=chunk)
    gx, gw = torch.autograd.grad(sum((o * gg.to(o.dtype)).sum() for o, gg in zip((lse, t, s), g)), (xx, ww))
    r_lse, r_t, r_s, r_gx, r_gw = plain_reference_by_rows(x, w, labels, scale, g)
    assert rel(lse, r_lse) <= 1e-5 and rel(t, r_t) <= 1e-5
    # The sum of a row's logits cancels: bound its error by the sum of their magnitudes.
    r_abs = scale * (x.double().abs() @ w.double().abs().t().sum(1, keepdim=True))[:, 0]
    assert ((s.double() - r_s).abs() <= 1e-6 * r_abs).all()
    floor = scale * math.sqrt(x.shape[0])
    assert rel(gx, r_gx, floor) <= 1e-5 and rel(gw, r_gw, floor) <= 1e-5


def test_plain_reference_by_rows_matches_the_op():
    # The row-block reference of the large GPU test below, checked here against the op.
    x, w, _ = make_case(70, 6, 300, 0)
    labels = torch.randint(0, 300, (70,))
    check_plain_by_rows(x, w, labels, 0.7, 64)


@pytest.mark.gpu
def test_cuda_more_than_2_31_logits_in_one_chunk():
    # B * C_chunk > 2^31: element offsets into the chunk's logit / dlogit buffers (row i at
    # i * n) do not fit an int32. About 12 GB of GPU memory at peak (8.6 GB logit buffer).
    B, D, C = 2049, 8, (1 << 20) + 3
    assert B * C > 2**31
    x = torch.randn(B, D, device="cuda")
    w = torch.randn(C, D, device="cuda")
    labels = torch.randint(0, C, (B,), device="cuda")
    labels[-1] = C - 1  # the very last logit of the buffer is a target
    check_plain_by_rows(x, w, labels, 0.7, C)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (a shard on cuda:1 while cuda:0 is current)")
@pytest.mark.parametrize("name", ["plain", "arcface"])
def test_cuda_shard_on_non_current_device(name):
    x, w, labels = make_case(33, 24, 500, 7, device="cuda:1")
    with torch.cuda.device(0):
        check_against_reference(x, w, labels, 7, name, 64)


@pytest.mark.gpu
def test_cuda_side_stream_matches_default_stream():
    # Kernels, GEMMs and temporaries all on the caller's current stream.
    x, w, labels = make_case(64, 32, 3000, 0, device="cuda")
    ref = ce_shard_stats(x, w, labels, chunk_classes=256, **kw("arcface"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = ce_shard_stats(x, w, labels, chunk_classes=256, **kw("arcface"))
    torch.cuda.current_stream().wait_stream(side)
    for a, b in zip(out[:3], ref[:3]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[3], ref[3])


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
