"""The planner's memory-budget figures (shardkit.plan.budgets): the kept bytes are the op's,
the time factor and the extra memory move monotonically with the budget, and the largest class
count is the largest that fits."""

import re

import pytest
import torch

from shardkit.ops import kept_bytes, kept_chunks_for_budget
from shardkit.plan import kept_logits, largest_classes, main, plan_budgets, plan_memory
from shardkit.plan.budgets import FULL, _fits

GiB = 1 << 30


@pytest.mark.parametrize("B,C,chunk", [(7, 95, 20), (1024, 125_000, 19_648), (3, 1, 64), (64, 1000, 1000)])
def test_kept_logits_are_the_ops(B, C, chunk):
    whole = kept_bytes(B, C, chunk, 1 << 60)
    for budget in (0, 1, B * 4, kept_bytes(B, C, chunk, 1), whole // 2, whole - 1, whole, 10 * whole):
        keep = kept_chunks_for_budget(B, C, chunk, budget)
        classes, nbytes = kept_logits(B, C, chunk, budget)
        assert nbytes == kept_bytes(B, C, chunk, keep) <= budget
        assert classes == (0 if keep == 0 else (C if nbytes == whole else keep * min(chunk, C)))
    assert kept_logits(B, C, chunk, FULL) == (C, whole)


def test_budget_rows_are_monotone_and_within_budget():
    args = dict(classes=1_000_003, dim=512, devices=3, batch=128, dtype="bf16", gpu_memory="80GiB", reserve="8GiB")
    budgets = [0, 1 << 20, 256 << 20, GiB, 4 * GiB, FULL]
    rows = plan_budgets(budgets, **args)
    assert rows[0].time_factor == pytest.approx(4 / 3) and rows[0].extra == 0 and rows[0].kept_classes == 0
    assert rows[-1].time_factor == pytest.approx(1.0)
    plan = plan_memory(**args)
    assert rows[-1].kept_classes == max(d.classes for d in plan.devices)
    assert rows[-1].extra == plan.global_batch * (rows[-1].kept_classes + 1) * 4
    for a, b in zip(rows, rows[1:]):
        assert b.time_factor <= a.time_factor and b.extra >= a.extra
        assert b.largest_classes <= a.largest_classes  # memory kept is memory the head cannot use
    for r in rows[:-1]:
        assert r.extra <= r.budget
    assert 1.0 < rows[2].time_factor < 4 / 3  # 256 MiB keeps part of a 333k-class shard


@pytest.mark.parametrize("budget", [0, GiB, FULL])
def test_largest_classes_is_the_largest_that_fits(budget):
    args = dict(dim=256, devices=2, batch=64, dtype="fp32", gpu_memory="6GiB", reserve="1GiB")
    best = largest_classes(budget, **args)
    assert best > 0

    def total(classes):
        plan = plan_memory(classes=classes, **args)
        shard = max(d.classes for d in plan.devices)
        return max(d.total for d in plan.devices) + kept_logits(plan.global_batch, shard, plan.chunk_classes, budget)[1]

    assert total(best) + (1 << 30) <= 6 << 30 < total(best + 1) + (1 << 30)


@pytest.mark.parametrize(
    "budget, args",
    [
        (65536, dict(dim=8, devices=1, batch=4, dtype="bf16", optimizer="sgd-momentum", sample_rate=0.3)),
        (200000, dict(dim=16, devices=3, batch=4, dtype="fp32", optimizer="sgd-momentum")),
        (20000, dict(dim=32, devices=2, batch=16, dtype="bf16", optimizer="sgd")),
    ],
)
def test_largest_classes_past_the_point_where_the_whole_shard_stops_being_kept(budget, args):
    # Past that point a device keeps whole chunks, fewer bytes than just before it, so larger
    # counts fit again: the search used to stop short (12,771 classes fit, 11,301 reported).
    args = dict(args, gpu_memory=3 << 19)
    best = largest_classes(budget, **args)
    fitting = [c for c in range(1, 2 * best + 2) if _fits(plan_memory(classes=c, **args), budget)]
    assert best == max(fitting)


def test_cli_prints_the_budget_table(capsys):
    argv = ["--classes", "200000", "--dim", "128", "--batch", "256", "--gpu-memory", "16GiB"]
    assert main([*argv, "--memory-budget", "0", "64MiB", "full"]) == 0
    out = capsys.readouterr().out
    assert "memory_budget" in out and "0 (recompute)" in out and "64.0 MiB" in out and "full logits" in out
    assert "1.33x" in out and "1.00x" in out and "largest C in 16 GiB" in out
    with pytest.raises(SystemExit) as err:
        main([*argv, "--memory-budget", "lots"])
    assert err.value.code == 2
    assert "argument --memory-budget: cannot parse size" in capsys.readouterr().err


ARGS = dict(classes=1000, dim=64, devices=2, batch=8)


@pytest.mark.parametrize(
    "budgets, error, message",
    [
        ([-5], ValueError, "argument `budgets[0]` must be bytes (an int >= 0) or 'full', got -5"),
        ([0, 1.5], TypeError, "argument `budgets[1]` must be bytes (an int >= 0) or 'full', got float"),
        ([float("inf")], TypeError, "argument `budgets[0]` must be bytes"),
        ([float("nan")], TypeError, "argument `budgets[0]` must be bytes"),
        ([True], TypeError, "argument `budgets[0]` must be bytes (an int >= 0) or 'full', got bool"),
        ([None], TypeError, "got NoneType"),
        (["2GiB"], ValueError, "argument `budgets[0]` must be bytes (an int >= 0) or 'full', got '2GiB'"),
        (["auto"], ValueError, "a plan cannot know"),
        ("full", TypeError, "argument `budgets` must be a list of budgets"),
        (5, TypeError, "argument `budgets` must be a list of budgets"),
    ],
)
def test_plan_budgets_refuses_bad_budgets(budgets, error, message):
    # Before: -5, 1.5 and True were planned as budgets that keep nothing, inf raised an
    # OverflowError, "2GiB" / "auto" a bare int() parse error, a string was iterated.
    with pytest.raises(error, match=re.escape(message)):
        plan_budgets(budgets, **ARGS)


def test_budget_helpers_check_the_budget():
    with pytest.raises(ValueError, match=re.escape("argument `budget` must be bytes (an int >= 0) or 'full', got -1")):
        kept_logits(8, 100, 10, -1)
    with pytest.raises(TypeError, match=re.escape("argument `budget` must be bytes")):
        largest_classes(2.5, gpu_memory=GiB, **ARGS)
    assert plan_budgets(["FULL"], **ARGS)[0].budget == FULL  # the label in any case
    assert kept_logits(8, 100, 10, " Full ") == kept_logits(8, 100, 10, FULL)


@pytest.mark.parametrize("value, message", [("auto", "a plan cannot know"), ("lots", "or 'full'"), ("-1", "or 'full'")])
def test_cli_budget_errors_say_what_it_takes(capsys, value, message):
    with pytest.raises(SystemExit) as err:
        main(["--classes", "1000", "--dim", "64", "--batch", "8", "--memory-budget", value])
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_planner_and_module_agree_on_a_cpu_head():
    # The kept bytes the planner counts for a one-device head are what the module saves.
    import shardkit

    C, D, B = 3000, 16, 32
    head = shardkit.ShardedSoftmaxLoss(D, C, memory_budget=1 << 30)
    x, y = torch.randn(B, D, requires_grad=True), torch.randint(0, C, (B,))
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        head(x, y)
    held = sum(seen.values())
    seen.clear()
    head.memory_budget = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        head(x, y)
    assert held - sum(seen.values()) == kept_logits(B, C, 64, FULL)[1]


@pytest.mark.parametrize("gpu_memory", ["256TiB", "4000000TiB"])
def test_largest_classes_has_no_fixed_ceiling(gpu_memory):
    # The search stopped at 2**44 classes per device, reporting 2**44 where 3 x 2**44 fit.
    args = dict(dim=1, devices=2, batch=1, dtype="fp16", optimizer="sgd", master_weights=False, gpu_memory=gpu_memory)
    best = largest_classes(0, **args)
    assert best > 2 * 2**44
    assert _fits(plan_memory(classes=best, **args), 0) and not _fits(plan_memory(classes=best + 1, **args), 0)


def test_largest_classes_stops_at_the_class_count_limit():
    # gpu_memory x devices passed 2**63 - 1 classes: the search asked plan_memory for more and
    # failed with an error about `classes`, which the caller never gave.
    best = largest_classes(0, dim=1, devices=65536, batch=1, gpu_memory=2**51)
    assert 0 < best <= 2**63 - 1
