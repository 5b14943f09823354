"""Device lists, balanced chunk sizes and splitting nested arguments over devices with one
operator call (the scatter half of ``shardkit.parallel``; the threads are in
:mod:`shardkit.parallel.threads`), and :func:`gather`, its inverse for the per-device outputs.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable, Mapping, Set
from typing import Any, Sequence

import torch

from shardkit.ops import split_to_devices
from shardkit.ops._devices import check_visible

# ---- devices ------------------------------------------------------------------------


def as_device(d: Any) -> torch.device:
    """torch.device with an explicit CUDA index (ints are CUDA indices, like DataParallel)."""
    # True would be cuda:1, and torch's own error for -1 names no argument
    if isinstance(d, bool) or (isinstance(d, int) and d < 0):
        raise ValueError(f"not a device: {d!r} (use e.g. 'cpu', 'cuda:0' or a CUDA index >= 0)")
    if isinstance(d, int):
        return torch.device("cuda", d)
    try:
        dev = torch.device(d)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"not a device: {d!r} (use e.g. 'cpu', 'cuda:0' or a CUDA index)") from err
    if dev.type == "cpu" and dev.index is not None:
        # torch has one CPU device and reports CPU tensors as plain "cpu" ("cpu:0" would never
        # equal the device of a module or output moved there)
        dev = torch.device("cpu")
    if dev.type == "cuda" and dev.index is None:
        # without a GPU, "cuda" means cuda:0 (the default current device), so the callers'
        # checks of what is visible (or nn.DataParallel's CPU fallback) apply to it
        dev = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return dev


def parse_device_ids(device_ids: Sequence[Any]) -> list[torch.device]:
    """Normalizes a user device list; every entry must be of one type, "cpu" or "cuda"."""
    if isinstance(device_ids, (str, int, torch.device)):
        raise TypeError(f"argument `device_ids` must be a list of devices, got {device_ids!r}")
    try:
        devices = [as_device(d) for d in device_ids]
    except ValueError as e:
        raise ValueError(f"argument `device_ids`: {e}") from None
    if not devices:
        raise ValueError("argument `device_ids` must not be empty; pass None to use every visible GPU")
    types = {d.type for d in devices}
    if len(types) > 1:
        raise ValueError(
            f"argument `device_ids` mixes device types {sorted(types)}; use only CUDA devices "
            f"or only repeated 'cpu' entries"
        )
    if types - {"cpu", "cuda"}:
        raise ValueError(f"argument `device_ids` must hold CUDA or 'cpu' devices, got {devices[0]}")
    return devices


# ---- chunk sizes --------------------------------------------------------------------


def balanced_chunk_sizes(
    batch: int, n: int, chunk_sizes: Sequence[int] | None = None, gpu0_bsz: int | None = None
) -> list[int]:
    """Samples per device for a batch of ``batch`` over ``n`` devices (zeros allowed).

    * default: as even as possible, the first ``batch % n`` devices get one more; with
      ``batch < n`` the last devices get nothing.
    * ``chunk_sizes``: used as given when they sum to ``batch``; otherwise treated as
      proportions (largest-remainder rounding), so the last, smaller batch of an epoch
      still splits in the same ratio.
    * ``gpu0_bsz``: device 0 gets ``gpu0_bsz`` samples, the others share the rest evenly
      (the extra samples go to devices 1, 2, ...). As in BalancedDataParallel, when
      ``gpu0_bsz`` is not below the others' share (a small last batch), the split is even.
    """
    if chunk_sizes is not None:
        total = sum(chunk_sizes)
        if total == batch:
            return list(chunk_sizes)
        exact = [batch * c / total for c in chunk_sizes]
        sizes = [int(e) for e in exact]
        order = sorted(range(n), key=lambda k: (-(exact[k] - sizes[k]), k))
        for k in order[: batch - sum(sizes)]:
            sizes[k] += 1
        return sizes
    if gpu0_bsz is not None and n > 1:
        share, extra = divmod(batch - gpu0_bsz, n - 1)
        if gpu0_bsz < share:
            return [gpu0_bsz] + [share + (1 if k < extra else 0) for k in range(n - 1)]
    q, r = divmod(batch, n)
    return [q + (1 if k < r else 0) for k in range(n)]


def torch_chunk_sizes(batch: int, n: int) -> list[int]:
    """Samples per device as ``nn.DataParallel`` and encoding.parallel split (``Tensor.chunk``):
    ``ceil(batch / n)`` each while samples last, so the last devices may get fewer or none."""
    size = -(-batch // n)
    return [min(size, max(0, batch - k * size)) for k in range(n)]


def check_split(split: Any, chunk_sizes: Sequence[int] | None, gpu0_bsz: int | None) -> str:
    """DataParallelModel's ``split``: "balanced" or "torch" (not with chunk_sizes / gpu0_bsz)."""
    if split not in ("balanced", "torch"):
        raise ValueError(f"argument `split` must be 'balanced' or 'torch', got {split!r}")
    if split == "torch" and (chunk_sizes is not None or gpu0_bsz is not None):
        raise ValueError("argument `split='torch'` sets every share; it excludes `chunk_sizes` and `gpu0_bsz`")
    return str(split)


def as_int(value: Any, what: str) -> int:
    """``value`` as an int: ints (not bools; numpy ints, 0-dim integer tensors) or integral
    floats (``4.0``); ``what`` names it in the errors (which say "non-negative": the callers
    check the sign with their own message)."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a non-negative int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        if not isinstance(value, numbers.Real):
            raise TypeError(f"{what} must be a non-negative int, got {type(value).__name__} {value!r}") from None
        if not math.isfinite(value) or value != math.trunc(value):
            raise ValueError(f"{what} must be a non-negative int, got {value!r}") from None
        return int(math.trunc(value))


def check_split_options(
    n: int, chunk_sizes: Sequence[int] | None, gpu0_bsz: int | None
) -> tuple[list[int] | None, int | None]:
    """Validated ``(chunk_sizes, gpu0_bsz)`` of DataParallelModel, as lists of ints / an int."""
    if chunk_sizes is not None and gpu0_bsz is not None:
        raise ValueError("arguments `chunk_sizes` and `gpu0_bsz` are exclusive; pass one of them")
    if chunk_sizes is not None:
        if isinstance(chunk_sizes, (str, bytes, Mapping, Set)) or not isinstance(chunk_sizes, Iterable):
            raise TypeError(
                f"argument `chunk_sizes` must be a list of ints, one per device, got {type(chunk_sizes).__name__} "
                f"{chunk_sizes!r}"
            )
        sizes = [as_int(c, f"argument `chunk_sizes` (index {k})") for k, c in enumerate(chunk_sizes)]
        if len(sizes) != n:
            raise ValueError(
                f"argument `chunk_sizes` must hold one size per device: got {len(sizes)} sizes for {n} devices"
            )
        if any(c < 0 for c in sizes) or sum(sizes) == 0:
            raise ValueError(f"argument `chunk_sizes` must be non-negative with a positive sum, got {sizes}")
        return sizes, None
    if gpu0_bsz is not None:
        gpu0_bsz = as_int(gpu0_bsz, "argument `gpu0_bsz`")
        if gpu0_bsz < 0:
            raise ValueError(f"argument `gpu0_bsz` must be a non-negative int, got {gpu0_bsz!r}")
    return None, gpu0_bsz


# ---- nested arguments ---------------------------------------------------------------


def flatten(obj: Any, leaves: list[torch.Tensor]) -> Any:
    """Collects the tensors of a nest of tuples/lists/dicts into ``leaves``; returns a spec."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return None
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return ("namedtuple", type(obj), [flatten(x, leaves) for x in obj])
    if isinstance(obj, (tuple, list)):
        return ("seq", type(obj), [flatten(x, leaves) for x in obj])
    if isinstance(obj, dict):
        return ("dict", type(obj), list(obj.keys()), [flatten(v, leaves) for v in obj.values()])
    return ("const", obj)


def unflatten(spec: Any, leaves: Any) -> Any:
    """Inverse of :func:`flatten`; ``leaves`` is an iterator over the replacement tensors."""
    if spec is None:
        return next(leaves)
    kind = spec[0]
    if kind == "namedtuple":
        return spec[1](*[unflatten(s, leaves) for s in spec[2]])
    if kind == "seq":
        return spec[1](unflatten(s, leaves) for s in spec[2])
    if kind == "dict":
        return spec[1](zip(spec[2], [unflatten(s, leaves) for s in spec[3]]))
    return spec[1]


def first_batched_tensor(obj: Any, dim: int) -> torch.Tensor | None:
    leaves: list[torch.Tensor] = []
    flatten(obj, leaves)
    for t in leaves:
        if t.dim() > (dim if dim >= 0 else -dim - 1):
            return t
    return None


def split_args(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    sizes: Sequence[int],
    devices: Sequence[torch.device],
    dim: int,
    what: str,
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Splits every tensor of (args, kwargs) by ``sizes`` along ``dim`` onto ``devices`` in one
    ``shardkit::split_to_devices`` call; non-tensors are passed to every device as they are."""
    leaves: list[torch.Tensor] = []
    spec = flatten((args, kwargs), leaves)
    batch = sum(sizes)
    for t in leaves:
        if t.dim() == 0 or t.size(dim) != batch:
            got = "a 0-dim tensor" if t.dim() == 0 else f"size {t.size(dim)} along dim {dim}"
            raise ValueError(
                f"{what}: every tensor argument must have the batch size {batch} along dim {dim} "
                f"(per device {list(sizes)}), got {got} (shape {tuple(t.shape)})"
            )
    if not leaves:
        return [(args, kwargs) for _ in devices]
    if pure_torch_mode():
        pieces = [list(p) for p in zip(*[composite_split(t, sizes, devices, dim) for t in leaves])]
    else:
        pieces = split_to_devices(leaves, list(sizes), list(devices), dim)
    return [unflatten(spec, iter(p)) for p in pieces]


def pure_torch_mode() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, jacrev, jvp) or forward-mode AD
    (``torch.autograd.forward_ad``) is active: the C++ ops (split_to_devices,
    weighted_loss_reduce) have no batching rule, functorch support or forward derivative,
    so pure-torch composites of the same math run instead (tensor_split + .to, torch ops)."""
    if torch._C._functorch.maybe_current_level() is not None:
        return True
    return getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0


def composite_split(t: torch.Tensor, sizes: Sequence[int], devices: Sequence[torch.device], dim: int) -> list[Any]:
    """split_to_devices for one tensor in torch ops: fresh contiguous pieces (never views of
    ``t``, as the op's), piece k on ``devices[k]``."""
    pieces = t.split(list(sizes), dim)
    return [p.to(d, copy=True, memory_format=torch.contiguous_format) for p, d in zip(pieces, devices)]


def to_device(obj: Any, device: torch.device) -> Any:
    leaves: list[torch.Tensor] = []
    spec = flatten(obj, leaves)
    nb = device.type == "cuda"
    return unflatten(spec, iter([t.to(device, non_blocking=nb) for t in leaves]))


# ---- gather -------------------------------------------------------------------------


def gather(outputs: Sequence[Any], target_device: Any, dim: int = 0) -> Any:
    """Concatenates per-device outputs (tensors, or tuples/lists/dicts of them, as
    DataParallelModel returns) along ``dim`` on ``target_device``; differentiable.
    E.g. embeddings ``[b_k, D]`` from K devices -> ``[B, D]`` on one device; 0-d tensors (per-device
    losses) -> a ``[K]`` vector. Entries that differ in kind, keys or length between the devices
    are refused naming them (TypeError / ValueError)."""
    if isinstance(outputs, torch.Tensor):
        raise TypeError(
            "argument `outputs` must be the list of per-device outputs, got a Tensor (a DataParallelModel with one "
            "device, or device_ids=None without a GPU, returns its module's output itself, not a list: use it as it is)"
        )
    if not isinstance(outputs, (list, tuple)) or len(outputs) == 0:
        raise ValueError(
            "argument `outputs` must be a non-empty list of per-device outputs (what DataParallelModel returns), "
            f"got {outputs!r}"
        )
    try:
        dev = as_device(target_device)
    except ValueError as err:
        raise ValueError(f"argument `target_device`: {err}") from None
    check_visible([dev], "target_device")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"argument `dim` must be an int, got {type(dim).__name__}")
    return _gather(list(outputs), dev, dim, "outputs")


def _gather(outputs: list[Any], dev: torch.device, dim: int, where: str) -> Any:
    # ``where``: the outputs' path in messages (outputs[k]['logits'][0] ...)
    first = outputs[0]
    kinds = (torch.Tensor, dict, tuple, list)
    kind = next((k for k in kinds if isinstance(first, k)), None)
    for k, o in enumerate(outputs):
        if kind is not None and not isinstance(o, kind):
            raise TypeError(
                f"argument `{where}`: device {k}'s entry is a {type(o).__name__}, device 0's a {type(first).__name__}"
            )
    if kind is torch.Tensor:
        if all(o.dim() == 0 for o in outputs):  # per-device scalars (losses): a [K] vector, as nn.parallel.gather
            return torch.stack([o.to(dev, non_blocking=dev.type == "cuda") for o in outputs])
        if not -first.dim() <= dim < max(first.dim(), 1):
            raise ValueError(f"argument `dim` is {dim}, out of range for the {first.dim()}-d tensors in `{where}`")
        return torch.cat([o.to(dev, non_blocking=dev.type == "cuda") for o in outputs], dim)
    if kind is dict:
        for k, o in enumerate(outputs):
            if set(o) != set(first):
                raise ValueError(f"argument `{where}`: device {k}'s keys {sorted(map(str, o))} are not device 0's")
        return type(first)((key, _gather([o[key] for o in outputs], dev, dim, f"{where}[{key!r}]")) for key in first)
    if kind is not None:
        for k, o in enumerate(outputs):
            if len(o) != len(first):
                raise ValueError(f"argument `{where}`: device {k}'s entry has {len(o)} items, device 0's {len(first)}")
        parts = [_gather([o[i] for o in outputs], dev, dim, f"{where}[{i}]") for i in range(len(first))]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    return list(outputs)
