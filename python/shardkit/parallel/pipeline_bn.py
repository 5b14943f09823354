"""BatchNorm inside a pipeline: micro-batches are normalized with their own statistics,
but the running statistics can still be those of the whole batch (:class:`DeferredBatchNorm`),
and a checkpoint's recomputation must not update them twice
(:func:`no_running_stats_update`)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


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
            saved.append((m, "momentum", m.momentum, m.num_batches_tracked))
            m.momentum = 0.0  # running = 1 * running + 0 * batch: unchanged
    try:
        yield
    finally:
        for m, attr, value, counter in saved:
            setattr(m, attr, value)
            if counter is not None:
                counter.sub_(1)  # the forward counted this batch once more


class DeferredBatchNorm(_BatchNorm):
    """BatchNorm whose running statistics are updated once per step from every micro-batch
    of the step (each micro-batch's mean and variance, merged in float64), as one forward of the whole batch
    would update them; each micro-batch is still normalized with its own statistics.
    Same parameters, buffers and state_dict keys as the layer it replaces."""

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
        self.recomputing = False
        self._expected = 1
        self._seen = 0
        # this step's (count, mean, sum of squared deviations) so far, float64
        self._acc: tuple[int, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """``module`` with every BatchNorm{1,2,3}d that tracks running statistics replaced by
        a DeferredBatchNorm sharing its Parameters and buffers (SyncBatchNorm is left alone)."""
        if type(module) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d) and module.track_running_stats:
            new = cls.__new__(cls)
            nn.Module.__init__(new)
            new.__dict__.update(
                {k: v for k, v in module.__dict__.items() if k not in ("_parameters", "_buffers", "_modules")}
            )
            new._parameters = dict(module._parameters)
            new._buffers = dict(module._buffers)
            new._modules = dict(module._modules)
            new.recomputing, new._expected, new._seen, new._acc = False, 1, 0, None
            return new
        for name, child in list(module.named_children()):
            converted = cls.convert(child)
            if converted is not child:
                setattr(module, name, converted)
        return module

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def begin_step(self, micro_batches: int) -> None:
        """Called by the pipeline before each forward: how many micro-batches make the step."""
        self._expected, self._seen, self._acc = micro_batches, 0, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training:
            return super().forward(x)
        if not self.recomputing:
            self._accumulate(x.detach())
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def _accumulate(self, x: torch.Tensor) -> None:
        # built with track_running_stats=True (convert() replaces only such layers)
        assert self.running_mean is not None and self.running_var is not None and self.num_batches_tracked is not None
        # Each micro-batch's mean and variance in one pass (torch's var_mean: no E[x^2] - E[x]^2,
        # which in float32 lost a small spread around a large mean), merged across micro-batches
        # in float64 by Chan et al.'s pairwise rule.
        dims = [0] + list(range(2, x.dim()))
        xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
        var, mean = torch.var_mean(xf, dims, correction=0)
        n = x.numel() // x.shape[1]
        part = (n, mean.double(), var.double() * n)
        prev = self._acc
        if prev is None:
            self._acc = acc = part
        else:
            total = prev[0] + part[0]
            delta = part[1] - prev[1]
            self._acc = acc = (
                total,
                prev[1] + delta * (part[0] / max(total, 1)),
                prev[2] + part[2] + delta * delta * (prev[0] * part[0] / max(total, 1)),
            )
        self._seen += 1
        if self._seen < self._expected:
            return
        count, mean64, m2 = acc
        self._acc, self._seen = None, 0
        unbiased = m2 / max(count - 1, 1)
        self.num_batches_tracked.add_(1)
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.lerp_(mean64.to(self.running_mean.dtype), momentum)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)
