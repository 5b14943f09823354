"""``python -m shardkit.train``: the whole shardkit recipe on a built-in default.

A ResNet-style backbone (:mod:`shardkit.train.models`) learns face-recognition-style embeddings of
procedurally generated identities (:mod:`shardkit.train.data`) through a class-sharded ArcFace head
(:class:`shardkit.ShardedSoftmaxLoss`); images travel as uint8 and are normalized on the device
(:class:`shardkit.Normalize`); :class:`shardkit.ModelEMA` averages the backbone. At the end it
reports train top-1 (from the head's statistics, no logits) and verification on held-out
identities for the raw and the EMA backbone, writes a checkpoint that resumes exactly and a
PNG plot of loss and accuracy.

The default finishes in about three minutes on a 2-core CPU. Scale it with flags:
``--devices cuda:0,cuda:1`` (head shards on both GPUs, backbone on the first), ``--dp``
(backbone and loss data-parallel over the devices), ``torchrun --nproc_per_node=N -m
shardkit.train`` (distributed head, DDP backbone). ``python -m shardkit.train --help`` lists
every flag. Bad flags or paths exit with code 2; Ctrl-C saves a resumable checkpoint.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist

from shardkit.train import loop
from shardkit.train.models import PRESETS

__all__ = ["main", "build_parser"]


def _device_list(text: str):
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            dev = torch.device(part)
        except RuntimeError:
            raise argparse.ArgumentTypeError(f"not a device: {part!r} (use e.g. cpu, cuda:0)") from None
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", 0)
        out.append(dev)
    if not out:
        raise argparse.ArgumentTypeError("empty device list")
    return out


def _positive(kind):
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {kind.__name__}: {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return v

    return parse


def _rate(text):
    v = _positive(float)(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m shardkit.train",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = p.add_argument_group("data")
    d.add_argument(
        "--data",
        metavar="PATH",
        help="ImageFolder-style directory (class subfolders) instead of the built-in synthetic identities",
    )
    d.add_argument(
        "--cache-ram",
        choices=["none", "encoded", "decoded"],
        default="none",
        help="with --data: keep images in RAM as encoded file bytes or decoded uint8",
    )
    d.add_argument("--classes", type=_positive(int), default=200, help="synthetic training identities")
    d.add_argument("--per-class", type=_positive(int), default=32, help="synthetic images per identity")
    d.add_argument("--image-size", type=_positive(int), default=32)
    d.add_argument("--val-classes", type=_positive(int), default=100, help="held-out identities for verification")
    d.add_argument("--val-per-class", type=_positive(int), default=6)
    d.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    m = p.add_argument_group("model and loss")
    m.add_argument("--backbone", choices=sorted(PRESETS), default="tiny")
    m.add_argument("--dim", type=_positive(int), default=128, help="embedding size")
    m.add_argument("--margin", choices=["arcface", "cosface", "none"], default="arcface")
    m.add_argument("--scale", type=_positive(float), default=32.0, help="s of the margin logits")
    m.add_argument("--m", type=float, default=None, help="margin (default 0.3 arcface, 0.25 cosface)")
    m.add_argument("--sample-rate", type=_rate, default=1.0, help="PartialFC negative class sampling rate")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=_positive(int), default=6)
    t.add_argument("--steps", type=_positive(int), default=None, help="stop after this many optimizer steps")
    t.add_argument("--batch", type=_positive(int), default=128, help="micro-batch size (per rank under torchrun)")
    t.add_argument("--accumulate", type=_positive(int), default=1, help="micro-batches per optimizer step")
    t.add_argument("--lr", type=_positive(float), default=0.2)
    t.add_argument("--weight-decay", type=float, default=5e-4)
    t.add_argument("--ema", type=float, default=0.995, metavar="DECAY", help="EMA decay (0 disables EMA)")
    t.add_argument("--ema-tau", type=float, default=100.0, help="EMA warm-up ramp (updates)")
    t.add_argument("--amp", choices=["bf16", "fp16"], default=None, help="autocast dtype")
    t.add_argument("--checkpointing", action="store_true", help="recompute backbone stages in the backward")
    t.add_argument("--seed", type=int, default=0)
    x = p.add_argument_group("devices")
    x.add_argument(
        "--devices",
        type=_device_list,
        default=None,
        help="comma-separated; head shards go one per device, the backbone on the first "
        "(default: cuda:0 when a GPU is visible, else cpu)",
    )
    x.add_argument(
        "--dp",
        action="store_true",
        help="backbone and loss data-parallel over --devices "
        "(shardkit.parallel.DataParallelModel / DataParallelCriterion)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", default="runs/train", help="output directory (checkpoint, plot, log)")
    o.add_argument("--resume", metavar="DIR", help="resume from a checkpoint directory (or the --out of a run)")
    o.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    return p


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.data is not None and not os.path.isdir(a.data):
        p.error(f"--data {a.data!r} is not a directory")
    if a.resume is not None and loop.find_checkpoint(a.resume) is None:
        p.error(f"--resume {a.resume!r}: no checkpoint found there (expected {loop.CKPT_FILE})")
    if a.devices is None:
        a.devices = [torch.device("cuda", 0)] if torch.cuda.is_available() else [torch.device("cpu")]
    for dev in a.devices:
        if dev.type == "cuda" and (not torch.cuda.is_available() or dev.index >= torch.cuda.device_count()):
            p.error(f"--devices: {dev} is not available on this machine")
        if dev.type not in ("cpu", "cuda"):
            p.error(f"--devices: only cpu and cuda devices are supported, got {dev}")
    if a.m is None:
        a.m = {"arcface": 0.3, "cosface": 0.25, "none": 0.0}[a.margin]
    if a.margin != "none" and not 0 <= a.m < math.pi:
        p.error(f"--m must be in [0, pi), got {a.m}")
    if a.amp == "fp16" and all(d.type == "cpu" for d in a.devices):
        p.error("--amp fp16 needs a CUDA device; use --amp bf16 on the CPU")
    if not 0 <= a.ema < 1:
        p.error(f"--ema must be in [0, 1), got {a.ema}")
    if a.workers < 0:
        p.error(f"--workers must be >= 0, got {a.workers}")
    if a.val_per_class < 2 or a.val_classes < 2:
        p.error("--val-classes and --val-per-class must be >= 2 (verification needs pairs)")


def main(argv=None) -> int:
    """Entry point of ``python -m shardkit.train`` and the ``shardkit-train`` script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    had_group = dist.is_available() and dist.is_initialized()
    world = loop.init_distributed(args)
    try:
        code = loop.run(args, world)
        if world.size > 1 and dist.is_initialized():
            # Tear down together: rank 0 still plots while the others would close their gloo
            # connections, and a peer's socket closing under a rank that still reads it aborts it.
            dist.barrier()
        return code
    finally:
        # Leave the process as we found it.
        if not had_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
