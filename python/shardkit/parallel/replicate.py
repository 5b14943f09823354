"""Replicas of a module for data parallelism, one per device of a step.

Distinct CUDA devices get ``torch.nn.parallel.replicate`` (parameters broadcast, buffers
copied), as ``nn.DataParallel`` does. Where nothing needs copying (CPU devices, or one GPU
repeated in the list) :func:`share_replicas` builds the same structure without copies: one
module object per device, parameters shared with the original, replica 0 holding the
original buffers and the others their own copies. Both then run the same per-replica
code (replication callbacks, threads, BatchNorm statistics kept from replica 0 only), so
what the CPU tests exercise is what GPU users run.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain
from typing import Any, Sequence

import torch
from torch import nn
from torch.nn.parallel import replicate as _torch_replicate

from shardkit.parallel import scatter as U


def replicate_module(module: nn.Module, device_ids: Sequence[Any], what: str = "DataParallelModel") -> list[nn.Module]:
    """``torch.nn.parallel.replicate`` onto CUDA ``device_ids`` from wherever the module's
    state lives. torch broadcasts from its FIRST device and requires every parameter and
    buffer there, so a split that leaves device 0 out (``gpu0_bsz=0``, a zero chunk size)
    or a criterion whose state sits on another device in the list would fail inside
    torch. Its device goes first, its own copy is dropped when not used: as
    BalancedDataParallel, that device's BatchNorm running statistics then miss the step."""
    refuse_compiled(module, what)
    ids = [U.as_device(d).index for d in device_ids]
    state = {t.device for t in chain(module.parameters(), module.buffers())}
    if not state:
        return _torch_replicate(module, ids, not torch.is_grad_enabled())
    src = next(iter(state))
    if len(state) > 1 or src.type != "cuda":
        raise ValueError(
            f"{what}: the module's parameters and buffers must all be on one CUDA device to be "
            f"replicated onto {[f'cuda:{i}' for i in ids]}, found them on {sorted(map(str, state))}; "
            f"move it there first (e.g. module.cuda({ids[0]}))"
        )
    order = replication_order(src.index, ids)
    if order == ids:
        return _torch_replicate(module, ids, not torch.is_grad_enabled())
    copies = dict(zip(order, _torch_replicate(module, order, not torch.is_grad_enabled())))
    return [copies[i] for i in ids]


def replication_order(src: int, ids: Sequence[int]) -> list[int]:
    """The device list torch's replicate() needs: ``src`` (where the module is) first, then
    the other distinct ``ids`` in order; equals ``ids`` when ``ids[0] == src``."""
    return [src] + [i for i in dict.fromkeys(ids) if i != src]


def refuse_compiled(module: nn.Module, what: str) -> None:
    """A ``torch.compile``d module (an OptimizedModule wrapper) cannot be replicated: its
    shallow copy writes through to the wrapped module, which would lose its parameters.
    Refused before anything is changed."""
    for name, m in module.named_modules():
        if type(m).__name__ == "OptimizedModule" and "_orig_mod" in m._modules:
            where = "the module" if not name else f"its sub-module {name!r}"
            raise TypeError(
                f"{what}: {where} is a torch.compile'd module, which cannot be replicated onto "
                "the devices; pass the module before torch.compile (its `_orig_mod`), whose "
                "replicas then run eagerly"
            )


def share_replicas(
    module: nn.Module, count: int, what: str = "DataParallelModel", keep_buffers: bool = True
) -> list[nn.Module]:
    """``count`` replicas of ``module`` on its own device, built like torch's replicate():
    every sub-module copied shallowly (``_replicate_for_data_parallel``), parameters set as
    plain attributes (and in ``_former_parameters``) -- here the original Parameters
    themselves, so gradients accumulate into them with no reduction -- and buffers: replica
    0 the original tensors (its BatchNorm running statistics are the module's), the others
    copies whose updates are dropped, as on GPUs other than the first. ``keep_buffers=False``
    (the chunk of ``device_ids[0]`` left out, e.g. ``gpu0_bsz=0``): every replica gets copies,
    so the module's buffers miss the step, as on GPUs, where the first device's replica is
    dropped then.

    As torch's replicate(), each distinct buffer is copied ONCE per replica (a buffer
    registered in two sub-modules stays one tensor in every replica), and a buffer that
    requires grad is copied with autograd while grad mode is on (torch's Broadcast), so
    every chunk's use of it reaches its gradient."""
    refuse_compiled(module, what)
    modules = list(module.modules())
    index = {id(m): i for i, m in enumerate(modules)}
    copies = [[m._replicate_for_data_parallel() for m in modules] for _ in range(count)]
    grad_on = torch.is_grad_enabled()
    for j in range(count):
        own: dict[int, torch.Tensor] = {}  # this replica's copy of each distinct buffer
        for i, m in enumerate(modules):
            replica = copies[j][i]
            replica._former_parameters = OrderedDict()
            for key, child in m._modules.items():
                replica._modules[key] = None if child is None else copies[j][index[id(child)]]
            for key, param in m._parameters.items():
                # Not through nn.Module.__setattr__, which would register it as a parameter.
                object.__setattr__(replica, key, param)
                replica._former_parameters[key] = param
            for key, buf in m._buffers.items():
                if buf is not None and (j > 0 or not keep_buffers):
                    if id(buf) not in own:
                        own[id(buf)] = buf.clone() if (buf.requires_grad and grad_on) else buf.detach().clone()
                    buf = own[id(buf)]
                replica._buffers[key] = buf
    return [copies[j][0] for j in range(count)]
