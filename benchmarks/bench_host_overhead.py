"""Host time of one sharded-loss training step: how long the host takes to issue a forward +
backward, beside how long the step takes to finish, for the bare op and for the module.

    python benchmarks/bench_host_overhead.py                          # CPU, tiny shapes
    python benchmarks/bench_host_overhead.py --device cuda --shape 1024 100000 512 --shape 256 100000 512

Per step: synchronize, then ``step()`` (forward + ``loss.backward()``) timed on the host's
clock until it returns (the time to issue the step: Python, dispatch, autograd, kernel
launches), then a synchronize, timed until the step's last kernel ends. Where the issue time is
close to the whole time the step is host-bound: the GPU waits for its kernels, and only a
shorter host path (or a CUDA graph) makes it faster. The methods:

- ``op``: ``shardkit.ops.ce_shard_stats`` and ``(lse - target).mean()``: the least a step issues;
- ``module``: ``ShardedSoftmaxLoss(check_inputs=False)``, what a training script calls;
- ``module+checks``: the module with its default ``check_inputs=True`` (one device-to-host
  sync per call, which also waits for the work queued before it).

On CUDA the kernels of one step are also counted (torch profiler, CUDA activity). Medians over
``--steps`` steps after warm-up; tiny shapes (the default on the CPU) leave only the host's part.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # _timing, whatever the cwd (also under python -m)
import _timing  # noqa: E402

_timing.prefer_in_place_build()  # before the first import of shardkit
import shardkit  # noqa: E402
from shardkit.softmax.margins import ArcFace  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
METHODS = ("op", "module", "module+checks")


def make_step(method, batch, classes, dim, dtype, device, margin):
    """(fwd+bwd closure of ``method`` on fresh data, its [x, weight]); gradients set to None
    each step."""
    x = torch.randn(batch, dim, device=device, dtype=dtype, requires_grad=True)
    y = torch.randint(0, classes, (batch,), device=device)
    head = shardkit.ShardedSoftmaxLoss(
        dim, classes, devices=[device], dtype=dtype, margin=margin, check_inputs=method == "module+checks"
    )
    w = head.weight_shards[0]
    if method == "op":
        scale, m1, m2, m3 = margin.params() if margin is not None else (1.0, 1.0, 0.0, 0.0)

        def forward():
            lse, target, _, _ = shardkit.ops.ce_shard_stats(
                x, w, y, scale=scale, m1=m1, m2=m2, m3=m3, normalize=margin is not None
            )
            return (lse - target).mean()

    else:

        def forward():
            return head(x, y)

    def step():
        x.grad = None
        w.grad = None
        forward().backward()

    return step, [x, w]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, device, steps, warmup):
    """(median issue seconds, median whole seconds) over ``steps`` synchronized steps."""
    for _ in range(warmup):
        step()
    issue, whole = [], []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        _sync(device)
        t2 = time.perf_counter()
        issue.append(t1 - t0)
        whole.append(t2 - t0)
    return statistics.median(issue), statistics.median(whole)


def step_kernels(step, device):
    """{kernel name: (launches, device microseconds)} of one step on ``device`` (CUDA only;
    None elsewhere): the kernels a method adds to another's step, and what they cost."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        _sync(device)
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n, us = kernels.get(e.name, (0, 0.0))
            kernels[e.name] = (n + 1, us + e.time_range.elapsed_us())
    return kernels


def added_kernels(rows):
    """The kernels of the module's step beyond the op's (CUDA rows of one shape), as text."""
    by = {r["method"]: r["kernel_names"] for r in rows}
    op, module = by.get("op"), by.get("module")
    if not op or not module:
        return ""
    extra = []
    for name, (n, us) in sorted(module.items(), key=lambda kv: -kv[1][1]):
        n_op, us_op = op.get(name, (0, 0.0))
        if n > n_op:
            extra.append(f"{name[:60]} x{n - n_op} ({us - us_op:+.1f})")
    return "; ".join(extra) or "none"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--shape",
        nargs=3,
        type=int,
        action="append",
        metavar=("B", "C", "D"),
        help="batch, classes, embedding dim (repeatable; default 8 64 64)",
    )
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--margin", choices=["none", "arcface"], default="none")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", default=None, help="also write the rows here (default: out/host_overhead.json)")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_host_overhead.py: --device cuda needs a CUDA GPU; none is visible")
    dtype = DTYPES[a.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    margin = ArcFace(s=64.0, m=0.5) if a.margin == "arcface" else None
    shapes = a.shape or [[8, 64, 64]]
    torch.manual_seed(0)
    print(f"device {device}, dtype {dtype}, margin {a.margin}, torch {torch.__version__}, {_timing.cpu_description()}")
    print(f"{'shape':>22} {'method':>14} {'issue us':>10} {'whole us':>10} {'issue/whole':>12} {'kernels':>8}")
    rows = []
    for batch, classes, dim in shapes:
        for method in a.methods:
            step, _ = make_step(method, batch, classes, dim, dtype, device, margin)
            issue, whole = time_steps(step, device, a.steps, a.warmup)
            names = step_kernels(step, device)
            kernels = None if names is None else sum(n for n, _ in names.values())
            rows.append(
                {
                    "batch": batch,
                    "classes": classes,
                    "dim": dim,
                    "method": method,
                    "issue_us": issue * 1e6,
                    "whole_us": whole * 1e6,
                    "kernels": kernels,
                    "kernel_names": names,
                }
            )
            shape = f"B={batch} C={classes} D={dim}"
            print(
                f"{shape:>22} {method:>14} {issue * 1e6:10.1f} {whole * 1e6:10.1f} {issue / whole:12.2f} "
                f"{'-' if kernels is None else kernels:>8}",
                flush=True,
            )
        extra = added_kernels(rows[-len(a.methods) :])
        if extra:
            print("  kernels the module adds to the op's step (launches, device us): " + extra, flush=True)
    path = a.json or os.path.join(_timing.out_dir(), "host_overhead.json")
    with open(path, "w") as f:
        json.dump(
            {"device": str(device), "dtype": str(dtype), "margin": a.margin, "torch": torch.__version__, "rows": rows},
            f,
            indent=1,
        )
    return rows


if __name__ == "__main__":
    main()
