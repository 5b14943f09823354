"""Balanced data parallelism: a drop-in for ``encoding.parallel`` (PyTorch-Encoding).

``DataParallelModel`` returns the per-device outputs instead of gathering them on device 0,
and ``DataParallelCriterion`` computes the loss on every device and reduces the per-device
losses EXACTLY (weighted by samples or valid elements), so the result equals the loss of
the whole batch on one device. Change ``from encoding.parallel import ...`` to
``from shardkit.parallel import ...``; nothing else in a training script changes.

Device modes (the same code path in all of them):

* CUDA device lists (default: every visible GPU): the module is replicated per step with
  ``torch.nn.parallel.replicate``, as ``nn.DataParallel`` does.
* CPU devices, e.g. ``device_ids=["cpu"] * 3`` (what the tests use without a GPU), or a
  GPU repeated in the list (``[0, 0]``): the same replicas, built without copies
  (:func:`shardkit.parallel.replicate.share_replicas`): one module object per chunk whose
  parameters ARE the module's (gradients accumulate into them), replica 0 with the
  module's buffers and the others with their own copies (one per distinct buffer, with
  autograd for a buffer that requires grad, as torch's), replication callbacks run on
  them: the per-replica path of the GPUs, so BatchNorm statistics come from chunk 0 in
  both (and from no chunk when chunk 0 is empty, ``gpu0_bsz=0``). "cpu:0" means "cpu".
* ``device_ids=None`` with no GPU, or a single device: the module is called directly and
  its output returned as it is (not in a list), as ``encoding.parallel`` does; the
  criterion then also calls its module directly.

Per-device criterion calls follow ``encoding.parallel``: a tuple output is unpacked
(``criterion(*output_k, *targets_k)``), a tensor or dict is passed as one argument. We
unpack tuples in the direct (0/1 device) mode too, so one criterion works in every mode.
"""

from __future__ import annotations

import functools
import numbers
from itertools import chain
from typing import Any, Sequence, Union

import torch
from torch import nn

from shardkit.parallel import scatter as U
from shardkit.parallel.loss_reduce import ChunkGate, reduce_results
from shardkit.parallel.loss_weights import WeightedLoss, _chunk_loss, direct_call, warn_own_forward
from shardkit.parallel.replicate import replicate_module, share_replicas
from shardkit.parallel.sync import execute_replication_callbacks, has_replication_callbacks
from shardkit.parallel.threads import profiler_range, run_parallel, same_device_order

__all__ = ["DataParallelModel", "DataParallelCriterion", "WeightedLoss"]

DeviceLike = Union[int, str, torch.device]


def _init_parallel(
    self: DataParallelModel | DataParallelCriterion,
    module: nn.Module,
    device_ids: Sequence[DeviceLike] | None,
    output_device: DeviceLike | None,
    dim: int,
) -> None:
    """nn.DataParallel.__init__ for CUDA lists of distinct devices; for repeated devices
    (``["cpu"] * k``, ``[0, 0]``), which nn.DataParallel rejects, the same public
    attributes (module, device_ids, output_device, dim) are set here."""
    if not isinstance(module, nn.Module):  # else it failed at the first call, naming nothing
        raise TypeError(f"argument `module` must be an nn.Module, got {type(module).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"argument `dim` must be an int, got {type(dim).__name__} {dim!r}")
    dim = int(dim)
    devices = None if device_ids is None else U.parse_device_ids(device_ids)
    if (devices is None or devices[0].type == "cuda") and not torch.cuda.is_available():
        # No GPU: CUDA ids (repeated ones too) are dropped and calls go straight to the module,
        # as nn.DataParallel does.
        nn.Module.__init__(self)
        self.module, self.device_ids, self.output_device, self.dim = module, [], None, dim
        self._devices, self._shared = [], False
        return
    if devices is None:
        devices = U.parse_device_ids(list(range(torch.cuda.device_count())))
    shared = devices[0].type == "cpu" or len(set(devices)) < len(devices)
    if not shared:
        nn.DataParallel.__init__(self, module, [d.index for d in devices], output_device, dim)
        if not self.device_ids:  # CUDA ids on a machine without GPUs: direct calls, as DataParallel
            self.dim, self.output_device, self._devices, self._shared = dim, None, [], False
            return
    else:
        nn.Module.__init__(self)
        try:
            out = U.as_device(output_device if output_device is not None else devices[0])
        except ValueError as e:
            raise ValueError(f"argument `output_device`: {e}") from None
        if out.type != devices[0].type:
            raise ValueError(f"argument `output_device` ({out}) must be of the type of `device_ids` ({devices[0]})")
        self.module, self.dim = module, dim
        self.device_ids = [d.index for d in devices] if out.type == "cuda" else devices
        self.output_device = out.index if out.type == "cuda" else out
        self.src_device_obj = devices[0]
        if len(devices) == 1:
            module.to(devices[0])
    self._devices, self._shared = devices, shared


class DataParallelModel(nn.DataParallel):
    """Data parallelism that leaves the outputs on their devices (no gather).

    Args:
        module: the model; its parameters live on ``device_ids[0]``.
        device_ids: CUDA devices (ints, "cuda:k" or torch.device; default every GPU), or
            repeated ``"cpu"`` entries (see the module notes).
        output_device: kept for API compatibility (outputs are not gathered).
        dim: the batch dimension of every tensor argument.
        chunk_sizes: samples per device, one int per device (exact when they sum to the
            batch, else proportions); zeros leave a device out.
        gpu0_bsz: samples for device 0 (the rest split evenly), as BalancedDataParallel.
        split: "balanced" (the default: as even as possible, the first ``batch % n`` devices
            one more) or "torch" (``nn.DataParallel``'s and encoding.parallel's split,
            ``Tensor.chunk``: ``ceil(batch / n)`` per device while samples last; with
            ``legacy_mean=True`` on the criterion it reproduces encoding's losses exactly).

    Forward: ``model(*inputs, **kwargs)`` splits every tensor (positional and keyword,
    nested in tuples/lists/dicts) along ``dim`` and returns a list with one output per
    device that got samples (fewer than ``len(device_ids)`` when the batch is smaller);
    each output is whatever the module returns (tensor, tuple, dict) on its device.
    With no device (no GPU, ``device_ids=None``) or one device: the module's output as is;
    CUDA ``device_ids`` on a machine without a GPU are dropped, as nn.DataParallel does.

    Raises ValueError (naming the argument) for bad ``device_ids`` (unknown, mixed CPU and
    CUDA), ``chunk_sizes`` or ``gpu0_bsz``; at forward, for an empty batch or inputs with
    no tensor to split; RuntimeError when the module is not on ``device_ids[0]``.
    """

    # Its replicate() runs the __data_parallel_replicate__ callbacks already, so
    # patch_replication_callback leaves it alone.
    _runs_replication_callbacks = True
    _devices: list[torch.device]  # one per chunk (repeats allowed); empty: direct calls
    _shared: bool  # replicas share the module's parameters (CPU or repeated devices)

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | str | torch.device] | None = None,
        output_device: int | str | torch.device | None = None,
        dim: int = 0,
        *,
        chunk_sizes: Sequence[int] | None = None,
        gpu0_bsz: int | None = None,
        split: str = "balanced",
    ) -> None:
        _init_parallel(self, module, device_ids, output_device, dim)
        self.chunk_sizes, self.gpu0_bsz = U.check_split_options(max(len(self._devices), 1), chunk_sizes, gpu0_bsz)
        self.split = U.check_split(split, self.chunk_sizes, self.gpu0_bsz)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The per-device outputs (a list, entry k on device k, each the module's output for
        chunk k of every tensor in ``inputs`` / ``kwargs`` split along ``dim``), or with one
        device the module's output (see the class notes). A worker's exception is re-raised;
        ``ValueError`` naming the input for tensors whose sizes along ``dim`` differ."""
        with profiler_range("shardkit.DataParallelModel.forward"):
            if not self.device_ids:
                return self.module(*inputs, **kwargs)
            src = self._devices[0]
            for t in chain(self.module.parameters(), self.module.buffers()):
                if t.device != src:
                    raise RuntimeError(
                        f"DataParallelModel: the module must have its parameters and buffers on "
                        f"device_ids[0] ({src}), found one on {t.device}"
                    )
            if len(self._devices) == 1:
                inputs, kwargs = U.to_device((inputs, kwargs), src)
                return self.module(*inputs, **kwargs)
            cls = type(self)  # a subclass's hooks (nn.DataParallel's, its signatures) run in place of these
            if cls.scatter is DataParallelModel.scatter:
                devices, per_device, first = self._split(inputs, kwargs)
                args, kws = [a for a, _ in per_device], [k for _, k in per_device]
            else:
                scattered = self.scatter(inputs, kwargs, self.device_ids)
                args, kws = list(scattered[0]), list(scattered[1])
                found = [U.first_batched_tensor((a, k), self.dim) for a, k in zip(args, kws)]
                devices = [t.device if t is not None else d for t, d in zip(found, self._devices)]
                first = 0 if devices[:1] == self._devices[:1] else 1
            ids = [d.index if d.type == "cuda" else d for d in devices]
            # device_ids[0] left out (gpu0_bsz=0): no replica keeps the module's buffers, as on GPUs
            own = cls.replicate is DataParallelModel.replicate  # (a subclass's takes two arguments)
            replicas = (
                self.replicate(self.module, ids) if first == 0 or not own else self.replicate(self.module, ids, False)
            )
            own_apply = cls.parallel_apply is DataParallelModel.parallel_apply
            outputs = self.parallel_apply(replicas, args, kws, **({"devices": devices} if own_apply else {}))
            return self.gather(outputs, self.output_device)

    def _split(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[list[torch.device], list[tuple[tuple[Any, ...], dict[str, Any]]], int]:
        first = U.first_batched_tensor((inputs, kwargs), self.dim)
        if first is None:
            raise ValueError(
                f"DataParallelModel: the inputs hold no tensor with a batch dimension to split (argument "
                f"`dim`={self.dim}: no input tensor has that dimension)"
            )
        if first.size(self.dim) == 0:
            raise ValueError(
                f"DataParallelModel: the batch is empty (0 samples along dim {self.dim}); there is nothing to "
                "split over the devices: skip empty batches (e.g. DataLoader(drop_last=True))"
            )
        batch, n = first.size(self.dim), len(self._devices)
        sizes = (
            U.torch_chunk_sizes(batch, n)
            if self.split == "torch"
            else U.balanced_chunk_sizes(batch, n, self.chunk_sizes, self.gpu0_bsz)
        )
        used = [k for k, s in enumerate(sizes) if s > 0]
        devices = [self._devices[k] for k in used]
        per_device = U.split_args(inputs, kwargs, [sizes[k] for k in used], devices, self.dim, "DataParallelModel")
        return devices, per_device, used[0]

    def scatter(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[int | torch.device]
    ) -> tuple[tuple[tuple[Any, ...], ...], tuple[dict[str, Any], ...]]:
        """Per-device (args, kwargs) with the balanced split (nn.DataParallel's hook)."""
        _, per_device, _ = self._split(inputs, kwargs or {})
        return tuple(a for a, _ in per_device), tuple(k for _, k in per_device)

    def replicate(
        self, module: nn.Module, device_ids: Sequence[int | torch.device], keep_buffers: bool = True
    ) -> list[nn.Module]:
        """Replicas for ``device_ids`` (sharing the parameters where the devices repeat or are
        CPUs; ``keep_buffers=False``: the first chunk was left out, no replica holds the module's
        buffers), then the ``__data_parallel_replicate__`` callbacks, as encoding.parallel does."""
        if self._shared:
            modules = share_replicas(module, len(device_ids), keep_buffers=keep_buffers)
        else:
            modules = replicate_module(module, device_ids)
        execute_replication_callbacks(modules)
        return modules

    def parallel_apply(
        self,
        replicas: Sequence[nn.Module],
        inputs: Sequence[Any],
        kwargs: Sequence[Any],
        devices: Sequence[torch.device] | None = None,
    ) -> list[Any]:
        """Calls replica k on (inputs[k], kwargs[k]) in its device's thread; the outputs."""
        devices = devices if devices is not None else self._devices[: len(replicas)]
        calls = [functools.partial(m, *a, **k) for m, a, k in zip(replicas, inputs, kwargs)]
        # SyncBN copies wait for each other inside their forward: concurrent on a shared device too
        after = None if has_replication_callbacks(replicas) else same_device_order(devices)
        return run_parallel(calls, devices, "DataParallelModel", after=after)

    def gather(self, outputs: list[Any], output_device: int | torch.device | None) -> list[Any]:
        """No gather: the per-device outputs, for DataParallelCriterion."""
        return outputs


class DataParallelCriterion(nn.DataParallel):
    """Computes the loss on every device and reduces it exactly.

    Args:
        module: the criterion (e.g. ``nn.CrossEntropyLoss(ignore_index=255)``).
        device_ids, output_device, dim: as for :class:`DataParallelModel`; use the same
            ``device_ids`` for both. The loss is returned on ``output_device``.
        legacy_mean: reduce as encoding.parallel does: the sum of the per-device results over
            the device count, whatever the criterion's reduction (differs from the
            single-device loss when chunks are uneven, or with ``reduction='sum'``).

    Forward: ``criterion(outputs, *targets, **kwargs)`` with ``outputs`` the list returned by
    DataParallelModel. Targets (and tensor keyword arguments) are split with the chunk
    sizes of the outputs (their sizes along ``dim``), the criterion runs on each device in
    its own thread (grad mode, autocast and CUDA streams carried over), and per-device
    results are reduced on ``output_device``: ``sum_k w_k loss_k / sum_k w_k`` with
    ``w_k`` the samples on device k; for ``nn.CrossEntropyLoss``/``nn.NLLLoss`` with
    ``reduction='mean'`` the valid elements (targets != ignore_index, class-weighted when
    the criterion has ``weight``; all positions for probability targets); for any other
    criterion with ``reduction='mean'`` and an int ``ignore_index`` attribute, the integer
    target elements != ignore_index; or the weight the criterion reports by returning
    :class:`WeightedLoss` or a dict with a ``"weight"`` entry. The target is the first
    positional target, or in the keyword form (``criterion(outputs, target=y)``) the
    keyword bound to the parameter after the outputs in the criterion's ``forward``.
    ``reduction='sum'`` criteria are summed; ``reduction='none'`` results (one loss per
    sample) are concatenated along ``dim`` in batch order. Any other criterion must return
    one-element losses. A dict or tuple of losses is reduced entry by entry: integer tensors
    are counts (e.g. ``(pred == y).sum()``), summed over the devices (the one-device value);
    non-tensor entries come back as the list of per-device values. A chunk of weight 0
    (every target ignored, a mask of zeros) adds nothing to the loss and no gradient (no
    NaN; with per-chunk replicas, the criterion's own parameters included). Under
    ``torch.func`` transforms and forward-mode AD the split and the reduction run as torch
    ops (same results).

    Raises ValueError for bad device arguments (as DataParallelModel), outputs of 0 samples,
    targets whose batch does not match the outputs' sizes (naming the argument), a keyword
    form whose target cannot be told for a criterion weighed by its targets, losses of more
    than one element without ``reduction='none'`` (whatever the split), per-sample losses
    that do not match the chunks with it, bool entries (naming the entry), or a list of
    per-device outputs given to a criterion with no device or one (naming ``device_ids``).
    """

    _devices: list[torch.device]  # as DataParallelModel's
    _shared: bool

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | str | torch.device] | None = None,
        output_device: int | str | torch.device | None = None,
        dim: int = 0,
        *,
        legacy_mean: bool = False,
    ) -> None:
        _init_parallel(self, module, device_ids, output_device, dim)
        if not isinstance(legacy_mean, bool):
            raise TypeError(f"argument `legacy_mean` must be True or False, got {type(legacy_mean).__name__}")
        self.legacy_mean = legacy_mean

    def forward(self, inputs: Any, *targets: Any, **kwargs: Any) -> Any:
        """The reduced loss on ``output_device`` (see the class notes)."""
        with profiler_range("shardkit.DataParallelCriterion.forward"):
            if len(self._devices) <= 1:
                return direct_call(self.module, self._devices, self.dim, inputs, targets, kwargs)
            if kwargs.get("return_details"):
                raise ValueError(
                    "DataParallelCriterion: `return_details=True` is not supported (per-device details are not "
                    "reduced across devices); compute them from the head itself, e.g. on gathered embeddings"
                )
            devices, sizes = self._input_layout(inputs)
            if sum(sizes) == 0:
                raise ValueError(
                    "DataParallelCriterion: the model outputs hold 0 samples; the loss of an empty batch is "
                    "undefined: skip empty batches (e.g. DataLoader(drop_last=True))"
                )
            per_device = U.split_args(
                targets,
                kwargs,
                sizes,
                devices,
                self.dim,
                f"DataParallelCriterion (targets for model outputs of {sum(sizes)} samples)",
            )
            # Replicate only a criterion with state on one device; a parameter-free one, or one
            # already spread over several devices (a class-sharded head), is shared by the threads.
            state_devices = {t.device for t in chain(self.module.parameters(), self.module.buffers())}
            if len(state_devices) != 1:
                replicas = [self.module] * len(devices)
            elif self._shared:
                replicas = share_replicas(self.module, len(devices), "DataParallelCriterion")
            else:
                replicas = self.replicate(self.module, [d.index for d in devices])
            # Each worker also computes its chunk's weight (the valid-target count of a mean
            # criterion): those few small ops then run in parallel, not after the join.
            reduction = getattr(self.module, "reduction", "mean")
            auto = not (self.legacy_mean or reduction == "sum")
            if auto:
                warn_own_forward(self.module)
            # Weighted means: a chunk of weight 0 must send no gradient (loss_reduce.ChunkGate).
            weighted = auto and reduction != "none" and torch.is_grad_enabled()
            gates: list[ChunkGate | None] = [ChunkGate() for _ in devices] if weighted else [None] * len(devices)
            for gate, replica in zip(gates, replicas):
                if gate is not None and replica is not self.module:  # per-chunk replicas: gate their parameters
                    gate.parameters(replica)
            calls = [
                functools.partial(_chunk_loss, m, out, t, k, n, auto, gate)
                for m, out, (t, k), n, gate in zip(replicas, inputs, per_device, sizes, gates)
            ]
            # Calls that share a random generator (a device's, or a criterion shared by the threads,
            # e.g. a class-sharded head with its sample_generator) run in chunk order: seeded steps repeat.
            shared = len(state_devices) > 1 and len(replicas) > 1  # (a stateless criterion: concurrent)
            order = [k - 1 if k else None for k in range(len(calls))] if shared else same_device_order(devices)
            results = run_parallel(calls, devices, "DataParallelCriterion", after=order)
            return self._reduce(results, sizes)

    def replicate(self, module: nn.Module, device_ids: Sequence[int | torch.device]) -> list[nn.Module]:
        """Replicas of a criterion with state (e.g. a class ``weight``) for ``device_ids``,
        broadcast from the device that holds it."""
        return replicate_module(module, device_ids, "DataParallelCriterion")

    def _input_layout(self, inputs: Any) -> tuple[list[torch.device], list[int]]:
        n_dev = len(self._devices)
        if not isinstance(inputs, (list, tuple)):
            raise TypeError(
                f"DataParallelCriterion over {n_dev} devices expects the list of per-device outputs "
                f"that DataParallelModel returns, got {type(inputs).__name__}"
            )
        if not 1 <= len(inputs) <= n_dev:
            raise ValueError(
                f"DataParallelCriterion got {len(inputs)} per-device outputs but has {n_dev} devices "
                f"in device_ids; use the same device_ids for DataParallelModel and DataParallelCriterion"
            )
        devices, sizes = [], []
        for k, out in enumerate(inputs):
            t = U.first_batched_tensor(out, self.dim)
            if t is None:
                raise ValueError(f"DataParallelCriterion: model output {k} holds no tensor with a batch dimension")
            if t.device not in self._devices:
                raise ValueError(
                    f"DataParallelCriterion: model output {k} is on {t.device}, which is not in its "
                    f"device_ids {self._devices}; use the same device_ids for DataParallelModel and "
                    f"DataParallelCriterion"
                )
            devices.append(t.device)
            sizes.append(t.size(self.dim))
        if not self._shared and len(set(devices)) < len(devices):
            raise ValueError(
                f"DataParallelCriterion: two model outputs are on one device ({devices}); "
                f"use the same device_ids for DataParallelModel and DataParallelCriterion"
            )
        return devices, sizes

    def _reduce(self, results: list[tuple[Any, Any]], sizes: list[int]) -> Any:
        """Reduces the workers' (value, weight) pairs (see _chunk_loss); ``sizes``: the samples
        of each chunk. ``legacy_mean``: encoding.parallel's sum of the per-device results over
        the device count, whatever the criterion's reduction."""
        reduction = getattr(self.module, "reduction", "mean")
        equal = self.legacy_mean or reduction == "sum"
        return reduce_results(
            [value for value, _ in results],
            [1 if equal else weight for _, weight in results],
            sizes,
            reduction=reduction,
            normalize=self.legacy_mean or reduction != "sum",
            dim=self.dim,
            out_dev=U.as_device(self.output_device),
        )
