"""The sharded softmax loss family: :class:`ShardedSoftmaxLoss` and its functional form,
margins, PartialFC sampling, the row-sparse optimizer and re-shardable checkpoints.

Inside the wing, dependencies point one way: margins, checks -> core -> sampling ->
local (one process) / collectives -> distributed (process group) -> module; checkpoint and
optim work on any head.
"""

from shardkit.softmax.checkpoint import export_full_weight, import_full_weight, load_sharded, save_sharded
from shardkit.softmax.checks import NonFiniteEmbeddingsError
from shardkit.softmax.core import ShardedLossOutput
from shardkit.softmax.local import sharded_cross_entropy
from shardkit.softmax.margins import ArcFace, CombinedMargin, CosFace, Margin
from shardkit.softmax.module import ShardedSoftmaxLoss
from shardkit.softmax.optim import SparseRowSGD

__all__ = [
    "ShardedSoftmaxLoss",
    "ShardedLossOutput",
    "sharded_cross_entropy",
    "CosFace",
    "ArcFace",
    "CombinedMargin",
    "Margin",
    "SparseRowSGD",
    "save_sharded",
    "load_sharded",
    "export_full_weight",
    "import_full_weight",
    "NonFiniteEmbeddingsError",
]
