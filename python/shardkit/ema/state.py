"""``ModelEMA``'s checkpoint: what :meth:`~shardkit.ModelEMA.state_dict` holds, the checks
:meth:`~shardkit.ModelEMA.load_state_dict` makes before it changes anything, and the copy of
checked weights into the EMA (a module, or a sharded model's local shards)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from shardkit.ema import sharded
from shardkit.ema.checks import _MAX_COUNT, Schedule, _dtype_kind, _short, check_schedule

FORMAT = "shardkit.ModelEMA/1"

__all__ = [
    "FORMAT",
    "ROUNDING_KEYS",
    "check_rounding_state",
    "check_state",
    "check_module_state",
    "load_module_state",
    "timm_state",
]


# Every key of a state_dict and the types it may hold (load_state_dict names a bad one).
_STATE_KEYS: Dict[str, Tuple[type, ...]] = {
    "module": (dict,),
    "updates": (int,),
    "calls": (int,),
    "decay": (float, int),
    "tau": (float, int, type(None)),
    "warmup_gamma": (float, int, type(None)),
    "warmup_power": (float, int, type(None)),
    "min_decay": (float, int),
    "update_after_step": (int,),
    "update_every": (int,),
    "copy_float_buffers": (bool,),
    "enabled": (bool,),
}


def timm_state(state_dict: object) -> Optional[Dict[str, Any]]:
    """The module weights of a timm ModelEmaV3 ``state_dict()`` (or of ``nn.Module.state_dict``
    called on a ModelEMA): its entries without their ``module.`` prefix; None for anything else
    (a ModelEMA state_dict has a ``format`` key)."""
    if isinstance(state_dict, dict) and not state_dict:
        return {}  # the state of a module without tensors
    if not isinstance(state_dict, dict) or "format" in state_dict:
        return None
    if not all(isinstance(k, str) and k.startswith("module.") for k in state_dict):
        return None
    return {k[len("module.") :]: v for k, v in state_dict.items()}


def check_state(state_dict: object, expected_format: str) -> Schedule:
    """A ModelEMA state_dict's keys, counters, flags and schedule (not its tensors), checked;
    returns the schedule as :func:`check_schedule` gives it. ValueError naming the bad entry."""
    if not isinstance(state_dict, dict) or state_dict.get("format") != expected_format:
        raise ValueError(f"argument `state_dict` is not a ModelEMA state_dict (expected format {expected_format!r})")
    for key, kinds in _STATE_KEYS.items():
        if key not in state_dict:
            raise ValueError(f"argument `state_dict` lacks the key {key!r} (a truncated or edited ModelEMA state)")
        value = state_dict[key]
        # (True is an int to Python, not a valid count or decay)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise ValueError(
                f"argument `state_dict` has a corrupt {key!r}: expected "
                f"{' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}"
            )
    for key in ("updates", "calls"):
        if not 0 <= state_dict[key] <= _MAX_COUNT:
            raise ValueError(
                f"argument `state_dict` has a corrupt {key!r}: expected an int in [0, 2**63 - 1], "
                f"got {_short(state_dict[key])}"
            )
    try:
        schedule = check_schedule(
            state_dict["decay"],
            state_dict["tau"],
            state_dict["warmup_gamma"],
            state_dict["warmup_power"],
            state_dict["min_decay"],
            state_dict["update_after_step"],
            state_dict["update_every"],
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"argument `state_dict`: {err}") from err
    return schedule


#: The rounding settings a state_dict carries (optional on load: older states lack them).
ROUNDING_KEYS = ("stochastic_rounding", "stochastic_rounding_seed")


def check_rounding_state(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """The rounding settings of a ModelEMA state_dict, checked: ``stochastic_rounding`` (a bool)
    and ``stochastic_rounding_seed`` (an int in [0, 2**63 - 1]), each where present (a state
    saved before they were saved has neither: the EMA keeps its own). ValueError naming a bad one."""
    out: Dict[str, Any] = {}
    for key, kind in (("stochastic_rounding", bool), ("stochastic_rounding_seed", int)):
        if key not in state_dict:
            continue
        value = state_dict[key]
        bad = not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or not 0 <= value <= _MAX_COUNT))
        if bad:
            expected = "a bool" if kind is bool else "an int in [0, 2**63 - 1]"
            raise ValueError(f"argument `state_dict` has a corrupt {key!r}: expected {expected}, got {_short(value)}")
        out[key] = value
    return out


def check_module_state(expected: Dict[str, Any], module_state: Dict[str, Any]) -> None:
    """``module_state`` against the EMA's own module state (``expected``: key -> tensor, a
    DTensor view for a shard, or a module's extra state), before anything is copied
    (``nn.Module.load_state_dict`` copies tensor by tensor and raises only at the end)."""
    missing = [k for k in expected if k not in module_state]
    unexpected = [k for k in module_state if k not in expected]
    if missing or unexpected:
        raise ValueError(
            "argument `state_dict` has a corrupt 'module': it does not match the EMA's module "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]}); a ModelEMA state loads only "
            "into a ModelEMA of the same model"
        )
    for name, e in expected.items():
        if not isinstance(e, torch.Tensor):
            continue  # a module's extra state (get_extra_state): the module checks it
        v = module_state[name]
        where = f"argument `state_dict` has a corrupt 'module' entry {name!r}"
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{where}: expected a tensor, got {type(v).__name__}")
        if v.is_nested:  # first: a nested tensor has no .shape to compare
            raise ValueError(f"{where}: a nested tensor, the EMA has a dense one of shape {tuple(e.shape)}")
        if v.shape != e.shape:
            raise ValueError(f"{where}: shape {tuple(v.shape)}, the EMA has {tuple(e.shape)}")
        if _dtype_kind(v.dtype) != _dtype_kind(e.dtype):
            raise ValueError(f"{where}: dtype {v.dtype} does not convert to the EMA's {e.dtype}")
        if v.is_meta or v.layout != torch.strided:
            raise ValueError(f"{where}: a {v.layout} tensor on {v.device} holds no loadable values")


def load_module_state(
    module: Optional[nn.Module],
    keys: Sequence[Tuple[str, int]],
    ema: List[torch.Tensor],
    refs: List[torch.Tensor],
    module_state: Dict[str, Any],
) -> None:
    """Copies a ``module`` entry checked by :func:`check_module_state` into the EMA: into its
    ``module``, or (a sharded model's EMA, ``module`` None) into each local shard ``ema[i]``
    through its view ``refs[i]`` for every (key, i) of ``keys``. The DTensor entries are
    checked first, so a bad one changes nothing."""
    if module is None:
        for key, i in keys:
            sharded.check_entry(refs[i], module_state[key], key)
        with torch.no_grad():
            for key, i in keys:
                sharded.load_entry(ema[i], refs[i], module_state[key])
        return
    try:
        module.load_state_dict(module_state)
    except (TypeError, ValueError, RuntimeError) as err:  # e.g. a module's own load hook
        raise ValueError(f"argument `state_dict`: {err}") from err
