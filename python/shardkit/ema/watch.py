"""How ``ModelEMA`` notices, in O(1) per update, that its own module changed under it: a
conversion (``ema.module.half()``, ``.float()``, ``.to()``), a load with ``assign=True``, or a
replaced module, submodule or tensor. The EMA then reads its tensors again."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from shardkit.ema.structure import Slot, _slots, slot_tensor

Tensor = torch.Tensor

__all__ = ["ModuleWatch", "probe_slots", "probe_changed"]


def probe_slots(slots: Sequence[Slot]) -> List[Tuple[Dict[str, Any], str, Tensor, torch.dtype, torch.device]]:
    """What :func:`probe_changed` looks at: (table, key, tensor, dtype, device) of the first and
    last parameter and buffer. Converting the EMA's module (``ema.module.half()``, ``.float()``,
    ``.to(...)``, or a first or last submodule alone) replaces its buffers and changes its
    parameters' dtype or device: four dict reads notice it on every update."""
    params = [s for s in slots if s[3]]
    buffers = [s for s in slots if not s[3]]
    out, seen = [], set()
    for slot in params[:1] + params[-1:] + buffers[:1] + buffers[-1:]:
        t = slot_tensor(slot)
        if id(t) not in seen:
            seen.add(id(t))
            out.append((slot[1], slot[2], t, t.dtype, t.device))
    return out


def probe_changed(probe: Sequence[Tuple[Dict[str, Any], str, Tensor, torch.dtype, torch.device]]) -> bool:
    """Whether a tensor of :func:`probe_slots` was replaced or changed dtype or device."""
    for table, key, t, dtype, device in probe:  # (a loop: every update runs it)
        if table.get(key) is not t or t.dtype != dtype or t.device != device:
            return True
    return False


class _Writes:
    """A count of the entries written into the watched tables of one ModelEMA's module."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class _WatchedTable(dict):
    """A ``_parameters`` / ``_buffers`` / ``_modules`` table of ModelEMA's module that counts
    the entries written into it or deleted from it: ``.half()``, ``.to()``, a load with
    ``assign=True`` or a replaced submodule write there. Pickled and copied as a plain dict."""

    __slots__ = ("writes",)

    def __init__(self, items: Dict[str, Any], writes: _Writes) -> None:
        super().__init__(items)
        self.writes = writes

    def __setitem__(self, key: str, value: Any) -> None:
        self.writes.n += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self.writes.n += 1
        super().__delitem__(key)

    def __reduce__(self) -> Tuple[type, Tuple[Dict[str, Any]]]:
        return (dict, (dict(self),))


class ModuleWatch:
    """Notices, in O(1) per update, that ModelEMA's ``module`` changed under it: a conversion
    (``ema.module.half()``, ``.float()``, ``.to()``, of the whole module or any submodule:
    ultralytics' validator halves ``ema.ema``) or a replacement (``ema.module = other``, a
    submodule or tensor assigned) leaves the EMA's tensor lists pointing at tensors the module no
    longer holds. Its tables count their writes; the first and last parameter's dtype and device
    are compared too (a conversion changes parameters in place, through ``.data``)."""

    def __init__(self, holder: nn.Module, module: Optional[nn.Module]) -> None:
        self.writes = _Writes()
        self.probe: List[Tuple[Dict[str, Any], str, Tensor, torch.dtype, torch.device]] = []
        if module is not None:
            owners = [holder] + list(module.modules())
            for m in owners:
                for name in ("_parameters", "_buffers", "_modules") if m is not holder else ("_modules",):
                    object.__setattr__(m, name, _WatchedTable(getattr(m, name), self.writes))
            self.probe = probe_slots(_slots(module))
        self.seen = self.writes.n

    def changed(self) -> bool:
        return self.writes.n != self.seen or probe_changed(self.probe)
