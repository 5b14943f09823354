"""Per-shard softmax statistics for the sharded cross-entropy (``torch.ops.shardkit.ce_shard_stats``).

One call handles one class shard on one device: it walks the shard's classes chunk by
chunk (one GEMM per chunk) and keeps only per-row statistics, so the [B, C_k] logits are
never held in memory. Combining the statistics of all shards into a loss is ordinary
differentiable torch code (see :mod:`shardkit.softmax.core`).
"""

from __future__ import annotations

import os
import warnings
from numbers import Integral
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "ce_shard_stats",
    "chunk_classes_for_budget",
    "kept_chunks_for_budget",
    "kept_bytes",
    "kept_logits_dtype",
]

#: The environment switch of the memory budget on CUDA: "1" lets CUDA shards keep logits (the
#: kept path has run on no GPU yet: experimental); unset or "0", they recompute at every budget.
CUDA_KEEP_ENV = "SHARDKIT_CUDA_KEEP"
_warned_env: set[str] = set()

#: Working-set budget of one call when ``chunk_classes`` is not given (GPU). Each chunk
#: costs a fixed ~15 kernel launches of host time, so chunks must be large enough for
#: their GEMMs to outlast it: at D=512 the weight rows dominate a chunk's bytes, and 64 MiB
#: gave ~6.5k classes per chunk at B=1024, bf16 (150+ chunks per 1M classes). 192 MiB gives 20k
#: and keeps B=1024, C=1M under 256 MiB of working memory beyond weights and gradients.
DEFAULT_BUDGET_BYTES = 192 << 20
#: On the CPU a chunk's logits should stay in the L2 cache rather than fill the budget:
#: larger chunks only add cache misses between the GEMM and the fused row pass.
CPU_MAX_CHUNK_BYTES = 1 << 20


def chunk_classes_for_budget(
    batch: int,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    *,
    embedding_dim: int = 0,
    dtype: torch.dtype = torch.float32,
    num_classes: Optional[int] = None,
) -> int:
    """Classes per chunk such that one chunk's working set fits ``budget_bytes``.

    Per class of a chunk the kernels hold ``batch`` fp32 logits (plus ``batch`` gradient
    values in ``dtype`` when it is a 16-bit type) and two rows of ``embedding_dim`` values in
    fp32 (the chunk's weights, normalized or converted, and their gradient). This also bounds
    the mixed mode (fp32 weights, 16-bit ``dtype`` embeddings): there a chunk holds its
    weights converted to ``dtype`` (and, normalized, a normalized copy in ``dtype``) while the
    fp32 weight gradient is written in place, at most 4 of the 8 bytes per value counted.

    Args:
        batch: rows B of the embeddings (int >= 0).
        budget_bytes: bytes available for the working set (int > 0).
        embedding_dim: D (int >= 0); 0 ignores the weight-sized part.
        dtype: dtype of the embeddings (the compute dtype; weights may be fp32 with 16-bit
            embeddings).
        num_classes: if given, the result is at most this (and at least 1).

    Returns:
        int >= 1: the ``chunk_classes`` argument of :func:`ce_shard_stats`; a multiple of 64
        when it is at least 64 (GEMM-friendly).
    """
    if int(budget_bytes) <= 0:
        raise ValueError(f"argument `budget_bytes` must be > 0, got {budget_bytes}")
    if int(batch) < 0:
        raise ValueError(f"argument `batch` must be >= 0, got {batch}")
    if int(embedding_dim) < 0:
        raise ValueError(f"argument `embedding_dim` must be >= 0, got {embedding_dim}")
    elem = torch.empty((), dtype=dtype).element_size()
    per_class = int(batch) * (4 + (elem if elem < 4 else 0)) + 2 * int(embedding_dim) * 4
    chunk = max(1, int(budget_bytes) // max(per_class, 1))
    if chunk >= 64:
        chunk -= chunk % 64
    if num_classes is not None:
        chunk = min(chunk, max(1, int(num_classes)))
    return chunk


def _default_chunk(x: Tensor, w: Tensor) -> int:
    batch = x.shape[0] if x.dim() >= 1 else 1
    dim = x.shape[1] if x.dim() >= 2 else 0
    budget = DEFAULT_BUDGET_BYTES
    if x.device.type == "cpu":
        budget = min(budget, CPU_MAX_CHUNK_BYTES)
    return chunk_classes_for_budget(
        batch, budget, embedding_dim=dim, dtype=x.dtype, num_classes=w.shape[0] if w.dim() >= 1 else None
    )


def _kept_classes(num_classes: int, chunk_classes: int, keep_chunks: int) -> int:
    # The kernels' rule (KeptChunks in csrc/sharded_ce_common.h): every class once keep_chunks
    # reaches the chunk count, else keep_chunks full chunks.
    chunk = max(1, min(chunk_classes, num_classes))
    return num_classes if keep_chunks >= -(-num_classes // chunk) else keep_chunks * chunk


def _device_type(device: Union[str, torch.device]) -> str:
    if isinstance(device, torch.device):
        return device.type
    if device in ("cpu", "cuda"):
        return device
    # a misspelled string ("bogus") was taken for the CPU; None or a float raised torch's own error
    if isinstance(device, bool) or not isinstance(device, (str, int)):
        raise TypeError(f"argument `device` must be a torch.device or a string such as 'cuda:0', got {device!r}")
    try:
        return torch.device(device).type
    except RuntimeError as err:
        raise ValueError(f"argument `device` must name a device such as 'cpu' or 'cuda:0', got {device!r}") from err


def kept_logits_dtype(dtype: torch.dtype, device: Union[str, torch.device] = "cpu") -> torch.dtype:
    """The dtype of the logits a forward keeps for ``dtype`` embeddings on ``device``: on CUDA,
    bfloat16 / float16 for those inputs (the raw dots as cuBLAS rounds them, with each row's
    target value kept in float32 beside them), else the statistics' dtype (float32; float64
    for float64), as the CPU kernels keep them whatever the input."""
    if _device_type(device) == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_counts(**values: Tuple[object, int]) -> None:
    # Sizes are ints (bool, float, str and tensors refused, not truncated) no smaller than their
    # bound; a SymInt is a traced size (ce_shard_stats under torch.compile with dynamic shapes).
    for name, (value, low) in values.items():
        if isinstance(value, bool) or not isinstance(value, (Integral, torch.SymInt)):
            raise TypeError(f"argument `{name}` must be an int, got {type(value).__name__} {value!r}")
        if int(value) < low:
            raise ValueError(f"argument `{name}` must be >= {low}, got {value}")


def _check_dtype(dtype: object) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"argument `dtype` must be a floating torch.dtype (the embeddings'), got {dtype!r}")


def kept_bytes(
    batch: int,
    num_classes: int,
    chunk_classes: int,
    keep_chunks: int,
    dtype: torch.dtype = torch.float32,
    device: Union[str, torch.device] = "cpu",
) -> int:
    """Bytes a forward with ``keep_chunks`` kept chunks holds until its backward: the kept
    logits ``[batch, kept classes]`` in :func:`kept_logits_dtype` (``dtype`` is the
    embeddings') and one target value per row in the statistics' dtype (float32; float64 for
    float64 ``dtype``). 0 when ``keep_chunks`` is 0."""
    _check_counts(batch=(batch, 0), num_classes=(num_classes, 0), chunk_classes=(chunk_classes, 1))
    _check_counts(keep_chunks=(keep_chunks, 0))
    _check_dtype(dtype)
    if keep_chunks <= 0:
        return 0
    elem = kept_logits_dtype(dtype, device).itemsize
    target = 8 if dtype == torch.float64 else 4
    return batch * (_kept_classes(num_classes, chunk_classes, keep_chunks) * elem + target)


def kept_chunks_for_budget(
    batch: int,
    num_classes: int,
    chunk_classes: int,
    budget_bytes: int,
    dtype: torch.dtype = torch.float32,
    device: Union[str, torch.device] = "cpu",
) -> int:
    """The most class chunks whose logits fit ``budget_bytes`` (:func:`kept_bytes`), at most
    all of them (``ceil(num_classes / chunk_classes)``); 0 when not even one fits.

    Args:
        batch, num_classes: B and the shard's classes C_k (ints >= 0).
        chunk_classes: the op's ``chunk_classes`` (int >= 1).
        budget_bytes: bytes the forward may hold for its backward (int >= 0).
        dtype: the embeddings' dtype; device: where the shard lives (the kept logits' dtype,
            :func:`kept_logits_dtype`, depends on both).
    """
    _check_counts(batch=(batch, 0), num_classes=(num_classes, 0), chunk_classes=(chunk_classes, 1))
    _check_counts(budget_bytes=(budget_bytes, 0))
    _check_dtype(dtype)
    batch, num_classes, budget = int(batch), int(num_classes), int(budget_bytes)
    if batch == 0 or num_classes == 0:
        return 0
    chunk = min(int(chunk_classes), num_classes)
    nchunks = -(-num_classes // chunk)
    if kept_bytes(batch, num_classes, chunk, nchunks, dtype, device) <= budget:
        return nchunks
    rows = kept_bytes(batch, 0, 1, 1, dtype, device)  # the target values alone
    per_chunk = kept_bytes(batch, num_classes, chunk, 1, dtype, device) - rows
    return max(0, (budget - rows) // per_chunk)


@torch.compiler.assume_constant_result
def cuda_keep_enabled() -> bool:
    """Whether CUDA shards keep logits for a memory budget: ``SHARDKIT_CUDA_KEEP=1`` in the
    environment (read at each call; under torch.compile at trace time). Off by default: the
    CUDA kept path is experimental until a GPU run has tested and measured it. Values other
    than 0 and 1 warn once and count as 0."""
    value = os.environ.get(CUDA_KEEP_ENV, "")
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    if value not in _warned_env:
        _warned_env.add(value)
        warnings.warn(f"{CUDA_KEEP_ENV}={value!r} is neither 0 nor 1: CUDA shards recompute", stacklevel=2)
    return False


def _keeps(x: Tensor, w: Tensor, keep_chunks: int) -> bool:
    # The kept path runs where it has kernels (the CPU; CUDA behind its switch) and when a
    # backward will use it.
    device_keeps = x.device.type == "cpu" or (x.device.type == "cuda" and cuda_keep_enabled())
    return keep_chunks > 0 and device_keeps and torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)


def ce_shard_stats(
    x: Tensor,
    w: Tensor,
    labels: Tensor,
    *,
    class_offset: int = 0,
    scale: float = 1.0,
    m1: float = 1.0,
    m2: float = 0.0,
    m3: float = 0.0,
    normalize: bool = False,
    chunk_classes: Optional[int] = None,
    target_ref: Optional[Tensor] = None,
    memory_budget: int = 0,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Softmax statistics of one class shard, without materializing its logits.

    The shard holds the classes ``[class_offset, class_offset + C_k)``. Logits are
    ``z = scale * x @ w.T`` (``normalize=False``; margins must then be off) or
    ``z = scale * cos`` with ``x`` and ``w`` rows L2-normalized, where the target column
    ``j = labels[i] - class_offset`` (if in the shard) becomes
    ``scale * psi(cos)``, ``psi(c) = cos(m1 * acos(c) + m2) - m3``, continued linearly with
    slope 1 below ``c_max = cos((pi - m2) / m1)`` (so it stays monotone where
    ``m1 * theta + m2 > pi``).

    Args:
        x: embeddings [B, D], float32 / bfloat16 / float16 (float64 for checks).
        w: the shard's weights [C_k, D] on the device of ``x``; C_k may be 0. Same dtype as
            ``x``, or float32 with bfloat16 / float16 ``x`` ("mixed" mode, fp32 master
            weights under autocast): the kernels then convert ``w`` chunk by chunk (on CUDA
            to ``x``'s dtype, the GEMMs' input dtype; the CPU kernels compute in fp32 from
            the fp32 rows) and return its gradient in float32, without a full-size 16-bit
            copy of ``w`` or of its gradient.
        labels: int64 [B] GLOBAL class ids; ids outside the shard (other shards' classes,
            ignore_index) simply have no target here.
        class_offset: global id of the shard's first class (>= 0).
        scale, m1, m2, m3: logit scale and margin parameters (see above).
        normalize: L2-normalize ``x`` and ``w`` rows (required by margins).
        chunk_classes: classes per chunk (>= 1); default from a 192 MiB working-set budget
            (:func:`chunk_classes_for_budget`), capped to a cache-sized chunk on the CPU. The
            fused sm90 kernels, holding no fp32 logits, walk larger chunks, within the memory
            this chunk takes in the other kernels and, for the backward's growth, 56 MiB of
            chunk buffers, in whole waves of tiles over the GPU's SMs (25,344 classes at B=1024,
            D=512, bf16 by default on a 132-SM H100 / H200).
        target_ref: optional float32 [B]: ``greater_count`` counts the classes whose PLAIN
            logit (no margin) exceeds it; zeros when None.
        memory_budget: bytes (int >= 0) the call may hold from its forward to its backward to
            keep the logits of as many class chunks as fit (:func:`kept_chunks_for_budget`):
            the backward then forms their gradients from them and recomputes only the other
            chunks' logits. Same results at every budget (within the dtype's rounding: on CUDA,
            bf16 / fp16 inputs keep 16-bit logits, :func:`kept_logits_dtype`). Used when a
            gradient is needed, on the CPU, and on CUDA with ``SHARDKIT_CUDA_KEEP=1``
            (:func:`cuda_keep_enabled`; experimental: the unfused kernels and cuBLAS then run
            every chunk, the fused sm90 kernels none); otherwise every chunk is recomputed (0,
            the default: keep nothing).

    Returns:
        ``(lse, target_logit, logit_sum, greater_count)``, each [B]: float32 (float64 for
        float64 inputs) ``log sum_j exp(z_ij)`` (-inf when C_k == 0 or all the row's logits
        are -inf; NaN as soon as one logit is NaN), the target logit
        ``z_{i, y_i}`` (0 when the target is not in the shard), ``sum_j z_ij`` (with the
        margin), and int64 counts. Differentiable w.r.t. ``x`` and ``w`` (not the count);
        the gradients come in the dtype of ``x`` and of ``w`` respectively.
    """
    if chunk_classes is None:
        chunk_classes = _default_chunk(x, w)
    args = (
        x,
        w,
        labels,
        target_ref,
        int(class_offset),
        float(scale),
        float(m1),
        float(m2),
        float(m3),
        bool(normalize),
        int(chunk_classes),
    )
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 0:
        raise ValueError(f"argument `memory_budget` must be an int >= 0 (bytes), got {memory_budget!r}")
    keep = 0
    if memory_budget > 0 and x.dim() == 2 and w.dim() == 2 and chunk_classes >= 1 and x.is_floating_point():
        keep = kept_chunks_for_budget(x.shape[0], w.shape[0], int(chunk_classes), memory_budget, x.dtype, x.device)
    if _keeps(x, w, keep):
        return torch.ops.shardkit.ce_shard_stats_keep.default(*args, keep)[:4]
    return torch.ops.shardkit.ce_shard_stats.default(*args)


def _stats_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# dtype names as the kernels' messages print them, so that eager and traced errors match.
_C10_NAMES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16"}


def _check_devices_fake(x: Tensor, **others: Optional[Tensor]) -> None:
    # The kernels' device rule, also where a meta tensor among real ones sends the call here.
    for name, t in others.items():
        if t is not None and t.device != x.device:
            raise RuntimeError(f"argument `{name}` must be on the device of `x` ({x.device}), got {t.device}")


def _check_dtypes_fake(x: Tensor, w: Tensor) -> None:
    # The kernels' dtype rule (equal dtypes, or fp32 w with 16-bit x), also under tracing.
    mixed = x.dtype in (torch.bfloat16, torch.float16) and w.dtype == torch.float32
    torch._check(
        w.dtype == x.dtype or mixed,
        lambda: (
            f"argument `w` must have the dtype of `x` ({_C10_NAMES.get(x.dtype, x.dtype)}), or be "
            f"float32 when `x` is bfloat16 or float16, got {_C10_NAMES.get(w.dtype, w.dtype)}"
        ),
    )


@torch.library.register_fake("shardkit::ce_shard_stats")
def _ce_shard_stats_fake(x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes):
    torch._check(x.dim() == 2, lambda: f"argument `x` must be 2-D [B, D], got shape {tuple(x.shape)}")
    torch._check(w.dim() == 2, lambda: f"argument `w` must be 2-D [C_k, D], got shape {tuple(w.shape)}")
    torch._check(
        w.shape[1] == x.shape[1], lambda: f"argument `w` has embedding dim {w.shape[1]} but `x` has {x.shape[1]}"
    )
    _check_devices_fake(x, w=w, labels=labels, target_ref=target_ref)
    _check_dtypes_fake(x, w)
    batch = x.shape[0]
    dt = _stats_dtype(x)
    return (
        x.new_empty(batch, dtype=dt),
        x.new_empty(batch, dtype=dt),
        x.new_empty(batch, dtype=dt),
        x.new_empty(batch, dtype=torch.int64),
    )


@torch.library.register_fake("shardkit::ce_shard_stats_backward")
def _ce_shard_stats_backward_fake(
    grad_lse, grad_target, grad_sum, x, w, labels, lse, class_offset, scale, m1, m2, m3, normalize, chunk_classes
):
    torch._check(x.dim() == 2 and w.dim() == 2, lambda: "arguments `x` and `w` must be 2-D")
    _check_devices_fake(x, w=w, labels=labels, lse=lse, grad_lse=grad_lse)
    _check_dtypes_fake(x, w)
    # grad_x in x's dtype, grad_w in w's (fp32 in the mixed mode).
    return x.new_empty(x.shape), w.new_empty(w.shape)


def _setup_context(ctx, inputs, output):
    x, w, labels, _target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes = inputs
    lse = output[0]
    ctx.save_for_backward(x, w, labels, lse)
    ctx.params = (class_offset, scale, m1, m2, m3, normalize, chunk_classes)
    ctx.mark_non_differentiable(output[3])


DOUBLE_BACKWARD_MESSAGE = (
    "shardkit.ce_shard_stats does not support double backward (create_graph=True): its "
    "backward is a fused kernel with no derivative of its own, so a second-order gradient "
    "(e.g. a gradient penalty) through ShardedSoftmaxLoss / sharded_cross_entropy would be "
    "wrong. Differentiate twice only through parts of the model without the sharded loss, "
    "or use torch.nn.functional.cross_entropy for the term that needs it"
)


def _backward(ctx, grad_lse, grad_target, grad_sum, _grad_count):
    x, w, labels, lse = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_x or need_w):
        return (None,) * 11
    # Grad mode is on inside a backward only for create_graph=True. The kernel's outputs
    # would carry no graph and a second derivative would silently be zero: refuse.
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (grad_lse, grad_target, grad_sum, x, w)
    ):
        raise RuntimeError(DOUBLE_BACKWARD_MESSAGE)
    grads = [g if g is not None else torch.zeros_like(lse) for g in (grad_lse, grad_target, grad_sum)]
    gx, gw = torch.ops.shardkit.ce_shard_stats_backward.default(*grads, x, w, labels, lse, *ctx.params)
    return (gx if need_x else None, gw if need_w else None) + (None,) * 9


torch.library.register_autograd("shardkit::ce_shard_stats", _backward, setup_context=_setup_context)


@torch.library.register_fake("shardkit::ce_shard_stats_keep")
def _ce_shard_stats_keep_fake(
    x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes, keep_chunks
):
    stats = _ce_shard_stats_fake(x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes)
    torch._check(keep_chunks >= 0, lambda: f"argument `keep_chunks` must be >= 0, got {keep_chunks}")
    kept = x.shape[0] * _kept_classes(w.shape[0], chunk_classes, keep_chunks)
    return (
        *stats,
        x.new_empty(kept, dtype=kept_logits_dtype(x.dtype, x.device)),
        x.new_empty(x.shape[0], dtype=_stats_dtype(x)),
    )


@torch.library.register_fake("shardkit::ce_shard_stats_backward_kept")
def _ce_shard_stats_backward_kept_fake(
    grad_lse, grad_target, grad_sum, x, w, labels, lse, kept_logits, kept_target, *params
):
    _check_devices_fake(x, kept_logits=kept_logits, kept_target=kept_target)
    return _ce_shard_stats_backward_fake(grad_lse, grad_target, grad_sum, x, w, labels, lse, *params[:7])


def _setup_context_keep(ctx, inputs, output):
    x, w, labels, _target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes, keep_chunks = inputs
    lse, _, _, count, kept_logits, kept_target = output
    ctx.save_for_backward(x, w, labels, lse, kept_logits, kept_target)
    ctx.params = (class_offset, scale, m1, m2, m3, normalize, chunk_classes, keep_chunks)
    ctx.mark_non_differentiable(count, kept_logits, kept_target)
    # Outputs without a gradient (the kept logits above all) must not get a materialized
    # zero gradient of their size in the backward.
    ctx.set_materialize_grads(False)


def _backward_keep(ctx, grad_lse, grad_target, grad_sum, _grad_count, _grad_kept, _grad_kept_target):
    x, w, labels, lse, kept_logits, kept_target = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_x or need_w):
        return (None,) * 12
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (grad_lse, grad_target, grad_sum, x, w)
    ):
        raise RuntimeError(DOUBLE_BACKWARD_MESSAGE)
    grads = [g if g is not None else torch.zeros_like(lse) for g in (grad_lse, grad_target, grad_sum)]
    gx, gw = torch.ops.shardkit.ce_shard_stats_backward_kept.default(
        *grads, x, w, labels, lse, kept_logits, kept_target, *ctx.params
    )
    return (gx if need_x else None, gw if need_w else None) + (None,) * 10


torch.library.register_autograd("shardkit::ce_shard_stats_keep", _backward_keep, setup_context=_setup_context_keep)
