"""PartialFC class sampling (``torch.ops.shardkit.partial_fc_sample``): fake kernel and
the Python wrapper. The op is random and not differentiable (it returns indices)."""

import os
from typing import Dict, Optional, Tuple

import torch

from shardkit.ops._args import INT64_MAX, int_arg, tensor_arg

__all__ = ["partial_fc_sample"]

# Bytes the op holds per class of the shard (num_local + 1 slots): a float32 score and an int64
# position (csrc/composite/sampling.cpp; ATen calls with int64 indices, so no int32 limit).
_BYTES_PER_CLASS = 4 + 8
_MEMORY: Dict[torch.device, int] = {}  # total memory of a device, read once (no sync)


def _device_memory(device: torch.device) -> int:
    """Total memory of ``device`` in bytes (0 when unknown: no bound is applied)."""
    total = _MEMORY.get(device)
    if total is None:
        total = 0
        if device.type == "cuda":
            if not torch.cuda.is_initialized():
                return 0  # fake CUDA labels (FakeTensorMode on a machine without a GPU): no bound
            total = torch.cuda.get_device_properties(device).total_memory
        elif device.type == "cpu" and hasattr(os, "sysconf"):
            try:
                total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError):
                total = 0
        _MEMORY[device] = total
    return total


def _check_sizes(labels: torch.Tensor, class_offset: int, num_local: int) -> None:
    # The kernel's own checks (>= 0, num_sample's range) stay its (RuntimeError naming them); these
    # refuse what it would turn into an int64 overflow or an allocator's error naming nothing.
    if torch.compiler.is_compiling() or not isinstance(class_offset, int) or not isinstance(num_local, int):
        return  # traced: the sizes come from tensors that exist
    if num_local >= INT64_MAX - class_offset:
        raise ValueError(
            f"argument `num_local` = {num_local}: the shard's class ids class_offset + num_local "
            f"(class_offset={class_offset}) must fit in int64"
        )
    memory = _device_memory(labels.device)
    need = (num_local + 1) * _BYTES_PER_CLASS
    if memory and need > memory:
        raise ValueError(
            f"argument `num_local` = {num_local} cannot be allocated: the op holds {_BYTES_PER_CLASS} bytes per "
            f"class ({need / 2**30:.4g} GiB), more than the {memory / 2**30:.4g} GiB of {labels.device}"
        )


@torch.library.register_fake("shardkit::partial_fc_sample")
def _partial_fc_sample_fake(labels, class_offset, num_local, num_sample, generator=None):
    torch._check(labels.dtype == torch.int64, lambda: f"argument `labels` must be int64, got {labels.dtype}")
    torch._check(labels.dim() == 1, lambda: f"argument `labels` must be 1-D [B], got {labels.dim()} dimensions")
    torch._check(
        0 <= num_sample <= num_local,
        lambda: f"argument `num_sample` must be in [0, num_local={num_local}], got {num_sample}",
    )
    torch._check(
        num_sample >= min(labels.shape[0], num_local),
        lambda: (
            f"argument `num_sample` must be >= min(B={labels.shape[0]}, num_local={num_local}) so that every "
            f"positive class of the batch fits, got {num_sample}"
        ),
    )
    torch._check(
        generator is None or generator.device.type == labels.device.type,
        lambda: f"argument `generator` must be a generator of the labels' device {labels.device}",
    )
    return labels.new_empty(num_sample), torch.empty_like(labels)


def partial_fc_sample(
    labels: torch.Tensor,
    *,
    class_offset: int,
    num_local: int,
    num_sample: int,
    generator: Optional[torch.Generator] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sample ``num_sample`` of a shard's ``num_local`` classes: every positive, then
    uniformly random negatives.

    Args:
        labels: [B] int64 global class ids (other shards' classes and ignore_index allowed).
        class_offset: first global class id of the shard.
        num_local: classes in the shard.
        num_sample: classes to keep, in [min(B, num_local), num_local]: at least as many as
            the batch can have distinct positives in the shard, so every positive fits.
        generator: torch.Generator on the labels' device (default: the device's global one).

    Returns:
        ``(index, remapped)``: index [num_sample] int64, the kept local class ids in
        increasing order; remapped [B] int64, each row's position in ``index`` or -1 when
        its class is not in this shard. Runs on the labels' device without host syncs.

    Raises:
        TypeError: naming the argument: ``labels`` not a tensor, a count that is not an int
            (numpy ints are; strings, floats, bools and None are not), a ``generator`` that
            is not a torch.Generator.
        ValueError: naming ``num_local``: more classes than the labels' device has memory for
            (12 bytes per class), or class ids past the int64 range.
        RuntimeError: naming the argument, for labels not 1-D int64, ``num_local`` < 0,
            ``class_offset`` < 0, ``num_sample`` outside the range above, or a ``generator``
            of another device.
    """
    labels = tensor_arg("labels", labels)
    class_offset = int_arg("class_offset", class_offset)
    num_local, num_sample = int_arg("num_local", num_local), int_arg("num_sample", num_sample)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"argument `generator` must be a torch.Generator or None, got {type(generator).__name__}")
    _check_sizes(labels, class_offset, num_local)
    return torch.ops.shardkit.partial_fc_sample(labels, class_offset, num_local, num_sample, generator=generator)
