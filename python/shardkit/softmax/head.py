"""What the mode objects of the sharded loss (:class:`~shardkit.softmax.local.LocalShards`,
:class:`~shardkit.softmax.distributed.ProcessGroupShards`) read of the module that holds
them, as a base class of :class:`shardkit.ShardedSoftmaxLoss`, so the modes depend on it
and not on the module; and the one-process checkpoint form (one class-ordered ``weight``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from shardkit.softmax.margins import Margin

__all__ = [
    "ShardedHead",
    "class_ordered_checkpoints",
    "checked_weight_loads",
    "current_shards",
    "stand_in_shards",
    "stand_in_weight",
]


class ShardedHead(nn.Module):
    """The attributes and calls of a sharded loss module that its mode object uses
    (:class:`shardkit.ShardedSoftmaxLoss` sets and defines them)."""

    margin: Optional[Margin]
    label_smoothing: float
    ignore_index: int
    reduction: Literal["mean", "sum", "none"]
    chunk_memory: Optional[int]
    memory_budget: Union[int, str]
    check_inputs: Union[bool, Literal["async"]]
    topk: Tuple[int, ...]
    sample_rate: float
    weight_shards: nn.ParameterList
    weight: Optional[torch.Tensor]  # (a class attribute there: None)

    sample_generator: Union[torch.Generator, Sequence[torch.Generator], None]  # (a property there)

    if TYPE_CHECKING:  # defined by the module (class_offsets and full_weight through its mode object)

        @property
        def embedding_dim(self) -> int: ...

        @property
        def num_classes(self) -> int: ...

        @property
        def class_offsets(self) -> Tuple[int, ...]: ...

        def full_weight(self, device: Union[torch.device, str, int, None] = None) -> torch.Tensor: ...

        @property
        def shard_sizes(self) -> Tuple[int, ...]: ...


def check_shard_shapes(module: ShardedHead, shards: Sequence[torch.Tensor], rows: int) -> None:
    """ValueError naming ``weight_shards`` when a shard (of ``shards``, the module's, listed
    once by the caller) was replaced by one of another shape: ``rows`` classes in all (the
    head's, or with a process group this rank's) of width D. A few host operations a step."""
    dim, total = module.embedding_dim, 0
    for p in shards:
        if p.dim() != 2 or p.shape[1] != dim:
            total = -1
            break
        total += p.shape[0]
    if total != rows:
        shapes = [tuple(p.shape) for p in shards]
        raise ValueError(
            f"argument `weight_shards` was changed to shapes {shapes}: this head holds {rows} classes of width "
            f"{dim} (fixed at construction; num_classes, checkpoints and labels follow it); "
            "copy new rows into the shards in place, or build a new head"
        )


def init_bound(fan_in: int) -> float:
    """nn.Linear's init bound, computed as ``kaiming_uniform_(a=sqrt(5))`` computes it (so a
    float64 draw is bit-identical too, not one rounding away as ``1 / sqrt(fan_in)`` would be)."""
    gain = nn.init.calculate_gain("leaky_relu", math.sqrt(5))
    return math.sqrt(3.0) * (gain / math.sqrt(fan_in))


def class_ordered_checkpoints(module: ShardedHead) -> None:
    """Make ``module``'s state_dict hold one class-ordered ``weight`` [C, D] whatever its
    shard count, and its load_state_dict take that form (or the per-shard one)."""
    module.register_state_dict_post_hook(_state_dict_post_hook)
    module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
    module.register_load_state_dict_post_hook(unreport_answered_keys)


def checked_weight_loads(module: ShardedHead) -> None:
    """Make ``module``'s load_state_dict check its weight entries (see :func:`check_weight_entries`)
    before anything is loaded (the distributed mode, whose checkpoints hold ``weight_shards.0``)."""
    module.register_load_state_dict_pre_hook(_check_weight_hook)


def check_weight_entries(module: ShardedHead, state_dict: Dict[str, Any], prefix: str) -> None:
    """Refuse, before anything is loaded, a state dict holding both the class-ordered
    ``weight`` and per-shard ``weight_shards.<k>`` entries (ValueError naming the keys), or a
    weight entry that is a tensor but not a dense floating-point one with data (TypeError
    naming the key; bool or integer rows would load as numbers, a sparse one fails in a copy).
    Non-tensor entries are left to the size-mismatch errors of load_state_dict."""
    full = prefix + "weight"
    # weight_shards.<k> itself; not the entries torch's reparametrizations add beside it
    # (weight_shards.0_orig and weight_shards.0_mask of torch.nn.utils.prune)
    shard_keys = sorted(k for k in state_dict if _shard_index(k, prefix) is not None)
    if full in state_dict and shard_keys:
        per_shard = ", ".join(f"`{k}`" for k in shard_keys)
        raise ValueError(
            f"argument `state_dict` holds both `{full}` (the class-ordered form) and {per_shard} (the per-shard "
            "form); keep one of them"
        )
    for key in [full] + shard_keys:
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        if value.is_nested or value.layout != torch.strided or value.device.type == "meta":
            raise TypeError(
                f"argument `state_dict`: `{key}` must be a dense tensor with data, got layout {value.layout} "
                f"on {value.device}"
            )
        if not value.is_floating_point():
            raise TypeError(f"argument `state_dict`: `{key}` must be floating point, got {value.dtype}")


def _check_weight_hook(
    module: ShardedHead,
    state_dict: Dict[str, Any],
    prefix: str,
    local_metadata: Dict[str, Any],
    strict: bool,
    missing: List[str],
    unexpected: List[str],
    errors: List[str],
) -> None:
    check_weight_entries(module, state_dict, prefix)


def _state_dict_post_hook(
    module: ShardedHead, state_dict: Dict[str, Any], prefix: str, local_metadata: Dict[str, Any]
) -> None:
    # One class-ordered `weight` [C, D] replaces the per-shard entries, so checkpoints do
    # not depend on the shard count.
    if reparametrized(module):
        return  # torch's own entries (the parametrizations' originals), loaded by torch as they are
    entries = [state_dict.pop(f"{prefix}weight_shards.{k}", None) for k in range(len(module.weight_shards))]
    # one shard: its own entry (the Parameter itself with keep_vars=True, as torch gives)
    one = entries[0] if len(entries) == 1 and entries[0] is not None else None
    state_dict[prefix + "weight"] = one if one is not None else checkpoint_weight(module)


def _load_state_dict_pre_hook(
    module: ShardedHead,
    state_dict: Dict[str, Any],
    prefix: str,
    local_metadata: Dict[str, Any],
    strict: bool,
    missing: List[str],
    unexpected: List[str],
    errors: List[str],
) -> None:
    key = prefix + "weight"
    if reparametrized(module):
        if key in state_dict:
            state_dict.pop(key)
            errors.append(
                f"`{key}` is the class-ordered weight of an unparametrized head, but this head's weight shards are "
                "parametrized (torch.nn.utils.parametrize or torch.nn.utils.prune); load it before registering the "
                "parametrization, or load the state dict of a head parametrized alike"
            )
        return
    check_weight_entries(module, state_dict, prefix)
    shard_keys = [f"{prefix}weight_shards.{k}" for k in range(len(module.weight_shards))]
    if key not in state_dict:
        if not any(name in state_dict for name in shard_keys):
            # Neither form: report the key state_dict() writes (`weight`), not the per-shard ones;
            # the shards keep their values (loaded from themselves).
            missing.append(key)
            unreport_keys(module, shard_keys)
            return
        # Per-shard keys (same shard count) load as ordinary parameters, all or none: a partial
        # set (even with strict=False) or one of the wrong shape is an error (load_state_dict's
        # RuntimeError), and every shard then keeps its values.
        absent = [name for name in shard_keys if name not in state_dict]
        if absent:
            given = ", ".join(f'"{name}"' for name in shard_keys if name in state_dict)
            errors.append(
                "per-shard entries load all or none: missing key(s) "
                + ", ".join(f'"{name}"' for name in absent)
                + f" (given {given}); no shard was loaded"
            )
            _hold_back(module, state_dict, shard_keys)
            return
        wrong = [
            (name, _shape(state_dict[name]), tuple(shard.shape))
            for name, shard in zip(shard_keys, module.weight_shards)
            if name in state_dict and _shape(state_dict[name]) != tuple(shard.shape)
        ]
        for name, got, expected in wrong:
            errors.append(f"size mismatch for {name}: the checkpoint has {got}, this module's shard is {expected}")
        if wrong:
            _hold_back(module, state_dict, shard_keys)
        return
    full = state_dict.pop(key)
    expected = (module.num_classes, module.embedding_dim)
    if _shape(full) != expected:
        shape = _shape(full)
        errors.append(
            f"size mismatch for {key}: the checkpoint has {shape}, this module expects {expected} "
            "[num_classes, embedding_dim]"
        )
        # The error is this size mismatch alone, not also "missing" per-shard keys the
        # checkpoint was never meant to hold.
        _hold_back(module, state_dict, shard_keys)
        return
    for k, (offset, size) in enumerate(zip(module.class_offsets, module.shard_sizes)):
        state_dict[f"{prefix}weight_shards.{k}"] = full[offset : offset + size]


def current_shards(module: ShardedHead) -> List[torch.Tensor]:
    """The shards as a forward uses them: first the forward pre-hooks of ``weight_shards``
    (a ParameterList is never called; torch.nn.utils.prune recomputes its pruned shards in
    one), then ``list(weight_shards)``."""
    shards = module.weight_shards
    for hook in list(shards._forward_pre_hooks.values()):
        hook(shards, ())
    return list(shards)


def stand_in_weight(module: ShardedHead) -> Optional[torch.Tensor]:
    """The tensor set as ``module.weight`` to stand in for the shards (what
    torch.func.functional_call sets from a state dict's ``weight``), else None. Read from the
    instance, past any ``weight`` property of a subclass (PartialFC_V2's is its own shard)."""
    value = module.__dict__.get("weight")
    return module._parameters.get("weight") if value is None else value


def reparametrized(module: ShardedHead) -> bool:
    """Whether a shard is no longer a plain Parameter of ``weight_shards``: a parametrization
    (torch.nn.utils.parametrize) or pruning (torch.nn.utils.prune: ``<k>_orig`` and ``<k>_mask``)."""
    shards = module.weight_shards
    if not isinstance(shards, nn.ParameterList):
        return False
    return parametrize.is_parametrized(shards) or any(str(k) not in shards._parameters for k in range(len(shards)))


def _shard_index(key: str, prefix: str) -> Optional[int]:
    """k for the key ``<prefix>weight_shards.<k>``, else None."""
    head = prefix + "weight_shards."
    rest = key[len(head) :] if key.startswith(head) else ""
    return int(rest) if rest.isdigit() and rest.isascii() else None


# Shard keys a load's pre-hook answered for (reported under `weight`, or as an error), which
# torch would report missing as well: its post-hook takes them out of missing_keys. Nothing of
# the shards is put in the state dict in their place: with load_state_dict(assign=True) torch
# would install it as a new Parameter, which the optimizer does not hold.
_UNREPORTED = "_shard_keys_unreported"


def unreport_keys(module: nn.Module, keys: Sequence[str]) -> None:
    module.__dict__.setdefault(_UNREPORTED, set()).update(keys)


def _hold_back(module: nn.Module, state_dict: Dict[str, Any], keys: Sequence[str]) -> None:
    """No shard loads (the load fails with the errors already recorded): the shard keys leave
    the state dict, and they are not reported missing besides."""
    for name in keys:
        state_dict.pop(name, None)
    unreport_keys(module, keys)


def unreport_answered_keys(module: nn.Module, incompatible_keys: Any) -> None:
    """The load post-hook of :func:`unreport_keys`."""
    keys = module.__dict__.pop(_UNREPORTED, set())
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in keys]


def _shape(value: object) -> Union[Tuple[int, ...], str]:
    """A checkpoint entry's shape, or its type's name when it is not a tensor."""
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def checkpoint_weight(module: ShardedHead) -> torch.Tensor:
    if len(module.weight_shards) == 1:  # the shard itself, detached (as nn.Module.state_dict gives): no copy
        return module.weight_shards[0].detach()
    devices = {p.device for p in module.weight_shards}
    # Gathering a million-class weight onto one GPU could exhaust it: the CPU holds it.
    return module.full_weight(devices.pop() if len(devices) == 1 else "cpu")


def new_shards(
    sizes: Sequence[int], dim: int, dtype: Optional[torch.dtype], devices: Sequence[torch.device]
) -> nn.ParameterList:
    """The head's uninitialized [size, dim] weight shards, one per device; a shard its device
    cannot hold is a MemoryError naming the head's size (not the allocator's message)."""
    shards = []
    for size, dev in zip(sizes, devices):
        try:
            shards.append(nn.Parameter(torch.empty(size, dim, dtype=dtype, device=dev)))
        except RuntimeError as err:  # torch.OutOfMemoryError, or the CPU allocator's enforce
            if "alloc" not in str(err).lower() and not isinstance(err, torch.OutOfMemoryError):
                raise
            nbytes = size * dim * (dtype or torch.get_default_dtype()).itemsize
            raise MemoryError(
                f"ShardedSoftmaxLoss: a shard of {size} classes x {dim} (`num_classes`, `embedding_dim`) "
                f"needs {nbytes / 2**30:.1f} GiB on {dev}, which it cannot allocate; shard the classes over "
                "more devices or ranks (`python -m shardkit.plan` sizes it)"
            ) from err
    return nn.ParameterList(shards)


def warn_before_init() -> None:
    """The one-process mode built under a launcher of several processes before
    torch.distributed is initialized: ``process_group=dist.group.WORLD`` is None then, so a
    head meant for the process-group mode silently became a whole head on every rank."""
    import os
    import warnings

    world = os.environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1 and dist.is_available() and not dist.is_initialized():
        warnings.warn(
            f"ShardedSoftmaxLoss: built in the one-process mode (every class on this process) under a launcher of "
            f"WORLD_SIZE={world} processes before torch.distributed.init_process_group: `dist.group.WORLD` is None "
            "until then. For the classes sharded over the processes, build it after init_process_group with "
            "process_group=dist.group.WORLD",
            stacklevel=3,
        )


def stand_in_shards(module: ShardedHead, weight: object, shards: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """``weight`` [C, D] (the class-ordered form of ``state_dict()``) cut into the shards'
    class ranges on their devices, differentiably; TypeError / ValueError naming ``weight``."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"attribute `weight` must be None or a [C, D] tensor, got {type(weight).__name__}")
    expected = (module.num_classes, module.embedding_dim)
    if tuple(weight.shape) != expected or not weight.is_floating_point():
        raise ValueError(
            f"attribute `weight` must be a floating [num_classes, embedding_dim] = {list(expected)} tensor (the "
            f"class-ordered weight of state_dict()), got {weight.dtype} {list(weight.shape)}"
        )
    return [_Dense.apply(weight[off : off + p.shape[0]].to(p.device)) for off, p in zip(module.class_offsets, shards)]


class _Dense(torch.autograd.Function):
    """Identity whose backward makes a row-sparse gradient (a sampled shard's) dense: the
    slicing of a stand-in weight takes only dense ones."""

    @staticmethod
    def forward(ctx: object, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.to_dense() if grad.layout != torch.strided else grad
