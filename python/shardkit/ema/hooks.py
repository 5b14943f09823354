"""``ModelEMA.attach``'s optimizer step post-hook, which updates the EMA after every step."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardkit.ema.structure import _unwrap


def attach_update(
    optimizer: torch.optim.Optimizer,
    model: Optional[nn.Module],
    default_ref: Callable[[], Optional[nn.Module]],
    update: Callable[[nn.Module], None],
) -> RemovableHandle:
    """Registers ``update(model)`` as ``optimizer``'s step post-hook (``model`` held weakly;
    ``None``: the one ``default_ref`` refers to). Arguments are checked before anything
    is registered. Returns the hook's handle."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"argument `optimizer` must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if model is not None and not isinstance(_unwrap(model), nn.Module):
        raise TypeError(f"argument `model` must be an nn.Module, got {type(model).__name__}")
    ref = weakref.ref(model) if model is not None else default_ref

    def hook(opt: torch.optim.Optimizer, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        m = ref()
        if m is None:
            msg = "no model (garbage-collected, or this EMA was unpickled); attach(optimizer, model)"
            raise RuntimeError(f"ModelEMA.attach: {msg}")
        update(m)

    return optimizer.register_step_post_hook(hook)
