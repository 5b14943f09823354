"""Class-sharded softmax cross-entropy that never materializes the [batch, classes] logits.

Each weight shard (a contiguous class range on its own device) yields four [B] statistics
from the fused op :func:`shardkit.ops.ce_shard_stats` (log-sum-exp, target logit, logit
sum, count of classes ranked above the target); they are combined on the embeddings'
device into the loss with ordinary differentiable torch code, so autograd runs each
shard's fused backward on the shard's own device.

The three steps (per-shard statistics, combining them, the loss) are separate functions
in ``shardkit._sce_core`` so the distributed mode can replace the combining step alone.
"""

from typing import Dict, NamedTuple, Optional, Sequence

import torch
from torch import nn

from shardkit._sce_checks import (
    check_options,
    check_shards,
    check_tensors,
    check_topk,
    check_values,
    parse_memory,
)
from shardkit._sce_core import (
    ShardStatistics,
    _to,
    combine_statistics,
    loss_from_statistics,
    shard_statistics,
)
from shardkit import _dist_loss  # distributed hook
from shardkit.margins import Margin
from shardkit.distributed import sampled_class_counts
from shardkit.sampling import check_sample_rate, mark_sampled, sample_shard

__all__ = ["ShardedSoftmaxLoss", "sharded_cross_entropy", "ShardedLossOutput", "ShardStatistics"]


class ShardedLossOutput(NamedTuple):
    """What ``return_details=True`` returns.

    loss: the reduced loss (float32; [B] for reduction="none"), differentiable.
    lse: [B] float32 per-row log-sum-exp over ALL classes of the logits the loss uses
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


def sharded_cross_entropy(
    embeddings: torch.Tensor,
    weight_shards: Sequence[torch.Tensor],
    labels: torch.Tensor,
    *,
    margin: Optional[Margin] = None,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    class_offsets: Optional[Sequence[int]] = None,
    chunk_memory=None,
    check_inputs=True,
    return_details: bool = False,
    topk: Sequence[int] = (1,),
    sample_rate: float = 1.0,
    generator=None,
):
    """Cross-entropy of ``embeddings @ cat(weight_shards).T`` without forming those logits.

    Args:
        embeddings: [B, D] float32/bfloat16/float16 (or float64, e.g. for gradcheck), B >= 1.
        weight_shards: list of [C_k, D] tensors of one dtype, each on its own device (repeats
            allowed); shard k holds classes [class_offsets[k], class_offsets[k] + C_k).
        labels: [B] int64 (other integer dtypes are converted) on the embeddings' device:
            class ids in [0, C) or ``ignore_index``.
        margin: None (plain logits x . w) or CosFace / ArcFace / CombinedMargin (cosine logits
            with the margin at the target; embeddings and weights L2-normalized).
        label_smoothing: eps in [0, 1], spread over all C classes like F.cross_entropy.
        ignore_index: label value of rows that count nowhere.
        reduction: "mean" (over non-ignored rows), "sum" or "none" ([B], 0 for ignored rows).
        class_offsets: first class of each shard (default: cumulative shard sizes); the
            ranges must tile [0, C).
        chunk_memory: working-set budget per shard (bytes or a string like "64MiB"): sets
            the classes per chunk, so extra memory is O(B x chunk), never O(B x C). None: the
            op's default, a 192 MiB budget on GPUs and a cache-sized (1 MiB) chunk on the CPU.
        check_inputs: True: one fused device->host sync per call to check labels and
            finiteness of the embeddings (clear ValueError); "async": the same check by
            ``torch._assert_async`` without a sync; False: no value check (out-of-range
            labels then silently act as "target in no shard").
        return_details: also return per-row log-sum-exp and top-k correct counts.
        topk: the k of the correct counts (with ``return_details``).
        sample_rate: PartialFC in (0, 1]: below 1, each shard uses every positive class of
            the batch plus uniformly sampled negatives, ``ceil(rate * C_k)`` classes (at
            least min(B, C_k)); the other classes take no part and get no gradient (each
            shard's gradient is a row-sparse COO tensor: step it with
            :class:`shardkit.SparseRowSGD`). Smoothing then spreads over the sampled classes
            and the lse / top-k counts are over them. 1: every class (the default).
        generator: for the sampling: None (the default generators), a torch.Generator of
            the shards' device, or a sequence of one per shard.

    Returns:
        The loss on the embeddings' device (float32; [B] for "none"), or a
        :class:`ShardedLossOutput` with ``return_details=True``.

    dtypes: outside autocast the embeddings are cast to the weights' dtype; under
    ``torch.autocast`` for a shard's device type the embeddings are cast to the autocast
    dtype, which is the compute dtype (as nn.Linear). fp32 weights under a bf16 / fp16
    autocast are NOT copied: the kernels convert them chunk by chunk (a chunk-sized
    temporary within ``chunk_memory``; on GPUs to the autocast dtype, the GEMMs' input
    dtype, while the CPU kernels compute in fp32 from the fp32 rows) and write their
    gradient in fp32 straight into the fp32 gradient, so no 16-bit copy of a shard or of its
    gradient is made. Other weight
    dtypes under autocast (e.g. bf16 weights with an fp16 autocast) are cast to the autocast
    dtype. Statistics and the loss are float32 whatever the input dtype. With a margin and
    fp16 autocast on a GPU, each fp32 row is rounded to fp16 before it is normalized, so
    rows of norm below ~1e-3 lose cosine accuracy (fp16 subnormals); bf16 has no such limit.
    """
    check_options(margin, label_smoothing, ignore_index, reduction, check_inputs)
    shards, offsets, num_classes = check_shards(weight_shards, class_offsets)
    labels = check_tensors(embeddings, labels, shards[0].shape[1])
    ks = check_topk(topk) if return_details else ()
    budget = None if chunk_memory is None else parse_memory(chunk_memory)
    if check_inputs:
        check_values(embeddings, labels, num_classes, ignore_index, check_inputs)
    op_labels = labels
    if 0 <= ignore_index < num_classes:
        # An ignore_index that is also a class id must not pick up a target (nor a margin).
        op_labels = labels.masked_fill(labels == ignore_index, -1)
    shard_labels = None
    if check_sample_rate(sample_rate) < 1.0:
        shards, shard_labels, num_classes = _sample_shards(shards, offsets, op_labels, sample_rate, generator)
        offsets = [0] * len(shards)
    per_shard = shard_statistics(embeddings, shards, offsets, op_labels, margin, budget, with_rank=bool(ks),
                                 shard_labels=shard_labels)
    # The statistics are fp32 already; autocast must not lower the combining arithmetic.
    with torch.autocast(embeddings.device.type, enabled=False):
        stats = combine_statistics(per_shard, embeddings.device)
        loss, valid = loss_from_statistics(
            stats, labels, num_classes,
            label_smoothing=float(label_smoothing), ignore_index=ignore_index, reduction=reduction,
        )
    if not return_details:
        return loss
    correct = {k: ((stats.greater_count < k) & valid).sum() for k in ks}
    return ShardedLossOutput(loss, stats.lse, correct, valid.sum())


def _sample_shards(shards, offsets, labels, sample_rate, generator):
    """PartialFC in the one-process mode: ``(sub_shards, shard_labels, classes_used)``; each
    shard keeps the batch's positives plus sampled negatives (see :mod:`shardkit.sampling`)."""
    if generator is None or isinstance(generator, torch.Generator):
        generators = [generator] * len(shards)
    else:
        generators = list(generator)
        if len(generators) != len(shards) or not all(isinstance(g, torch.Generator) for g in generators):
            raise TypeError("argument `generator` must be None, a torch.Generator or one torch.Generator per "
                            f"shard ({len(shards)}), got {generator!r}")
    counts = sampled_class_counts([w.shape[0] for w in shards], sample_rate, labels.shape[0])
    subs, sub_labels = [], []
    for w, offset, count, gen in zip(shards, offsets, counts, generators):
        mark_sampled(w)
        sub_w, sub_y, _ = sample_shard(w, _to(labels, w.device), offset, count, gen)
        subs.append(sub_w)
        sub_labels.append(sub_y)
    return subs, sub_labels, sum(counts)


def _split_sizes(num_classes: int, num_shards: int, shard_sizes) -> list:
    """Shard sizes from None (even split, the first shards one larger), explicit ints
    summing to num_classes, or proportions (floats, any positive total; largest remainder)."""
    if shard_sizes is None:
        base, extra = divmod(num_classes, num_shards)
        return [base + (k < extra) for k in range(num_shards)]
    sizes = list(shard_sizes)
    if len(sizes) != num_shards:
        raise ValueError(f"argument `shard_sizes` has {len(sizes)} entries for {num_shards} devices")
    if any(isinstance(s, bool) or not isinstance(s, (int, float)) or s < 0 for s in sizes):
        raise ValueError(f"argument `shard_sizes` must hold non-negative numbers, got {sizes}")
    if all(isinstance(s, int) for s in sizes):
        if sum(sizes) != num_classes:
            raise ValueError(f"argument `shard_sizes` {sizes} sums to {sum(sizes)}, not num_classes={num_classes}")
        return sizes
    total = float(sum(sizes))
    if total <= 0:
        raise ValueError(f"argument `shard_sizes` proportions must have a positive sum, got {sizes}")
    exact = [num_classes * s / total for s in sizes]
    out = [int(e) for e in exact]
    by_remainder = sorted(range(num_shards), key=lambda k: exact[k] - out[k], reverse=True)
    for k in by_remainder[: num_classes - sum(out)]:
        out[k] += 1
    return out


def _state_dict_post_hook(module, state_dict, prefix, local_metadata):
    # One class-ordered `weight` [C, D] replaces the per-shard entries, so checkpoints do
    # not depend on the shard count.
    for k in range(len(module.weight_shards)):
        state_dict.pop(f"{prefix}weight_shards.{k}", None)
    state_dict[prefix + "weight"] = module._checkpoint_weight()


def _load_state_dict_pre_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    key = prefix + "weight"
    if key not in state_dict:
        return  # per-shard keys (same shard count) load as ordinary parameters
    full = state_dict.pop(key)
    expected = (module.num_classes, module.embedding_dim)
    if not isinstance(full, torch.Tensor) or tuple(full.shape) != expected:
        shape = tuple(full.shape) if isinstance(full, torch.Tensor) else type(full).__name__
        errors.append(f"size mismatch for {key}: the checkpoint has {shape}, this module expects {expected} "
                      "[num_classes, embedding_dim]")
        return
    for k, (offset, size) in enumerate(zip(module.class_offsets, module.shard_sizes)):
        state_dict[f"{prefix}weight_shards.{k}"] = full[offset:offset + size]


class ShardedSoftmaxLoss(nn.Module):
    """FC layer + softmax cross-entropy with the classes sharded over devices.

    Replaces ``nn.Linear(embedding_dim, num_classes, bias=False)`` followed by
    ``nn.CrossEntropyLoss()``; the ``[B, num_classes]`` logits are never materialized (each
    shard works chunk by chunk over its classes; extra memory O(B x chunk)).

    Args:
        embedding_dim (int): D.
        num_classes (int): C.
        margin: None (plain logits), or :class:`shardkit.CosFace`, :class:`shardkit.ArcFace`,
            :class:`shardkit.CombinedMargin` (cosine logits, L2-normalized embeddings and
            weights, margin at the target).
        devices: list of devices, one shard each (repeats allowed, e.g. ``["cpu"] * 3``);
            None: one shard on the CPU (move it with ``.to()`` / ``.cuda()`` like any module).
        shard_sizes: classes per shard (ints summing to C) or proportions (floats);
            default: an even split in device order.
        label_smoothing, ignore_index, reduction: as ``nn.CrossEntropyLoss`` (smoothing over
            all C classes; reduction "mean" over non-ignored rows, "sum", "none").
        dtype: the weights' dtype (default: torch's default dtype).
        chunk_memory: working-set budget per shard, bytes or a string like "64MiB"; None
            (default): 192 MiB on GPUs, a cache-sized chunk on the CPU.
        check_inputs: True (default): validate labels and embedding finiteness with ONE
            device->host sync per forward (~ a [B] and a [B, D] scan; on a GPU, the sync stalls
            the CPU until the backbone's forward is done); "async": same check with no sync
            (``torch._assert_async``; on CUDA a failure is a device-side assert); False: none.
        topk: default k's of the correct counts returned by ``return_details=True``.
        sample_rate: PartialFC sampling in training mode when < 1, in one process or
            distributed (see ``sharded_cross_entropy``: row-sparse weight gradients, use
            :class:`shardkit.SparseRowSGD`); evaluation mode uses every class. Seed it by
            setting ``.sample_generator`` (a torch.Generator of the shards' device, or one
            per shard).
        process_group, input_layout: the torch.distributed mode (see
            :mod:`shardkit.distributed` and the README): this rank holds ONE shard, classes
            ``split_classes(C, world_size)[rank]``, on ``devices[0]`` (default: the current GPU
            under NCCL, else the CPU); ``input_layout`` "data_parallel" (each rank its own batch;
            the embedding gradient is world_size * dL/dX_r) or "replicated".

    Attributes:
        weight_shards (nn.ParameterList): one [C_k, D] Parameter per device; shard k holds
            classes ``[class_offsets[k], class_offsets[k] + C_k)``.

    Init: U(-1/sqrt(D), 1/sqrt(D)) like nn.Linear, drawn from the CPU generator in class
    order, so under the same seed ``full_weight()`` equals ``nn.Linear(D, C, bias=False)``'s
    weight (as built on the CPU) exactly.

    Checkpoints: ``state_dict()`` holds ONE class-ordered ``weight`` [C, D] (on the shards'
    device when they share one, else on the CPU) whatever the shard count, and
    ``load_state_dict`` splits it over the current shards: save with 4 shards, load with
    1 or 3. Plain tensors, so ``torch.load(..., weights_only=True)`` reads it.
    """

    _version = 1

    def __init__(self, embedding_dim: int, num_classes: int, *, margin: Optional[Margin] = None,
                 devices=None, shard_sizes=None, label_smoothing: float = 0.0, ignore_index: int = -100,
                 reduction: str = "mean", dtype: Optional[torch.dtype] = None,
                 chunk_memory=None, check_inputs=True, topk: Sequence[int] = (1, 5),
                 process_group=None, input_layout: str = "data_parallel", sample_rate: float = 1.0):
        super().__init__()
        for name, value in (("embedding_dim", embedding_dim), ("num_classes", num_classes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"argument `{name}` must be a positive int, got {value!r}")
        check_options(margin, label_smoothing, ignore_index, reduction, check_inputs)
        # distributed hook: torch.distributed mode, one shard per rank (see shardkit._dist_loss)
        self._dist, devices = _dist_loss.setup(self, num_classes, process_group, input_layout, sample_rate,
                                               devices, shard_sizes)
        if devices is None:
            devices = ["cpu"] if shard_sizes is None else ["cpu"] * len(list(shard_sizes))
        if isinstance(devices, (str, torch.device)):
            devices = [devices]
        devices = [torch.device(d) for d in devices]
        if not devices:
            raise ValueError("argument `devices` must name at least one device")
        sizes = _split_sizes(num_classes, len(devices), shard_sizes)
        if self._dist is not None:  # distributed hook: this rank's class range only
            sizes = [self._dist.num_local]
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if not dtype.is_floating_point:
            raise TypeError(f"argument `dtype` must be a floating dtype, got {dtype}")
        self.embedding_dim = embedding_dim
        self.num_classes = num_classes
        self.margin = margin
        self.label_smoothing = float(label_smoothing)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.chunk_memory = None if chunk_memory is None else parse_memory(chunk_memory)
        self.check_inputs = check_inputs
        self.topk = check_topk(topk)
        self.weight_shards = nn.ParameterList(
            [nn.Parameter(torch.empty(size, embedding_dim, dtype=dtype, device=dev))
             for size, dev in zip(sizes, devices)]
        )
        self.reset_parameters()
        if self._dist is None:  # distributed hook: ranks keep their own shard (shardkit.save_sharded)
            self.register_state_dict_post_hook(_state_dict_post_hook)
            self.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)

    @property
    def shard_sizes(self) -> tuple:
        """Classes per shard, in device order."""
        return tuple(p.shape[0] for p in self.weight_shards)

    @property
    def class_offsets(self) -> tuple:
        """First class id of each shard."""
        if self._dist is not None:  # distributed hook
            return (self._dist.class_offset,)
        out, acc = [], 0
        for size in self.shard_sizes:
            out.append(acc)
            acc += size
        return tuple(out)

    @property
    def devices(self) -> list:
        """Each shard's current device."""
        return [p.device for p in self.weight_shards]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """U(-1/sqrt(D), 1/sqrt(D)) (nn.Linear's kaiming_uniform(a=sqrt(5))), drawn on the
        CPU shard by shard in class order: the same numbers as one [C, D] draw."""
        if self._dist is not None:  # distributed hook
            return _dist_loss.reset_shard_(self)
        bound = 1.0 / self.embedding_dim ** 0.5
        for p in self.weight_shards:
            if p.device.type == "meta":
                continue
            p.copy_(torch.empty(p.shape, dtype=p.dtype).uniform_(-bound, bound))

    def full_weight(self, device=None) -> torch.Tensor:
        """A class-ordered copy [C, D] of the weight (detached) on ``device`` (default:
        the first shard's)."""
        if self._dist is not None:  # distributed hook: a collective, every rank calls it
            return _dist_loss.full_weight(self, device)
        device = self.weight_shards[0].device if device is None else torch.device(device)
        return torch.cat([p.detach().to(device) for p in self.weight_shards], dim=0)

    def _checkpoint_weight(self) -> torch.Tensor:
        devices = {p.device for p in self.weight_shards}
        # Gathering a million-class weight onto one GPU could exhaust it: the CPU holds it.
        return self.full_weight(devices.pop() if len(devices) == 1 else "cpu")

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor, *, return_details: bool = False,
                topk: Optional[Sequence[int]] = None):
        """embeddings [B, D] floating, labels [B] int64 (int32 accepted) on the same device.

        Returns the loss on the embeddings' device (float32 scalar; [B] with
        reduction="none"), or with ``return_details=True`` a :class:`ShardedLossOutput`
        (loss, per-row lse [B], correct {k: count} for ``topk`` (default: the module's),
        num_valid).
        """
        if self._dist is not None:  # distributed hook
            return _dist_loss.forward(self, embeddings, labels, return_details, topk)
        if isinstance(embeddings, torch.Tensor) and embeddings.dim() == 2 \
                and embeddings.shape[1] != self.embedding_dim:
            raise ValueError(f"argument `embeddings` has dim {embeddings.shape[1]}, "
                             f"but this loss has embedding_dim={self.embedding_dim}")
        return sharded_cross_entropy(
            embeddings, list(self.weight_shards), labels,
            margin=self.margin, label_smoothing=self.label_smoothing, ignore_index=self.ignore_index,
            reduction=self.reduction, class_offsets=self.class_offsets, chunk_memory=self.chunk_memory,
            check_inputs=self.check_inputs, return_details=return_details,
            topk=self.topk if topk is None else topk,
            sample_rate=self.sample_rate if self.training else 1.0, generator=self.sample_generator,
        )

    def extra_repr(self) -> str:
        devices = ", ".join(str(d) for d in self.devices)
        return (f"embedding_dim={self.embedding_dim}, num_classes={self.num_classes}, "
                f"shard_sizes={list(self.shard_sizes)}, devices=[{devices}], margin={self.margin}, "
                f"label_smoothing={self.label_smoothing}, ignore_index={self.ignore_index}, "
                f"reduction={self.reduction!r}")
