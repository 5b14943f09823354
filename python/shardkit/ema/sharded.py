"""ModelEMA of a sharded model: parameters and buffers that are DTensors (FSDP2's
``fully_shard``, HSDP on a 2-D DeviceMesh, tensor-parallel placements), alone or mixed with
plain tensors.

Each rank's EMA holds only its local shards, in the EMA dtype, and averages them with the
same fused op as for a plain model: no collective and no full copy of any tensor, at
construction or update (the model is never deep-copied: FSDP2 refuses that, and it would
be a full copy). Beside each local EMA shard the EMA keeps a DTensor view of it with the
model tensor's mesh and placements, for checkpoints (``torch.distributed.checkpoint``
reshards between world sizes) and for a gathered export.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from shardkit.ema.structure import Slot, _slots, check_model, copy_module, ema_copy, slot_tensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "build_ema",
    "dtensor_type",
    "reshard",
    "check_not_fsdp1",
    "build_local_ema",
    "state_keys",
    "check_entry",
    "load_entry",
    "local_tensors",
]


#: ModelEMA's error where a sharded model's EMA has no module ({where}: the method).
NO_MODULE = (
    "{where}: this EMA averages a sharded (DTensor) model and holds only this rank's shards, no "
    "module of its own (that would be a full copy); evaluate with `with ema.swap(model):`, save "
    "with ema.state_dict() (torch.distributed.checkpoint) or export with ema.full_state_dict()"
)


def dtensor_type() -> Optional[type[DTensor]]:
    """torch's DTensor class, or None while ``torch.distributed.tensor`` is not imported (no
    DTensor can exist then, and a plain model does not pay for the import)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def check_not_fsdp1(src: nn.Module, where: str) -> None:
    """TypeError for a model wrapped by FSDP1 (``FullyShardedDataParallel``): its flat
    parameters hold each rank's slice of several tensors flattened together, with no
    per-tensor shard to average or to put back."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp1 = getattr(fsdp, "FullyShardedDataParallel", None) if fsdp is not None else None
    if fsdp1 is None:
        return
    for name, mod in src.named_modules():
        if isinstance(mod, fsdp1):
            raise TypeError(
                f"{where}: argument `model` is wrapped by FSDP1 (FullyShardedDataParallel at "
                f"{name or 'the root'}), whose flat parameters mix slices of several tensors; shard the "
                "model with FSDP2 instead (torch.distributed.fsdp.fully_shard, whose DTensor parameters "
                "ModelEMA averages shard by shard)"
            )


def reshard(model: nn.Module) -> None:
    """Reshards every FSDP2 module of ``model`` (``FSDPModule.reshard``: frees the unsharded
    parameters and registers the sharded ones; no communication). FSDP2 keeps a module
    unsharded after a forward without backward where it does not reshard after forward (the
    root, by default): its registered parameters are then plain whole tensors, which the EMA
    neither averages nor swaps, and which a later forward would reuse as they are."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp2 = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    if fsdp2 is not None:
        for mod in model.modules():
            if isinstance(mod, fsdp2):
                mod.reshard()


def local_tensors(tensors: Sequence[torch.Tensor], dtensor: type[DTensor]) -> List[torch.Tensor]:
    """The local shard of each DTensor of ``tensors`` (the others as they are). Read on every
    update: FSDP2 may give a parameter a new local tensor (e.g. at its lazy initialization)."""
    return [t._local_tensor if type(t) is dtensor else t for t in tensors]


class BuiltEMA(NamedTuple):
    """What :func:`build_ema` gives ModelEMA."""

    slots: List[Slot]  # the model's
    dtensor: Optional[type[DTensor]]  # DTensor for a sharded model's EMA, else None
    module: Optional[nn.Module]  # the averaged copy of a plain model (None when sharded)
    ema: List[torch.Tensor]  # the EMA tensors, in the slots' order
    refs: List[torch.Tensor]  # what the model's tensors are checked against
    keys: List[Tuple[str, int]]  # (state_dict key, tensor index) of a sharded model's EMA


def build_ema(src: nn.Module, device: Optional[torch.device], dtype: Optional[torch.dtype]) -> BuiltEMA:
    """ModelEMA's tensors for model ``src``: a plain model's copy (the module, its tensors
    converted on the way), or for a sharded model (DTensor parameters or buffers) no module:
    each rank keeps its local shards, with DTensor views of them as the references (FSDP2
    refuses deepcopy, and a copy would be a full one)."""
    slots = _slots(src)
    check_model(slots, "ModelEMA")
    check_not_fsdp1(src, "ModelEMA")
    dtensor = dtensor_type()
    if not any(type(table[key]) is dtensor for _, table, key, _ in slots):
        module = copy_module(src, slots, device, dtype)
        ema = [slot_tensor(s) for s in _slots(module)]
        return BuiltEMA(slots, None, module, ema, ema, [])
    ema, refs = build_local_ema(slots, device, dtype, "ModelEMA")
    return BuiltEMA(slots, dtensor, None, ema, refs, state_keys(src, slots))


def build_local_ema(
    slots: Sequence[Slot], device: Optional[torch.device], dtype: Optional[torch.dtype], where: str
) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """For each slot of the model (:func:`shardkit.ema.structure._slots`): the EMA tensor (a
    copy of the local shard, converted to ``dtype`` / ``device``) and its reference view (a
    DTensor over that very memory with the model tensor's mesh, placements, global shape and
    strides; the EMA tensor itself for a plain one). Copies one shard at a time."""
    dtensor = dtensor_type()
    ema: List[torch.Tensor] = []
    views: List[torch.Tensor] = []
    for slot in slots:
        name, t = slot[0], slot_tensor(slot).detach()
        loc = t._local_tensor if type(t) is dtensor else t
        if type(t) is dtensor and device is not None and device.type != t.device_mesh.device_type:
            raise ValueError(
                f"{where}: argument `device` is {device}, but {name} is a DTensor on a "
                f"{t.device_mesh.device_type} mesh; the EMA of a sharded model lives on its mesh's device type"
            )
        e = ema_copy(loc, device, dtype)
        view = e
        if type(t) is dtensor:
            view = dtensor.from_local(e, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
            # the view must be the EMA's memory (a checkpoint loads into it in place)
            assert view._local_tensor.data_ptr() == e.data_ptr() or e.numel() == 0
        ema.append(e)
        views.append(view)
    return ema, views


def state_keys(src: nn.Module, slots: Sequence[Slot]) -> List[Tuple[str, int]]:
    """(state_dict key, slot index) for every tensor of ``src.state_dict()``: parameters and
    persistent buffers, tied tensors under each of their names, as the model saves them."""
    index = {id(table[key]): i for i, (_, table, key, _) in enumerate(slots)}
    out = []
    for k, v in src.state_dict(keep_vars=True).items():
        if isinstance(v, torch.Tensor) and id(v) in index:
            out.append((k, index[id(v)]))
    return out


def check_entry(view: torch.Tensor, value: object, key: str) -> None:
    """A state-dict entry for a sharded EMA tensor (``view``) that :func:`load_entry` can
    load: a DTensor must have the view's mesh and placements. ValueError naming ``key``."""
    dtensor = dtensor_type()
    if type(view) is dtensor and type(value) is dtensor:
        if value.device_mesh != view.device_mesh or tuple(value.placements) != tuple(view.placements):
            raise ValueError(
                f"argument `state_dict` has {key!r} as a DTensor on {value.device_mesh} with placements "
                f"{tuple(value.placements)}, the EMA's is on {view.device_mesh} with {tuple(view.placements)}; "
                "load a checkpoint of another layout with torch.distributed.checkpoint.load into "
                "ema.state_dict() (it reshards), or pass a gathered state (ema.full_state_dict())"
            )


def load_entry(ema: torch.Tensor, view: torch.Tensor, value: torch.Tensor) -> None:
    """Copies a state-dict tensor (checked by :func:`check_entry`) into one EMA tensor
    (``view``: its DTensor view, or the tensor itself).

    ``value`` may be the view itself (``torch.distributed.checkpoint`` loaded into it: nothing
    to copy), a DTensor of the same mesh and placements (its local shard is copied), or a
    whole tensor (a gathered state dict, or a plain model's EMA): this rank cuts its shard out
    of it without communication."""
    dtensor = dtensor_type()
    if type(view) is not dtensor:
        ema.copy_(value.full_tensor() if type(value) is dtensor else value)  # full_tensor: a collective
        return
    if type(value) is dtensor:
        local = value.to_local()
    else:
        from torch.distributed.tensor import distribute_tensor

        # src_data_rank=None: every rank takes its own shard of the whole tensor it holds
        local = distribute_tensor(value.detach(), view.device_mesh, view.placements, src_data_rank=None).to_local()
    if local.data_ptr() != ema.data_ptr() or local.shape != ema.shape or local.stride() != ema.stride():
        ema.copy_(local)


def full_state(state: Dict[str, Any], dtensor: Optional[type[DTensor]]) -> Dict[str, Any]:
    """``ModelEMA.full_state_dict``: ``state`` (a ModelEMA state_dict) with every tensor of its
    ``module`` whole (DTensors gathered one at a time: a collective) and in host memory."""
    state["module"] = {
        k: (v.full_tensor() if dtensor is not None and type(v) is dtensor else v).cpu()
        for k, v in state["module"].items()
    }
    return state


def rounding_layout(
    ema: Sequence[torch.Tensor],
    groups: Sequence[Tuple[List[torch.Tensor], List[int]]],
    refs: Sequence[torch.Tensor],
    dtensor: Optional[type[DTensor]],
) -> Tuple[bool, List[int]]:
    """(whether an averaged EMA tensor is bf16, the salt of each tensor's stochastic-rounding
    bits): its index in the model, and for a DTensor's local shard where that shard lies in the
    whole tensor, so replicas round alike and shards of one tensor apart."""
    bf16 = any(ema[i].dtype == torch.bfloat16 for _, idx in groups for i in idx)
    salts = list(range(len(ema)))
    if bf16 and dtensor is not None:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        for i, ref in enumerate(refs):
            if type(ref) is dtensor:
                _, offset = compute_local_shape_and_global_offset(ref.shape, ref.device_mesh, ref.placements)
                salts[i] = hash((i, *offset)) & (2**62 - 1)  # (ints hash alike in every process)
    return bf16, salts


def with_rounding(state: Dict[str, Any]) -> Dict[str, Any]:
    """A pickled ModelEMA's state with the stochastic rounding's attributes (their defaults and
    layout where it was pickled before they existed)."""
    if "_salts" in state:
        return state
    layout = rounding_layout(state["_ema"], state["_avg_groups"], state["_refs"], state["_dtensor"])
    return {
        "stochastic_rounding": True,
        "stochastic_rounding_seed": 0,
        **state,
        "_bf16": layout[0],
        "_salts": layout[1],
    }
