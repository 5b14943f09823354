"""A backbone split over devices in ONE process, with micro-batches pipelined through the
stages (GPipe's fill-drain schedule), the fuller split of the million-class write-up.

The batch is cut into ``chunks`` micro-batches. At clock ``t`` stage ``k`` runs micro-batch
``t - k``: while stage 1 works on micro-batch 0, stage 0 already works on micro-batch 1, so
with K stages and M micro-batches the devices idle for a fraction (K - 1) / (M + K - 1) of
the forward (the bubble) instead of (K - 1) / K for the naive split. The tasks of one clock
run in threads, one per device (:mod:`shardkit.parallel.threads`, which carries grad mode
and autocast); tasks that share a device run in stage order, so the draws of its random
generator (dropout) come in the same order run to run;
on GPUs each stage has its own stream, and an activation is handed to the next stage by a
non-blocking copy ordered by the producer's event. Autograd then runs the backward of each
device on that device's stream.

Checkpointing (activation recomputation) per micro-batch: ``"never"``, ``"except_last"``
(GPipe's default: the last micro-batch's backward starts at once, so keeping its
activations costs nothing in time) or ``"always"``. A recomputation never updates
BatchNorm statistics a second time, and replays the stage's random draws (dropout) exactly:
while the model checkpoints, tasks that share a random generator (the CPU's, or one GPU's
when it holds several stages) run one at a time, so no other stage draws between a forward
and the generator state it saved; stages on distinct GPUs stay concurrent.

BatchNorm: in training each micro-batch is normalized with its own statistics (as in
GPipe: the whole batch never exists on one device). ``batchnorm="deferred"`` (the default)
keeps the running statistics those of the whole batch, updated once per step, so what
evaluation uses equals the unsplit model's; ``batchnorm="micro"`` lets every micro-batch
update them (momentum applied ``chunks`` times per step), as plain BatchNorm would.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, Sequence, Union

import torch
from torch import nn

from shardkit.ops._devices import unavailable_cuda, visible_gpus
from shardkit.parallel.pipeline_bn import DeferredBatchNorm, micro_batch
from shardkit.parallel.pipeline_plan import BALANCE_BY, layer_costs, partition, split_evenly
from shardkit.parallel.pipeline_tasks import (
    TaskLabel,
    changes_its_input,
    check_shared,
    null_context,
    rng_lock,
    run_checkpointed,
)
from shardkit.parallel.scatter import as_device
from shardkit.parallel.threads import run_parallel

CHECKPOINT_MODES = ("never", "except_last", "always")
Stages = Union[nn.Sequential, Sequence[nn.Module]]
Stream = torch.cuda.Stream
Event = torch.cuda.Event


BATCHNORM_MODES = ("deferred", "micro")


def _layers(stages: Stages) -> list[nn.Module]:
    if isinstance(stages, nn.Sequential):
        return list(stages)  # every position: a layer held twice (a shared activation) runs twice
    if isinstance(stages, (list, tuple)) and all(isinstance(m, nn.Module) for m in stages):
        return list(stages)
    raise TypeError(f"argument `stages` must be an nn.Sequential or a list of nn.Modules, got {type(stages).__name__}")


def _device_arg(value: Any, name: str) -> torch.device:
    """``value`` as a CPU or visible CUDA device; ValueError naming argument ``name`` otherwise.
    Other device types are refused before any layer moves: a "meta" stage would take the
    caller's layers there and drop their values, and nothing can run on it."""
    try:
        dev = as_device(value)
    except ValueError as e:
        raise ValueError(f"argument `{name}`: {e}") from None
    if dev.type not in ("cpu", "cuda"):
        what = "hold CPU or CUDA devices" if name == "devices" else "be a CPU or CUDA device"
        raise ValueError(f"argument `{name}` must {what} (e.g. 'cpu', 'cuda:0'), got {dev}")
    return dev


def _check_visible(devices: Sequence[torch.device], name: str) -> None:
    """Every CUDA device of ``devices`` is visible here (else the first ``.to`` would fail
    with the driver's message, which names no argument)."""
    missing = unavailable_cuda(devices)
    if not missing:
        return
    count = visible_gpus()
    if count == 0:
        cuda = ", ".join(str(d) for d in devices if d.type == "cuda")
        raise ValueError(
            f"argument `{name}` names CUDA devices ({cuda}) but no CUDA GPU is visible "
            "(torch.cuda.is_available() is False); use 'cpu' devices, e.g. ['cpu', 'cpu'], on this machine"
        )
    raise ValueError(
        f"argument `{name}` names {', '.join(map(str, missing))} but only {count} CUDA GPU(s) are visible "
        f"(cuda:0 to cuda:{count - 1})"
    )


class PipelineModel(nn.Module):
    """``stages`` split over ``devices``, micro-batches pipelined through them.

    Args:
        stages: an ``nn.Sequential`` (or a list of modules) run in order; each layer takes
            and returns one tensor with the batch along dim 0 (a stage that changes the
            size of dim 0 raises ValueError when the batch is split into several micro-batches).
        devices: one device per stage, e.g. ``["cuda:0", "cuda:1"]`` (repeats allowed:
            ``["cpu", "cpu"]`` runs the same schedule on the CPU, the stages of one device one
            after another, so without overlap); CUDA devices must be visible (ValueError otherwise).
        chunks: micro-batches per step (>= 1; fewer when the batch is smaller), sizes
            differing by at most one (``x.tensor_split(chunks)``).
        balance: layers per device (ints summing to the layer count), or ``"time"`` /
            ``"memory"`` to choose them by profiling each layer on ``sample`` (see
            :meth:`balance_by`), or None for an even split by layer count.
        checkpoint: ``"never"``, ``"except_last"`` or ``"always"``: recompute a micro-batch's
            activations in the backward instead of keeping them.
        batchnorm: ``"deferred"`` (default: running statistics of the whole batch, updated
            once per step) or ``"micro"`` (every micro-batch updates them).
        output_device: where the output goes (default: the last stage's device).
        sample: a sample input batch, needed for ``balance="time"|"memory"``.

    Forward: ``model(x)`` with ``x`` [B, ...] on any device; returns [B, ...] on the output
    device. Parameters stay where the stages put them (``model.stage_devices``).
    """

    def __init__(
        self,
        stages: nn.Sequential | Sequence[nn.Module],
        devices: Sequence[torch.device | str | int],
        chunks: int = 4,
        balance: list[int] | tuple[int, ...] | Literal["time", "memory"] | None = None,
        checkpoint: Literal["never", "except_last", "always"] = "never",
        batchnorm: Literal["deferred", "micro"] = "deferred",
        output_device: torch.device | str | int | None = None,
        sample: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        layers = _layers(stages)
        if isinstance(devices, (str, int, torch.device)) or not devices:
            raise ValueError(f"argument `devices` must be a non-empty list of devices, got {devices!r}")
        devs = [_device_arg(d, "devices") for d in devices]
        _check_visible(devs, "devices")
        out_dev = devs[-1] if output_device is None else _device_arg(output_device, "output_device")
        _check_visible([out_dev], "output_device")
        if len(devs) > len(layers):
            raise ValueError(
                f"argument `devices` names {len(devs)} devices for {len(layers)} layers; each device needs "
                "at least one layer: pass fewer devices or split the model finer"
            )
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"argument `chunks` must be an int >= 1, got {chunks!r}")
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"argument `checkpoint` must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
        if batchnorm not in BATCHNORM_MODES:
            raise ValueError(f"argument `batchnorm` must be one of {BATCHNORM_MODES}, got {batchnorm!r}")
        if isinstance(balance, str):
            if balance not in BALANCE_BY:
                raise ValueError(f"argument `balance` must be a list of ints, 'time' or 'memory', got {balance!r}")
            if sample is None:
                raise ValueError(f"argument `balance`={balance!r} profiles the layers: pass `sample`, a sample batch")
            balance = self.balance_by(layers, sample, len(devs), by=balance)
        elif balance is None:
            balance = split_evenly(len(layers), len(devs))
        elif not isinstance(balance, (list, tuple)):
            raise TypeError(
                f"argument `balance` must be a list of ints (layers per device), 'time', 'memory' or None, "
                f"got {type(balance).__name__} {balance!r}"
            )
        balance = list(balance)
        if any(isinstance(b, bool) or not isinstance(b, int) for b in balance):
            raise TypeError(f"argument `balance` must hold ints (layers per device), got {balance!r}")
        if len(balance) != len(devs) or any(b < 1 for b in balance):
            raise ValueError(f"argument `balance` must hold one positive int per device ({len(devs)}), got {balance}")
        if sum(balance) != len(layers):
            raise ValueError(
                f"argument `balance` {balance} sums to {sum(balance)}, but the model has {len(layers)} layers"
            )
        if batchnorm == "deferred":  # in place: the caller's layers are the pipeline's
            memo: set[int] = set()
            for m in layers:
                DeferredBatchNorm.convert(m, memo)
        check_shared(layers, balance, devs)
        parts: list[nn.Module] = []
        start = 0
        for size, dev in zip(balance, devs):
            parts.append(nn.Sequential(*layers[start : start + size]).to(dev))
            start += size
        self.partitions = nn.ModuleList(parts)
        self.stage_devices = devs
        self.balance = balance
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.batchnorm = batchnorm
        self.output_device = out_dev
        self._streams: dict[int, Stream] = {}
        self._micro_count = 1

    @property
    def devices(self) -> list[torch.device]:
        """The distinct devices of the stages, in stage order (give them to the head)."""
        return list(dict.fromkeys(self.stage_devices))

    @staticmethod
    def balance_by(
        stages: nn.Sequential | Sequence[nn.Module],
        sample: torch.Tensor,
        partitions: int,
        by: Literal["time", "memory"] = "time",
    ) -> list[int]:
        """Layers per stage that balance ``by`` "time" (forward + backward, profiled on
        ``sample``) or "memory" (parameters, gradients, buffers, activations) over
        ``partitions`` stages. The layers are profiled where they are; returns the plan
        (a list of ints) so it can be printed and passed as ``balance=`` later."""
        layers = _layers(stages)
        if not isinstance(sample, torch.Tensor):
            raise TypeError(
                f"argument `sample` must be a Tensor (a sample input batch to profile the layers on), "
                f"got {type(sample).__name__}"
            )
        if isinstance(partitions, bool) or not isinstance(partitions, int) or not 1 <= partitions <= len(layers):
            raise ValueError(f"argument `partitions` must be an int in [1, {len(layers)}], got {partitions!r}")
        return partition(layer_costs(layers, sample, by), partitions)

    def memory_per_device(self) -> dict[torch.device, int]:
        """Bytes of parameters and buffers each device holds for the stages (what the head's
        ``shard_sizes`` can be balanced against, see :func:`shardkit.plan.balance_shards`)."""
        out = {d: 0 for d in self.devices}
        for part, dev in zip(self.partitions, self.stage_devices):
            out[dev] += sum(t.numel() * t.element_size() for t in list(part.parameters()) + list(part.buffers()))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B, ...] (any device; moved to the first stage) -> the model's output [B, ...]
        on ``output_device``, computed in ``min(chunks, B)`` pipelined micro-batches.

        Raises ``TypeError`` naming ``x`` for a non-tensor or a sparse / nested one,
        ``ValueError`` for an empty batch; a stage's exception is re-raised as it was."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"argument `x` must be a Tensor with the batch along dim 0, got {type(x).__name__}")
        if x.is_nested or x.layout != torch.strided:  # not split by tensor_split (a nested one has no shape)
            layout = "nested" if x.is_nested else str(x.layout)
            raise TypeError(f"argument `x` must be a dense (strided) tensor, got a {layout} one")
        if x.device.type not in ("cpu", "cuda"):
            where = ", ".join(map(str, self.devices))
            raise ValueError(f"argument `x` is on {x.device}; the stages run on {where}: give it data there")
        if x.dim() == 0 or x.shape[0] == 0:
            raise ValueError(f"argument `x` must have a non-empty batch along dim 0, got shape {tuple(x.shape)}")
        micro = list(x.tensor_split(min(self.chunks, x.shape[0])))
        if len(micro) > 1 and changes_its_input(self.partitions[0]):  # views of x share its version
            micro = [t.clone() for t in micro]  # counter: each in-place change would stale the others
        m = len(micro)
        self._micro_count = m
        deferred = (
            [mod for mod in self.partitions.modules() if isinstance(mod, DeferredBatchNorm)]
            if self.batchnorm == "deferred" and self.training
            else []
        )
        for mod in deferred:
            mod.begin_step(m)
        try:
            acts, events, streams = self._schedule(x, micro)
        finally:
            for mod in deferred:
                mod.end_step()
        # A non-blocking copy to the CPU would return before its data arrived (torch.cat on the
        # host would read it too early): only copies to a GPU are asynchronous.
        non_blocking = self.output_device.type == "cuda"
        out = torch.cat(
            [
                a.to(self.output_device, non_blocking=non_blocking) if a.device != self.output_device else a
                for a in self._join(acts, events, streams)
            ]
        )
        return out

    # ---- internals -----------------------------------------------------------------

    def _schedule(
        self, x: torch.Tensor, micro: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[Event | None], list[Stream | None]]:
        """The fill-drain clocks. The tasks of one clock that share a device (and so its random
        generator) run in stage order in one thread, the devices concurrently: dropout draws
        the same numbers run to run under one seed."""
        m, k = len(micro), len(self.partitions)
        streams = self._stage_streams(x)
        if streams[0] is not None and x.device == self.stage_devices[0]:
            x.record_stream(streams[0])  # the caller's tensor, read on stage 0's stream
        acts: list[torch.Tensor] = list(micro)
        events: list[Event | None] = [None] * m
        for clock in range(m + k - 1):
            per_device: dict[torch.device, list[tuple[int, int]]] = {}
            for s in range(k):
                if 0 <= clock - s < m:
                    per_device.setdefault(self.stage_devices[s], []).append((s, clock - s))
            groups = list(per_device.values())
            labels = [TaskLabel(m) for _ in groups]
            calls = [
                functools.partial(self._run_tasks, tasks, acts, events, streams, label)
                for tasks, label in zip(groups, labels)
            ]
            devices = [self.stage_devices[tasks[0][0]] for tasks in groups]
            for tasks, results in zip(groups, run_parallel(calls, devices, "PipelineModel", labels)):
                for (_, i), (y, event) in zip(tasks, results):
                    acts[i], events[i] = y, event
        return acts, events, streams

    def _run_tasks(
        self,
        tasks: list[tuple[int, int]],
        acts: list[torch.Tensor],
        events: list[Event | None],
        streams: Sequence[Stream | None],
        label: TaskLabel,
    ) -> list[tuple[torch.Tensor, Event | None]]:
        out = []
        for s, i in tasks:
            label.task = (s, i)
            with micro_batch(i):
                out.append(self._run_task(s, i, acts[i], events[i], streams))
        return out

    def _stage_streams(self, x: torch.Tensor) -> list[Stream | None]:
        """One CUDA stream per stage (None on CPUs); each first waits for the caller's stream
        on its device, which produced the input and the parameters."""
        if not any(d.type == "cuda" for d in self.stage_devices):
            return [None] * len(self.stage_devices)
        out: list[Stream | None] = []
        for s, dev in enumerate(self.stage_devices):
            if dev.type != "cuda":
                out.append(None)
                continue
            stream = self._streams.get(s)
            if stream is None or stream.device != dev:
                stream = self._streams[s] = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            if x.device.type == "cuda" and x.device != dev:
                stream.wait_stream(torch.cuda.current_stream(x.device))
            out.append(stream)
        return out

    def _run_task(
        self, s: int, i: int, x: torch.Tensor, ready: Event | None, streams: Sequence[Stream | None]
    ) -> tuple[torch.Tensor, Event | None]:
        last = i == self._micro_count - 1
        use_ckpt = self.checkpoint == "always" or (self.checkpoint == "except_last" and not last)
        if self.checkpoint != "never" and torch.is_grad_enabled():
            with rng_lock(self.stage_devices[s]):  # see the module docstring: recomputations replay the draws
                return self._launch(s, x, ready, streams, use_ckpt)
        return self._launch(s, x, ready, streams, use_ckpt)

    def _launch(
        self, s: int, x: torch.Tensor, ready: Event | None, streams: Sequence[Stream | None], use_ckpt: bool
    ) -> tuple[torch.Tensor, Event | None]:
        dev, stream, part = self.stage_devices[s], streams[s], self.partitions[s]
        if stream is None:
            if ready is not None and x.device.type == "cuda":
                # x was made on the previous stage's side stream; the copy to this (CPU) stage
                # runs on its device's current stream, which must wait for that work first
                torch.cuda.current_stream(x.device).wait_event(ready)
            y = self._run_stage(part, x.to(dev) if x.device != dev else x, use_ckpt, s)
            return y, None
        prev = streams[s - 1] if s > 0 and x.device.type == "cuda" else None
        with torch.cuda.stream(prev) if prev is not None else null_context(), torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            x_in = x.to(dev, non_blocking=True) if x.device != dev else x
            if x_in is x and x.device.type == "cuda":
                x.record_stream(stream)  # made on the previous stage's stream, used on this one
            y = self._run_stage(part, x_in, use_ckpt, s)
            event = torch.cuda.Event()
            event.record(stream)
        return y, event

    def _run_stage(self, part: nn.Module, x: torch.Tensor, use_ckpt: bool, s: int) -> torch.Tensor:
        if use_ckpt and torch.is_grad_enabled():
            y = run_checkpointed(part, x)
        else:
            y = part(x)
        if not isinstance(y, torch.Tensor):
            raise TypeError(
                f"PipelineModel: stage {s} (layers of partitions[{s}]) returned {type(y).__name__}; "
                "every stage must return one tensor with the batch along dim 0"
            )
        # A shape check only (no device sync). With several micro-batches, a stage that changes
        # dim 0 (e.g. x.mean(0)) would give each micro-batch's result, not the whole batch's.
        if y.dim() == 0 or (self._micro_count > 1 and y.shape[0] != x.shape[0]):
            raise ValueError(
                f"PipelineModel: stage {s} (layers of partitions[{s}]) turned a micro-batch of shape "
                f"{tuple(x.shape)} into shape {tuple(y.shape)}; PipelineModel splits the batch into "
                f"micro-batches ({self._micro_count} here) along dim 0, so every stage must keep dim 0 "
                "(the batch size) unchanged"
            )
        return y

    def _join(
        self, acts: list[torch.Tensor], events: Sequence[Event | None], streams: Sequence[Stream | None]
    ) -> list[torch.Tensor]:
        """The caller's streams wait for the last stage's work on every output."""
        last = streams[-1]
        if last is not None:
            current = torch.cuda.current_stream(self.stage_devices[-1])
            current.wait_stream(last)
            for a in acts:
                a.record_stream(current)
        return acts

    def extra_repr(self) -> str:
        return (
            f"devices={[str(d) for d in self.stage_devices]}, balance={self.balance}, chunks={self.chunks}, "
            f"checkpoint={self.checkpoint!r}, batchnorm={self.batchnorm!r}"
        )


def bubble_fraction(stages: int, chunks: int) -> float:
    """Idle fraction of the fill-drain schedule with equal stages: (K - 1) / (M + K - 1)."""
    return (stages - 1) / (chunks + stages - 1)
