"""ModelEMA's settings as attributes: the schedule (checked as a whole when one is set), and the
flags that take effect at the next update when set after construction, as timm's ModelEmaV3
reads its attributes at every update: ``copy_float_buffers`` (timm's ``exclude_buffers``) and
``use_warmup``; and the pickled state of a ModelEMA (also inside ``with ema.swap(model):``)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from torch import nn

from shardkit.ema import checks, sharded, structure
from shardkit.ema.swap import copy_unswapped

__all__ = ["Settings", "pickled_state", "unpickled_state"]


class Settings:
    """ModelEMA's attribute assignment (``ema.decay = 0.999``, ``ema.copy_float_buffers = True``,
    checked as the constructor's argument of that name), and timm ModelEmaV3's ``use_warmup`` and
    ``exclude_buffers`` as properties over the schedule and ``copy_float_buffers``: set after
    construction, each takes effect at the next update, as timm's do, and the state_dict saves
    what they select."""

    # the schedule (set from the arguments of the same names, checked)
    decay: float
    tau: Optional[float]
    warmup_gamma: Optional[float]
    warmup_power: Optional[float]
    min_decay: float
    update_after_step: int
    update_every: int
    copy_float_buffers: bool

    def _set_schedule(self, *args: object) -> None:
        vars(self).update(zip(checks.SCHEDULE, checks.check_schedule(*args)))

    def __setattr__(self, name: str, value: Any) -> None:
        # `ema.decay = 0.999` (as timm/ultralytics users write): the schedule is checked as a whole
        if name in checks.SCHEDULE and "update_every" in vars(self):
            return self._set_schedule(*(value if n == name else getattr(self, n) for n in checks.SCHEDULE))
        value = checks.checked_attribute(name, value)
        ema: Any = self
        regroup = name == "copy_float_buffers" and "_params" in vars(self)  # a built EMA: group its tensors again
        if regroup:
            ema._flush()  # (staged updates as they were made)
        super().__setattr__(name, value)
        if regroup:
            ema._regroup(ema._params)

    @property
    def use_warmup(self) -> bool:
        """timm's: whether the warmup schedule is selected (``warmup_gamma`` / ``warmup_power``
        given). Set True: the warmup (gamma 1.0 and power 2/3 where not set); False: the
        constant decay (``tau``, ``warmup_gamma`` and ``warmup_power`` become None), as the
        constructor's ``use_warmup`` does."""
        return self.warmup_gamma is not None or self.warmup_power is not None

    @use_warmup.setter
    def use_warmup(self, value: bool) -> None:
        flag = checks.check_bool("use_warmup", value)  # (None means "not given" to the constructor)
        tau, gamma, power, _ = checks.timm_arguments(
            flag, None, None, self.tau, self.warmup_gamma, self.warmup_power, self.copy_float_buffers
        )
        schedule = {**vars(self), "tau": tau, "warmup_gamma": gamma, "warmup_power": power}
        self._set_schedule(*(schedule[name] for name in checks.SCHEDULE))

    @property
    def exclude_buffers(self) -> bool:
        """timm's name of ``copy_float_buffers`` (floating buffers copied, not averaged)."""
        return self.copy_float_buffers

    @exclude_buffers.setter
    def exclude_buffers(self, value: bool) -> None:
        self.copy_float_buffers = checks.check_bool("exclude_buffers", value)


def pickled_state(ema: Any) -> Dict[str, Any]:
    """``ModelEMA.__getstate__``: its attributes without the links to the model and to its own
    tables (weak references, the host staging, the module watch). Inside ``with ema.swap(model):``
    a deep copy holding the EMA's own weights, not swapped (the block goes on unchanged)."""
    ema._flush()
    state = dict(vars(ema), _model_ref=structure._no_model, _tracker=None, _stage=None, _watch=None)
    if not ema._swapped:
        return state
    return copy_unswapped(dict(state, _swapped=False, _swap_pairs=None), ema._swap_pairs)


def unpickled_state(state: Dict[str, Any]) -> Dict[str, Any]:
    """A pickled ModelEMA's state with the attributes an earlier release did not pickle."""
    state = sharded.with_rounding(state)
    if "_params" not in state:  # which tensors are parameters: the module's, else the averaged ones
        module = state["_modules"].get("module")
        n = len(state["_ema"])
        averaged = [i in {i for _, idx in state["_avg_groups"] for i in idx} for i in range(n)]
        params: List[bool] = [s[3] for s in structure._slots(module)] if module is not None else averaged
        state = dict(state, _params=params, _averaged=averaged, _swap_pairs=None)
    return state


def refreshed_slots(module: Optional[nn.Module], names: List[str], dtensor: object) -> Optional[List[Any]]:
    """The slots of an unpickled EMA's ``module`` where they differ from its pickled ``names``
    (an EMA pickled when non-persistent buffers were averaged too), else None."""
    if module is None or dtensor is not None:
        return None
    slots = structure._slots(module)
    return slots if [s[0] for s in slots] != names else None
