"""Memory planner for a large-class softmax head: ``python -m shardkit.plan``.

Per device, the bytes held by the classification head (weights, gradients, fp32 master
weights, optimizer state) and by the loss's working set, for three ways of training it:

* ``shardkit``: :class:`shardkit.ShardedSoftmaxLoss`, classes split over ``devices``
  contiguously (device k holds ``C // N`` or ``C // N + 1`` classes), logits computed chunk
  by chunk and never held whole;
* ``partial_fc``: InsightFace's PartialFC_V2, as its published code allocates (per rank);
* ``naive``: one ``nn.Linear(D, C)`` + ``F.cross_entropy`` on one device.

Conventions (all figures are lower bounds of what the allocator will hold):

* ``batch`` is the per-device batch; the loss sees the global batch ``B = batch * devices``
  (gathered embeddings in the distributed mode, every embedding on every shard).
* ``dtype`` is the storage dtype of the head's weight and gradient. For fp16/bf16 the
  optimizer keeps fp32 master weights (``master_weights=True``, mixed-precision training
  as apex O2 does); its state is then fp32. Without master weights the state is in ``dtype``.
* Optimizer state per weight element: sgd 0, sgd-momentum 1, adam/adamw 2 (exp_avg,
  exp_avg_sq); shardkit's sgd-momentum (:class:`shardkit.SparseRowSGD`) adds one byte per
  class (the flag of rows whose momentum has started).
* Logits and softmax statistics are fp32 whatever ``dtype`` is (s = 64 logits overflow fp16).
* Sampling (``sample_rate < 1``): shardkit keeps the whole weight and its optimizer state
  but computes only the sampled rows (``S = ceil(rate * C_k)``, at least the batch's
  positives); the gradient holds only the sampled rows plus their indices, as the sampled
  :class:`shardkit.ShardedSoftmaxLoss` produces (a row-sparse gradient; ``sparse_grad=None``
  or ``True``), or, with ``sparse_grad=False``, a dense weight-sized buffer.
* Not counted: the backbone, activations, the CUDA context (~0.5-1 GiB) and allocator
  fragmentation; pass ``reserve`` to set memory aside for them.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Dict, List, Optional, Tuple, Union

__all__ = ["DeviceMemory", "MemoryPlan", "parse_size", "format_size", "plan_memory"]

MiB = 1 << 20
GiB = 1 << 30
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
OPTIMIZER_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
#: Chunk working-set budget of ShardedSoftmaxLoss when no chunk size is given.
DEFAULT_CHUNK_BUDGET = 192 * MiB
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}


#: The largest size (bytes) and count (classes, dim, batch) the planner takes: an int64's range,
#: as torch's sizes; past it figures stop meaning anything (and would overflow float formatting).
MAX_SIZE = 1 << 63
MAX_COUNT = (1 << 63) - 1


def sampled_rows(sample_rate: float, classes: int) -> int:
    """``ceil(sample_rate * classes)`` in exact integer arithmetic, with the rate read as
    the decimal it prints as (0.07 is 7/100, not the binary 0.07000000000000000666 whose
    product with 100 rounded up to 8), for any class count (no float overflow)."""
    rate = Fraction(repr(float(sample_rate)))
    return -((-rate.numerator * classes) // rate.denominator)


def _brief(value: object) -> str:
    """``repr(value)``, or for a huge int its digit count (a one-line error message)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"a {len(str(abs(value)))}-digit integer"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_size(text: Union[str, int, float]) -> int:
    """Bytes in a human size: ``"80GiB"``, ``"81920MiB"``, ``"80GB"`` (10^9), ``"1.5 TiB"``.

    KiB/MiB/GiB/TiB and the bare letters K/M/G/T are powers of 1024; KB/MB/GB/TB powers of
    1000; a bare number is bytes. Case-insensitive. Raises ValueError on anything else.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must be a finite non-negative number, got {_brief(text)}")
        if text > MAX_SIZE:  # (an int beyond a float's range must not reach float())
            raise ValueError(f"size must be at most 2**63 bytes (8 EiB), got {_brief(text)}")
        return int(text)
    if isinstance(text, float):
        value, unit = text, ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot parse size {text!r}: use a number with a unit such as 80GiB, 80GB or 81920MiB")
        value, unit = float(m.group(1)), m.group(2).lower()
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"size must be a finite non-negative number, got {text!r}")
    nbytes = value * _UNITS[unit]
    if not nbytes <= MAX_SIZE:  # also inf: 1e300TiB
        raise ValueError(f"size must be at most 2**63 bytes (8 EiB), got {_brief(text)}")
    return int(round(nbytes))


def _named_size(name: str, value: Any) -> int:
    """:func:`parse_size` with the ValueError naming the argument."""
    try:
        return parse_size(value)
    except ValueError as err:
        raise ValueError(f"argument `{name}`: {err}") from None


def format_size(nbytes: int) -> str:
    """``"1,953.1 MiB"`` below 1 TiB's worth of MiB columns, GiB for 100 GiB and more.
    ``nbytes``: an int >= 0 (ValueError naming it otherwise)."""
    nbytes = _check_int("nbytes", nbytes, 0, None)
    if nbytes >= 1 << 1000:  # past a float's range: exact integer tenths (rounded half up)
        tenths = (nbytes * 10 + GiB // 2) // GiB
        return f"{tenths // 10:,}.{tenths % 10} GiB"
    if nbytes >= 100 * GiB:
        return f"{nbytes / GiB:,.1f} GiB"
    return f"{nbytes / MiB:,.1f} MiB"


def _short_size(nbytes: int) -> str:
    """``"80 GiB"`` for whole GiB, else :func:`format_size`."""
    return f"{nbytes // GiB} GiB" if nbytes and nbytes % GiB == 0 else format_size(nbytes)


@dataclass
class DeviceMemory:
    """Bytes held on one device by one approach; ``total`` sums the five parts.

    ``loss_parts`` breaks ``loss_working_set`` down (names -> bytes); ``fits`` is None when
    no ``gpu_memory`` was given.
    """

    approach: str
    classes: int
    weights: int
    master_weights: int
    gradients: int
    optimizer_state: int
    loss_working_set: int
    loss_parts: Dict[str, int] = field(default_factory=dict)
    fits: Optional[bool] = None

    @property
    def total(self) -> int:
        return self.weights + self.master_weights + self.gradients + self.optimizer_state + self.loss_working_set


@dataclass
class MemoryPlan:
    """Result of :func:`plan_memory`: the inputs, one :class:`DeviceMemory` per shardkit
    device (``devices[k]`` holds ``devices[k].classes`` classes), the largest PartialFC_V2
    rank and the naive single-device head."""

    classes: int
    dim: int
    num_devices: int
    batch: int
    global_batch: int
    dtype: str
    optimizer: str
    sample_rate: float
    master_weights: bool
    chunk_classes: int
    gpu_memory: Optional[int]
    reserve: int
    devices: List[DeviceMemory]
    partial_fc: DeviceMemory
    naive: DeviceMemory

    @property
    def shardkit_max(self) -> DeviceMemory:
        """The most loaded shardkit device (the one that decides whether the plan fits)."""
        return max(self.devices, key=lambda d: d.total)


#: The most devices a plan takes (its tables list every device).
MAX_DEVICES = 1 << 16


def _check_int(name: str, value: object, minimum: int, maximum: Optional[int] = MAX_COUNT) -> int:
    # Python and numpy integers (numbers.Integral); bool, floats and strings refused
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"argument `{name}` must be an integer >= {minimum}, got {type(value).__name__} {_brief(value)}"
        )
    value = int(value)
    if value < minimum:
        raise ValueError(f"argument `{name}` must be an integer >= {minimum}, got {_brief(value)}")
    if maximum is not None and value > maximum:
        raise ValueError(f"argument `{name}` must be at most 2**63 - 1, got {_brief(value)}")
    return value


def _check_flag(name: str, value: object) -> Optional[bool]:
    """None or a bool (Python's or numpy's); anything else ('no', 0, 2) a ValueError naming ``name``."""
    if value is None or isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"):
        return bool(value)
    raise ValueError(f"argument `{name}` must be True, False or None, got {type(value).__name__} {_brief(value)}")


def _check_choice(name: str, value: object, table: Dict[str, int]) -> str:
    """``value`` when it is one of ``table``'s names (a string), else a ValueError naming ``name``
    (also for an unhashable value, which ``in`` would fail on with a TypeError naming nothing)."""
    if not isinstance(value, str) or value not in table:
        raise ValueError(f"argument `{name}` must be one of {sorted(table)}, got {value!r}")
    return value


def _check_rate(sample_rate: object) -> float:
    """``sample_rate`` as a float in (0, 1]: Python and numpy real numbers; bool refused (as
    for the sizes), and an int too large for a float (an OverflowError naming nothing)."""
    rate = math.nan
    if not isinstance(sample_rate, bool) and isinstance(sample_rate, numbers.Real):
        try:
            rate = float(sample_rate)
        except OverflowError:
            pass
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"argument `sample_rate` must be in (0, 1], got {_brief(sample_rate)}")
    return rate


def _head_parts(rows: int, dim: int, elem: int, states: int, master: bool) -> Tuple[int, int, int]:
    """(weights, master weights, optimizer state) bytes of a [rows, dim] parameter."""
    n = rows * dim
    state_elem = 4 if master else elem
    return n * elem, (n * 4 if master else 0), n * states * state_elem


def plan_memory(
    classes: int,
    dim: int,
    devices: int,
    batch: int,
    dtype: str = "fp32",
    optimizer: str = "sgd-momentum",
    sample_rate: float = 1.0,
    gpu_memory: Union[None, int, str] = None,
    *,
    master_weights: Optional[bool] = None,
    sparse_grad: Optional[bool] = None,
    chunk_budget: Union[int, str] = DEFAULT_CHUNK_BUDGET,
    reserve: Union[int, str] = 0,
) -> MemoryPlan:
    """Bytes per device of a ``classes`` x ``dim`` softmax head trained three ways.

    Args:
        classes: C, total number of classes (int >= 1).
        dim: D, embedding size (int >= 1).
        devices: N, devices the classes are sharded over (int, 1 to 65,536).
        batch: images per device per step (int >= 1); the loss sees ``batch * devices``.
        dtype: head weight/gradient storage: ``"fp32"``, ``"fp16"`` or ``"bf16"``.
        optimizer: ``"sgd"``, ``"sgd-momentum"``, ``"adam"`` or ``"adamw"``.
        sample_rate: PartialFC rate in (0, 1].
        gpu_memory: bytes per device (int or size string such as ``"80GiB"``) > 0, or None.
        master_weights: fp32 master copy for fp16/bf16 (default: True unless fp32).
        sparse_grad: sampled mode keeps gradients of sampled rows only (else a dense buffer);
            None (default) = True, what shardkit's sampled mode does.
        chunk_budget: ShardedSoftmaxLoss's chunk working-set budget (default 192 MiB).
        reserve: bytes set aside per device for everything not counted here (less than
            ``gpu_memory`` when that is given).

    Returns:
        MemoryPlan. Raises ValueError on invalid arguments.
    """
    classes = _check_int("classes", classes, 1)
    dim = _check_int("dim", dim, 1)
    n_dev = _check_int("devices", devices, 1)
    if n_dev > MAX_DEVICES:  # (more devices than classes: some hold none, as ShardedSoftmaxLoss allows)
        got = f"{n_dev:,}" if n_dev < 10**30 else _brief(n_dev)
        raise ValueError(f"argument `devices` must be at most {MAX_DEVICES:,}, got {got}")
    batch = _check_int("batch", batch, 1)
    dtype = _check_choice("dtype", dtype, DTYPE_BYTES)
    optimizer = _check_choice("optimizer", optimizer, OPTIMIZER_STATES)
    sample_rate = _check_rate(sample_rate)
    gpu = None if gpu_memory is None else _named_size("gpu_memory", gpu_memory)
    budget, reserve = _named_size("chunk_budget", chunk_budget), _named_size("reserve", reserve)
    if budget <= 0:
        raise ValueError(f"argument `chunk_budget` must be > 0, got {chunk_budget!r}")
    if gpu is not None and gpu <= 0:
        raise ValueError(f"argument `gpu_memory` must be > 0, got {gpu_memory!r}")
    if gpu is None and reserve:  # (a reserve is taken off gpu_memory: alone it would be ignored)
        raise ValueError(f"argument `reserve` needs argument `gpu_memory`, got reserve={_short_size(reserve)} alone")
    if gpu is not None and reserve >= gpu:
        raise ValueError(
            f"argument `reserve` ({_short_size(reserve)}) must be less than argument `gpu_memory` ({_short_size(gpu)})"
        )
    elem = DTYPE_BYTES[dtype]
    master_weights, sparse_grad = _check_flag("master_weights", master_weights), _check_flag("sparse_grad", sparse_grad)
    master = (dtype != "fp32") if master_weights is None else master_weights
    states = OPTIMIZER_STATES[optimizer]
    B = batch * n_dev
    sampled = sample_rate < 1.0

    def n_sampled(rows: int) -> int:
        # Every positive class of the batch is kept, so at least min(rows, B) rows are used.
        return min(rows, max(sampled_rows(sample_rate, rows), min(rows, B))) if sampled else rows

    # Per class of a chunk: B fp32 logits (+ B gradient values in a 16-bit dtype) and two
    # fp32 weight rows (converted/normalized weights and their gradient).
    per_class = B * (4 + (elem if elem < 4 else 0)) + 2 * dim * 4
    chunk = max(1, budget // per_class)
    if chunk >= 64:
        chunk -= chunk % 64

    def fits(d: DeviceMemory) -> DeviceMemory:
        d.fits = None if gpu is None else d.total + reserve <= gpu
        return d

    shard_rows = [classes // n_dev + (1 if k < classes % n_dev else 0) for k in range(n_dev)]
    per_device = []
    by_rows: Dict[int, DeviceMemory] = {}  # at most two shard sizes: one entry each, shared
    for rows in shard_rows:
        if rows in by_rows:
            per_device.append(by_rows[rows])
            continue
        w, mw, opt = _head_parts(rows, dim, elem, states, master)
        if optimizer == "sgd-momentum":
            opt += rows  # SparseRowSGD's per-row "seen" flags (bool)
        used = n_sampled(rows)
        c = min(chunk, max(used, 1))
        parts = {
            "chunk logits + weight rows": c * per_class if rows else 0,
            "gathered embeddings + grad (fp32)": B * dim * (elem + 4),
            "per-row statistics": B * 4 * 8,
        }
        grad = rows * dim * elem
        if sampled:
            parts["sampled row indices"] = used * 8
            if sparse_grad is None or sparse_grad:
                grad = used * dim * elem
        ws = sum(parts.values())
        by_rows[rows] = fits(DeviceMemory("shardkit", rows, w, mw, grad, opt, ws, parts))
        per_device.append(by_rows[rows])

    # PartialFC_V2 (per rank, largest shard): an fp32 Parameter whatever the AMP setting,
    # dense fp32 gradient (indexing's backward scatters into a weight-sized buffer),
    # optimizer state on the whole weight, and [B, S] fp32 logits held for the backward.
    rows = shard_rows[0]
    used = n_sampled(rows)
    half = dtype != "fp32"
    pfc_parts = {
        "logits [B, S] fp32 (held, backward grad, one-hot)": 3 * B * used * 4 + (B * used * 2 if half else 0),
        "sampled/normalized weight rows + grad": used * dim * (4 + 4 + (2 if half else 0))
        + (used * dim * 4 if sampled else 0),
        "gathered embeddings (+ normalized, grad)": 3 * B * dim * 4,
    }
    pfc = DeviceMemory(
        "partial_fc",
        rows,
        rows * dim * 4,
        0,
        rows * dim * 4,
        rows * dim * 4 * states,
        sum(pfc_parts.values()),
        pfc_parts,
    )

    # Naive: nn.Linear + F.cross_entropy on one device: logits [B, C] in dtype, fp32
    # log-softmax saved for backward, fp32 gradient of the logits.
    w, mw, opt = _head_parts(classes, dim, elem, states, master)
    naive_parts = {
        "logits [B, C]": B * classes * elem,
        "log-softmax [B, C] fp32": B * classes * 4,
        "grad of logits [B, C] fp32": B * classes * 4,
        "embeddings + grad": B * dim * (elem + 4),
    }
    naive = DeviceMemory("naive", classes, w, mw, classes * dim * elem, opt, sum(naive_parts.values()), naive_parts)

    return MemoryPlan(
        classes,
        dim,
        n_dev,
        batch,
        B,
        dtype,
        optimizer,
        sample_rate,
        master,
        min(chunk, max(shard_rows)),
        gpu,
        reserve,
        per_device,
        fits(pfc),
        fits(naive),
    )
