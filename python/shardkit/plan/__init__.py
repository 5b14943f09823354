"""The memory planner of a large softmax head: :func:`plan_memory` (the figures),
:func:`plan_budgets` (the loss's ``memory_budget``: kept logits, time factor, largest C),
:func:`balance_shards` (shard sizes that even out memory over devices that hold other things
too), and ``python -m shardkit.plan`` (:mod:`shardkit.plan.cli`)."""

from shardkit.plan.budgets import BudgetPlan, kept_logits, largest_classes, plan_budgets
from shardkit.plan.cli import format_budgets, format_plan, main
from shardkit.plan.memory import DeviceMemory, MemoryPlan, format_size, parse_size, plan_memory
from shardkit.plan.shards import balance_shards, head_bytes_per_class

__all__ = [
    "DeviceMemory",
    "MemoryPlan",
    "parse_size",
    "format_size",
    "plan_memory",
    "format_plan",
    "format_budgets",
    "BudgetPlan",
    "plan_budgets",
    "largest_classes",
    "kept_logits",
    "main",
    "balance_shards",
    "head_bytes_per_class",
]
