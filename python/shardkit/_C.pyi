"""Type stub of the compiled extension (csrc/shardkit.cpp): its one Python function. The ops it
registers are called through ``torch.ops.shardkit`` (typed by the wrappers in shardkit.ops)."""

from torch import Tensor

def cuda_built() -> bool: ...

# ModelEMA's internal per-update entry points (csrc/composite/ema_lists.cpp): lists of tensor
# lists (one per group) and the flat copy lists; nothing is kept after the call.
def ema_update_lists(
    ema_groups: list[list[Tensor]],
    model_groups: list[list[Tensor]],
    copy_to: list[Tensor],
    copy_from: list[Tensor],
    decay: float,
    /,
) -> None: ...
def ema_layout(
    ema_groups: list[list[Tensor]],
    model_groups: list[list[Tensor]],
    copy_to: list[Tensor],
    copy_from: list[Tensor],
    /,
) -> bytes | None: ...
