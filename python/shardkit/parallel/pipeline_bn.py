"""BatchNorm inside a pipeline: micro-batches are normalized with their own statistics,
but the running statistics can still be those of the whole batch (:class:`DeferredBatchNorm`),
and a checkpoint's recomputation must not update them twice
(:func:`no_running_stats_update`)."""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Iterator, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

_task = threading.local()  # .micro: the micro-batch a pipeline task of this thread runs (else absent)


@contextlib.contextmanager
def micro_batch(index: int) -> Iterator[None]:
    """Marks the calls within the block as the pipeline's micro-batch ``index`` (what
    :class:`DeferredBatchNorm` merges per use; calls outside any block act as plain BatchNorm)."""
    saved = getattr(_task, "micro", None)
    _task.micro = index
    try:
        yield
    finally:
        _task.micro = saved


@contextlib.contextmanager
def no_running_stats_update(module: nn.Module) -> Iterator[None]:
    """Within the block, BatchNorm layers of ``module`` in training mode normalize with the
    batch's statistics as usual but leave running statistics and counters as they were
    (what a recomputation of an already-counted forward needs). The layers still get their
    running buffers (momentum 0), so a checkpoint's recomputation saves the same tensors as
    the original forward did."""
    saved: list[tuple[nn.Module, str, object, torch.Tensor | None]] = []
    for m in module.modules():
        if isinstance(m, DeferredBatchNorm):
            saved.append((m, "recomputing", m.recomputing, None))
            m.recomputing = True
        elif isinstance(m, _BatchNorm) and m.training and m.track_running_stats:
            counter = m.num_batches_tracked
            saved.append((m, "momentum", m.momentum, None if counter is None else counter.clone()))
            m.momentum = 0.0  # running = 1 * running + 0 * batch: unchanged
    try:
        yield
    finally:
        for m, attr, value, count in saved:
            setattr(m, attr, value)
            now = getattr(m, "num_batches_tracked", None)
            if count is not None and isinstance(now, torch.Tensor):
                # as it was: the recomputation counted each use of the layer once more (none if it
                # failed before reaching it)
                now.copy_(count)


class DeferredBatchNorm(_BatchNorm):
    """BatchNorm whose running statistics are updated once per pipeline step from every
    micro-batch of the step (each micro-batch's mean and variance, merged in float64), as one
    forward of the whole batch would update them; each micro-batch is still normalized with
    its own statistics. A layer applied several times per forward (a block run twice)
    updates once per use, in use order, as the unsplit model does. Called outside a
    pipeline step (the caller's own model, or ``batchnorm="micro"``) it is plain BatchNorm.
    Same parameters, buffers and state_dict keys as the layer it replaces;
    :meth:`convert` makes a :class:`DeferredBatchNorm1d` / ``2d`` / ``3d``, which is still an
    instance of the BatchNorm class it replaces and checks its input's dimensions the same way."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, True, device=device, dtype=dtype)
        self._reset_step(1, False)

    def _reset_step(self, micro_batches: int, active: bool) -> None:
        self.recomputing = False
        self._expected, self._active = micro_batches, active
        self._uses: dict[int, int] = {}  # micro-batch -> calls so far this step
        # per use: (micro-batches seen, count, mean, sum of squared deviations), float64
        self._acc: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        self._stream: torch.cuda.Stream | None = None  # where the accumulators were made (CUDA)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "_uses" not in state:  # pickled by an earlier version (which counted calls)
            self._reset_step(1, False)

    @classmethod
    def convert(cls, module: nn.Module, memo: set[int] | None = None) -> nn.Module:
        """``module`` with every BatchNorm{1,2,3}d that tracks running statistics turned, in
        place (the same object: its class is swapped), into a DeferredBatchNorm{1,2,3}d with
        the same Parameters and buffers (SyncBatchNorm is left alone). A subclass of those
        (its forward may do more, e.g. an activation) is left as it is, with a warning: its
        running statistics update once per micro-batch. Returns ``module``."""
        memo = set() if memo is None else memo
        if id(module) in memo:
            return module
        memo.add(id(module))
        kind = _DEFERRED.get(type(module))
        if kind is not None and module.track_running_stats:
            module.__class__ = kind  # (a subclass adding no slots: the same object, the caller's)
            cast(DeferredBatchNorm, module)._reset_step(1, False)
            return module
        if (
            isinstance(module, _BatchNorm)
            and module.track_running_stats
            and not isinstance(module, (DeferredBatchNorm, nn.SyncBatchNorm))
            and type(module) not in _WARNED
        ):
            _WARNED.add(type(module))
            warnings.warn(
                f"PipelineModel(batchnorm='deferred'): {type(module).__name__} is a subclass of a BatchNorm class, "
                "whose forward may do more than BatchNorm's, so it is not deferred: its running statistics update "
                "once per micro-batch (batchnorm='micro'), not once per step",
                stacklevel=3,
            )
        for child in module._modules.values():  # every name, repeated layers included
            if child is not None:
                cls.convert(child, memo)
        return module

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def begin_step(self, micro_batches: int) -> None:
        """Called by the pipeline before each forward: how many micro-batches make the step."""
        self._reset_step(micro_batches, True)

    def end_step(self) -> None:
        """Called by the pipeline after each forward (also a failed one): every use that saw all
        the step's micro-batches updates the running statistics, in use order; then the layer
        is plain BatchNorm again until the next step."""
        acc, expected, stream = self._acc, self._expected, self._stream
        self._reset_step(1, False)
        # On the stream that made the accumulators (the stage's), as when the last micro-batch's
        # forward updated them: the caller's stream has not waited for the stage streams here.
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for seen, count, mean64, m2 in acc:
                if seen == expected:
                    self._update(count, mean64, m2)
        if stream is not None:  # what runs next on the caller's stream sees the updated statistics
            torch.cuda.current_stream(stream.device).wait_stream(stream)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training:
            return super().forward(x)
        if self.recomputing:  # a checkpoint's recomputation: the step already counted this batch
            return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
        micro = getattr(_task, "micro", None)
        if micro is None or not self._active:  # outside a deferred pipeline step: plain BatchNorm
            return super().forward(x)
        self._accumulate(x.detach(), micro)
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def _accumulate(self, x: torch.Tensor, micro: int) -> None:
        # Each micro-batch's mean and variance in one pass (torch's var_mean: no E[x^2] - E[x]^2,
        # which in float32 lost a small spread around a large mean), merged across micro-batches
        # in float64 by Chan et al.'s pairwise rule.
        use = self._uses.get(micro, 0)
        self._uses[micro] = use + 1
        if x.is_cuda:
            self._stream = torch.cuda.current_stream(x.device)
        dims = [0] + list(range(2, x.dim()))
        xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
        var, mean = torch.var_mean(xf, dims, correction=0)
        n = x.numel() // x.shape[1]
        part = (1, n, mean.double(), var.double() * n)
        if use == len(self._acc):
            self._acc.append(part)
            return
        seen, count, mean0, m2 = self._acc[use]
        total = count + n
        delta = part[2] - mean0
        self._acc[use] = (
            seen + 1,
            total,
            mean0 + delta * (n / max(total, 1)),
            m2 + part[3] + delta * delta * (count * n / max(total, 1)),
        )

    @torch.no_grad()
    def _update(self, count: int, mean64: torch.Tensor, m2: torch.Tensor) -> None:
        # built with track_running_stats=True (convert() replaces only such layers)
        assert self.running_mean is not None and self.running_var is not None and self.num_batches_tracked is not None
        unbiased = m2 / max(count - 1, 1)
        self.num_batches_tracked.add_(1)
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.lerp_(mean64.to(self.running_mean.dtype), momentum)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)


class DeferredBatchNorm1d(DeferredBatchNorm, nn.BatchNorm1d):
    """:class:`DeferredBatchNorm` replacing an ``nn.BatchNorm1d`` (still an instance of it)."""

    _check_input_dim = nn.BatchNorm1d._check_input_dim


class DeferredBatchNorm2d(DeferredBatchNorm, nn.BatchNorm2d):
    """:class:`DeferredBatchNorm` replacing an ``nn.BatchNorm2d`` (still an instance of it)."""

    _check_input_dim = nn.BatchNorm2d._check_input_dim


class DeferredBatchNorm3d(DeferredBatchNorm, nn.BatchNorm3d):
    """:class:`DeferredBatchNorm` replacing an ``nn.BatchNorm3d`` (still an instance of it)."""

    _check_input_dim = nn.BatchNorm3d._check_input_dim


_WARNED: set[type] = set()  # the BatchNorm subclasses warned about, once each
_DEFERRED: dict[type, type[DeferredBatchNorm]] = {
    nn.BatchNorm1d: DeferredBatchNorm1d,
    nn.BatchNorm2d: DeferredBatchNorm2d,
    nn.BatchNorm3d: DeferredBatchNorm3d,
}
