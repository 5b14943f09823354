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
"""

import os
from typing import List, Optional, Tuple

import torch

FORMAT = "shardkit.sharded_weight"
VERSION = 1

__all__ = ["save_sharded", "load_sharded", "export_full_weight", "import_full_weight", "save_shard_file", "read_rows"]


def _file_name(start: int, end: int) -> str:
    return f"classes-{start:012d}-{end:012d}.pt"


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
        if not (name.startswith("classes-") and name.endswith(".pt")):
            continue
        start, end = (int(v) for v in name[len("classes-") : -len(".pt")].split("-"))
        entries.append((start, end, os.path.join(directory, name)))
    if not entries:
        raise FileNotFoundError(f"argument `directory`: {directory!r} holds no shard files (classes-*.pt)")
    head = torch.load(entries[0][2], weights_only=True, mmap=True)
    if head.get("format") != FORMAT or head.get("version") != VERSION:
        raise ValueError(
            f"{entries[0][2]!r} is not a {FORMAT} v{VERSION} file (got {head.get('format')!r} v{head.get('version')!r})"
        )
    num_classes, dim = head["num_classes"], head["embedding_dim"]
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
    num_classes, _, entries = _index(directory)
    if not 0 <= start <= start + count <= num_classes:
        raise ValueError(f"rows [{start}, {start + count}) are outside the checkpoint's [0, {num_classes})")
    parts = []
    for f_start, f_end, path in entries:
        lo, hi = max(start, f_start), min(start + count, f_end)
        if lo >= hi:
            continue
        blob = torch.load(path, weights_only=True, mmap=True)
        if key not in blob:
            return None
        parts.append(blob[key][lo - f_start : hi - f_start].clone())
    if not parts:  # count == 0: an empty tensor of the stored dtype
        stored = torch.load(entries[0][2], weights_only=True, mmap=True).get(key)
        return None if stored is None else stored[:0].clone()
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _shards(module) -> Tuple[List[Tuple[int, torch.nn.Parameter]], int]:
    """[(class_offset, parameter)] of the head's local shards, and its total classes."""
    return list(zip(module.class_offsets, module.weight_shards)), module.num_classes


def save_sharded(module, directory: str, optimizer: Optional[torch.optim.Optimizer] = None) -> List[str]:
    """Save this process's shards of ``module`` (a :class:`shardkit.ShardedSoftmaxLoss`, one-
    process or distributed) into ``directory``. In the distributed mode every rank calls
    it with the same (shared-filesystem) directory; no collective is needed. With
    ``optimizer``, the shards' momentum buffers are saved too. Returns the written paths."""
    shards, num_classes = _shards(module)
    paths = []
    for offset, p in shards:
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        paths.append(
            save_shard_file(directory, p, offset, num_classes, state.get("momentum_buffer"), state.get("seen"))
        )
    return paths


def load_sharded(module, directory: str, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Fill ``module``'s local shards from a checkpoint saved with any sharding (rows copied
    bit for bit, cast only if the dtypes differ). With ``optimizer``, momentum buffers saved
    with the checkpoint are restored into its state. Raises ValueError when the class count
    or embedding width differ."""
    num_classes, dim, _ = _index(directory)
    shards, mine = _shards(module)
    if num_classes != mine or dim != shards[0][1].shape[1]:
        raise ValueError(
            f"checkpoint {directory!r} holds {num_classes} classes x {dim}, the module has "
            f"{mine} classes x {shards[0][1].shape[1]}"
        )
    with torch.no_grad():
        for offset, p in shards:
            p.copy_(read_rows(directory, offset, p.shape[0]))
            if optimizer is None:
                continue
            buf = read_rows(directory, offset, p.shape[0], "momentum_buffer")
            if buf is not None:
                seen = read_rows(directory, offset, p.shape[0], "momentum_seen")
                optimizer.state[p]["momentum_buffer"] = buf.to(device=p.device, dtype=p.dtype)
                optimizer.state[p]["seen"] = seen.to(p.device)


def export_full_weight(module) -> torch.Tensor:
    """The class-ordered [C, D] weight (``module.full_weight()``; a collective in the
    distributed mode: every rank must call it)."""
    return module.full_weight()


def import_full_weight(module, weight: torch.Tensor) -> None:
    """Copy the rows of a class-ordered [C, D] ``weight`` into ``module``'s local shards
    (every rank passes the same full weight; no collective)."""
    shards, num_classes = _shards(module)
    if weight.dim() != 2 or weight.shape[0] != num_classes or weight.shape[1] != shards[0][1].shape[1]:
        raise ValueError(
            f"argument `weight` must be [{num_classes}, {shards[0][1].shape[1]}], got {tuple(weight.shape)}"
        )
    with torch.no_grad():
        for offset, p in shards:
            p.copy_(weight[offset : offset + p.shape[0]])
