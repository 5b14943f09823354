"""The training loop behind ``python -m shardkit.train`` (see :mod:`shardkit.train`)."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import resource
import signal
import time
from types import FrameType
from typing import Any, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shardkit.softmax import NonFiniteEmbeddingsError, ShardedLossOutput
from shardkit.train import checkpoint, header, layout, plots, resume, setup
from shardkit.train import report as report_mod
from shardkit.train.errors import UsageError
from shardkit.train.log import RunLog
from shardkit.train.world import World

CKPT_FILE = checkpoint.CKPT_FILE


def _peak_gib(devices: List[torch.device]) -> List[float]:
    """Peak memory of each distinct device, GiB (the CPU: the process's peak resident set, as
    the CPU has no per-device allocator statistics)."""
    out = []
    for dev in dict.fromkeys(devices):
        if dev.type == "cuda":
            out.append(torch.cuda.max_memory_allocated(dev) / 2**30)
        else:
            out.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    return out


def _peak_memory(devices: List[torch.device]) -> str:
    names = [f"{d}:" if d.type == "cuda" else "cpu(rss):" for d in dict.fromkeys(devices)]
    return " ".join(f"{n}{g:.2f}G" for n, g in zip(names, _peak_gib(devices)))


def new_history() -> Dict[str, Any]:
    """Per step: loss, batch top-1, images/s, peak GiB per device; every --eval-every steps and
    at the end: held-out verification of the raw and EMA backbones."""
    return dict({k: [] for k in checkpoint.HISTORY_KEYS}, eval={k: [] for k in checkpoint.EVAL_KEYS})


def _record_eval(history: Dict[str, Any], step: int, results: Dict[str, Tuple[float, float]]) -> None:
    ev = history["eval"]
    ev["step"].append(step)
    for name, (acc, tar) in results.items():
        ev[f"{name}_acc"].append(acc)
        ev[f"{name}_tar"].append(tar)


def _lr_at(step: int, total: int, base: float) -> float:
    """Linear warm-up over 5% of the steps, then cosine to 0: a pure function of the step, so
    resuming needs no scheduler state."""
    warm = max(1, total // 20)
    if step < warm:
        return base * (step + 1) / warm
    return base * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


class _Interrupted(Exception):
    pass


def set_deterministic() -> None:
    """Bit-for-bit repeatable GPU steps (--deterministic): cuDNN's deterministic algorithms and
    no autotuning, cuBLAS with a fixed workspace, and torch's deterministic mode (warning, not
    failing, where an op has no deterministic kernel). shardkit's own kernels use no atomics
    and are deterministic already. The CPU path is deterministic without it."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def run(args: argparse.Namespace, world: World) -> int:
    ckpt = os.path.join(args.out, "checkpoint")
    try:
        # A new run in the folder of an earlier one replaces its log now and its checkpoint at
        # the first save: say so (on stderr), with the flags that keep or continue it.
        earlier = not (args.resume or args.profile) and os.path.isdir(ckpt) and bool(os.listdir(ckpt))
        os.makedirs(args.out if args.profile else ckpt, exist_ok=True)  # (a profile trains nothing to keep)
        lock = layout.lock_out(args.out) if world.rank == 0 else None  # one run per --out
        log = RunLog(args.out, enabled=world.rank == 0, append=bool(args.resume))
    except OSError as e:
        raise UsageError(f"--out {args.out!r}: cannot write there ({e.strerror or e}); give another --out") from None
    try:
        return _run(args, world, log, earlier)
    finally:
        log.close()
        if lock is not None:
            lock.close()


def _stop_agreed(flag: bool, world: World) -> bool:
    """Whether any rank got Ctrl-C, seen by every rank after the same step: under torchrun one
    host-side all-reduce of one int per step (no device sync). A rank acting on its own flag
    would enter the save's collectives while another ran the next step's: a hang."""
    if world.size <= 1 or not dist.is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world.host_group)
    return bool(t.item())


def _diverged(
    where: str, args: argparse.Namespace, what: str = "the embeddings became NaN or infinite", kept: str = ""
) -> UsageError:
    """The one-line error of a run whose embeddings (or weights) became NaN or infinite."""
    return UsageError(
        f"training diverged {where} ({what}){kept}; lower --lr (now {args.lr:g}), "
        f"--weight-decay (now {args.weight_decay:g}) or --scale"
    )


def _save_if_finite(
    ckpt_dir: str,
    parts: setup.Parts,
    step: int,
    history: Dict[str, Any],
    world: World,
    args: argparse.Namespace,
    last_saved: Optional[int],
) -> int:
    """Saves the checkpoint of ``step`` and returns ``step``, unless the run diverged on any rank
    (NaN or infinite weights, or embeddings: :func:`resume.diverged`): then nothing is written
    (the last checkpoint stays the one to resume) and the run stops with the divergence error."""
    bad = resume.diverged(parts)
    if world.size > 1 and dist.is_initialized():  # every rank saves, or none does
        flag = torch.tensor([0.0 if bad is None else 1.0], device=world.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if bad is None and flag.item() > 0:
            bad = "on another rank"
    if bad is None:
        resume.save_checkpoint(ckpt_dir, parts, step, history, world)
        return step
    kept = (
        f"; no checkpoint of step {step} was written, {ckpt_dir} keeps step {last_saved}'s"
        if last_saved is not None
        else f"; no checkpoint of it was written to {ckpt_dir}"
    )
    raise _diverged(f"by step {step}", args, bad, kept)


def _data_error(
    err: UsageError,
    ckpt_dir: str,
    parts: setup.Parts,
    step: int,
    history: Dict[str, Any],
    world: World,
    args: argparse.Namespace,
    last_saved: Optional[int],
) -> UsageError:
    """The error of a step whose data could not be read (read before the step changed the
    model): in one process the ``step`` steps done are saved first, unless the last save
    holds them already. (Under torchrun the failing rank alone knows; the others are in the
    step's collectives: the run stops as before, from its last save.)"""
    if world.size > 1 or step == 0 or step == last_saved or setup.decode_error_line(err) is None:
        return err
    _save_if_finite(ckpt_dir, parts, step, history, world, args, last_saved)
    return UsageError(
        f"{err} (the {step} steps before it are saved: replace that file and continue with --resume {args.out})"
    )


def _run(args: argparse.Namespace, world: World, log: RunLog, earlier: bool) -> int:
    lead = world.rank == 0
    if args.deterministic:
        set_deterministic()
    torch.manual_seed(args.seed + world.rank)
    random.seed(args.seed)
    parts = setup.build(args, world)
    steps_per_epoch = len(parts.train_set) // (args.batch * world.size * args.accumulate)
    if steps_per_epoch < 1:
        raise UsageError(
            f"the training set ({len(parts.train_set)} images) is smaller than one step's batch ({args.batch} x "
            f"{world.size} ranks x {args.accumulate} micro-batches); use a smaller --batch or --accumulate"
        )
    total = args.steps or steps_per_epoch * args.epochs
    for line in header.lines(parts, args, world, total, steps_per_epoch):
        log.line(line)
    for text in header.warnings(parts, args, world):
        log.warn(text)
    if earlier:
        log.warn(
            f"{args.out} held an earlier run: its log.txt is replaced and its checkpoint will be at the first save "
            f"(--out DIR keeps runs apart; --resume {args.out} continues one)"
        )
    if args.profile:
        from shardkit.train import profile

        return profile.run(parts, args, steps_per_epoch, _lr_at(0, total, args.lr), log, world)
    history = new_history()
    start = 0
    if args.resume:
        found = checkpoint.find(args.resume)
        if found is None:  # there when the flags were read (cli.parse), gone since
            raise UsageError(f"--resume {args.resume!r}: no checkpoint found there any more")
        start, saved = resume.load_checkpoint(found, parts, world)
        history.update(saved)
        here = os.path.dirname(found) if layout.is_generation(found) else found
        if lead and os.path.realpath(here) == os.path.realpath(os.path.join(args.out, "checkpoint")):
            layout.tidy(here, found)  # what killed saves of this run left (its next save may never come)
        log.line(f"resumed from {found} at step {start} of {total}; writing to {args.out}")
        evaluated = os.path.exists(os.path.join(checkpoint.run_dir(found), "curves.png"))
        if start == total and not evaluated:
            # Trained to the end but stopped before its final evaluation (a Ctrl-C in the last
            # step, a kill after the last save): no step is left; the evaluation and report run.
            log.line(f"that run trained all {total} steps but was stopped before its final evaluation: evaluating it")
        elif start >= total:
            log.line(
                f"that run already finished ({start} of {total} steps): nothing to train or evaluate; its "
                f"results are in {os.path.join(checkpoint.run_dir(found), 'log.txt')}. To train on, resume "
                f"with --steps N (N > {start}) or more --epochs"
            )
            return 0
    ckpt_dir = os.path.join(args.out, "checkpoint")

    # Ctrl-C: finish the current step, then save a resumable checkpoint.
    stop = {"flag": False}
    old_handler = signal.getsignal(signal.SIGINT)

    def on_sigint(signum: int, frame: Optional[FrameType]) -> None:
        if stop["flag"]:  # a second Ctrl-C stops at once
            signal.signal(signal.SIGINT, old_handler)
            raise KeyboardInterrupt
        stop["flag"] = True

    signal.signal(signal.SIGINT, on_sigint)
    last_saved = start if args.resume else None  # the step of the checkpoint a resume would use
    bar = report_mod.Progress(total, start, enabled=lead, bar=not args.no_progress, log=log)
    per_step = args.batch * args.accumulate * world.size
    eval_every = steps_per_epoch if args.eval_every is None else args.eval_every
    step = start
    try:
        for step in range(start, total):
            t0 = time.perf_counter()
            try:
                loss, top1 = train_step(parts, args, step, steps_per_epoch, total, world)
            except NonFiniteEmbeddingsError as err:  # the head's input check: the backbone went NaN/inf
                raise _diverged(f"at step {step + 1}", args) from err
            except UsageError as err:  # an image that does not decode: the steps before it are kept
                raise _data_error(err, ckpt_dir, parts, step, history, world, args, last_saved) from None
            history["step"].append(step + 1)
            history["loss"].append(loss)
            history["top1"].append(top1)
            history["img_s"].append(per_step / max(time.perf_counter() - t0, 1e-9))
            history["mem_gib"].append(_peak_gib(parts.devices))
            if lead and eval_every and (step + 1) % eval_every == 0 and step + 1 < total:
                try:
                    _record_eval(history, step + 1, report_mod.verify_now(parts, args))
                except NonFiniteEmbeddingsError as err:
                    raise _diverged(f"by step {step + 1}", args) from err
            if lead:
                # Training throughput of the last steps (evaluation and checkpoint time excluded).
                recent = history["img_s"][-10:]
                rate = len(recent) / sum(1 / r for r in recent)
                stats = {"loss": f"{loss:.3f}", "img/s": f"{rate:.0f}", "mem": _peak_memory(parts.devices)}
                if top1 is not None:
                    stats["top1"] = f"{100 * top1:.1f}%"
                bar.set(step + 1, stats)
            if (step + 1) % steps_per_epoch == 0 or step + 1 == total:
                last_saved = _save_if_finite(ckpt_dir, parts, step + 1, history, world, args, last_saved)
            if _stop_agreed(stop["flag"], world):
                raise _Interrupted
    except _Interrupted:
        _save_if_finite(ckpt_dir, parts, step + 1, history, world, args, last_saved)
        bar.close()
        log.line(f"\ninterrupted: checkpoint of step {step + 1} saved in {ckpt_dir}; continue with --resume {args.out}")
        return 130
    finally:
        signal.signal(signal.SIGINT, old_handler)
    bar.close()
    try:
        return _finish(parts, args, world, history, total, log, ckpt_dir)
    except KeyboardInterrupt:  # a first Ctrl-C after the last step (its handler is gone): all is saved
        curves = os.path.join(args.out, "curves.png")
        if lead and os.path.lexists(curves) and not os.path.islink(curves):
            os.remove(curves)  # (perhaps half written) a resume evaluates a run without one
        # (a resume with nothing left to train saved nothing: its checkpoint is the one resumed)
        where, again = (ckpt_dir, args.out) if total > start else (checkpoint.find(args.resume), args.resume)
        log.line(
            f"\ninterrupted during the final evaluation: the checkpoint of step {total} is in {where}; "
            f"--resume {again} evaluates it"
        )
        return 130


def _finish(
    parts: setup.Parts,
    args: argparse.Namespace,
    world: World,
    history: Dict[str, Any],
    total: int,
    log: RunLog,
    ckpt_dir: str,
) -> int:
    """The final evaluation, its report and the curves (on rank 0)."""
    lead = world.rank == 0
    try:
        report = report_mod.evaluate(parts, args, world)
    except NonFiniteEmbeddingsError as err:  # found by the final evaluation (a step's check did not run)
        raise _diverged(f"by step {total}", args) from err
    if lead:
        for line in report_mod.report_lines(report, history, args):
            log.line(line)
        _record_eval(
            history, total, {n: (r["verification"].accuracy, r["verification"].tar) for n, r in report.items()}
        )
        plots.plot(history, list(dict.fromkeys(parts.devices)), os.path.join(args.out, "curves.png"))
        log.line(f"checkpoint: {ckpt_dir}   plot: {os.path.join(args.out, 'curves.png')}   log: {log.path}")
    return 0


def train_step(
    parts: setup.Parts, args: argparse.Namespace, step: int, steps_per_epoch: int, total: int, world: World
) -> Tuple[float, Optional[float]]:
    """One optimizer step over ``args.accumulate`` micro-batches; returns (loss, top-1 or None)."""
    lr = _lr_at(step, total, args.lr)
    for opt in parts.optimizers:
        for g in opt.param_groups:
            g["lr"] = lr
    parts.backbone_train.train()
    loss_sum, correct, valid = 0.0, 0, 0
    # under torchrun the backbone is DistributedDataParallel (--dp and --pipeline are one-process)
    ddp = parts.backbone_train if isinstance(parts.backbone_train, DistributedDataParallel) else None
    # Every micro-batch read first: an image that does not decode stops the step before any of
    # its forwards changed the model (BatchNorm statistics), so the steps before it can be saved.
    per_epoch = steps_per_epoch * args.accumulate
    data = [parts.batches.get(step * args.accumulate + m, per_epoch) for m in range(args.accumulate)]
    for micro in range(args.accumulate):
        # DDP all-reduces the backbone's gradients once per step, on the last micro-batch.
        last = micro == args.accumulate - 1
        sync: ContextManager[object] = contextlib.nullcontext() if last or ddp is None else ddp.no_sync()
        with sync:
            loss, top = _micro_step(parts, args, data[micro])
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


def _micro_step(
    parts: setup.Parts, args: argparse.Namespace, batch: Tuple[torch.Tensor, torch.Tensor]
) -> Tuple[torch.Tensor, Optional[ShardedLossOutput]]:
    """Forward and backward of one micro-batch (images, labels); returns (loss, head output or None)."""
    images, labels = batch
    with parts.autocast():
        x = parts.normalize(images.to(parts.devices[0], non_blocking=True))
        emb = parts.backbone_train(x)
    labels = labels.to(parts.devices[0], non_blocking=True)
    top: Optional[ShardedLossOutput] = None
    if parts.criterion is not None:  # --dp
        loss = parts.criterion(emb, labels)
    else:
        out = parts.head(emb.float() if args.amp == "fp16" else emb, labels, return_details=True, topk=(1,))
        loss, top = out.loss, out
    scaled = loss / args.accumulate
    parts.scaler.scale(scaled).backward() if parts.scaler is not None else scaled.backward()
    return loss, top
