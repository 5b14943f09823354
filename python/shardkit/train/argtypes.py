"""The trainer's argument types and limits: each parses one flag's text or checks a bound,
raising argparse's error type so the message names the flag (exit 2 in main)."""

from __future__ import annotations

import argparse
import math
import os
from typing import Callable, List, Optional, TypeVar

import torch

from shardkit.plan import format_size, plan_memory
from shardkit.train.models import build_backbone

_N = TypeVar("_N", int, float)

MAX_INT = 2**63 - 1  # an int flag's largest value: torch's sizes and seeds are int64
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # a float flag's largest magnitude


def _device_list(text: str) -> List[torch.device]:
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


def _number(kind: type[_N], text: str, rule: str = "a finite number") -> _N:
    """``text`` as a finite ``kind`` (int or float), else an argparse error saying ``rule``."""
    try:
        v = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {'an' if kind is int else 'a'} {kind.__name__}: {text!r}") from None
    if kind is int:  # (an int past a float's range would raise OverflowError in isfinite)
        if not -MAX_INT <= v <= MAX_INT:
            raise argparse.ArgumentTypeError(f"must be at most 2**63 - 1 in size, got {_brief(text)}")
        return v
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
    if abs(v) > FLOAT32_MAX:  # torch keeps the value as a float32 (SGD's weight decay), where it overflows
        raise argparse.ArgumentTypeError(f"must fit a float32 (at most {FLOAT32_MAX:.7g} in size), got {text}")
    return v


def _brief(text: str) -> str:
    """``text``, or for a long number its digit count (an error message stays one short line)."""
    text = text.strip()
    return text if len(text) <= 30 else f"a {len(text.lstrip('+-'))}-digit number"


def _positive(kind: type[_N], high: Optional[float] = None) -> Callable[[str], _N]:
    """argparse type: a finite ``kind`` > 0 (and <= ``high`` when given)."""

    def parse(text: str) -> _N:
        v = _number(kind, text, "a finite number > 0")
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        if high is not None and v > high:
            raise argparse.ArgumentTypeError(f"must be in (0, {high:g}], got {text}")
        return v

    return parse


def _finite(text: str) -> float:
    """argparse type: a finite float."""
    return _number(float, text)


def _non_negative(text: str) -> float:
    """argparse type: a finite float >= 0."""
    v = _number(float, text, "a finite number >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def _rate(text: str) -> float:
    v = _positive(float)(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


MAX_LR = 1e3  # far above any learning rate that trains; 1e30 only overflows the weights
MAX_SCALE = 1e29  # the margins take s * (1 + m) <= 1e30, and --m is below pi
MIN_IMAGE_SIZE = 4  # the synthetic identities' smallest side (the backbones take any size)
MAX_SEED = 2**63 - 1  # seed + rank/epoch must stay a valid torch seed (< 2**64)
MAX_PROFILE_STEPS = 1000  # --profile: far more steps than a timing needs (the trace keeps the first 20)


def _max_workers() -> int:
    """The most --workers that makes sense: DataLoader processes beyond this only thrash."""
    return max(64, 8 * (os.cpu_count() or 1))


def _ram_bytes() -> Optional[int]:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _held_out_bytes(a: argparse.Namespace) -> int:
    """A lower bound of the RAM the synthetic held-out set takes: its uint8 images and
    embeddings, and per pair (every genuine one + 10000 impostors) its indices and the two
    fp32 embeddings gathered to score it."""
    images = a.val_classes * a.val_per_class
    pairs = a.val_classes * (a.val_per_class * (a.val_per_class - 1) // 2) + 10000
    return held_out_bytes(images, pairs, a)


def held_out_bytes(images: int, pairs: int, a: argparse.Namespace) -> int:
    """A lower bound of the RAM of ``images`` held-out images and their ``pairs``: the uint8
    images and their embeddings, and per pair its indices and the two fp32 embeddings gathered
    to score it."""
    return images * (3 * a.image_size**2 + 4 * a.dim) + pairs * (16 + 8 * a.dim)


def _capacity(dev: torch.device) -> Optional[int]:
    """Bytes of memory behind a device: a GPU's total memory, the machine's RAM for the CPU."""
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev.index or 0).total_memory
    return _ram_bytes()


def _head_misfit(a: argparse.Namespace, world_size: int, classes: Optional[int] = None) -> Optional[str]:
    """None if the head of --classes (or ``classes``: --data's training classes) x --dim (the
    planner's bytes per shard: weights, momentum, gradient, loss working set) fits the memory
    of the devices holding it, else a message. Shards on one device (``--devices cpu,cpu``) add
    up; under torchrun each rank holds one."""
    n = world_size if world_size > 1 else len(a.devices)
    batch = a.batch if world_size > 1 else max(1, a.batch // n)
    what = f"--classes {a.classes}" if classes is None else f"--data's {classes} training classes"
    classes = a.classes if classes is None else classes
    plan = plan_memory(classes, a.dim, n, batch, sample_rate=a.sample_rate)
    per_shard = plan.shardkit_max.total
    held = [a.devices[0]] if world_size > 1 else a.devices
    for dev in dict.fromkeys(held):
        need, cap = per_shard * held.count(dev), _capacity(dev)
        if cap is not None and need > cap:
            return (
                f"{what} x --dim {a.dim}: the head needs about {format_size(need)} on {dev} "
                f"(python -m shardkit.plan's figure), which has {format_size(cap)}; use fewer classes, a smaller "
                "--dim, --sample-rate, or more devices"
            )
    return None


def _saved_bytes_per_image(a: argparse.Namespace) -> int:
    """Bytes the backbone's training forward keeps for its backward, per image of
    --image-size (fp32, --checkpointing honoured): forwards on the meta device, which
    allocate nothing, with every saved tensor counted, at two batch sizes; their difference
    leaves out what does not grow with the batch (the weights the layers save)."""
    with torch.device("meta"):
        backbone = build_backbone(a.backbone, a.dim, checkpointing=a.checkpointing)
    backbone.train()

    def saved(batch: int) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            backbone(torch.empty(batch, 3, a.image_size, a.image_size, device="meta"))
        return total

    return max(0, saved(4) - saved(2)) // 2


def _activations_misfit(a: argparse.Namespace, world_size: int) -> Optional[str]:
    """None if one micro-batch's backbone activations can fit the first device's memory,
    else a message. The figure is a lower bound (half the saved bytes, which count in-place
    results twice; halved again under --amp), so only runs that cannot fit are refused."""
    n = len(a.devices) if world_size == 1 and (a.dp or a.pipeline) else 1
    per_device = -(-a.batch // n)
    dev = a.devices[0]
    cap = _capacity(dev)
    # The uint8 input batch first, in ints: an --image-size past this would overflow the
    # meta-device forward below (its 4-image batch's size) before it allocates anything.
    images = 3 * a.image_size**2 * per_device
    if 3 * a.image_size**2 * max(per_device, 4) > MAX_INT or (cap is not None and images > cap):
        room = f", which has {format_size(cap)}" if cap is not None else ""
        return (
            f"--image-size {a.image_size} with --batch {a.batch}: one step's uint8 images alone need "
            f"{format_size(images)} on {dev}{room}; lower --image-size or --batch"
        )
    need = _saved_bytes_per_image(a) * per_device // (4 if a.amp else 2)
    if cap is None or need <= cap:
        return None
    hint = "" if a.checkpointing else ", or add --checkpointing"
    return (
        f"--image-size {a.image_size} with --batch {a.batch} and --backbone {a.backbone}: one step's activations "
        f"need over {format_size(need)} on {dev}, which has {format_size(cap)}; lower --batch or --image-size{hint}"
    )


def _train_index_bytes(a: argparse.Namespace) -> int:
    """RAM of an epoch's shuffled order of the synthetic training set (int64 per image)."""
    return 8 * a.classes * a.per_class
