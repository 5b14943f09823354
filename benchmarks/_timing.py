"""Timing helpers shared by the benchmark scripts in this folder.

All times are in seconds (scripts that print milliseconds convert at the call site).
On a CUDA device a call is timed by two CUDA events recorded on the current stream around
it, so the figure is GPU time of the work it queued, not host launch time; on the CPU by
``time.perf_counter`` wall clock.

The scripts import this module as ``_timing`` after putting their own folder on
``sys.path``, so they run from any working directory and with ``python -m``.
"""

import glob
import os
import statistics
import sys
import time

import torch

# Where the scripts write their JSON and PNG files: benchmarks/out/ (git-ignored), or the
# folder named by SHARDKIT_BENCH_OUT (benchmarks/gpu_suite.sh points it into its own
# output folder, so one run's files are collected in one place).
OUT_ENV = "SHARDKIT_BENCH_OUT"


def prefer_in_place_build():
    """Put the source tree's ``python/`` first on ``sys.path`` when it holds an in-place build
    of the extension (``python setup.py build_ext --inplace``); else the installed shardkit is
    the one imported (a source tree without ``_C`` would shadow it). Call before importing
    shardkit."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
    if glob.glob(os.path.join(src, "shardkit", "_C*.so")):  # the compiled module, not its _C.pyi stub
        sys.path.insert(0, src)


def checked_devices(parser, flag, names):
    """``names`` (device strings) as torch.devices; ``parser.error`` (exit 2, one line) for a name
    torch cannot parse or a CUDA device where no GPU is visible (torch's own error there is a
    traceback about the driver)."""
    devices = []
    for name in names:
        try:
            dev = torch.device(name)
        except RuntimeError as err:
            parser.error(f"{flag} {name!r}: {err}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            parser.error(f"{flag} {name!r}: no CUDA GPU is visible on this machine (use cpu)")
        devices.append(dev)
    return devices


def out_dir():
    """The folder for benchmark outputs (created): $SHARDKIT_BENCH_OUT or benchmarks/out."""
    path = os.environ.get(OUT_ENV) or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(path, exist_ok=True)
    return path


def target_line(name, ok, detail):
    """One line of an issue target's verdict, printed the same way by every script:
    ``TARGET <PASS|FAIL|n/a> <name>: <detail>`` (``ok`` None = could not be measured)."""
    verdict = "n/a " if ok is None else ("PASS" if ok else "FAIL")
    line = f"TARGET {verdict} {name}: {detail}"
    print(line, flush=True)
    return {"target": name, "ok": ok, "detail": detail}


def cpu_description():
    """The CPU model, its logical cores, torch's thread count and the vector ISA flags that
    matter to the kernels (CPU figures only compare on the same machine)."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    isa = [f for f in ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return (
        f"{model}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}, "
        f"ISA {' '.join(isa) or 'unknown'}"
    )


SYNCS = ("event", "device")


def time_once(fn, device, sync="event"):
    """Seconds of one call of ``fn()`` on ``device`` (a ``torch.device``).

    ``sync`` says how the host waits for a CUDA call before reading the events: ``"event"``
    waits for the end event alone; ``"device"`` calls ``torch.cuda.synchronize()``, which
    also waits for work queued on other streams of the current device. Ignored on the CPU.
    """
    if sync not in SYNCS:
        raise ValueError(f"argument `sync` must be one of {SYNCS}, got {sync!r}")
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if sync == "device":
            torch.cuda.synchronize()
        else:
            end.synchronize()
        return start.elapsed_time(end) / 1e3  # elapsed_time is in ms
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_all(fn, device, reps, warmup=2, sync="event", sync_after_warmup=False):
    """List of ``reps`` per-call seconds of ``fn()``, after ``warmup`` untimed calls.

    ``sync_after_warmup``: on CUDA, ``torch.cuda.synchronize()`` once after the warm-up so
    the first timed call does not start behind a queue of warm-up work. ``sync`` as in
    :func:`time_once`.
    """
    for _ in range(warmup):
        fn()
    if sync_after_warmup and device.type == "cuda":
        torch.cuda.synchronize()
    return [time_once(fn, device, sync) for _ in range(reps)]


def time_median(fn, device, reps, warmup=2, sync="event", sync_after_warmup=False):
    """Median seconds of ``fn()`` over ``reps`` timed calls (arguments as :func:`time_all`)."""
    return statistics.median(time_all(fn, device, reps, warmup, sync, sync_after_warmup))


def copy_bandwidth(nbytes, device, reps, warmup=2, sync="event", sync_after_warmup=False, burst=1):
    """Bytes/s of a device-local copy of a float32 tensor of ``nbytes`` bytes, read + write
    counted (2 * nbytes per copy), from the median of ``reps`` timed ``copy_`` calls (each
    timing ``burst`` calls back to back). Timing arguments as :func:`time_all`. The
    benchmarks' memory-bound floor is their bytes over this rate."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = time_median(burst_of(lambda: dst.copy_(src), burst), device, reps, warmup, sync, sync_after_warmup)
    return 2 * nbytes * burst / seconds


def burst_of(fn, burst):
    """``fn`` called ``burst`` times back to back (one timing then covers them all: on a GPU
    the host cost of one call then overlaps the device time of the previous one)."""
    if burst == 1:
        return fn
    return lambda: [fn() for _ in range(burst)]
