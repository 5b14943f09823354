"""PartialFC: each step uses every positive class of the global batch plus uniformly
sampled negatives, ``sample_rate`` of each rank's shard (at least enough to hold every
positive), instead of all classes.

The sampled weight rows are read with ``F.embedding(index, weight, sparse=True)``, so the
shard's gradient is a row-sparse COO tensor holding only the sampled rows: rows not
sampled get no gradient at all. An optimizer with momentum or weight decay must then
leave them untouched; ``torch.optim.SGD`` does not (with a sparse gradient it raises on
weight decay, and with momentum it keeps moving rows whose momentum buffer is non-zero),
so use :class:`shardkit.SparseRowSGD`. A ``torch.optim.SGD`` with momentum or weight decay
over a sampled shard gets a warning on its first step.

Label smoothing under sampling spreads eps over the SAMPLED classes (the logit sum and
the class count both come from the sampled set): the loss is that of a classifier over
the sampled classes, as PartialFC trains it. ``sample_rate=1`` runs the full path and
equals the full loss exactly.
"""

from __future__ import annotations

import math
import numbers
import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from shardkit.ops._sampling import partial_fc_sample
from shardkit.plan.memory import sampled_rows


def sampled_class_counts(sizes: Sequence[int], sample_rate: float, global_batch: int) -> List[int]:
    """PartialFC's classes per rank this step (the formula and arguments:
    :func:`shardkit.distributed.sampled_class_counts`, the public form, which also takes numpy
    integers); Python ints here."""
    sample_rate = check_sample_rate(sample_rate)
    sizes = list(sizes)
    for name, values, shown in (("sizes", sizes, sizes), ("global_batch", [global_batch], global_batch)):
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
            raise ValueError(f"argument `{name}` must hold ints >= 0, got {shown!r}")
    return [min(c, max(sampled_rows(sample_rate, c), min(global_batch, c))) for c in sizes]


def check_sample_rate(sample_rate: float) -> float:
    """``sample_rate`` as a float in (0, 1] (any real number type but bool); ValueError /
    TypeError naming the argument, also for an int beyond the float range."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, numbers.Real):
        raise TypeError(f"argument `sample_rate` must be a float in (0, 1], got {type(sample_rate).__name__}")
    huge = isinstance(sample_rate, int) and abs(sample_rate) >= 10**30
    shown = f"a {len(str(abs(sample_rate)))}-digit integer" if huge else repr(sample_rate)[:60]
    try:
        rate = float(sample_rate)
    except OverflowError:
        rate = math.nan
    if not (math.isfinite(rate) and 0.0 < rate <= 1.0):
        raise ValueError(f"argument `sample_rate` must be in (0, 1], got {shown}")
    return rate


def sample_shard(
    weight: torch.Tensor,
    labels: torch.Tensor,
    class_offset: int,
    num_sample: int,
    generator: Optional[torch.Generator] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled part of one class shard.

    Args:
        weight: [C_r, D] the shard's weight (a Parameter: its gradient becomes row-sparse).
        labels: [B] int64 global class ids of the (global) batch, on the weight's device.
        class_offset: the shard's first global class id.
        num_sample: classes to keep (>= distinct positives, see
            :func:`sampled_class_counts`).
        generator: optional torch.Generator on the weight's device.

    Returns:
        ``(sub_weight [num_sample, D], sub_labels [B] int64, index [num_sample] int64)``:
        sub_weight's rows are ``weight[index]`` (gradient flows back as a sparse COO
        gradient of ``weight``); sub_labels are positions in ``index`` (-1 for rows whose
        class is not in this shard), for the statistics op with ``class_offset=0``.
    """
    index, sub_labels = partial_fc_sample(
        labels, class_offset=class_offset, num_local=weight.shape[0], num_sample=num_sample, generator=generator
    )
    _fold_half_grads(weight)
    return F.embedding(index, weight, sparse=True), sub_labels, index


class _HalfSparseFold:
    """A gradient hook of a float16 CPU shard: torch cannot add two float16 sparse COO tensors
    on the CPU ("cadd_sparse" not implemented for 'Half'), which a second backward before the
    optimizer step (gradient accumulation, ``retain_graph``) needs. When a backward is about to
    accumulate a sparse gradient into a sparse ``.grad``, the hook joins the two (their rows side
    by side: an uncoalesced sum, as torch's own sparse add leaves it) and hands
    the result to torch as the whole gradient. ``torch.autograd.grad`` calls, which do not
    accumulate, pass through untouched."""

    __torch_unserializable__ = True  # not pickled with the Parameter: the next forward adds it again

    def __init__(self, weight: torch.Tensor) -> None:
        # A strong reference (a cycle the garbage collector frees): a weak one would stop
        # torch.utils.swap_tensors, which module conversions use under
        # torch.__future__.set_swap_module_params_on_conversion(True).
        self.weight = weight
        self.cdata = weight._cdata  # the tensor it was registered on (swap_tensors changes it)

    def __call__(self, grad: torch.Tensor) -> Optional[torch.Tensor]:
        weight = self.weight
        if weight._cdata != self.cdata:
            return None  # the Parameter now holds another tensor (swapped): its own hook acts
        old = weight.grad
        if old is None or not (grad.is_sparse and old.is_sparse) or old.dtype != torch.float16:
            return None
        try:  # torch.autograd.grad does not accumulate: it returns the gradient, .grad is left alone
            if not torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(weight).node):
                return None
        except RuntimeError:  # raised for a leaf under torch.autograd.grad
            return None
        # float32's sparse add joins the two uncoalesced (no arithmetic on the values, so the
        # round trip through float32 is exact)
        joined = (old.float() + grad.float()).to(torch.float16)
        weight.grad = None  # AccumulateGrad then takes the joined gradient as it is
        return joined


def _fold_half_grads(weight: torch.Tensor) -> None:
    if weight.dtype != torch.float16 or weight.device.type != "cpu" or torch.compiler.is_compiling():
        return
    if not (weight.is_leaf and weight.requires_grad):
        return
    hooks = getattr(weight, "_backward_hooks", None) or {}
    if not any(isinstance(h, _HalfSparseFold) and h.cdata == weight._cdata for h in hooks.values()):
        weight.register_hook(_HalfSparseFold(weight))


# optimizer -> what it was when last checked and found nothing to warn about (its parameter count,
# the marks so far, which groups had momentum or weight decay), or _WARNED
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, object] = weakref.WeakKeyDictionary()
_WARNED = object()
_marks = 0  # shards marked so far (a shard sampled for the first time makes the check run again)
_hook: Optional[RemovableHandle] = None
# The attribute that marks a sampled shard (a plain attribute on the Parameter, read by the hook).
_SAMPLED = "_shardkit_sampled"


def _sgd_step_pre_hook(optimizer: torch.optim.Optimizer, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    # Runs before every optimizer step in the process: cheap after the first check.
    if not isinstance(optimizer, torch.optim.SGD):
        return
    seen = _checked.get(optimizer)
    if seen is _WARNED:
        return
    groups = optimizer.param_groups
    key = (
        sum(len(g["params"]) for g in groups),
        _marks,
        tuple(bool(g.get("momentum", 0) or g.get("weight_decay", 0)) for g in groups),
    )
    if seen == key:
        return  # checked as it is: no sampled shard under momentum or weight decay
    marked = False
    for group in optimizer.param_groups:
        if not (group.get("momentum", 0) or group.get("weight_decay", 0)):
            continue
        shards = [p for p in group["params"] if getattr(p, _SAMPLED, False)]
        marked = marked or bool(shards)
        # warn when a shard's gradient IS row-sparse: one trained without sampling this step
        # (a head whose sample_rate went to 1, an eval-mode forward) has a dense gradient
        if any(p.grad is not None and p.grad.layout == torch.sparse_coo for p in shards):
            _checked[optimizer] = _WARNED
            warnings.warn(
                "torch.optim.SGD with momentum or weight_decay updates rows of a PartialFC-sampled "
                "ShardedSoftmaxLoss shard that were not sampled this step (or raises on weight decay with "
                "their sparse gradients); use shardkit.SparseRowSGD, which leaves them untouched",
                UserWarning,
                stacklevel=3,
            )
            return
    if not marked:
        _checked[optimizer] = key


def mark_sampled(weight: torch.Tensor) -> None:
    """Tag a shard trained with sampling so that a ``torch.optim.SGD`` step with momentum or
    weight decay over it warns (once per optimizer)."""
    global _hook, _marks
    if torch.compiler.is_compiling():
        return  # a traced setattr would break the graph; the module marks its shards at construction
    if not getattr(weight, _SAMPLED, False):
        setattr(weight, _SAMPLED, True)
        _marks += 1
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_sgd_step_pre_hook)
