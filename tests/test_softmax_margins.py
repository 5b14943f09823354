"""Margin constructors refuse number arguments too large for a float with a ValueError that
names the argument and the margin class (not a bare OverflowError)."""

from fractions import Fraction

import pytest

import shardkit

_HUGE = [10**400, -(10**400), Fraction(10**400, 7)]


@pytest.mark.parametrize("value", _HUGE, ids=["int", "negative-int", "Fraction"])
@pytest.mark.parametrize(
    "make, cls, name",
    [
        (lambda v: shardkit.CombinedMargin(v), "CombinedMargin", "s"),
        (lambda v: shardkit.CombinedMargin(64, m1=v), "CombinedMargin", "m1"),
        (lambda v: shardkit.CombinedMargin(64, m2=v), "CombinedMargin", "m2"),
        (lambda v: shardkit.CombinedMargin(64, m3=v), "CombinedMargin", "m3"),
        (lambda v: shardkit.CosFace(s=v), "CosFace", "s"),
        (lambda v: shardkit.CosFace(m=v), "CosFace", "m"),
        (lambda v: shardkit.ArcFace(s=v), "ArcFace", "s"),
        (lambda v: shardkit.ArcFace(m=v), "ArcFace", "m"),
    ],
    ids=lambda x: "" if callable(x) else x,
)
def test_margin_names_a_number_too_large_for_a_float(make, cls, name, value):
    kind = type(value).__name__
    with pytest.raises(ValueError, match=rf"^{cls}: argument `{name}` must be finite, got an? {kind} too large"):
        make(value)


def test_large_numbers_that_fit_a_float_are_still_checked_as_before():
    assert shardkit.CombinedMargin(10**20).scale == 1e20  # a big int that fits
    with pytest.raises(ValueError, match=r"CombinedMargin: argument `s` \(the scale\) must be at most"):
        shardkit.CombinedMargin(10**300)
    with pytest.raises(TypeError, match=r"ArcFace: argument `m` must be a real number, got str"):
        shardkit.ArcFace(m="0.5")
