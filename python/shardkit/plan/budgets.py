"""The loss's memory budget in the planner: for each ``memory_budget`` of
:class:`shardkit.ShardedSoftmaxLoss`, the logits a device keeps from forward to backward, the
time the layer's GEMM work takes relative to its three GEMMs, and the largest class count that
still fits.

* Kept logits are float32, ``B`` values per class plus one per row (what the CPU kernels keep,
  :func:`shardkit.ops.kept_bytes`), whole chunks of ``chunk_classes`` classes (the planner's
  chunk), or the whole shard once it fits.
* Time factor: a model, not a measurement: the layer's GEMM passes over its three (logits, dX,
  dW): ``(3 + share of classes recomputed) / 3``, so 4/3 with no budget and 1 with the whole
  shard kept. It leaves out the elementwise passes (about one more memory pass over the kept
  logits; they matter at small D, see the README's measured figures).
* Largest class count: the largest C whose plan (weights, gradients, optimizer state, working
  set, kept logits) fits ``gpu_memory - reserve`` on every device.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Any, List, Optional, Sequence, Tuple, Union

from shardkit.plan.memory import MAX_COUNT, MAX_SIZE, DeviceMemory, MemoryPlan, _check_int, plan_memory, sampled_rows

#: The budget label that stands for "the whole shard's logits".
FULL = "full"

Budget = Union[int, str]  # bytes, or FULL


@dataclass
class BudgetPlan:
    """One budget's figures on the most loaded device: ``kept_classes`` and ``extra`` (bytes
    held from forward to backward), the modelled ``time_factor`` and, with ``gpu_memory``,
    ``largest_classes`` (None otherwise)."""

    budget: Budget
    kept_classes: int
    extra: int
    time_factor: float
    largest_classes: Optional[int] = None


def check_budget(budget: Any, name: str = "budget") -> Budget:
    """``budget`` as the planner takes it: bytes (an int >= 0) or :data:`FULL` (any case).
    TypeError / ValueError naming ``name`` otherwise (a float, a bool, a size string: the
    command line parses those; "auto": its bytes depend on the memory free at run time)."""
    if isinstance(budget, str):
        if budget.strip().lower() == FULL:
            return FULL
        hint = (
            "; 'auto' is a quarter of the memory available at each forward, which a plan cannot know: plan "
            "with that many bytes"
            if budget.strip().lower() == "auto"
            else ""
        )
        raise ValueError(f"argument `{name}` must be bytes (an int >= 0) or {FULL!r}, got {budget!r}{hint}")
    if isinstance(budget, bool) or not isinstance(budget, Integral):
        raise TypeError(f"argument `{name}` must be bytes (an int >= 0) or {FULL!r}, got {type(budget).__name__}")
    size = int(budget)
    if size < 0:
        raise ValueError(f"argument `{name}` must be bytes (an int >= 0) or {FULL!r}, got {size}")
    if size > MAX_SIZE:
        got = size if size < 10**30 else f"a {len(str(size))}-digit integer"
        raise ValueError(f"argument `{name}` must be at most 2**63 bytes (8 EiB) or {FULL!r}, got {got}")
    return size


def kept_logits(batch: int, classes: int, chunk: int, budget: Budget) -> Tuple[int, int]:
    """(kept classes, bytes) of one shard of ``classes`` classes at ``budget`` (bytes or
    :data:`FULL`), as :func:`shardkit.ops.kept_chunks_for_budget` keeps them. ``batch`` and
    ``classes`` are ints >= 0, ``chunk`` an int >= 1 (ValueError naming them otherwise)."""
    batch, classes = _check_int("batch", batch, 0), _check_int("classes", classes, 0)
    chunk, budget = _check_int("chunk", chunk, 1), check_budget(budget)
    if classes <= 0 or batch <= 0 or budget == 0:
        return 0, 0
    whole = batch * (classes + 1) * 4
    if budget == FULL or (isinstance(budget, int) and whole <= budget):
        return classes, whole
    chunk = max(1, min(chunk, classes))
    keep = max(0, (int(budget) - batch * 4) // (batch * chunk * 4))
    return (keep * chunk, batch * (keep * chunk + 1) * 4) if keep else (0, 0)


def _device_kept(plan: MemoryPlan, budget: Budget) -> Tuple[int, int, float]:
    """(kept classes, bytes, recomputed share) on the device holding the most kept bytes."""
    best: Tuple[int, int, float] = (0, 0, 1.0)
    for classes in _used_classes(plan):
        kept, nbytes = kept_logits(plan.global_batch, classes, plan.chunk_classes, budget)
        share = 1.0 - kept / classes if classes else 0.0
        if nbytes > best[1] or (nbytes == best[1] and share < best[2]):
            best = (kept, nbytes, share)
    return best


def _distinct(plan: MemoryPlan) -> List[DeviceMemory]:
    # The devices of distinct shard sizes (a plan's equal shards share one entry).
    return list({d.classes: d for d in plan.devices}.values())


def _used_classes(plan: MemoryPlan) -> List[int]:
    # The classes each distinct device's op sees: its shard, or the sampled part of it.
    if plan.sample_rate >= 1.0:
        return [d.classes for d in _distinct(plan)]
    rate, batch = plan.sample_rate, plan.global_batch
    return [min(d.classes, max(sampled_rows(rate, d.classes), min(d.classes, batch))) for d in _distinct(plan)]


def _fits(plan: MemoryPlan, budget: Budget) -> bool:
    assert plan.gpu_memory is not None  # largest_classes is asked only with gpu_memory
    used = _used_classes(plan)
    return all(
        d.total + kept_logits(plan.global_batch, c, plan.chunk_classes, budget)[1] + plan.reserve <= plan.gpu_memory
        for d, c in zip(_distinct(plan), used)
    )


def plan_budgets(budgets: Sequence[Budget], **plan_args: Any) -> List[BudgetPlan]:
    """:class:`BudgetPlan` per budget for the head that :func:`shardkit.plan.plan_memory` plans
    from ``plan_args`` (its arguments, by name): a list, one per budget, in order.

    Args:
        budgets: ``memory_budget`` values to plan: bytes (ints >= 0) or :data:`FULL`.
        plan_args: :func:`shardkit.plan.plan_memory`'s arguments; with ``gpu_memory`` each
            row also gets its ``largest_classes``.

    Raises ``TypeError`` / ``ValueError`` naming the argument: ``budgets`` not a list, an entry
    that is a float, a bool, a size string (the command line parses those) or ``"auto"`` (its
    bytes depend on the memory free at run time); ``plan_memory``'s own errors."""
    if isinstance(budgets, (str, bytes)) or not isinstance(budgets, Sequence):
        raise TypeError(
            f"argument `budgets` must be a list of budgets (bytes or {FULL!r}), got {type(budgets).__name__}"
        )
    budgets = [check_budget(b, f"budgets[{i}]") for i, b in enumerate(budgets)]
    plan = plan_memory(**plan_args)
    out = []
    for budget in budgets:
        kept, nbytes, recomputed = _device_kept(plan, budget)
        # The slowest device sets the step: the largest recomputed share among devices.
        worst = max(
            (1.0 - kept_logits(plan.global_batch, c, plan.chunk_classes, budget)[0] / c if c else 0.0)
            for c in _used_classes(plan)
        )
        row = BudgetPlan(budget, kept, nbytes, (3.0 + worst) / 3.0)
        if plan.gpu_memory is not None:
            row.largest_classes = largest_classes(budget, **plan_args)
        out.append(row)
    return out


def largest_classes(budget: Budget, **plan_args: Any) -> int:
    """The largest class count whose plan fits ``gpu_memory`` at ``budget`` (0 if not even
    one class does). ``plan_args`` are :func:`plan_memory`'s (``classes`` aside) and must
    include ``gpu_memory``.

    A device keeps its whole shard's logits while they fit the budget and whole chunks after,
    so the kept bytes drop (by up to a chunk) where its shard outgrows the budget: fitting is
    monotone in C only between those points. The search bisects each such stretch (all
    devices keeping their whole shard, some, none) and returns the largest count found.

    Raises ``ValueError`` without ``gpu_memory``; ``TypeError`` / ``ValueError`` naming a bad
    ``budget`` (as :func:`plan_budgets`) or a bad ``plan_memory`` argument."""
    budget = check_budget(budget)
    args = dict(plan_args)
    if args.get("gpu_memory") is None:
        raise ValueError("argument `gpu_memory` is needed: largest_classes finds the largest C that fits in it")

    def plan(classes: int) -> MemoryPlan:
        args["classes"] = classes
        return plan_memory(**args)

    def whole(classes: int, every: bool) -> bool:  # all / some devices keep their whole shard
        p = plan(classes)
        used = _used_classes(p)
        size = min(used) if not every else max(used)
        return isinstance(budget, int) and 0 < budget and p.global_batch * (size + 1) * 4 <= budget

    def fits(classes: int) -> bool:
        return _fits(plan(classes), budget)

    one = plan(1)  # (plan_memory checks the arguments first); more classes keep more bytes
    if not _fits(one, budget):
        return 0
    # A class keeps at least one byte (its weight row) on the device that holds it: no more
    # than gpu_memory classes fit per device.
    top = min(int(one.gpu_memory or 1) * int(args.get("devices", 1)), MAX_COUNT)  # (classes' own limit)
    all_whole = _last_true(lambda c: whole(c, every=True), top)
    some_whole = _last_true(lambda c: whole(c, every=False), top)
    best = 0
    for first, last in ((1, all_whole), (all_whole + 1, some_whole), (some_whole + 1, top)):
        if first <= last and fits(first):
            best = max(best, _last_true(fits, last, first))
    return best


def _last_true(pred: Any, top: int, first: int = 1) -> int:
    """The largest c in [first, top] with pred(c), for a pred true up to some point and false
    after it (first - 1 if pred(first) is false): doubling from ``first``, then bisection."""
    if not pred(first):
        return first - 1
    good, bad = first, first + 1
    while bad <= top and pred(bad):
        good, bad = bad, first + 2 * (bad - first)
    bad = min(bad, top + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if pred(mid) else (good, mid)
    return good
