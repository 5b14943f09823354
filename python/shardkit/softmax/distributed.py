"""The process-group mode of the sharded loss: ONE weight shard per rank of a
``torch.distributed`` group (classes ``[class_offset, class_offset + C_r)``, split as
:func:`shardkit.softmax.collectives.split_classes`). The collectives and their autograd
are in :mod:`shardkit.softmax.collectives`.

:class:`ProcessGroupShards` is the mode object :class:`shardkit.ShardedSoftmaxLoss` picks
when it gets a ``process_group``; it answers the same calls as the one-process
:class:`shardkit.softmax.local.LocalShards`.
"""

from __future__ import annotations

import weakref
from typing import Dict, NoReturn, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shardkit import ops
from shardkit.softmax.budget import check_memory_budget, shard_budgets
from shardkit.softmax.checks import check_options, check_tensors, check_topk, check_values, parse_memory
from shardkit.softmax.collectives import (
    DistContext,
    DistributedInputError,
    all_gather_rows,
    combine_stats,
    gather_batch,
)
from shardkit.softmax.core import (
    ShardedLossOutput,
    ShardStatistics,
    chunk_classes,
    compute_dtype,
    loss_from_statistics,
    loss_output,
    plain_target_logit,
    target_ref_dtype,
    weights_for,
)
from shardkit.softmax.exchange import ConfigValue, check_same_config, exchange_batch_info
from shardkit.softmax.head import (
    ShardedHead,
    check_shard_shapes,
    checked_weight_loads,
    current_shards,
    init_bound,
    stand_in_weight,
)
from shardkit.softmax.margins import Margin
from shardkit.softmax.sampling import check_sample_rate, mark_sampled, sample_shard, sampled_class_counts

DeviceLike = Union[torch.device, str, int]

# The DistributedDataParallel modules already checked for a head's shard: {ddp: {id(shard): ref}}.
_DDP_CHECKED: weakref.WeakKeyDictionary[torch.nn.Module, Dict[int, weakref.ref]] = weakref.WeakKeyDictionary()


def check_not_synced_by_ddp(shard: torch.Tensor) -> None:
    """Refuses (``ValueError``) a shard that the DistributedDataParallel running this forward
    synchronizes: DDP copied rank 0's shard over the other ranks' at construction and would
    average the gradients of different classes. One class-attribute read per step; the
    module's parameters are searched once per DDP module. Not while torch.compile traces the
    head (``DistributedDataParallel(torch.compile(model))``): reading the running DDP's module,
    which holds the module being traced, fails dynamo's own mutation tracking."""
    if torch.compiler.is_compiling():
        return
    active = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
    ddp = active() if active is not None else None
    if ddp is None:
        return
    seen = _DDP_CHECKED.setdefault(ddp, {})
    ref = seen.get(id(shard))
    if ref is not None and ref() is shard:
        return
    ignored = getattr(ddp, "parameters_to_ignore", ())
    synced = [n for n, p in ddp.module.named_parameters(remove_duplicate=False) if p is shard and n not in ignored]
    if synced:
        raise ValueError(
            f"this process-group head's shard (parameter {synced[0]!r}) is inside a DistributedDataParallel "
            "that synchronizes it: DDP copied rank 0's shard over the other ranks' when it was built and "
            "would average the gradients of different classes. Wrap the backbone alone in DDP, or call "
            "shardkit.distributed.ddp_ignore_heads(model) before DistributedDataParallel(model)"
        )
    seen[id(shard)] = weakref.ref(shard)


def default_device(group: dist.ProcessGroup) -> torch.device:
    """This rank's shard device when ``devices`` is not given: the group's bound device
    (``init_process_group(device_id=...)``) or the current CUDA device when the group
    runs CUDA tensors on NCCL, else the CPU. A group made by ``init_process_group()``
    without a backend, or by "cpu:gloo,cuda:nccl", is NCCL for CUDA tensors too (its
    backend name is not "nccl"), so the name is searched, not compared."""
    backend = str(dist.get_backend(group)).lower()
    on_gpu = torch.cuda.is_available() and (
        "nccl" in backend or (backend == dist.Backend.UNDEFINED and dist.is_nccl_available())
    )
    if not on_gpu:
        return torch.device("cpu")
    bound = getattr(group, "bound_device_id", None)
    if isinstance(bound, torch.device) and bound.type == "cuda" and bound.index is not None:
        return bound
    return torch.device("cuda", torch.cuda.current_device())


class ProcessGroupShards:
    """This rank's one shard of a head split over the ranks of ``process_group``.

    ``state_dict()`` holds the rank's own shard only; :func:`shardkit.save_sharded` writes
    re-shardable files."""

    def __init__(
        self,
        num_classes: int,
        process_group: Optional[dist.ProcessGroup],
        input_layout: str,
        devices: Union[Sequence[DeviceLike], torch.device, str, None],
        shard_sizes: Optional[Sequence[float]],
        config: Optional[dict[str, ConfigValue]] = None,
    ) -> None:
        """``config``: the head's arguments that every rank must share (checked across the
        group with one small collective, :func:`check_same_config`)."""
        if shard_sizes is not None:
            raise ValueError(
                "argument `shard_sizes` is not used with `process_group`: rank r holds "
                "shardkit.distributed.split_classes(num_classes, world_size)[r] classes"
            )
        self.ctx = DistContext(num_classes, process_group, input_layout)
        if devices is None:
            devices = [default_device(self.ctx.group)]
        if isinstance(devices, (str, torch.device)):
            devices = [devices]
        devices = list(devices)
        if len(devices) != 1:
            raise ValueError(f"argument `devices` must name ONE device per rank with `process_group`, got {devices}")
        self.devices = [torch.device(devices[0])]
        self.sizes = [self.ctx.num_local]
        # The head's token pairs this rank's shard with the others' (checked at every step).
        self.token = check_same_config(
            self.ctx, {"num_classes": num_classes, "input_layout": input_layout, **(config or {})}
        )

    def refuse(self, module: ShardedHead, error: Exception) -> NoReturn:
        """Raises ``error`` (a bad forward argument or option on this rank) on every rank:
        this rank reports it in the step's exchange, which the others are waiting in."""
        exchange_batch_info(self.ctx, None, error, token=getattr(self, "token", 0))
        raise error  # (not reached: the exchange raises DistributedInputError)

    def attach(self, module: ShardedHead) -> None:
        """Ranks keep their own shard in ``state_dict()``; loading checks its dtype and layout."""
        checked_weight_loads(module)

    def class_offsets(self, module: ShardedHead) -> Tuple[int, ...]:
        return (self.ctx.class_offset,)

    @torch.no_grad()
    def reset_parameters(self, module: ShardedHead) -> None:
        """nn.Linear's U(-1/sqrt(D), 1/sqrt(D)) for this rank's shard, from a CPU generator
        seeded by one draw of the global CPU generator plus the rank: ranks seeded alike still
        give different classes different rows (the one-process draw is not reproduced; use
        :func:`shardkit.import_full_weight` for an exact copy of a given weight)."""
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu").item()) + 1000003 * self.ctx.rank
        gen = torch.Generator().manual_seed(seed % 2**63)
        bound = init_bound(module.embedding_dim)
        for p in module.weight_shards:
            if p.device.type != "meta":
                p.copy_(torch.empty(p.shape, dtype=p.dtype, device="cpu").uniform_(-bound, bound, generator=gen))

    def full_weight(self, module: ShardedHead, device: Optional[DeviceLike] = None) -> torch.Tensor:
        """Class-ordered [C, D] copy gathered from every rank (a collective: all ranks call it)."""
        full = all_gather_rows(self.ctx, module.weight_shards[0].detach())
        return full if device is None else full.to(device)

    def forward(
        self,
        module: ShardedHead,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        return_details: bool,
        topk: Union[int, Sequence[int], None],
    ) -> Union[torch.Tensor, ShardedLossOutput]:
        """The loss of the GLOBAL batch on every rank (see :mod:`shardkit.softmax.collectives`
        for the gradient convention)."""
        try:  # options set after construction are checked here, as the one-process mode does
            check_inputs = check_options(
                module.margin, module.label_smoothing, module.ignore_index, module.reduction, module.check_inputs
            )
            ks = check_topk(module.topk if topk is None else topk, module.num_classes) if return_details else ()
            rate = check_sample_rate(module.sample_rate) if module.training else 1.0  # eval: every class
            if module.chunk_memory is not None:
                parse_memory(module.chunk_memory)
            check_memory_budget(module.memory_budget)
            shards = current_shards(module)
            check_not_synced_by_ddp(module.weight_shards[0])
            if stand_in_weight(module) is not None:
                raise ValueError(
                    "attribute `weight` (a class-ordered weight standing in for the shards) is the one-process form; "
                    "with a process_group set `weight_shards.0` (this rank's shard), as torch.func.functional_call "
                    "does with this head's state_dict()"
                )
            check_shard_shapes(module, shards, self.ctx.num_local)
        except (TypeError, ValueError) as err:
            self.refuse(module, err)
        options: dict[str, ConfigValue] = {
            "margin": None if module.margin is None else tuple(module.margin.params()),
            "ignore_index": module.ignore_index,
            "label_smoothing": float(module.label_smoothing),
            "reduction": module.reduction,
        }
        generator = module.sample_generator
        assert not isinstance(generator, Sequence)  # the module's setter refuses lists in this mode
        stats, labels_g, used = distributed_statistics(
            self.ctx,
            embeddings,
            labels,
            shards[0],
            margin=module.margin,
            chunk_memory=module.chunk_memory,
            with_rank=bool(ks),
            ignore_index=module.ignore_index,
            check_inputs=check_inputs,
            sample_rate=rate,
            generator=generator,
            return_details=return_details,
            memory_budget=module.memory_budget,
            identity=(getattr(self, "token", 0), options),
        )
        with torch.autocast(stats.lse.device.type, enabled=False):  # fp32 statistics stay fp32
            loss, valid = loss_from_statistics(
                stats,
                labels_g,
                used,
                label_smoothing=module.label_smoothing,
                ignore_index=module.ignore_index,
                reduction=module.reduction,
            )
        return loss_output(loss, stats, valid, ks) if return_details else loss


def check_local_input(
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    dim: int,
    num_classes: int,
    ignore_index: int,
    check_inputs: Union[bool, str],
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """The one-process mode's argument checks, except that a rank may bring an EMPTY batch
    (only the global batch must be non-empty), plus the shard's ``device``: embeddings
    elsewhere would fail in the first collective on this rank alone (NCCL takes no CPU
    tensor) while the others wait in it. Returns labels as int64; raises ValueError /
    TypeError naming the argument."""
    if device is not None and isinstance(embeddings, torch.Tensor) and embeddings.device != device:
        raise ValueError(
            f"argument `embeddings` is on {embeddings.device} but this rank's weight shard is on "
            f"{device}; move the embeddings (and labels) there"
        )
    if (
        isinstance(embeddings, torch.Tensor)
        and not embeddings.is_nested
        and embeddings.dim() == 2
        and embeddings.shape[0] == 0
    ):
        # check_tensors rejects empty batches; run it on a one-row stand-in for the rest, after
        # the labels' length (a stand-in of one of them hid [3] labels for 0 rows).
        if isinstance(labels, torch.Tensor) and tuple(labels.shape) != (0,):
            raise ValueError(
                f"argument `labels` has shape {list(labels.shape)} but `embeddings` has 0 rows; an empty "
                "batch on a rank takes labels of shape [0]"
            )
        fake_labels = labels[:1] if isinstance(labels, torch.Tensor) and labels.dim() == 1 else labels
        if isinstance(fake_labels, torch.Tensor) and fake_labels.shape[0] == 0:
            fake_labels = fake_labels.new_zeros(1)
        check_tensors(embeddings.new_zeros(1, embeddings.shape[1]), fake_labels, dim)
        return labels.long()
    labels = check_tensors(embeddings, labels, dim)
    if check_inputs == "async" and embeddings.device.type == "cpu":
        # No device to sync with on the CPU: the check runs at once, and its error reaches the
        # other ranks through the batch exchange (an assert raised here left them waiting in
        # that exchange until the group's timeout).
        check_inputs = True
    if check_inputs:
        check_values(embeddings, labels, num_classes, ignore_index, check_inputs)
    return labels


def distributed_statistics(
    dctx: DistContext,
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    *,
    margin: Optional[Margin],
    chunk_memory: Optional[int],
    with_rank: bool,
    ignore_index: int = -100,
    check_inputs: Union[bool, str] = True,
    sample_rate: float = 1.0,
    generator: Optional[torch.Generator] = None,
    return_details: bool = False,
    memory_budget: Union[int, str] = 0,
    identity: Tuple[int, Optional[Dict[str, ConfigValue]]] = (0, None),
) -> Tuple[ShardStatistics, torch.Tensor, int]:
    """One rank's part of the distributed loss, up to the global statistics.

    Args:
        embeddings: [b_r, D] this rank's batch (data-parallel layout; b_r may be 0) or the
            replicated [B, D] batch.
        labels: [b_r] integer class ids in [0, num_classes) or ``ignore_index``.
        weight: [C_r, D] this rank's shard (classes ``dctx.class_offset`` onward).
        margin, chunk_memory, check_inputs: as :func:`shardkit.sharded_cross_entropy`.
        with_rank: also count, per row, the classes whose plain logit beats the target
            (top-k); costs one extra all-reduce of [B_g] (the plain target logit).
        sample_rate: PartialFC rate in (0, 1]; below 1 only the sampled classes take part.
        generator: torch.Generator on the weight's device for the sampling.
        return_details: whether the caller returns details (checked to agree across
            ranks, with ``with_rank`` and ``sample_rate``, in the per-step exchange).
        memory_budget: this rank's budget (bytes or "auto", as
            :func:`shardkit.sharded_cross_entropy`); ranks may differ.
        identity: ``(token, options)`` of the head, compared across the ranks in the
            per-step exchange (see :func:`shardkit.softmax.exchange.exchange_batch_info`).

    Returns:
        ``(stats, labels_global, num_classes_used)``: :class:`ShardStatistics` of the
        global batch ([B_g] each; identical on every rank), the global labels [B_g] int64
        in rank order, and the class count the smoothing term divides by (all classes, or
        the sampled ones).
    """

    error = None
    try:
        labels = check_local_input(
            embeddings, labels, weight.shape[1], dctx.num_classes, ignore_index, check_inputs, weight.device
        )
        dtype = compute_dtype(weight)
        if embeddings.dtype != dtype:
            embeddings = embeddings.to(dtype)  # cast before the gather: fewer bytes on the wire
    except (ValueError, TypeError) as err:
        error = err
    needs_grad = torch.is_grad_enabled() and isinstance(embeddings, torch.Tensor) and embeddings.requires_grad
    mode = (return_details, with_rank, sample_rate, needs_grad)
    sizes = exchange_batch_info(dctx, embeddings, error, mode, token=identity[0], options=identity[1])
    if sum(sizes) == 0:
        raise DistributedInputError(
            f"ShardedSoftmaxLoss rank {dctx.rank}: argument `embeddings` is empty on every rank; the loss "
            "of no samples is undefined"
        )
    xg, yg = gather_batch(dctx, embeddings, labels, sizes)
    batch = xg.shape[0]
    y_op = yg
    if 0 <= ignore_index < dctx.num_classes:
        # An ignore_index that is also a class id must not be a target (nor a sampled positive).
        y_op = yg.masked_fill(yg == ignore_index, -1)
    if sample_rate < 1.0:
        counts = sampled_class_counts(dctx.class_sizes, sample_rate, batch)
        mark_sampled(weight)
        w, y_shard, _ = sample_shard(weight, y_op, dctx.class_offset, counts[dctx.rank], generator)
        offset, used = 0, sum(counts)
    else:
        w, y_shard, offset, used = weight, y_op, dctx.class_offset, dctx.num_classes
    w = weights_for(w, xg.dtype)  # fp32 weights with 16-bit (autocast) embeddings go as they are
    target_ref = None
    if with_rank:
        part = plain_target_logit([(xg, y_shard)], [w], [offset], y_shard, margin, xg.device)
        target_ref = torch.zeros(batch, dtype=target_ref_dtype(xg.dtype), device=xg.device) if part is None else part
        try:  # the rank owning each row's class contributes its plain logit, the others 0
            dist.all_reduce(target_ref, group=dctx.group)
        except Exception as err:
            raise dctx.fail("target-logit all_reduce", err) from err
    scale, m1, m2, m3 = margin.params() if margin is not None else (1.0, 1.0, 0.0, 0.0)
    lse, target, logit_sum, greater = ops.ce_shard_stats(
        xg,
        w,
        y_shard,
        class_offset=offset,
        scale=scale,
        m1=m1,
        m2=m2,
        m3=m3,
        normalize=margin is not None,
        chunk_classes=chunk_classes(batch, w.shape[0], xg.shape[1], xg.dtype, chunk_memory),
        target_ref=target_ref,
        memory_budget=shard_budgets(check_memory_budget(memory_budget), [w])[0],
    )
    with torch.autocast(xg.device.type, enabled=False):  # fp32 statistics stay fp32
        lse_g, target_g, sum_g, greater_g = combine_stats(dctx, lse, target, logit_sum, greater if with_rank else None)
    return ShardStatistics(lse_g, target_g, sum_g, greater_g), yg, used
