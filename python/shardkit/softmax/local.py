"""The one-process mode of the sharded loss: every shard in this process, each on its own
device (repeats allowed), and the functional form :func:`sharded_cross_entropy`.

:class:`LocalShards` is the mode object :class:`shardkit.ShardedSoftmaxLoss` picks when it
gets no ``process_group``; :class:`shardkit.softmax.distributed.ProcessGroupShards` is the
other one. Both answer the same calls (sizes, offsets, init, full weight, forward), so the
module never asks which mode it is in.
"""

from __future__ import annotations

import math
import numbers
from typing import List, Literal, NoReturn, Optional, Sequence, Tuple, Union, overload

import torch

from shardkit.ops._args import bool_arg
from shardkit.ops._devices import check_visible
from shardkit.softmax.budget import check_memory_budget
from shardkit.softmax.checks import check_options, check_shards, check_tensors, check_topk, check_values, parse_memory
from shardkit.softmax.core import (
    ShardedLossOutput,
    combine_statistics,
    loss_from_statistics,
    loss_output,
    shard_statistics,
    to_device,
)
from shardkit.softmax.head import (
    ShardedHead,
    check_shard_shapes,
    class_ordered_checkpoints,
    current_shards,
    init_bound,
    stand_in_shards,
    stand_in_weight,
)
from shardkit.softmax.margins import Margin
from shardkit.softmax.sampling import check_sample_rate, mark_sampled, sample_shard, sampled_class_counts

DeviceLike = Union[torch.device, str, int]
Generators = Union[torch.Generator, Sequence[torch.Generator], None]  # (private helpers)


@overload
def sharded_cross_entropy(
    embeddings: torch.Tensor,
    weight_shards: Sequence[torch.Tensor],
    labels: torch.Tensor,
    *,
    margin: Optional[Margin] = None,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum", "none"] = "mean",
    class_offsets: Optional[Sequence[int]] = None,
    chunk_memory: Union[int, str, None] = None,
    check_inputs: Union[bool, Literal["async"]] = True,
    return_details: Literal[False] = False,
    topk: Union[int, Sequence[int]] = (1,),
    sample_rate: float = 1.0,
    generator: Union[torch.Generator, Sequence[torch.Generator], None] = None,
    memory_budget: Union[int, str] = 0,
) -> torch.Tensor: ...


@overload
def sharded_cross_entropy(
    embeddings: torch.Tensor,
    weight_shards: Sequence[torch.Tensor],
    labels: torch.Tensor,
    *,
    margin: Optional[Margin] = None,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum", "none"] = "mean",
    class_offsets: Optional[Sequence[int]] = None,
    chunk_memory: Union[int, str, None] = None,
    check_inputs: Union[bool, Literal["async"]] = True,
    return_details: Literal[True],
    topk: Union[int, Sequence[int]] = (1,),
    sample_rate: float = 1.0,
    generator: Union[torch.Generator, Sequence[torch.Generator], None] = None,
    memory_budget: Union[int, str] = 0,
) -> ShardedLossOutput: ...


@overload
def sharded_cross_entropy(
    embeddings: torch.Tensor,
    weight_shards: Sequence[torch.Tensor],
    labels: torch.Tensor,
    *,
    margin: Optional[Margin] = None,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum", "none"] = "mean",
    class_offsets: Optional[Sequence[int]] = None,
    chunk_memory: Union[int, str, None] = None,
    check_inputs: Union[bool, Literal["async"]] = True,
    return_details: bool = False,
    topk: Union[int, Sequence[int]] = (1,),
    sample_rate: float = 1.0,
    generator: Union[torch.Generator, Sequence[torch.Generator], None] = None,
    memory_budget: Union[int, str] = 0,
) -> Union[torch.Tensor, ShardedLossOutput]: ...


def sharded_cross_entropy(
    embeddings: torch.Tensor,
    weight_shards: Sequence[torch.Tensor],
    labels: torch.Tensor,
    *,
    margin: Optional[Margin] = None,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum", "none"] = "mean",
    class_offsets: Optional[Sequence[int]] = None,
    chunk_memory: Union[int, str, None] = None,
    check_inputs: Union[bool, Literal["async"]] = True,
    return_details: bool = False,
    topk: Union[int, Sequence[int]] = (1,),
    sample_rate: float = 1.0,
    generator: Union[torch.Generator, Sequence[torch.Generator], None] = None,
    memory_budget: Union[int, str] = 0,
) -> Union[torch.Tensor, ShardedLossOutput]:
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
        return_details: also return per-row log-sum-exp and top-k correct counts (a bool:
            a Python or numpy one; anything else is a TypeError).
        topk: the k of the correct counts (with ``return_details``), each in [1, C] (C the
            full class count, with sampling too; a larger k is a ValueError as in ``torch.topk``).
        sample_rate: PartialFC in (0, 1]: below 1, each shard uses every positive class of
            the batch plus uniformly sampled negatives, ``ceil(rate * C_k)`` classes (at
            least min(B, C_k)); the other classes take no part and get no gradient (each
            shard's gradient is a row-sparse COO tensor: step it with
            :class:`shardkit.SparseRowSGD`). Smoothing then spreads over the sampled classes
            and the lse / top-k counts are over them. 1: every class (the default).
        generator: for the sampling: None (the default generators), a torch.Generator of
            the shards' device, or a sequence of one per shard.
        memory_budget: bytes per device the forward may hold until the backward, to keep
            the logits of as many class chunks as fit so that the backward need not
            recompute them: an int, a string like "2GiB", "auto"
            (:data:`shardkit.softmax.budget.AUTO_SHARE` of the available memory at each
            forward) or 0 (the default: keep nothing, recompute every chunk). Same loss and
            gradients at every budget. The kept path runs on CPU shards; CUDA shards
            recompute (see the README).

    Returns:
        The loss on the embeddings' device (float32, float64 for float64 weights; [B] for
        "none"), or a
        :class:`ShardedLossOutput` with ``return_details=True``.

    dtypes: outside autocast the embeddings are cast to the weights' dtype; under
    ``torch.autocast`` for a shard's device type the embeddings are cast to the autocast
    dtype, which is the compute dtype (as nn.Linear does for its input). fp32 weights under a bf16 / fp16
    autocast are NOT copied: the kernels convert them chunk by chunk (a chunk-sized
    temporary within ``chunk_memory``; on GPUs to the autocast dtype, the GEMMs' input
    dtype, while the CPU kernels compute in fp32 from the fp32 rows) and write their
    gradient in fp32 straight into the fp32 gradient, so no 16-bit copy of a shard or of its
    gradient is made. Other weight
    dtypes under autocast (e.g. bf16 weights with an fp16 autocast) are cast to the autocast
    dtype. Statistics and the loss are float32 for 16-bit and float32 inputs (float64 for
    float64 weights). With a margin and
    fp16 autocast on a GPU, each fp32 row is rounded to fp16 before it is normalized, so
    rows of norm below ~1e-3 lose cosine accuracy (fp16 subnormals); bf16 has no such limit.
    """
    check_inputs = check_options(margin, label_smoothing, ignore_index, reduction, check_inputs)
    return_details = bool_arg("return_details", return_details)
    shards, offsets, num_classes = check_shards(weight_shards, class_offsets)
    labels = check_tensors(embeddings, labels, shards[0].shape[1])
    ks = check_topk(topk, num_classes) if return_details else ()
    budget = None if chunk_memory is None else parse_memory(chunk_memory)
    keep_budget = check_memory_budget(memory_budget)
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
    per_shard = shard_statistics(
        embeddings,
        shards,
        offsets,
        op_labels,
        margin,
        budget,
        with_rank=bool(ks),
        shard_labels=shard_labels,
        memory_budget=keep_budget,
    )
    # The statistics are fp32 already; autocast must not lower the combining arithmetic.
    with torch.autocast(embeddings.device.type, enabled=False):
        stats = combine_statistics(per_shard, embeddings.device)
        loss, valid = loss_from_statistics(
            stats,
            labels,
            num_classes,
            label_smoothing=float(label_smoothing),
            ignore_index=ignore_index,
            reduction=reduction,
        )
    return loss_output(loss, stats, valid, ks) if return_details else loss


def _sample_shards(
    shards: Sequence[torch.Tensor],
    offsets: Sequence[int],
    labels: torch.Tensor,
    sample_rate: float,
    generator: Generators,
) -> Tuple[List[torch.Tensor], List[torch.Tensor], int]:
    """PartialFC in the one-process mode: ``(sub_shards, shard_labels, classes_used)``; each
    shard keeps the batch's positives plus sampled negatives (see :mod:`shardkit.softmax.sampling`)."""
    if generator is None or isinstance(generator, torch.Generator):
        generators = [generator] * len(shards)
    else:
        generators = list(generator) if isinstance(generator, (list, tuple)) else []
        if len(generators) != len(shards) or not all(isinstance(g, torch.Generator) for g in generators):
            raise TypeError(
                "argument `generator` must be None, a torch.Generator or one torch.Generator per "
                f"shard ({len(shards)}), got {generator!r}"
            )
    counts = sampled_class_counts([w.shape[0] for w in shards], sample_rate, labels.shape[0])
    subs, sub_labels = [], []
    for w, offset, count, gen in zip(shards, offsets, counts, generators):
        mark_sampled(w)
        sub_w, sub_y, _ = sample_shard(w, to_device(labels, w.device), offset, count, gen)
        subs.append(sub_w)
        sub_labels.append(sub_y)
    return subs, sub_labels, sum(counts)


def check_devices(devices: Sequence[torch.device]) -> None:
    """cpu and visible cuda devices only (the kernels' backends): a clear error at construction
    instead of torch's driver error or an autocast error at the first forward."""
    for dev in devices:
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"argument `devices`: {dev} is not supported; shardkit's kernels run on cpu and cuda")
    check_visible(devices, "devices")


def split_sizes(
    num_classes: int, num_shards: int, shard_sizes: Union[Sequence[int], Sequence[float], None]
) -> List[int]:
    """Shard sizes from None (even split, the first shards one larger), explicit ints
    summing to num_classes, or proportions (floats, any positive total; largest remainder)."""
    if shard_sizes is None:
        base, extra = divmod(num_classes, num_shards)
        return [base + (k < extra) for k in range(num_shards)]
    if isinstance(shard_sizes, (str, bytes)) or not hasattr(shard_sizes, "__iter__"):
        raise TypeError(
            f"argument `shard_sizes` must be a sequence of ints or proportions, got {type(shard_sizes).__name__}"
        )
    sizes = list(shard_sizes)
    if len(sizes) != num_shards:
        raise ValueError(f"argument `shard_sizes` has {len(sizes)} entries for {num_shards} devices")
    if any(isinstance(s, bool) or not isinstance(s, numbers.Real) for s in sizes):
        raise TypeError(f"argument `shard_sizes` must hold numbers, got {sizes}")
    # numpy / torch integers count as ints; NaN or inf proportions are refused.
    sizes = [int(s) if isinstance(s, numbers.Integral) else float(s) for s in sizes]
    if any(not math.isfinite(s) or s < 0 for s in sizes):
        raise ValueError(f"argument `shard_sizes` must hold finite non-negative numbers, got {sizes}")
    ints = [s for s in sizes if isinstance(s, int)]
    if len(ints) == len(sizes):
        if sum(ints) != num_classes:
            raise ValueError(f"argument `shard_sizes` {ints} sums to {sum(ints)}, not num_classes={num_classes}")
        return ints
    top = max(sizes)
    if top <= 0:
        raise ValueError(f"argument `shard_sizes` proportions must have a positive sum, got {sizes}")
    sizes = [s / top for s in sizes]  # in [0, 1]: the sum cannot overflow to inf
    total = float(sum(sizes))
    exact = [num_classes * s / total for s in sizes]
    out = [int(e) for e in exact]
    by_remainder = sorted(range(num_shards), key=lambda k: exact[k] - out[k], reverse=True)
    for k in by_remainder[: num_classes - sum(out)]:
        out[k] += 1
    return out


class LocalShards:
    """Shards on a list of devices of this process: shard k holds ``sizes[k]`` classes on
    ``devices[k]``, in class order. ``state_dict()`` holds one class-ordered ``weight``."""

    def __init__(
        self,
        num_classes: int,
        devices: Union[Sequence[DeviceLike], torch.device, str, None],
        shard_sizes: Union[Sequence[int], Sequence[float], None],
    ) -> None:
        if devices is None:
            devices = ["cpu"] if shard_sizes is None else ["cpu"] * len(list(shard_sizes))
        if isinstance(devices, (str, torch.device)):
            devices = [devices]
        try:
            self.devices = [torch.device(d) for d in devices]
        except (RuntimeError, TypeError) as err:
            msg = f"argument `devices` must list devices such as 'cpu' or 'cuda:0', got {devices!r}"
            raise ValueError(msg) from err
        if not self.devices:
            raise ValueError("argument `devices` must name at least one device")
        check_devices(self.devices)
        self.sizes = split_sizes(num_classes, len(self.devices), shard_sizes)

    def attach(self, module: ShardedHead) -> None:
        """One class-ordered ``weight`` in checkpoints, whatever the shard count."""
        class_ordered_checkpoints(module)

    def class_offsets(self, module: ShardedHead) -> Tuple[int, ...]:
        out, acc = [], 0
        for size in module.shard_sizes:
            out.append(acc)
            acc += size
        return tuple(out)

    @torch.no_grad()
    def reset_parameters(self, module: ShardedHead) -> None:
        # Drawn on the CPU shard by shard in class order: the same numbers as one [C, D] draw.
        bound = init_bound(module.embedding_dim)
        for p in module.weight_shards:
            if p.device.type == "meta":
                continue
            p.copy_(torch.empty(p.shape, dtype=p.dtype, device="cpu").uniform_(-bound, bound))

    def full_weight(self, module: ShardedHead, device: Optional[DeviceLike] = None) -> torch.Tensor:
        device = module.weight_shards[0].device if device is None else torch.device(device)
        return torch.cat([p.detach().to(device) for p in module.weight_shards], dim=0)

    def refuse(self, module: ShardedHead, error: Exception) -> NoReturn:
        """Raises ``error`` (a bad forward argument; the process-group mode raises it on
        every rank)."""
        raise error

    def forward(
        self,
        module: ShardedHead,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        return_details: bool,
        topk: Union[int, Sequence[int], None],
    ) -> Union[torch.Tensor, ShardedLossOutput]:
        shards = current_shards(module)
        check_shard_shapes(module, shards, module.num_classes)
        stand_in = stand_in_weight(module)
        if stand_in is not None:  # a class-ordered weight standing in (functional_call)
            shards = stand_in_shards(module, stand_in, shards)
        if (
            isinstance(embeddings, torch.Tensor)
            and not embeddings.is_nested
            and embeddings.dim() == 2
            and embeddings.shape[1] != module.embedding_dim
        ):
            raise ValueError(
                f"argument `embeddings` has dim {embeddings.shape[1]}, "
                f"but this loss has embedding_dim={module.embedding_dim}"
            )
        return sharded_cross_entropy(
            embeddings,
            shards,
            labels,
            margin=module.margin,
            label_smoothing=module.label_smoothing,
            ignore_index=module.ignore_index,
            reduction=module.reduction,
            class_offsets=module.class_offsets,
            chunk_memory=module.chunk_memory,
            check_inputs=module.check_inputs,
            return_details=return_details,
            topk=module.topk if topk is None else topk,
            sample_rate=module.sample_rate if module.training else 1.0,
            generator=module.sample_generator,
            memory_budget=module.memory_budget,
        )
