"""Saving and restoring a ``python -m shardkit.train`` run: the checkpoint of everything a
resume needs (written atomically, never from a diverged run) and its restore, checked."""

from __future__ import annotations

import os
import random
import re
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import shardkit
from shardkit.softmax.optim import _check_hyperparameters
from shardkit.train import checkpoint, layout, report
from shardkit.train.errors import UsageError, cannot_write
from shardkit.train.setup import Parts
from shardkit.train.world import World

CKPT_FILE = checkpoint.CKPT_FILE


def diverged(parts: Parts) -> Optional[str]:
    """What shows the run diverged, else None: weights holding a NaN or an infinity
    (:func:`non_finite_state`), or finite weights whose evaluation-mode embeddings of a few
    held-out images do (two small forwards)."""
    bad = non_finite_state(parts)
    if bad is not None:
        return f"the weights hold NaN or infinite values: {bad}"
    model = report.non_finite_embeddings(parts)
    if model is not None:
        return f"the {model} backbone's embeddings of held-out images are NaN or infinite"
    return None


def non_finite_state(parts: Parts) -> Optional[str]:
    """The name of the first floating tensor of the run's weights (backbone parameters and
    buffers, head shards, EMA) holding a NaN or an infinity, else None: what a checkpoint must
    not be written from. One device-to-host copy per device (a pass over the weights, cheap
    beside writing them); the names are looked for only when something is wrong."""
    named = [(f"backbone {k}", t) for k, t in parts.backbone.state_dict().items()]
    named += [(f"head shard {k}", w.detach()) for k, w in enumerate(parts.head.weight_shards)]
    if parts.ema is not None:
        named += [(f"EMA {k}", t) for k, t in parts.ema.module.state_dict().items()]
    named = [(name, t) for name, t in named if t.is_floating_point() and t.numel()]
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for _, t in named:
        by_device.setdefault(t.device, []).append(torch.isfinite(t).all())
    if all(bool(torch.stack(flags).all()) for flags in by_device.values()):
        return None
    return next(name for name, t in named if not bool(torch.isfinite(t).all()))


def save_checkpoint(ckpt_dir: str, parts: Parts, step: int, history: Dict[str, Any], world: World) -> None:
    """Everything a resume needs, as tensors and plain types, written atomically. The head's
    weight is shard-agnostic (one class-ordered weight; under torchrun, one file per rank via
    shardkit.save_sharded)."""
    rank_sfx = f".rank{world.rank}" if world.size > 1 else ""
    state = {
        "format": checkpoint.FORMAT,
        "step": step,
        "world_size": world.size,
        "history": history,
        "backbone": parts.backbone.state_dict(),
        "optimizers": [
            parts.optimizers[0].state_dict(),
            # one process: in class order, so a resume may shard the head differently
            checkpoint.head_optimizer_state(parts.optimizers[1], parts.head)
            if world.size == 1
            else parts.optimizers[1].state_dict(),
        ],
        "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
        "ema": parts.ema.state_dict() if parts.ema is not None else None,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "args": checkpoint.settings_of(parts.args),
        "data": parts.data_fingerprint,
    }
    if world.size == 1:
        state["head"] = parts.head.state_dict()
        checkpoint.write_atomic(state, os.path.join(ckpt_dir, CKPT_FILE))
        layout.remove_others(ckpt_dir, keep=None)  # an earlier torchrun run's files
        return
    # Every rank's files into a new generation folder, named in LATEST once all are written
    # (shardkit.train.layout): a save killed halfway leaves the previous one complete.
    name = layout.generation_name(step, _agreed_nonce(world))
    gen = os.path.join(ckpt_dir, name)
    failed = None
    try:
        os.makedirs(gen, exist_ok=True)
        # tagged with the step: a resume refuses head files of another save than this file's
        shardkit.save_sharded(parts.head, os.path.join(gen, "head"), tag=step)
        state["head_tag"] = step
        checkpoint.write_atomic(state, os.path.join(gen, CKPT_FILE + rank_sfx))
    except Exception as e:  # every rank learns of it below, and none commits
        failed = e
    if _any_rank(world, failed is not None):
        if isinstance(failed, OSError):  # a read-only place, a full disk: one line, as one process says it
            raise cannot_write(gen, failed) from None
        if failed is not None:
            raise failed
        raise UsageError(f"another rank could not write its checkpoint files into {gen}; {ckpt_dir} keeps the last one")
    if world.rank == 0:
        try:
            layout.commit(ckpt_dir, name)
        except OSError as e:
            raise cannot_write(os.path.join(ckpt_dir, layout.LATEST), e) from None


def _agreed_nonce(world: World) -> int:
    """One random draw of rank 0's, the same on every rank (the generation's name)."""
    nonce = torch.tensor([int.from_bytes(os.urandom(4), "little")], dtype=torch.int64, device=world.device)
    if dist.is_initialized():
        dist.broadcast(nonce, src=0)
    return int(nonce.item())


def _any_rank(world: World, flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (one all-reduce)."""
    t = torch.tensor([1.0 if flag else 0.0], device=world.device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


_SHARD_FILE = re.compile(r"classes-(\d{12})-(\d{12})\.pt")  # shardkit.save_sharded's file names


def _verify_head_files(directory: str, parts: Parts) -> None:
    """The CRCs of the head's shard files this rank reads (those overlapping its classes),
    as :func:`checkpoint.verify_archive` checks the main file: one extra read of them."""
    again = "resume from another checkpoint, or start a new run without --resume"
    mine = [(o, o + w.shape[0]) for o, w in zip(parts.head.class_offsets, parts.head.weight_shards)]
    names = os.listdir(directory) if os.path.isdir(directory) else []  # (load_sharded says it is missing)
    for name in sorted(names):
        m = _SHARD_FILE.fullmatch(name)
        if m and any(int(m.group(1)) < end and start < int(m.group(2)) for start, end in mine):
            checkpoint.verify_archive(os.path.join(directory, name), again, "head shard file")


def _check_head_tag(directory: str, tag: Optional[int], path: str) -> None:
    """The head's shard files come from the save that wrote ``path`` (a save interrupted
    between the head's files and the rank files would mix two steps)."""
    if tag is None or not os.path.isdir(directory):
        return  # a checkpoint written before the tags (or no head files: load_sharded says so)
    found = shardkit.softmax.checkpoint.save_id_of(directory)
    if found != tag:
        raise UsageError(
            f"checkpoint {path} is of step {tag} but its head's shard files in {directory} are of "
            f"{'step ' + str(found) if found is not None else 'another save'} (a save interrupted between "
            "them?); resume from another checkpoint, or start a new run without --resume"
        )


def _check_same_data(saved: Any, now: Optional[Dict[str, Any]], data: Optional[str], path: str) -> None:
    """--data must hold what it held when the checkpoint was written (the labels, the batches
    and the head's rows follow from its class folders and their images); a checkpoint of an
    earlier version holds no record of it (None): not checked."""
    if not isinstance(saved, dict) or now is None or saved == now:
        return
    then = f"{saved.get('classes')} class folders and {saved.get('images')} images"
    here = f"{now['classes']} and {now['images']}"
    if (saved.get("classes"), saved.get("images")) == (now["classes"], now["images"]):
        here += " (the same counts, but other class folders or images per class)"
    raise UsageError(
        f"--data {data!r} has changed since checkpoint {path} was written: it held {then}, now {here}; a resume "
        "continues on the same images (its labels and batches follow from them): restore the folder, or start a "
        "new run without --resume"
    )


def load_checkpoint(ckpt_dir: str, parts: Parts, world: World) -> Tuple[int, Dict[str, Any]]:
    """Restore a checkpoint into ``parts``; returns (step, history). A UsageError for a file
    that is unreadable, unsafe, or does not fit the model built from the restored settings."""
    path = checkpoint.file_for(ckpt_dir, world.size, world.rank)
    state = checkpoint.read(path)
    saved_world = state.get("world_size", world.size)
    if saved_world != world.size:  # (fewer ranks than wrote it find their files too)
        how = "one process" if saved_world == 1 else f"torchrun --nproc_per_node={saved_world}"
        raise UsageError(
            f"checkpoint {path} was written by {saved_world} process(es), this run has {world.size}; resume it "
            f"with the same number ({how}), as the head's optimizer state is saved per rank"
        )
    _check_same_data(state.get("data"), parts.data_fingerprint, parts.args.data, path)
    built = _settings(parts)  # what this run's flags (and the checkpoint's settings) give
    try:
        parts.backbone.load_state_dict(state["backbone"])
        if world.size > 1:
            _verify_head_files(os.path.join(ckpt_dir, "head"), parts)
            _check_head_tag(os.path.join(ckpt_dir, "head"), state.get("head_tag"), path)
            shardkit.load_sharded(parts.head, os.path.join(ckpt_dir, "head"))
        else:
            parts.head.load_state_dict(state["head"])
        parts.optimizers[0].load_state_dict(state["optimizers"][0])
        checkpoint.load_head_optimizer_state(parts.optimizers[1], parts.head, state["optimizers"][1])
        for opt, which in zip(parts.optimizers, ("backbone", "head")):
            checkpoint.check_optimizer_state(opt, which)
        if parts.scaler is not None and state["scaler"] is not None:
            parts.scaler.load_state_dict(state["scaler"])
        if parts.ema is not None and state["ema"] is not None:
            parts.ema.load_state_dict(state["ema"])
        _check_settings(built, _settings(parts), path)
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
    except (RuntimeError, KeyError, ValueError, TypeError, AttributeError, IndexError) as e:
        # every line: load_state_dict's first one only says "Error(s) in loading state_dict for X:"
        said = " ".join(line.strip() for line in str(e).strip().splitlines() if line.strip()) or type(e).__name__
        said = said if len(said) <= 600 else said[:600] + " ..."
        raise UsageError(
            f"checkpoint {path} does not fit this run ({said}); resume it with the version of "
            "shardkit that wrote it, or start a new run without --resume"
        ) from None
    bad = diverged(parts)
    if bad is not None:  # written by a diverged run (this version never saves one)
        raise UsageError(
            f"checkpoint {path} is of a diverged run ({bad}): there is nothing to resume; start a new run "
            "(with a lower --lr) without --resume"
        )
    return state["step"], state["history"]


# What a checkpoint's optimizer and EMA states carry besides tensors: the trainer builds them
# from its settings (--weight-decay, --ema, --ema-tau; momentum 0.9), so a resume must find
# the same values there (the learning rate is set at every step, from --lr).
_GROUP_KEYS = ("momentum", "dampening", "weight_decay", "nesterov", "maximize")
_EMA_KEYS = ("decay", "tau", "warmup_gamma", "warmup_power", "min_decay", "update_after_step", "update_every")


_Settings = Dict[Tuple[str, int, str], Any]  # (optimizer or "EMA", param group, name): value


def _settings(parts: Parts) -> _Settings:
    """The hyper-parameters of the run's optimizers' param groups and of its EMA, by name."""
    out: _Settings = {}
    for opt, which in zip(parts.optimizers, ("backbone", "head")):
        for k, group in enumerate(opt.param_groups):
            out.update({(which, k, key): group.get(key) for key in _GROUP_KEYS + ("lr",)})
    if parts.ema is not None:
        out.update({("EMA", 0, key): getattr(parts.ema, key, None) for key in _EMA_KEYS})
    return out


def _check_settings(built: _Settings, loaded: _Settings, path: str) -> None:
    """A UsageError naming the first hyper-parameter a checkpoint's optimizer or EMA state
    brings that is invalid (momentum outside [0, 1), a negative weight decay: what
    SparseRowSGD refuses for the head, checked for the backbone's torch.optim.SGD too) or
    differs from what this run's settings build (a hand-edited ``ema.decay`` would otherwise
    override --ema silently, as the checkpoint's own --ema setting says otherwise)."""
    for which, k in dict.fromkeys((w, k) for w, k, _ in loaded if w != "EMA"):
        try:
            _check_hyperparameters(
                {name: loaded[(which, k, name)] for name in _GROUP_KEYS[:4] + ("lr",)},
                f"the {which} optimizer's param group {k}: ",
            )
        except (TypeError, ValueError) as e:
            raise UsageError(f"checkpoint {path} is malformed ({e}); {_AGAIN}") from None
    for (which, k, key), value in loaded.items():
        want = built.get((which, k, key))
        if key == "lr" or value is want or (value == want and isinstance(value, bool) == isinstance(want, bool)):
            continue
        name = "EMA" if which == "EMA" else f"{which} optimizer's param group {k}"
        flag = f" (from {_FLAG[key]})" if key in _FLAG and (which, k) != ("backbone", 1) else ""
        raise UsageError(
            f"checkpoint {path} is malformed (its {name} has {key} {value!r}, not the {want!r} this run's "
            f"settings give{flag}); {_AGAIN}"
        )


_FLAG = {"weight_decay": "--weight-decay", "decay": "--ema", "tau": "--ema-tau"}
_AGAIN = "resume from another checkpoint, or start a new run without --resume"
