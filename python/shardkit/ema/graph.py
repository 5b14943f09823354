"""The CUDA-graph path of ``ModelEMA(cuda_graph=True)``: for updates bound by host time.

The update of a fixed set of tensors (one ``ema_update_device_decay_`` per dtype group, the
integer buffers' copy) is captured once in a CUDA graph whose kernels read the decay from a
one-element device tensor; each update then costs a fill of that tensor and one graph
launch on the current stream, instead of the op's per-tensor host work (argument checks,
overlap check, grouping, the launch tables). The graph holds raw addresses, so it is
replayed only while the tensors given now have exactly the captured layout
(``shardkit._C.ema_layout``: address, size, strides, dtype of every tensor); any change
captures again (one device synchronization). Where the graph cannot serve (a pair that is
not contiguous or dense with equal strides, a capture of the caller's already running),
the eager update runs.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from shardkit.ops._ema import UpdateLists, update_layout

__all__ = ["GraphedEMA"]


class _Captured:
    """One captured update: the graph, the decay tensor it reads, the layout it baked in."""

    def __init__(self, lists: UpdateLists, layout: bytes, device: torch.device) -> None:
        ema_groups, model_groups, copy_to, copy_from = lists
        self.layout = layout
        self.decay = torch.zeros((), dtype=torch.float64, device=device)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' CUDA calls (a DataLoader's pin-memory thread) may go on
        with torch.cuda.device(device), torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            for e, m in zip(ema_groups, model_groups):
                if e:
                    torch.ops.shardkit.ema_update_device_decay_.default(e, m, self.decay)
            if copy_to:
                torch._foreach_copy_(copy_to, copy_from)


class GraphedEMA:
    """ModelEMA's graph state for an EMA on one CUDA device: the last capture, and how many."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.captures = 0
        self._captured: Optional[_Captured] = None

    def __getstate__(self) -> Dict[str, Any]:  # a pickled ModelEMA captures again where it is loaded
        return {"device": self.device, "captures": 0, "_captured": None}

    def run(self, lists: UpdateLists, d: float) -> bool:
        """The update of ``lists`` (``ema_update_lists``' four lists) with decay ``d`` from the
        graph; False (nothing done) where the eager update must run instead."""
        if torch.cuda.is_current_stream_capturing():
            return False  # inside the caller's own capture: eager ops are captured there
        layout = update_layout(*lists)
        if layout is None:
            return False
        if self._captured is None or self._captured.layout != layout:
            self._captured = None  # the old graph's memory goes before the new capture
            self._captured = _Captured(lists, layout, self.device)
            self.captures += 1
        captured = self._captured
        if torch.cuda.current_device() != self.device.index:
            with torch.cuda.device(self.device):
                captured.decay.fill_(d)
                captured.graph.replay()
        else:
            captured.decay.fill_(d)
            captured.graph.replay()
        return True
