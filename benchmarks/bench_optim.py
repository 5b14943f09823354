"""SparseRowSGD's step on a backbone's dense gradients against torch.optim.SGD's.

arcface_torch's script (and the guide that moves it to shardkit) gives the backbone and the head
to one optimizer, so :class:`shardkit.SparseRowSGD` steps the backbone's dense gradients too. It
runs them as torch.optim.SGD runs them by default: multi-tensor kernels per (device, dtype) on
a GPU, one tensor at a time on the CPU. Timed here, alternating repetitions, on the parameters
of the trainer's iresnet50 (238 tensors, 43.6M parameters), momentum 0.9 and weight decay 5e-4:

    python benchmarks/bench_optim.py --device cpu
    python benchmarks/bench_optim.py --device cuda

Prints the median ms per step (and the spread) of SparseRowSGD, torch.optim.SGD(foreach=True)
and torch.optim.SGD(foreach=False).
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

_timing.prefer_in_place_build()
import shardkit  # noqa: E402
from shardkit.train.models import build_backbone  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=10, help="timed steps per optimizer (default 10)")
    args = parser.parse_args()
    (device,) = _timing.checked_devices(parser, "--device", [args.device])
    shapes = [p.shape for p in build_backbone("iresnet50", 512).parameters()]
    kw = dict(lr=0.1, momentum=0.9, weight_decay=5e-4)
    makers = {
        "SparseRowSGD": lambda ps: shardkit.SparseRowSGD(ps, **kw),
        "SGD foreach": lambda ps: torch.optim.SGD(ps, foreach=True, **kw),
        "SGD for-loop": lambda ps: torch.optim.SGD(ps, foreach=False, **kw),
    }
    opts = {}
    for name, make in makers.items():
        ps = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
        for p in ps:
            p.grad = torch.randn_like(p)
        opts[name] = make(ps)
        for _ in range(2):
            opts[name].step()
    times = {name: [] for name in opts}
    for _ in range(args.reps):  # alternating: one step of each in turn
        for name, opt in opts.items():
            times[name].append(_timing.time_once(opt.step, device) * 1e3)
    n = sum(s.numel() for s in map(torch.Size, shapes))
    print(f"{len(shapes)} tensors, {n / 1e6:.1f}M parameters, {device}, torch {torch.__version__}")
    for name, t in times.items():
        print(f"{name:14s} median {statistics.median(t):8.2f} ms/step  (min {min(t):.2f}, max {max(t):.2f})")


if __name__ == "__main__":
    main()
