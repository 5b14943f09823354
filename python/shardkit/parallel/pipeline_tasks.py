"""The pipeline's per-task helpers: a stage's checkpointed run (its recomputation replays
the forward's training/eval modes and leaves BatchNorm statistics alone), the random
generator locks, the check that no tensor is shared across devices, and the label an error
note names its task by."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from shardkit.parallel.pipeline_bn import no_running_stats_update

_RNG_LOCKS: dict[str, threading.RLock] = {}  # device -> RLock: one task at a time per random generator (checkpointing)
_RNG_LOCKS_GUARD = threading.Lock()


def rng_lock(dev: torch.device) -> threading.RLock:
    with _RNG_LOCKS_GUARD:
        return _RNG_LOCKS.setdefault(str(dev), threading.RLock())


def check_shared(layers: list[nn.Module], balance: list[int], devices: list[torch.device]) -> None:
    """ValueError when a Parameter or buffer is held by stages on different devices (a layer
    or a tied weight used in two of them): a tensor lives on one device, and moving the
    second stage would take it from the first."""
    where: dict[int, tuple[int, str]] = {}
    start = 0
    for s, (size, dev) in enumerate(zip(balance, devices)):
        stage = nn.Sequential(*layers[start : start + size])
        start += size
        for name, t in list(stage.named_parameters()) + list(stage.named_buffers()):
            first = where.setdefault(id(t), (s, name))
            if devices[first[0]] != dev:
                raise ValueError(
                    f"argument `stages`: the tensor at layer {first[1]!r} of stage {first[0]} is also used by "
                    f"stage {s} ({name!r}), but the stages are on {devices[first[0]]} and {dev}; a shared layer "
                    "or tied weight must stay on one device: give those stages the same device (`devices`, "
                    "`balance`)"
                )


def run_checkpointed(part: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``part(x)`` under a non-reentrant checkpoint: the backward recomputes it with the
    forward's modes and without counting BatchNorm batches again."""
    calls = {"n": 0}
    failed: list[BaseException] = []

    modes = [(mod, mod.training) for mod in part.modules()]
    # The checkpoint recomputes from the stage's input, which an in-place first layer
    # (ReLU(inplace=True) just after a stage boundary) would change: it gets a copy.
    copy_input = changes_its_input(part)
    version = x._version

    def run(inp: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if copy_input:
            inp = inp.clone()
        if calls["n"] > 1:  # the recomputation in the backward replays the forward's modes
            with _modes_of(modes), no_running_stats_update(part):  # modes first: they pick the layers
                return part(inp)
        # torch's checkpoint installs its saved-tensor hooks on this thread and removes
        # them only after the function returns: an exception would leave them in place
        # (until the exception is collected, possibly on another thread), and every
        # later forward on this thread would save its tensors into this failed call.
        try:
            return part(inp)
        except BaseException as e:  # noqa: BLE001 (re-raised below, once checkpoint is done)
            failed.append(e)
            return inp.new_empty(0)

    y = _checkpoint(run, x, use_reentrant=False)
    if failed:
        error = failed.pop()
        try:
            raise error
        finally:
            del error  # no reference cycle through this frame
    if x._version != version:  # (torch's own error would come in the backward, naming nothing)
        raise RuntimeError(
            "a layer of this checkpointed stage changed the stage's input in place, so the backward cannot "
            "recompute the stage from it: make that layer out of place (inplace=False), or pass checkpoint='never'"
        )
    return y


def changes_its_input(part: nn.Module) -> bool:
    """Whether ``part``'s first layer (through nested Sequentials) is one of torch's in-place
    layers (``inplace=True``: ReLU, LeakyReLU, Dropout, Hardswish, ...)."""
    first: nn.Module | None = part
    while isinstance(first, nn.Sequential):
        first = next(iter(first), None)
    return first is not None and getattr(first, "inplace", False) is True


@contextlib.contextmanager
def _modes_of(modes: list[tuple[nn.Module, bool]]) -> Iterator[None]:
    """Each module's ``training`` flag as recorded (a model switched to ``eval()`` between
    the forward and the backward still recomputes its training forward), restored after."""
    now = [(mod, mod.training) for mod, _ in modes]
    for mod, flag in modes:
        mod.training = flag
    try:
        yield
    finally:
        for mod, flag in now:
            mod.training = flag


class TaskLabel:
    """Names the task a device's call is running (the note on an error raised in it)."""

    def __init__(self, micro_batches: int) -> None:
        self.micro_batches = micro_batches
        self.task = (0, 0)

    def __str__(self) -> str:
        s, i = self.task
        return f"stage {s} (partitions[{s}]), micro-batch {i} of {self.micro_batches}"


class null_context:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> Literal[False]:
        return False
