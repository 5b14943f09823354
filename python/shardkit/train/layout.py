"""Where the checkpoint of a ``python -m shardkit.train`` run lives in ``<out>/checkpoint``.

One process: ``checkpoint.pt``, one file replaced atomically. Under torchrun a save is many
files (each rank's ``checkpoint.pt.rankR`` and the head's shard files in ``head/``), which no
rename replaces at once: each save writes them into a new generation folder
``step-<step>-<id>``; once every rank has written its files, rank 0 names that folder in
``LATEST`` (replaced atomically) and removes the older ones. A save killed at any point leaves
``LATEST`` naming the previous complete checkpoint.

After a save the folder holds one layout only (a one-process save removes a torchrun run's
files, and the reverse). Where an interrupted clean-up left both, the newer one is resumed.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import IO, List, Optional, Tuple

from shardkit.softmax.shard_files import fsync_directory
from shardkit.train.errors import UsageError

CKPT_FILE = "checkpoint.pt"
LATEST = "LATEST"
_GENERATION = re.compile(r"step-\d{12}-[0-9a-f]{8}")
_TEMPORARY = re.compile(r"\.(checkpoint\.pt(\.rank\d+)?|LATEST)\.tmp\d+")  # a write killed before its rename


def generation_name(step: int, nonce: int) -> str:
    """The folder of one torchrun save (``nonce``: one random draw, the same on every rank)."""
    return f"step-{step:012d}-{nonce & 0xFFFFFFFF:08x}"


def is_generation(path: str) -> bool:
    return bool(_GENERATION.fullmatch(os.path.basename(os.path.normpath(path))))


def generation(ckpt_dir: str) -> Optional[str]:
    """The generation folder ``LATEST`` names in ``ckpt_dir``, else None."""
    try:
        with open(os.path.join(ckpt_dir, LATEST), encoding="utf-8") as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    path = os.path.join(ckpt_dir, name)
    return path if _GENERATION.fullmatch(name) and os.path.isdir(path) else None


def _mtime(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def newest_file(directory: str) -> Optional[str]:
    """The checkpoint file to resume from in ``directory`` (a checkpoint folder or a generation
    folder): the newest of ``checkpoint.pt``, ``checkpoint.pt.rank0`` and the rank-0 file of
    the generation ``LATEST`` names (dated by ``LATEST``, written once the save was complete).
    None when there is none."""
    found: List[Tuple[int, int, str]] = []
    for rank, name in enumerate((CKPT_FILE, CKPT_FILE + ".rank0")):
        t = _mtime(os.path.join(directory, name))
        if t is not None:
            found.append((t, rank, os.path.join(directory, name)))
    gen = generation(directory)
    if gen is not None and os.path.isfile(os.path.join(gen, CKPT_FILE + ".rank0")):
        t = _mtime(os.path.join(directory, LATEST))
        found.append((t or 0, 2, os.path.join(gen, CKPT_FILE + ".rank0")))
    return max(found)[2] if found else None


def commit(ckpt_dir: str, name: str) -> None:
    """Names generation ``name`` in ``LATEST`` (durably: temporary file, fsync, rename, fsync
    of the folder), then removes every other layout's files. Rank 0 calls it once every rank
    has written its files of ``name``."""
    tmp = os.path.join(ckpt_dir, f".{LATEST}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(ckpt_dir, LATEST))
    except BaseException:
        _remove(tmp)
        raise
    fsync_directory(ckpt_dir)
    remove_others(ckpt_dir, keep=name)


def remove_others(ckpt_dir: str, keep: Optional[str]) -> None:
    """Removes what another save left in ``ckpt_dir``: with ``keep`` (a torchrun save's
    generation) every other generation and a one-process run's files; without (a one-process
    save) every torchrun file. Best effort: a file that cannot be removed stays (the newer
    layout is resumed)."""
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return
    for name in names:
        path = os.path.join(ckpt_dir, name)
        if _TEMPORARY.fullmatch(name):
            _remove(path)
            continue
        torchrun_file = name == "head" or name.startswith(CKPT_FILE + ".rank") or name == LATEST
        if keep is None:
            stale = torchrun_file or _GENERATION.fullmatch(name) is not None
        else:
            stale = (torchrun_file and name != LATEST) or name == CKPT_FILE
            stale = stale or (_GENERATION.fullmatch(name) is not None and name != keep)
        if stale:
            _remove(path)


LOCK = ".shardkit-train.lock"


def lock_out(out_dir: str) -> Optional[IO[str]]:
    """An exclusive lock on ``out_dir`` for the run (rank 0 takes it, before the log or a
    checkpoint is touched): two runs writing to one ``--out`` would replace each other's log and
    remove each other's checkpoints. The returned file holds it until closed (or the process
    ends). None where file locks are not available; a UsageError when another run holds it."""
    try:
        import fcntl
    except ImportError:  # (not POSIX)
        return None
    f = open(os.path.join(out_dir, LOCK), "a", encoding="utf-8")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise UsageError(
            f"--out {out_dir!r}: another run is writing there (it holds {os.path.join(out_dir, LOCK)}); give "
            "another --out, or let that run finish"
        ) from None
    return f


def tidy(ckpt_dir: str, resumed: Optional[str] = None) -> None:
    """What killed saves left in ``ckpt_dir`` beside the checkpoint a resume reads: temporary
    files, and generation folders that neither ``LATEST`` nor ``resumed`` (the folder being
    resumed, which may be an older one given to --resume) names: a save killed before its
    commit, or a clean-up cut short. A resume calls it (rank 0): a resumed run that saves
    nothing more would otherwise keep them for good."""
    latest = generation(ckpt_dir)
    keep = {os.path.basename(p) for p in (latest, resumed) if p is not None}
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return
    for name in names:
        stale_gen = _GENERATION.fullmatch(name) is not None and name not in keep
        if _TEMPORARY.fullmatch(name) or (stale_gen and latest is not None):
            _remove(os.path.join(ckpt_dir, name))


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    except OSError:
        pass
