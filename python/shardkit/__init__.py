"""shardkit: million-class sharded softmax losses, balanced data parallelism and a fused
model-weight EMA for PyTorch, as a C++/CUDA extension.

Public names only; see the README for usage. The wings: :mod:`shardkit.softmax`,
:mod:`shardkit.parallel`, :mod:`shardkit.ema`, :mod:`shardkit.transforms`, :mod:`shardkit.plan`,
all over :mod:`shardkit.ops`; the application :mod:`shardkit.train` sits on top.
"""

import torch  # noqa: F401  (loads libtorch before our extension)

from shardkit import _C  # noqa: F401  (loads the library: registers torch.ops.shardkit.*)
from shardkit import ops  # noqa: F401

__version__ = "0.1.0"


def cuda_built() -> bool:
    """Whether this build of shardkit contains the CUDA kernels.

    ``False`` means every op runs on the CPU only; CUDA tensors passed to an op
    then fail with torch's "no kernel for CUDA" error.
    """
    return bool(_C.cuda_built())


# ---- ema ----
from shardkit.ema import ModelEMA  # noqa: E402
# ---- end ema ----

# ---- sharded cross-entropy ----
from shardkit.softmax import (ArcFace, CombinedMargin, CosFace, ShardedLossOutput,  # noqa: E402
                              ShardedSoftmaxLoss, sharded_cross_entropy)
# ---- end sharded cross-entropy ----

# ---- parallel ----
from shardkit import parallel  # noqa: F401  (shardkit.parallel.DataParallelModel, ...)
# ---- end parallel ----

# ---- distributed ----
from shardkit import distributed  # noqa: F401,E402  (torch.distributed mode, see its docstring)
from shardkit.softmax import (SparseRowSGD, export_full_weight, import_full_weight, load_sharded,  # noqa: E402
                              save_sharded)
# ---- end distributed ----

# ---- normalize ----
from shardkit.transforms import Normalize  # noqa: E402
# ---- end normalize ----

__all__ = [
    "cuda_built",
    "ops",
    # ---- public classes and functions, one block per family ----
    # ema
    "ModelEMA",
    # sharded cross-entropy
    "ShardedSoftmaxLoss",
    "ShardedLossOutput",
    "sharded_cross_entropy",
    "CosFace",
    "ArcFace",
    "CombinedMargin",
    # parallel
    "parallel",
    # distributed
    "distributed", "SparseRowSGD", "save_sharded", "load_sharded", "export_full_weight", "import_full_weight",
    # normalize
    "Normalize",
]
