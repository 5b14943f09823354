"""SGD that updates only the rows present in a row-sparse gradient (PartialFC).

With PartialFC sampling, each step's weight gradient is a sparse COO tensor holding the
sampled rows only. ``torch.optim.SGD`` would move the other rows too (momentum keeps
pushing rows whose buffer is non-zero; weight decay touches every row; with a sparse
gradient it even raises on weight decay). :class:`SparseRowSGD` applies SGD with
momentum, dampening, weight decay and Nesterov to the gradient's rows alone: the weight
AND the momentum buffer of an unsampled row stay bit-for-bit unchanged, so the row just
misses that step (the PartialFC behaviour).
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any, Callable, Optional, overload

import torch

from shardkit.ops._args import too_large_for_float

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

__all__ = ["SparseRowSGD"]


def _real(name: str, value: object, where: str) -> float:
    """``value`` as a float: a real number (not a bool), or for ``lr`` a one-element tensor
    (as ``torch.optim.SGD`` allows); else a TypeError naming the argument (a ValueError for
    a number too large for a float)."""
    if name == "lr" and isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{where}argument `lr` as a tensor must have one element, got shape {list(value.shape)}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}argument `{name}` must be a real number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:  # a huge int or Fraction
        raise ValueError(
            f"{where}argument `{name}` must be a finite number, got {too_large_for_float(value)}"
        ) from None


def _hyper(group: dict[str, Any]) -> tuple[Any, float, float, float]:
    """(lr, weight_decay, momentum, dampening) as the steps use them: floats (a Fraction or a
    numpy number as well), a tensor lr as a 0-d tensor (``[0.1]`` too, as torch.optim.SGD
    takes it; typed Any: torch's stubs list numbers only for `alpha`, which takes 0-d tensors)."""
    lr = group["lr"]
    lr = lr.reshape(()) if isinstance(lr, torch.Tensor) else float(lr)
    return lr, float(group["weight_decay"]), float(group["momentum"]), float(group["dampening"])


def _check_hyperparameters(group: dict[str, Any], where: str = "") -> None:
    """ValueError / TypeError naming the first bad hyper-parameter of ``group``."""
    lr, momentum, dampening, wd = (
        _real(name, group[name], where) for name in ("lr", "momentum", "dampening", "weight_decay")
    )
    for name, value, ok, rule in (
        ("lr", lr, lr >= 0, ">= 0"),
        ("momentum", momentum, 0 <= momentum < 1, "in [0, 1)"),
        ("dampening", dampening, 0 <= dampening <= 1, "in [0, 1]"),
        ("weight_decay", wd, wd >= 0, ">= 0"),
    ):
        if not (ok and math.isfinite(value)):
            raise ValueError(f"{where}argument `{name}` must be {rule} and finite, got {value}")
    if not isinstance(group["nesterov"], bool):
        raise TypeError(f"{where}argument `nesterov` must be True or False, got {group['nesterov']!r}")
    if group["nesterov"] and (momentum <= 0 or dampening != 0):
        raise ValueError(f"{where}argument `nesterov` needs momentum > 0 and dampening = 0")


_HYPERPARAMETERS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")


def momentum_state_problem(
    buf: object,
    seen: object,
    shape: torch.Size,
    dtype: torch.dtype,
    keys: tuple[str, str] = ("momentum_buffer", "seen"),
    like: str = "the parameter's",
) -> tuple[type[Exception], str] | None:
    """What is wrong with a momentum buffer ``buf`` (None: none) and its per-row flags
    ``seen`` (None: none) for a parameter of ``shape`` and ``dtype`` (``like``: "the
    parameter's", in the message), as (exception type, message naming the key), or None when
    they can be loaded: the buffer a dense tensor of ``shape`` (floating when the parameter is,
    else of its dtype), the flags a dense 1-D bool tensor (or an integer one holding only 0
    and 1) of the parameter's row count."""
    for key, t in zip(keys, (buf, seen)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            return TypeError, f"`{key}` must be a tensor, got {type(t).__name__}"
        if t.is_nested or t.layout != torch.strided or t.device.type == "meta":
            return TypeError, f"`{key}` must be a dense tensor with data, got layout {t.layout} on {t.device}"
    rows = shape[0] if len(shape) else 1
    if isinstance(buf, torch.Tensor):
        if not (buf.is_floating_point() if dtype.is_floating_point else buf.dtype == dtype):
            return (
                TypeError,
                f"`{keys[0]}` must be {'floating point' if dtype.is_floating_point else dtype}, got {buf.dtype}",
            )
        if buf.shape != shape:
            return ValueError, f"`{keys[0]}` must have {like} shape {list(shape)}, got {list(buf.shape)}"
    if isinstance(seen, torch.Tensor):
        if seen.dtype != torch.bool and (seen.is_floating_point() or seen.is_complex()):
            return TypeError, f"`{keys[1]}` must be a bool tensor (one flag per row), got {seen.dtype}"
        if seen.shape != (rows,):
            return ValueError, f"`{keys[1]}` must have shape [{rows}] (one flag per row), got {list(seen.shape)}"
        if seen.dtype != torch.bool and not bool(((seen == 0) | (seen == 1)).all()):
            return ValueError, f"`{keys[1]}` as an integer tensor must hold only 0 and 1"
    return None


class SparseRowSGD(torch.optim.Optimizer):
    """SGD (lr, momentum, dampening, weight_decay, nesterov; the ``torch.optim.SGD``
    update rule) that touches only rows present in a row-sparse gradient.

    Args:
        params: parameters or parameter groups, as for ``torch.optim.SGD``.
        lr, momentum, dampening, weight_decay, nesterov: as ``torch.optim.SGD``: lr (a float
            or a one-element tensor) and weight_decay finite and >= 0, momentum in [0, 1),
            dampening in [0, 1]. A ValueError names a bad value, a TypeError a non-number.
        maximize, foreach, differentiable, fused: ``torch.optim.SGD``'s, taken so that its
            calls run unchanged: ``foreach`` and ``fused`` (kernel choices) are ignored;
            ``maximize`` and ``differentiable`` must be False (ValueError otherwise).

    Parameters with a sparse COO gradient (``F.embedding(..., sparse=True)``, which the
    sampled :class:`shardkit.ShardedSoftmaxLoss` produces) are updated row by row: for the
    gradient's rows R only, ``g = grad[R] + wd * p[R]``; ``buf[R] = g`` the first time a row
    is seen, else ``momentum * buf[R] + (1 - dampening) * g``; ``p[R] -= lr * (g + momentum *
    buf[R] if nesterov else buf[R])``. Rows outside R are not read or written. On a dense
    gradient every row is in R: the step equals ``torch.optim.SGD``'s, and runs as it does by
    default (multi-tensor kernels per device and dtype on a GPU, one tensor at a time on the
    CPU; a tensor ``lr``, or a parameter whose earlier sparse steps left rows unstarted, takes
    the per-row rule). Momentum buffers are
    dense [rows, ...] tensors in ``state[p]["momentum_buffer"]`` with a [rows] bool
    ``state[p]["seen"]`` (rows whose buffer has been started).

    Cost on CUDA: a sparse gradient is coalesced first (its rows must be unique), and torch
    sizes a coalesced CUDA tensor on the host: one device-to-host sync per sparse parameter
    per step (autograd does not keep the coalesced flag of the sampled shard's gradient).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        differentiable: bool = False,
        fused: Optional[bool] = None,
    ) -> None:
        # torch.optim.SGD's other arguments, so that a call written for it runs unchanged:
        # foreach and fused choose kernels (this optimizer picks its own) and are ignored.
        for name, value in (("maximize", maximize), ("differentiable", differentiable)):
            if value is not False:
                raise ValueError(
                    f"argument `{name}`={value!r} is not supported: SparseRowSGD minimizes (negate the loss "
                    "to maximize) and its step is not differentiable"
                )
        for name, flag in (("foreach", foreach), ("fused", fused)):
            if flag is not None and not isinstance(flag, bool):
                raise TypeError(f"argument `{name}` must be None or a bool, got {type(flag).__name__}")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
        _check_hyperparameters(defaults)
        super().__init__(params, defaults)
        self._all_seen: set[torch.Tensor] = set()  # parameters whose every row's buffer has started

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._all_seen = set()  # not pickled: the next dense step takes the per-row rule once

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group``, with the group's own lr, momentum,
        dampening, weight_decay and nesterov checked as the constructor checks its arguments."""
        if isinstance(param_group, dict):  # else torch's own TypeError
            _check_hyperparameters({**self.defaults, **param_group}, where=f"param group {len(self.param_groups)}: ")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a SparseRowSGD state_dict, or a ``torch.optim.SGD`` one (same layout; its
        states lack ``seen``).

        A ``torch.optim.SGD`` momentum buffer has been started for every row (SGD updates
        all rows every step), so a loaded buffer gets ``seen`` True for every row: the next
        steps then equal what ``torch.optim.SGD`` would have done (a row with a zero buffer
        gets ``momentum * 0 + (1 - dampening) * g``, as in SGD, not the first-step ``g``).
        A ``None`` buffer (SGD with momentum 0, or no step yet) starts fresh. SGD's
        ``maximize=True`` is refused (SparseRowSGD only minimizes); ``foreach``, ``fused``
        and ``differentiable`` are implementation choices and are ignored.

        Everything is checked before anything is loaded (a refused state leaves the optimizer
        as it was): each param group's lr, momentum, dampening, weight_decay and nesterov as
        the constructor checks them, and each parameter's state: ``momentum_buffer`` None or a
        floating tensor of the parameter's shape, ``seen`` a bool (or 0/1 integer, converted)
        tensor of its row count; each state key must name a parameter of the param groups
        (once). A TypeError / ValueError names the param group and key.
        """
        self._check_state_dict(state_dict)  # everything, before anything changes
        super().load_state_dict(state_dict)
        self._all_seen.clear()  # the next dense step of each parameter takes the per-row rule once
        # Optimizer.load_state_dict casts tensor state to the parameter's floating dtype;
        # the per-row `seen` flags must stay boolean.
        for state in self.state.values():
            if state.get("momentum_buffer", 0) is None:
                del state["momentum_buffer"]
                state.pop("seen", None)
            elif "momentum_buffer" in state and "seen" not in state:
                buf = state["momentum_buffer"]
                state["seen"] = torch.ones(buf.shape[0] if buf.dim() else 1, dtype=torch.bool, device=buf.device)
            if "seen" in state:
                state["seen"] = state["seen"].bool()

    def state_replaced(self, p: torch.Tensor) -> None:
        """Called after ``p``'s momentum state was replaced from outside (e.g. by
        :func:`shardkit.load_sharded`): its next step takes the per-row ``seen`` rule again."""
        self._all_seen.discard(p)

    def _check_state_dict(self, state_dict: object) -> None:
        """TypeError / ValueError naming the param group and key of the first entry of
        ``state_dict`` that the constructor or a step would refuse."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError(
                "argument `state_dict` must be an optimizer state_dict (a dict with 'state' and 'param_groups')"
            )
        groups, states = state_dict["param_groups"], state_dict["state"]
        if not isinstance(groups, (list, tuple)) or not isinstance(states, dict):
            raise TypeError("argument `state_dict`: 'param_groups' must be a list and 'state' a dict")
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"argument `state_dict` holds {len(groups)} param groups, this optimizer {len(self.param_groups)}"
            )
        params: dict[Any, tuple[torch.Tensor, str]] = {}  # state key -> (parameter, its name in messages)
        for i, (group, mine) in enumerate(zip(groups, self.param_groups)):
            where = f"argument `state_dict`, param group {i}: "
            if not isinstance(group, dict) or not isinstance(group.get("params"), (list, tuple)):
                raise TypeError(f"{where}must be a dict with a 'params' list, got {type(group).__name__}")
            if len(group["params"]) != len(mine["params"]):
                raise ValueError(
                    f"{where}holds {len(group['params'])} parameters, this optimizer's group {len(mine['params'])}"
                )
            missing = [name for name in _HYPERPARAMETERS if name not in group]
            if missing:
                raise ValueError(f"{where}lacks the hyper-parameter(s) {', '.join(f'`{m}`' for m in missing)}")
            if group.get("maximize"):
                raise ValueError(
                    f"argument `state_dict`: param group {i} has maximize=True (a torch.optim.SGD state); "
                    "SparseRowSGD only minimizes"
                )
            _check_hyperparameters(group, where)
            for j, (key, p) in enumerate(zip(group["params"], mine["params"])):
                try:
                    taken = key in params
                except TypeError:  # unhashable
                    raise TypeError(
                        f"{where}parameter {j}: its state key must be hashable (an int), got {type(key).__name__}"
                    ) from None
                if taken:
                    raise ValueError(f"{where}parameter {j}: state key {key!r} names two parameters")
                params[key] = (p, f"param group {i}, parameter {j} (state key {key!r}, shape {list(p.shape)})")
        for key, entry in states.items():
            if key not in params:  # torch would keep it aside, and the loading below would trip on it
                keys = list(params)
                known = ", ".join(repr(k) for k in keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
                raise ValueError(
                    f"argument `state_dict`: state[{key!r}] names no parameter of the param groups "
                    f"(their state keys: {known})"
                )
            p, name = params[key]
            if not isinstance(entry, dict):
                raise TypeError(f"argument `state_dict`, {name}: the state must be a dict, got {type(entry).__name__}")
            problem = momentum_state_problem(entry.get("momentum_buffer"), entry.get("seen"), p.shape, p.dtype)
            if problem is None and "seen" in entry and entry["seen"] is None:
                problem = TypeError, "`seen` must be a tensor, got NoneType"
            if problem is not None:
                raise problem[0](f"argument `state_dict`, {name}: {problem[1]}")

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient (dense: torch.optim.SGD's; sparse
        rows: the rule in the class notes); returns the closure's loss (``closure`` re-evaluates
        the model under grad mode, as torch's optimizers call it). ``ValueError`` for a sparse
        gradient that is not row-sparse (sparse_dim 1)."""
        loss: float | None = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            dense: list[torch.Tensor] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    grad = grad.coalesce()  # unique, sorted rows
                    rows, values = grad.indices()[0], grad.values()
                    if grad.sparse_dim() != 1:
                        raise ValueError(
                            "SparseRowSGD: sparse gradients must be row-sparse (sparse_dim 1), got "
                            f"sparse_dim {grad.sparse_dim()}"
                        )
                    self._update(p, rows, values, group)
                    self._all_seen.discard(p)
                elif self._batchable(p, group):
                    dense.append(p)
                else:
                    self._update(p, None, grad, group)
                    self._all_seen.add(p)
            if dense:
                self._dense_steps(dense, group)
        return loss

    def _batchable(self, p: torch.Tensor, group: dict[str, Any]) -> bool:
        # A dense gradient takes the multi-tensor step when every row of its buffer has been
        # started (or it has none yet) and lr is a number (a tensor lr takes the per-tensor step).
        if isinstance(group["lr"], torch.Tensor) or p.grad is None or p.grad.dtype != p.dtype:
            return False
        return group["momentum"] == 0 or "momentum_buffer" not in self.state[p] or p in self._all_seen

    def _dense_steps(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """``torch.optim.SGD``'s step on dense gradients (every row present), as torch runs
        it by default: multi-tensor kernels per (device, dtype) on GPUs (few launches), one
        tensor at a time on the CPU (one pass over each tensor while it is in cache)."""
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in params:
            by_kind.setdefault((p.device, p.dtype), []).append(p)
        for (device, _), ps in by_kind.items():
            if device.type == "cpu":
                for p in ps:
                    self._sgd_tensor(p, group)
            else:
                self._sgd_tensors(ps, group)
        if group["momentum"] != 0:
            self._all_seen.update(params)

    def _sgd_tensor(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        # torch.optim.SGD's single-tensor step: the same operations as _sgd_tensors.
        lr, wd, momentum, dampening = _hyper(group)
        lr = float(lr)
        assert p.grad is not None
        g = p.grad if wd == 0 else p.grad.add(p, alpha=wd)
        if momentum != 0:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.clone(g).detach()
                state["seen"] = torch.ones(p.shape[0] if p.dim() else 1, dtype=torch.bool, device=p.device)
                buf = state["momentum_buffer"]
            else:
                buf = state["momentum_buffer"].mul_(momentum).add_(g, alpha=1.0 - dampening)
            g = g.add(buf, alpha=momentum) if group["nesterov"] else buf
        p.add_(g, alpha=-lr)

    def _sgd_tensors(self, ps: list[torch.Tensor], group: dict[str, Any]) -> None:
        lr, wd, momentum, dampening = _hyper(group)
        lr = float(lr)
        grads: list[torch.Tensor] | tuple[torch.Tensor, ...] = [p.grad for p in ps if p.grad is not None]
        if wd != 0:
            grads = torch._foreach_add(grads, ps, alpha=wd)
        if momentum != 0:
            started = [i for i, p in enumerate(ps) if "momentum_buffer" in self.state[p]]
            if started:
                bufs = [self.state[ps[i]]["momentum_buffer"] for i in started]
                torch._foreach_mul_(bufs, momentum)
                torch._foreach_add_(bufs, [grads[i] for i in started], alpha=1.0 - dampening)
            for p, g in zip(ps, grads):
                state = self.state[p]
                if "momentum_buffer" not in state:
                    # torch.optim.SGD starts a buffer with the raw gradient (no dampening).
                    state["momentum_buffer"] = torch.clone(g).detach()
                    state["seen"] = torch.ones(p.shape[0] if p.dim() else 1, dtype=torch.bool, device=p.device)
            bufs = [self.state[p]["momentum_buffer"] for p in ps]
            grads = torch._foreach_add(grads, bufs, alpha=momentum) if group["nesterov"] else bufs
        torch._foreach_add_(ps, grads, alpha=-lr)

    def _update(self, p: torch.Tensor, rows: torch.Tensor | None, g: torch.Tensor, group: dict[str, Any]) -> None:
        lr, wd, momentum, dampening = _hyper(group)
        current = p if rows is None else p.index_select(0, rows)
        if wd != 0:
            g = g.add(current, alpha=wd)
        if momentum != 0:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                # one flag per row; a scalar parameter (e.g. a learnable scale) is one row
                state["seen"] = torch.zeros(p.shape[0] if p.dim() else 1, dtype=torch.bool, device=p.device)
            buf_all, seen_all = state["momentum_buffer"], state["seen"]
            buf = buf_all if rows is None else buf_all.index_select(0, rows)
            seen = seen_all if rows is None else seen_all.index_select(0, rows)
            seen = seen.view((-1,) + (1,) * (g.dim() - 1)) if g.dim() else seen.view(())
            # torch.optim.SGD starts a buffer with the raw gradient (no dampening).
            new_buf = torch.where(seen, buf.mul(momentum).add(g, alpha=1.0 - dampening), g)
            if rows is None:
                buf_all.copy_(new_buf)
                seen_all.fill_(True)
            else:
                buf_all.index_copy_(0, rows, new_buf)
                seen_all.index_fill_(0, rows, True)
            g = g.add(new_buf, alpha=momentum) if group["nesterov"] else new_buf
        if rows is None:
            p.add_(g, alpha=-lr)
        else:
            p.index_copy_(0, rows, current.add(g, alpha=-lr))
