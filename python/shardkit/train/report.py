"""End-of-run evaluation, report, plot and the progress bar of ``python -m shardkit.train``."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from shardkit.train.log import RunLog, emit
from shardkit.train.world import World

if TYPE_CHECKING:
    from shardkit.train.setup import Parts


class Progress:
    """A tqdm bar (or, without a terminal or with --no-progress, a line every ~10%); the
    ~10% lines always go to the run's log."""

    def __init__(self, total: int, start: int, enabled: bool, bar: bool = True, log: Optional[RunLog] = None) -> None:
        self.total, self.enabled, self.last_line, self.log = total, enabled, start, log
        self.bar: Any = None  # a tqdm bar
        if enabled and bar and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def set(self, step: int, stats: Dict[str, Any]) -> None:
        due = step - self.last_line >= max(1, self.total // 10) or step == self.total
        line = f"step {step}/{self.total} " + " ".join(f"{k} {v}" for k, v in stats.items())
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(stats, refresh=True)
        if due and self.enabled:
            self.last_line = step
            if self.bar is None:
                emit(line)
            if self.log is not None:
                self.log.write(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def eval_batch(batch: int) -> int:
    """Images per evaluation forward: the training batch, but at least 32 (or 8x the batch,
    if less). A forward without gradients holds a fraction of a training step's activations,
    and a tiny --batch (--accumulate 4 --batch 2) would otherwise spend the evaluation's
    thousands of images on per-batch overhead."""
    return batch if batch >= 32 else min(32, 8 * batch)


@torch.no_grad()
def _embed_fn(parts: Parts, model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def embed(images_u8: torch.Tensor) -> torch.Tensor:
        with parts.autocast():
            return model(parts.normalize(images_u8.to(parts.devices[0]))).float()

    return embed


@torch.no_grad()
def _train_top1(parts: Parts, model: nn.Module, limit: int = 4096) -> float:
    """Top-1 on (up to ``limit`` of) the training images from the head's statistics: no
    [B, C] logits. Under torchrun every rank takes its own slice (the head's forward is a
    collective), and the counts are summed."""
    world, n = parts.world, min(limit, len(parts.train_set))
    per_rank = n // world.size
    idx = list(range(world.rank * per_rank, (world.rank + 1) * per_rank))
    correct = torch.zeros((), dtype=torch.int64)
    valid = torch.zeros((), dtype=torch.int64)
    bs = eval_batch(parts.args.batch)
    for i in range(0, per_rank, bs):
        from shardkit.train.data import collate_uint8

        images, labels = collate_uint8([parts.train_set[j] for j in idx[i : i + bs]])
        emb = _embed_fn(parts, model)(images)
        out = parts.head(emb, labels.to(parts.devices[0]), return_details=True, topk=(1,))
        correct += out.correct[1].cpu()
        valid += out.num_valid.cpu()
    if world.size > 1:
        pair = torch.stack([correct, valid]).to(parts.devices[0])
        dist.all_reduce(pair)
        correct, valid = pair.cpu()
    return float(correct) / max(1, int(valid))


def _models(parts: Parts) -> Dict[str, nn.Module]:
    models = {"raw": parts.backbone}
    if parts.ema is not None:
        models["ema"] = parts.ema.module
    return models


@torch.no_grad()
def non_finite_embeddings(parts: Parts, images: int = 16) -> Optional[str]:
    """The name of the backbone ("raw" or "ema") whose evaluation-mode embeddings of the first
    ``images`` held-out images hold a NaN or an infinity, else None: a model that diverged
    with finite weights (BatchNorm's running statistics no longer tame its activations)."""
    batch = parts.val_set.images[:images]
    for name, model in _models(parts).items():
        was_training = model.training
        model.eval()
        try:
            emb = _embed_fn(parts, model)(batch)
        finally:
            model.train(was_training)
        if not bool(torch.isfinite(emb).all()):
            return name
    return None


def verify_now(parts: Parts, args: argparse.Namespace) -> Dict[str, Tuple[float, float]]:
    """Held-out verification (accuracy, TAR@FAR) of the raw and the EMA backbone, on this
    process (rank 0 during training): {name: (accuracy, tar)}."""
    out = {}
    for name, model in _models(parts).items():
        was_training = model.training
        model.eval()
        v = parts.val_set.evaluate(parts.val_set.embed(_embed_fn(parts, model), batch_size=eval_batch(args.batch)))
        model.train(was_training)
        out[name] = (v.accuracy, v.tar)
    return out


def evaluate(parts: Parts, args: argparse.Namespace, world: World) -> Dict[str, Dict[str, Any]]:
    """Train top-1 and held-out verification for the raw and the EMA backbone."""
    report = {}
    for name, model in _models(parts).items():
        was_training = model.training
        model.eval()
        top1 = _train_top1(parts, model)
        ver = None
        if world.rank == 0:
            emb = parts.val_set.embed(_embed_fn(parts, model), batch_size=eval_batch(args.batch))
            ver = parts.val_set.evaluate(emb)
        report[name] = {"top1": top1, "verification": ver}
        model.train(was_training)
    return report


def report_lines(report: Dict[str, Dict[str, Any]], history: Dict[str, Any], args: argparse.Namespace) -> List[str]:
    """The results table, as lines."""
    lines = [
        "",
        "results (train top-1 from the sharded head's statistics; verification on "
        f"{args.val_classes} held-out identities):",
        f"  {'model':<6} {'train top-1':>12} {'verif. acc':>12} {'TAR@FAR=1e-3':>14}",
    ]
    for name, r in report.items():
        v = r["verification"]
        lines.append(f"  {name:<6} {100 * r['top1']:>11.2f}% {100 * v.accuracy:>11.2f}% {100 * v.tar:>13.2f}%")
    v = report["raw"]["verification"]
    subset = v.num_balanced < v.num_genuine  # more genuine than impostor pairs: accuracy on a balanced subset
    lines.append(
        f"  ({v.num_genuine} genuine / {v.num_impostor} impostor pairs; "
        + (f"accuracy on {v.num_balanced} of each, chance 50%" if subset else "chance accuracy 50%")
        + ("" if v.far_reliable else f"; FAR resolution {v.far_resolution:.1e}")
        + ")"
    )
    if history["loss"]:
        lines.append(f"  loss: first step {history['loss'][0]:.3f}, last step {history['loss'][-1]:.3f}")
    return lines
