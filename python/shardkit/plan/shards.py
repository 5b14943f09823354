"""Shard sizes of a class-sharded head that even out memory over devices which already
hold other things (a pipelined backbone's stages, say): the head's bytes go first where
the least is used, like water filling the lowest vessels."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import List, Optional, Union

from shardkit.plan.memory import (
    DTYPE_BYTES,
    OPTIMIZER_STATES,
    _check_choice,
    _check_flag,
    _check_int,
    _head_parts,
    _named_size,
)


def head_bytes_per_class(
    dim: int, dtype: str = "fp32", optimizer: str = "sgd-momentum", master_weights: Optional[bool] = None
) -> int:
    """Bytes one class costs on its device: weight row, its gradient, fp32 master copy (for
    fp16/bf16 unless ``master_weights=False``) and optimizer state (as :func:`plan_memory`).
    ``dim``: an int >= 1; bad arguments raise a ValueError naming them."""
    dim = _check_int("dim", dim, 1)
    dtype = _check_choice("dtype", dtype, DTYPE_BYTES)
    optimizer = _check_choice("optimizer", optimizer, OPTIMIZER_STATES)
    master_weights = _check_flag("master_weights", master_weights)
    master = dtype != "fp32" if master_weights is None else master_weights
    weights, master_bytes, states = _head_parts(1, dim, DTYPE_BYTES[dtype], OPTIMIZER_STATES[optimizer], master)
    flag = 1 if optimizer == "sgd-momentum" else 0  # SparseRowSGD's per-row "seen" flag, as plan_memory
    return weights + master_bytes + states + flag + dim * DTYPE_BYTES[dtype]  # + the gradient row


def balance_shards(
    classes: int,
    dim: int,
    used: Iterable[Union[int, str]],
    dtype: str = "fp32",
    optimizer: str = "sgd-momentum",
    master_weights: Optional[bool] = None,
) -> List[int]:
    """Classes per device (ints summing to ``classes``) such that ``used[k]`` plus device k's
    share of the head is as even as possible over the devices.

    Args:
        classes: C (int >= 1).
        dim: D, the embedding size.
        used: bytes each device holds already (ints or size strings such as "3GiB"), a list
            or any iterable, e.g. ``pipeline.memory_per_device().values()``.
        dtype, optimizer, master_weights: as :func:`shardkit.plan.plan_memory`.

    Returns a list for ``ShardedSoftmaxLoss(..., shard_sizes=...)``: a device already fuller
    than the level the head fills the others to gets no class. Exact (integer arithmetic)
    at any size: the list always sums to ``classes``.

    Raises ``TypeError`` / ``ValueError`` naming the argument: ``classes`` or ``dim`` not an
    int >= 1, an entry of ``used`` that is neither bytes >= 0 nor a size string, an unknown
    ``dtype`` or ``optimizer``.
    """
    classes = _check_int("classes", classes, 1)
    dim = _check_int("dim", dim, 1)
    if isinstance(used, Mapping):
        raise ValueError("argument `used` must list the bytes used on each device, got a mapping: pass its .values()")
    if isinstance(used, (str, bytes)) or not isinstance(used, Iterable):
        raise ValueError(f"argument `used` must list the bytes used on each device, got {used!r}")
    base = [_named_size(f"used[{k}]", u) for k, u in enumerate(used)]
    if not base:
        raise ValueError(f"argument `used` must list the bytes used on each device, got {used!r}")
    per_class = head_bytes_per_class(dim, dtype, optimizer, master_weights)
    # The water level L with sum_k max(0, L - base_k) = classes * per_class, over the n devices
    # below it: add devices in order of their use until the level stops rising past the next.
    # In integers (n * L = total + sum of their bases): floats lost classes at 2**62 bytes.
    order = sorted(range(len(base)), key=lambda k: base[k])
    total, n, below = classes * per_class, 0, 0
    for n in range(1, len(order) + 1):
        below += base[order[n - 1]]
        if n == len(order) or total + below <= n * base[order[n]]:
            break
    # Device k's exact share is num_k / (n * per_class); floors, then the largest remainders.
    active = set(order[:n])
    num = [max(0, total + below - n * base[k]) if k in active else 0 for k in range(len(base))]
    sizes = [x // (n * per_class) for x in num]
    by_remainder = sorted(range(len(base)), key=lambda k: num[k] % (n * per_class), reverse=True)
    for k in by_remainder[: classes - sum(sizes)]:
        sizes[k] += 1
    return sizes
