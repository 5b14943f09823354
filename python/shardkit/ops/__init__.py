"""The functional operators of shardkit (``torch.ops.shardkit.*``), with fake kernels
(so ``torch.compile`` traces them) and autograd where they are differentiable.

One private module per op family; this module re-exports the public functions.
"""

# ---- ema ----
from shardkit.ops._ema import ema_swap_, ema_unswap_, ema_update_, ema_update_device_decay_  # noqa: F401

# ---- end ema ----
# ---- sharded cross-entropy ----
from shardkit.ops._kept import (  # noqa: F401
    chunk_classes_for_budget,
    kept_bytes,
    kept_chunks_for_budget,
    kept_logits_dtype,
)

# ---- end distributed ----
# ---- normalize ----
from shardkit.ops._normalize import normalize_images  # noqa: F401

# ---- end sharded cross-entropy ----
# ---- parallel ----
from shardkit.ops._parallel import split_to_devices, weighted_loss_reduce  # noqa: F401

# ---- end parallel ----
# ---- distributed ----
from shardkit.ops._sampling import partial_fc_sample  # noqa: F401
from shardkit.ops._sharded_ce import ce_shard_stats  # noqa: F401

# ---- end normalize ----

__all__ = [
    "ema_update_",
    "ema_update_device_decay_",
    "ema_swap_",
    "ema_unswap_",
    "ce_shard_stats",
    "chunk_classes_for_budget",
    "kept_chunks_for_budget",
    "kept_bytes",
    "kept_logits_dtype",
    "split_to_devices",
    "weighted_loss_reduce",
    "partial_fc_sample",
    "normalize_images",
]
