"""Additive angular / cosine margins for :class:`shardkit.ShardedSoftmaxLoss`.

With a margin, the loss L2-normalizes every embedding row and every class weight row
(each norm clamped below at 1e-12) and the logits become ``scale * cos(theta_ij)``,
``theta_ij`` the angle between embedding i and class j. The target column alone is
replaced by ``scale * psi(cos theta)``, with

    psi(c) = cos(m1 * theta + m2) - m3,        theta = acos(clamp(c, -1 + 1e-7, 1 - 1e-7))

(SphereFace's m1, ArcFace's m2, CosFace's m3; the combination of the InsightFace write-up).
Without an angular margin (``m1 = 1``, ``m2 = 0``: plain cosine logits, CosFace) no angle is
taken: ``psi(c) = c - m3`` exactly, with no clamp near +-1.

**Past pi.** ``cos(m1 * theta + m2)`` decreases only while ``m1 * theta + m2 <= pi``;
beyond, a plain ArcFace target logit would rise again as theta -> pi, rewarding the
worst-classified samples. shardkit continues psi there as a straight line of slope 1 in
``c``: for ``c < c_max = cos((pi - m2) / m1)`` when ``(pi - m2) / m1 < pi`` (else
``m1 * theta + m2`` never reaches pi, ``c_max = -1`` and there is no continuation),

    psi(c) = -1 - m3 + (c - c_max),

which is continuous at ``c_max`` and monotone increasing over all of [-1, 1], so the
gradient keeps pushing the target cosine up everywhere. (InsightFace's ArcFace uses
``c - m * sin(m)`` there, which jumps at the threshold; ours has no jump.) The gradients
are the exact derivative of this function, through the normalizations too.

The margin objects only carry numbers; the kernels apply them.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, NoReturn

from shardkit.ops._args import too_large_for_float

__all__ = ["Margin", "CosFace", "ArcFace", "CombinedMargin"]

_FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max
_LOGIT_MAX = 1e30  # the largest |logit| a margin may produce: sums over 1e8 classes stay finite


def _number(name: str, value: object, *, cls: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{cls}: argument `{name}` must be a real number, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:  # a huge int or Fraction
        raise ValueError(f"{cls}: argument `{name}` must be finite, got {too_large_for_float(value)}") from None
    if not math.isfinite(value):
        raise ValueError(f"{cls}: argument `{name}` must be finite, got {value}")
    return value


class Margin:
    """Base of the margin objects: immutable, hashable, compared by value.

    Attributes (floats): ``scale`` (s > 0), ``m1`` (> 0), ``m2`` (in [0, pi)), ``m3``.
    The target logit is ``scale * (cos(m1 * theta + m2) - m3)`` (see the module docstring
    for the continuation past pi); every other logit is ``scale * cos(theta)``.
    """

    __slots__ = ("scale", "m1", "m2", "m3")
    scale: float
    m1: float
    m2: float
    m3: float

    def __init__(self, scale: float, m1: float, m2: float, m3: float, *, _cls: str = "CombinedMargin") -> None:
        scale = _number("s", scale, cls=_cls)
        m1 = _number("m1", m1, cls=_cls)
        m2 = _number("m2", m2, cls=_cls)
        m3 = _number("m3", m3, cls=_cls)
        if scale <= 0:
            raise ValueError(f"{_cls}: argument `s` (the scale) must be > 0, got {scale}")
        if scale > _FLOAT32_MAX:  # the kernels compute in float32 (float64 inputs aside)
            raise ValueError(f"{_cls}: argument `s` (the scale) must be at most {_FLOAT32_MAX:.4g}, got {scale}")
        if m1 <= 0:
            raise ValueError(f"{_cls}: argument `m1` must be > 0, got {m1}")
        if not 0.0 <= m2 < math.pi:
            raise ValueError(f"{_cls}: argument `m2` (the angular margin, radians) must be in [0, pi), got {m2}")
        if scale * (1.0 + abs(m3)) > _LOGIT_MAX:  # float32 logits, and their sums over classes, stay finite
            m = "m" if _cls == "CosFace" else "m3"
            raise ValueError(
                f"{_cls}: arguments `s` and `{m}` give logits up to s * (1 + |{m}|) = {scale * (1.0 + abs(m3)):.4g}, "
                f"beyond {_LOGIT_MAX:.0e} (float32 logits and their sums over the classes would overflow); "
                f"use a smaller s or {m}"
            )
        for name, value in (("scale", scale), ("m1", m1), ("m2", m2), ("m3", m3)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise AttributeError(f"{type(self).__name__} is immutable; make a new one")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def params(self) -> tuple[float, float, float, float]:
        """``(scale, m1, m2, m3)`` as floats."""
        return (self.scale, self.m1, self.m2, self.m3)

    @property
    def has_angular_part(self) -> bool:
        """Whether psi needs acos (m1 != 1 or m2 != 0); False for CosFace and plain cosine."""
        return self.m1 != 1.0 or self.m2 != 0.0

    @property
    def c_max(self) -> float:
        """The cosine below which psi is the linear continuation (-1.0 when it never is)."""
        limit = (math.pi - self.m2) / self.m1
        return -1.0 if limit >= math.pi else math.cos(limit)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Margin) and self.params() == other.params()

    def __hash__(self) -> int:
        return hash(("shardkit.Margin",) + self.params())

    def __reduce__(self) -> tuple[type[Margin], tuple[float, ...]]:
        return (CombinedMargin, self.params())

    def __repr__(self) -> str:
        return f"CombinedMargin(s={self.scale}, m1={self.m1}, m2={self.m2}, m3={self.m3})"


class CombinedMargin(Margin):
    """Combined margin: target logit ``s * (cos(m1 * theta + m2) - m3)``.

    Args:
        s (float): scale, > 0 (64 is the face-recognition default).
        m1 (float): multiplicative angular margin, > 0 (1 = none).
        m2 (float): additive angular margin in radians, in [0, pi) (0 = none).
        m3 (float): additive cosine margin (0 = none); ``s * (1 + |m3|)`` at most 1e30 (the
            largest logit, kept far from float32's overflow).

    ``CombinedMargin(64, 1.0, 0.3, 0.2)`` is InsightFace's "combined" setting. Embeddings
    and weights are L2-normalized by the loss. Past ``m1 * theta + m2 = pi`` the target
    logit continues linearly in cos(theta) (see :mod:`shardkit.softmax.margins`).
    Raises ``TypeError`` naming the argument for a value that is not a real number (a bool, a
    string), ``ValueError`` for one outside the range above or not finite.
    """

    __slots__ = ()

    def __init__(self, s: float, m1: float = 1.0, m2: float = 0.0, m3: float = 0.0) -> None:
        super().__init__(s, m1, m2, m3, _cls="CombinedMargin")


class CosFace(Margin):
    """CosFace / AM-Softmax (large-margin cosine): target logit ``s * (cos(theta) - m)``.

    Args:
        s (float): scale, > 0. Default 64.
        m (float): cosine margin, >= 0. Default 0.4.

    Embeddings and weights are L2-normalized by the loss. Equal to
    ``CombinedMargin(s, 1, 0, m)``; needs no acos, so its kernels take the fast path and
    the continuation past pi never applies.
    Raises ``TypeError`` naming the argument for a value that is not a real number (a bool, a
    string), ``ValueError`` for one outside the range above or not finite.
    """

    __slots__ = ()

    def __init__(self, s: float = 64.0, m: float = 0.4) -> None:
        m = _number("m", m, cls="CosFace")
        if m < 0:
            raise ValueError(f"CosFace: argument `m` must be >= 0, got {m}")
        super().__init__(s, 1.0, 0.0, m, _cls="CosFace")

    def __reduce__(self) -> tuple[type[Margin], tuple[float, ...]]:
        return (CosFace, (self.scale, self.m3))

    def __repr__(self) -> str:
        return f"CosFace(s={self.scale}, m={self.m3})"


class ArcFace(Margin):
    """ArcFace (additive angular margin): target logit ``s * cos(theta + m)``.

    Args:
        s (float): scale, > 0. Default 64.
        m (float): angular margin in radians, in [0, pi). Default 0.5.

    Embeddings and weights are L2-normalized by the loss. Where ``theta + m > pi``
    (cos(theta) < cos(pi - m)) the target logit continues as
    ``s * (-1 + cos(theta) - cos(pi - m))``: continuous and monotone, unlike the raw
    ``cos(theta + m)`` which would rise again as theta -> pi. Equal to
    ``CombinedMargin(s, 1, m, 0)``.
    Raises ``TypeError`` naming the argument for a value that is not a real number (a bool, a
    string), ``ValueError`` for one outside the range above or not finite.
    """

    __slots__ = ()

    def __init__(self, s: float = 64.0, m: float = 0.5) -> None:
        m = _number("m", m, cls="ArcFace")
        if not 0.0 <= m < math.pi:
            raise ValueError(f"ArcFace: argument `m` (radians) must be in [0, pi), got {m}")
        super().__init__(s, 1.0, m, 0.0, _cls="ArcFace")

    def __reduce__(self) -> tuple[type[Margin], tuple[float, ...]]:
        return (ArcFace, (self.scale, self.m2))

    def __repr__(self) -> str:
        return f"ArcFace(s={self.scale}, m={self.m2})"
