"""What the mode objects of the sharded loss (:class:`~shardkit.softmax.local.LocalShards`,
:class:`~shardkit.softmax.distributed.ProcessGroupShards`) read of the module that holds
them, as a base class of :class:`shardkit.ShardedSoftmaxLoss`, so the modes depend on it
and not on the module; and the one-process checkpoint form (one class-ordered ``weight``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from shardkit.softmax.margins import Margin

__all__ = ["ShardedHead", "class_ordered_checkpoints"]


class ShardedHead(nn.Module):
    """The attributes and calls of a sharded loss module that its mode object uses
    (:class:`shardkit.ShardedSoftmaxLoss` sets and defines them)."""

    embedding_dim: int
    num_classes: int
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

    sample_generator: Union[torch.Generator, Sequence[torch.Generator], None]  # (a property there)

    if TYPE_CHECKING:  # defined by the module (the first two through its mode object)

        @property
        def class_offsets(self) -> Tuple[int, ...]: ...

        def full_weight(self, device: Union[torch.device, str, int, None] = None) -> torch.Tensor: ...

        @property
        def shard_sizes(self) -> Tuple[int, ...]: ...


def class_ordered_checkpoints(module: ShardedHead) -> None:
    """Make ``module``'s state_dict hold one class-ordered ``weight`` [C, D] whatever its
    shard count, and its load_state_dict take that form (or the per-shard one)."""
    module.register_state_dict_post_hook(_state_dict_post_hook)
    module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)


def _state_dict_post_hook(
    module: ShardedHead, state_dict: Dict[str, Any], prefix: str, local_metadata: Dict[str, Any]
) -> None:
    # One class-ordered `weight` [C, D] replaces the per-shard entries, so checkpoints do
    # not depend on the shard count.
    for k in range(len(module.weight_shards)):
        state_dict.pop(f"{prefix}weight_shards.{k}", None)
    state_dict[prefix + "weight"] = checkpoint_weight(module)


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
    if key not in state_dict:
        shard_keys = [f"{prefix}weight_shards.{k}" for k in range(len(module.weight_shards))]
        if not any(name in state_dict for name in shard_keys):
            # Neither form: report the key state_dict() writes (`weight`), not the per-shard ones;
            # the shards keep their values (loaded from themselves).
            missing.append(key)
            for name, shard in zip(shard_keys, module.weight_shards):
                state_dict[name] = shard.detach()
        return  # per-shard keys (same shard count) load as ordinary parameters
    full = state_dict.pop(key)
    expected = (module.num_classes, module.embedding_dim)
    if not isinstance(full, torch.Tensor) or tuple(full.shape) != expected:
        shape = tuple(full.shape) if isinstance(full, torch.Tensor) else type(full).__name__
        errors.append(
            f"size mismatch for {key}: the checkpoint has {shape}, this module expects {expected} "
            "[num_classes, embedding_dim]"
        )
        # The shards' own values stand in, so the error is this size mismatch alone, not also
        # "missing" per-shard keys the checkpoint was never meant to hold.
        for k, shard in enumerate(module.weight_shards):
            state_dict.setdefault(f"{prefix}weight_shards.{k}", shard.detach())
        return
    for k, (offset, size) in enumerate(zip(module.class_offsets, module.shard_sizes)):
        state_dict[f"{prefix}weight_shards.{k}"] = full[offset : offset + size]


def checkpoint_weight(module: ShardedHead) -> torch.Tensor:
    if len(module.weight_shards) == 1:  # the shard itself, detached (as nn.Module.state_dict gives): no copy
        return module.weight_shards[0].detach()
    devices = {p.device for p in module.weight_shards}
    # Gathering a million-class weight onto one GPU could exhaust it: the CPU holds it.
    return module.full_weight(devices.pop() if len(devices) == 1 else "cpu")
