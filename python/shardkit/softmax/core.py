"""The three steps of the sharded cross-entropy, shared by both modes (one process, process group).

:func:`shard_statistics` (fused op per shard, on the shard's device) ->
:func:`combine_statistics` (here: copy the [B] stats to one device and reduce; the
distributed mode replaces this step by all-reduces of the same packed stats) ->
:func:`loss_from_statistics` (F.cross_entropy semantics). All three are ordinary
differentiable torch code around the op, so autograd runs each shard's fused backward on
the shard's own device.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from shardkit import ops
from shardkit.softmax.budget import shard_budgets
from shardkit.softmax.margins import Margin


class ShardStatistics(NamedTuple):
    """Per-row statistics over a set of classes (one shard, or all after combining).

    lse, target_logit, logit_sum: [B] float32 (float64 for float64 inputs);
    greater_count: [B] int64 (zeros unless top-k was asked for).
    """

    lse: torch.Tensor
    target_logit: torch.Tensor
    logit_sum: torch.Tensor
    greater_count: torch.Tensor


class ShardedLossOutput(NamedTuple):
    """What ``return_details=True`` returns.

    loss: the reduced loss (float32, float64 for float64 weights; [B] for reduction="none"),
        differentiable.
    lse: [B] float32 (float64 for float64 weights) per-row log-sum-exp over ALL classes of the logits the loss uses
        (margin at the target column), differentiable: ``z_loss = (lse ** 2).mean()``.
        Defined for ignored rows too (their label plays no part in it except the margin,
        which they do not get).
    correct: {k: int64 0-d tensor}: non-ignored rows whose label is among the k highest
        PLAIN logits (no margin), for each requested k; a class ranks above the target when
        its logit is higher by more than a rounding band: 1e-5 (fp32), 2^-10 (fp16) or 2^-8
        (bf16) times scale (or |x| |w_y| for plain logits); closer ties count for the target.
    num_valid: int64 0-d tensor: the number of non-ignored rows (accuracy = correct / num_valid).
    """

    loss: torch.Tensor
    lse: torch.Tensor
    correct: Dict[int, torch.Tensor]
    num_valid: torch.Tensor


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    # Under autocast for the shard's device type, the embeddings take the autocast dtype as
    # nn.Linear's input would (fp32 weights stay fp32: the GPU kernels convert their chunks to
    # it, the CPU kernels compute in fp32 from them); otherwise the embeddings follow the
    # weights' dtype.
    # float64 weights stay float64 under autocast, as torch's autocast never casts float64.
    device_type = weight.device.type
    if weight.dtype != torch.float64 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


# Weight / embedding dtype pairs the op takes as they are ("mixed" mode): fp32 weights with
# 16-bit embeddings, i.e. fp32 master weights under a 16-bit autocast. The op converts the
# weights chunk by chunk and returns their gradient in fp32, so no 16-bit copy of the shard
# (nor of its gradient) is ever made.
_MIXED_PAIRS = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32)}


def weights_for(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` as the op takes it with embeddings of ``dtype``: unchanged when the dtypes
    match or form a mixed pair (16-bit embeddings, fp32 weights), else cast to ``dtype``
    (differentiable: the cast's gradient flows back in the weight's dtype)."""
    if weight.dtype == dtype or (dtype, weight.dtype) in _MIXED_PAIRS:
        return weight
    return weight.to(dtype)


def to_device(t: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    # Host-to-device and device-to-device copies may be asynchronous; a copy to the
    # CPU must not be (the host would read before the data lands).
    return t.to(device=device, dtype=dtype, non_blocking=device.type != "cpu")


def chunk_classes(batch: int, shard_classes: int, dim: int, dtype: torch.dtype, budget: Optional[int]) -> Optional[int]:
    # None: the op's own default (192 MiB on GPUs, a cache-sized chunk on the CPU).
    if budget is None:
        return None
    return ops.chunk_classes_for_budget(
        batch, budget, embedding_dim=dim, dtype=dtype, num_classes=max(shard_classes, 1)
    )


# Rank threshold margin, relative to the largest the plain target logit can be (scale, or
# |x| |w_y|), by compute dtype: the kernels recompute the target's own plain logit inside
# their GEMM (in 16-bit dtypes from rounded, possibly pre-normalized operands, which moves
# it by up to ~2^-9 of that bound for bf16), and it must not count as ranked above itself.
# Ties closer than this count for the target; the logits are not more accurate than that.
RANK_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-8}


def target_ref_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the top-k threshold: float64 for float64 embeddings (whose tolerance,
    1e-9, is below float32's resolution), else float32 (the kernels' accumulation type)."""
    return torch.float64 if x_dtype == torch.float64 else torch.float32


def plain_target_logit(
    inputs: Sequence[Tuple[torch.Tensor, torch.Tensor]],
    shards: Sequence[torch.Tensor],
    offsets: Sequence[int],
    labels: torch.Tensor,
    margin: Optional[Margin],
    device: torch.device,
) -> Optional[torch.Tensor]:
    """[B] float32 (float64 for float64 embeddings, :func:`target_ref_dtype`): each row's
    plain target logit (scale * cos, or x . w) plus the rank tolerance, gathered from the
    shard owning its class (labels no shard owns get a value that never matters: their rows
    are ignored). No logits: one [B, D] row gather per shard. The threshold of the top-k
    counts; not differentiated. None when every shard is empty (a rank of a process group
    with fewer classes than ranks)."""
    total: Optional[torch.Tensor] = None
    with torch.no_grad():
        for (x_k, labels_k), w, offset in zip(inputs, shards, offsets):
            size = w.shape[0]
            if size == 0:
                continue
            local = labels_k - offset
            inside = (local >= 0) & (local < size)
            acc = target_ref_dtype(x_k.dtype)
            rows = w.index_select(0, local.clamp(0, size - 1)).to(acc)
            xf = x_k.to(acc)
            if margin is not None:
                # in float64: a float row of norm above ~1.8e19 must not normalize to zeros
                unit_x = F.normalize(xf.double(), dim=1, eps=1e-12)
                dot = margin.scale * (unit_x * F.normalize(rows.double(), dim=1, eps=1e-12)).sum(1).to(acc)
                bound = torch.full_like(dot, margin.scale)
            else:
                dot = (xf * rows).sum(1)
                bound = xf.norm(dim=1) * rows.norm(dim=1)
            value = dot + RANK_TOLERANCE[x_k.dtype] * bound
            part = to_device(torch.where(inside, value, torch.zeros_like(value)), device)
            total = part if total is None else total + part
    return total


def shard_statistics(
    embeddings: torch.Tensor,
    shards: Sequence[torch.Tensor],
    offsets: Sequence[int],
    labels: torch.Tensor,
    margin: Optional[Margin],
    chunk_memory: Optional[int],
    with_rank: bool,
    shard_labels: Optional[Sequence[torch.Tensor]] = None,
    memory_budget: Union[int, str] = 0,
) -> List[ShardStatistics]:
    """Launch :func:`shardkit.ops.ce_shard_stats` on every shard's device.

    embeddings [B, D] and labels [B] int64 go to each shard's device once per device
    (asynchronously); each op is enqueued on its device's current stream without a host
    sync, so CUDA shards run concurrently. ``shard_labels`` (PartialFC sampling): one [B]
    int64 tensor per shard, on its device, used by that shard instead of ``labels``.
    ``memory_budget``: bytes per device (or "auto", :mod:`shardkit.softmax.budget`) the
    forwards may hold for the backwards, shared by a device's shards by their classes.
    Returns each shard's stats on its own device.
    """
    scale, m1, m2, m3 = margin.params() if margin is not None else (1.0, 1.0, 0.0, 0.0)
    normalize = margin is not None
    batch, dim = embeddings.shape
    cache: Dict[Tuple[torch.device, torch.dtype], Tuple[torch.Tensor, torch.Tensor]] = {}
    inputs: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for w in shards:
        dtype = compute_dtype(w)
        key = (w.device, dtype)
        if key not in cache:
            cache[key] = (to_device(embeddings, w.device, dtype), to_device(labels, w.device))
        inputs.append(cache[key])
    if shard_labels is not None:
        inputs = [(x_k, y_k) for (x_k, _), y_k in zip(inputs, shard_labels)]
    target_ref = None
    if with_rank:
        target_ref = plain_target_logit(inputs, shards, offsets, labels, margin, embeddings.device)
    stats: List[ShardStatistics] = []
    budgets = shard_budgets(memory_budget, shards)
    for (x_k, labels_k), w, offset, budget in zip(inputs, shards, offsets, budgets):
        w_k = weights_for(w, x_k.dtype)
        ref_k = None if target_ref is None else to_device(target_ref, w.device)
        out = ops.ce_shard_stats(
            x_k,
            w_k,
            labels_k,
            class_offset=offset,
            scale=scale,
            m1=m1,
            m2=m2,
            m3=m3,
            normalize=normalize,
            chunk_classes=chunk_classes(batch, w.shape[0], dim, x_k.dtype, chunk_memory),
            target_ref=ref_k,
            memory_budget=budget,
        )
        stats.append(ShardStatistics(*out))
    return stats


def combine_statistics(stats: Sequence[ShardStatistics], device: torch.device) -> ShardStatistics:
    """Global statistics from per-shard ones: only [B] tensors travel (to ``device``).

    lse = logsumexp_k lse_k (shards without classes give -inf and drop out);
    target, logit sum and greater count add up. Differentiable. The distributed mode
    replaces this function by all-reduces of the same packed statistics.
    """
    if len(stats) == 1:
        return ShardStatistics(*(to_device(t, device) for t in stats[0]))
    moved = [ShardStatistics(*(to_device(t, device) for t in s)) for s in stats]
    lse = torch.logsumexp(torch.stack([s.lse for s in moved]), dim=0)
    target = torch.stack([s.target_logit for s in moved]).sum(0)
    logit_sum = torch.stack([s.logit_sum for s in moved]).sum(0)
    greater = torch.stack([s.greater_count for s in moved]).sum(0)
    return ShardStatistics(lse, target, logit_sum, greater)


def loss_from_statistics(
    stats: ShardStatistics,
    labels: torch.Tensor,
    num_classes: int,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The cross-entropy from global statistics, F.cross_entropy's semantics.

    loss_i = (1 - eps)(lse_i - z_{i,y_i}) + eps (lse_i - sum_j z_ij / C), smoothing over
    all C classes; rows with ``labels == ignore_index`` get 0 and count nowhere; "mean"
    divides by the number of the other rows (NaN when there are none, as in torch).
    Returns (loss, valid mask [B] bool).
    """
    valid = labels != ignore_index
    # (1 - eps)(lse - z_y) + eps (lse - sum_j z_j / C), in as few [B] kernels as it takes.
    if label_smoothing > 0.0:
        per_row = stats.lse - (1.0 - label_smoothing) * stats.target_logit
        per_row = per_row - (label_smoothing / num_classes) * stats.logit_sum
    else:
        per_row = stats.lse - stats.target_logit
    per_row = torch.where(valid, per_row, 0.0)
    if reduction == "none":
        return per_row, valid
    total = per_row.sum()
    if reduction == "sum":
        return total, valid
    return total / valid.sum(), valid


def loss_output(
    loss: torch.Tensor, stats: ShardStatistics, valid: torch.Tensor, ks: Sequence[int]
) -> ShardedLossOutput:
    """The ``return_details=True`` result from the loss, the global statistics and the
    valid-row mask: top-k hits counted without a host sync."""
    correct = {k: ((stats.greater_count < k) & valid).sum() for k in ks}
    return ShardedLossOutput(loss, stats.lse, correct, valid.sum())
