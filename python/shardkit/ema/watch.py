"""How ``ModelEMA`` notices, cheaply on every update, that its own module changed under it: a
conversion (``ema.module.half()``, ``.float()``, ``.to()``, of the whole module or of any
submodule), a load with ``assign=True``, or a replaced module, submodule or tensor. The EMA then
reads its tensors again."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from shardkit.ema.structure import _slots, slot_tensor
from shardkit.ops._ema import update_layout

Tensor = torch.Tensor

__all__ = ["ModuleWatch"]


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
    """Notices that ModelEMA's ``module`` changed under it: a conversion (``ema.module.half()``,
    ``.float()``, ``.to()``, of the whole module or any submodule: ultralytics' validator halves
    ``ema.ema``) or a replacement (``ema.module = other``, a submodule or tensor assigned) leaves
    the EMA's tensor lists pointing at tensors the module no longer holds, or at tensors of
    another dtype or device.

    Two checks per update: the module's tables count their writes (a converted buffer, a
    replaced tensor or submodule), and the layout of every tensor of the module (address, dtype,
    device, sizes, strides: ``shardkit._C.ema_layout``, one C call, ~10 ns per tensor) is compared
    with the one seen: a conversion changes parameters in place (through ``.data``, or
    ``torch.utils.swap_tensors``), in any submodule. Under ``torch.compile`` the dtypes and
    devices are compared in Python instead (the compiler turns them into guards)."""

    def __init__(self, holder: nn.Module, module: Optional[nn.Module]) -> None:
        self.writes = _Writes()
        tensors: List[Tensor] = []
        if module is not None:
            owners = [holder] + list(module.modules())
            for m in owners:
                for name in ("_parameters", "_buffers", "_modules") if m is not holder else ("_modules",):
                    object.__setattr__(m, name, _WatchedTable(getattr(m, name), self.writes))
            tensors = [slot_tensor(s) for s in _slots(module)]
        # ema_layout takes two lists of one length (its copy lists): the two halves, which
        # share the middle tensor when the count is odd
        half = (len(tensors) + 1) // 2
        self._halves = (tensors[:half], tensors[len(tensors) - half :])
        self._meta = [(t, t.dtype, t.device) for t in tensors]
        # (made while torch.compile traces: no layout, and the first eager update looks again)
        self.layout: Optional[bytes] = None if torch.compiler.is_compiling() else self._layout()
        self.seen = self.writes.n

    def _layout(self) -> Optional[bytes]:
        return update_layout([], [], *self._halves) if self._meta else None

    def changed(self) -> bool:
        if self.writes.n != self.seen:
            return True
        if torch.compiler.is_compiling():
            return any(t.dtype != dtype or t.device != device for t, dtype, device in self._meta)
        return self._layout() != self.layout
