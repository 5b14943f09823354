"""``shardkit.ShardedSoftmaxLoss``: the FC layer + softmax cross-entropy with the classes
sharded, in one process over devices or over the ranks of a process group.

The module holds the parameters and the options; where the shards live and how their
statistics meet is the business of a mode object chosen once, at construction:
:class:`~shardkit.softmax.local.LocalShards` (one process) or
:class:`~shardkit.softmax.distributed.ProcessGroupShards` (torch.distributed). Both compute
four [B] statistics per shard with the fused op :func:`shardkit.ops.ce_shard_stats`
(log-sum-exp, target logit, logit sum, count of classes ranked above the target) and
combine them into the loss with differentiable torch code (:mod:`shardkit.softmax.core`).
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from shardkit.ops._args import bool_arg
from shardkit.ops._devices import check_visible
from shardkit.softmax.budget import check_memory_budget
from shardkit.softmax.checks import KERNEL_DTYPES, check_options, check_topk, parse_memory
from shardkit.softmax.collectives import DATA_PARALLEL
from shardkit.softmax.core import ShardedLossOutput, ShardStatistics
from shardkit.softmax.distributed import ProcessGroupShards
from shardkit.softmax.exchange import ConfigValue
from shardkit.softmax.head import ShardedHead, new_shards, warn_before_init
from shardkit.softmax.local import LocalShards, sharded_cross_entropy
from shardkit.softmax.margins import Margin
from shardkit.softmax.sampling import check_sample_rate, mark_sampled

__all__ = ["ShardedSoftmaxLoss", "sharded_cross_entropy", "ShardedLossOutput", "ShardStatistics"]

# The constructor's default ``topk``: its k's above ``num_classes`` are dropped (a given
# ``topk`` with such a k is refused).
DEFAULT_TOPK = (1, 5)


def _count(name: str, value: Any) -> int:
    """``value`` as a positive int (numpy integers too, not bools); ValueError naming it."""
    try:
        count = -1 if isinstance(value, bool) else operator.index(value)
    except TypeError:
        count = -1
    if count < 1:
        raise ValueError(f"argument `{name}` must be a positive int, got {value!r}")
    return count


class ShardedSoftmaxLoss(ShardedHead):
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
        topk: default k's of the correct counts returned by ``return_details=True``, each
            in [1, num_classes] (default ``(1, 5)``, less its k's above ``num_classes``).
        sample_rate: PartialFC sampling in training mode when < 1, in one process or
            distributed (see ``sharded_cross_entropy``: row-sparse weight gradients, use
            :class:`shardkit.SparseRowSGD`); evaluation mode uses every class. Seed it by
            setting ``.sample_generator`` (a torch.Generator of the shards' device, or one
            per shard).
        memory_budget: extra bytes per device the loss may hold from its forward to its
            backward, to keep the logits of as many class chunks as fit so that the backward
            need not recompute them (three GEMMs' work instead of four): an int, a string like
            "2GiB", "auto" (a quarter of the memory available at each forward,
            :data:`shardkit.softmax.budget.AUTO_SHARE`), "full" (keep every chunk, B x 4 bytes
            per class) or 0 (the default: keep nothing;
            extra memory O(B x chunk)). A hard bound, shared by a device's shards by their
            classes; the same loss and gradients at every budget. Kept logits are float32
            (float64 for float64 weights), B x 4 bytes per class. CPU shards use it; CUDA
            shards recompute (their kept path is not written yet).
        process_group, input_layout: the torch.distributed mode (see
            :mod:`shardkit.distributed` and the README): this rank holds ONE shard, classes
            ``split_classes(C, world_size)[rank]``, on ``devices[0]`` (default: the current GPU
            under NCCL, else the CPU); ``input_layout`` "data_parallel" (each rank its own batch;
            the embedding gradient is world_size * dL/dX_r) or "replicated".

    Attributes:
        weight_shards (nn.ParameterList): one [C_k, D] Parameter per device; shard k holds
            classes ``[class_offsets[k], class_offsets[k] + C_k)``.
        weight: None (the weights are the shards). In one process, a class-ordered [C, D]
            tensor set here stands in for the shards at ``forward`` (split over their devices,
            differentiably): what ``torch.func.functional_call(model, state_dict)`` does with
            the ``weight`` entry of ``state_dict()``. Not a parameter: optimizers, ``.to()``
            and checkpoints see the shards only.

    Init: U(-1/sqrt(D), 1/sqrt(D)) like nn.Linear, drawn from the CPU generator in class
    order, so under the same seed ``full_weight()`` equals ``nn.Linear(D, C, bias=False)``'s
    weight (as built on the CPU) exactly.

    Checkpoints: in one process, ``state_dict()`` holds ONE class-ordered ``weight`` [C, D]
    (on the shards' device when they share one, else on the CPU) whatever the shard count,
    and ``load_state_dict`` splits it over the current shards: save with 4 shards, load with
    1 or 3. Plain tensors, so ``torch.load(..., weights_only=True)`` reads it. With two or
    more shards that ``weight`` is a fresh copy, not a view: writing into ``state_dict()``
    values in place (as timm's ModelEmaV3 and ultralytics' ModelEMA average) changes
    nothing; :class:`shardkit.ModelEMA` averages the shards themselves. With a
    ``process_group``, ``state_dict()`` holds this rank's shard only (``weight_shards.0``,
    [C_r, D]); :func:`shardkit.save_sharded` / :func:`shardkit.load_sharded` write and read
    every rank's, re-sharded to any world size.

    Raises (at construction), naming the argument: ``TypeError`` for a ``dtype`` the kernels
    lack and for an argument of the wrong type (a string ``margin``, a float ``ignore_index``,
    a string ``sample_rate``, a ``check_inputs`` that is neither a bool nor a string);
    ``ValueError`` for a bad value of ``embedding_dim``, ``num_classes``, ``label_smoothing``,
    ``ignore_index``, ``reduction``, ``check_inputs``, ``topk``, ``chunk_memory``,
    ``memory_budget``, ``shard_sizes``, ``devices``, ``sample_rate`` or ``input_layout``;
    :class:`shardkit.distributed.DistributedInputError` when the ranks of a ``process_group`` disagree on
    the options. At ``forward``: see there.
    """

    _version = 1
    # A class attribute, so getattr(head, "weight") works for every head, old pickles too
    # (torch.distributed.checkpoint walks the state_dict keys with getattr).
    weight: Optional[torch.Tensor] = None
    _sample_generator: Union[torch.Generator, Sequence[torch.Generator], None]

    def __init__(
        self,
        embedding_dim: int,
        num_classes: int,
        *,
        margin: Optional[Margin] = None,
        devices: Union[Sequence[Union[torch.device, str, int]], torch.device, str, None] = None,
        shard_sizes: Union[Sequence[int], Sequence[float], None] = None,
        label_smoothing: float = 0.0,
        ignore_index: int = -100,
        reduction: Literal["mean", "sum", "none"] = "mean",
        dtype: Optional[torch.dtype] = None,
        chunk_memory: Union[int, str, None] = None,
        check_inputs: Union[bool, Literal["async"]] = True,
        topk: Union[int, Sequence[int], None] = DEFAULT_TOPK,
        process_group: Optional[dist.ProcessGroup] = None,
        input_layout: Literal["data_parallel", "replicated"] = "data_parallel",
        sample_rate: float = 1.0,
        memory_budget: Union[int, str] = 0,
    ) -> None:
        super().__init__()
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in KERNEL_DTYPES:
            raise TypeError(f"argument `dtype` must be float32, bfloat16, float16 or float64, got {dtype}")
        embedding_dim, num_classes = _count("embedding_dim", embedding_dim), _count("num_classes", num_classes)
        if num_classes * embedding_dim >= 2**63:
            raise ValueError(
                f"arguments `num_classes` x `embedding_dim` = {num_classes * embedding_dim} weights, "
                "more than int64 indexes"
            )
        check_inputs = check_options(margin, label_smoothing, ignore_index, reduction, check_inputs)
        if topk is DEFAULT_TOPK:
            topk = tuple(k for k in DEFAULT_TOPK if k <= num_classes)
        topk = check_topk(topk, num_classes)
        self.sample_rate = check_sample_rate(sample_rate)
        # Set to seed the sampling: a torch.Generator of the shard's device (a CPU generator
        # for a CUDA shard is refused by the sampling op), or in the one-process mode one per shard.
        self.sample_generator = None
        self._mode: Union[LocalShards, ProcessGroupShards]
        if process_group is None:
            if input_layout != DATA_PARALLEL:
                raise ValueError("argument `input_layout` needs `process_group`")
            self._mode = LocalShards(num_classes, devices, shard_sizes)
            warn_before_init()
        else:
            config: Dict[str, ConfigValue] = {
                "embedding_dim": embedding_dim,
                "dtype": str(dtype),
                "margin": None if margin is None else tuple(margin.params()),
                "sample_rate": self.sample_rate,
                "ignore_index": ignore_index,
                "label_smoothing": float(label_smoothing),
                "reduction": reduction,
            }
            self._mode = ProcessGroupShards(num_classes, process_group, input_layout, devices, shard_sizes, config)
        sizes, devices = self._mode.sizes, self._mode.devices
        self.__dict__["_sizes"] = (embedding_dim, num_classes)  # fixed: the shards hold them
        self.margin = margin
        self.label_smoothing = float(label_smoothing)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.chunk_memory = None if chunk_memory is None else parse_memory(chunk_memory)
        self.memory_budget = check_memory_budget(memory_budget)
        self.check_inputs = check_inputs
        self.topk = topk
        self.weight_shards = new_shards(sizes, embedding_dim, dtype, devices)
        self.reset_parameters()
        self._mode.attach(self)
        if self.sample_rate < 1.0:
            for p in self.weight_shards:
                mark_sampled(p)

    @property
    def sample_generator(self) -> Union[torch.Generator, Sequence[torch.Generator], None]:
        """The generator(s) of the class sampling: None, a torch.Generator, or (one-process
        mode) a list with one per shard."""
        return self._sample_generator

    @sample_generator.setter
    def sample_generator(self, value: Union[torch.Generator, Sequence[torch.Generator], None]) -> None:
        gens = value if isinstance(value, (list, tuple)) else [value]
        if value is not None and not all(isinstance(g, torch.Generator) for g in gens):
            raise TypeError(
                "`sample_generator` must be None, a torch.Generator or a list of them (one per shard), "
                f"got {type(value).__name__}"
            )
        if isinstance(value, (list, tuple)) and isinstance(self.__dict__.get("_mode"), ProcessGroupShards):
            raise TypeError(
                "`sample_generator` with a `process_group` must be None or one torch.Generator (this rank "
                f"holds one shard), got a {type(value).__name__}"
            )
        self.__dict__["_sample_generator"] = value

    @property
    def sample_rate(self) -> Any:
        """PartialFC's rate in (0, 1] (checked at each forward, as the other options)."""
        text = self.__dict__.get("_sample_rate_text")
        # A float is kept as its repr: torch.compile treats a str as a constant (a guard on its
        # value) where it would make a changed float symbolic, and the sampled counts need a
        # concrete rate: a head whose rate changed compiles whole again, one graph per distinct
        # rate (up to dynamo's recompile limit, 8 by default).
        if text is not None:
            return float(text)
        if "_sample_rate_value" in self.__dict__:
            return self.__dict__["_sample_rate_value"]
        return self.__dict__.get("sample_rate")  # a module pickled before the property

    @sample_rate.setter
    def sample_rate(self, value: Any) -> None:
        is_float = isinstance(value, float)
        self.__dict__["_sample_rate_text"] = float.__repr__(value) if is_float else None
        self.__dict__["_sample_rate_value"] = None if is_float else value
        # A public copy, never read here (the property wins): attribute copiers that walk
        # __dict__ (ModelEMA.update_attr, ultralytics' copy_attr) copy the rate through it.
        self.__dict__["sample_rate"] = value

    @property
    def embedding_dim(self) -> int:
        """D (fixed at construction: the shards' width)."""
        return self._fixed_sizes()[0]

    @embedding_dim.setter
    def embedding_dim(self, value: object) -> None:
        raise AttributeError("`embedding_dim` is fixed at construction (the weight shards' width); build a new head")

    @property
    def num_classes(self) -> int:
        """C (fixed at construction: the shards' classes)."""
        return self._fixed_sizes()[1]

    @num_classes.setter
    def num_classes(self, value: object) -> None:
        raise AttributeError("`num_classes` is fixed at construction (the weight shards' classes); build a new head")

    def _fixed_sizes(self) -> Tuple[int, int]:
        # (a head pickled before these were read-only kept them as plain attributes)
        sizes = self.__dict__.get("_sizes")
        return sizes if sizes is not None else (self.__dict__["embedding_dim"], self.__dict__["num_classes"])

    @property
    def shard_sizes(self) -> Tuple[int, ...]:
        """Classes per shard, in device order."""
        return tuple(p.shape[0] for p in self.weight_shards)

    @property
    def class_offsets(self) -> Tuple[int, ...]:
        """First class id of each shard."""
        return self._mode.class_offsets(self)

    @property
    def devices(self) -> List[torch.device]:
        """Each shard's current device."""
        return [p.device for p in self.weight_shards]

    def reset_parameters(self) -> None:
        """U(-1/sqrt(D), 1/sqrt(D)) (nn.Linear's kaiming_uniform(a=sqrt(5))), drawn on the
        CPU shard by shard in class order: the same numbers as one [C, D] draw (with a
        ``process_group``, each rank draws its own shard)."""
        self._mode.reset_parameters(self)

    def full_weight(self, device: Union[torch.device, str, int, None] = None) -> torch.Tensor:
        """A class-ordered copy [C, D] of the weight (detached) on ``device`` (default:
        the first shard's). With a ``process_group`` it is a collective: every rank calls it."""
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError):
                raise ValueError(f"argument `device` must name a device, got {device!r}") from None
            check_visible([device], "device")
        return self._mode.full_weight(self, device)

    def forward(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        *,
        return_details: bool = False,
        topk: Union[int, Sequence[int], None] = None,
    ) -> Union[torch.Tensor, ShardedLossOutput]:
        """embeddings [B, D] floating (B >= 1), labels [B] integer (int64; other integer
        dtypes are converted) on the embeddings' device: class ids in [0, C) or ``ignore_index``.

        Returns the loss on the embeddings' device (a scalar; [B] with reduction="none"),
        float32 (float64 when the weights are float64), or with ``return_details=True`` a
        :class:`ShardedLossOutput` (loss, per-row lse [B], correct {k: count} for ``topk``
        (default: the module's), num_valid).

        Raises:
            TypeError: floating or bool ``labels``, non-floating ``embeddings``, a
                ``return_details`` that is not a bool (Python or numpy; "no" or 1 is refused),
                a ``topk`` that is not an int or a sequence of ints.
            ValueError: (naming the argument) a ``topk`` with a k outside [1, num_classes] (the
                full head's class count, with sampling or a process group too),
                ``embeddings`` not [B, D] with this D, an empty
                batch, ``labels`` not [B] or on another device, a label outside [0, C) that
                is not ``ignore_index`` (with ``check_inputs``).
            shardkit.NonFiniteEmbeddingsError: NaN/inf embeddings (with ``check_inputs``; a
                ``ValueError``).
            shardkit.distributed.DistributedInputError: with a ``process_group``, when the ranks' inputs
                disagree, when any rank's input, forward argument or option is invalid (instead of
                the TypeError / ValueError above, which its message carries), when an option
                differs between the ranks, or when the ranks call different heads (raised on
                every rank at once; a ``ValueError``).
        """
        try:
            return_details = bool_arg("return_details", return_details)
            if topk is not None:
                topk = check_topk(topk, self.num_classes)
        except (TypeError, ValueError) as err:
            self._mode.refuse(self, err)  # with a process group: raised on every rank
        return self._mode.forward(self, embeddings, labels, return_details, topk)

    def extra_repr(self) -> str:
        devices = ", ".join(str(d) for d in self.devices)
        return (
            f"embedding_dim={self.embedding_dim}, num_classes={self.num_classes}, "
            f"shard_sizes={list(self.shard_sizes)}, devices=[{devices}], margin={self.margin}, "
            f"label_smoothing={self.label_smoothing}, ignore_index={self.ignore_index}, "
            f"reduction={self.reduction!r}" + "".join(f", {name}={value!r}" for name, value in self._set_options())
        )

    def _set_options(self) -> List[Tuple[str, object]]:
        """The options that differ from their defaults (what ``extra_repr`` adds)."""
        options: List[Tuple[str, object]] = [
            ("memory_budget", self.memory_budget),
            ("sample_rate", self.sample_rate),
            ("chunk_memory", self.chunk_memory),
            ("check_inputs", self.check_inputs),
            ("topk", self.topk),
        ]
        defaults = {
            "memory_budget": 0,
            "sample_rate": 1.0,
            "chunk_memory": None,
            "check_inputs": True,
            "topk": tuple(k for k in DEFAULT_TOPK if k <= self.num_classes),
        }
        return [(n, v) for n, v in options if v != defaults[n]]
