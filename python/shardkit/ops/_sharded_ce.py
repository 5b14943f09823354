"""Per-shard softmax statistics for the sharded cross-entropy (``torch.ops.shardkit.ce_shard_stats``).

One call handles one class shard on one device: it walks the shard's classes chunk by
chunk (one GEMM per chunk) and keeps only per-row statistics, so the [B, C_k] logits are
never held in memory. Combining the statistics of all shards into a loss is ordinary
differentiable torch code (see :mod:`shardkit.softmax.core`).

The ops' autograd is C++ (``csrc/composite/sharded_ce_autograd.cpp``: one node per call, no
Python between a step's kernels); their fake kernels, for tracing and torch.compile, are here.
"""

from __future__ import annotations

import math
from numbers import Integral
from typing import Optional, Tuple

import torch
from torch import Tensor

from shardkit.ops._args import bool_arg, int_arg, optional_tensor_arg, real_arg, tensor_arg
from shardkit.ops._kept import cuda_keep_enabled, default_chunk, kept_chunks_for_budget, kept_classes, kept_logits_dtype

__all__ = ["ce_shard_stats"]


_LOGIT_MAX = 1e30  # shardkit.softmax.margins._LOGIT_MAX: sums of float32 logits over 1e8 classes stay finite


def _check_margin(scale: float, m1: float, m2: float, m3: float, normalize: bool, dtype: torch.dtype) -> None:
    """The ranges of shardkit.softmax.margins.Margin (ops may not import softmax; the rules are
    repeated here): with normalize, scale > 0 and, below float64 (float32 logits),
    scale * (1 + |m3|) <= 1e30 (m3=1e38 gave -inf target logits and sums); m2 in [0, pi) always
    (cos(m1 theta + m2) is continued past pi only for such m2). Non-finite values and m1 <= 0
    are left to the kernels' checks (RuntimeError naming them), as are traced values
    (torch.compile: math.isfinite does not trace; the sharded heads pass a Margin's numbers,
    checked when it was made)."""
    if torch.compiler.is_compiling() or not all(isinstance(v, float) for v in (scale, m1, m2, m3)):
        return
    if math.isfinite(m2) and not 0.0 <= m2 < math.pi:
        raise ValueError(f"argument `m2` (the angular margin, radians) must be in [0, pi), got {m2}")
    if normalize is not True or not math.isfinite(scale):
        return
    if scale <= 0:
        raise ValueError(f"argument `scale` must be > 0 with normalize=True (a margin's scale), got {scale}")
    if dtype != torch.float64 and math.isfinite(m3) and scale * (1.0 + abs(m3)) > _LOGIT_MAX:
        raise ValueError(
            f"arguments `scale` and `m3` give logits up to scale * (1 + |m3|) = {scale * (1.0 + abs(m3)):.4g}, "
            f"beyond {_LOGIT_MAX:.0e} (float32 logits and their sums over the classes would overflow); "
            f"use a smaller scale or m3"
        )


def _check_budget(memory_budget: object) -> int:
    # numpy ints too; bool, float and str refused (ValueError, as before: the error tests match it)
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, Integral) or memory_budget < 0:
        raise ValueError(f"argument `memory_budget` must be an int >= 0 (bytes), got {memory_budget!r}")
    return int(memory_budget)


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
    slope 1 where ``m1 * theta + m2 > pi``, i.e. below ``c_max = cos((pi - m2) / m1)``
    when ``(pi - m2) / m1 < pi`` (no continuation otherwise), so it stays monotone.

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
        class_offset: global id of the shard's first class (an int >= 0; numpy ints too).
        scale, m1, m2, m3: logit scale and margin parameters (see above), real numbers (no
            strings or tensors) in the ranges of :class:`shardkit.CombinedMargin`: finite,
            ``m1 > 0``, ``m2`` in [0, pi) and, with ``normalize``, ``scale > 0`` and (inputs
            below float64) ``scale * (1 + |m3|) <= 1e30`` (ValueError naming them).
        normalize: L2-normalize ``x`` and ``w`` rows (required by margins); a Python bool.
        chunk_classes: classes per chunk (an int >= 1); default from a 192 MiB working-set budget
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
    x, w, labels = tensor_arg("x", x), tensor_arg("w", w), tensor_arg("labels", labels)
    target_ref = optional_tensor_arg("target_ref", target_ref)
    # Strict types (no int() / float() / bool() coercion: normalize="no" was True, class_offset=1.7
    # was 1, strings were parsed); value ranges the kernels check themselves stay theirs (RuntimeError).
    class_offset = int_arg("class_offset", class_offset)
    scale, m1, m2, m3 = real_arg("scale", scale), real_arg("m1", m1), real_arg("m2", m2), real_arg("m3", m3)
    normalize = bool_arg("normalize", normalize)
    _check_margin(scale, m1, m2, m3, normalize, x.dtype)
    chunk_classes = default_chunk(x, w) if chunk_classes is None else int_arg("chunk_classes", chunk_classes)
    memory_budget = _check_budget(memory_budget)
    args = (x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes)
    keep = 0
    if memory_budget > 0 and x.dim() == 2 and w.dim() == 2 and chunk_classes >= 1 and x.is_floating_point():
        keep = kept_chunks_for_budget(x.shape[0], w.shape[0], chunk_classes, memory_budget, x.dtype, x.device)
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
    grad_lse,
    grad_target,
    grad_sum,
    x,
    w,
    labels,
    lse,
    class_offset,
    scale,
    m1,
    m2,
    m3,
    normalize,
    chunk_classes,
    need_grad_w=True,
):
    torch._check(x.dim() == 2 and w.dim() == 2, lambda: "arguments `x` and `w` must be 2-D")
    _check_devices_fake(x, w=w, labels=labels, lse=lse, grad_lse=grad_lse)
    _check_dtypes_fake(x, w)
    # grad_x in x's dtype, grad_w in w's (fp32 in the mixed mode); [0] for a frozen w.
    return x.new_empty(x.shape), w.new_empty(w.shape if need_grad_w else (0,))


@torch.library.register_fake("shardkit::ce_shard_stats_keep")
def _ce_shard_stats_keep_fake(
    x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes, keep_chunks
):
    stats = _ce_shard_stats_fake(x, w, labels, target_ref, class_offset, scale, m1, m2, m3, normalize, chunk_classes)
    torch._check(keep_chunks >= 0, lambda: f"argument `keep_chunks` must be >= 0, got {keep_chunks}")
    kept = x.shape[0] * kept_classes(w.shape[0], chunk_classes, keep_chunks)
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
    need_grad_w = params[8] if len(params) > 8 else True
    return _ce_shard_stats_backward_fake(grad_lse, grad_target, grad_sum, x, w, labels, lse, *params[:7], need_grad_w)
