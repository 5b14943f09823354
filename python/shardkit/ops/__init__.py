"""The functional operators of shardkit (``torch.ops.shardkit.*``), with fake kernels
(so ``torch.compile`` traces them) and autograd where they are differentiable.

One private module per op family; this module re-exports the public functions.
"""

# ---- ema ----
# ---- end ema ----

# ---- sharded cross-entropy ----
# ---- end sharded cross-entropy ----

# ---- parallel ----
from shardkit.ops._parallel import split_to_devices, weighted_loss_reduce  # noqa: F401
# ---- end parallel ----

# ---- normalize ----
# ---- end normalize ----
