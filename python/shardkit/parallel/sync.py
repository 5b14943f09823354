"""SyncBN support of ``shardkit.parallel``, with encoding.parallel's API: the cross-device
``allreduce`` autograd function and the ``__data_parallel_replicate__`` replication callbacks.
Device-generic (plain tensor copies and adds), so it also runs on repeated "cpu" devices.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
from torch import nn

__all__ = ["allreduce", "patch_replication_callback", "execute_replication_callbacks", "CallbackContext"]

# The attribute that marks a data-parallel object whose replicate() runs the callbacks.
_PATCHED = "_runs_replication_callbacks"


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, num_inputs: int, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.num_inputs = num_inputs
        return _allreduce_sum(num_inputs, inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None,) + _allreduce_sum(ctx.num_inputs, grads)


def _allreduce_sum(num_inputs: int, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    if num_inputs < 1 or len(tensors) % num_inputs:
        raise ValueError(f"allreduce: expected groups of `num_inputs`={num_inputs} tensors, got {len(tensors)}")
    groups = [tensors[i : i + num_inputs] for i in range(0, len(tensors), num_inputs)]
    root = groups[0][0].device
    totals: list[torch.Tensor] = []
    for j in range(num_inputs):
        total = groups[0][j].clone()
        for g in groups[1:]:
            total += g[j].to(root, non_blocking=root.type == "cuda")
        totals.append(total)
    out = []
    for gi, g in enumerate(groups):
        for j in range(num_inputs):
            dev = g[j].device
            out.append(totals[j] if gi == 0 else totals[j].to(dev, non_blocking=dev.type == "cuda", copy=True))
    return tuple(out)


def allreduce(*inputs: Any) -> tuple[torch.Tensor, ...]:
    """``allreduce(num_inputs, *tensors)``: cross-device all-reduce (sum), differentiable.

    ``tensors`` are K groups of ``num_inputs`` tensors, group k on device k (e.g. each
    replica's ``(sum, square_sum)`` in SyncBN). Returns K * num_inputs tensors: tensor j
    of group k is the sum over groups of tensor j, on group k's device, of its dtype and
    shape. The backward is the same all-reduce of the gradients.

    Raises ``TypeError`` / ``ValueError`` naming the argument: ``num_inputs`` not an int >= 1,
    no tensors, a count that is not a multiple of ``num_inputs``, an entry that is not a
    tensor or is on the meta device, tensor j of a group of another dtype or shape than
    group 0's.
    """
    if not inputs:
        raise TypeError("allreduce(num_inputs, *tensors): argument `num_inputs` is missing")
    num_inputs, tensors = inputs[0], inputs[1:]
    if isinstance(num_inputs, bool) or not isinstance(num_inputs, int):
        raise TypeError(
            f"allreduce(num_inputs, *tensors): argument `num_inputs` must be an int (the tensors per group), "
            f"got {type(num_inputs).__name__}"
        )
    if num_inputs < 1:
        raise ValueError(f"allreduce: argument `num_inputs` must be >= 1, got {num_inputs}")
    if not tensors:
        raise TypeError(
            f"allreduce(num_inputs, *tensors): argument `tensors` is empty; pass groups of `num_inputs`={num_inputs} "
            "tensors, one group per device"
        )
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"allreduce: argument `tensors` must hold tensors, got {type(t).__name__} at index {i}")
        if t.is_meta:
            raise ValueError(f"allreduce: argument `tensors` holds a tensor on the meta device (no data) at index {i}")
    if len(tensors) % num_inputs == 0:
        for i, t in enumerate(tensors[num_inputs:], start=num_inputs):
            first = tensors[i % num_inputs]
            if t.shape != first.shape or t.dtype != first.dtype:  # (a sum over them takes group 0's)
                raise ValueError(
                    f"allreduce: argument `tensors`: tensor {i % num_inputs} of group {i // num_inputs} is "
                    f"{t.dtype}{list(t.shape)}, group 0's is {first.dtype}{list(first.shape)}: each must be alike"
                )
    return _AllReduce.apply(*inputs)


class CallbackContext:
    """Shared by the copies of one sub-module during one replication."""


def execute_replication_callbacks(modules: Sequence[nn.Module]) -> None:
    """Calls ``m.__data_parallel_replicate__(ctx, copy_id)`` on every sub-module of every
    replica that defines it; copy j of a sub-module gets copy_id j and the context shared
    by all copies of that sub-module; the master copy (copy 0) is called first."""
    if isinstance(modules, nn.Module) or not isinstance(modules, Sequence) or not modules:
        raise TypeError(
            f"argument `modules` must be a non-empty list of replicas (nn.Modules), got {type(modules).__name__}"
        )
    for k, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise TypeError(f"argument `modules` must hold nn.Modules, got {type(m).__name__} at index {k}")
    n_sub = len(list(modules[0].modules()))
    ctxs = [CallbackContext() for _ in range(n_sub)]
    for copy_id, module in enumerate(modules):
        for j, m in enumerate(module.modules()):
            callback = getattr(m, "__data_parallel_replicate__", None)
            if callback is not None:
                callback(ctxs[j], copy_id)


def has_replication_callbacks(replicas: Sequence[nn.Module]) -> bool:
    """Whether the replicas (two or more) have sub-modules with replication callbacks
    (SyncBN: its copies then wait for each other inside their forward)."""
    return len(replicas) > 1 and any(
        getattr(m, "__data_parallel_replicate__", None) is not None for m in replicas[0].modules()
    )


def patch_replication_callback(data_parallel: nn.DataParallel) -> None:
    """Makes an existing ``nn.DataParallel`` (or a customised one) run the replication
    callbacks after each replication. A no-op for DataParallelModel, which runs them
    already, and for an object patched before (callbacks never run twice)."""
    if not isinstance(data_parallel, nn.DataParallel):
        raise TypeError(f"argument `data_parallel` must be an nn.DataParallel, got {type(data_parallel).__name__}")
    if getattr(data_parallel, _PATCHED, False):
        return
    old_replicate = data_parallel.replicate

    @functools.wraps(old_replicate)
    def new_replicate(module: nn.Module, device_ids: Sequence[int | torch.device]) -> list[nn.Module]:
        modules = old_replicate(module, device_ids)
        execute_replication_callbacks(modules)
        return modules

    # Patching this object's own method is the point (encoding.parallel's API).
    data_parallel.replicate = new_replicate  # type: ignore[method-assign]
    setattr(data_parallel, _PATCHED, True)
