"""``ModelEMA.swap``: the EMA weights put into the model in place for an evaluation and the
model's own put back bit-exactly after it, and the pickle of an EMA taken inside the block."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import torch

from shardkit.ops._ema import swap_pairs_, unswap_pairs_

Tensor = torch.Tensor

__all__ = ["plan_swap", "swapped", "copy_unswapped", "SwapPairs"]


def _flat_ok(e: torch.Tensor, m: torch.Tensor) -> bool:
    if e.is_contiguous() and m.is_contiguous():
        return True
    return e.dim() == 4 and e.stride() == m.stride() and e.is_contiguous(memory_format=torch.channels_last)


def _same_view(a: Tensor, b: Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
    )


def plan_swap(
    ema: Sequence[Tensor], src: Sequence[Tensor], names: Sequence[str]
) -> Tuple[List[Tensor], List[Tensor], List[Tuple[Tensor, Tensor, Tensor]]]:
    """How ``ModelEMA.swap`` puts each EMA tensor into the model's: (EMA tensors, model tensors)
    that the swap ops exchange or pack in place (same device, and the same dtype or a float32
    EMA of a flat-compatible bfloat16 tensor), and (EMA, model, host copy of the model's) for
    every other pair, which is copied over with the model's values stashed in host memory.

    Model tensors that are one view of one storage (``head.weight = nn.Parameter(emb.weight)``:
    two Parameters, one memory) are swapped once, with the first one's EMA (``names``: the
    tensors' state-dict names); other views sharing memory raise ValueError naming both."""
    ex_e: List[Tensor] = []
    ex_m: List[Tensor] = []
    stash: List[Tuple[Tensor, Tensor, Tensor]] = []
    seen: Dict[Tuple[torch.device, int], List[Tuple[int, Tensor]]] = {}
    for i, (e, m) in enumerate(zip(ema, src)):
        if m.layout == torch.strided and any(size > 1 and stride == 0 for size, stride in zip(m.shape, m.stride())):
            raise ValueError(
                f"ModelEMA.swap: argument `model` has {names[i]} as a view whose elements share memory (a zero "
                "stride, e.g. made by expand()); swap writes the EMA's values into the model's tensors in place, "
                "so each element needs memory of its own: register a copy of it (.clone())"
            )
        if m.numel() and m.layout == torch.strided and not m.is_nested:
            key = (m.device, m.untyped_storage().data_ptr())
            earlier = seen.setdefault(key, [])
            tied = next((j for j, t in earlier if _same_view(t, m)), None)
            if tied is not None:
                continue  # storage-tied to an earlier tensor: swapped with it
            clash = next((j for j, t in earlier if _overlap(t, m)), None)
            if clash is not None:
                raise ValueError(
                    f"ModelEMA.swap: argument `model` has {names[i]} and {names[clash]} in one memory (overlapping) as "
                    "different views; swap writes each of them in place, so they need memory of their own "
                    "(tie weights as one Parameter, or as Parameters over the very same view)"
                )
            earlier.append((i, m))  # disjoint views of one buffer (a flat parameter's parts) are fine
        if e.device == m.device and (
            e.dtype == m.dtype or (e.dtype == torch.float32 and m.dtype == torch.bfloat16 and _flat_ok(e, m))
        ):
            ex_e.append(e)
            ex_m.append(m)
        else:
            stash.append((e, m, m.detach().to("cpu", copy=True)))
    return ex_e, ex_m, stash


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors of one storage reach a common byte (their spans, first to last
    element, intersect: interleaved views count as overlapping)."""

    def span(t: Tensor) -> Tuple[int, int]:
        start = int(t.storage_offset()) * t.element_size()
        extent = sum((int(size) - 1) * abs(int(stride)) for size, stride in zip(t.shape, t.stride())) + 1
        return start, start + extent * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


# The pairs a swap exchanged in place (EMA tensors, model tensors): put back for a pickle.
SwapPairs = Tuple[List[Tensor], List[Tensor]]


@contextlib.contextmanager
def swapped(ema: Sequence[Tensor], src: Sequence[Tensor], names: Sequence[str]) -> Iterator[SwapPairs]:
    """``ModelEMA.swap``'s exchange: ``src`` (the model's tensors) holds the EMA's values inside
    the block and its own, bit-exactly, after it (also on an exception); see :func:`plan_swap`.
    Yields the pairs exchanged in place (the stashed ones keep the EMA's values meanwhile)."""
    ex_e, ex_m, stash = plan_swap(ema, src, names)
    with torch.no_grad():
        swap_pairs_(ex_e, ex_m)
        for e, m, _ in stash:
            m.copy_(e)
    try:
        yield ex_e, ex_m
    finally:
        with torch.no_grad():
            unswap_pairs_(ex_e, ex_m)
            for _, m, host in stash:
                m.copy_(host)


def copy_unswapped(state: Dict[str, Any], pairs: SwapPairs) -> Dict[str, Any]:
    """A deep copy of ``state`` (a ModelEMA's pickled state, inside ``with ema.swap(model):``)
    holding the EMA's own values: the exchanged ``pairs`` are put back for the copy (bit-exact)
    and exchanged again after it, so the copy is the true EMA and the block goes on unchanged
    (the stashed pairs' EMA tensors kept their values)."""
    with torch.no_grad():
        unswap_pairs_(*pairs)
    try:
        return copy.deepcopy(state)
    finally:
        with torch.no_grad():
            swap_pairs_(*pairs)
