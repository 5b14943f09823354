"""Argument checks and small parsers for the sharded cross-entropy (private).

Shape, dtype and device checks are free (no device sync) and always run. The value
checks (labels in range, finite embeddings) need the device's answer: they are fused into
one tiny flag tensor and one host sync, and run only when ``check_inputs`` asks.
"""

from __future__ import annotations

import re
from numbers import Integral, Real
from typing import Any, Iterable, List, Literal, Optional, Sequence, Tuple, Union

import torch

from shardkit.ops._args import bool_arg
from shardkit.softmax.margins import Margin

REDUCTIONS = ("none", "sum", "mean")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class NonFiniteEmbeddingsError(ValueError):
    """The embeddings given to the loss hold NaN or inf (``check_inputs=True``): usually a
    diverged backbone. A ValueError, so existing handlers still catch it."""


def parse_memory(value: Union[int, str], name: str = "chunk_memory") -> int:
    """Bytes from an int or a string like ``"64MiB"``, ``"512 KiB"``, ``"1GB"``."""
    if isinstance(value, bool):
        raise TypeError(f"argument `{name}` must be a number of bytes or a string like '64MiB', got bool")
    if isinstance(value, Integral):
        nbytes = int(value)
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"argument `{name}` must look like '64MiB', '512KiB', '1GB' or be an int, got {value!r}")
        nbytes = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    else:
        raise TypeError(
            f"argument `{name}` must be a number of bytes or a string like '64MiB', got {type(value).__name__}"
        )
    if nbytes <= 0:
        raise ValueError(f"argument `{name}` must be positive, got {value!r}")
    return nbytes


def check_options(
    margin: Optional[Margin],
    label_smoothing: float,
    ignore_index: int,
    reduction: str,
    check_inputs: Union[bool, str],
) -> Union[bool, Literal["async"]]:
    """Check the loss's options (errors naming the argument); returns ``check_inputs`` as a
    Python bool or ``"async"`` (a numpy bool is converted; 1, 1.0 or another string refused)."""
    if margin is not None and not isinstance(margin, Margin):
        raise TypeError(
            "argument `margin` must be None or a shardkit margin (CosFace, ArcFace, CombinedMargin), "
            f"got {type(margin).__name__}"
        )
    # (int, float) first: dynamo traces that check on a symbolic float; numpy scalars and other
    # real numbers after it, as nn.CrossEntropyLoss takes them
    plain = isinstance(label_smoothing, (int, float)) and not isinstance(label_smoothing, bool)
    if not plain and (isinstance(label_smoothing, bool) or not isinstance(label_smoothing, Real)):
        raise TypeError(f"argument `label_smoothing` must be a float, got {type(label_smoothing).__name__}")
    try:
        smoothing = float(label_smoothing)
    except OverflowError:
        raise ValueError("argument `label_smoothing` must be in [0, 1], got an int too large for a float") from None
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"argument `label_smoothing` must be in [0, 1], got {label_smoothing}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, Integral):
        raise TypeError(f"argument `ignore_index` must be an int, got {type(ignore_index).__name__}")
    if not -(2**63) <= int(ignore_index) < 2**63:
        raise ValueError(f"argument `ignore_index` must fit in int64 (a label value), got {ignore_index}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"argument `reduction` must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(check_inputs, str):
        if check_inputs != "async":
            raise ValueError(f"argument `check_inputs` must be True, False or 'async', got {check_inputs!r}")
        return "async"
    return bool_arg("check_inputs", check_inputs)


KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_dense(t: torch.Tensor, name: str, device: bool = True) -> None:
    """A dense (strided, not nested) tensor (with ``device``: of a cpu or cuda device), or an
    error naming it."""
    if t.is_nested or t.layout != torch.strided:
        layout = "nested" if t.is_nested else str(t.layout)
        raise TypeError(f"argument `{name}` must be a dense (strided) tensor, got a {layout} one")
    if device and t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"argument `{name}` is on {t.device}; shardkit's kernels run on cpu and cuda")


def check_shards(
    weight_shards: Union[torch.Tensor, Iterable[torch.Tensor]], class_offsets: Optional[Iterable[int]]
) -> Tuple[List[torch.Tensor], List[int], int]:
    """Returns (shards, offsets, num_classes); shards must tile [0, num_classes)."""
    if isinstance(weight_shards, torch.Tensor):
        weight_shards = [weight_shards]
    if isinstance(weight_shards, (str, bytes)) or not hasattr(weight_shards, "__iter__"):
        got = type(weight_shards).__name__
        raise TypeError(f"argument `weight_shards` must be a tensor or a list of [C_k, D] tensors, got {got}")
    shards = list(weight_shards)
    if not shards:
        raise ValueError("argument `weight_shards` must hold at least one [C_k, D] tensor")
    dim = None
    for k, w in enumerate(shards):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"argument `weight_shards[{k}]` must be a tensor, got {type(w).__name__}")
        _check_dense(w, f"weight_shards[{k}]")
        if w.dim() != 2:
            raise ValueError(f"argument `weight_shards[{k}]` must be 2-D [C_k, D], got shape {tuple(w.shape)}")
        if w.dtype not in KERNEL_DTYPES:
            raise TypeError(
                f"argument `weight_shards[{k}]` must be float32, bfloat16, float16 or float64, got {w.dtype}"
            )
        if dim is None:
            dim = w.shape[1]
        elif w.shape[1] != dim:
            raise ValueError(f"argument `weight_shards[{k}]` has embedding dim {w.shape[1]}, shard 0 has {dim}")
        if w.dtype != shards[0].dtype:
            raise TypeError(f"argument `weight_shards[{k}]` has dtype {w.dtype}, shard 0 has {shards[0].dtype}")
    sizes = [w.shape[0] for w in shards]
    num_classes = sum(sizes)
    if num_classes == 0:
        raise ValueError("argument `weight_shards` holds no classes (all shards have 0 rows)")
    if class_offsets is None:
        offsets, acc = [], 0
        for size in sizes:
            offsets.append(acc)
            acc += size
        return shards, offsets, num_classes
    if isinstance(class_offsets, (str, bytes)) or not hasattr(class_offsets, "__iter__"):
        raise TypeError(f"argument `class_offsets` must be a sequence of ints, got {type(class_offsets).__name__}")
    class_offsets = list(class_offsets)
    if any(isinstance(o, bool) or not isinstance(o, Integral) for o in class_offsets):
        raise TypeError(f"argument `class_offsets` must hold ints, got {class_offsets!r}")
    offsets = [int(o) for o in class_offsets]
    if len(offsets) != len(shards):
        raise ValueError(f"argument `class_offsets` has {len(offsets)} entries for {len(shards)} weight shards")
    ranges = sorted(zip(offsets, sizes))
    expected = 0
    for start, size in ranges:
        if start != expected:
            raise ValueError(
                f"argument `class_offsets` {offsets} with shard sizes {sizes} must tile [0, {num_classes}) "
                "without gaps or overlaps"
            )
        expected += size
    return shards, offsets, num_classes


def check_tensors(embeddings: torch.Tensor, labels: torch.Tensor, dim: int) -> torch.Tensor:
    """Free checks of embeddings [B, D] and labels [B]; returns labels as int64."""
    if not isinstance(embeddings, torch.Tensor):
        raise TypeError(f"argument `embeddings` must be a tensor, got {type(embeddings).__name__}")
    _check_dense(embeddings, "embeddings")
    if embeddings.dim() != 2:
        raise ValueError(f"argument `embeddings` must be 2-D [batch, dim], got shape {tuple(embeddings.shape)}")
    if not embeddings.is_floating_point():
        raise TypeError(f"argument `embeddings` must be floating point, got {embeddings.dtype}")
    if embeddings.dtype not in KERNEL_DTYPES:
        raise TypeError(f"argument `embeddings` must be float32, bfloat16, float16 or float64, got {embeddings.dtype}")
    if embeddings.shape[0] == 0:
        raise ValueError("argument `embeddings` is an empty batch (0 rows); the loss of no samples is undefined")
    if embeddings.shape[1] != dim:
        raise ValueError(
            f"argument `embeddings` has dim {embeddings.shape[1]}, but the weights have embedding dim {dim}"
        )
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"argument `labels` must be a tensor, got {type(labels).__name__}")
    _check_dense(labels, "labels", device=False)  # (its device is compared with the embeddings')
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise TypeError(
            f"argument `labels` must be an integer tensor of class ids (int64, int32, ...), got {labels.dtype}"
        )
    if labels.dtype == getattr(torch, "uint64", None):  # (its ids past 2**63 - 1 would wrap to negatives)
        raise TypeError(
            "argument `labels` is uint64, whose ids past 2**63 - 1 have no int64 form; pass int64 (labels.long() "
            "when every id fits)"
        )
    if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
        raise ValueError(
            f"argument `labels` must be 1-D with {embeddings.shape[0]} entries (one per embedding row), "
            f"got shape {tuple(labels.shape)}"
        )
    if labels.device != embeddings.device:
        raise ValueError(
            f"argument `labels` is on {labels.device} but `embeddings` is on {embeddings.device}; "
            "put them on the same device"
        )
    return labels if labels.dtype == torch.int64 else labels.long()


def _in_func_transform(t: torch.Tensor) -> bool:
    """Whether ``t`` is a torch.func (vmap, grad, ...) wrapper, whose values the host cannot read."""
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(wrapped is not None and wrapped(t))


def _capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s device's current stream is being captured into a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_values(
    embeddings: torch.Tensor, labels: torch.Tensor, num_classes: int, ignore_index: int, mode: Union[bool, str]
) -> None:
    """Labels in [0, num_classes) or == ignore_index; embeddings finite.

    One fused flag tensor; ``mode=True`` syncs once (``.tolist()``) and raises a
    ValueError naming the argument; ``mode="async"`` uses ``torch._assert_async`` (no
    sync: on CUDA a failure surfaces later as a device-side assert that ends the process's
    CUDA context; on the CPU it raises at once). Under ``torch.compile`` ``True`` acts as
    ``"async"``, so the default traces into one graph, and so it does while the embeddings'
    stream is captured into a CUDA graph (a host read cannot be captured: it failed the capture).
    """
    with torch.no_grad():
        ignored = labels == ignore_index
        negative = ((labels < 0) & ~ignored).any()
        too_big = ((labels >= num_classes) & ~ignored).any()
        not_finite = ~torch.isfinite(embeddings).all()
        flags = torch.stack([negative, too_big, not_finite])
        # Under torch.compile a host read would break the graph: the traced form of the check
        # is the asynchronous assert (one graph; the failure raises when the graph runs).
        if mode == "async" or torch.compiler.is_compiling() or _capturing(embeddings):
            torch._assert_async(
                ~flags.any(),
                "sharded cross-entropy: `labels` out of [0, num_classes) (and not ignore_index) "
                "or non-finite `embeddings`",
            )
            return
        try:
            negative, too_big, not_finite = flags.tolist()
        except RuntimeError:
            if _in_func_transform(embeddings) or _in_func_transform(labels):
                raise ValueError(
                    "argument `check_inputs`=True reads the check's result on the host, which torch.vmap "
                    "cannot do; pass check_inputs=False there (torch.vmap of the loss's forward and of an outer "
                    "backward works; torch.func.grad, vjp, jacrev and jvp cannot differentiate this loss, whose "
                    "autograd is C++: use torch.autograd.grad)"
                ) from None
            raise
    if negative:
        raise ValueError(f"argument `labels` has negative class ids other than ignore_index={ignore_index}")
    if too_big:
        raise ValueError(
            f"argument `labels` has class ids >= num_classes={num_classes} (other than ignore_index={ignore_index})"
        )
    if not_finite:
        raise NonFiniteEmbeddingsError("argument `embeddings` contains NaN or infinite values")


def check_topk(topk: Union[int, Sequence[int], None], num_classes: Optional[int] = None) -> Tuple[int, ...]:
    """The k's of the top-k counts as a tuple of ints (None: none); each in [1, num_classes]
    (as ``torch.topk``, a k above the class count is refused: every row would count as a hit).
    ``num_classes`` is the full head's, whatever the sampling or the process group."""
    if topk is None:
        return ()
    if isinstance(topk, Integral):
        ks: Tuple[Any, ...] = (topk,)
    elif getattr(topk, "ndim", None) == 0:  # a 0-d tensor or array (iterating one raises a bare TypeError)
        raise TypeError(
            f"argument `topk` must be an int or a sequence of ints, got a 0-d {type(topk).__name__}: pass int(topk)"
        )
    elif isinstance(topk, (str, bytes)) or not hasattr(topk, "__iter__"):
        raise TypeError(f"argument `topk` must be an int or a sequence of ints, got {type(topk).__name__}")
    else:
        ks = tuple(topk)
    if any(isinstance(k, bool) or not isinstance(k, Integral) for k in ks):
        raise TypeError(f"argument `topk` must hold ints, got {ks!r}")
    if any(k < 1 for k in ks):
        raise ValueError(f"argument `topk` must hold positive ints, got {ks!r}")
    if num_classes is not None and any(k > num_classes for k in ks):
        raise ValueError(f"argument `topk` {ks!r} holds a k larger than num_classes={num_classes} (out of range)")
    return tuple(int(k) for k in ks)
