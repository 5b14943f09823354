"""The torch.distributed mode of :class:`shardkit.ShardedSoftmaxLoss`: its public names.

``ShardedSoftmaxLoss(D, C, process_group=group)`` splits the classes over the ranks of
``group``; how a step communicates is described in :mod:`shardkit.softmax.collectives`,
the mode itself is :mod:`shardkit.softmax.distributed`.

The helpers here check their arguments (a ``TypeError`` / ``ValueError`` naming the argument;
Python and numpy integers taken, bool, floats and strings refused) before the internal
ones they call, which trust their callers.
"""

from __future__ import annotations

import numbers
from typing import Any, Iterable, List, Optional

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.softmax import collectives as _collectives
from shardkit.softmax import sampling as _sampling
from shardkit.softmax.collectives import CollectiveError, DistributedInputError  # noqa: F401
from shardkit.softmax.exchange import DistributedNonFiniteError  # noqa: F401

__all__ = [
    "split_classes",
    "class_offsets",
    "ddp_ignore_heads",
    "sampled_class_counts",
    "CollectiveError",
    "DistributedInputError",
    "DistributedNonFiniteError",
]


def _brief(value: Any) -> str:
    # repr, or a huge int's digit count (one-line messages)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"a {len(str(abs(value)))}-digit integer"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(name: str, value: Any, minimum: int, maximum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"argument `{name}` must be an int >= {minimum}, got {type(value).__name__} {_brief(value)}")
    if int(value) < minimum:
        raise ValueError(f"argument `{name}` must be an int >= {minimum}, got {_brief(value)}")
    if maximum is not None and int(value) > maximum:
        raise ValueError(f"argument `{name}` must be an int in [{minimum}, {maximum}], got {_brief(value)}")
    return int(value)


# The most ranks split_classes plans for (it returns a list of that length).
MAX_WORLD_SIZE = 1 << 20


def _ints(name: str, values: Any) -> List[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"argument `{name}` must be a list of ints >= 0, got {type(values).__name__}")
    return [_int(f"{name}[{k}]", v, 0) for k, v in enumerate(values)]


def split_classes(num_classes: int, world_size: int) -> List[int]:
    """Class counts per rank: as even as possible, the first ``num_classes % world_size``
    ranks one class more. Returns a list of ``world_size`` ints summing to ``num_classes``.

    Args:
        num_classes: C (int >= 1).
        world_size: ranks (int in [1, 2**20]).

    Raises ``TypeError`` (not an int: a float, a bool, a string) or ``ValueError`` (out of
    range) naming the argument.
    """
    return _collectives.split_classes(
        _int("num_classes", num_classes, 1), _int("world_size", world_size, 1, MAX_WORLD_SIZE)
    )


def class_offsets(sizes: Iterable[int]) -> List[int]:
    """Start class id of each rank's range, from the per-rank ``sizes`` (ints >= 0): a list
    of ``len(sizes)`` ints. ``TypeError`` / ``ValueError`` naming the entry otherwise."""
    return _collectives.class_offsets(_ints("sizes", sizes))


def sampled_class_counts(sizes: Iterable[int], sample_rate: float, global_batch: int) -> List[int]:
    """PartialFC: classes used per rank this step, host-known so no sync is needed.

    ``K_r = min(C_r, max(ceil(rate * C_r), min(B_g, C_r)))``: at least as many as the batch
    can have distinct positives, so every positive always fits.

    Args:
        sizes: classes per rank (ints >= 0).
        sample_rate: in (0, 1] (``ValueError`` / ``TypeError`` otherwise).
        global_batch: rows of the gathered batch (int >= 0).
    """
    rate = _sampling.check_sample_rate(sample_rate)
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise ValueError(f"argument `sizes` must hold ints >= 0, got {type(sizes).__name__}")
    # numpy integers as Python ones; anything else is refused (ValueError) by the check inside
    counts, batch = [_as_int(v) for v in sizes], _as_int(global_batch)
    return _sampling.sampled_class_counts(counts, rate, batch)


def _as_int(value: Any) -> Any:
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


def ddp_ignore_heads(model: nn.Module) -> List[str]:
    """Lets ``DistributedDataParallel(model)`` wrap a model that holds process-group heads:
    marks every process-group :class:`shardkit.ShardedSoftmaxLoss` shard inside ``model`` (its
    parameters and buffers) for DDP to leave alone. Call it on the unwrapped model, before
    ``DistributedDataParallel(model)``. Without it, DDP copies rank 0's shard over the other
    ranks' when it is built and averages the gradients of different classes; the head's
    forward then raises (``DistributedInputError`` on every rank).

    Call it on the very module given to DDP: on ``torch.compile(model)`` when that is what DDP
    wraps (the names then carry its ``_orig_mod.`` prefix); compiling ``DDP(model)`` instead
    needs it on ``model``. Adds to the names already set for DDP to ignore. Returns the names of ``model``'s
    parameters and buffers DDP will leave alone. ``TypeError`` for a model already wrapped
    (DDP reads the names when it is built), ``ValueError`` when ``model`` holds no
    process-group head.
    """
    from shardkit.softmax.distributed import ProcessGroupShards
    from shardkit.softmax.module import ShardedSoftmaxLoss

    if not isinstance(model, nn.Module):
        raise TypeError(f"argument `model` must be an nn.Module, got {type(model).__name__}")
    if isinstance(getattr(model, "_orig_mod", model), DistributedDataParallel):  # (torch.compile(DDP(m)) too)
        raise TypeError(
            "argument `model` is already a DistributedDataParallel, which reads the names to ignore "
            "when it is built: call ddp_ignore_heads on the model before wrapping it"
        )
    names: List[str] = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, ShardedSoftmaxLoss) and isinstance(module.__dict__.get("_mode"), ProcessGroupShards):
            dot = prefix + "." if prefix else ""
            names += [dot + n for n, _ in module.named_parameters(remove_duplicate=False)]
            names += [dot + n for n, _ in module.named_buffers(remove_duplicate=False)]
    if not names:
        raise ValueError("argument `model` holds no ShardedSoftmaxLoss with a process_group: nothing to ignore")
    before = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    merged = before + [n for n in names if n not in before]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, merged)
    return merged
