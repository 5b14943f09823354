"""The command line of the memory planner: ``python -m shardkit.plan`` (also ``shardkit-plan``);
the figures come from :func:`shardkit.plan.memory.plan_memory`."""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Optional, Sequence

from shardkit.plan.budgets import FULL, Budget, BudgetPlan, check_budget, plan_budgets
from shardkit.plan.memory import (
    DEFAULT_CHUNK_BUDGET,
    DTYPE_BYTES,
    OPTIMIZER_STATES,
    GiB,
    MemoryPlan,
    _short_size,
    format_size,
    parse_size,
    plan_memory,
)


def format_plan(p: MemoryPlan) -> str:
    """The plan as the table ``python -m shardkit.plan`` prints."""
    sk = p.shardkit_max
    lines = [
        f"shardkit memory plan: {p.classes:,} classes x {p.dim}-d head, {p.num_devices} device(s), "
        f"batch {p.batch} per device (global {p.global_batch})",
        f"dtype {p.dtype}"
        + (" + fp32 master weights" if p.master_weights else "")
        + f", optimizer {p.optimizer}, sample rate {p.sample_rate:g}"
        + (f", chunk {p.chunk_classes:,} classes" if p.chunk_classes else ""),
        "",
    ]
    cols = [("shardkit / device", sk), ("PartialFC_V2 / rank", p.partial_fc), ("naive, 1 device", p.naive)]
    rows = [
        ("classes held", [f"{d.classes:,}" for _, d in cols]),
        ("weights", [format_size(d.weights) for _, d in cols]),
        ("master weights (fp32)", [format_size(d.master_weights) for _, d in cols]),
        ("gradients", [format_size(d.gradients) for _, d in cols]),
        ("optimizer state", [format_size(d.optimizer_state) for _, d in cols]),
        ("loss working set", [format_size(d.loss_working_set) for _, d in cols]),
        ("total", [format_size(d.total) for _, d in cols]),
        ("total (GiB)", [f"{d.total / GiB:,.2f} GiB" for _, d in cols]),
    ]
    if p.gpu_memory is not None:
        label = f"fits in {_short_size(p.gpu_memory)}" + (f" - {_short_size(p.reserve)} reserve" if p.reserve else "")
        rows.append((label, ["yes" if d.fits else "NO" for _, d in cols]))
    w0 = max(len(r[0]) for r in rows) + 2
    widths = [max(len(name), *(len(r[1][i]) for r in rows)) + 2 for i, (name, _) in enumerate(cols)]
    lines.append(" " * w0 + "".join(name.rjust(w) for (name, _), w in zip(cols, widths)))
    for label, vals in rows:
        lines.append(label.ljust(w0) + "".join(v.rjust(w) for v, w in zip(vals, widths)))
    lines.append("")
    lines.append("loss working set, shardkit: " + ", ".join(f"{k} {format_size(v)}" for k, v in sk.loss_parts.items()))
    lines.append(
        "loss working set, naive: " + ", ".join(f"{k} {format_size(v)}" for k, v in p.naive.loss_parts.items())
    )
    lines.append("Not counted: backbone, activations, CUDA context, allocator slack (use --reserve).")
    return "\n".join(lines)


def format_budgets(rows: Sequence[BudgetPlan], gpu_memory: Optional[int]) -> str:
    """The memory-budget table ``python -m shardkit.plan`` prints after the plan."""
    head = ["memory_budget", "kept classes / device", "extra / device", "time x 3 GEMMs"]
    if gpu_memory is not None:
        head.append(f"largest C in {_short_size(gpu_memory)}")
    table = [head]
    for r in rows:
        if isinstance(r.budget, str):
            label = "full logits"  # FULL, the only string a budget row holds
        else:
            label = "0 (recompute)" if r.budget == 0 else format_size(r.budget)
        cells = [label, f"{r.kept_classes:,}", format_size(r.extra), f"{r.time_factor:.2f}x"]
        if gpu_memory is not None:
            cells.append(f"{r.largest_classes:,}")
        table.append(cells)
    widths = [max(len(row[i]) for row in table) + 2 for i in range(len(head))]
    lines = ["", "ShardedSoftmaxLoss(memory_budget=...): logits kept from forward to backward (fp32, per device)"]
    for row in table:
        lines.append(row[0].ljust(widths[0]) + "".join(c.rjust(w) for c, w in zip(row[1:], widths[1:])))
    lines.append(
        "time: the layer's GEMM passes over its three, (3 + recomputed share) / 3, a model (elementwise passes not "
        "counted); CUDA shards keep nothing yet (they recompute at every budget)."
    )
    return "\n".join(lines)


def _budget_arg(text: str) -> Budget:
    try:
        if text.strip().lower() in (FULL, "auto"):
            return check_budget(text, "--memory-budget")
        nbytes = parse_size(text)
    except ValueError as e:
        msg = str(e).replace("argument `--memory-budget` ", "").replace("bytes (an int >= 0)", "a size such as 1GiB")
        raise argparse.ArgumentTypeError(
            msg if "'full'" in msg else f"{msg}; or 'full' (the whole shard's logits)"
        ) from None
    _refuse_bare_number(text)  # ("0" is the recompute design: no unit needed)
    return nbytes


def _parses(text: str) -> bool:
    try:
        parse_size(text)
    except ValueError:
        return False
    return True


def _size_arg(text: str) -> int:
    try:
        nbytes = parse_size(text)
    except ValueError as e:  # "-0", "5e": not numbers, so no unit to suggest
        raise argparse.ArgumentTypeError(str(e)) from None
    _refuse_bare_number(text)
    return nbytes


def _refuse_bare_number(text: str) -> None:
    # A bare number other than 0 ("80", "0.5"): bytes, surely not what was meant.
    try:
        value = float(text) if re.fullmatch(r"\s*[0-9.eE+-]+\s*", text) else 0.0
    except ValueError:
        return
    if value == 0.0:
        return
    num = text.strip()
    forms = [f"{num}{unit}" for unit in ("GiB", "GB") if _parses(num + unit)]  # ("1e19GiB" is too large)
    in_bytes = f"{num}B" if value == int(value) else None  # (not 0.5B: bytes are whole)
    if forms:
        hint = f"write e.g. {', '.join(forms)}" + (f" or, for bytes, {in_bytes}" if in_bytes else "")
    else:
        hint = f"write {in_bytes} for bytes" if in_bytes else "give a unit, e.g. GiB"
    raise argparse.ArgumentTypeError(f"{text!r} has no unit: {hint}")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # the CLI contract: one line on stderr, exit status 2
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="python -m shardkit.plan",
        description="Memory per device of a large softmax head: shardkit vs PartialFC_V2 vs one naive device.",
    )
    ap.add_argument("--classes", type=int, required=True, help="number of classes C")
    ap.add_argument("--dim", type=int, required=True, help="embedding size D")
    ap.add_argument("--devices", type=int, default=1, help="devices the classes are sharded over (default 1)")
    ap.add_argument("--batch", type=int, required=True, help="images per device per step")
    ap.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="fp32", help="head weight dtype (default fp32)")
    ap.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZER_STATES),
        default="sgd-momentum",
        help="optimizer of the head: its state per weight (default sgd-momentum)",
    )
    ap.add_argument(
        "--sample-rate", type=float, default=1.0, help="PartialFC sampling rate in (0, 1] (default 1: no sampling)"
    )
    ap.add_argument(
        "--gpu-memory",
        type=_size_arg,
        default=None,
        help="memory per device, e.g. 80GiB, 80GB, 81920MiB (default: none, no fit check)",
    )
    ap.add_argument(
        "--reserve",
        type=_size_arg,
        default=0,
        help="memory per device kept for the rest (backbone, context; default 0)",
    )
    ap.add_argument(
        "--chunk-budget",
        type=_size_arg,
        default=DEFAULT_CHUNK_BUDGET,
        help="ShardedSoftmaxLoss chunk budget (default 192MiB)",
    )
    ap.add_argument(
        "--memory-budget",
        type=_budget_arg,
        nargs="+",
        default=[0, GiB, 4 * GiB, FULL],
        metavar="SIZE",
        help="ShardedSoftmaxLoss memory_budget values to compare, sizes or 'full' (default: 0 1GiB 4GiB full)",
    )
    ap.add_argument("--no-master-weights", action="store_true", help="fp16/bf16 without fp32 master weights")
    ap.add_argument(
        "--dense-grad",
        action="store_true",
        help="model a dense weight-sized gradient in the sampled mode (shardkit's is row-sparse)",
    )
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point (``shardkit-plan``). Returns 0; a user error exits with status 2 and one
    line on stderr, an internal error with its traceback (status 1)."""
    ap = _parser()
    args = ap.parse_args(argv)
    plan_args = dict(
        classes=args.classes,
        dim=args.dim,
        devices=args.devices,
        batch=args.batch,
        dtype=args.dtype,
        optimizer=args.optimizer,
        sample_rate=args.sample_rate,
        gpu_memory=args.gpu_memory,
        master_weights=False if args.no_master_weights else None,
        sparse_grad=not args.dense_grad,
        chunk_budget=args.chunk_budget,
        reserve=args.reserve,
    )
    try:
        plan = plan_memory(**plan_args)
        budgets = plan_budgets(args.memory_budget, **plan_args)
    except ValueError as e:
        # plan_memory names its Python arguments (`sample_rate`); say the flag instead.
        msg = re.sub(r"argument `(\w+)`", lambda m: "--" + m.group(1).replace("_", "-"), str(e))
        ap.error(msg)  # one line, exit status 2
    try:
        print(format_plan(plan), flush=True)
        print(format_budgets(budgets, plan.gpu_memory), flush=True)
    except BrokenPipeError:  # `python -m shardkit.plan ... | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0
