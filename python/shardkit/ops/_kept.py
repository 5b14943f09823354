"""How much of a shard the sharded cross-entropy walks at once and keeps for its backward:
the chunk size from a working-set budget, and the logits a memory budget keeps between
forward and backward (bytes, chunks, dtype; CUDA behind ``SHARDKIT_CUDA_KEEP``)."""

from __future__ import annotations

import os
import warnings
from numbers import Integral
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "chunk_classes_for_budget",
    "cuda_keep_enabled",
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
        dtype: dtype of the embeddings, a floating torch.dtype (the compute dtype; weights may
            be fp32 with 16-bit embeddings).
        num_classes: if given (an int >= 0), the result is at most this (and at least 1).

    Returns:
        int >= 1: the ``chunk_classes`` argument of :func:`ce_shard_stats`; a multiple of 64
        when it is at least 64 (GEMM-friendly).

    Raises:
        TypeError: naming the argument: a size that is not an int (numpy ints are; strings,
            floats and bools are not), a ``dtype`` that is not a floating torch.dtype.
        ValueError: naming the argument: a negative size, ``budget_bytes`` <= 0.
    """
    # ints (numpy ints too), not strings, floats or bools; num_classes >= 0 (a shard may be empty)
    _check_counts(budget_bytes=(budget_bytes, None))
    if int(budget_bytes) <= 0:
        raise ValueError(f"argument `budget_bytes` must be > 0, got {budget_bytes}")
    _check_counts(batch=(batch, 0), embedding_dim=(embedding_dim, 0))
    if num_classes is not None:
        _check_counts(num_classes=(num_classes, 0))
    _check_dtype(dtype)
    elem = dtype.itemsize
    per_class = int(batch) * (4 + (elem if elem < 4 else 0)) + 2 * int(embedding_dim) * 4
    chunk = max(1, int(budget_bytes) // max(per_class, 1))
    if chunk >= 64:
        chunk -= chunk % 64
    if num_classes is not None:
        chunk = min(chunk, max(1, int(num_classes)))
    return chunk


def default_chunk(x: Tensor, w: Tensor) -> int:
    batch = x.shape[0] if x.dim() >= 1 else 1
    dim = x.shape[1] if x.dim() >= 2 else 0
    budget = DEFAULT_BUDGET_BYTES
    if x.device.type == "cpu":
        budget = min(budget, CPU_MAX_CHUNK_BYTES)
    # a non-floating x is the kernels' to refuse, naming `x` (not this helper's `dtype`)
    dtype = x.dtype if x.is_floating_point() else torch.float32
    return chunk_classes_for_budget(
        batch, budget, embedding_dim=dim, dtype=dtype, num_classes=w.shape[0] if w.dim() >= 1 else None
    )


def kept_classes(num_classes: int, chunk_classes: int, keep_chunks: int) -> int:
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
    for float64), as the CPU kernels keep them whatever the input. ``dtype`` must be a floating
    torch.dtype (TypeError naming it, not float32 for an int32 or a string)."""
    _check_dtype(dtype)
    if _device_type(device) == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_counts(**values: Tuple[object, Optional[int]]) -> None:
    # Sizes are ints (bool, float, str and tensors refused, not truncated) no smaller than their
    # bound (None: type only); a SymInt is a traced size (ce_shard_stats under torch.compile with
    # dynamic shapes).
    for name, (value, low) in values.items():
        if isinstance(value, bool) or not isinstance(value, (Integral, torch.SymInt)):
            raise TypeError(f"argument `{name}` must be an int, got {type(value).__name__} {value!r}")
        if low is not None and int(value) < low:
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
    float64 ``dtype``). 0 when ``keep_chunks`` is 0.

    Raises ``TypeError`` / ``ValueError`` naming the argument: a count that is not an int (or
    below its minimum: 0, 1 for ``chunk_classes``), a ``dtype`` the kernels lack."""
    _check_counts(batch=(batch, 0), num_classes=(num_classes, 0), chunk_classes=(chunk_classes, 1))
    _check_counts(keep_chunks=(keep_chunks, 0))
    _check_dtype(dtype)
    if keep_chunks <= 0:
        return 0
    elem = kept_logits_dtype(dtype, device).itemsize
    target = 8 if dtype == torch.float64 else 4
    return batch * (kept_classes(num_classes, chunk_classes, keep_chunks) * elem + target)


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

    Raises ``TypeError`` / ``ValueError`` naming the argument, as :func:`kept_bytes`.
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
