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
other file (a temporary ``*.tmp*``, notes, a README) is ignored. Every shard
file that loading reads is checked: a file that does not unpickle with
``weights_only=True`` (empty, truncated, garbage, or a pickle that would run code), a dict
of another format, or rows/offsets that disagree with its name raise ``ValueError`` naming
the file.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from shardkit.softmax.collectives import DistributedInputError
from shardkit.softmax.head import reparametrized
from shardkit.softmax.optim import SparseRowSGD, momentum_state_problem
from shardkit.softmax.shard_files import (
    _check_directory,
    _index,
    _load_shard,
    save_shard_file,
)

if TYPE_CHECKING:
    from shardkit.softmax.module import ShardedSoftmaxLoss

__all__ = [
    "save_sharded",
    "load_sharded",
    "export_full_weight",
    "import_full_weight",
    "save_shard_file",
    "read_rows",
    "save_id_of",
]
_ROW_KEYS = ("momentum_buffer", "momentum_seen")


def _check_optimizer(optimizer: object) -> None:
    # The shard files hold SGD's momentum: another optimizer's state (AdamW's moments, RMSprop's
    # own "momentum_buffer") would be dropped on save, or overwritten with SGD's on load.
    if optimizer is None or isinstance(optimizer, (SparseRowSGD, torch.optim.SGD)):
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"argument `optimizer` must be a torch.optim.Optimizer (shardkit.SparseRowSGD or torch.optim.SGD) or "
            f"None, got {type(optimizer).__name__}"
        )
    raise TypeError(
        f"argument `optimizer` must be shardkit.SparseRowSGD or torch.optim.SGD (the shard files hold SGD's "
        f"momentum), got {type(optimizer).__name__}: pass optimizer=None and save / load its state with its "
        "own state_dict()"
    )


def read_rows(directory: str, start: int, count: int, key: str = "weight") -> Optional[torch.Tensor]:
    """Rows [start, start + count) of ``key`` ("weight", "momentum_buffer" or
    "momentum_seen") from a checkpoint directory, on the CPU, bit-exact; None when the
    files lack ``key``."""
    if key not in ("weight", *_ROW_KEYS):
        raise ValueError(f"argument `key` must be 'weight', 'momentum_buffer' or 'momentum_seen', got {key!r}")
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
    if reparametrized(module):
        raise TypeError(
            "argument `module` has parametrized weight shards (e.g. weight_norm, or pruned): save_sharded, "
            "load_sharded and import_full_weight copy plain rows and would miss the parametrization's "
            "originals; use the head's state_dict() / load_state_dict() (which hold them), or remove "
            "the parametrization first"
        )
    return list(zip(module.class_offsets, module.weight_shards)), module.num_classes


def save_sharded(
    module: ShardedSoftmaxLoss,
    directory: str,
    optimizer: Optional[torch.optim.Optimizer] = None,
    tag: Optional[int] = None,
) -> List[str]:
    """Save this process's shards of ``module`` (a :class:`shardkit.ShardedSoftmaxLoss`, one-
    process or distributed) into ``directory``. In the distributed mode every rank calls
    it with the same (shared-filesystem) directory; without ``tag`` it is a collective (one small
    gloo all_gather, so an argument refused on one rank raises on every rank and none writes;
    pass ``tag``, e.g. the step, to save from a background thread: no collective). With
    ``optimizer``, the shards' momentum
    buffers are saved too. Returns the written paths (one file per local shard; the rows keep
    their dtype and are written from any device).

    Every file records the save's id (``tag`` when given, e.g. the step; else a random id), and
    :func:`load_sharded` refuses a directory whose files come from several saves (a save
    interrupted after some files were replaced). Each file is written atomically and
    durably; the directory as a whole is not: save each checkpoint into a new directory to
    always keep an intact one.

    Raises:
        TypeError: ``module`` is not a :class:`shardkit.ShardedSoftmaxLoss`, ``directory``
            not a path, ``optimizer`` not a ``shardkit.SparseRowSGD`` or ``torch.optim.SGD`` (the
            files hold SGD momentum only), ``tag`` not an int; the shards are parametrized
            (``weight_norm``: use the head's ``state_dict``).
        TypeError, ValueError: a shard's optimizer state holds a ``momentum_buffer`` that is not
            a floating tensor of the shard's shape, or ``seen`` flags that are not a bool tensor
            of its row count (the shard and key are named; nothing is written); ``optimizer``
            does not optimize a shard of ``module`` (ValueError).
        OSError: the directory cannot be created or written.
    """
    shards, num_classes = _shards(module)
    error: Optional[Exception] = None
    states = []
    try:
        _check_directory(directory)
        _check_optimizer(optimizer)
        _check_tag(tag)
        optimized = {id(q) for g in optimizer.param_groups for q in g["params"]} if optimizer is not None else set()
        for k, (offset, p) in enumerate(shards):
            if optimizer is not None and id(p) not in optimized:  # (its momentum would be lost silently)
                raise ValueError(
                    f"argument `optimizer` does not optimize shard {k} of `module` (classes [{offset}, "
                    f"{offset + p.shape[0]})): pass the head's optimizer, or optimizer=None to save the weights only"
                )
            state = optimizer.state.get(p, {}) if optimizer is not None else {}
            buf, seen = state.get("momentum_buffer"), state.get("seen")
            problem = momentum_state_problem(buf, seen, p.shape, p.dtype)
            if problem is not None:
                where = f"the state of shard {k} (classes [{offset}, {offset + p.shape[0]}))"
                raise problem[0](f"argument `optimizer`: {where}: {problem[1]}")
            states.append((buf, seen))
    except Exception as err:  # noqa: BLE001 (every rank learns of it in the exchange; re-raised there)
        error = err
    save_id = _new_save_id(module, shards, num_classes, tag, error)
    return [
        save_shard_file(directory, p, offset, num_classes, buf, seen, save_id)
        for (offset, p), (buf, seen) in zip(shards, states)
    ]


def _check_tag(tag: Optional[int]) -> None:
    if tag is not None and (isinstance(tag, bool) or not isinstance(tag, int) or not -(2**63) <= tag < 2**63):
        raise TypeError(f"argument `tag` must be an int (int64), got {tag!r}")


def _new_save_id(
    module: ShardedSoftmaxLoss,
    shards: List[Tuple[int, torch.nn.Parameter]],
    num_classes: int,
    tag: Optional[int],
    error: Optional[Exception],
) -> Optional[int]:
    """The id every file of this save records: ``tag`` when given (no collective), else a
    random one: in the process-group mode the ranks exchange (error flag, id) with one small
    gloo all_gather, so an argument refused on one rank raises on every rank (none writes) and
    the ranks take rank 0's id. Without a process group, a call that writes only part of the classes (ranks
    saving on their own) records none unless ``tag`` is given. Raises ``error`` (this rank's)."""
    mine = int.from_bytes(os.urandom(8), "little") >> 1
    ctx = getattr(getattr(module, "_mode", None), "ctx", None)
    if ctx is not None and tag is None:  # a tagged save needs no collective (a background thread's)
        row = torch.tensor([int(error is not None), mine], dtype=torch.int64, device="cpu")
        rows = torch.empty(2 * ctx.world_size, dtype=torch.int64, device="cpu")
        try:
            dist.all_gather_into_tensor(rows, row, group=ctx.cpu_group)
        except Exception as err:
            raise ctx.fail("save_sharded exchange", err) from err
        flags, ids = rows.view(ctx.world_size, 2).t().tolist()
        if error is not None:
            raise error
        bad = [r for r, f in enumerate(flags) if f]
        if bad:
            raise DistributedInputError(
                f"save_sharded rank {ctx.rank}: rank(s) {bad} refused their arguments (their error says which); "
                "no rank wrote its files"
            )
        return tag if tag is not None else ids[0]
    if error is not None:
        raise error
    if tag is not None:
        return tag
    return mine if sum(p.shape[0] for _, p in shards) == num_classes else None


def save_id_of(directory: str) -> Optional[int]:
    """The id of the save a checkpoint directory's files come from (None for files saved
    before ids were written); ValueError when its files come from several saves."""
    num_classes, dim, entries = _index(directory)
    return _check_files_agree(entries, {}, num_classes, dim)


def _check_files_agree(
    entries: List[Tuple[int, int, str]],
    blobs: Dict[str, Dict[str, Any]],
    num_classes: int,
    dim: int,
    momentum: bool = False,
) -> Optional[int]:
    """Every shard file of the directory comes from one save (the same ``save_id``: files of
    an interrupted save mixed with an earlier one's are refused) and, with ``momentum``, all
    hold ``momentum_buffer`` or none do (restoring the momentum of some shards only would go
    unnoticed). Every file is read (memory-mapped: the pickles, not the rows), the ones this
    process loads no rows from too, so every rank decides alike. ValueError naming two files
    that differ. Returns the save id."""
    ids: Dict[Optional[int], str] = {}
    has: Dict[bool, str] = {}
    for start, end, path in entries:
        blob = blobs[path] if path in blobs else _load_shard(path, start, end, num_classes, dim)
        ids.setdefault(blob.get("save_id"), path)
        has.setdefault("momentum_buffer" in blob, path)
    if len(ids) > 1:
        (id_a, path_a), (id_b, path_b) = list(ids.items())[:2]
        raise ValueError(
            f"shard files {path_a!r} and {path_b!r} come from different saves (ids {id_a} and {id_b}): an "
            "interrupted or concurrent save_sharded left files of two checkpoints mixed; load an "
            "intact checkpoint (save each checkpoint into a new directory to always keep one)"
        )
    if momentum and len(has) == 2:
        raise ValueError(
            f"shard file {has[False]!r} lacks the `momentum_buffer` (and `momentum_seen`) that shard file "
            f"{has[True]!r} holds: a checkpoint saved with an optimizer for some shards only (or files "
            "of two saves mixed); its momentum cannot be restored for every shard"
        )
    return next(iter(ids))


def load_sharded(module: ShardedSoftmaxLoss, directory: str, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Fill ``module``'s local shards from a checkpoint saved with any sharding (rows copied
    bit for bit, cast only if the dtypes differ). With ``optimizer``, momentum buffers saved
    with the checkpoint are restored into its state, on each shard's device and dtype.

    Every file read is checked before anything is copied: a refused checkpoint leaves the
    module and the optimizer as they were.

    Raises:
        TypeError: ``module`` is not a :class:`shardkit.ShardedSoftmaxLoss`, ``directory`` not
            a path, ``optimizer`` not a ``shardkit.SparseRowSGD`` or
            ``torch.optim.SGD``.
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
    _check_files_agree(entries, blobs, num_classes, dim, momentum=optimizer is not None)
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
            if optimizer is None:
                continue
            state = optimizer.state[p]
            if buf is not None and seen is not None:
                state["momentum_buffer"] = buf.to(device=p.device, dtype=p.dtype)
                state["seen"] = seen.to(device=p.device, dtype=torch.bool)
            else:  # no momentum saved: none for the loaded rows (as Optimizer.load_state_dict)
                state.pop("momentum_buffer", None)
                state.pop("seen", None)
            replaced = getattr(optimizer, "state_replaced", None)
            if callable(replaced):
                replaced(p)  # SparseRowSGD: its per-row `seen` rule applies again


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
