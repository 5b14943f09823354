"""What DataParallelCriterion weighs each device's loss by: the weight a criterion reports
(:class:`WeightedLoss`, a ``"weight"`` dict entry), else the denominator of a mean criterion
on its chunk (its valid targets, found positionally or by keyword), else the chunk's samples."""

from __future__ import annotations

import inspect
import warnings
from typing import Any, NamedTuple

import torch
from torch import nn

from shardkit.ops._parallel import check_weight
from shardkit.parallel import scatter as U


class WeightedLoss(NamedTuple):
    """What a criterion may return to set its own weight in the cross-device reduction.

    ``loss``: a tensor (or a dict/tuple of tensors) already averaged over this device's
    chunk; ``weight``: what that average was divided by (valid elements, a weight sum):
    a finite, non-negative number or a one-element tensor on any device (no host sync
    needed; its value is not checked).
    """

    loss: Any
    weight: Any


def _call(module: nn.Module, output: Any, targets: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if isinstance(output, tuple):
        return module(*output, *targets, **kwargs)
    return module(output, *targets, **kwargs)


def direct_call(
    module: nn.Module,
    devices: list[torch.device],
    dim: int,
    inputs: Any,
    targets: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """DataParallelCriterion with no device or one: the criterion called directly, as
    encoding.parallel does. A list of per-device outputs of a DataParallelModel over more
    devices (the outputs' batches add up to the targets') cannot be reduced here: refused
    naming the device lists, where the criterion would fail on the list naming neither."""
    where = f"one device ({devices[0]})" if devices else "no device (device_ids=None without a GPU)"
    if type(inputs) is list and len(inputs) > 1:
        target = U.first_batched_tensor((targets, kwargs), dim)
        firsts = [U.first_batched_tensor(out, dim) for out in inputs]
        batch = [t.size(dim) for t in firsts if t is not None]
        if target is not None and len(batch) == len(inputs) and sum(batch) == target.size(dim):
            raise ValueError(
                f"DataParallelCriterion over {where} calls its criterion directly, but got a list of "
                f"{len(inputs)} outputs of {batch} samples, which together make the targets' batch of "
                f"{sum(batch)}: the per-device outputs of a DataParallelModel over {len(inputs)} devices; "
                "give DataParallelCriterion the same device_ids as DataParallelModel"
            )
    if devices:
        targets, kwargs = U.to_device((targets, kwargs), devices[0])
    try:
        return _strip_weight(_call(module, inputs, targets, kwargs))
    except Exception as e:
        if isinstance(inputs, list):
            e.add_note(
                f"(DataParallelCriterion over {where} passed its list input to the criterion as it is; if it "
                "holds a DataParallelModel's per-device outputs, give both the same device_ids)"
            )
        raise


def _chunk_loss(
    module: nn.Module,
    output: Any,
    targets: tuple[Any, ...],
    kwargs: dict[str, Any],
    samples: int,
    auto: bool,
    gate: Any = None,
) -> tuple[Any, Any]:
    """One worker's part of DataParallelCriterion: (loss value, its weight). The weight is
    what the criterion reports, else (when ``auto``) the denominator of its mean on this
    chunk, else the chunk's sample count. ``gate`` (a loss_reduce.ChunkGate): the criterion
    gets ``output`` through it, and it learns the weight (no gradient from a chunk of weight 0)."""
    # (the gated inputs may be changed in place: the criterion runs once, gated)
    result = _call(module, output if gate is None else gate.inputs(output), targets, kwargs)
    value, weight = _split_weight(result)
    if weight is None:
        weight = _auto_weight(module, _target_of(module, output, targets, kwargs), samples) if auto else samples
    if gate is not None:
        gate.weight = weight
    return value, weight


def _target_of(criterion: nn.Module, output: Any, targets: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The criterion's target as a one-element tuple (or empty): the first positional target,
    or, in the keyword form (``criterion(outputs, target=y)``), the keyword argument bound to
    the parameter after the outputs in the criterion's ``forward`` signature. ValueError when
    keywords are given but none can be told to be the target of a criterion that averages
    over its valid targets (the weights would otherwise silently count samples)."""
    if targets or not kwargs:
        return targets
    n_out = len(output) if isinstance(output, tuple) else 1
    try:
        params = list(inspect.signature(criterion.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) > n_out and positional[n_out].name in kwargs:
        return (kwargs[positional[n_out].name],)
    if _weighs_targets(criterion):
        raise ValueError(
            f"DataParallelCriterion: cannot tell which of the keyword arguments {sorted(kwargs)} is the target of "
            f"{type(criterion).__name__} (its forward's parameter after the outputs is not among them); pass the "
            "target positionally: criterion(outputs, target)"
        )
    return ()


_WARNED_FORWARDS: set[type] = set()


def warn_own_forward(criterion: nn.Module) -> None:
    """Once per class: a CrossEntropyLoss / NLLLoss subclass with a forward of its own is still
    weighed by its valid targets, which is exact only when every term of its loss averages over
    them (an auxiliary CE head: yes; a per-image term, e.g. encoding's se_loss: no)."""
    cls = type(criterion)
    base = nn.CrossEntropyLoss if isinstance(criterion, nn.CrossEntropyLoss) else nn.NLLLoss
    if not isinstance(criterion, base) or cls.forward is base.forward or cls in _WARNED_FORWARDS:
        return
    _WARNED_FORWARDS.add(cls)
    warnings.warn(
        f"DataParallelCriterion weighs each device's {cls.__name__} loss by its valid targets (as a "
        f"{base.__name__}), but {cls.__name__} has a forward of its own: the result equals the one-device loss "
        "only if every term it adds averages over those targets. For a term averaged otherwise (e.g. over "
        "images), return shardkit.parallel.WeightedLoss(loss, weight) from the criterion, or reduce per "
        "device with legacy_mean=True",
        stacklevel=3,
    )


def _weighs_targets(criterion: nn.Module) -> bool:
    """Whether a mean criterion's denominator depends on its target (ignore_index, class weight)."""
    if getattr(criterion, "reduction", None) != "mean":
        return False
    return isinstance(criterion, (nn.CrossEntropyLoss, nn.NLLLoss)) or isinstance(
        getattr(criterion, "ignore_index", None), int
    )


def _split_weight(result: Any) -> tuple[Any, Any]:
    """(loss, the weight the criterion reports or None), the weight checked: a tensor or a
    finite, non-negative number (in every device mode, so a criterion fails the same way)."""
    if isinstance(result, WeightedLoss):
        check_weight(result.weight, "WeightedLoss.weight (the criterion's loss weight)")
        return result.loss, result.weight
    if isinstance(result, dict) and "weight" in result:
        check_weight(result["weight"], 'the "weight" entry of the criterion\'s dict')
        rest = type(result)((k, v) for k, v in result.items() if k != "weight")
        return rest, result["weight"]
    return result, None


def _strip_weight(result: Any) -> Any:
    return _split_weight(result)[0]


def _auto_weight(criterion: nn.Module, targets: tuple[Any, ...], samples: int) -> Any:
    """The denominator of a mean-reduced criterion on one chunk, without a host sync."""
    if (
        isinstance(criterion, (nn.CrossEntropyLoss, nn.NLLLoss))
        and criterion.reduction == "mean"
        and targets
        and isinstance(targets[0], torch.Tensor)
    ):
        target = targets[0]
        if target.is_floating_point():  # class probabilities: the mean is over every position
            return target.numel() // target.size(1) if target.dim() > 1 else 1
        valid = target != criterion.ignore_index
        if criterion.weight is None:
            return valid.sum()
        class_weight = criterion.weight.to(target.device)[target.masked_fill(~valid, 0)]
        return (class_weight * valid).sum()
    first = targets[0] if targets else None
    ignore_index = getattr(criterion, "ignore_index", None)
    if (
        getattr(criterion, "reduction", None) == "mean"
        and isinstance(ignore_index, int)
        and isinstance(first, torch.Tensor)
        and not first.is_floating_point()
    ):
        return (first != ignore_index).sum()  # e.g. ShardedSoftmaxLoss: mean over valid rows
    return samples
