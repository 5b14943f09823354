"""Pinned host staging for a CPU-resident ModelEMA of a CUDA model.

``push`` enqueues non-blocking device-to-host copies of the model tensors into one of two
sets of pinned buffers, on the current stream (so the copies read the weights the
optimizer step just wrote, and the next step cannot overwrite them before they are
read), and records a CUDA event per device. The CPU-side average for a set runs only once its
events have completed: at a later ``push`` (without waiting, unless both sets are still in
flight) or at ``drain`` (which waits). The host never blocks on the GPU in the steady
state; the GPU stream pays the copy time (model bytes / host link bandwidth).
"""

from __future__ import annotations

import collections
from typing import Callable, List, Sequence, Tuple

import torch

# apply(buffers, (decay, update count)): the CPU-side average of one landed set of buffers
Apply = Callable[[List[torch.Tensor], Tuple[float, int]], None]


def _pinned_like(t: torch.Tensor) -> torch.Tensor:
    """A pinned host buffer with ``t``'s shape, dtype and, when ``t`` is dense, strides.

    Keeping the strides of a dense tensor (e.g. a channels_last conv weight) makes the
    device-to-host copy one flat memcpy (no device-side contiguous temporary) and keeps
    the buffer flat-compatible with the EMA tensor (which ModelEMA creates with the
    model's strides), so the CPU update takes the fused kernel rather than the strided
    fallback."""
    dense = (
        t.is_contiguous()
        or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))
        or (t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d))
    )
    if dense:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=True)
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)


class HostStage:
    """Two sets of pinned buffers shaped like ``tensors`` (same dtypes), and the queue of
    copies in flight."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._bufs = [[_pinned_like(t) for t in tensors] for _ in range(2)]
        # Every CUDA device the model lives on (a model split over GPUs copies from each
        # device's current stream): one event per device per push.
        self._devices = list(dict.fromkeys(t.device for t in tensors if t.is_cuda))
        self._pending: collections.deque[Tuple[List[torch.cuda.Event], int, Tuple[float, int]]] = collections.deque()
        # (events, buffer set, (decay, update count))
        self._next = 0

    def push(self, tensors: Sequence[torch.Tensor], decay: Tuple[float, int], apply: Apply) -> None:
        """Starts copying ``tensors``; ``apply(buffers, decay)`` runs once they landed (``decay``:
        the update's (decay, count), kept with it)."""
        while self._pending and (len(self._pending) == 2 or all(e.query() for e in self._pending[0][0])):
            self._pop(apply)
        idx, self._next = self._next, self._next ^ 1
        for b, t in zip(self._bufs[idx], tensors):
            b.copy_(t.detach(), non_blocking=True)
        events = []
        for device in self._devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        self._pending.append((events, idx, decay))

    def drain(self, apply: Apply) -> None:
        """Waits for every copy in flight and applies it, oldest first."""
        while self._pending:
            self._pop(apply)

    def _pop(self, apply: Apply) -> None:
        events, idx, decay = self._pending.popleft()
        for event in events:
            event.synchronize()
        apply(self._bufs[idx], decay)
