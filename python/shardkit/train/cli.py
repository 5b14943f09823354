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
every flag. A user error (bad flag, path, data folder or checkpoint) exits with status 2 and
one line saying what is wrong and what to do; an internal error exits 1 with its traceback.
Ctrl-C saves a resumable checkpoint and exits 130.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, Optional, Sequence, Set

import torch
import torch.distributed as dist

from shardkit.train import checkpoint, checks, layout, loop, ranks
from shardkit.train.argtypes import (
    MAX_LR,
    MAX_SCALE,
    _device_list,
    _finite,
    _non_negative,
    _positive,
    _rate,
)
from shardkit.train.errors import UsageError
from shardkit.train.models import PRESETS
from shardkit.train.setup import decode_error_line
from shardkit.train.world import init_distributed

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are a UsageError (one line, exit 2 in main), not usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see --help)")


EPILOG = """\
learning rate: linear warm-up over the first 5% of the steps to --lr, then cosine decay to 0
at the last step (SGD, momentum 0.9, for the backbone and the head's rows).

--resume DIR continues the run in DIR (output too, unless --out is given) with the settings
saved in its checkpoint. Flags that may change on resume: --steps, --epochs, --lr, --amp,
--checkpointing, and the ones about this machine and the output (--devices, --dp, --pipeline,
--chunks, --workers, --cache-ram, --out, --eval-every, --no-progress; the head may be sharded
differently). Any other flag given with a value other than the checkpoint's is an error.

exit status: 0 done, 2 a user error (one line on stderr saying what to do), 1 an internal
error (with its traceback), 130 interrupted by Ctrl-C (checkpoint saved; a second Ctrl-C
stops at once and keeps the last checkpoint). Under torchrun the rank that meets an error
prints it, tagged [rank R of W], and the other ranks stop naming that rank.
"""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m shardkit.train",
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = p.add_argument_group("data")
    d.add_argument(
        "--data",
        metavar="PATH",
        help="ImageFolder-style directory (class subfolders); default: the built-in synthetic identities",
    )
    d.add_argument(
        "--cache-ram",
        choices=["none", "encoded", "decoded"],
        default="none",
        help="with --data: keep images in RAM as encoded file bytes or decoded uint8 (default: %(default)s)",
    )
    d.add_argument(
        "--classes", type=_positive(int), default=200, help="synthetic training identities (default: %(default)s)"
    )
    d.add_argument(
        "--per-class", type=_positive(int), default=32, help="synthetic images per identity (default: %(default)s)"
    )
    d.add_argument("--image-size", type=_positive(int), default=32, help="image side in pixels (default: %(default)s)")
    d.add_argument(
        "--val-classes",
        type=_positive(int),
        default=100,
        help="held-out identities for verification (default: %(default)s)",
    )
    d.add_argument(
        "--val-per-class", type=_positive(int), default=6, help="images per held-out identity (default: %(default)s)"
    )
    d.add_argument(
        "--workers",
        type=int,
        default=0,
        help="DataLoader worker processes (default: %(default)s, load in the main process)",
    )
    m = p.add_argument_group("model and loss")
    m.add_argument("--backbone", choices=sorted(PRESETS), default="tiny", help="backbone preset (default: %(default)s)")
    m.add_argument("--dim", type=_positive(int), default=128, help="embedding size (default: %(default)s)")
    m.add_argument(
        "--init",
        choices=["default", "xavier", "kaiming"],
        default="default",
        help="weight init of the backbone's conv/linear layers and the head (default: %(default)s, torch's own)",
    )
    m.add_argument(
        "--margin",
        choices=["arcface", "cosface", "none"],
        default="arcface",
        help="margin of the softmax (default: %(default)s)",
    )
    m.add_argument(
        "--scale",
        type=_positive(float, MAX_SCALE),
        default=32.0,
        help="s of the margin logits (default: %(default)s)",
    )
    m.add_argument("--m", type=_finite, default=None, help="margin (default: 0.3 for arcface, 0.25 for cosface)")
    m.add_argument(
        "--sample-rate",
        type=_rate,
        default=1.0,
        help="PartialFC negative class sampling rate (default: %(default)s, no sampling)",
    )
    t = p.add_argument_group("training")
    t.add_argument(
        "--epochs", type=_positive(int), default=6, help="passes over the training set (default: %(default)s)"
    )
    t.add_argument(
        "--steps", type=_positive(int), default=None, help="optimizer steps to train (default: --epochs worth)"
    )
    t.add_argument(
        "--batch",
        type=_positive(int),
        default=128,
        help="micro-batch size, per rank under torchrun (default: %(default)s)",
    )
    t.add_argument(
        "--accumulate", type=_positive(int), default=1, help="micro-batches per optimizer step (default: %(default)s)"
    )
    t.add_argument(
        "--lr", type=_positive(float, MAX_LR), default=0.2, help="peak learning rate, see below (default: %(default)s)"
    )
    t.add_argument(
        "--weight-decay",
        type=_non_negative,
        default=5e-4,
        help="SGD weight decay of weights, not of biases/BN (default: %(default)s)",
    )
    t.add_argument(
        "--ema", type=float, default=0.995, metavar="DECAY", help="EMA decay, 0 disables EMA (default: %(default)s)"
    )
    t.add_argument(
        "--ema-tau", type=_positive(float), default=100.0, help="EMA warm-up ramp in updates (default: %(default)s)"
    )
    t.add_argument(
        "--amp", choices=["none", "bf16", "fp16"], default="none", help="autocast dtype (default: %(default)s)"
    )
    t.add_argument(
        "--checkpointing", action="store_true", help="recompute backbone stages in the backward (default: off)"
    )
    t.add_argument("--seed", type=int, default=0, help="seed of the data, init and sampling (default: %(default)s)")
    t.add_argument(
        "--deterministic",
        action="store_true",
        help="bit-for-bit repeatable steps on a GPU (deterministic cuDNN/cuBLAS, a little slower); the CPU "
        "is deterministic anyway for a given thread count, but for --dp with --amp bf16 (default: off)",
    )
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
        "(shardkit.parallel.DataParallelModel / DataParallelCriterion; default: off)",
    )
    x.add_argument(
        "--pipeline",
        action="store_true",
        help="split the backbone over --devices (one stage each, balanced by layer time) and pipeline "
        "micro-batches through them (shardkit.parallel.PipelineModel); head shards sized to even out memory "
        "(default: off)",
    )
    x.add_argument("--chunks", type=int, default=4, help="micro-batches per step with --pipeline (default: 4)")
    o = p.add_argument_group("output")
    o.add_argument(
        "--out",
        default=None,
        help="output directory: checkpoint/, log.txt, curves.png (default: runs/train, or the resumed run's directory)",
    )
    o.add_argument(
        "--resume", metavar="DIR", help="continue the run in DIR, a run's --out or its checkpoint/ (default: a new run)"
    )
    o.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="time N steps (at most 1000) phase by phase, print where the time goes and a verdict, write a "
        "profiler trace of the first 20 and a chart to --out, then stop; 0: train (default: %(default)s)",
    )
    o.add_argument(
        "--eval-every",
        type=int,
        default=None,
        metavar="K",
        help="held-out verification of the raw and EMA backbones every K steps, for the plot; 0: only "
        "at the end (default: once per epoch)",
    )
    o.add_argument(
        "--no-progress", action="store_true", help="plain log lines instead of a progress bar (default: off)"
    )
    return p


def _explicit(argv: Optional[Sequence[str]]) -> Set[str]:
    """The destinations of the flags given on the command line."""
    p = build_parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return set(vars(p.parse_args(argv)))


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The run's settings: the flags, and on --resume the checkpoint's saved settings."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.data == "":  # (`--data "$DATA"` with DATA unset: it would name the current folder)
        raise UsageError("--data is empty; give a folder of class subfolders of images")
    if args.data is not None and not os.path.isabs(args.data):  # saved absolute: a resume elsewhere finds it
        args.data = os.path.join(os.getcwd(), args.data)  # (not normpath: "link/.." must keep its meaning)
    if args.resume is not None:
        found = checkpoint.find(args.resume)
        if found is None:
            raise UsageError(
                f"--resume {args.resume!r}: no checkpoint found there (expected {checkpoint.CKPT_FILE} in it "
                "or in its checkpoint/); give the --out of an earlier run"
            )
        path = layout.newest_file(found)
        assert path is not None  # (find returned its folder)
        saved = checkpoint.read(path)
        checks.check_saved_settings(parser, saved["args"], path)
        recorded = isinstance(saved.get("data"), dict)  # (checkpoints before 2026-11-28 hold no record)
        checkpoint.restore_settings(args, _explicit(argv), saved["args"], found, recorded)
        if args.out is None:
            args.out = checkpoint.run_dir(found)
    if args.out is None:
        args.out = "runs/train"
    synthetic_only = sorted(_explicit(argv) & {"classes", "per_class", "val_per_class"})
    if args.data is not None and synthetic_only:  # (the folder's classes and images count: they did nothing)
        flags = ", ".join("--" + d.replace("_", "-") for d in synthetic_only)
        raise UsageError(
            f"{flags} size the synthetic data; with --data the folder's class folders and images count: drop "
            f"{'it' if len(synthetic_only) == 1 else 'them'}"
        )
    checks.check_args(args)
    return args


def _out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation failure: a GPU's (torch.OutOfMemoryError), the CPU
    allocator's, or Python's MemoryError."""
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
        return True
    return "DefaultCPUAllocator: can't allocate memory" in str(e)


def _user_error_line(e: BaseException) -> Optional[str]:
    """The one line of a user error (a UsageError, an image of --data that does not decode
    outside a training step, running out of memory), else None."""
    if isinstance(e, UsageError):
        return str(e)
    if isinstance(e, ValueError):  # an image of --data that fails outside a training step (the evaluation's)
        line = decode_error_line(e)
        return None if line is None else f"{line}; remove or replace that file in --data"
    if isinstance(e, (RuntimeError, MemoryError)) and _out_of_memory(e):
        said = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return (
            f"out of memory ({said}); lower --batch or --image-size, use a smaller --backbone, add "
            "--checkpointing or --amp bf16, or give the head more --devices or a --sample-rate"
        )
    return None


def _failed(e: BaseException, args: argparse.Namespace, world: loop.World) -> Optional[int]:
    """The exit code of a run that raised ``e`` (after saying why), or None to re-raise it (an
    internal error, recorded for the other ranks first). See :mod:`shardkit.train.ranks`."""
    if isinstance(e, KeyboardInterrupt):  # a second Ctrl-C: stop now (the first one saves at its step's end)
        if world.rank == 0:
            print(
                "\npython -m shardkit.train: stopped by a second Ctrl-C without saving; the last checkpoint in "
                f"{os.path.join(args.out, 'checkpoint')} (if any) is intact",
                file=sys.stderr,
            )
        return 130
    line = _user_error_line(e)
    if line is not None:
        return ranks.fail(world, 2, line)
    peer = ranks.peer_failure(world)
    if peer is not None:  # this rank's error follows another rank's failure
        return ranks.stopped_by_peer(world, peer, e)
    if isinstance(e, ranks.Terminated):
        ranks.say(f"{ranks.tag(world.rank, world.size)}stopped by the launcher (SIGTERM)")
        return 143
    if world.size > 1 and ranks.transport_failure(e):
        return ranks.stopped_by_lost_peer(world, e)
    said = (str(e).strip().splitlines() or [""])[0]
    ranks.record(world, 1, f"internal error {type(e).__name__}: {said} (its traceback is in that rank's output)")
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m shardkit.train`` and the ``shardkit-train`` script; returns
    the exit code: 2 with one line on stderr for a user error (under torchrun on the rank that
    met it, the others naming that rank: :mod:`shardkit.train.ranks`)."""
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        had_group = dist.is_available() and dist.is_initialized()
        world = init_distributed(args)
    except UsageError as e:
        ranks.say(f"{ranks.env_tag()}{e}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the run started: nothing to save
        print("\npython -m shardkit.train: interrupted before training started", file=sys.stderr)
        return 130
    try:
        with ranks.sigterm_raises(world):
            code = loop.run(args, world)
            if world.size > 1 and dist.is_initialized():
                # Tear down together: rank 0 still plots while the others would close their gloo
                # connections, and a peer's socket closing under a rank that still reads it aborts it.
                dist.barrier()
        return code
    except BaseException as e:  # noqa: BLE001 (what is ours is re-raised)
        failed = _failed(e, args, world)
        if failed is None:
            raise
        return failed
    finally:
        # Leave the process as we found it.
        if not had_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
