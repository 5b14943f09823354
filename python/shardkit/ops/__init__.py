"""The functional operators of shardkit (``torch.ops.shardkit.*``), with fake kernels
(so ``torch.compile`` traces them) and autograd where they are differentiable.

One private module per op family; this module re-exports the public functions.
"""

# ---- ema ----
# ---- end ema ----

# ---- sharded cross-entropy ----
# ---- end sharded cross-entropy ----

# ---- parallel ----
# ---- end parallel ----

# ---- distributed ----
from shardkit.ops._sampling import partial_fc_sample  # noqa: F401
# ---- end distributed ----

# ---- normalize ----
# ---- end normalize ----
