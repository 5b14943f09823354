"""A drop-in for InsightFace arcface_torch's ``partial_fc_v2.PartialFC_V2``, backed by
:class:`shardkit.ShardedSoftmaxLoss`.

In an arcface_torch ``train_v2.py`` the change is the import line::

    from shardkit.softmax.partial_fc import PartialFC_V2   # was: from partial_fc_v2 import PartialFC_V2

The constructor and ``forward`` take what PartialFC_V2's take; the loss is the same number
(the mean over the global batch) with the same gradient convention (each rank's embedding
gradient is ``world_size * dL/dX_r``); the weight is drawn as PartialFC_V2 draws it
(N(0, 0.01), this rank's rows, from the CPU generator), so under the same seed the two start
from the same numbers. ``torch.optim.SGD`` / ``AdamW`` over ``parameters()`` work unchanged:
with ``sample_rate < 1`` the weight's gradient is dense with zero rows for the classes not
sampled, as PartialFC_V2's is, so those optimizers treat the rows as they do under
PartialFC_V2 (weight decay and momentum still move them).

:class:`SparseRowPartialFC_V2` keeps the gradient row-sparse instead (no dense ``[C, D]``
gradient is ever formed); step it with :class:`shardkit.SparseRowSGD`, which leaves the rows
not sampled untouched: the second line of the change.

Where the math differs from arcface_torch (see docs/guides/arcface_torch.md): ArcFace's
gradient here is the exact derivative of the margin (PartialFC_V2 treats ``cos(theta + m)``
as if its derivative were 1), and past ``theta + m = pi`` the target logit continues
linearly (:mod:`shardkit.softmax.margins`). CosFace and plain cosine logits are the same
math.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Dict, List, Literal, Optional, Sequence, Union, cast

import torch
import torch.distributed as dist
from torch import nn

from shardkit.softmax.core import ShardedLossOutput
from shardkit.softmax.head import unreport_answered_keys, unreport_keys
from shardkit.softmax.margins import ArcFace, CombinedMargin, CosFace, Margin
from shardkit.softmax.module import ShardedSoftmaxLoss
from shardkit.softmax.sampling import _SAMPLED

__all__ = ["PartialFC_V2", "SparseRowPartialFC_V2", "margin_from_loss"]

INIT_STD = 0.01  # PartialFC_V2's weight init: N(0, 0.01)


def margin_from_loss(margin_loss: object) -> Margin:
    """The shardkit margin that computes what ``margin_loss`` computes.

    Accepts a shardkit :class:`~shardkit.Margin`, or arcface_torch's loss objects by their
    attributes: ``CombinedMarginLoss`` (``s, m1, m2, m3, interclass_filtering_threshold``),
    ``ArcFace`` (``s, margin``; of earlier releases ``scale`` with ``margin`` or with
    ``cos_m, sin_m``, or a class named ``ArcFace`` with ``s, m``), ``CosFace`` (``s, m``).
    ``CombinedMarginLoss`` applies ArcFace when ``m1 == 1 and m3 == 0`` (plain scaled cosine when ``m2 == 0`` too) and
    CosFace when ``m3 > 0``.

    Raises:
        TypeError: ``margin_loss`` is none of these.
        ValueError: a setting arcface_torch refuses (``m1 != 1`` with ``m3 == 0``), one it
            silently reduces to CosFace (``m3 > 0`` with ``m1 != 1`` or ``m2 != 0``: it then
            ignores ``m1`` and ``m2``), or ``interclass_filtering_threshold > 0`` (not
            supported: it zeroes logits above the threshold, an O(B x C) mask).
    """
    if isinstance(margin_loss, Margin):
        return margin_loss
    if all(hasattr(margin_loss, name) for name in ("s", "m1", "m2", "m3")):
        s, m1, m2, m3 = (_number(margin_loss, name) for name in ("s", "m1", "m2", "m3"))
        for name, value in (("s", s), ("m1", m1), ("m2", m2), ("m3", m3)):
            if not math.isfinite(value):
                raise ValueError(f"argument `margin_loss` has {name}={value}; it must be finite")
        threshold = _number(margin_loss, "interclass_filtering_threshold", default=0.0)
        if math.isnan(threshold):
            raise ValueError("argument `margin_loss`: interclass_filtering_threshold is NaN; set it to 0")
        if threshold > 0:
            raise ValueError(
                f"argument `margin_loss`: interclass_filtering_threshold={threshold} is not supported "
                "(it masks every logit above the threshold, which needs the [B, C] logits); set it to 0"
            )
        if m1 == 1.0 and m3 == 0.0:
            return ArcFace(s, m2) if m2 != 0.0 else CombinedMargin(s)
        if m3 > 0.0:
            if m1 != 1.0 or m2 != 0.0:
                raise ValueError(
                    f"argument `margin_loss`: margins (m1={m1}, m2={m2}, m3={m3}); arcface_torch's "
                    "CombinedMarginLoss applies only m3 (CosFace) when m3 > 0 and ignores m1 and m2. Set "
                    "m1=1, m2=0 for CosFace, or use shardkit.CombinedMargin for the combined margin"
                )
            return CosFace(s, m3)
        raise ValueError(
            f"argument `margin_loss`: margins (m1={m1}, m2={m2}, m3={m3}) are refused by arcface_torch's "
            "CombinedMarginLoss too; use m1=1 with m2 (ArcFace) or m3 > 0 (CosFace)"
        )
    arc = _arcface_of(margin_loss)
    if arc is not None:
        return arc
    if hasattr(margin_loss, "s") and hasattr(margin_loss, "m"):
        return CosFace(_number(margin_loss, "s"), _number(margin_loss, "m"))
    raise TypeError(
        "argument `margin_loss` must be a shardkit margin or an arcface_torch margin loss "
        f"(CombinedMarginLoss, ArcFace, CosFace), got {type(margin_loss).__name__}"
    )


def _arcface_of(margin_loss: object) -> Optional[Margin]:
    """arcface_torch's ``ArcFace`` as its releases store it, else None: the scale as ``s``
    (2023 on) or ``scale`` (2022), the margin as ``margin`` or, where a release keeps only its
    cosine and sine (early 2022), ``atan2(sin_m, cos_m)``; a class named ``ArcFace`` with
    ``s`` and ``m`` (2021) is an ArcFace too, not the CosFace those two names mean elsewhere."""
    scale = "s" if hasattr(margin_loss, "s") else "scale" if hasattr(margin_loss, "scale") else None
    if scale is None:
        return None
    if hasattr(margin_loss, "margin"):
        return ArcFace(_number(margin_loss, scale), _number(margin_loss, "margin"))
    if hasattr(margin_loss, "cos_m") and hasattr(margin_loss, "sin_m"):
        angle = math.atan2(_number(margin_loss, "sin_m"), _number(margin_loss, "cos_m"))
        return ArcFace(_number(margin_loss, scale), angle)
    if type(margin_loss).__name__ == "ArcFace" and hasattr(margin_loss, "m"):
        return ArcFace(_number(margin_loss, scale), _number(margin_loss, "m"))
    return None


def _number(margin_loss: object, name: str, default: Optional[float] = None) -> float:
    """The attribute ``name`` of an arcface_torch margin loss as a float: a real number or a
    one-element tensor (not a bool, string or None, which float() would take or name nothing
    by); ``default`` where the attribute is absent or None."""
    value = getattr(margin_loss, name, None)
    if value is None and default is not None:
        return default
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype.is_floating_point:
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"argument `margin_loss` ({type(margin_loss).__name__}) has {name}={value!r}; it must be a real number"
        )
    return float(value)


def _densify_grad(param: torch.Tensor) -> None:
    """Post-accumulate hook: the sampled shard's row-sparse gradient becomes a dense one
    with zero rows (PartialFC_V2's), so torch optimizers take it."""
    if param.grad is not None and param.grad.is_sparse:
        param.grad = param.grad.to_dense()
    # The tag makes a torch.optim.SGD with momentum warn about rows moved without a gradient;
    # with a dense gradient that is what PartialFC_V2 does, so there is nothing to warn about.
    setattr(param, _SAMPLED, False)


class PartialFC_V2(ShardedSoftmaxLoss):
    """arcface_torch's PartialFC_V2 on :class:`shardkit.ShardedSoftmaxLoss` (a subclass:
    every ShardedSoftmaxLoss attribute and checkpoint helper works on it).

    Args (PartialFC_V2's, in its order):
        margin_loss: arcface_torch's ``CombinedMarginLoss`` (or ``ArcFace`` / ``CosFace``) or
            a shardkit margin; see :func:`margin_from_loss`.
        embedding_size (int): D.
        num_classes (int): C, over all ranks.
        sample_rate (float): PartialFC in (0, 1]: each step uses the batch's positive classes
            plus uniformly sampled negatives, ``ceil(rate * C_r)`` per rank (PartialFC_V2:
            ``int(rate * C_r)``); the others get a zero gradient row.
        fp16 (bool): compute the logits under an fp16 autocast (PartialFC_V2's flag; False
            also disables an outer autocast for the head, as there).

    Keyword-only (shardkit's): ``chunk_memory``, ``check_inputs``, ``dtype`` as
    :class:`~shardkit.ShardedSoftmaxLoss`; ``sparse_grad`` (default False): keep the sampled
    weight gradient row-sparse (use :class:`shardkit.SparseRowSGD`) instead of dense.

    Process group: when ``torch.distributed`` is initialized with more than one rank, the
    classes are split over the ranks of the default group as PartialFC_V2 splits them
    (rank r holds ``C // W + (r < C % W)`` classes, in rank order) and ``forward`` takes this
    rank's batch (the shard is built where :class:`~shardkit.ShardedSoftmaxLoss` puts it:
    the current GPU under NCCL); otherwise every class is in this process, built on the CPU
    (PartialFC_V2 needs an initialized group even then; this class does not). Move the
    module with ``.cuda()`` as train_v2.py does.

    ``state_dict()`` holds ``weight``: this rank's ``[C_r, D]`` rows, PartialFC_V2's key and
    layout, so checkpoints load either way.
    """

    def __init__(
        self,
        margin_loss: object,
        embedding_size: int,
        num_classes: int,
        sample_rate: float = 1.0,
        fp16: bool = False,
        *,
        sparse_grad: bool = False,
        chunk_memory: Union[int, str, None] = None,
        check_inputs: Union[bool, Literal["async"]] = True,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        if not isinstance(fp16, bool):
            raise TypeError(f"argument `fp16` must be True or False, got {fp16!r}")
        if not isinstance(sparse_grad, bool):
            raise TypeError(f"argument `sparse_grad` must be True or False, got {sparse_grad!r}")
        group = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            group = dist.group.WORLD
        super().__init__(
            embedding_size,
            num_classes,
            margin=margin_from_loss(margin_loss),
            sample_rate=sample_rate,
            process_group=group,
            chunk_memory=chunk_memory,
            check_inputs=check_inputs,
            dtype=dtype,
        )
        self.fp16 = fp16
        self.sparse_grad = sparse_grad
        self.embedding_size = embedding_size
        self.rank = 0 if group is None else dist.get_rank()
        self.world_size = 1 if group is None else dist.get_world_size()
        self.num_local = self.shard_sizes[0]
        self.class_start = self.class_offsets[0]
        if self.sample_rate < 1.0 and not sparse_grad:
            self.weight.register_post_accumulate_grad_hook(_densify_grad)
        if group is not None:
            self.register_state_dict_post_hook(_weight_key_out)
            self.register_load_state_dict_pre_hook(_weight_key_in)
            self.register_load_state_dict_post_hook(unreport_answered_keys)

    @property  # (ShardedSoftmaxLoss's `weight` is None, the stand-in of functional_call)
    def weight(self) -> torch.nn.Parameter:  # type: ignore[override]
        """This rank's ``[C_r, D]`` weight rows (PartialFC_V2's ``weight``)."""
        return self.weight_shards[0]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, 0.01) drawn on the CPU generator for this rank's rows, as PartialFC_V2's
        ``torch.normal(0, 0.01, (num_local, D))``: the same numbers under the same seed."""
        for p in self.weight_shards:
            if p.device.type == "cpu":
                p.normal_(0.0, INIT_STD)
            elif p.device.type != "meta":
                p.copy_(torch.empty(p.shape, dtype=p.dtype, device="cpu").normal_(0.0, INIT_STD))

    # PartialFC_V2's argument names (local_embeddings, local_labels), kept for drop-in use: a
    # caller passing ShardedSoftmaxLoss's `embeddings=` / `labels=` by keyword gets a TypeError.
    def forward(  # type: ignore[override]
        self,
        local_embeddings: torch.Tensor,
        local_labels: torch.Tensor,
        *,
        return_details: bool = False,
        topk: Optional[Sequence[int]] = None,
    ) -> Union[torch.Tensor, ShardedLossOutput]:
        """local_embeddings [B, D] floating, local_labels [B] or [B, 1] integer class ids in
        [0, C) (PartialFC_V2 squeezes them in place; here the caller's tensor is left alone).

        Returns the loss of the global batch (a float32 scalar, float64 for float64
        weights); ``return_details`` and ``topk`` as :class:`ShardedSoftmaxLoss`.
        Errors as :meth:`ShardedSoftmaxLoss.forward`.
        """
        labels = local_labels
        if isinstance(labels, torch.Tensor) and labels.dim() == 2 and labels.shape[1] == 1:
            labels = labels.reshape(-1)
        device_type = local_embeddings.device.type if isinstance(local_embeddings, torch.Tensor) else "cpu"
        if device_type not in ("cpu", "cuda"):  # refused there, naming the argument (autocast would not)
            return super().forward(local_embeddings, labels, return_details=return_details, topk=topk)
        with torch.autocast(device_type, dtype=torch.float16, enabled=self.fp16):
            return super().forward(local_embeddings, labels, return_details=return_details, topk=topk)


class SparseRowPartialFC_V2(PartialFC_V2):
    """:class:`PartialFC_V2` with ``sparse_grad=True``: under sampling the weight gradient
    holds only the sampled rows; step it with :class:`shardkit.SparseRowSGD` (which leaves
    the other rows and their momentum untouched). Import it as ``PartialFC_V2`` to keep the
    script's constructor calls."""

    def __init__(
        self,
        margin_loss: object,
        embedding_size: int,
        num_classes: int,
        sample_rate: float = 1.0,
        fp16: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("sparse_grad", True)
        super().__init__(margin_loss, embedding_size, num_classes, sample_rate, fp16, **kwargs)


def _weight_key_out(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Dict[str, Any]) -> None:
    # process-group mode: this rank's shard under PartialFC_V2's key
    state_dict[prefix + "weight"] = state_dict.pop(prefix + "weight_shards.0")


def _weight_key_in(
    module: nn.Module,
    state_dict: Dict[str, Any],
    prefix: str,
    local_metadata: Dict[str, Any],
    strict: bool,
    missing: List[str],
    unexpected: List[str],
    errors: List[str],
) -> None:
    # Errors name `weight`, the key of PartialFC_V2's checkpoints, not the shard's inner name.
    key, inner = prefix + "weight", prefix + "weight_shards.0"
    shard = cast(nn.ParameterList, module.weight_shards)[0]
    if key in state_dict:
        value = state_dict.pop(key)
        if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(shard.shape):
            errors.append(
                f"size mismatch for {key}: the checkpoint has {tuple(value.shape)}, this rank's shard is "
                f"{tuple(shard.shape)} (this rank's classes of the head, from num_classes and the world size)"
            )
            unreport_keys(module, [inner])  # (the error above is the one reported; nothing loads)
            return
        state_dict[inner] = value
    elif inner not in state_dict:
        missing.append(key)
        unreport_keys(module, [inner])  # (`weight` is reported missing, not the inner name)
