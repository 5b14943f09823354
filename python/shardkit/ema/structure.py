"""The model side of ``ModelEMA``: finding a model's parameters and buffers, checking them
against the EMA's, and noticing cheaply, on every update, that the model has changed."""

from __future__ import annotations

import copy
import operator
import weakref
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Tuple, cast

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from shardkit.ema.checks import EMA_DTYPES
from shardkit.ema.graph import GraphedEMA
from shardkit.ops._ema import UpdateLists, update_lists

Tensor = torch.Tensor
# (name, owner table, key, is_param) of one parameter or buffer: the tensor is table[key], the
# table a module's _parameters or _buffers (read with dict.get in bulk: a plain dict)
Slot = Tuple[str, Dict[str, Any], str, bool]
# (EMA tensors, indices into the model's tensors) of one device
Groups = Sequence[Tuple[List[Tensor], List[int]]]

__all__ = ["ModelTracker", "check_structure", "check_model", "copy_module", "ema_copy", "apply_update"]


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DataParallel / DistributedDataParallel (and so shardkit's
    DataParallelModel, a DataParallel subclass) and torch.compile wrappers."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
            continue
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _slots(root: nn.Module) -> List[Slot]:
    """(name, owner dict, key, is_param) for every parameter and persistent buffer, once per
    tensor (tied weights appear once, so they are averaged once), in a fixed order.
    Non-persistent buffers (``register_buffer(..., persistent=False)``: caches such as rotary
    tables, which a model may rebuild at another size) are neither averaged nor swapped, as
    timm's ModelEmaV3 (which walks ``state_dict()``) leaves them: the EMA's module keeps its own."""
    out: List[Slot] = []
    seen = set()
    for prefix, mod in root.named_modules():
        tables: Tuple[Tuple[bool, Dict[str, Any]], ...] = ((True, mod._parameters), (False, mod._buffers))
        skip = mod._non_persistent_buffers_set
        for is_param, table in tables:
            for key, t in table.items():
                if t is None or id(t) in seen or (not is_param and key in skip):
                    continue
                seen.add(id(t))
                out.append((f"{prefix}.{key}" if prefix else key, table, key, is_param))
    return out


def slot_tensor(slot: Slot) -> Tensor:
    """The tensor of a slot, as :func:`_slots` found it."""
    _, table, key, _ = slot
    t = table[key]
    assert t is not None  # _slots lists only the entries that hold a tensor
    return t


def _no_model() -> None:  # the model link of an unpickled ModelEMA (a weak reference cannot be pickled)
    return None


def copy_attributes(src: nn.Module, dst: nn.Module, include: Collection[str], exclude: Collection[str]) -> None:
    """``ModelEMA.update_attr``: ``src``'s public non-module attributes set on ``dst`` (only the
    names in ``include`` when given, never those in ``exclude``, never ``training``)."""
    if not isinstance(src, nn.Module):
        raise TypeError(f"argument `model` must be an nn.Module, got {type(src).__name__}")
    for k, v in src.__dict__.items():
        if (include and k not in include) or k.startswith("_") or k in exclude or k == "training":
            continue
        setattr(dst, k, v)


def ema_copy(t: torch.Tensor, device: Optional[torch.device], dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``t`` detached and copied to the EMA's ``device`` and, if averaged (a floating dtype but
    float8, whose buffers are copied), ``dtype`` (None: t's)."""
    dtype = dtype if dtype and t.dtype in EMA_DTYPES else t.dtype
    return t.detach().to(device=device or t.device, dtype=dtype, copy=True)


def copy_module(
    src: nn.Module, slots: Sequence[Slot], device: Optional[torch.device], dtype: Optional[torch.dtype]
) -> nn.Module:
    """The EMA's module: a deep copy of ``src`` in eval mode without gradients, its tensors
    converted on the way (a memo entry per tensor), so that a CPU EMA of a GPU model never
    holds a second copy on the GPU, even transiently."""
    memo: Dict[int, Any] = {}
    for slot in slots:
        original = slot_tensor(slot)
        t = ema_copy(original, device, dtype)
        memo[id(original)] = nn.Parameter(t, requires_grad=False) if slot[3] else t
    for mod in src.modules():  # non-persistent buffers: not averaged, but of the EMA's device and dtype
        for key in mod._non_persistent_buffers_set:
            buf = mod._buffers.get(key)
            if buf is not None and id(buf) not in memo:
                memo[id(buf)] = ema_copy(buf, device, dtype)
    module = copy.deepcopy(src, memo).eval()
    return module.requires_grad_(False)


def check_structure(src: nn.Module, names: Sequence[str], ema: Sequence[Tensor], where: str) -> List[Slot]:
    """``src``'s slots (:func:`_slots`), after checking their names and shapes against the
    EMA's ``names`` / ``ema`` tensors; ValueError naming the first parameter or buffer that
    differs."""
    slots = _slots(src)
    got = [s[0] for s in slots]
    if got != names:
        missing = sorted(set(names) - set(got))
        extra = sorted(set(got) - set(names))
        raise ValueError(
            f"{where}: argument `model` does not have the EMA's structure "
            f"(missing {missing[:5]}, unexpected {extra[:5]}); a parameter or buffer added, "
            "removed or renamed after the EMA was made is not averaged: build a new ModelEMA "
            "(or load its state into one made from the changed model)"
        )
    for slot, e in zip(slots, ema):
        name, t = slot[0], slot_tensor(slot)
        if t.shape != e.shape:
            raise ValueError(
                f"{where}: argument `model` has {name} of shape {tuple(t.shape)}, "
                f"the EMA has {tuple(e.shape)}; the model changed after the EMA was made: "
                "build a new ModelEMA"
            )
        if t.is_floating_point() != e.is_floating_point() or t.is_complex() != e.is_complex():
            raise ValueError(
                f"{where}: argument `model` has {name} of dtype {t.dtype}, the EMA has {e.dtype}; "
                "the model changed after the EMA was made: build a new ModelEMA"
            )
        if t.device.type == "meta":
            raise ValueError(f"{where}: argument `model` has {name} on the meta device (no data to average)")
        if hasattr(e, "placements") or hasattr(t, "placements"):  # a DTensor on either side
            _check_layout(name, t, e, where)
    return slots


def _check_layout(name: str, t: Tensor, e: Tensor, where: str) -> None:
    """The model's tensor ``t`` against the EMA's reference ``e`` when either is a DTensor."""

    def layout(x: Any) -> str:
        return (
            f"a DTensor on {x.device_mesh} with placements {tuple(x.placements)}"
            if hasattr(x, "placements")
            else "a plain tensor"
        )

    if layout(t) != layout(e):
        raise ValueError(
            f"{where}: argument `model` has {name} as {layout(t)}, the EMA holds {layout(e)}; the model was "
            "sharded or unsharded after the EMA was made (FSDP2 registers unsharded parameters between its "
            "forward and backward: update the EMA after the optimizer step), or build a new ModelEMA"
        )


def check_model(slots: Sequence[Slot], where: str) -> None:
    """A model ModelEMA can average, checked at construction: TypeError naming the first complex
    parameter or buffer, float8 (any floating dtype the op does not average) parameter, or sparse
    (or other non-strided) tensor;
    ValueError naming the first tensor on the meta device (a model not yet materialized) or
    not yet initialized (a lazy module before its first forward)."""
    for slot in slots:
        t = slot_tensor(slot)
        if is_lazy(t):
            raise ValueError(
                f"{where}: argument `model` has {slot[0]} not yet initialized (a lazy module such as "
                "nn.LazyLinear); build the ModelEMA after a first forward has given it its shape"
            )
        if t.is_complex():
            raise TypeError(
                f"{where}: argument `model` has {slot[0]} of dtype {t.dtype}; ModelEMA averages "
                "real floating tensors (and copies integer ones): keep a complex value as a real "
                "parameter of torch.view_as_real's shape [..., 2]"
            )
        if slot[3] and t.is_floating_point() and t.dtype not in EMA_DTYPES:
            raise TypeError(
                f"{where}: argument `model` has the parameter {slot[0]} of dtype {t.dtype}; ModelEMA averages "
                "float32, float64, float16 and bfloat16 parameters (float8 buffers are copied, as integer "
                "ones): average the higher-precision weights that float8 training casts from"
            )
        if t.layout != torch.strided or t.is_nested:  # (the EMA's watch and ops read dense memory)
            raise TypeError(
                f"{where}: argument `model` has {slot[0]} of layout {'nested' if t.is_nested else t.layout}, "
                "not a dense tensor; ModelEMA averages dense (strided) parameters and buffers"
            )
        if t.is_meta:
            raise ValueError(
                f"{where}: argument `model` has {slot[0]} on the meta device (no data to average); build the "
                "ModelEMA once the model's weights exist (after to_empty() and their initialization, or a "
                "checkpoint's load)"
            )


def _forget_when_gone(tracker: ModelTracker) -> Callable[[object], None]:
    """The callback of the tracker's weak reference to its model (it holds the tracker weakly)."""
    tracker_ref = weakref.ref(tracker)

    def callback(_: object) -> None:
        t = tracker_ref()
        if t is not None:
            t.forget()

    return callback


class ModelTracker:
    """The tensors of one model, in the EMA's order, with a cheap change check per call.

    Host-only, no device sync: the model's tensors and submodules must be the very objects
    seen at the last full check, and every module's parameter, buffer and child tables must
    keep their sizes (an added tensor or submodule changes one). Anything else runs the full
    :func:`check_structure` again, which names the parameter (or accepts a replacement of
    the same shape and follows it). A tensor reshaped in place (``p.data = ...``) keeps its
    identity: the op raises then, and ``ModelEMA`` re-checks to name it.
    """

    _owner: List[Dict[str, Any]]  # each tensor's owner table, in the EMA's order
    _key: List[str]  # and its key there
    _tables: List[Dict[str, Any]]  # every module's parameter, buffer and child tables
    _sizes: List[int]  # their sizes
    _child_tables: List[Dict[str, Any]]  # (table, key, child) of every submodule
    _child_keys: List[str]
    _child_mods: List[Optional[nn.Module]]
    _tensors: List[Tensor]  # the tensors of the last full check
    _lists: List[Tuple[List[Tensor], UpdateLists]]  # [(the src tensors, their ema_update_lists)]

    def __init__(
        self,
        model: nn.Module,
        names: Sequence[str],
        ema: Sequence[Tensor],
        where: str,
        prepare: Optional[Callable[[nn.Module], None]] = None,
    ) -> None:
        src = _unwrap(model)
        if not isinstance(src, nn.Module):
            raise TypeError(f"{where}: argument `model` must be an nn.Module, got {type(model).__name__}")
        self._names, self._ema, self._prepare = names, ema, prepare
        self.model = weakref.ref(src, _forget_when_gone(self))
        self._snapshot(src, where)

    def forget(self) -> None:
        """Drops every reference to the model's tables, submodules and tensors (the model was
        garbage-collected: the EMA must not keep its tensors alive)."""
        self._owner, self._key, self._tables, self._sizes = [], [], [], []
        self._child_tables, self._child_keys, self._child_mods, self._tensors, self._lists = [], [], [], [], []

    def follows(self, model: nn.Module) -> bool:
        return self.model() is _unwrap(model)

    def _snapshot(self, src: nn.Module, where: str) -> None:
        if self._prepare is not None:  # e.g. reshard an FSDP2 model left unsharded
            self._prepare(src)
        slots = check_structure(src, self._names, self._ema, where)
        # Column lists, so that the per-call check below runs in C (map over builtins and
        # operator functions): ~20 ns per entry instead of a Python generator step.
        self._owner = [table for _, table, _, _ in slots]
        self._key = [key for _, _, key, _ in slots]
        modules = list(src.modules())
        self._tables = [t for mod in modules for t in (mod._parameters, mod._buffers, mod._modules)]
        self._sizes = [len(t) for t in self._tables]
        children = [(mod._modules, k, c) for mod in modules for k, c in mod._modules.items()]
        self._child_tables = [t for t, _, _ in children]
        self._child_keys = [k for _, k, _ in children]
        self._child_mods = [c for _, _, c in children]
        self._tensors = [slot_tensor(s) for s in slots]
        self._lists = []  # [(the src tensors, the argument lists of ema_update_lists)], the newest first

    def lists_for(
        self, groups: Groups, copy_to: List[Tensor], copy_idx: Sequence[int], src: Sequence[Tensor]
    ) -> UpdateLists:
        """The four argument lists of ``shardkit._C.ema_update_lists`` for the tensors of ``src``,
        built once and reused while the same tensor objects come again (each call still runs
        the op's checks and version bumps, but no list is rebuilt or converted to the op's
        arguments). Two sets are kept: a CPU EMA of a GPU model alternates between two sets of
        staging buffers. Only Python lists of the Python tensor objects are kept, no C++
        reference: a conversion that swaps tensors (``torch.utils.swap_tensors``) keeps the
        objects, so the lists stay valid and the next update reads the new values."""
        found = next((e for e in self._lists if len(src) == len(e[0]) and all(map(operator.is_, src, e[0]))), None)
        if found is None:
            model_groups = [[src[i] for i in idx] for _, idx in groups]
            found = (list(src), ([e for e, _ in groups], model_groups, copy_to, [src[i] for i in copy_idx]))
            self._lists = [found] + self._lists[:1]
        return found[1]

    def tensors(self, where: str) -> List[Tensor]:
        tensors = list(map(dict.get, self._owner, self._key))  # a removed entry reads None
        if (
            all(map(operator.is_, tensors, self._tensors))
            and list(map(len, self._tables)) == self._sizes
            and all(map(operator.is_, map(dict.get, self._child_tables, self._child_keys), self._child_mods))
        ):
            return cast(List[Tensor], tensors)  # each one of self._tensors: no None
        model = self.model()
        assert model is not None  # the caller holds it (ModelEMA checks follows() first)
        self._snapshot(model, where)
        return list(self._tensors)


def update_groups(ema: List[Tensor], averaged: Sequence[bool]) -> Tuple[Groups, List[Tensor], List[int]]:
    """How :func:`apply_update` treats ``ema`` (``averaged[i]``: ``ema[i]`` is averaged, else
    copied): the averaged tensors grouped by device, as (EMA tensors, their indices), one
    fused call per device (a model spread over devices, e.g. a pipelined backbone, has its
    EMA spread alike); and the copied tensors with their indices."""
    by_device: Dict[torch.device, List[int]] = {}
    for i, a in enumerate(averaged):
        if a:
            by_device.setdefault(ema[i].device, []).append(i)
    copy_idx = [i for i, a in enumerate(averaged) if not a]
    return [([ema[i] for i in idx], idx) for idx in by_device.values()], [ema[i] for i in copy_idx], copy_idx


def apply_update(
    tracker: Optional[ModelTracker],
    groups: Groups,
    copy_to: List[Tensor],
    copy_idx: Sequence[int],
    src: Sequence[Tensor],
    d: float,
    graph: Optional[GraphedEMA] = None,
    stochastic: Optional[Tuple[int, int, Sequence[int]]] = None,
) -> None:
    """``ModelEMA``'s update of its EMA tensors from ``src`` (the model's, in the EMA's order,
    on the EMA's devices) with decay ``d``: ``groups`` are (EMA tensors, indices into ``src``)
    per device, ``copy_to`` the integer buffers copied from ``src[copy_idx]``. Through the
    tracker's cached lists when there is a tracker (not while torch.compile traces: it calls
    the ops), replayed from a CUDA graph when ``graph`` (ema/graph.py) can, else one fused op
    call per group and one foreach copy. ``stochastic`` = (seed, counter, salts): each group
    through ``ema_update_stochastic_`` instead (its bf16 EMA tensors rounded stochastically, the
    bits of tensor i keyed by ``salts[i]``; eager)."""
    if stochastic is not None:
        seed, counter, salts = stochastic
        for ema_k, idx_k in groups:
            src_k, salts_k = [src[i] for i in idx_k], [salts[i] for i in idx_k]
            torch.ops.shardkit.ema_update_stochastic_.default(ema_k, src_k, d, seed, counter, salts_k)
    elif tracker is not None and not torch.compiler.is_compiling():
        lists = tracker.lists_for(groups, copy_to, copy_idx, src)
        if graph is None or not graph.run(lists, d):
            update_lists(*lists, d)
        return
    else:
        for ema_k, idx_k in groups:
            torch.ops.shardkit.ema_update_.default(ema_k, [src[i] for i in idx_k], d)
    if copy_to:
        torch._foreach_copy_(copy_to, [src[i] for i in copy_idx])
