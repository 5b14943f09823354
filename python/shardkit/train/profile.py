"""``--profile N``: where the time of a step goes. N optimizer steps (after one warm-up step;
N <= MAX_PROFILE_STEPS) with each phase timed, a verdict naming the flag to try, a torch
profiler trace of the first TRACE_STEPS of them (``<out>/profile_trace.json``, open it in
https://ui.perfetto.dev or chrome://tracing) and a bar chart (``<out>/profile.png``).
Nothing is saved to the checkpoint.

Phases are timed on the host. On GPUs each phase is also timed on the devices, by CUDA
events recorded on each device's current stream where the phase starts and ends, read once
after the profiled steps: nothing synchronizes between phases, so the steps run as in a
normal run (GPU work still overlaps the host), and a phase's device time is its span on the
device's timeline (its kernels, plus any wait for the host to queue them). The verdict uses
the device times there, and the host time of "data wait" (the loader is host work).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
import warnings
from collections import defaultdict
from typing import TYPE_CHECKING, Dict, Iterator, List, Sequence, Tuple

import torch

if TYPE_CHECKING:
    from shardkit.train.log import RunLog
    from shardkit.train.setup import Parts
    from shardkit.train.world import World

# (start, end) events of one occurrence of a phase, one pair per CUDA device
_Pairs = List[Tuple[torch.cuda.Event, torch.cuda.Event]]

TRACE_STEPS = 20  # profiled steps kept in the trace (the profiler's memory grows with each)
PHASES = ("data wait", "host-to-device", "normalize", "backbone fwd", "head", "backward", "optimizer", "EMA")


class _Timer:
    """Host seconds per phase; with CUDA devices also a (start, end) event pair per device for
    every occurrence of every phase (see the module notes)."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.cuda = [d for d in dict.fromkeys(devices) if d.type == "cuda"]
        self.total: defaultdict[str, float] = defaultdict(float)
        # phase -> [[(start, end) per CUDA device] per occurrence]
        self.marks: defaultdict[str, List[_Pairs]] = defaultdict(list)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in self.cuda]
        for d, (start, _) in zip(self.cuda, pairs):
            start.record(torch.cuda.current_stream(d))
        t0 = time.perf_counter()
        with torch.profiler.record_function(phase):
            yield
        self.total[phase] += time.perf_counter() - t0
        for d, (_, end) in zip(self.cuda, pairs):
            end.record(torch.cuda.current_stream(d))
        if pairs:
            self.marks[phase].append(pairs)

    def device_seconds(self) -> Dict[str, float]:
        """Per phase, the sum over its occurrences of the longest span among the devices
        (waits for every device first)."""
        for d in self.cuda:
            torch.cuda.synchronize(d)
        return {
            phase: sum(max(s.elapsed_time(e) for s, e in pairs) for pairs in occurrences) / 1000.0
            for phase, occurrences in self.marks.items()
        }


def _step(parts: Parts, args: argparse.Namespace, index: int, per_epoch: int, timer: _Timer) -> None:
    dev0 = parts.devices[0]
    for micro in range(args.accumulate):
        with timer("data wait"):
            images, labels = parts.batches.get(index * args.accumulate + micro, per_epoch * args.accumulate)
        with timer("host-to-device"):
            images, labels = images.to(dev0, non_blocking=True), labels.to(dev0, non_blocking=True)
        with parts.autocast():
            with timer("normalize"):
                x = parts.normalize(images)
            with timer("backbone fwd"):
                emb = parts.backbone_train(x)
        with timer("head"):
            if parts.criterion is not None:  # --dp
                loss = parts.criterion(emb, labels)
            else:
                loss = parts.head(emb.float() if args.amp == "fp16" else emb, labels)
        with timer("backward"):
            scaled = loss / args.accumulate
            parts.scaler.scale(scaled).backward() if parts.scaler is not None else scaled.backward()
    with timer("optimizer"):
        for opt in parts.optimizers:
            parts.scaler.step(opt) if parts.scaler is not None else opt.step()
        if parts.scaler is not None:
            parts.scaler.update()
        for opt in parts.optimizers:
            opt.zero_grad(set_to_none=True)
    with timer("EMA"):
        if parts.ema is not None:
            parts.ema.update(parts.backbone)


def verdict(shares: Dict[str, float], on_gpu: bool) -> str:
    """The bottleneck and the flag to try, from each phase's share of the step time."""
    data = shares["data wait"]
    host = shares["host-to-device"] + shares["normalize"] + shares["optimizer"] + shares["EMA"]
    compute = shares["backbone fwd"] + shares["head"] + shares["backward"]
    if data >= 0.3:
        return "input-bound: the step waits for data; try --workers N, or --cache-ram decoded with --data"
    if not on_gpu:
        return "host-bound (CPU compute): the model runs on the CPU; try --devices cuda:0 on a GPU machine"
    if compute >= 0.6:
        return "GPU-bound: compute dominates; try --amp bf16 (or fp16), or --dp over more --devices"
    if host >= 0.3:
        return "host-bound: copies, optimizer or EMA dominate; try a larger --batch, or --amp to halve the traffic"
    return "balanced: no phase dominates"


def run(parts: Parts, args: argparse.Namespace, steps_per_epoch: int, lr: float, log: RunLog, world: World) -> int:
    """Profile ``args.profile`` steps from step 0 at learning rate ``lr``; print the table and
    verdict (the rate of every rank's images, as training reports it); write the trace and
    chart (rank 0's; under torchrun each other rank writes ``..._rank<r>``)."""
    parts.backbone_train.train()
    n = args.profile
    timer = _Timer(parts.devices)
    for opt in parts.optimizers:
        for g in opt.param_groups:
            g["lr"] = lr
    _step(parts, args, 0, steps_per_epoch, _Timer(parts.devices))  # warm-up: first-call costs
    sfx = f"_rank{world.rank}" if world.rank else ""
    trace = os.path.join(args.out, f"profile_trace{sfx}.json")
    t0 = time.perf_counter()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if timer.cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    elif not torch.cuda.is_available():
        # Without a GPU, torch's profiler (2.15) logs "ERROR ... gpuGetDeviceCount failed" from
        # its own device query; a level of its own log (the user's, where set) keeps it quiet.
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    # The trace holds the first TRACE_STEPS profiled steps: the profiler keeps every event it
    # records in host memory (tens of MB per step), so a long --profile would run out of it.
    # The phase table covers all n steps.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Profiler won't be using warmup")  # the warm-up step ran above
        schedule = torch.profiler.schedule(wait=0, warmup=0, active=min(n, TRACE_STEPS), repeat=1)
        prof = torch.profiler.profile(activities=activities, schedule=schedule, acc_events=True)
    stepping = 0.0  # the profiler's own prof.step() calls: the last active one processes every event
    with prof:
        for i in range(1, n + 1):
            _step(parts, args, i, steps_per_epoch, timer)
            t1 = time.perf_counter()
            prof.step()
            stepping += time.perf_counter() - t1
        device = timer.device_seconds() if timer.cuda else None  # waits for the devices
        wall = time.perf_counter() - t0 - stepping  # the steps' time (the profiler's event processing left out)
    os.makedirs(args.out, exist_ok=True)
    prof.export_chrome_trace(trace)
    # What the verdict weighs: host times on the CPU; on GPUs the device spans, and the host
    # time of "data wait".
    used = dict(timer.total) if device is None else {p: device.get(p, 0.0) for p in PHASES}
    if device is not None:
        used["data wait"] = timer.total["data wait"]
    timed = sum(used.get(p, 0.0) for p in PHASES)
    shares = {p: used.get(p, 0.0) / max(timed, 1e-12) for p in PHASES}
    images = n * args.batch * args.accumulate * world.size  # every rank's (training's img/s is the job's)
    log.line(f"\nprofile: {n} steps, {1000 * wall / n:.1f} ms/step, {images / wall:.0f} img/s (profiler on)")
    if device is None:
        log.line(f"  {'phase':<16} {'ms/step':>9} {'share':>7}")
        for p in PHASES:
            log.line(f"  {p:<16} {1000 * timer.total[p] / n:>9.2f} {100 * shares[p]:>6.1f}%")
    else:
        log.line(f"  {'phase':<16} {'host ms':>9} {'device ms':>10} {'share':>7}   (device: CUDA events, no syncs)")
        for p in PHASES:
            log.line(
                f"  {p:<16} {1000 * timer.total[p] / n:>9.2f} {1000 * device.get(p, 0.0) / n:>10.2f} "
                f"{100 * shares[p]:>6.1f}%"
            )
    log.line(f"verdict: {verdict(shares, device is not None)}")
    chart = os.path.join(args.out, f"profile{sfx}.png")
    _chart(shares, {p: 1000 * used.get(p, 0.0) / n for p in PHASES}, chart)
    traced = f"steps 1-{min(n, TRACE_STEPS)}" if n > 1 else "step 1"
    log.line(f"trace: {trace} ({traced}; open in https://ui.perfetto.dev)   chart: {chart}")
    return 0


def _chart(shares: Dict[str, float], ms: Dict[str, float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = list(PHASES)[::-1]
    ax.barh(names, [ms[p] for p in names], color="C0")
    for y, p in enumerate(names):
        ax.text(ms[p], y, f" {100 * shares[p]:.0f}%", va="center", fontsize=8)
    ax.set_xlabel("milliseconds per optimizer step")
    ax.set_title("python -m shardkit.train --profile: where a step's time goes")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
