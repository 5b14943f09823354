"""Float64 full-logit reference for the sharded cross-entropy (tests only).

Everything here materializes the whole [B, C] logit matrix in float64 and uses plain
PyTorch (``F.cross_entropy`` for the loss), so it is an independent check of the
chunked, sharded kernels and of the module that combines their statistics.

Margin convention (the op contract): with ``normalize=True`` the logits are
``scale * cos`` with ``cos`` the cosine between the L2-normalized embedding and class
weight (each norm clamped below at 1e-12); the target column becomes
``scale * psi(cos)``, ``psi(c) = cos(m1 * theta + m2) - m3`` with
``theta = acos(clamp(c, -1 + 1e-7, 1 - 1e-7))``, continued linearly with slope 1 in ``c``
where ``m1 * theta + m2 > pi``: ``psi(c) = -1 - m3 + (c - c_max)``,
``c_max = cos((pi - m2) / m1)``.
"""

import math
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

_EPS_NORM = 1e-12
_EPS_ACOS = 1e-7


def margin_psi(c: torch.Tensor, m1: float = 1.0, m2: float = 0.0, m3: float = 0.0) -> torch.Tensor:
    """psi(c) = cos(m1 * acos(c) + m2) - m3 with the linear continuation past pi.

    ``c``: any shape, floating (use float64). Differentiable by autograd. Without an angular
    margin (m1 = 1, m2 = 0: plain cosine, CosFace) no angle is taken: psi(c) = c - m3 exactly,
    with no clamp near +-1 (cos(acos(clamp(c))) would move c by up to 1e-7 there).
    """
    if m1 == 1.0 and m2 == 0.0:
        return c - m3
    theta = torch.acos(torch.clamp(c, -1.0 + _EPS_ACOS, 1.0 - _EPS_ACOS))
    arc = torch.cos(m1 * theta + m2) - m3
    limit = (math.pi - m2) / m1
    if limit >= math.pi:  # m1 * theta + m2 never exceeds pi for theta in [0, pi]
        return arc
    c_max = math.cos(limit)
    linear = -1.0 - m3 + (c - c_max)
    return torch.where(m1 * theta + m2 > math.pi, linear, arc)


def full_logits(
    x: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    *,
    scale: float = 1.0,
    m1: float = 1.0,
    m2: float = 0.0,
    m3: float = 0.0,
    normalize: bool = False,
    margin_on_target: bool = True,
) -> torch.Tensor:
    """The full [B, C] float64 logits (differentiable w.r.t. x [B, D] and w [C, D]).

    ``labels`` [B] int64 global class ids; rows whose label is outside [0, C) (e.g. an
    ignore_index) get no margin. ``margin_on_target=False`` gives the plain logits
    (``scale * cos`` or ``scale * x.w``) used for top-k ranking.
    """
    x = x.double()
    w = w.double()
    if not normalize:
        return scale * (x @ w.t())
    xn = x / x.norm(dim=1, keepdim=True).clamp_min(_EPS_NORM)
    wn = w / w.norm(dim=1, keepdim=True).clamp_min(_EPS_NORM)
    cos = xn @ wn.t()
    if not margin_on_target:
        return scale * cos
    num_classes = w.shape[0]
    valid = (labels >= 0) & (labels < num_classes)
    onehot = F.one_hot(torch.where(valid, labels, 0).long(), num_classes).bool() & valid[:, None]
    return scale * torch.where(onehot, margin_psi(cos, m1, m2, m3), cos)


def reference_loss(
    x: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
    *,
    scale: float = 1.0,
    m1: float = 1.0,
    m2: float = 0.0,
    m3: float = 0.0,
    normalize: bool = False,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of the full float64 logits by ``F.cross_entropy`` (same semantics:
    smoothing over all C classes, ignored rows count nowhere, mean over the others)."""
    z = full_logits(x, w, labels, scale=scale, m1=m1, m2=m2, m3=m3, normalize=normalize)
    return F.cross_entropy(
        z, labels.long(), ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction
    )


def margin_kwargs(margin) -> dict:
    """The reference keyword arguments for a shardkit margin object (or None: plain)."""
    if margin is None:
        return dict(scale=1.0, m1=1.0, m2=0.0, m3=0.0, normalize=False)
    return dict(scale=margin.scale, m1=margin.m1, m2=margin.m2, m3=margin.m3, normalize=True)


class ReferenceGrads(NamedTuple):
    loss: torch.Tensor  # float64, shape of the reduction
    grad_x: torch.Tensor  # [B, D] float64
    grad_w: torch.Tensor  # [C, D] float64, class order


def reference_loss_and_grads(
    x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, grad_out: Optional[torch.Tensor] = None, **kwargs
) -> ReferenceGrads:
    """Loss and its gradients w.r.t. x and the full w, by float64 autograd.

    ``grad_out`` is the upstream gradient (needed for reduction="none"; default ones).
    """
    xd = x.detach().double().requires_grad_(True)
    wd = w.detach().double().requires_grad_(True)
    loss = reference_loss(xd, wd, labels, **kwargs)
    if grad_out is None:
        grad_out = torch.ones_like(loss)
    gx, gw = torch.autograd.grad(loss, (xd, wd), grad_out.double())
    return ReferenceGrads(loss.detach(), gx, gw)


def reference_unowned_targets(
    x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100, **kwargs
) -> ReferenceGrads:
    """Mean loss and gradients when labels outside [0, C) other than ``ignore_index`` are
    targets in no shard (what ``check_inputs=False`` lets through): such a row's loss is the
    log-sum-exp of its logits (no margin, no target logit subtracted) and it counts in the
    mean like any other row. ``kwargs``: the margin's (:func:`margin_kwargs`)."""
    xd = x.detach().double().requires_grad_(True)
    wd = w.detach().double().requires_grad_(True)
    z = full_logits(xd, wd, labels, **kwargs)
    owned = (labels >= 0) & (labels < w.shape[0])
    target = z.gather(1, torch.where(owned, labels, 0).long()[:, None])[:, 0]
    per_row = torch.logsumexp(z, dim=1) - torch.where(owned, target, torch.zeros_like(target))
    valid = labels != ignore_index
    loss = torch.where(valid, per_row, torch.zeros_like(per_row)).sum() / valid.sum()
    gx, gw = torch.autograd.grad(loss, (xd, wd))
    return ReferenceGrads(loss.detach(), gx, gw)


def reference_grad_x_terms(
    x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, grad_out: Optional[torch.Tensor] = None, **kwargs
) -> float:
    """The size of the terms whose sum is d loss / d x, for unnormalized logits: the norm of
    ``|dL/dz| @ |scale * w|`` (float64), i.e. the gradient with every term taken positive.
    Any float32 computation of grad_x rounds at ~2^-24 times this, however small cancellation
    makes grad_x itself (with D = 1 and one row, grad_x is one sum of C signed terms). For
    normalized logits it returns 0.0 (no such bound is computed; callers compare plainly).
    """
    if kwargs.get("normalize", False):
        return 0.0
    loss_kwargs = {k: v for k, v in kwargs.items() if k in ("label_smoothing", "ignore_index", "reduction")}
    logit_kwargs = {k: v for k, v in kwargs.items() if k not in loss_kwargs}
    z = full_logits(x.detach().double(), w.detach().double(), labels, **logit_kwargs).requires_grad_(True)
    loss = F.cross_entropy(z, labels.long(), **loss_kwargs)
    grad_out = torch.ones_like(loss) if grad_out is None else grad_out.double()
    (dz,) = torch.autograd.grad(loss, z, grad_out)
    return float((dz.abs() @ (kwargs.get("scale", 1.0) * w.detach().double()).abs()).norm())


def reference_lse(x, w, labels, **kwargs) -> torch.Tensor:
    """Per-row log-sum-exp [B] float64 over all C classes of the logits the loss uses
    (margin applied at the target column)."""
    return torch.logsumexp(full_logits(x, w, labels, **kwargs), dim=1)


class TopkReference(NamedTuple):
    greater_lo: torch.Tensor  # [B] int64: classes clearly above the target (by > tol)
    greater_hi: torch.Tensor  # [B] int64: classes above the target or within tol of it


def reference_greater_count(x, w, labels, *, tol: float = 1e-4, abs_tol: float = 0.0, **kwargs) -> TopkReference:
    """For each row, the number of classes whose PLAIN logit (no margin) exceeds the
    target's plain logit, as a bracket [lo, hi] so that near-ties (within
    ``tol * max(1, |target|) + abs_tol`` of the target logit) never make a test flaky. The target
    column itself is never counted. Rows with a label outside [0, C) get zeros."""
    kwargs = dict(kwargs)
    z = full_logits(x, w, labels, margin_on_target=False, **kwargs)
    num_classes = w.shape[0]
    valid = (labels >= 0) & (labels < num_classes)
    safe = torch.where(valid, labels, 0).long()
    t = z.gather(1, safe[:, None])
    band = tol * t.abs().clamp_min(1.0) + abs_tol
    not_target = torch.ones_like(z, dtype=torch.bool).scatter_(1, safe[:, None], False)
    lo = ((z > t + band) & not_target).sum(1)
    hi = ((z > t - band) & not_target).sum(1)
    zero = torch.zeros_like(lo)
    return TopkReference(torch.where(valid, lo, zero), torch.where(valid, hi, zero))


def reference_correct(
    x, w, labels, ks: Sequence[int], *, ignore_index: int = -100, tol: float = 1e-4, abs_tol: float = 0.0, **kwargs
):
    """{k: (lo, hi)}: bracket for the number of non-ignored rows whose label is in the
    top k of the plain logits (exact when no near-ties)."""
    ref = reference_greater_count(x, w, labels, tol=tol, abs_tol=abs_tol, **kwargs)
    keep = labels != ignore_index
    out = {}
    for k in ks:
        # Fewer classes clearly above -> more likely correct: hi count gives the lower bound.
        lo = int(((ref.greater_hi < k) & keep).sum())
        hi = int(((ref.greater_lo < k) & keep).sum())
        out[k] = (lo, hi)
    return out


def split_rows(t: torch.Tensor, sizes: Sequence[int]):
    """Split a [C, ...] tensor into consecutive row blocks of the given sizes."""
    return list(torch.split(t, list(sizes), dim=0))
