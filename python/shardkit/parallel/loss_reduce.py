"""How DataParallelCriterion combines the per-device results into one: the weighted reduction
of losses (the C++ op, or a pure-torch composite of the same math under ``torch.func``
transforms and forward-mode AD), counts summed, per-sample losses concatenated; and the
gradient gate that keeps a chunk of weight 0 (nothing valid in it) out of the gradients.

Why the gate: a chunk with nothing to count (every target ignored, a mask of zeros) reports a
NaN mean (0/0) with weight 0. The reduction adds nothing of it, but autograd still runs that
chunk's backward with a zero gradient, and the criterion's own backward turns 0 * (1/0) into
NaN in the model's gradients. On one device those elements add exactly nothing. The gate is
the identity on the criterion's inputs (and on its replica's parameters) whose backward
SELECTS the gradient where the chunk's weight is non-zero and 0 elsewhere (a select, so NaN
does not pass); the weight is only known after the criterion ran, so the gate reads it from
a holder at backward time: no host sync, the weight may be a device tensor.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from shardkit.ops import weighted_loss_reduce
from shardkit.parallel import scatter as U


def _alias(t: torch.Tensor) -> torch.Tensor:
    """The gate's output: ``t``'s storage and version counter, not a view in autograd's sense
    (so the criterion may change it in place); a view where ``t`` is a leaf that requires grad,
    so that an in-place change is refused, as torch refuses it on that leaf on one device."""
    return t.view_as(t) if t.is_leaf and t.requires_grad else t.detach()


class _Gate(torch.autograd.Function):
    """Identity forward; backward: ``where(weight != 0, grad, 0)``, the weight read from
    ``gate`` (a ChunkGate) when the backward runs. Its backward is differentiable (double
    backward) and its jvp the identity (forward-mode AD).

    The forward's output shares the input's storage and version counter (``detach``) but is
    not a view in autograd's sense: a criterion may change its input in place, as on one device
    (torch refuses in-place changes of a view made inside a custom Function), and autograd
    still sees the change where the input was saved for a backward."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, gate: ChunkGate) -> torch.Tensor:
        ctx.gate = gate
        return _alias(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        return ctx.gate.apply_to_grad(grad), None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, _: Any) -> torch.Tensor:
        return tangent.detach()  # (as the forward's output)


class _FuncGate(torch.autograd.Function):
    """_Gate in the functorch style (setup_context, a generated vmap rule), for ``torch.func``
    transforms. Not used otherwise: its apply binds the arguments with inspect.signature
    (~20 us a call, as much as the rest of a small criterion's chunk)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(t: torch.Tensor, gate: ChunkGate) -> torch.Tensor:
        return _alias(t)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.gate = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        return ctx.gate.apply_to_grad(grad), None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, _: Any) -> torch.Tensor:
        return tangent.detach()


class ChunkGate:
    """The gradient gate of one chunk (see the module notes): wrap the criterion's inputs
    with :meth:`inputs` (and its per-chunk replica's parameters with :meth:`parameters`),
    then set :attr:`weight` once the criterion has reported it."""

    __slots__ = ("weight", "host")

    def __init__(self) -> None:
        self.weight: Any = None  # set after the criterion ran; None: pass the gradient
        # A CPU weight may be read on the host (no device to sync with; ~1 us against ~20 us
        # for the select's small ops), except under torch.func transforms (batched values).
        self.host = not U.pure_torch_mode()

    def apply_to_grad(self, grad: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w is None:
            return grad
        if isinstance(w, torch.Tensor) and self.host and w.device.type == "cpu" and grad.device.type == "cpu":
            w = w.item()
        if not isinstance(w, torch.Tensor):
            return grad if w != 0 else torch.zeros_like(grad)
        w = w.to(grad.device, non_blocking=grad.device.type == "cuda").reshape(())
        return torch.where(w != 0, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))

    def inputs(self, obj: Any) -> Any:
        """``obj`` (a tensor or a nest of them) with every tensor that requires grad gated."""
        leaves: list[torch.Tensor] = []
        spec = U.flatten(obj, leaves)
        if not any(t.requires_grad for t in leaves):
            return obj
        gate = _Gate if self.host else _FuncGate
        return U.unflatten(spec, iter([gate.apply(t, self) if t.requires_grad else t for t in leaves]))

    def parameters(self, replica: nn.Module) -> None:
        """Gates the parameters of a per-chunk criterion replica (set as plain attributes, as
        torch's replicate() and share_replicas set them), so a learnable criterion's own
        gradients get no NaN from a chunk of weight 0 either."""
        for m in replica.modules():
            for key, param in list(getattr(m, "_former_parameters", {}).items()):
                if isinstance(param, torch.Tensor) and param.requires_grad and m.__dict__.get(key) is param:
                    object.__setattr__(m, key, (_Gate if self.host else _FuncGate).apply(param, self))


def composite_weighted_reduce(
    losses: Sequence[torch.Tensor], weights: Sequence[Any], out_dev: torch.device, normalize: bool
) -> torch.Tensor:
    """``shardkit.ops.weighted_loss_reduce`` in torch ops (for torch.func transforms and
    forward-mode AD): ``sum_k w_k loss_k / sum_k w_k`` (or the weighted sum), a chunk of
    weight 0 adding nothing (its NaN mean selected away), half/bfloat16 accumulated in float."""
    out_dtype = losses[0].dtype
    for t in losses[1:]:
        out_dtype = torch.promote_types(out_dtype, t.dtype)
    acc = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
    if normalize and not any(isinstance(w, torch.Tensor) or w for w in weights):
        raise ValueError(
            f"argument `weights` sums to 0 ({list(weights)}): the normalized mean would be 0/0 = NaN; "
            "give at least one positive weight (or normalize=False for the weighted sum)"
        )
    numerator: Any = None
    denominator: Any = 0.0
    for loss, w in zip(losses, weights):
        value = loss.to(out_dev, acc)
        wt: Any
        if isinstance(w, torch.Tensor):
            wt = w.to(out_dev, acc).reshape(())
            term = torch.where(wt != 0, value * wt, torch.zeros((), dtype=acc, device=out_dev))
        else:
            wt = float(w)
            term = value * wt if wt != 0 else torch.zeros_like(value)
        numerator = term if numerator is None else numerator + term
        denominator = denominator + wt
    result = numerator / denominator if normalize else numerator
    return result.to(out_dtype)


def _where(path: str) -> str:
    return f"the entry {path}" if path else "the loss"


def reduce_results(
    values: list[Any],
    weights: list[Any],
    sizes: list[int],
    *,
    reduction: str,
    normalize: bool,
    dim: int,
    out_dev: torch.device,
) -> Any:
    """Reduces the per-device values (tensors, or dicts/tuples of them, one structure) into
    one on ``out_dev``: floating one-element losses by the weighted reduction; integer
    tensors (counts, e.g. ``(pred == y).sum()``) summed over the devices, which equals the
    one-device call's value; ``reduction='none'`` per-sample losses concatenated along
    ``dim`` in batch order; non-tensor entries as the list of per-device values."""
    pure = U.pure_torch_mode()
    nb = out_dev.type == "cuda"

    def combine(leaves: list[torch.Tensor], path: str) -> Any:
        shapes = [tuple(x.shape) for x in leaves]
        d = dim if dim >= 0 else dim + max(len(shape) for shape in shapes)
        per_sample = all(0 <= d < len(shape) and shape[d] == n for shape, n in zip(shapes, sizes))
        if any(x.dtype == torch.bool or x.is_complex() for x in leaves):
            raise ValueError(
                f"DataParallelCriterion: {_where(path)} of the criterion's result is a "
                f"{next(x.dtype for x in leaves if x.dtype == torch.bool or x.is_complex())} tensor, which cannot be "
                "reduced across devices; return a float loss, or an integer count (e.g. `(pred == y).sum()`), "
                "which is summed over the devices"
            )
        if reduction == "none" and (per_sample or all(x.is_floating_point() for x in leaves)):
            if not per_sample:
                raise ValueError(
                    f"DataParallelCriterion: the criterion has reduction='none' but returned losses of shapes "
                    f"{shapes} for chunks of {sizes} samples; with reduction='none' it must return one loss "
                    f"per sample (the chunk's size along dim {dim}), which are concatenated in batch order"
                )
            return torch.cat([x.to(out_dev, non_blocking=nb) for x in leaves], dim)
        if not all(x.is_floating_point() for x in leaves):  # counts: their sum is the one-device count
            if len(set(shapes)) > 1:
                raise ValueError(
                    f"DataParallelCriterion: {_where(path)} holds integer tensors (counts, summed over the "
                    f"devices) of different shapes {shapes} on the devices; they must have one shape"
                )
            total = leaves[0].to(out_dev, non_blocking=nb)
            for x in leaves[1:]:
                total = total + x.to(out_dev, non_blocking=nb)
            return total
        if any(x.numel() != 1 for x in leaves):
            # Per-sample (or any non-scalar) losses cannot be averaged across devices
            # element by element: that would pair unrelated samples, and fail when the
            # chunks differ in size. Refused whatever the split, so a script fails alike
            # on every batch size and device count.
            raise ValueError(
                f"DataParallelCriterion: the criterion returned losses of shapes {shapes} (chunks of {sizes} "
                f"samples), but its reduction is {reduction!r}: each device's loss must be a scalar (one "
                f"element) to be reduced across devices; for per-sample losses give the criterion "
                f"reduction='none' (a `reduction` attribute), and they are concatenated in batch order"
            )
        if pure:
            return composite_weighted_reduce(leaves, weights, out_dev, normalize)
        return weighted_loss_reduce(leaves, weights, out_dev, normalize)

    def combine_nested(vals: list[Any], path: str) -> Any:
        v0 = vals[0]
        if isinstance(v0, torch.Tensor) and all(isinstance(v, torch.Tensor) for v in vals):
            return combine(vals, path)
        if isinstance(v0, (tuple, list)) and all(type(v) is type(v0) and len(v) == len(v0) for v in vals):
            parts = [combine_nested([v[i] for v in vals], f"{path}[{i}]") for i in range(len(v0))]
            return type(v0)(*parts) if hasattr(v0, "_fields") else type(v0)(parts)
        if isinstance(v0, dict) and all(isinstance(v, dict) and v.keys() == v0.keys() for v in vals):
            return type(v0)((key, combine_nested([v[key] for v in vals], f"{path}[{key!r}]")) for key in v0)
        if isinstance(v0, (torch.Tensor, tuple, list, dict)):
            raise ValueError("DataParallelCriterion: the criterion returned different structures on different devices")
        return list(vals)

    return combine_nested(values, "")
