"""``shardkit.ModelEMA``: an exponential moving average of a model's weights, updated by the
fused :func:`shardkit.ops.ema_update_` (one pass over memory for all tensors); drop-in for the
ModelEMA of yolov3/ultralytics and timm's ModelEmaV3 (see the class docstring)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Collection, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar, Union

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils.hooks import RemovableHandle

from shardkit.ema import checks, sharded, structure
from shardkit.ema import state as saved
from shardkit.ema.checks import _MAX_COUNT, SCHEDULE, _check_int, _check_step, check_device, schedule_decay
from shardkit.ema.diagnose import named_failure
from shardkit.ema.graph import GraphedEMA
from shardkit.ema.hooks import attach_update
from shardkit.ema.settings import Settings, pickled_state, refreshed_slots, unpickled_state
from shardkit.ema.stage import HostStage
from shardkit.ema.structure import ModelTracker, _unwrap, check_structure, slot_tensor
from shardkit.ema.swap import SwapPairs, swapped
from shardkit.ema.watch import ModuleWatch

ModelT = TypeVar("ModelT", bound=nn.Module)

__all__ = ["ModelEMA"]


class ModelEMA(Settings, nn.Module):
    """Exponential moving average of a model's parameters and buffers.

    Every ``update(model)``: ``e <- e + (1 - d) * (m - e)`` for every floating parameter
    (and floating buffer, unless ``copy_float_buffers``), one fused kernel for all of
    them; integer and float8 buffers (e.g. BatchNorm's ``num_batches_tracked``) are copied.
    A float8 parameter or a tensor on the meta device is refused (TypeError, ValueError).

    Args:
        model: the ``nn.Module`` to average (DataParallel, DistributedDataParallel and
            torch.compile wrappers are unwrapped). ``self.module`` starts as a copy of it.
        decay: float in [0, 1], the (final) decay.
        tau: ramp time constant (finite, > 0): ``d = decay * (1 - exp(-t / tau))`` (ultralytics).
            ``None`` gives a constant decay (timm ModelEmaV3 without warmup).
        updates: initial update count, int in [0, 2**63 - 1] (ultralytics' resume argument;
            ``model, decay, tau, updates`` may be positional, as ultralytics' ModelEMA takes them).
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
        dtype: the EMA's floating tensors' dtype: ``torch.float32``, ``float64``, ``float16`` or
            ``bfloat16`` (e.g. float32 for a bfloat16 model; others raise ValueError); ``None`` keeps the model's.
        device: device of the EMA; ``None`` keeps the model's. A CPU EMA of a CUDA model
            is fed by non-blocking copies into pinned staging buffers (two sets, model
            dtype) and averaged on the CPU once the copy's CUDA event has completed, so
            the training step never waits on it; pending updates are applied before
            ``module``, ``state_dict()`` and ``swap`` are used.
        copy_float_buffers: copy floating buffers (e.g. BatchNorm running stats) instead
            of averaging them (timm's ``exclude_buffers``). Like ``use_warmup`` and
            ``exclude_buffers``, an attribute too: set later, it takes effect at the next update.
        cuda_graph: replay each update from a CUDA graph (decay read from a device scalar; see
            ema/graph.py), for updates bound by host time (many small tensors), where the EMA
            lives on one CUDA device and every pair is contiguous or dense with equal strides;
            captured again (one device sync) when a tensor's address, shape or dtype changes.
            Elsewhere, inside a capture of the caller's and under torch.compile, eager runs.
        use_warmup, exclude_buffers, foreach: timm ModelEmaV3's (bools, or None: not given):
            ``use_warmup=True`` selects the warmup (gamma and power default to 1.0 and 2/3),
            ``False`` the constant decay (tau unused either way); ``exclude_buffers=True``
            is ``copy_float_buffers=True``; ``foreach`` has no effect (one fused kernel).
        stochastic_rounding, stochastic_rounding_seed: timm ModelEmaV3's: a bfloat16 EMA tensor's
            update rounds up or down at random with the fp32 update's expected value, so steps
            below a bf16 ulp (decay 0.9999) add up instead of rounding away; the bits hash (seed,
            ``updates``, tensor, element): runs, resumes, ranks, devices agree. False: to nearest.
            Per tensor, by its dtype at the update: also a part of the EMA converted later.

    ``t`` is ``step`` (an int >= 0) when ``update(model, step=...)`` gives one (timm), else the count of
    applied updates including this one (``self.updates``, 1 on the first update; timm without
    a step uses ``decay`` throughout instead).

    Attributes: ``module`` (the averaged module, eval mode, ``requires_grad=False``;
    ``ema`` is an alias), ``updates``, ``enabled`` (False makes ``update`` a no-op).
    ModelEMA is an ``nn.Module`` holding ``module`` (as timm's ModelEmaV3): ``ema(x)`` calls
    it, ``ema.eval()``, ``ema.to(...)`` and ``ema.named_buffers()`` reach it, and a module
    that holds the EMA saves its weights under ``<name>.module.`` in its own state_dict.
    Inside ``with ema.swap(model):`` ``module``'s tensors hold the model's own: do not read them (:meth:`swap`).

    Sharded models (DTensor parameters or buffers: FSDP2 ``fully_shard``, HSDP, tensor-parallel
    placements; plain tensors may be mixed in): each rank's EMA holds its local shards only
    (``dtype`` applies; ``device`` of the mesh's device type), averaged by the fused op with no
    collective and no full copy. There is no ``module`` (RuntimeError): evaluate with
    :meth:`swap`, checkpoint with :meth:`state_dict` (DTensors for torch.distributed.checkpoint,
    which reshards) or export with :meth:`full_state_dict`. Update after the optimizer step.
    FSDP1 (``FullyShardedDataParallel``'s flat parameters) is refused with a TypeError.
    """

    @torch.inference_mode(False)  # built under torch.inference_mode(), its tensors still take updates
    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        tau: Optional[float] = 2000,
        updates: int = 0,
        *,
        warmup_gamma: Optional[float] = None,
        warmup_power: Optional[float] = None,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        update_every: int = 1,
        dtype: Optional[torch.dtype] = None,
        device: Union[torch.device, str, int, None] = None,
        copy_float_buffers: bool = False,
        cuda_graph: bool = False,
        use_warmup: Optional[bool] = None,
        exclude_buffers: Optional[bool] = None,
        foreach: Optional[bool] = None,
        stochastic_rounding: bool = True,
        stochastic_rounding_seed: int = 0,
    ) -> None:
        super().__init__()
        src = _unwrap(model)
        if not isinstance(src, nn.Module):
            raise TypeError(f"argument `model` must be an nn.Module, got {type(model).__name__}")
        dtype = checks.check_dtype(dtype)
        tau, warmup_gamma, warmup_power, copy_float_buffers = checks.timm_arguments(
            use_warmup, exclude_buffers, foreach, tau, warmup_gamma, warmup_power, copy_float_buffers
        )
        self._set_schedule(decay, tau, warmup_gamma, warmup_power, min_decay, update_after_step, update_every)
        self.copy_float_buffers = bool(copy_float_buffers)
        self.updates = _check_int("updates", updates, 0, _MAX_COUNT)
        self._calls = 0
        self.enabled = True
        self._swapped = False
        self._swap_pairs: Optional[SwapPairs] = None  # inside swap: the pairs exchanged in place
        self._model_ref: Callable[[], Optional[nn.Module]] = weakref.ref(model)
        ema_device = check_device(device)

        b = sharded.build_ema(src, ema_device, dtype)
        slots, self._dtensor, self._refs, self._keys, self._ema = b.slots, b.dtensor, b.refs, b.keys, b.ema
        if b.module is not None:  # registered as the submodule `module`, as timm's ModelEmaV3 holds it
            self._modules["module"] = b.module
        self._names = [name for name, _, _, _ in slots]
        self._tracker: Optional[ModelTracker] = None  # the last model seen and its tensors
        self._stage: Optional[HostStage] = None
        self._cuda_graph = checks.check_bool("cuda_graph", cuda_graph)
        self.stochastic_rounding, self.stochastic_rounding_seed = stochastic_rounding, stochastic_rounding_seed
        self._regroup([s[3] for s in slots])

    def _regroup(self, params: List[bool]) -> None:
        """The update's groups, graph and module watch for the EMA tensors ``self._ema``
        (``params[i]``: tensor i is a parameter); the model's lists are built again."""
        self._params, cp = params, self.copy_float_buffers
        self._averaged = [e.dtype in checks.EMA_DTYPES and (p or not cp) for e, p in zip(self._ema, params)]
        self._avg_groups, self._cp_e, self._cp_idx = structure.update_groups(self._ema, self._averaged)
        self._tracker = None
        self._bf16, self._salts = sharded.rounding_layout(self._ema, self._avg_groups, self._refs, self._dtensor)
        devices = list({e.device for e in self._ema})
        one_gpu = self._cuda_graph and len(devices) == 1 and devices[0].type == "cuda"
        self._graph = GraphedEMA(devices[0]) if one_gpu else None  # (ema/graph.py)
        self._watch = ModuleWatch(self, self._module)

    def _follow_module(self) -> None:
        # ema.module converted (.half(), .float(), .to(): new buffers, parameters of another dtype
        # or device, e.g. ultralytics' validator halving `ema.ema`): read its tensors again.
        if self._watch is not None and not self._watch.changed():
            return
        if self._module is None:  # a sharded model's EMA (or no module): nothing to follow
            self._watch = ModuleWatch(self, None)
            return
        slots = check_structure(self._module, self._names, self._ema, "ModelEMA.update (its module, ema.module)")
        self._ema = self._refs = [slot_tensor(s) for s in slots]
        self._regroup([s[3] for s in slots])

    def __getstate__(self) -> Dict[str, Any]:
        """Pickling (``torch.save(ema)``, ``copy.deepcopy``) keeps weights, schedule, counters
        (staged updates applied first), not the link to the model (:meth:`attach` needs it).
        Inside ``with ema.swap(model):`` too: the copy holds the EMA weights and is not swapped."""
        return pickled_state(self)

    def __setstate__(self, state: Dict[str, Any]) -> None:  # a pickle of an earlier release too
        super().__setstate__(unpickled_state(state))
        slots = refreshed_slots(self._module, self._names, self._dtensor)
        if slots is not None:  # pickled when non-persistent buffers were averaged too
            self._names, self._ema = [s[0] for s in slots], [slot_tensor(s) for s in slots]
            self._refs = self._ema
            self._regroup([s[3] for s in slots])

    # ---- schedule (the attributes: ema/settings.py) --------------------------------------
    def get_decay(self, step: Optional[int] = None) -> float:
        """The decay used at schedule step ``step`` (see the class docstring); ``None``: the
        decay of the next ``update(model)`` without a step (step ``updates + 1``)."""
        step = self.updates + 1 if step is None else step if type(step) is int and step >= 0 else _check_step(step)
        return schedule_decay(step, *(getattr(self, name) for name in SCHEDULE[:-1]))

    # ---- the averaged module -----------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The averaged module (pending CPU-side updates applied first). A sharded model's EMA
        has none (RuntimeError): see :meth:`swap`, :meth:`state_dict`, :meth:`full_state_dict`."""
        if self._module is None:
            raise RuntimeError(sharded.NO_MODULE.format(where="ModelEMA.module"))
        self._flush()
        return self._module

    ema = module  # ultralytics' name

    @property
    def _module(self) -> Optional[nn.Module]:  # None for a sharded model's EMA
        return self._modules.get("module")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``ema(x)``: calls :attr:`module` (timm's ModelEmaV3, e.g. ``validate(model_ema, ...)``);
        refused inside :meth:`swap` (RuntimeError), where ``module`` holds the model's weights."""
        if self._swapped:
            raise checks.in_swap("ModelEMA.forward", checks.CALL_THE_MODEL)
        return self.module(*args, **kwargs)

    def _flush(self) -> None:
        if self._stage is not None:
            self._stage.drain(self._average)  # (each staged update with its decay and counter)

    def _model_tensors(self, model: nn.Module, where: str) -> List[torch.Tensor]:
        tracker = self._tracker
        if tracker is None or not tracker.follows(model):
            prepare = None if self._dtensor is None else sharded.reshard
            self._tracker = tracker = ModelTracker(model, self._names, self._refs, where, prepare)
        tensors = tracker.tensors(where)
        return tensors if self._dtensor is None else sharded.local_tensors(tensors, self._dtensor)

    # ---- update ------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, model: nn.Module, step: Optional[int] = None) -> None:
        """Averages ``model`` (same structure as the EMA) into the EMA. ``step``: the schedule
        step (timm's), an int, numpy integer or one-element integer tensor in [0, 2**63 - 1];
        ``None`` uses ``self.updates``. Anything else raises (TypeError or ValueError naming
        ``step``) before the EMA or its counters change. A model whose tensors changed (added,
        removed, renamed, reshaped) raises ValueError: build a new EMA."""
        if self._swapped:
            raise RuntimeError("ModelEMA.update: called inside `with ema.swap(model)`; update after the block")
        if step is not None and (type(step) is not int or not 0 <= step <= _MAX_COUNT):
            step = _check_step(step)  # the slow path: checks, converts numpy integers
        if not self.enabled:
            return
        calls, n = self._calls + 1, self.updates + 1  # (counted once the update is done: not if it raises)
        if calls % self.update_every:
            self.__dict__["_calls"] = calls
            return
        if self._watch is None or self._watch.changed():
            self._follow_module()
        src = self._model_tensors(model, "ModelEMA.update")
        d = self.get_decay(n if step is None else step)
        if self._ema and self._ema[0].device.type == "cpu" and src[0].is_cuda:  # pinned host staging
            if self._stage is None:
                self._stage = HostStage(src)
            self._stage.push(src, (d, n), self._average)
        else:
            self._flush()  # updates still staged (the model was on the GPU before) go first
            self._average(src, (d, n))
        self.__dict__["_calls"] = calls  # (plain attributes: no nn.Module.__setattr__ on the hot path)
        self.__dict__["updates"] = n

    @torch.no_grad()
    def set(self, model: nn.Module) -> None:
        """Copies ``model``'s tensors into the EMA, counters unchanged (timm's ``set``)."""
        if self._swapped:
            raise RuntimeError("ModelEMA.set: called inside `with ema.swap(model)`; set after the block")
        self._flush()
        self._follow_module()
        for e, m in zip(self._ema, self._model_tensors(model, "ModelEMA.set")):
            e.copy_(m)

    def _average(self, src: Sequence[torch.Tensor], dc: Tuple[float, int]) -> None:
        # The hot path (structure.apply_update, `dc`: the decay and the update count that keys the
        # stochastic rounding's bits); devices are compared on the first and last tensors.
        moved = src and (src[0].device != self._ema[0].device or src[-1].device != self._ema[-1].device)
        if moved:
            src = [m if m.device == e.device else m.to(e.device, non_blocking=True) for e, m in zip(self._ema, src)]
        try:
            tracker = None if moved else self._tracker
            sr = (
                (self.stochastic_rounding_seed, dc[1], self._salts) if self.stochastic_rounding and self._bf16 else None
            )
            structure.apply_update(tracker, self._avg_groups, self._cp_e, self._cp_idx, src, dc[0], self._graph, sr)
        except (RuntimeError, TypeError, ValueError) as err:
            # e.g. a tensor reshaped or converted in place: name it rather than an index of the op's lists
            model = self._tracker.model() if self._tracker is not None else None
            if model is not None:
                check_structure(model, self._names, self._refs, "ModelEMA.update")
            raise named_failure(err, self._names, self._ema, src, self._averaged, self._avg_groups) from err

    # ---- swap --------------------------------------------------------------------------
    @contextlib.contextmanager
    def swap(self, model: ModelT) -> Iterator[ModelT]:
        """``with ema.swap(model): evaluate(model)``: the model holds the EMA weights inside
        the block and its own weights, bit-exactly, after it (also on an exception).

        Same device and dtype: exchanged in place. float32 EMA of a bfloat16 model: packed in
        place (the model sees the EMA rounded to bfloat16; :func:`shardkit.ops.ema_swap_`). Any
        other pair (fp16 model, fp32 EMA; other devices): the model's tensor is stashed in host
        memory meanwhile. No second full copy of the model on its device. Do not modify the
        model or the EMA inside the block, nor read ``ema.module`` (it holds the model's
        weights or packed bits); ``ema(x)``, ``update``, ``set``, ``state_dict`` and
        ``load_state_dict`` raise RuntimeError there.
        """
        if self._swapped:
            raise RuntimeError("ModelEMA.swap: already swapped; swap blocks do not nest")
        self._flush()
        if self._dtensor is not None:  # no unsharded FSDP2 parameters before or after the block
            sharded.reshard(_unwrap(model))
        src = self._model_tensors(model, "ModelEMA.swap")
        try:
            with swapped(self._ema, src, self._names) as self._swap_pairs:
                self._swapped = True
                yield model
        finally:
            if self._dtensor is not None:  # a forward in the block may leave EMA values unsharded
                sharded.reshard(_unwrap(model))
            self._swapped, self._swap_pairs = False, None

    # ---- checkpoints -------------------------------------------------------------------
    def _module_state(self, keep_vars: bool = False) -> Dict[str, Any]:
        self._flush()
        if self._module is not None:
            return self._module.state_dict(keep_vars=keep_vars)
        return {key: self._refs[i] for key, i in self._keys}

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:  # type: ignore[override]
        """Everything to resume: EMA weights (``module``, a plain module state_dict), the
        counters, the schedule and the rounding (``stochastic_rounding`` and its seed). Only
        tensors, numbers, None and strings, so ``torch.load(..., weights_only=True)`` reads it. With
        arguments (``prefix=``, ``keep_vars=``, as a parent module's state_dict calls it),
        ``nn.Module``'s: the EMA weights under ``module.`` (timm ModelEmaV3's keys).

        A sharded model's EMA: ``module`` maps the model's state_dict keys to DTensors over
        this rank's EMA shards (the model's mesh and placements, the EMA dtype), sharing the
        EMA's memory: ``torch.distributed.checkpoint.save(ema.state_dict(), ...)`` saves it,
        and ``sd = ema.state_dict(); torch.distributed.checkpoint.load(sd, ...);
        ema.load_state_dict(sd)`` resumes, also at another world size or mesh (DCP reshards)."""
        if self._swapped:
            raise RuntimeError("ModelEMA.state_dict: called inside `with ema.swap(model)`")
        if args or kwargs:
            self._flush()
            return super().state_dict(*args, **kwargs)
        return {
            "format": saved.FORMAT,
            "module": self._module_state(),
            "updates": self.updates,
            "calls": self._calls,
            **{name: getattr(self, name) for name in SCHEDULE},
            "copy_float_buffers": self.copy_float_buffers,
            "enabled": self.enabled,
            **{key: getattr(self, key) for key in saved.ROUNDING_KEYS},
        }

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Restores what :meth:`state_dict` saved (weights copied into the EMA's tensors,
        keeping its dtype and device), or the weights alone from a timm ModelEmaV3
        ``state_dict()`` (``module.``-prefixed keys; the counters stay as they are).

        All is checked first (keys, counters, schedule; every tensor of ``module`` present, no
        extra one, same shape, dtype of the same kind): a bad one raises ``ValueError`` naming
        it, the EMA unchanged. Weights alone with ``strict=False`` or ``assign=True``:
        ``nn.Module.load_state_dict``'s load. Returns (missing_keys, unexpected_keys).
        Refused inside :meth:`swap`."""
        if self._swapped:
            raise checks.in_swap("ModelEMA.load_state_dict", "load after the block")
        weights_only = saved.timm_state(state_dict)
        if weights_only is not None and (not strict or assign):
            result = super().load_state_dict(state_dict, strict=strict, assign=assign)
            self._follow_module()  # assign=True replaced the module's tensors
            return result
        schedule = None if weights_only is not None else saved.check_state(state_dict, saved.FORMAT)
        rounding = {} if weights_only is not None else saved.check_rounding_state(state_dict)
        module_state = state_dict["module"] if weights_only is None else weights_only
        saved.check_module_state(self._module_state(keep_vars=True), module_state)
        self._follow_module()
        saved.load_module_state(self._module, self._keys, self._ema, self._refs, module_state)
        if schedule is not None:
            self._set_schedule(*schedule)
            self.updates, self._calls, self.enabled = (state_dict[k] for k in ("updates", "calls", "enabled"))
            self.copy_float_buffers = state_dict["copy_float_buffers"]
            self.__dict__.update(rounding)  # (checked above)
        return _IncompatibleKeys([], [])

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        if self._swapped:  # a parent module's load_state_dict, which would load `module` next
            raise checks.in_swap("ModelEMA (a parent module's load_state_dict)", "load after the block")
        super()._load_from_state_dict(*args, **kwargs)

    def full_state_dict(self) -> Dict[str, Any]:
        """:meth:`state_dict` with every tensor whole, in host memory, for export: a sharded
        model's EMA gathers them one at a time (collectives: call it on every rank of the mesh)."""
        return sharded.full_state(self.state_dict(), self._dtensor)

    # ---- conveniences ------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer, model: Optional[nn.Module] = None) -> RemovableHandle:
        """Updates the EMA after every ``optimizer.step()`` (an optimizer step post-hook)
        from ``model`` (default: the model given to the constructor). Returns the hook's
        handle; ``handle.remove()`` detaches."""
        return attach_update(optimizer, model, self._model_ref, self.update)

    def update_attr(
        self, model: nn.Module, include: Collection[str] = (), exclude: Collection[str] = ("process_group", "reducer")
    ) -> None:
        """Copies ``model``'s public non-module attributes to the EMA module (ultralytics):
        only the names in ``include`` when given, never those in ``exclude``."""
        if self._module is None:
            raise RuntimeError(sharded.NO_MODULE.format(where="ModelEMA.update_attr"))
        structure.copy_attributes(_unwrap(model), self._module, include, exclude)

    def __repr__(self) -> str:
        return checks.describe(self.decay, self.tau, self.warmup_gamma, self.warmup_power, self.updates, len(self._ema))
