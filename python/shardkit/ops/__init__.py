"""The functional operators of shardkit (``torch.ops.shardkit.*``), with fake kernels
(so ``torch.compile`` traces them) and autograd where they are differentiable.

One private module per op family; this module re-exports the public functions.
"""

# ---- ema ----
# ---- end ema ----

# ---- sharded cross-entropy ----
from shardkit.ops._sharded_ce import ce_shard_stats, chunk_classes_for_budget  # noqa: F401
# ---- end sharded cross-entropy ----

# ---- parallel ----
# ---- end parallel ----

# ---- distributed ----
from shardkit.ops._sampling import partial_fc_sample  # noqa: F401
# ---- end distributed ----

# ---- normalize ----
# ---- end normalize ----
