"""The files of a re-shardable checkpoint (see :mod:`shardkit.softmax.checkpoint`): their
names, one file's atomic write, one file's checked read, and the directory's index."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import threading
from typing import Any, Dict, List, Optional, Tuple

import torch

from shardkit.softmax.optim import momentum_state_problem

FORMAT = "shardkit.sharded_weight"
VERSION = 1


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
    if "save_id" in blob and (isinstance(blob["save_id"], bool) or not isinstance(blob["save_id"], int)):
        raise ValueError(f"shard file {path!r} has a corrupt `save_id` ({type(blob['save_id']).__name__})")
    return blob


def fsync_directory(directory: str) -> None:
    """Makes a rename in ``directory`` durable (where the platform allows opening directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_shard_file(
    directory: str,
    weight: torch.Tensor,
    class_offset: int,
    num_classes: int,
    momentum_buffer: Optional[torch.Tensor] = None,
    momentum_seen: Optional[torch.Tensor] = None,
    save_id: Optional[int] = None,
) -> str:
    """Write one shard ([n, D] rows of classes [class_offset, class_offset + n)) into
    ``directory`` (created if missing); atomic and durable (a temporary file of its own,
    fsynced, renamed, the directory fsynced). Returns the path. ``momentum_buffer`` must be a
    floating [n, D] tensor, ``momentum_seen`` a bool [n] one; ``save_id`` (an int) marks the
    files of one save (loading refuses files of several saves mixed)."""
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
    if save_id is not None:
        blob["save_id"] = int(save_id)
    path = os.path.join(directory, _file_name(start, end))
    tmp = None
    try:
        # a temporary name of this call's own (threads of one process saving at once each get one)
        # (created with mode 0666 less the umask, as open() makes files: mkstemp's 0600 would hide
        # the checkpoint from the other users of a shared filesystem)
        tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            torch.save(blob, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        fsync_directory(directory)
    except (OSError, RuntimeError) as err:  # a full disk: torch's writer raises RuntimeError
        raise OSError(f"cannot write shard file {path!r} (disk full or not writable?): {err}") from err
    finally:  # also on Ctrl-C: no partial temporary file is left
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
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
