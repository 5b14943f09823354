"""The memory budget of the sharded loss: how many bytes a forward may hold for its backward
so that the backward need not recompute the logits it kept (``memory_budget``).

Without a budget the backward recomputes every chunk's logits: a fourth GEMM beside the
layer's three. With one, the forward keeps the logits of as many class chunks as fit (see
:func:`shardkit.ops.kept_chunks_for_budget`) until the backward, which forms those chunks'
gradients from them. The results are the same at every budget.

The budget is per device: the shards of one device share it in proportion to their classes.
"auto" takes :data:`AUTO_SHARE` of the memory the device has available at each forward (on the
CPU, ``MemAvailable`` of ``/proc/meminfo``; on CUDA, :func:`cuda_available_bytes`). CUDA shards
keep logits only with ``SHARDKIT_CUDA_KEEP=1`` (:func:`shardkit.ops._kept.cuda_keep_enabled`:
the CUDA kept path is experimental until measured on a GPU); without it they recompute whatever
the budget, and an "auto" budget there resolves to 0 without asking the device.
"""

import os
import re
from numbers import Integral
from typing import List, Optional, Sequence, Union

import torch

from shardkit.ops._kept import cuda_keep_enabled
from shardkit.softmax.checks import parse_memory

#: Share of the device's available memory an "auto" budget takes at each forward: the loss's
#: backward still has to allocate the weight gradient and the backbone's gradients after it.
AUTO_SHARE = 0.25

Budget = Union[int, str]


#: What ``memory_budget="full"`` grants per device: every chunk's logits are kept, whatever
#: their size (the planner's "full" budget).
FULL_BYTES = 1 << 62


def check_memory_budget(value: Budget) -> Budget:
    """``memory_budget`` as bytes (int >= 0), ``"auto"`` or ``"full"``: an int, a size string
    such as ``"2GiB"`` or ``"512MB"``, 0 / ``"0"`` (keep nothing), ``"auto"``, or ``"full"``
    (keep every chunk's logits). ValueError / TypeError naming the argument otherwise."""
    if isinstance(value, str) and value.strip().lower() in ("auto", "full"):
        return value.strip().lower()
    if isinstance(value, str) and re.fullmatch(r"\s*0+(\.0*)?\s*(b|kb|mb|gb|kib|mib|gib)?\s*", value, re.IGNORECASE):
        return 0  # "0", "0B", "0 MiB": keep nothing (parse_memory takes positive sizes only)
    if isinstance(value, Integral) and not isinstance(value, bool) and int(value) == 0:
        return 0
    if isinstance(value, Integral) and not isinstance(value, bool) and int(value) < 0:
        raise ValueError(
            f"argument `memory_budget` must be >= 0 bytes, a size like '2GiB', 'auto' or 'full', got {value!r}"
        )
    try:
        return parse_memory(value, "memory_budget")
    except ValueError as err:
        raise ValueError(f"{err} (or 'auto', 'full', or 0 to keep nothing)") from None


@torch.compiler.assume_constant_result
def cpu_available_bytes() -> int:
    """Bytes the CPU can still allocate: ``MemAvailable`` of /proc/meminfo where readable
    (Linux), else the free physical pages. Read at trace time under torch.compile (the
    compiled graph keeps the value it saw)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


@torch.compiler.assume_constant_result
def cuda_available_bytes(index: Optional[int]) -> int:
    """Bytes CUDA device ``index`` (None: the current one) can still give tensors: the driver's
    free memory (``torch.cuda.mem_get_info``) plus what torch's caching allocator holds unused
    there (reserved minus allocated; after the first training step most free memory sits in
    that cache). Read at trace time under torch.compile (the compiled graph keeps the value)."""
    if index is None:
        index = torch.cuda.current_device()
    free, _total = torch.cuda.mem_get_info(index)
    return int(free + torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index))


def device_budget(budget: Budget, device: torch.device) -> int:
    """The bytes a budget grants on ``device``: the budget itself, or for "auto"
    :data:`AUTO_SHARE` of the available memory: the CPU's, or a CUDA device's with
    ``SHARDKIT_CUDA_KEEP=1`` (0 otherwise, and on other devices, which keep nothing)."""
    if budget == "full":
        return FULL_BYTES if device.type == "cpu" or (device.type == "cuda" and cuda_keep_enabled()) else 0
    if budget != "auto":
        return int(budget)
    if device.type == "cpu":
        return int(AUTO_SHARE * cpu_available_bytes())
    if device.type == "cuda" and cuda_keep_enabled():
        return int(AUTO_SHARE * cuda_available_bytes(device.index))
    return 0


def shard_budgets(budget: Budget, shards: Sequence[torch.Tensor]) -> List[int]:
    """Bytes per shard: each device's budget split over the shards it holds in proportion to
    their classes (rounded down, so the device's total stays within it)."""
    if budget == 0:
        return [0] * len(shards)
    classes: dict[torch.device, int] = {}
    for w in shards:
        classes[w.device] = classes.get(w.device, 0) + w.shape[0]
    granted = {dev: device_budget(budget, dev) for dev in classes}
    return [granted[w.device] * w.shape[0] // max(classes[w.device], 1) for w in shards]
