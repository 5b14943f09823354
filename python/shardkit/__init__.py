"""shardkit: million-class sharded softmax losses, balanced data parallelism and a fused
model-weight EMA for PyTorch, as a C++/CUDA extension.

Public names only; see the README for usage. The wings: :mod:`shardkit.softmax`,
:mod:`shardkit.parallel`, :mod:`shardkit.ema`, :mod:`shardkit.transforms`, :mod:`shardkit.plan`,
all over :mod:`shardkit.ops`; the application :mod:`shardkit.train` sits on top.
"""

# ruff: noqa: I001  (import order matters: torch, the version check, then the extension)
import torch  # noqa: F401  (loads libtorch before our extension)

from shardkit.build import build_info, check_torch_version

check_torch_version()  # before loading _C: a mismatch is a clear ImportError, not an undefined symbol
del check_torch_version  # not public (shardkit.build keeps it)

from shardkit import _C  # noqa: E402, F401  (loads the library: registers torch.ops.shardkit.*)
from shardkit import distributed, ops, parallel, plan  # noqa: E402, F401  (public submodules)
from shardkit.ema import ModelEMA  # noqa: E402
from shardkit.softmax import (  # noqa: E402
    ArcFace,
    CombinedMargin,
    CosFace,
    Margin,
    NonFiniteEmbeddingsError,
    ShardedLossOutput,
    ShardedSoftmaxLoss,
    SparseRowSGD,
    export_full_weight,
    import_full_weight,
    load_sharded,
    save_sharded,
    sharded_cross_entropy,
)
from shardkit.transforms import Normalize  # noqa: E402

__version__ = "0.1.0"


def cuda_built() -> bool:
    """Whether this build of shardkit contains the CUDA kernels.

    ``False`` means every op runs on the CPU only; CUDA tensors passed to an op
    then fail with torch's "no kernel for CUDA" error.
    """
    return bool(_C.cuda_built())


__all__ = [
    "cuda_built",
    "build_info",
    "ops",
    # ema
    "ModelEMA",
    # sharded softmax
    "ShardedSoftmaxLoss",
    "ShardedLossOutput",
    "sharded_cross_entropy",
    "CosFace",
    "ArcFace",
    "CombinedMargin",
    "Margin",
    "NonFiniteEmbeddingsError",
    "SparseRowSGD",
    "save_sharded",
    "load_sharded",
    "export_full_weight",
    "import_full_weight",
    # parallel and distributed
    "parallel",
    "distributed",
    "plan",
    # transforms
    "Normalize",
]
