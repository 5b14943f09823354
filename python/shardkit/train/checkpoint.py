"""Checkpoints of ``python -m shardkit.train``: find, write atomically, read safely, and
restore the run's settings on ``--resume``.

A checkpoint holds only tensors and plain Python types (dicts, lists, tuples, numbers,
strings, None) and is always read with ``torch.load(..., weights_only=True)``: a crafted
file cannot run code, it is refused. It is written to a temporary file in the same
directory, flushed to disk (fsync) and renamed over the previous one, so a write killed
halfway leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch

from shardkit.softmax.shard_files import fsync_directory
from shardkit.train import layout
from shardkit.train.errors import UsageError, cannot_write

if TYPE_CHECKING:
    import argparse

    from shardkit.softmax import ShardedSoftmaxLoss

CKPT_FILE = layout.CKPT_FILE
FORMAT = "shardkit.train/2"

# Settings that define the run (its data, model, loss and data order): restored on resume;
# a flag that contradicts the checkpoint is an error.
FIXED = (
    "data",
    "classes",
    "per_class",
    "image_size",
    "val_classes",
    "val_per_class",
    "backbone",
    "dim",
    "init",
    "margin",
    "scale",
    "m",
    "sample_rate",
    "batch",
    "accumulate",
    "weight_decay",
    "ema",
    "ema_tau",
    "seed",
)
# Restored on resume unless given again, and may be changed then.
CHANGEABLE = ("steps", "epochs", "lr", "amp", "checkpointing")
# Not restored: where and how this process runs.
LOCAL = (
    "devices",
    "deterministic",
    "dp",
    "workers",
    "cache_ram",
    "out",
    "resume",
    "no_progress",
    "eval_every",
    "profile",
)


# The run's history (python -m shardkit.train's per-step records and its evaluations).
HISTORY_KEYS = ("step", "loss", "top1", "img_s", "mem_gib")
EVAL_KEYS = ("step", "raw_acc", "raw_tar", "ema_acc", "ema_tar")


def find(path: str) -> Optional[str]:
    """The directory of the checkpoint to resume at ``path`` or ``path/checkpoint`` (where a
    one-process checkpoint is, or the generation folder of a torchrun one: see
    :mod:`shardkit.train.layout`), else None."""
    for cand in (path, os.path.join(path, "checkpoint")):
        found = layout.newest_file(cand)
        if found is not None:
            return os.path.dirname(found)
    return None


def run_dir(ckpt_dir: str) -> str:
    """The run directory a checkpoint directory belongs to (where a resume writes by default)."""
    ckpt_dir = os.path.normpath(ckpt_dir)
    if layout.is_generation(ckpt_dir):  # <out>/checkpoint/step-...: a torchrun save
        ckpt_dir = os.path.dirname(ckpt_dir) or "."
    if os.path.basename(ckpt_dir) == "checkpoint":
        return os.path.dirname(ckpt_dir) or "."
    return ckpt_dir


def file_for(ckpt_dir: str, world_size: int, rank: int) -> str:
    """This process's checkpoint file; a UsageError when the checkpoint to resume (the newest
    in ``ckpt_dir``) was written by another number of processes (one file for one process,
    ``.rankR`` files under torchrun)."""
    single = os.path.join(ckpt_dir, CKPT_FILE)
    newest = layout.newest_file(ckpt_dir)
    one_process = newest is not None and os.path.basename(newest) == CKPT_FILE
    if world_size == 1:
        if one_process:
            return single
        ranks = len([f for f in os.listdir(ckpt_dir) if f.startswith(CKPT_FILE + ".rank")])
        raise UsageError(
            f"{ckpt_dir} holds a checkpoint of a torchrun run with {ranks} processes; resume it "
            f"with `torchrun --nproc_per_node={ranks} -m shardkit.train --resume {run_dir(ckpt_dir)}`"
        )
    path = os.path.join(os.path.dirname(newest) if newest else ckpt_dir, f"{CKPT_FILE}.rank{rank}")
    if one_process or not os.path.isfile(path):
        what = "a one-process run" if one_process else "a run with fewer processes"
        raise UsageError(
            f"{ckpt_dir} holds a checkpoint of {what} (no {os.path.basename(path)}); resume it with "
            "the same number of processes it was written with"
        )
    return path


def write_atomic(state: Dict[str, Any], path: str) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename over ``path``. A
    write that fails (a full disk, a read-only place) removes the temporary file, keeps the
    previous checkpoint, and is a UsageError naming ``path`` and the reason."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        if isinstance(e, (OSError, RuntimeError)) and not isinstance(e, torch.OutOfMemoryError):
            raise cannot_write(path, e) from None
        raise
    fsync_directory(directory)  # make the rename itself durable


# Files whose CRCs were checked, by (inode, size, mtime, ctime): --resume reads rank 0's file
# twice (its settings while the flags are parsed, then its state); one check of it is enough.
_verified: Dict[str, Tuple[int, ...]] = {}


def verify_archive(path: str, again: str, what: str = "checkpoint") -> None:
    """A UsageError naming ``path`` unless every member of the zip archive ``torch.save``
    wrote matches its CRC32: torch.load does not check them, so a bit flipped on disk or in a
    copy would load silently as a wrong weight. Costs one sequential read of the file (about
    as long as loading it) the first time a file is seen."""
    stat = os.stat(path)
    key = (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if _verified.get(path) == key:
        return
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every member once, the first failing its CRC or None
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception:  # BadZipFile (garbage, truncated, a damaged header), NotImplementedError, ...
        raise UsageError(f"{what} {path} is corrupted (not a readable zip archive); {again}") from None
    if bad is not None:
        raise UsageError(
            f"{what} {path} is corrupted (its member {bad!r} fails its CRC32 check: damaged on disk or in a "
            f"copy); {again}"
        )
    _verified[path] = key


def read(path: str) -> Dict[str, Any]:
    """A checkpoint file's contents (tensors and plain types only); a UsageError naming the
    file for an empty, truncated, corrupted (a CRC mismatch), foreign or unsafe file."""
    again = "resume from another checkpoint, or start a new run without --resume"
    if os.path.getsize(path) == 0:
        raise UsageError(f"checkpoint {path} is empty (0 bytes); {again}")
    verify_archive(path, again)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "GLOBAL" in str(e):
            raise UsageError(
                f"refusing to load {path}: it holds Python objects other than tensors and plain types "
                f"(a shardkit checkpoint never does; loading it could run code); {again}"
            ) from None
        raise UsageError(f"checkpoint {path} is not a readable checkpoint (garbage or truncated); {again}") from None
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception:  # torch's unpickler fails garbage in many ways (EOFError, IndexError on 2.15, ...)
        raise UsageError(f"checkpoint {path} is not a readable checkpoint (garbage or truncated); {again}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"{path} is not a checkpoint of this version of python -m shardkit.train; {again}")
    problem = _malformed(state)
    if problem is not None:
        raise UsageError(f"checkpoint {path} is malformed ({problem}); {again}")
    return state


def _malformed(state: Dict[str, Any]) -> Optional[str]:
    """What is wrong with the layout of a checkpoint's fields (a file of the right format
    edited or damaged by hand), or None. The values of the settings are checked by the
    flag parser (cli), the tensors by the state dicts that load them."""
    step = state.get("step")
    if type(step) is not int or step < 0:
        return f"step {step!r} is not an int >= 0"
    if not isinstance(state.get("args"), dict):
        return "no settings (args)"
    history = state.get("history")
    if not isinstance(history, dict) or not isinstance(history.get("eval"), dict):
        return "history is not a dict of lists"
    if set(history) != set(HISTORY_KEYS) | {"eval"} or set(history["eval"]) != set(EVAL_KEYS):
        return f"history keys {sorted(history)} are not {sorted(HISTORY_KEYS + ('eval',))}"
    lists = [v for k, v in history.items() if k != "eval"] + list(history["eval"].values())
    if not all(isinstance(v, list) for v in lists):
        return "history is not a dict of lists"
    problem = _history_problem(history)
    if problem is not None:
        return f"history {problem}"
    opts = state.get("optimizers")
    if not isinstance(opts, list) or len(opts) != 2 or not all(isinstance(o, dict) for o in opts):
        return "optimizers is not a list of the 2 optimizer states (backbone, head)"
    for key in ("backbone", "rng"):
        if not isinstance(state.get(key), dict):
            return f"no {key} state"
    ema = state.get("ema")
    if (ema is None) != (not state["args"].get("ema")):
        return "its EMA state does not match its --ema setting"
    return None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _history_problem(history: Dict[str, Any]) -> Optional[str]:
    """What is wrong with the values of a history of the right keys (found at resume, not by
    the plot at the end of the run), or None: one entry per step in each per-step list, one
    per evaluation in each evaluation list (none for the EMA of a run without one), numbers
    (the batch top-1 may be None; the peak memory is a list of numbers per step)."""
    ev = history["eval"]
    for lists, what in ((history, "step"), (ev, "evaluation")):
        lengths = {k: len(v) for k, v in lists.items() if k != "eval"}
        n = lengths["step"]
        bad = [k for k, m in lengths.items() if m != n and not (lists is ev and k.startswith("ema_") and m == 0)]
        if bad:
            return f"lists have unequal lengths (one entry per {what}): " + ", ".join(
                f"{k} {lengths[k]}" for k in lengths
            )
    if len(ev["ema_acc"]) != len(ev["ema_tar"]):
        return "lists have unequal lengths: eval ema_acc and ema_tar"
    step_no = (lambda v: type(v) is int and v > 0, "a step number >= 1")
    number = (_number, "a number")
    checks = [
        ("step", history["step"], step_no),
        ("loss", history["loss"], number),
        ("top1", history["top1"], (lambda v: v is None or _number(v), "a number or None")),
        ("img_s", history["img_s"], number),
        (
            "mem_gib",
            history["mem_gib"],
            (lambda v: isinstance(v, list) and v and all(map(_number, v)), "a list of numbers"),
        ),
    ]
    checks += [(f"eval {k}", v, step_no if k == "step" else number) for k, v in ev.items()]
    for name, values, (ok, kind) in checks:
        wrong = next((v for v in values if not ok(v)), _OK)
        if wrong is not _OK:
            return f"{name} holds {wrong!r}, not {kind}"
    return None


_OK = object()


def settings_of(args: argparse.Namespace) -> Dict[str, Any]:
    """The run's settings as plain types (what a checkpoint stores)."""
    out = {k: getattr(args, k) for k in FIXED + CHANGEABLE}
    out["devices"] = [str(d) for d in args.devices]
    return out


def restore_settings(
    args: argparse.Namespace, explicit: Set[str], saved: Dict[str, Any], where: str, data_recorded: bool = False
) -> None:
    """Fill ``args`` from a checkpoint's settings: a FIXED flag given with another value than
    the checkpoint's is a UsageError naming both; CHANGEABLE flags keep the value given.
    ``data_recorded``: the checkpoint records what its --data held (its folder may then move)."""
    for key in FIXED:
        value = saved.get(key)
        flag = "--" + key.replace("_", "-")
        given = getattr(args, key)
        if key == "data" and isinstance(given, str) and isinstance(value, str):
            if key in explicit and data_recorded and os.path.isdir(given):  # moved or mounted elsewhere: its
                continue  # contents are checked against the checkpoint's record when the run is built
            same = os.path.realpath(given) == os.path.realpath(value)  # data/ and ./data are one folder
        else:
            same = given == value
        if key in explicit and not same:
            raise UsageError(
                f"{flag} {getattr(args, key)} contradicts the checkpoint in {where}, which was trained with "
                f"{flag} {value}; drop {flag} to continue that run (the flags that may change on resume are "
                f"listed in --help), or start a new run with another --out"
            )
        setattr(args, key, value)
        if key == "data" and isinstance(value, str) and not os.path.isdir(value):
            raise UsageError(
                f"--data {value!r}, the checkpoint's, is not a directory any more: give --data with the folder's "
                "new place (its class folders and images must be the same)"
            )
    for key in CHANGEABLE:
        if key == "steps" and "epochs" in explicit:
            continue  # --epochs given on resume sets the length (a run saved with --steps said so)
        if key not in explicit and key in saved:
            setattr(args, key, saved[key])


def head_optimizer_state(opt: torch.optim.Optimizer, head: ShardedSoftmaxLoss) -> Dict[str, Any]:
    """The head optimizer's (SparseRowSGD) state in class order, whatever the shard count: the
    shards' [rows, D] momentum buffers and [rows] flags of rows whose momentum has started,
    listed in class order (the tensors themselves, no copy; a shard never stepped: zeros and
    False, which is what a fresh buffer means). A resume cuts them along its own shards
    (--devices, --dp and --pipeline may change)."""
    order = sorted(range(len(head.weight_shards)), key=lambda k: head.class_offsets[k])
    bufs, seen = [], []
    for k in order:
        p = head.weight_shards[k]
        st = opt.state.get(p, {})
        buf = st.get("momentum_buffer")
        bufs.append(buf.detach() if buf is not None else torch.zeros(p.shape, dtype=p.dtype))
        flags = st.get("seen")
        seen.append(flags if flags is not None else torch.zeros(p.shape[0], dtype=torch.bool))
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    return {"class_ordered": True, "momentum_buffer": bufs, "seen": seen, "group": group}


def _rows(parts: List[torch.Tensor], start: int, n: int) -> torch.Tensor:
    """Rows [start, start + n) of the class-ordered concatenation of ``parts`` (one copy)."""
    out, at = [], 0
    for t in parts:
        lo, hi = max(start, at), min(start + n, at + t.shape[0])
        if lo < hi:
            out.append(t[lo - at : hi - at].cpu())
        at += t.shape[0]
    return torch.cat(out) if out else parts[0][:0].cpu()


def load_head_optimizer_state(opt: torch.optim.Optimizer, head: ShardedSoftmaxLoss, saved: Dict[str, Any]) -> None:
    """Restore :func:`head_optimizer_state`'s output (or a torchrun rank's own optimizer state
    dict, whose shard is fixed by the world size) into ``opt`` over ``head``'s shards."""
    if not saved.get("class_ordered"):
        opt.load_state_dict(saved)
        return
    bufs, seen, group = saved.get("momentum_buffer"), saved.get("seen"), saved.get("group")
    C, D = sum(head.shard_sizes), head.weight_shards[0].shape[1]
    if not (
        isinstance(bufs, list)
        and isinstance(seen, list)
        and all(isinstance(t, torch.Tensor) for t in bufs + seen)
        and bufs
        and all(t.dim() == 2 and t.shape[1] == D for t in bufs)
    ):
        raise ValueError(f"the head's momentum is not a list of [rows, {D}] tensors")
    if sum(t.shape[0] for t in bufs) != C or sum(t.numel() for t in seen) != C or not isinstance(group, dict):
        raise ValueError(f"the head optimizer's state does not hold {C} classes")
    state = {}
    for k, (p, off) in enumerate(zip(head.weight_shards, head.class_offsets)):
        n = p.shape[0]
        state[k] = {"momentum_buffer": _rows(bufs, off, n), "seen": _rows(seen, off, n)}
    opt.load_state_dict({"state": state, "param_groups": [dict(group, params=list(range(len(state))))]})


def check_optimizer_state(opt: torch.optim.Optimizer, which: str) -> None:
    """The momentum each parameter's state holds after ``opt.load_state_dict``: a finite
    tensor of the parameter's shape. ``load_state_dict`` takes any tensor there; a damaged one
    failed only at the next ``step`` (a broadcast error's traceback) or, when not finite,
    turned the weights NaN: a ValueError naming ``which`` optimizer instead."""
    for group in opt.param_groups:
        for k, p in enumerate(group["params"]):
            buf = opt.state.get(p, {}).get("momentum_buffer")
            if buf is None:
                continue
            if not isinstance(buf, torch.Tensor) or buf.layout != torch.strided or buf.shape != p.shape:
                shape = tuple(buf.shape) if isinstance(buf, torch.Tensor) else type(buf).__name__
                raise ValueError(f"the {which} optimizer's momentum of parameter {k} is {shape}, not {tuple(p.shape)}")
            if not bool(torch.isfinite(buf).all()):
                raise ValueError(f"the {which} optimizer's momentum of parameter {k} holds NaN or infinite values")
