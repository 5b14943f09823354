"""Re-shardable checkpoints of a class-sharded head: save on N ranks (or N devices of the
one-process mode), load on M, any N and M.

A checkpoint is a directory with one file per saved shard, named by its class range
(``classes-<start>-<end>.pt``, not by rank), each holding::

    {"format": "shardkit.sharded_weight", "version": 1, "num_classes": C,
     "embedding_dim": D, "class_offset": start, "weight": [end - start, D] tensor,
     optional "momentum_buffer": [end - start, D], "momentum_seen": [end - start] bool}

so loading needs only the class range each shard wants: it reads the overlapping rows of
the files that cover it (memory-mapped, ``torch.load(weights_only=True, mmap=True)``)
and copies them bit for bit. The optional momentum rows are :class:`shardkit.SparseRowSGD`'s
(``torch.optim.SGD``'s buffer has the same layout and is saved too; ``seen`` is then all
True). Save into an empty (or this head's own) directory: files of another sharding left
there overlap and loading rejects them.

Which files are shards: exactly the names ``classes-<12 digits>-<12 digits>.pt``; every
other file (an interrupted save's ``*.tmp<pid>``, notes, a README) is ignored. Every shard
file that loading reads is checked: a file that does not unpickle with
``weights_only=True`` (empty, truncated, garbage, or a pickle that would run code), a dict
of another format, or rows/offsets that disagree with its name raise ``ValueError`` naming
the file.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

if TYPE_CHECKING:
    from shardkit.softmax.module import ShardedSoftmaxLoss

FORMAT = "shardkit.sharded_weight"
VERSION = 1

__all__ = ["save_sharded", "load_sharded", "export_full_weight", "import_full_weight", "save_shard_file", "read_rows"]


def _file_name(start: int, end: int) -> str:
    return f"classes-{start:012d}-{end:012d}.pt"


_SHARD_NAME = re.compile(r"classes-(\d{12})-(\d{12})\.pt")


def _load_shard(
    path: str, start: int, end: int, num_classes: Optional[int] = None, dim: Optional[int] = None
) -> Dict[str, Any]:
    """The dict of one shard file, checked against its name (and the checkpoint's class
    count and width when given). ValueError naming the file on anything unexpected."""
    try:
        blob = torch.load(path, weights_only=True, mmap=True)
    except Exception as err:  # EOFError, UnpicklingError, RuntimeError of the zip reader, ...
        raise ValueError(
            f"shard file {path!r} cannot be read as a {FORMAT} file (empty, truncated, garbage, or "
            f"not a weights-only pickle): {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        ) from err
    if not isinstance(blob, dict) or blob.get("format") != FORMAT or blob.get("version") != VERSION:
        got = (blob.get("format"), blob.get("version")) if isinstance(blob, dict) else type(blob).__name__
        raise ValueError(f"shard file {path!r} is not a {FORMAT} v{VERSION} file (got {got!r})")
    weight = blob.get("weight")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"shard file {path!r} holds no 2-D `weight` tensor")
    if blob.get("class_offset") != start or weight.shape[0] != end - start:
        raise ValueError(
            f"shard file {path!r}: its name says classes [{start}, {end}) ({end - start} rows), the file "
            f"holds {weight.shape[0]} rows at class_offset {blob.get('class_offset')!r}"
        )
    if (num_classes is not None and blob.get("num_classes") != num_classes) or (
        dim is not None and weight.shape[1] != dim
    ):
        raise ValueError(
            f"shard file {path!r} holds {blob.get('num_classes')!r} classes x {weight.shape[1]}, the other "
            f"shard files {num_classes} x {dim} (files of another checkpoint in the directory?)"
        )
    for key in ("momentum_buffer", "momentum_seen"):
        t = blob.get(key)
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape[0] != weight.shape[0]):
            raise ValueError(f"shard file {path!r}: `{key}` does not have the {weight.shape[0]} rows of `weight`")
    return blob


def save_shard_file(
    directory: str,
    weight: torch.Tensor,
    class_offset: int,
    num_classes: int,
    momentum_buffer: Optional[torch.Tensor] = None,
    momentum_seen: Optional[torch.Tensor] = None,
) -> str:
    """Write one shard ([n, D] rows of classes [class_offset, class_offset + n)) into
    ``directory`` (created if missing); atomic (temporary file + rename). Returns the path."""
    os.makedirs(directory, exist_ok=True)
    start, end = int(class_offset), int(class_offset) + weight.shape[0]
    if not 0 <= start <= end <= num_classes:
        raise ValueError(f"argument `class_offset` {start} with {weight.shape[0]} rows is outside [0, {num_classes})")
    blob = {
        "format": FORMAT,
        "version": VERSION,
        "num_classes": int(num_classes),
        "embedding_dim": int(weight.shape[1]),
        "class_offset": start,
        "weight": weight.detach().to("cpu", copy=True).contiguous(),
    }
    if momentum_buffer is not None:
        blob["momentum_buffer"] = momentum_buffer.detach().to("cpu", copy=True).contiguous()
        seen = momentum_seen if momentum_seen is not None else torch.ones(weight.shape[0], dtype=torch.bool)
        blob["momentum_seen"] = seen.detach().to("cpu", copy=True)
    path = os.path.join(directory, _file_name(start, end))
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(blob, tmp)
    os.replace(tmp, path)
    return path


def _index(directory: str) -> Tuple[int, int, List[Tuple[int, int, str]]]:
    """(num_classes, dim, [(start, end, path)] sorted) of a checkpoint directory; checks
    that the files tile [0, num_classes) exactly."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"argument `directory`: no checkpoint directory at {directory!r}")
    entries = []
    for name in sorted(os.listdir(directory)):
        match = _SHARD_NAME.fullmatch(name)
        if match is None:
            continue  # not a shard file (see the module docstring)
        start, end = int(match.group(1)), int(match.group(2))
        if end < start:
            raise ValueError(f"shard file {os.path.join(directory, name)!r}: its class range ends before it starts")
        entries.append((start, end, os.path.join(directory, name)))
    if not entries:
        raise FileNotFoundError(
            f"argument `directory`: {directory!r} holds no shard files (classes-<start>-<end>.pt, 12 digits each)"
        )
    head = _load_shard(entries[0][2], entries[0][0], entries[0][1])
    num_classes, dim = head.get("num_classes"), head["weight"].shape[1]
    if not isinstance(num_classes, int) or head.get("embedding_dim") != dim:
        raise ValueError(f"shard file {entries[0][2]!r} has a corrupt `num_classes` or `embedding_dim`")
    expected = 0
    for start, end, path in entries:
        if start != expected:
            raise ValueError(
                f"checkpoint {directory!r}: shard files must tile [0, {num_classes}) without gaps "
                f"or overlaps, found {path!r} at class {start} where {expected} was expected "
                "(files of another sharding left in the directory?)"
            )
        expected = end
    if expected != num_classes:
        raise ValueError(f"checkpoint {directory!r}: shard files cover [0, {expected}) of {num_classes} classes")
    return num_classes, dim, entries


def read_rows(directory: str, start: int, count: int, key: str = "weight") -> Optional[torch.Tensor]:
    """Rows [start, start + count) of ``key`` ("weight", "momentum_buffer" or
    "momentum_seen") from a checkpoint directory, on the CPU, bit-exact; None when the
    files lack ``key``."""
    num_classes, _dim, entries = _index(directory)
    if not 0 <= start <= start + count <= num_classes:
        raise ValueError(f"rows [{start}, {start + count}) are outside the checkpoint's [0, {num_classes})")
    parts = []
    for f_start, f_end, path in entries:
        lo, hi = max(start, f_start), min(start + count, f_end)
        if lo >= hi:
            continue
        blob = _load_shard(path, f_start, f_end, num_classes, _dim)
        if key not in blob:
            return None
        parts.append(blob[key][lo - f_start : hi - f_start].clone())
    if not parts:  # count == 0: an empty tensor of the stored dtype
        stored = _load_shard(entries[0][2], entries[0][0], entries[0][1], num_classes, _dim).get(key)
        return None if stored is None else stored[:0].clone()
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _shards(module: ShardedSoftmaxLoss) -> Tuple[List[Tuple[int, torch.nn.Parameter]], int]:
    """[(class_offset, parameter)] of the head's local shards, and its total classes."""
    if not all(hasattr(module, a) for a in ("class_offsets", "weight_shards", "num_classes")):
        raise TypeError(
            f"argument `module` must be a shardkit.ShardedSoftmaxLoss (a class-sharded head), got "
            f"{type(module).__name__}"
        )
    return list(zip(module.class_offsets, module.weight_shards)), module.num_classes


def save_sharded(
    module: ShardedSoftmaxLoss, directory: str, optimizer: Optional[torch.optim.Optimizer] = None
) -> List[str]:
    """Save this process's shards of ``module`` (a :class:`shardkit.ShardedSoftmaxLoss`, one-
    process or distributed) into ``directory``. In the distributed mode every rank calls
    it with the same (shared-filesystem) directory; no collective is needed. With
    ``optimizer``, the shards' momentum buffers are saved too. Returns the written paths
    (one file per local shard; the rows keep their dtype and are written from any device).

    Raises:
        TypeError: ``module`` is not a :class:`shardkit.ShardedSoftmaxLoss`.
        OSError: the directory cannot be created or written.
    """
    shards, num_classes = _shards(module)
    paths = []
    for offset, p in shards:
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        paths.append(
            save_shard_file(directory, p, offset, num_classes, state.get("momentum_buffer"), state.get("seen"))
        )
    return paths


def load_sharded(module: ShardedSoftmaxLoss, directory: str, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Fill ``module``'s local shards from a checkpoint saved with any sharding (rows copied
    bit for bit, cast only if the dtypes differ). With ``optimizer``, momentum buffers saved
    with the checkpoint are restored into its state, on each shard's device and dtype.

    Raises:
        TypeError: ``module`` is not a :class:`shardkit.ShardedSoftmaxLoss`.
        FileNotFoundError: ``directory`` does not exist or holds no shard files.
        ValueError: the class count or embedding width differ from the module's, or a shard
            file is malformed or the files do not tile the classes (the file is named).
    """
    shards, mine = _shards(module)
    num_classes, dim, _ = _index(directory)
    if num_classes != mine or dim != shards[0][1].shape[1]:
        raise ValueError(
            f"checkpoint {directory!r} holds {num_classes} classes x {dim}, the module has "
            f"{mine} classes x {shards[0][1].shape[1]}"
        )
    with torch.no_grad():
        for offset, p in shards:
            rows = read_rows(directory, offset, p.shape[0])
            assert rows is not None  # every shard file holds `weight` (_load_shard checks it)
            p.copy_(rows)
            if optimizer is None:
                continue
            buf = read_rows(directory, offset, p.shape[0], "momentum_buffer")
            if buf is not None:
                seen = read_rows(directory, offset, p.shape[0], "momentum_seen")
                if seen is None:  # no flags saved with the rows: every row's buffer was started (as from SGD)
                    seen = torch.ones(p.shape[0], dtype=torch.bool)
                optimizer.state[p]["momentum_buffer"] = buf.to(device=p.device, dtype=p.dtype)
                optimizer.state[p]["seen"] = seen.to(p.device)


def export_full_weight(module: ShardedSoftmaxLoss) -> torch.Tensor:
    """The class-ordered [C, D] weight, detached, in the shards' dtype, on the first shard's
    device (``module.full_weight()``; a collective in the distributed mode: every rank must
    call it). ``TypeError`` when ``module`` is not a :class:`shardkit.ShardedSoftmaxLoss`."""
    _shards(module)  # TypeError naming `module` for anything but a head
    return module.full_weight()


def import_full_weight(module: ShardedSoftmaxLoss, weight: torch.Tensor) -> None:
    """Copy the rows of a class-ordered [C, D] ``weight`` (any floating dtype, any device: each
    shard's rows are cast and moved to it) into ``module``'s local shards (every rank passes
    the same full weight; no collective).

    Raises:
        TypeError: ``weight`` is not a floating tensor, or ``module`` not a :class:`shardkit.ShardedSoftmaxLoss`.
        ValueError: ``weight`` is not [C, D] with the module's C and D.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"argument `weight` must be a [C, D] torch.Tensor, got {type(weight).__name__}")
    if weight.is_nested or weight.layout != torch.strided or weight.device.type == "meta":
        raise TypeError(
            f"argument `weight` must be a dense tensor with data, got layout {weight.layout} on {weight.device}"
        )
    if not weight.is_floating_point():
        raise TypeError(f"argument `weight` must be floating point, got {weight.dtype}")
    shards, num_classes = _shards(module)
    if weight.dim() != 2 or weight.shape[0] != num_classes or weight.shape[1] != shards[0][1].shape[1]:
        raise ValueError(
            f"argument `weight` must be [{num_classes}, {shards[0][1].shape[1]}], got {tuple(weight.shape)}"
        )
    with torch.no_grad():
        for offset, p in shards:
            p.copy_(weight[offset : offset + p.shape[0]])
