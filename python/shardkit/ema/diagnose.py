"""The error of a ``ModelEMA.update`` that the fused op refused: the op names positions in its
lists (``model[2]``, "at index 2"), the EMA names the parameter or buffer (its state-dict name)
and the argument ``model``. Runs only after a failure: nothing is checked on the hot path."""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from shardkit.ema.checks import EMA_DTYPES

Tensor = torch.Tensor

__all__ = ["named_failure"]

# The EMA dtypes, as messages write them.
_AVERAGED = "float32, float64, float16 and bfloat16"
_INDEX = re.compile(r"(?:\b(?:ema|model)\[|at index )(\d+)")


def _storage(t: Tensor) -> Optional[Tuple[torch.device, int]]:
    if not t.numel() or t.layout != torch.strided or t.is_nested:
        return None
    return (t.device, t.untyped_storage().data_ptr())


def _pair_problem(name: str, e: Tensor, m: Tensor, averaged: bool) -> Optional[str]:
    if m.layout != torch.strided or m.is_nested:
        return f"argument `model` has {name} of layout {'nested' if m.is_nested else m.layout}, not a dense tensor"
    if averaged and m.dtype not in EMA_DTYPES:
        return (
            f"argument `model` has {name} of dtype {m.dtype}, which the EMA cannot average (it averages "
            f"{_AVERAGED} tensors; the EMA's is {e.dtype}): the model changed after the EMA was made"
        )
    if averaged and e.dtype not in EMA_DTYPES:
        return (
            f"the EMA's {name} is of dtype {e.dtype} (ema.module converted?), which it cannot average; "
            f"it averages {_AVERAGED} tensors"
        )
    if m.device != e.device:
        return f"argument `model` has {name} on {m.device}, the EMA's is on {e.device}"
    return None


def _problem(names: Sequence[str], ema: Sequence[Tensor], src: Sequence[Tensor], averaged: Sequence[bool]) -> str:
    for name, e, m, avg in zip(names, ema, src, averaged):
        found = _pair_problem(name, e, m, avg)
        if found is not None:
            return found
    storages: Dict[Tuple[torch.device, int], int] = {}
    for i, e in enumerate(ema):
        key = _storage(e)
        if key is not None:
            storages.setdefault(key, i)
    for j, m in enumerate(src):
        key = _storage(m)
        if key is not None and key in storages:
            i = storages[key]
            return (
                f"argument `model` has {names[j]} in the memory of the EMA's {names[i]}: pass the trained "
                "model, not ema.module (or a module sharing its tensors)"
            )
    return ""


def named_failure(
    err: Exception,
    names: Sequence[str],
    ema: Sequence[Tensor],
    src: Sequence[Tensor],
    averaged: Sequence[bool],
    groups: Sequence[Tuple[List[Tensor], List[int]]],
    where: str = "ModelEMA.update",
) -> Exception:
    """The error to raise for ``err``, raised by the op on the EMA tensors ``ema`` and the model's
    ``src`` (``names``: their state-dict names; ``averaged[i]``: pair i averaged, else copied;
    ``groups``: the op's lists, as (EMA tensors, indices into ``src``)): the same exception class,
    naming the first pair that explains it, else the op's message with each list index it names
    translated (one group: its indices are the EMA's)."""
    message = _problem(names, ema, src, averaged)
    if not message:
        text = str(err)
        indices = sorted({int(k) for k in _INDEX.findall(text)})
        if len(groups) == 1 and indices and all(k < len(groups[0][1]) for k in indices):
            named = ", ".join(f"{k} is {names[groups[0][1][k]]}" for k in indices)
            message = f"argument `model`: {text} (of the EMA's averaged tensors, index {named})"
        else:
            message = f"argument `model`: {text}"
    kind = type(err) if type(err) in (RuntimeError, TypeError, ValueError, NotImplementedError) else RuntimeError
    return kind(f"{where}: {message}")
