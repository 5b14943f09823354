"""The host-side exchanges of the process-group mode, on the gloo ``cpu_group`` of a
:class:`~shardkit.softmax.collectives.DistContext`: the configuration fingerprint (once, at
construction) and the per-step batch info and mode. Both let EVERY rank raise
:class:`DistributedInputError` at once where the device collectives would otherwise
disagree (or hang until the group's timeout)."""

from __future__ import annotations

import hashlib
import os
import struct
import zlib
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from shardkit.softmax.checks import NonFiniteEmbeddingsError
from shardkit.softmax.collectives import _LAYOUTS, REPLICATED, DistContext, DistributedInputError


class DistributedNonFiniteError(DistributedInputError, NonFiniteEmbeddingsError):
    """Raised on every rank when a rank's embeddings hold NaN or infinite values: a
    DistributedInputError that ``except shardkit.NonFiniteEmbeddingsError`` also catches, as
    in the one-process mode (a diverged backbone)."""


# A value of the configuration fingerprint (see check_same_config).
ConfigValue = Union[None, str, float, Tuple[float, ...]]

# Dtype codes for the size exchange (ranks must agree on the embeddings' dtype).
_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}


# ---- the configuration fingerprint, exchanged once at construction ----------------------
# Each field travels as _SLOTS float64: [kind, values...]; kind 0 None, 1 number, 2 string
# (its crc32), 3 tuple of numbers. Strings are decoded back through this vocabulary.
_SLOTS = 6
_KNOWN_STRINGS = {
    zlib.crc32(v.encode()): v
    for v in ["mean", "sum", "none", *_LAYOUTS]
    + [str(t) for t in (torch.float32, torch.float64, torch.float16, torch.bfloat16)]
}


def _encode_field(value: ConfigValue) -> List[float]:
    if value is None:
        out = [0.0]
    elif isinstance(value, str):
        out = [2.0, float(zlib.crc32(value.encode()))]
    elif isinstance(value, (tuple, list)):
        out = [3.0, float(len(value))] + [float(v) for v in value]
    else:
        out = [1.0, float(value)]
    if len(out) > _SLOTS:
        raise ValueError(f"configuration field {value!r} does not fit the fingerprint")
    return out + [0.0] * (_SLOTS - len(out))


def _decode_field(slots: List[float]) -> ConfigValue:
    kind = int(slots[0])
    if kind == 0:
        return None
    if kind == 2:
        return _KNOWN_STRINGS.get(int(slots[1]), f"<string crc {int(slots[1])}>")
    if kind == 3:
        return tuple(slots[2 : 2 + int(slots[1])])
    v = slots[1]
    return int(v) if v == int(v) else v


def check_same_config(ctx: DistContext, config: Dict[str, ConfigValue], changed: bool = False) -> int:
    """Raises :class:`DistributedInputError` on every rank unless every rank built its head
    with the same ``config`` (a dict of numbers, strings, None or short tuples of numbers,
    the same keys on every rank). One all_gather of ``len(config) * 6 + 1`` float64 on the
    CPU group, at construction (and, with ``changed``, when a step's option fingerprints
    differ: the message then says the options were changed after construction). Heads
    that disagree (e.g. on ``num_classes``) would otherwise train without error, with
    classes in no shard or in two.

    Returns the head's token: rank 0's random 52-bit number, the same on every rank, which
    the per-step exchange compares (heads called in another order on another rank)."""
    names = list(config)
    token = float(int.from_bytes(os.urandom(7), "little") >> 4)  # 52 bits: exact in float64
    fields = [v for name in names for v in _encode_field(config[name])]
    mine = torch.tensor(fields + [token], dtype=torch.float64, device="cpu")
    out = torch.empty(ctx.world_size * mine.numel(), dtype=torch.float64, device="cpu")
    try:
        dist.all_gather_into_tensor(out, mine, group=ctx.cpu_group)
    except Exception as err:
        raise ctx.fail("configuration exchange", err) from err
    gathered = out.view(ctx.world_size, mine.numel())
    rows = gathered[:, :-1].reshape(ctx.world_size, len(names), _SLOTS).tolist()
    diffs = []
    for i, name in enumerate(names):
        if any(row[i] != rows[0][i] for row in rows):
            per_rank = ", ".join(f"rank {r}: {_decode_field(row[i])!r}" for r, row in enumerate(rows))
            diffs.append(f"`{name}` differs ({per_rank})")
    if diffs and changed:
        raise DistributedInputError(
            f"ShardedSoftmaxLoss rank {ctx.rank}: the head's options differ between the ranks this step "
            "(changed after construction on some ranks only): " + "; ".join(diffs) + ". Set them alike on every rank"
        )
    if diffs:
        raise DistributedInputError(
            f"ShardedSoftmaxLoss rank {ctx.rank}: the ranks of the process group built different heads: "
            + "; ".join(diffs)
            + ". Build the loss with the same arguments on every rank"
        )
    return int(gathered[0, -1].item())


# Per-step mode fields carried by the batch-info exchange (after b, d, dtype code, error).
_MODE_FIELDS = (
    "return_details",
    "with_rank (topk details)",
    "sample_rate (train vs eval)",
    "embeddings need a gradient (grad mode and requires_grad)",
)


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(b)))[0]


def options_fingerprint(options: Dict[str, ConfigValue]) -> int:
    """A signed 64-bit digest of ``options`` (encoded as :func:`check_same_config` encodes
    them): what the per-step exchange compares, a few microseconds of host work."""
    encoded = struct.pack(f"<{_SLOTS * len(options)}d", *[v for k in options for v in _encode_field(options[k])])
    return int.from_bytes(hashlib.blake2b(encoded, digest_size=8).digest(), "little", signed=True)


def exchange_batch_info(
    ctx: DistContext,
    x: object,
    error: Optional[Exception],
    mode: Tuple[bool, bool, float, bool] = (False, False, 1.0, False),
    token: int = 0,
    options: Optional[Dict[str, ConfigValue]] = None,
) -> List[int]:
    """Host-side exchange of (batch size, width, dtype, error flag), of this step's mode
    (``(return_details, with_rank, effective sample_rate, embeddings need a gradient)``: a
    rank whose embeddings need none skips the backward's reduce-scatter), of the head's
    ``token`` (from :func:`check_same_config`) and of a fingerprint of its current
    ``options`` (those that change the loss: margin, smoothing, ignore_index, reduction),
    on the CPU group.

    Returns every rank's batch size. Raises :class:`DistributedInputError` on every rank
    when any rank reports an error, when the ranks call different heads (another order),
    when they disagree on the width or dtype (or, in the replicated layout, on the batch
    size), when they call the loss in different modes (the collectives that follow would
    differ and stall until the group's timeout), or when an option differs (the loss would
    differ between ranks, silently; a second small exchange names the option).
    """
    if isinstance(x, torch.Tensor) and x.dim() == 2:
        b, d, code = x.shape[0], x.shape[1], _DTYPE_CODES.get(x.dtype, 0)
    else:
        b, d, code = -1, -1, 0
    details, with_rank, rate, grad = mode
    flag = 0 if error is None else 2 if isinstance(error, NonFiniteEmbeddingsError) else 1
    digest = 0 if options is None else options_fingerprint(options)
    row = [
        b,
        d,
        code,
        flag,
        int(bool(details)),
        int(bool(with_rank)),
        _float_bits(rate),
        int(bool(grad)),
        token,
        digest,
    ]
    mine = torch.tensor(row, dtype=torch.int64, device="cpu")
    out = torch.empty(ctx.world_size * len(row), dtype=torch.int64, device="cpu")
    try:
        dist.all_gather_into_tensor(out, mine, group=ctx.cpu_group)
    except Exception as err:  # gloo raises RuntimeError / DistBackendError on timeout or peer loss
        raise ctx.fail("batch-size exchange", err) from err
    info = out.view(ctx.world_size, len(row)).tolist()  # CPU tensor: no device sync
    if error is not None:
        raise (DistributedNonFiniteError if flag == 2 else DistributedInputError)(
            f"ShardedSoftmaxLoss rank {ctx.rank}: {error}"
        )
    # Another rank's invalid input first: its mode fields (e.g. whether its non-tensor
    # "embeddings" need a gradient) mean nothing, and a mode mismatch would name the wrong cause.
    bad = [r for r, row in enumerate(info) if row[3]]
    if bad:
        raise (DistributedNonFiniteError if any(info[r][3] == 2 for r in bad) else DistributedInputError)(
            f"ShardedSoftmaxLoss rank {ctx.rank}: rank(s) {bad} got invalid input (their error says "
            f"which); every rank raises so that none waits in a collective"
        )
    if len({row[8] for row in info}) > 1:
        raise DistributedInputError(
            f"ShardedSoftmaxLoss rank {ctx.rank}: the ranks called different heads this step (a head's "
            "shards are paired across the ranks in the order the heads were built): call the heads in "
            "the same order on every rank"
        )
    diffs = []
    for k, name in enumerate(_MODE_FIELDS):
        values = [r[4 + k] for r in info]
        if len(set(values)) > 1:
            shown = [_bits_float(v) for v in values] if k == 2 else [bool(v) for v in values]
            diffs.append(f"{name} {shown}")
    if diffs:
        raise DistributedInputError(
            f"ShardedSoftmaxLoss rank {ctx.rank}: the ranks called the loss in different modes this step "
            f"(values per rank): {'; '.join(diffs)}. Every rank must call it alike: the same "
            "return_details and topk, all in train() or all in eval() mode (sample_rate applies in "
            "training only), and embeddings that require grad on all ranks or on none (the same grad "
            "mode); compute details on every rank and log them on one"
        )
    if options is not None and len({row[9] for row in info}) > 1:
        check_same_config(ctx, options, changed=True)  # names the option (every rank is here)
        raise DistributedInputError(  # (a digest collision of equal encodings: not reached)
            f"ShardedSoftmaxLoss rank {ctx.rank}: the head's options differ between the ranks this step"
        )
    widths = sorted({row[1] for row in info})
    dtypes = sorted({row[2] for row in info})
    if len(widths) > 1 or len(dtypes) > 1:
        names = {code: str(dtype).replace("torch.", "") for dtype, code in _DTYPE_CODES.items()}
        raise DistributedInputError(
            f"ShardedSoftmaxLoss rank {ctx.rank}: argument `embeddings` must have the same width and "
            f"compute dtype on every rank, got widths {[row[1] for row in info]} and dtypes "
            f"{[names.get(row[2], 'unsupported') for row in info]} (the dtype the loss computes in: the "
            "embeddings', or torch.autocast's where a rank runs under autocast; run every rank under the "
            "same autocast)"
        )
    sizes = [row[0] for row in info]
    if ctx.layout == REPLICATED and len(set(sizes)) > 1:
        raise DistributedInputError(
            f"ShardedSoftmaxLoss rank {ctx.rank}: input_layout='replicated' needs the same "
            f"`embeddings` on every rank, got batch sizes {sizes}"
        )
    return sizes
