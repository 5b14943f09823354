"""Argument checks of ``ModelEMA``: numbers, counters, the schedule and a saved state,
each refused with an error naming it before anything changes; and the schedule's formula."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Optional, Tuple, Union

import torch

from shardkit.ops._devices import check_visible

# Largest step / update count: an int64, as torch's step counters (a larger one overflows the
# float math of the schedule).
_MAX_COUNT = 2**63 - 1

# The schedule's attributes of ModelEMA, in check_schedule's order (schedule_decay takes all but the last).
SCHEDULE = ("decay", "tau", "warmup_gamma", "warmup_power", "min_decay", "update_after_step", "update_every")

# check_schedule's result: decay, tau, warmup_gamma, warmup_power, min_decay, update_after_step, update_every
Schedule = Tuple[float, Optional[float], Optional[float], Optional[float], float, int, int]


def _short(value: object) -> str:
    """``repr(value)`` cut short (a huge int's repr is long, or refused past 4300 digits)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an int of {value.bit_length()} bits"
    r = repr(value)
    return r if len(r) <= 40 else f"{r[:20]}...({len(r)} characters)"


def _real(name: str, value: object) -> float:
    # float(None) / float("0.9") would give a TypeError not naming the argument, or accept a string.
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.is_floating_point():
            return float(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an int (or Fraction) beyond the float range
            raise ValueError(f"argument `{name}` must be a finite float, got {_short(value)}") from None
    raise TypeError(f"argument `{name}` must be a float, got {type(value).__name__} {value!r}")


def _check_int(name: str, value: object, minimum: int, maximum: Optional[int] = None) -> int:
    """``value`` as an int (numpy integers too, not bools) >= minimum; ValueError naming it."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise ValueError(f"argument `{name}` must be an int >= {minimum}, got {_short(value)}")
    value = number
    if maximum is not None and value > maximum:
        raise ValueError(f"argument `{name}` must be an int in [{minimum}, 2**63 - 1], got {_short(value)}")
    return value


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a Python bool, else a TypeError naming argument ``name``."""
    if not isinstance(value, bool):
        kind = type(value)
        raise TypeError(f"argument `{name}` must be a Python bool, got {kind.__module__}.{kind.__name__}")
    return value


def timm_arguments(
    use_warmup: object,
    exclude_buffers: object,
    foreach: object,
    tau: Optional[float],
    warmup_gamma: Optional[float],
    warmup_power: Optional[float],
    copy_float_buffers: bool,
) -> Tuple[Optional[float], Optional[float], Optional[float], bool]:
    """ModelEMA's (tau, warmup_gamma, warmup_power, copy_float_buffers) after timm ModelEmaV3's
    arguments: ``use_warmup=True`` selects the warmup (gamma 1.0, power 2/3 unless given),
    ``use_warmup=False`` the constant decay (tau unused either way); ``exclude_buffers=True`` is
    ``copy_float_buffers=True``; ``foreach`` is accepted and has no effect (one fused kernel)."""
    for name, value in (("use_warmup", use_warmup), ("exclude_buffers", exclude_buffers), ("foreach", foreach)):
        if value is not None:
            check_bool(name, value)
    check_bool("copy_float_buffers", copy_float_buffers)
    if use_warmup is True:
        tau = None
        warmup_gamma = 1.0 if warmup_gamma is None else warmup_gamma
        warmup_power = 2 / 3 if warmup_power is None else warmup_power
    elif use_warmup is False:  # timm ignores warmup_gamma / warmup_power then, and so does ModelEMA
        tau, warmup_gamma, warmup_power = None, None, None
    return tau, warmup_gamma, warmup_power, bool(copy_float_buffers) or exclude_buffers is True


def _check_step(step: object) -> int:
    """``update``'s ``step`` when it is not a plain int in range (the slow path): numpy integers
    and one-element integer tensors (read on the host: a sync for a CUDA tensor) are taken."""
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point() and not step.is_complex():
        if step.dtype != torch.bool:
            step = int(step.item())
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(
            f"argument `step` must be an int (or None), got {type(step).__name__} {_short(step)}; "
            "a float step is not truncated: pass int(step)"
        )
    value = int(step)  # numpy integers
    if not 0 <= value <= _MAX_COUNT:
        raise ValueError(f"argument `step` must be an int in [0, 2**63 - 1] or None, got {_short(step)}")
    return value


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "floating"
    return "complex" if dtype.is_complex else "integer"


def check_schedule(
    decay: object,
    tau: object,
    warmup_gamma: object,
    warmup_power: object,
    min_decay: object,
    update_after_step: object,
    update_every: object,
) -> Schedule:
    """The schedule arguments, checked and converted (floats, ints); changes nothing."""
    d, min_d = _real("decay", decay), _real("min_decay", min_decay)
    t = None if tau is None else _real("tau", tau)
    gamma = None if warmup_gamma is None else _real("warmup_gamma", warmup_gamma)
    power = None if warmup_power is None else _real("warmup_power", warmup_power)
    if not 0.0 <= d <= 1.0:  # (NaN fails every comparison)
        raise ValueError(f"argument `decay` must lie in [0, 1], got {d}")
    if not 0.0 <= min_d <= d:
        raise ValueError(f"argument `min_decay` must lie in [0, decay={d}], got {min_d}")
    # inf would make the decay 0 forever (the EMA a plain copy of the model), silently.
    for name, v in (("tau", t), ("warmup_gamma", gamma), ("warmup_power", power)):
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise ValueError(f"argument `{name}` must be > 0 and finite, or None, got {v}")
    after = _check_int("update_after_step", update_after_step, 0)
    every = _check_int("update_every", update_every, 1)
    return d, t, gamma, power, min_d, after, every


def schedule_decay(
    step: int,
    decay: float,
    tau: Optional[float],
    warmup_gamma: Optional[float],
    warmup_power: Optional[float],
    min_decay: float,
    update_after_step: int,
) -> float:
    """The decay at schedule step ``step`` (``ModelEMA.get_decay``; the class docstring)."""
    uas = update_after_step
    if warmup_gamma is not None or warmup_power is not None:
        s = max(0, step - uas - 1)
        if s <= 0:
            return 0.0
        gamma = 1.0 if warmup_gamma is None else warmup_gamma
        power = 2.0 / 3.0 if warmup_power is None else warmup_power
        return max(min(1.0 - (1.0 + s / gamma) ** -power, decay), min_decay)
    if tau is None:
        return 0.0 if step - uas - 1 <= 0 else decay
    s = step - uas
    if s <= 0:
        return 0.0
    return max(decay * (1.0 - math.exp(-s / tau)), min_decay)


# The EMA dtypes the fused update averages (:func:`shardkit.ops.ema_update_`).
EMA_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def check_dtype(dtype: object) -> Optional[torch.dtype]:
    """``ModelEMA(dtype=...)``: None (the model's dtypes kept) or one of :data:`EMA_DTYPES`; else
    a ValueError naming ``dtype`` (a float8 dtype would fail inside the op at the first update)."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in EMA_DTYPES):
        return dtype
    raise ValueError(
        "argument `dtype` must be a floating torch.dtype the EMA averages (torch.float32, torch.float64, "
        f"torch.float16 or torch.bfloat16) or None, got {_short(dtype)}"
    )


# ``ema(x)`` inside a swap: ``ema.module`` holds the training weights (or packed bits) there.
CALL_THE_MODEL = "there the model holds the averaged weights (ema.module its own): call the model itself"


def in_swap(where: str, advice: str) -> RuntimeError:
    """The error of a ModelEMA method that is refused inside ``with ema.swap(model):``."""
    return RuntimeError(f"{where}: called inside `with ema.swap(model)`; {advice}")


def check_device(device: Union[torch.device, str, int, None]) -> Optional[torch.device]:
    """``ModelEMA(device=...)``: None, or a cpu / visible cuda device (a clear error instead of
    the driver's at the first copy)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"argument `device` must name a device such as 'cpu' or 'cuda:0', got {device!r}") from err
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"argument `device` must be a cpu or cuda device, got {dev}")
    check_visible([dev], "device")
    return dev


def describe(decay: float, tau: object, gamma: object, power: object, updates: int, tensors: int) -> str:
    """ModelEMA's repr."""
    sched = "warmup" if gamma is not None or power is not None else "constant" if tau is None else f"ramp(tau={tau})"
    return f"ModelEMA(decay={decay}, schedule={sched}, updates={updates}, tensors={tensors})"


def check_flag(name: str, value: object) -> bool:
    """``value`` as a bool: a Python bool or a numpy bool (converted); else a TypeError naming
    ``name`` (``ema.enabled = 0`` would be saved as an int that no state_dict loads)."""
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool"):
        return bool(value)
    if not isinstance(value, bool):
        raise TypeError(f"argument `{name}` must be a bool (Python or numpy), got {kind.__name__} {_short(value)}")
    return value


def checked_attribute(name: str, value: Any) -> Any:
    """A ModelEMA attribute set after construction, checked as the argument of its name."""
    if name == "updates" or name == "stochastic_rounding_seed":
        return _check_int(name, value, 0, _MAX_COUNT)
    if name == "enabled":
        return check_flag(name, value)
    return check_bool(name, value) if name in ("stochastic_rounding", "copy_float_buffers") else value
