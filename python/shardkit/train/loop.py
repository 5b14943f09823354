"""The training loop behind ``python -m shardkit.train`` (see :mod:`shardkit.train`)."""

from __future__ import annotations

import math
import os
import random
import resource
import signal
import time
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from shardkit.train import report as report_mod
from shardkit.train import setup

CKPT_FILE = setup.CKPT_FILE


@dataclass
class World:
    size: int = 1
    rank: int = 0
    device: Optional[torch.device] = None


def init_distributed(args) -> World:
    """Under torchrun (WORLD_SIZE > 1): join the process group; one device per rank."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    args.devices = [dev]
    return World(size, rank, dev)


def find_checkpoint(path: str) -> Optional[str]:
    """The checkpoint directory at ``path`` or ``path/checkpoint`` (a one-process checkpoint,
    or the rank-0 file of a torchrun one), else None."""
    for cand in (path, os.path.join(path, "checkpoint")):
        if any(os.path.isfile(os.path.join(cand, CKPT_FILE + sfx)) for sfx in ("", ".rank0")):
            return cand
    return None


def _peak_memory(devices: List[torch.device]) -> str:
    parts = []
    for dev in dict.fromkeys(devices):
        if dev.type == "cuda":
            parts.append(f"{dev}:{torch.cuda.max_memory_allocated(dev) / 2**30:.2f}G")
        else:  # the process's peak resident set: the CPU has no per-device allocator statistics
            parts.append(f"cpu(rss):{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f}G")
    return " ".join(parts)


def _lr_at(step: int, total: int, base: float) -> float:
    """Linear warm-up over 5% of the steps, then cosine to 0: a pure function of the step, so
    resuming needs no scheduler state."""
    warm = max(1, total // 20)
    if step < warm:
        return base * (step + 1) / warm
    return base * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


class _Interrupted(Exception):
    pass


def run(args, world: World) -> int:
    lead = world.rank == 0
    torch.manual_seed(args.seed + world.rank)
    random.seed(args.seed)
    parts = setup.build(args, world)
    steps_per_epoch = len(parts.train_set) // (args.batch * world.size * args.accumulate)
    if steps_per_epoch < 1:
        raise SystemExit(
            f"error: the training set ({len(parts.train_set)} images) is smaller than one step's "
            f"batch ({args.batch} x {world.size} ranks x {args.accumulate} micro-batches)"
        )
    total = args.steps or steps_per_epoch * args.epochs
    history = {"step": [], "loss": [], "top1": []}
    start = 0
    if args.resume:
        start, history = setup.load_checkpoint(find_checkpoint(args.resume), parts, world)
        if lead:
            print(f"resumed from {args.resume} at step {start}")
    ckpt_dir = os.path.join(args.out, "checkpoint")
    os.makedirs(ckpt_dir, exist_ok=True)

    # Ctrl-C: finish the current step, then save a resumable checkpoint.
    stop = {"flag": False}
    old_handler = signal.getsignal(signal.SIGINT)

    def on_sigint(signum, frame):
        if stop["flag"]:  # a second Ctrl-C stops at once
            signal.signal(signal.SIGINT, old_handler)
            raise KeyboardInterrupt
        stop["flag"] = True

    signal.signal(signal.SIGINT, on_sigint)
    bar = report_mod.Progress(total, start, enabled=lead, bar=not args.no_progress)
    t_last, img_since = time.perf_counter(), 0
    step = start
    try:
        for step in range(start, total):
            loss, top1 = train_step(parts, args, step, steps_per_epoch, total, world)
            history["step"].append(step + 1)
            history["loss"].append(loss)
            history["top1"].append(top1)
            img_since += args.batch * args.accumulate * world.size
            if lead:
                now = time.perf_counter()
                rate = img_since / max(now - t_last, 1e-9)
                stats = {"loss": f"{loss:.3f}", "img/s": f"{rate:.0f}", "mem": _peak_memory(parts.devices)}
                if top1 is not None:
                    stats["top1"] = f"{100 * top1:.1f}%"
                bar.set(step + 1, stats)
                if now - t_last > 2:
                    t_last, img_since = now, 0
            if (step + 1) % steps_per_epoch == 0 or step + 1 == total:
                setup.save_checkpoint(ckpt_dir, parts, step + 1, history, world)
            if stop["flag"]:
                raise _Interrupted
    except _Interrupted:
        setup.save_checkpoint(ckpt_dir, parts, step + 1, history, world)
        bar.close()
        if lead:
            print(
                f"\ninterrupted: checkpoint of step {step + 1} saved in {ckpt_dir}; continue with --resume {ckpt_dir}"
            )
        return 130
    finally:
        signal.signal(signal.SIGINT, old_handler)
    bar.close()
    report = report_mod.evaluate(parts, args, world)
    if lead:
        report_mod.print_report(report, history, args)
        report_mod.plot(history, report, os.path.join(args.out, "curves.png"))
        print(f"checkpoint: {ckpt_dir}   plot: {os.path.join(args.out, 'curves.png')}")
    return 0


def train_step(parts, args, step: int, steps_per_epoch: int, total: int, world: World):
    """One optimizer step over ``args.accumulate`` micro-batches; returns (loss, top-1 or None)."""
    lr = _lr_at(step, total, args.lr)
    for opt in parts.optimizers:
        for g in opt.param_groups:
            g["lr"] = lr
    parts.backbone_train.train()
    loss_sum, correct, valid = 0.0, 0, 0
    for micro in range(args.accumulate):
        images, labels = parts.batches.get(step * args.accumulate + micro, steps_per_epoch * args.accumulate)
        with parts.autocast():
            x = parts.normalize(images.to(parts.devices[0], non_blocking=True))
            emb = parts.backbone_train(x)
        labels = labels.to(parts.devices[0], non_blocking=True)
        if args.dp:
            loss = parts.criterion(emb, labels)
            top = None
        else:
            out = parts.head(emb.float() if args.amp == "fp16" else emb, labels, return_details=True, topk=(1,))
            loss, top = out.loss, out
        scaled = loss / args.accumulate
        parts.scaler.scale(scaled).backward() if parts.scaler is not None else scaled.backward()
        loss_sum += float(loss.detach())
        if top is not None:
            correct += int(top.correct[1])
            valid += int(top.num_valid)
    for opt in parts.optimizers:
        if parts.scaler is not None:
            parts.scaler.step(opt)
        else:
            opt.step()
    if parts.scaler is not None:
        parts.scaler.update()
    for opt in parts.optimizers:
        opt.zero_grad(set_to_none=True)
    if parts.ema is not None:
        parts.ema.update(parts.backbone)
    return loss_sum / args.accumulate, (correct / valid if valid else None)
