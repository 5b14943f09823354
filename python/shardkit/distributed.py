"""The torch.distributed mode of :class:`shardkit.ShardedSoftmaxLoss`: its public names.

``ShardedSoftmaxLoss(D, C, process_group=group)`` splits the classes over the ranks of
``group``; how a step communicates is described in :mod:`shardkit.softmax.collectives`,
the mode itself is :mod:`shardkit.softmax.distributed`.
"""

from shardkit.softmax.collectives import CollectiveError, DistributedInputError, class_offsets, split_classes  # noqa: F401
from shardkit.softmax.sampling import sampled_class_counts  # noqa: F401

__all__ = ["split_classes", "class_offsets", "sampled_class_counts", "CollectiveError", "DistributedInputError"]
