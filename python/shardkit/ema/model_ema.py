"""``shardkit.ModelEMA``: an exponential moving average of a model's weights, updated by
the fused :func:`shardkit.ops.ema_update_` (one pass over memory for all tensors).

Drop-in for the ModelEMA of yolov3/ultralytics (``ema.update(model)``, ``ema.ema``,
``ema.updates``, ramp ``decay * (1 - exp(-updates / tau))``) and for timm's ModelEmaV3
(``ema.module``, ``ema.update(model, step=...)``, warmup ``1 - (1 + step / gamma) **
-power`` clamped to ``[min_decay, decay]``, ``update_after_step``).
"""

import contextlib
import copy
import math
import weakref
from typing import Optional

import torch
from torch import nn

from shardkit.ema.checks import (
    _MAX_COUNT,
    _check_int,
    _check_step,
    _short,
    check_device,
    check_module_state,
    check_schedule,
)
from shardkit.ema.stage import HostStage
from shardkit.ema.structure import ModelTracker, _slots, _unwrap, apply_update, check_no_complex, check_structure
from shardkit.ops._ema import ema_swap_, ema_unswap_

__all__ = ["ModelEMA"]

_FORMAT = "shardkit.ModelEMA/1"
# Every key of a state_dict and the types it may hold (load_state_dict names a bad one).
_STATE_KEYS = {
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


def _flat_ok(e: torch.Tensor, m: torch.Tensor) -> bool:
    if e.is_contiguous() and m.is_contiguous():
        return True
    return e.dim() == 4 and e.stride() == m.stride() and e.is_contiguous(memory_format=torch.channels_last)


def _no_model():  # the model link of an unpickled ModelEMA (a weak reference cannot be pickled)
    return None


class ModelEMA:
    """Exponential moving average of a model's parameters and buffers.

    Every ``update(model)``: ``e <- e + (1 - d) * (m - e)`` for every floating parameter
    (and floating buffer, unless ``copy_float_buffers``), one fused kernel for all of
    them; integer buffers (e.g. BatchNorm's ``num_batches_tracked``) are copied.

    Args:
        model: the ``nn.Module`` to average (DataParallel, DistributedDataParallel and
            torch.compile wrappers are unwrapped). ``self.module`` starts as a copy of it.
        decay: float in [0, 1], the (final) decay.
        tau: ramp time constant (finite, > 0): ``d = decay * (1 - exp(-t / tau))`` (ultralytics).
            ``None`` gives a constant decay (timm ModelEmaV3 without warmup).
        warmup_gamma, warmup_power: giving either selects timm's warmup
            ``d = clamp(1 - (1 + s / gamma) ** -power, min_decay, decay)`` with
            ``s = t - update_after_step - 1`` (defaults gamma 1.0, power 2/3; both finite
            and > 0); tau is then unused.
        min_decay: float in [0, decay], lower clamp of the ramp and the warmup.
        update_after_step: int >= 0. The first updates copy the model (d = 0): for
            t <= update_after_step with the ramp, t <= update_after_step + 1 with the
            warmup and the constant decay (exactly timm's rule); the ramp then runs on
            ``t - update_after_step``.
        update_every: int >= 1: only every N-th call of ``update`` does anything.
        dtype: floating dtype of the EMA's floating tensors (e.g. ``torch.float32`` for a
            bfloat16 model); ``None`` keeps the model's.
        device: device of the EMA; ``None`` keeps the model's. A CPU EMA of a CUDA model
            is fed by non-blocking copies into pinned staging buffers (two sets, model
            dtype) and averaged on the CPU once the copy's CUDA event has completed, so
            the training step never waits on it; pending updates are applied before
            ``module``, ``state_dict()`` and ``swap`` are used.
        copy_float_buffers: copy floating buffers (e.g. BatchNorm running stats) instead
            of averaging them (timm's ``exclude_buffers``).
        updates: initial update count, int in [0, 2**63 - 1] (ultralytics' resume argument).

    ``t`` is ``step`` (an int >= 0) when ``update(model, step=...)`` gives one (timm), else the count of
    applied updates including this one (``self.updates``, 1 on the first update; timm without
    a step uses ``decay`` throughout instead).

    Attributes: ``module`` (the averaged module, eval mode, ``requires_grad=False``;
    ``ema`` is an alias), ``updates``, ``enabled`` (False makes ``update`` a no-op).
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        *,
        tau: Optional[float] = 2000,
        warmup_gamma: Optional[float] = None,
        warmup_power: Optional[float] = None,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        update_every: int = 1,
        dtype: Optional[torch.dtype] = None,
        device=None,
        copy_float_buffers: bool = False,
        updates: int = 0,
    ):
        src = _unwrap(model)
        if not isinstance(src, nn.Module):
            raise TypeError(f"argument `model` must be an nn.Module, got {type(model).__name__}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"argument `dtype` must be a floating torch.dtype or None, got {dtype!r}")
        self._set_schedule(decay, tau, warmup_gamma, warmup_power, min_decay, update_after_step, update_every)
        self.copy_float_buffers = bool(copy_float_buffers)
        self.updates = _check_int("updates", updates, 0, _MAX_COUNT)
        self._calls = 0
        self.enabled = True
        self._swapped = False
        self._model_ref = weakref.ref(model)
        device = check_device(device)

        # Copy with the tensors converted on the way (a memo entry per tensor), so a CPU
        # EMA of a GPU model never holds a second copy on the GPU, even transiently.
        memo = {}
        check_no_complex(_slots(src), "ModelEMA")
        for _, table, key, is_param in _slots(src):
            t = table[key].detach()
            t = t.to(device=device or t.device, dtype=dtype if dtype and t.is_floating_point() else t.dtype, copy=True)
            memo[id(table[key])] = nn.Parameter(t, requires_grad=False) if is_param else t
        self._module = copy.deepcopy(src, memo).eval()
        self._module.requires_grad_(False)

        self._names, self._ema, self._avg = [], [], []
        for name, table, key, is_param in _slots(self._module):
            t = table[key]
            self._names.append(name)
            self._ema.append(t)
            self._avg.append(t.is_floating_point() and (is_param or not self.copy_float_buffers))
        self._avg_idx = [i for i, a in enumerate(self._avg) if a]
        self._cp_idx = [i for i, a in enumerate(self._avg) if not a]
        self._avg_e = [self._ema[i] for i in self._avg_idx]
        # One fused call per device: a model spread over devices (a pipelined backbone) has its
        # EMA spread alike, and the op takes the tensors of one device per call.
        by_device = {}
        for i in self._avg_idx:
            by_device.setdefault(self._ema[i].device, []).append(i)
        self._avg_groups = [([self._ema[i] for i in idx], idx) for idx in by_device.values()]
        self._cp_e = [self._ema[i] for i in self._cp_idx]
        self._tracker = None  # the last model seen and its tensors (ModelTracker)
        self._stage = None

    def __getstate__(self):
        """Pickling (``torch.save(ema)``, ``copy.deepcopy``) keeps the weights, schedule and
        counters (pending staged updates applied first), not the weak link to the model:
        :meth:`attach` then needs its ``model`` argument."""
        self._flush()
        return dict(self.__dict__, _model_ref=_no_model, _tracker=None, _stage=None)

    # ---- schedule --------------------------------------------------------------------
    def _set_schedule(self, *args):
        (
            self.decay,
            self.tau,
            self.warmup_gamma,
            self.warmup_power,
            self.min_decay,
            self.update_after_step,
            self.update_every,
        ) = check_schedule(*args)

    def get_decay(self, step: int) -> float:
        """The decay used at schedule step ``step`` (see the class docstring)."""
        uas = self.update_after_step
        if self.warmup_gamma is not None or self.warmup_power is not None:
            s = max(0, step - uas - 1)
            if s <= 0:
                return 0.0
            gamma = 1.0 if self.warmup_gamma is None else self.warmup_gamma
            power = 2.0 / 3.0 if self.warmup_power is None else self.warmup_power
            return max(min(1.0 - (1.0 + s / gamma) ** -power, self.decay), self.min_decay)
        if self.tau is None:
            return 0.0 if step - uas - 1 <= 0 else self.decay
        s = step - uas
        if s <= 0:
            return 0.0
        return max(self.decay * (1.0 - math.exp(-s / self.tau)), self.min_decay)

    # ---- the averaged module -----------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The averaged module (pending CPU-side updates applied first)."""
        self._flush()
        return self._module

    ema = module  # ultralytics' name

    def _flush(self):
        if self._stage is not None:
            self._stage.drain(self._apply)

    def _model_tensors(self, model, where):
        if self._tracker is None or not self._tracker.follows(model):
            self._tracker = ModelTracker(model, self._names, self._ema, where)
        return self._tracker.tensors(where)

    def _feeds_host(self, src) -> bool:
        """Whether this update goes through the pinned host staging (CPU EMA, CUDA model)."""
        return len(self._ema) > 0 and self._ema[0].device.type == "cpu" and src[0].is_cuda

    # ---- update ------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, model: nn.Module, step: Optional[int] = None) -> None:
        """Averages ``model`` (same structure as the EMA) into the EMA.

        ``step``: the schedule step (timm's ``step``), an int (or numpy integer) in
        [0, 2**63 - 1]; ``None`` uses ``self.updates``. Anything else raises (TypeError or
        ValueError naming ``step``) before the EMA or its counters change. A model whose
        tensors changed (added, removed, renamed, reshaped) raises ValueError: build a new EMA.
        """
        if self._swapped:
            raise RuntimeError("ModelEMA.update: called inside `with ema.swap(model)`; update after the block")
        if step is not None and (type(step) is not int or not 0 <= step <= _MAX_COUNT):
            step = _check_step(step)  # the slow path: checks, converts numpy integers
        if not self.enabled:
            return
        self._calls += 1
        if self._calls % self.update_every:
            return
        src = self._model_tensors(model, "ModelEMA.update")
        self.updates += 1
        d = self.get_decay(self.updates if step is None else step)
        if self._feeds_host(src):
            if self._stage is None:
                self._stage = HostStage(src)
            self._stage.push(src, d, self._apply)
        else:
            self._flush()  # updates still staged (the model was on the GPU before) go first
            self._apply(src, d)

    def _apply(self, src, d):
        # The hot path (structure.apply_update: the tracker's cached lists, or one fused op call
        # per device); devices are compared on the first and last tensors.
        moved = src and (src[0].device != self._ema[0].device or src[-1].device != self._ema[-1].device)
        if moved:
            src = [m if m.device == e.device else m.to(e.device, non_blocking=True) for e, m in zip(self._ema, src)]
        try:
            apply_update(None if moved else self._tracker, self._avg_groups, self._cp_e, self._cp_idx, src, d)
        except RuntimeError:
            # e.g. a tensor reshaped in place: name it rather than an index of the op's lists
            model = self._tracker.model() if self._tracker is not None else None
            if model is not None:
                check_structure(model, self._names, self._ema, "ModelEMA.update")
            raise

    # ---- swap --------------------------------------------------------------------------
    @contextlib.contextmanager
    def swap(self, model: nn.Module):
        """``with ema.swap(model): evaluate(model)``: the model holds the EMA weights inside
        the block and its own weights, bit-exactly, after it (also on an exception).

        Same device and dtype: the tensors are exchanged in place. float32 EMA of a
        bfloat16 model: packed in place (the model sees the EMA rounded to bfloat16; see
        :func:`shardkit.ops.ema_swap_`). Any other pair (e.g. float16 model with a float32
        EMA, or EMA and model on different devices): the model's tensor is stashed in
        host memory for the duration. No second full copy of the model on its device.
        Do not modify the model or the EMA inside the block.
        """
        if self._swapped:
            raise RuntimeError("ModelEMA.swap: already swapped; swap blocks do not nest")
        self._flush()
        src = self._model_tensors(model, "ModelEMA.swap")
        ex_e, ex_m, stash = [], [], []
        for e, m in zip(self._ema, src):
            if e.device == m.device and (
                e.dtype == m.dtype or (e.dtype == torch.float32 and m.dtype == torch.bfloat16 and _flat_ok(e, m))
            ):
                ex_e.append(e)
                ex_m.append(m)
            else:
                stash.append((e, m, m.detach().to("cpu", copy=True)))
        with torch.no_grad():
            ema_swap_(ex_e, ex_m)
            for e, m, _ in stash:
                m.copy_(e)
        self._swapped = True
        try:
            yield model
        finally:
            with torch.no_grad():
                ema_unswap_(ex_e, ex_m)
                for _, m, host in stash:
                    m.copy_(host)
            self._swapped = False

    # ---- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything to resume: EMA weights (``module``, a plain module state_dict), the
        counters and the schedule. Only tensors, numbers, None and strings, so
        ``torch.load(..., weights_only=True)`` reads it."""
        if self._swapped:
            raise RuntimeError("ModelEMA.state_dict: called inside `with ema.swap(model)`")
        return {
            "format": _FORMAT,
            "module": self.module.state_dict(),
            "updates": self.updates,
            "calls": self._calls,
            "decay": self.decay,
            "tau": self.tau,
            "warmup_gamma": self.warmup_gamma,
            "warmup_power": self.warmup_power,
            "min_decay": self.min_decay,
            "update_after_step": self.update_after_step,
            "update_every": self.update_every,
            "copy_float_buffers": self.copy_float_buffers,
            "enabled": self.enabled,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores what :meth:`state_dict` saved (weights copied into the EMA's tensors,
        keeping its dtype and device).

        The whole state is checked first (keys, counters, schedule, and every tensor of
        ``module``: present, no extra entry, same shape, a dtype of the same kind); a bad
        one raises ``ValueError`` naming it and leaves the EMA exactly as it was."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != _FORMAT:
            raise ValueError(f"argument `state_dict` is not a ModelEMA state_dict (expected format {_FORMAT!r})")
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
        if bool(state_dict["copy_float_buffers"]) != self.copy_float_buffers:
            raise ValueError(
                "argument `state_dict` was saved with copy_float_buffers="
                f"{state_dict['copy_float_buffers']}, this ModelEMA has {self.copy_float_buffers}"
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
        check_module_state(self._module, state_dict["module"])
        # Everything is checked: from here on nothing raises on a well-formed state.
        self._flush()
        try:
            self._module.load_state_dict(state_dict["module"])
        except (TypeError, ValueError, RuntimeError) as err:  # e.g. a module's own load hook
            raise ValueError(f"argument `state_dict`: {err}") from err
        self._set_schedule(*schedule)
        self.updates = state_dict["updates"]
        self._calls = state_dict["calls"]
        self.enabled = state_dict["enabled"]

    # ---- conveniences ------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer, model: Optional[nn.Module] = None):
        """Updates the EMA after every ``optimizer.step()`` (an optimizer step post-hook)
        from ``model`` (default: the model given to the constructor). Returns the hook's
        handle; ``handle.remove()`` detaches."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"argument `optimizer` must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        ref = weakref.ref(model) if model is not None else self._model_ref

        def hook(opt, args, kwargs):
            m = ref()
            if m is None:
                msg = "no model (garbage-collected, or this EMA was unpickled); attach(optimizer, model)"
                raise RuntimeError(f"ModelEMA.attach: {msg}")
            self.update(m)

        return optimizer.register_step_post_hook(hook)

    def update_attr(self, model, include=(), exclude=("process_group", "reducer")):
        """Copies ``model``'s public non-module attributes to the EMA module (ultralytics):
        only the names in ``include`` when given, never those in ``exclude``."""
        for k, v in _unwrap(model).__dict__.items():
            if (include and k not in include) or k.startswith("_") or k in exclude or k == "training":
                continue
            setattr(self._module, k, v)

    def __repr__(self):
        sched = (
            "warmup"
            if self.warmup_gamma is not None or self.warmup_power is not None
            else "constant"
            if self.tau is None
            else f"ramp(tau={self.tau})"
        )
        return f"ModelEMA(decay={self.decay}, schedule={sched}, updates={self.updates}, tensors={len(self._ema)})"
