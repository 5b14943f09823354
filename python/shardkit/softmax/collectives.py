"""The collectives of the process-group mode and their autograd: the class dimension of
ShardedSoftmaxLoss split over the ranks of a ``torch.distributed`` process group (NCCL on
GPUs, gloo on CPUs).

Rank ``r`` owns one contiguous class range (ranks in order, sizes as even as possible:
the first ``C % W`` ranks hold one class more). Per step and rank:

1. one tiny host-side exchange on a CPU (gloo) group (:mod:`shardkit.softmax.exchange`):
   every rank's batch size, embedding width, dtype, an input-error flag and the step's
   mode. Batch sizes are host-known (``x.shape[0]``), so
   this blocks the host until all ranks arrive but never waits for the GPU (no
   ``.item()``); a rank with bad input makes EVERY rank raise at once instead of hanging.
2. one ``all_gather`` of a byte-packed ``[B_max, 8 + D * elem]`` buffer per rank: labels
   (8 bytes) and embeddings (viewed as bytes), padded to the largest batch.
3. the per-shard statistics kernel (``shardkit.ops.ce_shard_stats``) on the GLOBAL batch
   against the rank's own weight shard: lse, target logit, logit sum, each ``[B_g]`` fp32.
4. one ``all_gather`` of those statistics packed ``[3, B_g]``; every rank then combines
   them (logsumexp over ranks, sums) and computes the loss of the global batch.
5. backward: the statistics gather needs no communication (every rank computes the same
   function of the gathered statistics, so the gradient of rank r's statistics is its own
   slice of the identical upstream gradient); the kernel's dX of the global batch is
   reduce-scattered (sum) back to the owning ranks.

Semantics (InsightFace's convention): every rank returns the loss of the global batch;
the head's gradients are exact; each rank's embedding gradient is ``world_size * dL/dX_r``,
so that after DDP AVERAGES the backbone gradients the update equals single-process
training on the global batch. Therefore DDP must not synchronize the head (its shards differ
per rank: wrap the backbone alone, or mark them with
:func:`shardkit.distributed.ddp_ignore_heads`), and every rank must call backward on the loss
it got, unchanged.

The replicated layout (``input_layout="replicated"``: every rank holds the same
embeddings and labels, tensor-parallel style) skips the gather; dX is all-reduced (sum)
and carries no world_size factor: it is exactly ``dL/dX``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

DATA_PARALLEL = "data_parallel"
REPLICATED = "replicated"
_LAYOUTS = (DATA_PARALLEL, REPLICATED)


def split_classes(num_classes: int, world_size: int) -> List[int]:
    """Class counts per rank: as even as possible, the first ``num_classes % world_size``
    ranks one class more. Returns a list of ``world_size`` ints summing to ``num_classes``."""
    if world_size < 1:
        raise ValueError(f"argument `world_size` must be >= 1, got {world_size}")
    if num_classes < 1:
        raise ValueError(f"argument `num_classes` must be >= 1, got {num_classes}")
    base, extra = divmod(num_classes, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def class_offsets(sizes: Sequence[int]) -> List[int]:
    """Start class id of each rank's range, from the per-rank ``sizes``."""
    out: List[int] = []
    acc = 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


class CollectiveError(RuntimeError):
    """A collective of the distributed ShardedSoftmaxLoss failed or timed out, usually
    because another rank raised, exited or took a different code path."""


class DistributedInputError(ValueError):
    """Raised on every rank when any rank's input to the distributed loss is invalid."""


def _cpu_group_for(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo group with the same ranks as ``group``, for the host-side size exchange.

    Reuses ``group`` when it runs CPU tensors on gloo (a gloo group, or "cpu:gloo,cuda:nccl").
    Otherwise a new gloo group is made. Over the whole job that is torch's usual collective
    new_group(). For a SUBGROUP only its members build the loss (others are refused), and
    a plain new_group() called by them alone advances their group counter only: every
    later new_group() of the job would then pair groups of different names and time out.
    So a subgroup's gloo group synchronizes among its members (torch's
    use_local_synchronization), which needs the members to have created the same number
    of groups before; creating the subgroup as "cpu:gloo,cuda:nccl" avoids all of this.
    """
    backend = str(dist.get_backend(group)).lower()
    if backend == dist.Backend.GLOO or "cpu:gloo" in backend:
        return group
    ranks = dist.get_process_group_ranks(group)
    timeout = _group_timeout(group)
    if len(ranks) == dist.get_world_size():
        return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
    try:
        return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)
    except RuntimeError as err:
        raise CollectiveError(
            f"ShardedSoftmaxLoss: creating the gloo group for the size exchange among ranks {ranks} failed "
            f"({err}); torch names such a group from the number of groups each member has created, so they "
            f"must have created the same groups before. Create the subgroup with backend "
            f"'cpu:gloo,cuda:nccl' instead: it is then reused and nothing is created"
        ) from err


def _group_timeout(group: dist.ProcessGroup) -> Optional[timedelta]:
    """The timeout ``group`` was created with (so a rank that never arrives fails the size
    exchange as soon as it would fail the device collectives); None (torch's default) when
    torch does not expose it."""
    for device in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # private API: absent backends and other torch versions
            continue
    return None


class UnpickledHeadError(RuntimeError):
    """A process-group head restored by pickle was used for a collective: its group stayed
    with the job that built it."""


class DistContext:
    """Communication state of one distributed loss module, created once at construction.

    Attributes: ``group`` (the device process group), ``cpu_group`` (gloo, same ranks),
    ``rank``, ``world_size``, ``class_sizes`` (classes per rank), ``class_offset`` and
    ``num_local`` (this rank's range), ``num_classes``, ``layout``.
    """

    def __init__(
        self, num_classes: int, process_group: Optional[dist.ProcessGroup] = None, input_layout: str = DATA_PARALLEL
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "argument `process_group` needs torch.distributed to be initialized "
                "(call torch.distributed.init_process_group first, e.g. under torchrun)"
            )
        if input_layout not in _LAYOUTS:
            raise ValueError(f"argument `input_layout` must be one of {_LAYOUTS}, got {input_layout!r}")
        group = dist.group.WORLD if process_group is None else process_group
        assert group is not None  # the default group exists once torch.distributed is initialized (checked above)
        if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
            raise ValueError(
                "argument `process_group` does not contain this process: build the loss only on the ranks of its group"
            )
        self._groups: Optional[Tuple[dist.ProcessGroup, dist.ProcessGroup]] = (group, _cpu_group_for(group))
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.layout = input_layout
        self.num_classes = int(num_classes)
        self.class_sizes = split_classes(self.num_classes, self.world_size)
        self.class_offsets = class_offsets(self.class_sizes)
        self.class_offset = self.class_offsets[self.rank]
        self.num_local = self.class_sizes[self.rank]

    @property
    def group(self) -> dist.ProcessGroup:
        return self._live()[0]

    @property
    def cpu_group(self) -> dist.ProcessGroup:
        return self._live()[1]

    def _live(self) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
        if self._groups is None:
            raise UnpickledHeadError(
                "this process-group ShardedSoftmaxLoss was unpickled: its process group does not travel "
                "with it (it belongs to the job that built it). Its shard is in `weight_shards` and "
                "`state_dict()`; to train or evaluate, build the head in this job and load that state "
                "(or use shardkit.save_sharded / load_sharded)"
            )
        return self._groups

    def __deepcopy__(self, memo: Dict[int, object]) -> DistContext:
        # Immutable once built, and a process group cannot be copied: a deep copy of the head
        # (ModelEMA's EMA of it) shares this context, so it runs in the same group.
        return self

    def __getstate__(self) -> Dict[str, object]:
        state = dict(self.__dict__)
        state["_groups"] = None  # a ProcessGroup cannot be pickled; the unpickled head says so when used
        return state

    def fail(self, what: str, err: Exception) -> Exception:
        if isinstance(err, UnpickledHeadError):
            return err  # no collective ran: the head has no group
        return CollectiveError(
            f"ShardedSoftmaxLoss rank {self.rank}/{self.world_size}: collective '{what}' failed "
            f"- another rank may have raised, exited or timed out ({type(err).__name__}: {err})"
        )


def _row_bytes(dim: int, elem: int) -> int:
    # Labels first (8 bytes, so the int64 view is aligned), then the embedding row padded to
    # a multiple of 8 bytes so the next row's label stays aligned too.
    return 8 + (dim * elem + 7) // 8 * 8


def _pack(x: torch.Tensor, labels: torch.Tensor, rows: int) -> torch.Tensor:
    b, d = x.shape
    buf = torch.zeros(rows, _row_bytes(d, x.element_size()), dtype=torch.uint8, device=x.device)
    buf[:b, :8] = labels.reshape(b, 1).contiguous().view(torch.uint8)
    buf[:b, 8 : 8 + d * x.element_size()] = x.contiguous().view(torch.uint8)
    return buf


def _unpack(buf: torch.Tensor, dim: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    elem = torch.empty((), dtype=dtype, device="cpu").element_size()
    labels = buf[:, :8].contiguous().view(torch.int64).view(-1)
    x = buf[:, 8 : 8 + dim * elem].contiguous().view(dtype)
    return x, labels


def _select_rows(t: torch.Tensor, sizes: Sequence[int], b_max: int) -> torch.Tensor:
    """Rows of the valid samples of a [W * b_max, ...] padded tensor, in rank order."""
    if all(s == b_max for s in sizes):
        return t
    return torch.cat([t[r * b_max : r * b_max + s] for r, s in enumerate(sizes)], dim=0)


def _pad_rows(t: torch.Tensor, sizes: Sequence[int], b_max: int) -> torch.Tensor:
    if all(s == b_max for s in sizes):
        return t.contiguous()
    out = t.new_zeros((len(sizes) * b_max,) + tuple(t.shape[1:]))
    start = 0
    for r, s in enumerate(sizes):
        out[r * b_max : r * b_max + s] = t[start : start + s]
        start += s
    return out


class _GatherBatch(torch.autograd.Function):
    """Forward: [b_r, D] embeddings + [b_r] labels on each rank -> the global batch
    [B_g, D], [B_g] (one all_gather). Backward: reduce-scatter (sum) of dX_global, times
    world_size (the documented convention)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, labels: torch.Tensor, dctx: DistContext, sizes: List[int]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        b_max = max(sizes)
        packed = _pack(x.detach(), labels, b_max)
        out = packed.new_empty((dctx.world_size * b_max, packed.shape[1]))
        try:
            dist.all_gather_into_tensor(out, packed, group=dctx.group)
        except Exception as err:
            raise dctx.fail("embedding all_gather", err) from err
        xg, yg = _unpack(_select_rows(out, sizes, b_max), x.shape[1], x.dtype)
        ctx.dctx, ctx.sizes, ctx.b_max = dctx, sizes, b_max
        ctx.mark_non_differentiable(yg)
        return xg, yg

    @staticmethod
    @once_differentiable  # the collective has no recorded graph: a second derivative raises
    def backward(
        ctx: Any, grad_xg: torch.Tensor, _grad_yg: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, None, None, None]:
        dctx, sizes, b_max = ctx.dctx, ctx.sizes, ctx.b_max
        full = _pad_rows(grad_xg, sizes, b_max)
        mine = full.new_empty((b_max,) + tuple(full.shape[1:]))
        try:
            dist.reduce_scatter_tensor(mine, full, op=dist.ReduceOp.SUM, group=dctx.group)
        except Exception as err:
            raise dctx.fail("embedding-gradient reduce_scatter", err) from err
        grad_x = mine[: sizes[dctx.rank]]
        grad_x.mul_(dctx.world_size)
        return grad_x, None, None, None


class _ReplicatedInput(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) dX: every rank's shard contributes to
    the gradient of the same embeddings."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dctx: DistContext) -> torch.Tensor:
        ctx.dctx = dctx
        return x.view_as(x)

    @staticmethod
    @once_differentiable  # the collective has no recorded graph: a second derivative raises
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        try:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.dctx.group)
        except Exception as err:
            raise ctx.dctx.fail("embedding-gradient all_reduce", err) from err
        return grad, None


class _GatherStats(torch.autograd.Function):
    """Forward: this rank's packed statistics [k, B] (fp32) -> every rank's [W, k, B] (one
    all_gather). Backward: this rank's slice of the incoming gradient. That is exact and
    needs no communication because every rank evaluates the same function of the
    gathered statistics and receives the same upstream gradient."""

    @staticmethod
    def forward(ctx: Any, stats: torch.Tensor, dctx: DistContext) -> torch.Tensor:
        # Concatenated output form (gloo lacks the stacked one), viewed as [W, k, B].
        out = stats.new_empty((dctx.world_size * stats.shape[0],) + tuple(stats.shape[1:]))
        try:
            dist.all_gather_into_tensor(out, stats.contiguous(), group=dctx.group)
        except Exception as err:
            raise dctx.fail("statistics all_gather", err) from err
        ctx.rank = dctx.rank
        return out.view((dctx.world_size,) + tuple(stats.shape))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return grad[ctx.rank], None


def gather_batch(
    dctx: DistContext, x: torch.Tensor, labels: torch.Tensor, sizes: List[int]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The global batch as every rank sees it: ``(x_global [B_g, D], labels_global [B_g])``
    in rank order. Differentiable in ``x`` (data-parallel layout) or an identity with an
    all-reduced gradient (replicated layout)."""
    if dctx.layout == REPLICATED:
        return _ReplicatedInput.apply(x, dctx), labels
    return _GatherBatch.apply(x, labels, dctx, sizes)


def combine_stats(
    dctx: DistContext,
    lse: torch.Tensor,
    target: torch.Tensor,
    logit_sum: torch.Tensor,
    greater: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global ``(LSE, T, S, greater_count)`` [B_g] from this rank's shard statistics with ONE
    all_gather of the packed stats, then logsumexp / sums over ranks (differentiable in
    the first three). The int64 counts (top-k), when given, ride in the same buffer as raw
    bits (they are only copied, never reduced, by the gather); else the counts are zeros."""
    rows = [lse, target, logit_sum]
    if greater is not None:
        # [B] int64 = [2B] fp32 (or [B] fp64) bit patterns; reshaped to rows of B.
        rows += list(greater.contiguous().view(lse.dtype).view(-1, lse.shape[0]).unbind(0))
    g = _GatherStats.apply(torch.stack(rows), dctx)
    lse_g, target_g, sum_g = torch.logsumexp(g[:, 0], dim=0), g[:, 1].sum(0), g[:, 2].sum(0)
    if greater is None:
        counts = torch.zeros(lse.shape, dtype=torch.int64, device=lse.device)
    else:
        # clone, not contiguous: the int64 view needs an 8-byte-aligned storage offset
        counts = g[:, 3:].detach().clone().view(dctx.world_size, -1).view(torch.int64).sum(0)
    return lse_g, target_g, sum_g, counts


def all_gather_rows(dctx: DistContext, rows: torch.Tensor) -> torch.Tensor:
    """Concatenation over ranks of per-rank ``[n_r, ...]`` tensors (n_r may differ);
    used for ``full_weight()``. Not differentiable; two collectives (sizes, data)."""
    n = torch.tensor([rows.shape[0]], dtype=torch.int64, device="cpu")
    ns = torch.empty(dctx.world_size, dtype=torch.int64, device="cpu")
    try:
        dist.all_gather_into_tensor(ns, n, group=dctx.cpu_group)
        sizes = ns.tolist()
        padded = rows.new_zeros((max(sizes),) + tuple(rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        out = rows.new_empty((dctx.world_size * max(sizes),) + tuple(rows.shape[1:]))
        dist.all_gather_into_tensor(out, padded.contiguous(), group=dctx.group)
    except Exception as err:
        raise dctx.fail("weight all_gather", err) from err
    return _select_rows(out, sizes, max(sizes))
