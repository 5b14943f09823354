"""Strict argument checks shared by the ops' Python wrappers: no ``int()`` / ``float()`` /
``bool()`` coercion (a string, a float count or None is refused, not converted), each error
naming its argument. Cheap isinstance checks only: nothing here reads a tensor's value.

Traced values pass as they are (a ``torch.SymInt`` / ``SymFloat`` / ``SymBool`` is a size or
a scalar under ``torch.compile`` with dynamic shapes): their range is the kernels' to check.
"""

from __future__ import annotations

import numbers
import operator
from typing import Any, Optional

import torch

__all__ = ["bool_arg", "check_dense", "int_arg", "optional_tensor_arg", "real_arg", "tensor_arg", "INT64_MAX"]

INT64_MAX = 2**63 - 1  # the op schemas' ``int`` (int64_t)


def check_dense(name: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` if it is a dense (strided, not nested) tensor, else TypeError naming ``name``: the
    kernels have no sparse (or nested) backend, and the dispatcher's "Could not run ... with
    arguments from the 'SparseCPU' backend" named no argument. Host metadata only."""
    if value.layout != torch.strided or value.is_nested:
        layout = "nested" if value.is_nested else value.layout
        raise TypeError(f"argument `{name}` must be a dense (strided) tensor, got layout {layout}")
    return value


def tensor_arg(name: str, value: Any) -> torch.Tensor:
    """``value`` if it is a dense Tensor, else TypeError naming ``name`` (None gave AttributeErrors;
    a sparse tensor the dispatcher's error naming no argument)."""
    if isinstance(value, torch.Tensor):
        return check_dense(name, value)
    raise TypeError(f"argument `{name}` must be a Tensor, got {type(value).__name__}")


def optional_tensor_arg(name: str, value: Any) -> Optional[torch.Tensor]:
    """``value`` if it is a dense Tensor or None, else TypeError naming ``name``."""
    if value is None:
        return value
    if isinstance(value, torch.Tensor):
        return check_dense(name, value)
    raise TypeError(f"argument `{name}` must be a Tensor or None, got {type(value).__name__}")


def bool_arg(name: str, value: Any) -> bool:
    """``value`` if it is a Python bool: a string ('no' is truthy), an int or None is refused."""
    if isinstance(value, (bool, torch.SymBool)):
        return value  # type: ignore[return-value]
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):  # numpy 2 and 1
        return bool(value)
    raise TypeError(f"argument `{name}` must be a Python bool, got {type(value).__name__} {value!r}")


def int_arg(name: str, value: Any, *, low: Optional[int] = None, high: int = INT64_MAX) -> int:
    """``value`` as an int: Python and numpy integers, a one-element integer tensor (read: a
    host sync for a GPU one); bool, float, str and other tensors refused (TypeError); outside
    ``[low, high]`` a ValueError (``low`` None: no lower bound here)."""
    if isinstance(value, torch.SymInt):
        return value  # type: ignore[return-value]
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not (value.is_floating_point() or value.is_complex()):
        if value.dtype == torch.bool:
            raise TypeError(f"argument `{name}` must be an int, got a bool tensor")
        value = int(value.item())
    if type(value) is not int:  # (the common case skips the ABC check)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"argument `{name}` must be an int, got {type(value).__name__} {value!r}")
        value = operator.index(value)
    if low is not None and value < low:
        raise ValueError(f"argument `{name}` must be >= {low}, got {value}")
    if value > high:
        raise ValueError(f"argument `{name}` must be <= {high}, got {value}")
    return value


def too_large_for_float(value: object) -> str:
    """'an int too large for a float' (or a Fraction...): how an error names a number whose float()
    overflows, without printing its digits (there may be thousands)."""
    kind = type(value).__name__
    return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind} too large for a float"


def real_arg(name: str, value: Any) -> float:
    """``value`` as a float: Python and numpy real numbers (ints too), a one-element real tensor
    (read: a host sync for a GPU one); bool, str, None and other tensors refused (TypeError).
    Finiteness and ranges are the caller's (the kernels check them)."""
    if isinstance(value, torch.SymFloat):
        return value  # type: ignore[return-value]
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool and not value.is_complex():
        return float(value.item())
    if type(value) is float:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"argument `{name}` must be a real number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int such as 10**400: a bare OverflowError naming nothing (digits not printed)
        raise ValueError(f"argument `{name}` must be finite, got {too_large_for_float(value)}") from None
