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

# ---- normalize ----
from shardkit.ops._normalize import normalize_images  # noqa: F401
# ---- end normalize ----
