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

import contextlib
import os
import re
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from shardkit.softmax.optim import momentum_state_problem

if TYPE_CHECKING:
    from shardkit.softmax.module import ShardedSoftmaxLoss

FORMAT = "shardkit.sharded_weight"
VERSION = 1

__all__ = ["save_sharded", "load_sharded", "export_full_weight", "import_full_weight", "save_shard_file", "read_rows"]


def _file_name(start: int, end: int) -> str:
    return f"classes-{start:012d}-{end:012d}.pt"


_SHARD_NAME = re.compile(r"classes-(\d{12})-(\d{12})\.pt")
_MOMENTUM_KEYS = ("momentum_buffer", "momentum_seen")


def _check_directory(directory: object) -> None:
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"argument `directory` must be a path (str or os.PathLike), got {type(directory).__name__}")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D {value.dtype} tensor"
    return type(value).__name__


def _check_optimizer(optimizer: object) -> None:
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"argument `optimizer` must be a torch.optim.Optimizer (e.g. shardkit.SparseRowSGD) or None, got "
            f"{type(optimizer).__name__}"
        )


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
    if weight.layout != torch.strided or not weight.is_floating_point():
        raise ValueError(
            f"shard file {path!r}: `weight` must be a dense floating-point tensor, got {weight.dtype} ({weight.layout})"
        )
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
    problem = momentum_state_problem(
        blob.get("momentum_buffer"), blob.get("momentum_seen"), weight.shape, weight.dtype, _MOMENTUM_KEYS, "`weight`'s"
    )
    if problem is not None:
        raise ValueError(f"shard file {path!r}: {problem[1]}")
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
    ``directory`` (created if missing); atomic (temporary file + rename). Returns the path.
    ``momentum_buffer`` must be a floating [n, D] tensor, ``momentum_seen`` a bool [n] one."""
    _check_directory(directory)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise TypeError(f"argument `weight` must be a 2-D floating-point tensor, got {_describe(weight)}")
    problem = momentum_state_problem(
        momentum_buffer, momentum_seen, weight.shape, weight.dtype, _MOMENTUM_KEYS, "`weight`'s"
    )
    if problem is not None:
        raise problem[0](f"argument {problem[1]}")
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
        seen = (
            momentum_seen if momentum_seen is not None else torch.ones(weight.shape[0], dtype=torch.bool, device="cpu")
        )
        blob["momentum_seen"] = seen.detach().to("cpu", copy=True).bool()
    path = os.path.join(directory, _file_name(start, end))
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(blob, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:  # a full disk: torch's writer raises RuntimeError
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise OSError(f"cannot write shard file {path!r} (disk full or not writable?): {err}") from err
    return path


def _index(directory: str) -> Tuple[int, int, List[Tuple[int, int, str]]]:
    """(num_classes, dim, [(start, end, path)] sorted) of a checkpoint directory; checks
    that the files tile [0, num_classes) exactly."""
    _check_directory(directory)
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
    num_classes, dim, entries = _index(directory)
    if not 0 <= start <= start + count <= num_classes:
        raise ValueError(f"rows [{start}, {start + count}) are outside the checkpoint's [0, {num_classes})")
    blobs = {path: _load_shard(path, s, e, num_classes, dim) for s, e, path in _covering(entries, start, count)}
    return _gather(entries, blobs, start, count, key)


def _covering(entries: List[Tuple[int, int, str]], start: int, count: int) -> List[Tuple[int, int, str]]:
    """The files that rows [start, start + count) are read from (the first one for no rows)."""
    covering = [e for e in entries if max(start, e[0]) < min(start + count, e[1])]
    return covering or entries[:1]


def _gather(
    entries: List[Tuple[int, int, str]], blobs: Dict[str, Dict[str, Any]], start: int, count: int, key: str
) -> Optional[torch.Tensor]:
    """Rows [start, start + count) of ``key`` from the checked ``blobs`` of the covering files."""
    parts = []
    for f_start, f_end, path in _covering(entries, start, count):
        if key not in blobs[path]:
            return None
        lo, hi = max(start, f_start), min(start + count, f_end)
        parts.append(blobs[path][key][lo - f_start : hi - f_start].clone())
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
        TypeError: ``module`` is not a :class:`shardkit.ShardedSoftmaxLoss`, ``directory``
            not a path, ``optimizer`` not a ``torch.optim.Optimizer``.
        TypeError, ValueError: a shard's optimizer state holds a ``momentum_buffer`` that is not
            a floating tensor of the shard's shape, or ``seen`` flags that are not a bool tensor
            of its row count (the shard and key are named; nothing is written).
        OSError: the directory cannot be created or written.
    """
    shards, num_classes = _shards(module)
    _check_directory(directory)
    _check_optimizer(optimizer)
    states = []
    for k, (offset, p) in enumerate(shards):
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        buf, seen = state.get("momentum_buffer"), state.get("seen")
        problem = momentum_state_problem(buf, seen, p.shape, p.dtype)
        if problem is not None:
            where = f"the state of shard {k} (classes [{offset}, {offset + p.shape[0]}))"
            raise problem[0](f"argument `optimizer`: {where}: {problem[1]}")
        states.append((buf, seen))
    return [
        save_shard_file(directory, p, offset, num_classes, buf, seen)
        for (offset, p), (buf, seen) in zip(shards, states)
    ]


def _check_same_momentum(
    entries: List[Tuple[int, int, str]], blobs: Dict[str, Dict[str, Any]], num_classes: int, dim: int
) -> None:
    """Refuse a checkpoint whose shard files disagree on holding ``momentum_buffer`` (every file
    is read, the ones this process loads no rows from too, so every rank decides alike):
    restoring the momentum of some shards only would go unnoticed. ValueError naming a file
    that has it and one that lacks it."""
    has: Dict[bool, str] = {}
    for start, end, path in entries:
        blob = blobs[path] if path in blobs else _load_shard(path, start, end, num_classes, dim)
        has.setdefault("momentum_buffer" in blob, path)
    if len(has) == 2:
        raise ValueError(
            f"shard file {has[False]!r} lacks the `momentum_buffer` (and `momentum_seen`) that shard file "
            f"{has[True]!r} holds: a checkpoint saved with an optimizer for some shards only (or files "
            "of two saves mixed); its momentum cannot be restored for every shard"
        )


def load_sharded(module: ShardedSoftmaxLoss, directory: str, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Fill ``module``'s local shards from a checkpoint saved with any sharding (rows copied
    bit for bit, cast only if the dtypes differ). With ``optimizer``, momentum buffers saved
    with the checkpoint are restored into its state, on each shard's device and dtype.

    Every file read is checked before anything is copied: a refused checkpoint leaves the
    module and the optimizer as they were.

    Raises:
        TypeError: ``module`` is not a :class:`shardkit.ShardedSoftmaxLoss`, ``directory`` not
            a path, ``optimizer`` not a ``torch.optim.Optimizer``.
        FileNotFoundError: ``directory`` does not exist or holds no shard files.
        ValueError: the class count or embedding width differ from the module's; a shard
            file is malformed (a non-floating ``weight``; a ``momentum_buffer`` that is not a
            floating [rows, D] tensor; ``momentum_seen`` flags that are not a bool [rows]
            tensor) or the files do not tile the classes (the file is named); the checkpoint
            holds momentum for a shard that ``optimizer`` does not optimize; with ``optimizer``,
            some shard files hold momentum and others not (a file lacking it and one holding
            it are named).
    """
    shards, mine = _shards(module)
    _check_optimizer(optimizer)
    num_classes, dim, entries = _index(directory)
    if num_classes != mine or dim != shards[0][1].shape[1]:
        raise ValueError(
            f"checkpoint {directory!r} holds {num_classes} classes x {dim}, the module has "
            f"{mine} classes x {shards[0][1].shape[1]}"
        )
    blobs: Dict[str, Dict[str, Any]] = {}
    for offset, p in shards:  # read and check every file first
        for start, end, path in _covering(entries, offset, p.shape[0]):
            if path not in blobs:
                blobs[path] = _load_shard(path, start, end, num_classes, dim)
    if optimizer is not None:
        _check_same_momentum(entries, blobs, num_classes, dim)
    loads = []
    optimized = {id(q) for group in optimizer.param_groups for q in group["params"]} if optimizer is not None else set()
    for k, (offset, p) in enumerate(shards):
        rows = _gather(entries, blobs, offset, p.shape[0], "weight")
        assert rows is not None  # every shard file holds `weight` (_load_shard checks it)
        buf = _gather(entries, blobs, offset, p.shape[0], "momentum_buffer") if optimizer is not None else None
        seen = None
        if buf is not None:
            if id(p) not in optimized:
                raise ValueError(
                    f"argument `optimizer` does not optimize shard {k} of `module` (classes [{offset}, "
                    f"{offset + p.shape[0]})), whose momentum checkpoint {directory!r} holds"
                )
            seen = _gather(entries, blobs, offset, p.shape[0], "momentum_seen")
            if seen is None:  # no flags saved with the rows: every row's buffer was started (as from SGD)
                seen = torch.ones(p.shape[0], dtype=torch.bool, device="cpu")
        loads.append((p, rows, buf, seen))
    with torch.no_grad():
        for p, rows, buf, seen in loads:
            p.copy_(rows)
            if optimizer is not None and buf is not None and seen is not None:
                optimizer.state[p]["momentum_buffer"] = buf.to(device=p.device, dtype=p.dtype)
                optimizer.state[p]["seen"] = seen.to(device=p.device, dtype=torch.bool)


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
