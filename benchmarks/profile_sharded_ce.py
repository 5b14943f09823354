"""Per-kernel device time of one ShardedSoftmaxLoss step (forward + backward) on a GPU.

    python benchmarks/profile_sharded_ce.py                      # B=1024, C=1M, D=512, bf16
    python benchmarks/profile_sharded_ce.py --batch 256 --margin arcface

Runs a few warm-up steps, then ``--steps`` steps under the torch profiler (CUDA activity
only), and prints the kernels by total device time, the time per step, and the share of the
step spent outside cuBLAS's GEMMs (the baseline the fused kernels are measured against).
"""

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # _timing, whatever the cwd (also under python -m)
import _timing  # noqa: E402

_timing.prefer_in_place_build()  # before the first import of shardkit
import shardkit  # noqa: E402
from shardkit.softmax.margins import ArcFace  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# cuBLAS's GEMM kernels on Hopper are named nvjet_* (cuBLASLt), sm90_xmma_* or *gemm*; the fused
# kernels (CUTLASS GEMMs with shardkit's epilogue, SHARDKIT_FUSED) are sce_forward_gemm_<tile> and
# sce_backward_gemm_<tile> (sharded_ce_fused_launch.cuh).
GEMM_MARKERS = ("nvjet", "gemm", "xmma", "splitkreduce")
FUSED_MARKER = "_gemm_128x"  # in both names


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--classes", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--margin", choices=["none", "arcface"], default="none")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=25, help="kernels listed")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_sharded_ce.py needs a CUDA GPU")
    dev, dt = torch.device("cuda"), DTYPES[a.dtype]
    margin = ArcFace(s=64.0, m=0.5) if a.margin == "arcface" else None
    head = shardkit.ShardedSoftmaxLoss(a.dim, a.classes, devices=[dev], dtype=dt, margin=margin)
    x = torch.randn(a.batch, a.dim, device=dev, dtype=dt, requires_grad=True)
    y = torch.randint(0, a.classes, (a.batch,), device=dev)

    def step():
        head.zero_grad(set_to_none=True)
        x.grad = None
        head(x, y).backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    print(
        f"ShardedSoftmaxLoss fwd+bwd, B={a.batch} C={a.classes} D={a.dim} {a.dtype} margin={a.margin}, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {a.steps} profiled steps"
    )
    switches = {k: v for k, v in sorted(os.environ.items()) if k.startswith("SHARDKIT_")}
    print("environment: " + (" ".join(f"{k}={v}" for k, v in switches.items()) or "no SHARDKIT_* variables"))
    print(events.table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=70))

    def device_us(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    total = sum(device_us(e) for e in events)
    fused = sum(device_us(e) for e in events if FUSED_MARKER in e.key)
    gemm = sum(
        device_us(e) for e in events if FUSED_MARKER not in e.key and any(k in e.key.lower() for k in GEMM_MARKERS)
    )
    per = 1e3 * a.steps
    print(
        f"device time per step: {total / per:.2f} ms; cuBLAS GEMMs {gemm / per:.2f} ms; "
        f"fused GEMM + epilogue kernels {fused / per:.2f} ms"
    )
    rest = total - gemm - fused
    print(f"outside the GEMMs (fused or not): {rest / per:.2f} ms = {100 * rest / total:.0f}% of the step")


if __name__ == "__main__":
    main()
