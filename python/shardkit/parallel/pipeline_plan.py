"""The balance plan of :class:`shardkit.parallel.PipelineModel`: how many consecutive layers
each stage gets, evenly by count or by profiled cost (forward + backward time, or memory)
with an exact minimax partition."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Sequence

import torch
from torch import nn

BALANCE_BY = ("time", "memory")  # what balance_by / layer_costs profile


def split_evenly(num_layers: int, parts: int) -> list[int]:
    """Layer counts of ``parts`` contiguous stages as even as possible (first ones larger)."""
    base, extra = divmod(num_layers, parts)
    return [base + (k < extra) for k in range(parts)]


def partition(costs: Sequence[float], parts: int) -> list[int]:
    """Layer counts of ``parts`` contiguous, non-empty stages minimizing the largest stage
    cost (exact, by dynamic programming over the prefix sums)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[p][i]: the smallest max-stage cost of the first i layers in p stages
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for p in range(1, parts + 1):
        for i in range(p, n + 1):
            for j in range(p - 1, i):
                value = max(best[p - 1][j], prefix[i] - prefix[j])
                if value < best[p][i]:
                    best[p][i], cut[p][i] = value, j
    sizes, i = [], n
    for p in range(parts, 0, -1):
        j = cut[p][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def layer_costs(layers: Sequence[nn.Module], sample: torch.Tensor, by: str, repeats: int = 3) -> list[float]:
    """Per-layer cost on ``sample`` (run through the layers in order, where the layers are):
    ``"time"``: the median of ``repeats`` forward + backward times in seconds;
    ``"memory"``: bytes of parameters, their gradients and buffers plus the output
    activation kept for the backward. The layers are left as they were: their buffers
    (BatchNorm's running statistics), gradients and the random generators' states are
    restored, so profiling changes nothing a training run or a checkpoint sees."""
    if by not in BALANCE_BY:
        raise ValueError(f"argument `by` must be 'time' or 'memory', got {by!r}")
    if not isinstance(sample, torch.Tensor):
        raise TypeError(
            f"argument `sample` must be a Tensor (a sample input batch to profile the layers on), "
            f"got {type(sample).__name__}"
        )
    if sample.dim() == 0 or sample.shape[0] == 0:
        raise ValueError(f"argument `sample` must have a non-empty batch along dim 0, got shape {tuple(sample.shape)}")
    costs, x = [], sample
    with _state_kept(layers, sample.device):
        for i, layer in enumerate(layers):
            # parameters and their gradients, buffers once
            state = 2 * sum(t.numel() * t.element_size() for t in layer.parameters())
            state += sum(t.numel() * t.element_size() for t in layer.buffers())
            if by == "memory":
                with torch.no_grad():
                    y = _profiled_call(layer, i, x, sample)
                costs.append(float(state + y.numel() * y.element_size()))
            else:
                times = []
                for _ in range(repeats):
                    inp = x.detach().requires_grad_(x.is_floating_point())
                    # a copy (not a leaf): a layer may change its input in place (ReLU(inplace=True)),
                    # and each repeat starts from the same values
                    inp = inp.clone()
                    _sync(inp.device)
                    start = time.perf_counter()
                    y = _profiled_call(layer, i, inp, sample)
                    if y.requires_grad:
                        y.backward(torch.ones_like(y))
                    _sync(inp.device)
                    times.append(time.perf_counter() - start)
                costs.append(sorted(times)[len(times) // 2])
            x = y.detach()
    return costs


def _profiled_call(layer: nn.Module, i: int, x: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """``layer(x)``; an error that names `sample` when the sample does not fit the layers."""
    try:
        y = layer(x)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        said = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"argument `sample` (shape {tuple(sample.shape)}, {sample.dtype}, on {sample.device}) does not run "
            f"through the layers to profile them: layer {i} ({type(layer).__name__}) raised {type(e).__name__}: "
            f"{said}; pass a batch of the model's input (its shape, dtype and device)"
        ) from e
    if not isinstance(y, torch.Tensor):
        raise TypeError(
            f"layer {i} ({type(layer).__name__}) returned {type(y).__name__}; every layer must return one tensor"
        )
    return y


@contextlib.contextmanager
def _state_kept(layers: Sequence[nn.Module], device: torch.device) -> Iterator[None]:
    """Restores the layers' buffers and gradients and the random generators after the block."""
    buffers = [(b, b.detach().clone()) for layer in layers for b in layer.buffers()]
    grads = [(p, p.grad) for layer in layers for p in layer.parameters()]
    for p, _ in grads:
        p.grad = None
    places = [device, *(b.device for b, _ in buffers), *(p.device for p, _ in grads)]
    cuda = sorted({d.index or 0 for d in places if d.type == "cuda"})  # dropout on a GPU draws there
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
        for p, g in grads:
            p.grad = g


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
