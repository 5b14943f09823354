"""Checks shared by the sharded cross-entropy test files (CPU and GPU). For the per-shard op
shardkit::ce_shard_stats and its backward: test cases, the float64 comparison, the
low-precision comparison with torch's own error, and a row-block float64 reference for
shards too large to materialize. For the module: margins, labels, gradients and the
comparison with the float64 reference loss."""

import math

import torch
import torch.nn.functional as F
from softmax_reference import (
    full_logits,
    margin_kwargs,
    margin_psi,
    reference_grad_x_terms,
    reference_loss,
    reference_loss_and_grads,
)
from torch.utils._python_dispatch import TorchDispatchMode

import shardkit
from shardkit.ops import ce_shard_stats

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


def gradient_weights(B, C, eps=0.1):
    """{name: (g_lse, g_target, g_sum)}, float64 [B] each: the weights of the three statistics in
    the scalar whose gradients the checks compare. Each statistic alone (random per row, the
    others 0), and the module's own loss with label smoothing ``eps`` over the shard's C classes
    (1, -(1 - eps), -eps / C). One statistic at a time: the softmax term of the backward lives
    in the lse's gradient alone, and in a random mix of the three the logit sum's gradient (no
    softmax, the largest) hides it: a backward that drops the softmax term passed that."""
    zero = torch.zeros(B, dtype=torch.float64)
    return {
        "lse": (torch.randn(B, dtype=torch.float64), zero, zero),
        "target": (zero, torch.randn(B, dtype=torch.float64), zero),
        "sum": (zero, zero, torch.randn(B, dtype=torch.float64)),
        "loss": (torch.ones(B, dtype=torch.float64), torch.full((B,), eps - 1.0), torch.full((B,), -eps / max(C, 1))),
    }


def weighted(outputs, g):
    """sum_i of the finite outputs (lse, target, sum) [B] times their weights ``g`` (moved to the
    outputs' device and dtype)."""
    return sum((o * gg.to(o.device, o.dtype)).sum() for o, gg in zip(outputs, g) if torch.isfinite(o).all())


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


def check_against_reference(x, w, labels, class_offset, name, chunk, tol=1e-5, grad_tol=None, memory_budget=0):
    k = kw(name)
    B = x.shape[0]
    xr = x.detach().double().cpu().requires_grad_()
    wr = w.detach().double().cpu().requires_grad_()
    r_lse, r_t, r_s, plain = ref_stats(xr, wr, labels.cpu(), class_offset, **k)
    tref = (r_t.detach() + 0.3 * torch.randn(B, dtype=torch.float64)).float()
    xx = x.detach().clone().requires_grad_()
    ww = w.detach().clone().requires_grad_()
    lse, t, s, cnt = ce_shard_stats(
        xx,
        ww,
        labels,
        class_offset=class_offset,
        chunk_classes=chunk,
        target_ref=tref.to(x.device),
        memory_budget=memory_budget,
        **k,
    )
    stats_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    assert lse.dtype == stats_dtype and cnt.dtype == torch.int64 and lse.shape == (B,)
    if w.shape[0] == 0:
        assert torch.isneginf(lse).all() and (t == 0).all() and (s == 0).all() and (cnt == 0).all()
    else:
        assert rel(lse.cpu(), r_lse) <= tol
        # A target logit can cancel to ~0 too (CosFace: s (cos - m) with cos ~ m; one row makes
        # it the whole norm): there, bound the error by the magnitude of its parts.
        local = (labels.cpu() - class_offset).clamp(0, w.shape[0] - 1)
        if k["normalize"]:  # |s cos| <= s
            t_abs = k["scale"] * (1.0 + abs(k["m3"])) * torch.ones_like(r_t.detach())
        else:  # the parts of x . w_y are bounded by |x| |w_y|
            t_abs = xr.detach().norm(dim=1) * wr.detach()[local].norm(dim=1)
        assert (
            rel(t.cpu(), r_t) <= tol
            or r_t.abs().max() == 0
            and (t == 0).all()
            or ((t.cpu().double() - r_t.detach()).abs() <= min(tol, 1e-6) * t_abs).all()
        )
        # A row's logit sum can cancel to ~0 (D = 1: logits +-scale): where the relative error
        # does not hold, bound the error by the sum of the logits' magnitudes.
        r_abs = plain.detach().abs().sum(1) + r_t.detach().abs()
        assert rel(s.cpu(), r_s) <= tol or ((s.cpu().double() - r_s.detach()).abs() <= min(tol, 1e-6) * r_abs).all()
    lo, hi = count_bracket(plain.detach(), tref)
    assert ((cnt.cpu() >= lo) & (cnt.cpu() <= hi)).all()
    if w.shape[0] == 0:
        g = [torch.randn(B, dtype=torch.float64) for _ in range(3)]
        gx, gw = torch.autograd.grad(weighted((lse, t, s), g) + xx.sum() * 0 + ww.sum() * 0, (xx, ww))
        assert (gx == 0).all() and gw.shape == w.shape
        return
    # Floor: the size of the logit gradients (scale * sqrt(B)). It only matters where the exact
    # gradient vanishes: with D == 1 and normalize, d/dx and d/dw are 0 in theory but fp32
    # rounding of x / |x| leaves ~1e-7 of the unprojected gradient.
    floor = k["scale"] * math.sqrt(B)
    gtol = (grad_tol or tol) * _angular_amplification(plain.detach(), labels.cpu() - class_offset, x.shape[1], k)
    # The gradients of each statistic alone and of the module's loss (gradient_weights).
    for what, g in gradient_weights(B, w.shape[0]).items():
        gx, gw = torch.autograd.grad(weighted((lse, t, s), g), (xx, ww), retain_graph=True)
        rgx, rgw = torch.autograd.grad(weighted((r_lse, r_t, r_s), g), (xr, wr), retain_graph=True)
        assert gx.dtype == x.dtype and gw.dtype == w.dtype
        assert rel(gx.cpu(), rgx, floor) <= gtol, (what, "x", rel(gx.cpu(), rgx, floor))
        assert rel(gw.cpu(), rgw, floor) <= gtol, (what, "w", rel(gw.cpu(), rgw, floor))


def _angular_amplification(plain, local, dim, k):
    """How much an angular margin amplifies the inputs' rounding in the gradients: d psi / d cos
    = m1 sin(m1 theta + m2) / sin(theta) grows like 1 / sin(theta) for targets near theta = 0,
    so fp32 rounding of cos (~1e-7) costs ~1e-7 / sin(theta) there, in any implementation.
    1 for plain logits and CosFace; capped at 100; not for D = 1 (every theta is 0 or pi
    there, and those cases set their own tolerance)."""
    if not k["normalize"] or (k["m1"], k["m2"]) == (1.0, 0.0) or dim == 1:
        return 1.0
    inside = (local >= 0) & (local < plain.shape[1])
    if not inside.any():
        return 1.0
    cos = plain[inside].gather(1, local[inside][:, None])[:, 0] / k["scale"]
    sin = (1.0 - cos.double() ** 2).clamp_min(1e-4).sqrt()
    return float((1.0 / sin).max().clamp(1.0, 100.0))


def torch_low_precision_stats(x, w, labels, scale, m1, m2, m3, normalize, *, fp32_normalize=False):
    """What plain torch computes at the inputs' dtype: GEMM (and normalization) in that dtype,
    the rest in float32 (as an fp32 loss would). ``fp32_normalize``: normalize in float32 and
    round back, as under autocast (an fp16 normalization of a zero row is 0 / fp16(1e-12) = NaN)."""
    if normalize:

        def unit(t):
            return torch.nn.functional.normalize(t.float() if fp32_normalize else t, dim=1).to(t.dtype)

        x, w = unit(x), unit(w)
    z = (x @ w.t()).float()
    if normalize:
        zt = z.gather(1, labels[:, None])
        z = z.scatter(1, labels[:, None], margin_psi(zt, m1, m2, m3))
    z = scale * z
    return torch.logsumexp(z, 1), z.gather(1, labels[:, None])[:, 0], z.sum(1)


def check_low_precision(
    device,
    dtype,
    name,
    *,
    margin=None,
    noncontiguous=False,
    chunk=60,
    shape=(33, 64, 257),
    labels_below=None,
    memory_budget=0,
    near_target=None,
):
    """Ours vs the float64 reference within 2x the error of torch's own computation at
    ``dtype``, for the three outputs and both gradients. ``margin``: explicit
    (scale, m1, m2, m3, normalize) instead of ``MARGINS[name]``; ``noncontiguous``: a
    column-major ``x`` and a transposed ``w`` (strided weight reads in every kernel); ``shape``:
    (B, D, C); ``labels_below``: labels drawn from [0, labels_below) instead of [0, C);
    ``memory_budget``: the op's (bytes of kept logits); ``near_target``: each row is its target's
    weight row plus that much Gaussian noise (cosines near 1, as a trained model's: an angular
    margin's derivative magnifies the cosine's rounding there)."""
    k = kw(name) if margin is None else dict(zip(("scale", "m1", "m2", "m3", "normalize"), margin))
    B, D, C = shape
    x32, w32, labels = make_case(B, D, C, 0)
    labels = torch.randint(0, labels_below or C, (B,))
    if near_target is not None:
        x32 = w32[labels] + near_target * torch.randn(B, D)
    if noncontiguous:
        x32, w32 = x32.t().contiguous().t(), w32.t().contiguous().t()
    x = x32.to(device, dtype).requires_grad_()
    w = w32.to(device, dtype).requires_grad_()
    assert x.is_contiguous() != noncontiguous and w.is_contiguous() != noncontiguous
    xr = x.detach().double().cpu().requires_grad_()
    wr = w.detach().double().cpu().requires_grad_()
    ref = ref_stats(xr, wr, labels, 0, **k)[:3]
    xt = x.detach().clone().requires_grad_()
    wt = w.detach().clone().requires_grad_()
    tor = torch_low_precision_stats(xt, wt, labels.to(device), **k)
    ours = ce_shard_stats(x, w, labels.to(device), chunk_classes=chunk, memory_budget=memory_budget, **k)[:3]
    assert all(torch.isfinite(t).all() for t in ours)
    for a, b, r in zip(ours, tor, ref):
        err_ours, err_torch = rel(a.cpu(), r), rel(b.cpu(), r)
        assert err_ours <= 2 * err_torch + 1e-6, (err_ours, err_torch)
    # The gradients of each statistic alone and of the module's loss (gradient_weights).
    for what, g in gradient_weights(B, C).items():
        rg = torch.autograd.grad(weighted(ref, g), (xr, wr), retain_graph=True)
        tg = torch.autograd.grad(weighted(tor, g), (xt, wt), retain_graph=True)
        og = torch.autograd.grad(weighted(ours, g), (x, w), retain_graph=True)
        assert og[0].dtype == dtype and og[1].dtype == dtype
        assert all(torch.isfinite(t).all() for t in og), what
        for name, a, b, r in zip("xw", og, tg, rg):
            err_ours, err_torch = rel(a.cpu(), r), rel(b.cpu(), r)
            assert err_ours <= 2 * err_torch + 1e-6, (what, name, err_ours, err_torch)


def opcheck_samples():
    samples = []
    for name, (B, D, C, off, chunk) in [
        ("plain", (5, 8, 13, 0, 4)),
        ("arcface", (4, 3, 9, 2, 100)),
        ("combined", (1, 5, 6, 0, 1)),
        ("cosface", (3, 2, 0, 0, 2)),
    ]:
        s, m1, m2, m3, norm = MARGINS[name]
        x, w, labels = make_case(B, D, C, off)
        tref = torch.randn(B) if name != "arcface" else None
        samples.append((x, w, labels, tref, off, s, m1, m2, m3, norm, chunk))
    return samples


def plain_reference_by_rows(x, w, labels, scale, g, rows=64, dtype=torch.float64):
    """(lse, target, sum) of the plain logits z = scale * x @ w.T (labels all inside the shard)
    and the gradients of sum(g[0] * lse + g[1] * target + g[2] * sum) w.r.t. x and w, computed
    by torch in ``dtype`` (float64: the reference; float32: torch's own fp32 computation), in
    blocks of rows: for shards whose full logit matrix would not fit in memory."""
    xd, wd = x.to(dtype), w.to(dtype)
    g = [t.to(dtype) for t in g]
    B = x.shape[0]
    lse, tgt, zsum = (torch.empty(B, dtype=dtype, device=x.device) for _ in range(3))
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


def check_plain_by_rows(x, w, labels, scale, chunk, rows=64):
    g = [torch.randn(x.shape[0], dtype=torch.float64, device=x.device) for _ in range(3)]
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    lse, t, s, _ = ce_shard_stats(xx, ww, labels, scale=scale, chunk_classes=chunk)
    gx, gw = torch.autograd.grad(sum((o * gg.to(o.dtype)).sum() for o, gg in zip((lse, t, s), g)), (xx, ww))
    r_lse, r_t, r_s, r_gx, r_gw = plain_reference_by_rows(x, w, labels, scale, g, rows)
    assert rel(lse, r_lse) <= 1e-5 and rel(t, r_t) <= 1e-5
    # The sum of a row's logits cancels: bound its error by the sum of their magnitudes.
    r_abs = scale * (x.double().abs() @ w.double().abs().t().sum(1, keepdim=True))[:, 0]
    assert ((s.double() - r_s).abs() <= 1e-6 * r_abs).all()
    # The gradients sum over every class (dX over C terms in one GEMM accumulation): within 1e-5
    # of the reference, or within twice the error of torch's own fp32 computation where that is
    # larger (the rounding of a C-term fp32 sum grows with C).
    floor = scale * math.sqrt(x.shape[0])
    t_gx, t_gw = plain_reference_by_rows(x, w, labels, scale, g, rows, dtype=torch.float32)[3:]
    for ours, torch_fp32, ref in ((gx, t_gx, r_gx), (gw, t_gw, r_gw)):
        err, err_torch = rel(ours, ref, floor), rel(torch_fp32, ref, floor)
        assert err <= max(1e-5, 2 * err_torch + 1e-6), (err, err_torch)


# ---- module-level helpers (ShardedSoftmaxLoss / sharded_cross_entropy tests) ----------------

LOSS_MARGINS = {
    "plain": None,
    "cosface": shardkit.CosFace(s=8.0, m=0.35),
    "arcface": shardkit.ArcFace(s=8.0, m=0.5),
    "combined": shardkit.CombinedMargin(6.0, 1.15, 0.3, 0.1),
}


def make_labels(batch, num_classes, ignore=()):
    y = torch.randint(0, num_classes, (batch,))
    for i in ignore:
        y[i] = -100
    return y


def grads_of(loss_fn, x, y, grad_out=None, **kw):
    x = x.detach().clone().requires_grad_(True)
    loss = loss_fn(x, y, **kw)
    grad_out = torch.randn_like(loss) if grad_out is None else grad_out
    gx, *gw = torch.autograd.grad(loss, [x, *loss_fn.weight_shards], grad_out)
    return loss, gx, torch.cat(gw), grad_out


def assert_matches_reference(loss_fn, x, y, margin, tol=1e-5, **ref_kw):
    loss, gx, gw, g = grads_of(loss_fn, x, y)
    ref = reference_loss_and_grads(x, loss_fn.full_weight(), y, g, **margin_kwargs(margin), **ref_kw)
    assert loss.dtype == torch.float32 and loss.shape == ref.loss.shape
    assert rel(loss, ref.loss) <= tol
    # grad_x against the larger of its own norm and its terms' (cancellation in a short sum,
    # e.g. D = 1 and one row, can make grad_x far smaller than the float32 rounding of the
    # terms it sums; a wrong gradient is off by about the terms' size, so it still fails)
    terms = reference_grad_x_terms(x, loss_fn.full_weight(), y, g, **margin_kwargs(margin), **ref_kw)
    assert rel(gx, ref.grad_x, floor=max(terms, 1e-30)) <= tol
    assert rel(gw, ref.grad_w) <= tol


def check_large_scale(scale, m, device):
    """CosFace(scale, m) on ``device``: the backward must subtract lse from the logit s * cos
    rounded as the forward rounded it (a fused s * cos - lse is off by up to s * 2^-24, enough
    at large s to make a softmax probability exceed 1: gradient error ~ s, then inf and NaN).
    Both gradients must be as close to the float64 truth as torch's own float32 computation
    of the same loss (4x its error, plus 1e-5).

    The data keep the check well conditioned at every s: each row's largest logit is a wrong
    class ahead of every other by >= 40, so its probability is 1 - O(e^-40) and the gradient
    is O(s) whatever the last bit of each cosine. (With near-ties, a cosine's legitimate
    rounding, s * 2^-24, moves the probabilities as much as the defect does, and the check
    would depend on the draw.) The defect still shows: it puts that probability off by
    ~ s * 2^-24 relative (1e-3 at s = 1e5)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    for _ in range(100):
        w = torch.randn(23, 17, generator=g)
        y = torch.randint(0, 23, (7,), generator=g)
        decoy = (y + torch.randint(1, 23, (7,), generator=g)) % 23  # a wrong class per row
        x = 3 * F.normalize(w[decoy], dim=1) + 0.3 * torch.randn(7, 17, generator=g)
        cos = F.normalize(x.double(), dim=1) @ F.normalize(w.double(), dim=1).T
        logits = scale * (cos - m * F.one_hot(y, 23).double())
        top2 = logits.topk(2, dim=1).values
        if bool(((top2[:, 0] - top2[:, 1]) >= 40).all()) and bool((logits.argmax(1) == decoy).all()):
            break
    else:
        raise AssertionError("no well-conditioned draw in 100 tries")

    def reference(dtype):
        xr, wr = x.to(dtype, copy=True).requires_grad_(), w.to(dtype, copy=True).requires_grad_()  # leaves
        cos = F.normalize(xr, dim=1) @ F.normalize(wr, dim=1).T
        F.cross_entropy(scale * (cos - m * F.one_hot(y, 23).to(dtype)), y, reduction="sum").backward()
        return xr.grad, wr.grad

    head = shardkit.ShardedSoftmaxLoss(17, 23, margin=shardkit.CosFace(scale, m), reduction="sum", devices=[device])
    with torch.no_grad():
        head.weight_shards[0].copy_(w)
    xs = x.to(device, copy=True).requires_grad_()
    head(xs, y.to(device)).backward()
    grads = zip((xs.grad, head.weight_shards[0].grad), reference(torch.float32), reference(torch.float64))
    for ours, torch32, exact in grads:
        ours = ours.cpu()
        assert torch.isfinite(ours).all()
        assert rel(ours, exact) <= 4 * rel(torch32, exact) + 1e-5, (rel(ours, exact), rel(torch32, exact))


def check_module_low_precision(
    device,
    dtype,
    margin_name,
    *,
    shape=(96, 128, 3001),
    shards=2,
    eps=0.1,
    mixed=False,
    chunk_memory=None,
    memory_budget=0,
):
    """The module's loss (label smoothing ``eps``: the statistics' gradients weighted 1, -(1 - eps)
    and -eps / C) and both gradients against the float64 reference of the same inputs, within
    2x the error of torch's own computation at ``dtype``: the logits by a GEMM in ``dtype``
    (normalized in fp32 and rounded, as autocast does), the rest in fp32. ``mixed``: fp32 weights
    under a ``dtype`` autocast, else weights in ``dtype``. ``shape``: (B, D, C) over ``shards``
    shards on ``device``; D a multiple of 64 and 16-bit inputs: the fused kernels' case.
    ``chunk_memory``, ``memory_budget``: the module's (None: its default; 0: keep nothing)."""
    margin = LOSS_MARGINS[margin_name]
    B, D, C = shape
    head = shardkit.ShardedSoftmaxLoss(
        D,
        C,
        margin=margin,
        devices=[device] * shards,
        dtype=torch.float32 if mixed else dtype,
        label_smoothing=eps,
        check_inputs=False,
        chunk_memory=chunk_memory,
        memory_budget=memory_budget,
    )
    with torch.no_grad():  # weights of unit-order rows (the init's are ~1/sqrt(D))
        for p in head.weight_shards:
            p.copy_(torch.randn(p.shape, dtype=torch.float32).to(p.dtype))
    w = head.full_weight("cpu")
    x = torch.randn(B, D).to(dtype if not mixed else torch.float32)
    if margin is None:
        x = x / math.sqrt(D)  # plain logits of order 1
    y = make_labels(B, C)
    xin = x.to(dtype)  # what the loss computes with (autocast casts the embeddings)
    # (The weights as stored: in fp32 (mixed), the exact values torch and the GPU kernels round.)
    ref = reference_loss_and_grads(xin, w, y, label_smoothing=eps, **margin_kwargs(margin))

    def torch_own(xt, wt, reduction="mean"):
        # fp32 normalization rounded to dtype, the GEMM in dtype, the rest in fp32.
        if margin is not None:
            xt, wt = F.normalize(xt.float(), dim=1), F.normalize(wt.float(), dim=1)
        z = (xt.to(dtype) @ wt.to(dtype).t()).float()
        if margin is not None:
            zt = z.gather(1, y.to(device)[:, None])
            z = margin.scale * z.scatter(1, y.to(device)[:, None], margin_psi(zt, margin.m1, margin.m2, margin.m3))
        return F.cross_entropy(z, y.to(device), label_smoothing=eps, reduction=reduction)

    xt = xin.to(device).requires_grad_()
    wt = w.to(device, torch.float32 if mixed else dtype).requires_grad_()
    t_loss = torch_own(xt, wt)
    t_gx, t_gw = torch.autograd.grad(t_loss, (xt, wt))
    xo = x.to(device).requires_grad_()
    with torch.autocast(torch.device(device).type, dtype=dtype, enabled=mixed):
        loss = head(xo, y.to(device))
    gx, *gws = torch.autograd.grad(loss, [xo, *head.weight_shards])
    gw = torch.cat([g.to("cpu") for g in gws])
    assert loss.dtype == torch.float32 and gw.dtype == (torch.float32 if mixed else dtype)
    assert torch.isfinite(gx).all() and torch.isfinite(gw).all()
    # The loss is compared row by row (reduction="none"): a scalar's error against float64 is
    # one rounding draw, and torch's can be near zero by luck (its row errors cancel), which
    # would make "2x torch's error" a coin toss. The mean is then checked against those rows.
    head.reduction = "none"
    with torch.no_grad(), torch.autocast(torch.device(device).type, dtype=dtype, enabled=mixed):
        rows = head(x.to(device), y.to(device))
    head.reduction = "mean"
    with torch.no_grad():
        t_rows = torch_own(xt, wt, reduction="none")
    ref_rows = reference_loss(xin, w, y, label_smoothing=eps, reduction="none", **margin_kwargs(margin))
    assert rows.shape == (B,) and rows.dtype == torch.float32
    torch.testing.assert_close(loss.double().cpu(), rows.double().mean().cpu(), rtol=1e-5, atol=1e-6)
    for what, ours, theirs, exact in (
        ("loss rows", rows, t_rows, ref_rows),
        ("x", gx, t_gx, ref.grad_x),
        ("w", gw, t_gw, ref.grad_w),
    ):
        err_ours, err_torch = rel(ours.cpu(), exact), rel(theirs.cpu(), exact)
        assert err_ours <= 2 * err_torch + 1e-6, (what, err_ours, err_torch)


class OpLog(TorchDispatchMode):
    """The names of the shardkit ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "shardkit":
            self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))
