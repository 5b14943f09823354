"""The trainer's checks of a run's settings, before anything is built from them: every
flag's combination with the others and with this machine (devices, memory, the output
folder), and the settings a checkpoint brings on --resume. Each failure is a UsageError
(one line, exit status 2)."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Dict, Optional, Tuple

import torch

from shardkit.train import checkpoint
from shardkit.train.argtypes import (
    MAX_PROFILE_STEPS,
    MAX_SEED,
    MIN_IMAGE_SIZE,
    _activations_misfit,
    _head_misfit,
    _held_out_bytes,
    _max_workers,
    _ram_bytes,
    _train_index_bytes,
)
from shardkit.train.errors import UsageError


def check_args(a: argparse.Namespace) -> None:
    """Every check of a run's parsed (and, on --resume, restored) settings; fills the
    defaults that depend on others (--devices, --m, --amp none -> None)."""
    if a.data is not None and not os.path.isdir(a.data):
        raise UsageError(f"--data {a.data!r} is not a directory; give a folder of class subfolders of images")
    if a.devices is None:
        a.devices = [torch.device("cuda", 0)] if torch.cuda.is_available() else [torch.device("cpu")]
    for dev in a.devices:
        if dev.type not in ("cpu", "cuda"):
            raise UsageError(f"--devices: only cpu and cuda devices are supported, got {dev}")
        if dev.type == "cuda" and (not torch.cuda.is_available() or dev.index >= torch.cuda.device_count()):
            raise UsageError(f"--devices: {dev} is not available on this machine; use cpu or a visible GPU")
    if a.m is None:
        a.m = {"arcface": 0.3, "cosface": 0.25, "none": 0.0}[a.margin]
    if a.margin != "none" and not 0 <= a.m < math.pi:
        raise UsageError(f"--m must be in [0, pi), got {a.m}")
    if a.margin == "none" and a.m != 0:
        raise UsageError(f"--m {a.m:g} has no effect with --margin none; drop it or pick a margin")
    if a.cache_ram != "none" and a.data is None:
        raise UsageError(f"--cache-ram {a.cache_ram} caches the images of --data; the synthetic data needs no cache")
    if a.amp == "none":
        a.amp = None
    if a.amp == "fp16" and all(d.type == "cpu" for d in a.devices):
        raise UsageError("--amp fp16 needs a CUDA device; use --amp bf16 on the CPU")
    if not 0 <= a.ema < 1:
        raise UsageError(f"--ema must be in [0, 1), got {a.ema}")
    if not 0 <= a.profile <= MAX_PROFILE_STEPS:
        raise UsageError(
            f"--profile must be in [0, {MAX_PROFILE_STEPS}] (steps to time; a few dozen show where the time "
            f"goes), got {a.profile}"
        )
    if a.profile and a.resume:
        raise UsageError("--profile measures a fresh run; drop --resume (or --profile)")
    if a.eval_every is not None and a.eval_every < 0:
        raise UsageError(f"--eval-every must be >= 0, got {a.eval_every}")
    if a.pipeline and a.dp:
        raise UsageError("--pipeline and --dp are two ways to use --devices; pick one")
    if a.pipeline and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--pipeline runs in one process; launch it without torchrun")
    if a.dp and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Each rank has one device under torchrun, and the backbone would not be wrapped in DDP:
        # every rank would train a backbone of its own.
        raise UsageError(
            "--dp runs in one process over --devices; under torchrun each rank has one device and the "
            "backbone is data-parallel through DDP already: drop --dp"
        )
    if a.chunks < 1:
        raise UsageError(f"--chunks must be >= 1, got {a.chunks}")
    if not 0 <= a.workers <= _max_workers():
        raise UsageError(f"--workers must be in [0, {_max_workers()}], got {a.workers}")
    if not 0 <= a.seed <= MAX_SEED:
        raise UsageError(f"--seed must be in [0, 2**63 - 1], got {a.seed}")
    if a.image_size < MIN_IMAGE_SIZE:
        raise UsageError(f"--image-size must be >= {MIN_IMAGE_SIZE}, got {a.image_size}")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise UsageError(f"--out {a.out!r} is a file; give a directory (a new one or an earlier run's)")
    parent = os.path.dirname(os.path.abspath(a.out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"--out {a.out!r}: {parent!r} is a file, not a directory; give another --out")
    if a.val_per_class < 2 or a.val_classes < 2:
        raise UsageError("--val-classes and --val-per-class must be >= 2 (verification needs pairs)")
    if a.data is None and a.classes < 2:
        raise UsageError(
            f"--classes must be >= 2, got {a.classes} (a softmax over one class has loss 0: nothing to learn)"
        )
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    _check_batch_norm_pieces(a, world_size)
    for name, want_dir in (("checkpoint", True), ("log.txt", False), ("curves.png", False)):
        path = os.path.join(a.out, name)
        if os.path.exists(path) and os.path.isdir(path) != want_dir:
            kind = "a file" if want_dir else "a directory"
            raise UsageError(
                f"--out {a.out!r}: {path!r} is {kind}, where the run writes its {name}; give another --out"
            )
    misfit = None if a.data is not None else _head_misfit(a, world_size)
    misfit = misfit or _activations_misfit(a, world_size)
    if misfit is not None:
        raise UsageError(misfit)
    ram = _ram_bytes()
    if a.data is None and ram is not None and _train_index_bytes(a) > ram // 2:
        raise UsageError(
            f"--classes {a.classes} x --per-class {a.per_class} training images: an epoch's shuffled order alone "
            f"needs {_train_index_bytes(a) / 2**30:.3g} GiB of RAM, this machine has {ram / 2**30:.3g} GiB; "
            "lower --per-class"
        )
    if a.data is None and ram is not None and _held_out_bytes(a) > ram:
        raise UsageError(
            f"--val-classes {a.val_classes} x --val-per-class {a.val_per_class}: the held-out images and their "
            f"genuine pairs need over {_held_out_bytes(a) / 2**30:.3g} GiB of RAM, this machine has "
            f"{ram / 2**30:.3g} GiB; lower --val-per-class"
        )


def check_saved_settings(parser: argparse.ArgumentParser, saved: Dict[str, Any], path: str) -> None:
    """A checkpoint's settings must be what the flags parse to: the type, range and choices of
    each flag (a file edited by hand that says ``classes: "16"`` or ``batch: 0`` is refused
    here, naming the setting, before anything is built from it)."""
    actions = {a.dest: a for a in parser._actions}
    for key in checkpoint.FIXED + checkpoint.CHANGEABLE:
        if key not in saved:
            if key in checkpoint.FIXED:
                raise UsageError(f"checkpoint {path} is malformed (no {key} setting); start a new run without --resume")
            continue
        value, act = saved[key], actions[key]
        if value is None:
            ok = act.default is None or key in ("amp", "m")  # --amp none is kept as None, --m's default too
        elif isinstance(act, argparse._StoreTrueAction):
            ok = isinstance(value, bool)
        elif act.choices is not None:
            ok = isinstance(value, str) and value in act.choices
        elif isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                parsed: object
                if act.type is None:
                    parsed = str(value)
                elif callable(act.type):
                    parsed = act.type(str(value))
                else:  # a type given by name (argparse.FileType aside, none of the trainer's)
                    raise TypeError(f"flag type {act.type!r}")
                ok = type(parsed) is type(value) and parsed == value
            except (argparse.ArgumentTypeError, ValueError, TypeError):
                ok = False
        else:
            ok = False
        if not ok:
            flag = "--" + key.replace("_", "-")
            raise UsageError(
                f"checkpoint {path} is malformed: its {flag} is {value!r}, which that flag does not accept; "
                "start a new run without --resume"
            )


BATCH_NORM_WARN_BELOW = 8  # images per BatchNorm forward below which the run is warned about


def batch_norm_piece(a: argparse.Namespace, world_size: int) -> Tuple[int, str, str]:
    """(the fewest images one BatchNorm forward of the backbone sees, where they come from,
    "dp" | "pipeline" | "batch"): per device under --dp, per micro-batch under --pipeline, per
    batch otherwise (--batch is per process under torchrun; --accumulate runs --batch images
    per forward)."""
    n = len(a.devices) if world_size == 1 else 1
    if a.dp and n > 1:
        return a.batch // n, f"--batch {a.batch} over {n} devices (--dp)", "dp"
    if a.pipeline:
        chunks = min(a.chunks, a.batch)
        return a.batch // chunks, f"--batch {a.batch} in --chunks {a.chunks} micro-batches (--pipeline)", "pipeline"
    return a.batch, f"--batch {a.batch}", "batch"


def batch_norm_warning(a: argparse.Namespace, world_size: int) -> Optional[str]:
    """A warning when BatchNorm normalizes too few images at once to train well, else None:
    its batch statistics are then mostly noise (with 2 images every channel normalizes to
    about -1 and +1) and what evaluation uses, the running statistics, differs from what
    training saw; such runs often diverge."""
    images, source, kind = batch_norm_piece(a, world_size)
    if images >= BATCH_NORM_WARN_BELOW:
        return None
    return (
        f"{source} gives BatchNorm {images} images per forward; its statistics of fewer than "
        f"{BATCH_NORM_WARN_BELOW} images are mostly noise (with 2, every channel becomes about -1 or +1) and training "
        f"can diverge: give it {BATCH_NORM_WARN_BELOW} or more (a larger --batch"
        + {"pipeline": ", fewer --chunks", "dp": ", fewer --devices"}.get(kind, "")
        + "; --accumulate adds images per step, not per forward)"
    )


def _check_batch_norm_pieces(a: argparse.Namespace, world_size: int) -> None:
    """The backbone's BatchNorm layers need 2 images in every piece of a batch a forward
    sees (see :func:`batch_norm_piece`)."""
    images, source, kind = batch_norm_piece(a, world_size)
    if images >= 2:
        return
    if kind == "dp":
        raise UsageError(
            f"{source} leaves {images} image(s) on a device; BatchNorm needs 2: use --batch {2 * len(a.devices)} "
            "or more"
        )
    if kind == "pipeline":
        raise UsageError(
            f"{source} leaves {images} image(s) in one; BatchNorm needs 2: use fewer --chunks or "
            f"--batch {2 * a.chunks} or more"
        )
    raise UsageError(f"--batch {a.batch}: BatchNorm needs 2 images per batch; use --batch 2 or more")
