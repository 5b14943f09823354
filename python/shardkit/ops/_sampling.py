"""PartialFC class sampling (``torch.ops.shardkit.partial_fc_sample``): fake kernel and
the Python wrapper. The op is random and not differentiable (it returns indices)."""

from typing import Optional, Tuple

import torch

__all__ = ["partial_fc_sample"]


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
        RuntimeError: naming the argument, for labels not 1-D int64, ``num_local`` < 0,
            ``class_offset`` < 0, ``num_sample`` outside the range above, or a ``generator``
            of another device.
    """
    return torch.ops.shardkit.partial_fc_sample(
        labels, int(class_offset), int(num_local), int(num_sample), generator=generator
    )
