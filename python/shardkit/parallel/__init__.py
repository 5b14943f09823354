"""Balanced data parallelism: a drop-in for ``encoding.parallel`` (PyTorch-Encoding).

``DataParallelModel`` returns the per-device outputs instead of gathering them on device 0,
and ``DataParallelCriterion`` computes the loss on every device and reduces it exactly, so
``from encoding.parallel import ...`` becomes ``from shardkit.parallel import ...``.

Modules of the wing: :mod:`~shardkit.parallel.data_parallel` (the two classes),
:mod:`~shardkit.parallel.pipeline` (PipelineModel: a backbone split over devices with
micro-batches pipelined, BatchNorm in :mod:`~shardkit.parallel.pipeline_bn`, the balance plan in
:mod:`~shardkit.parallel.pipeline_plan`, per-task helpers in :mod:`~shardkit.parallel.pipeline_tasks`),
:mod:`~shardkit.parallel.loss_weights` (what each device's loss weighs),
:mod:`~shardkit.parallel.loss_reduce` (the per-device results reduced into one; the gate that
keeps a chunk of weight 0 out of the gradients),
:mod:`~shardkit.parallel.replicate` (per-step replicas),
:mod:`~shardkit.parallel.scatter` (device lists, chunk sizes, splitting arguments, ``gather``),
:mod:`~shardkit.parallel.threads` (per-device calls in threads),
:mod:`~shardkit.parallel.sync` (SyncBN callbacks, ``allreduce``).
"""

from shardkit.parallel.data_parallel import (
    DataParallelCriterion,
    DataParallelModel,
    WeightedLoss,
)
from shardkit.parallel.pipeline import PipelineModel
from shardkit.parallel.replicate import replication_order  # noqa: F401  (tests; not public)
from shardkit.parallel.scatter import gather
from shardkit.parallel.sync import CallbackContext, allreduce, execute_replication_callbacks, patch_replication_callback

__all__ = [
    "allreduce",
    "DataParallelModel",
    "DataParallelCriterion",
    "patch_replication_callback",
    "execute_replication_callbacks",
    "CallbackContext",
    "WeightedLoss",
    "gather",
    "PipelineModel",
]
