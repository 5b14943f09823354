"""Running per-device calls in threads that carry the caller's grad mode, autocast state
and CUDA streams (the parallel-apply half of ``shardkit.parallel``)."""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
import traceback
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch

_slots: list[_Slot] = []
_slots_lock = threading.Lock()
_worker = threading.local()


class _Slot:
    """A long-lived worker thread for chunk k. One thread per chunk index (rather than a
    shared pool) guarantees the K chunks really run concurrently; starting K threads per
    step would cost more than a small criterion itself."""

    def __init__(self, k: int) -> None:
        self.queue: queue.SimpleQueue[tuple[Callable[[], None], threading.Lock]] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=f"shardkit-parallel-{k}", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, done = self.queue.get()
            try:
                fn()
            finally:
                # Hold nothing of a finished task while waiting for the next one: a failed
                # task's closure holds its exception, and so the frames and tensors of its traceback.
                del fn
                done.release()

    def submit(self, fn: Callable[[], None]) -> threading.Lock:
        """Queues fn; returns a lock held until fn has run (``acquire()`` waits for it). A
        bare lock is the cheapest wait there is (threading.Event goes through a Condition)."""
        done = threading.Lock()
        done.acquire()
        self.queue.put((fn, done))
        return done


def _after_fork_in_child() -> None:
    # A forked child inherits the slots but not their threads: work queued to them would wait
    # forever. It starts threads of its own on its first call.
    global _slots_lock
    _slots.clear()
    _slots_lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _slot(k: int) -> _Slot:
    with _slots_lock:
        while len(_slots) <= k:
            _slots.append(_Slot(len(_slots)))
        return _slots[k]


_NO_RANGE = contextlib.nullcontext()


def profiler_range(name: str) -> ContextManager[object]:
    """``record_function(name)`` while the torch profiler runs, else a no-op: entering a
    record_function costs ~20 us even with no profiler, a tenth of a small criterion call."""
    if torch._C._autograd._profiler_enabled():
        return torch.autograd.profiler.record_function(name)
    return _NO_RANGE


def _default_devices() -> list[torch.device]:
    """The default devices of the caller's function-mode stack (``torch.set_default_device``,
    ``with torch.device(...)``), bottom first; a worker thread enters them again."""
    if torch._C._len_torch_function_stack() == 0:
        return []
    from torch.utils._device import DeviceContext

    stack = torch.overrides._get_current_function_mode_stack()
    return [m.device for m in stack if isinstance(m, DeviceContext)]


class ThreadState:
    """The caller's thread-local state that a worker thread must see: grad mode, inference
    mode, autocast (per device type: enabled, dtype, cache), the default device
    (``torch.set_default_device`` is per thread) and the current CUDA stream of every device
    of the call."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = [(dt, torch.get_autocast_dtype(dt)) for dt in ("cpu", "cuda") if torch.is_autocast_enabled(dt)]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.streams = {d: torch.cuda.current_stream(d) for d in set(devices) if d.type == "cuda"}
        self.default_devices = _default_devices()

    @contextlib.contextmanager
    def applied(self, device: torch.device) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for default in self.default_devices:  # the caller's default device for factory calls
                stack.enter_context(torch.device(default))
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=self.autocast_cache))
            # The caller's stream on EVERY device of the call, not only the worker's own: a
            # module spread over the devices (a class-sharded head under DataParallelCriterion)
            # also works on the others, and must queue there behind the caller's work. The
            # worker's own device becomes current last (setting a stream switches devices).
            for stream in self.streams.values():
                stack.enter_context(torch.cuda.stream(stream))
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
            yield


def caller_thread_only() -> bool:
    """Whether the caller's thread holds state that a worker thread would not see and that
    ThreadState cannot carry: a ``torch.func`` transform (grad, vmap, jacrev), a torch
    dispatch mode (``FlopCounterMode``), a function mode other than a default device or
    saved-tensor hooks (``save_on_cpu``, a non-reentrant checkpoint around the call). Run on
    workers, the calls would compute outside them: wrong gradients under ``torch.func.grad``,
    uncounted FLOPs, activations not offloaded. Such calls run one after another on the
    caller's thread instead."""
    if torch._C._functorch.maybe_current_level() is not None:
        return True
    if torch._C._len_torch_dispatch_stack() > 0:
        return True
    if torch._C._len_torch_function_stack() > 0 and len(_default_devices()) < torch._C._len_torch_function_stack():
        return True  # a function mode other than a default device (which ThreadState carries)
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top_hooks is not None and top_hooks(False) is not None


def same_device_order(devices: Sequence[torch.device]) -> list[int | None]:
    """For :func:`run_parallel`'s ``after``: each call waits for the previous call on its device
    (calls sharing a device share its random generator: their draws then come in call order,
    so a seeded step repeats; calls on distinct devices stay concurrent)."""
    last: dict[torch.device, int] = {}
    after: list[int | None] = []
    for k, d in enumerate(devices):
        after.append(last.get(d))
        last[d] = k
    return after


def run_parallel(
    calls: Sequence[Callable[[], Any]],
    devices: Sequence[torch.device],
    owner: str,
    labels: Sequence[object] | None = None,
    after: Sequence[int | None] | None = None,
) -> list[Any]:
    """Runs ``calls[k]()`` for every k concurrently, call k on ``devices[k]`` under the caller's
    thread state; returns the results in order. Call 0 runs in the calling thread. ``after[k]``
    (an index below k, or None): call k starts once that call has finished. A failing
    call's exception is re-raised here, same type and message, with its original traceback
    and a note naming the call (``labels[k]``, default "chunk k of K") and the device."""
    state = ThreadState(devices)
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)
    finished = [threading.Event() for _ in calls] if after is not None else []

    def work(k: int) -> None:
        nested = getattr(_worker, "active", False)
        _worker.active = True
        try:
            first = after[k] if after is not None else None
            if first is not None:
                finished[first].wait()
            if k == 0 and devices[0].type == "cpu":  # the caller's own thread and state: nothing to apply
                results[0] = calls[0]()
                return
            with state.applied(devices[k]):
                results[k] = calls[k]()
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller)
            # Drop the failed call's frames' locals here, in the thread that ran it: a call that
            # raised inside torch.utils.checkpoint leaves that checkpoint's saved-tensor hooks
            # installed on this thread until its suspended generator is collected, and collected
            # later in the caller's thread it would pop that thread's hooks instead (torch's
            # "!tls.stack.empty()" assert) and leave this worker saving into the failed call.
            # The traceback keeps its lines; only the frames' local variables go.
            traceback.clear_frames(e.__traceback__)
            errors[k] = e
        finally:
            _worker.active = nested
            if finished:
                finished[k].set()

    if len(calls) == 1 or getattr(_worker, "active", False) or caller_thread_only():
        # Inside a worker already (nested data parallelism): run in order rather than wait
        # on the pool from one of its own threads. Under a transform, mode or hooks of the
        # caller's thread (see caller_thread_only): in order, on that thread.
        for k in range(len(calls)):
            work(k)
    else:
        pending = [_slot(k).submit(functools.partial(work, k)) for k in range(1, len(calls))]
        work(0)
        for done in pending:
            done.acquire()
    failed = next((k for k, e in enumerate(errors) if e is not None), None)
    if failed is None:
        return results
    error = errors[failed]
    assert error is not None  # `failed` is the first call whose error is set
    errors.clear()  # the traceback holds this frame, whose closure holds `errors`: no cycle
    results.clear()
    label = labels[failed] if labels is not None else f"chunk {failed} of {len(calls)}"
    error.add_note(f"(raised in the {owner} call for {label}, on device {devices[failed]})")
    try:
        raise error.with_traceback(error.__traceback__)
    finally:
        error = None
