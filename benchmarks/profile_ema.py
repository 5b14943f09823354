"""Device time against wall time of one EMA update on a GPU: shardkit.ModelEMA (the device
table, and with SHARDKIT_EMA_V1=1 the first, chunked launcher) and a bare
``torch._foreach_lerp_`` on tensor lists built once, on the same model.

    python benchmarks/profile_ema.py                 # ResNet-50 shapes, fp32 model and EMA
    python benchmarks/profile_ema.py --model 350m

Runs ``--updates`` updates of each under the torch profiler (CUDA activity) and prints, per
update: the summed duration of the GPU kernels, the wall time of the updates issued back to
back (host cost and device time overlap there: the larger of the two wins), and the wall time
of the host side alone (``torch.cuda.synchronize`` only at the end). An update whose wall time
exceeds its kernels' time is bound by its host cost.
"""

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ema import BareForeachEMA, OursEMA, OursFirstLauncherEMA, build_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["resnet50", "100m", "350m"], default="resnet50")
    ap.add_argument("--updates", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_ema.py needs a CUDA GPU")
    if a.updates < 1:
        ap.error("--updates must be >= 1")
    dev = torch.device("cuda")
    model, source = build_model(a.model, torch.float32, dev)
    print(f"{source}, fp32 model and EMA, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    methods = {
        "shardkit": OursEMA(model, torch.float32),
        "shardkit_v1": OursFirstLauncherEMA(model, torch.float32),
        "foreach_bare": BareForeachEMA(model, torch.float32),
    }
    print(f"{'method':<14}{'kernels us':>11}{'launches':>9}{'wall us':>9}{'host us':>9}")
    for name, impl in methods.items():
        for _ in range(3):
            impl.update(model)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.updates):
                impl.update(model)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        device_us = sum(e.device_time for e in kernels) / a.updates
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.updates):
            impl.update(model)
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        print(
            f"{name:<14}{device_us:>11.1f}{len(kernels) / a.updates:>9.1f}"
            f"{wall / a.updates * 1e6:>9.1f}{host / a.updates * 1e6:>9.1f}"
        )


if __name__ == "__main__":
    main()
