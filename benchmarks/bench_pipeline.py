"""Benchmark of shardkit.parallel.PipelineModel: a ResNet-50-sized backbone (bottleneck
blocks 3-4-6-3) split over 2 devices, one training step (forward + backward) for chunks in
{1, 2, 4, 8}, against the unsplit model on one device. chunks=1 is the write-up's naive
split (no micro-batches). For each case: the median step time, the peak memory per device
(CUDA only), and the forward's bubble, predicted (K - 1) / (M + K - 1) for equal stages
next to the one measured (1 - busy stage time / (K x forward wall time); the stages'
busy time is taken by hooks around each stage call).

    python benchmarks/bench_pipeline.py --devices cpu,cpu            # 2-core CPU: small images
    python benchmarks/bench_pipeline.py --devices cpu,cpu --stage-threads 1   # one intra-op thread
    python benchmarks/bench_pipeline.py --devices cuda:0,cuda:1      # two GPUs
    python benchmarks/bench_pipeline.py --devices cuda:0,cuda:0      # one GPU, two streams

On ONE GPU the two stages are two streams of the same device: that times the schedule and
its overhead (threads, events, copies), but both stages share the same SMs, so it cannot
show the speed-up of two devices working at once. Stages that share a device run one after
another (a seeded step then draws the same random numbers run to run), so on "cpu,cpu" the
forward's bubble is 1/2 by construction: the CPU run shows the schedule runs and what its
micro-batches cost, not an overlap.

Writes benchmarks/out/bench_pipeline_<devices>.json.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # _timing, whatever the cwd (also under python -m)
import _timing  # noqa: E402

_timing.prefer_in_place_build()  # before the first import of shardkit
from _timing import checked_devices, out_dir  # noqa: E402

from shardkit.parallel import PipelineModel  # noqa: E402
from shardkit.parallel.pipeline import bubble_fraction  # noqa: E402


class Bottleneck(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )  # fmt: skip
        self.skip = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x):
        return torch.relu(self.body(x) + self.skip(x))


def resnet50_layers(embedding_dim=512):
    """ResNet-50's layout as a flat list of layers (stem, 16 blocks, head): 25.6M-class size."""
    layers = [nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                            nn.MaxPool2d(3, 2, 1))]  # fmt: skip
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(Bottleneck(cin, width, stride if b == 0 else 1))
            cin = width * 4
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, embedding_dim)))
    return layers


def stage_timer(pipe):
    """Hooks summing the wall time of each stage call (forward only)."""
    busy = [0.0] * len(pipe.partitions)
    starts = {}

    def pre(k):
        def hook(_m, _inp):
            starts[(k, id(_inp[0]))] = time.perf_counter()

        return hook

    def post(k):
        def hook(_m, inp, _out):
            busy[k] += time.perf_counter() - starts.pop((k, id(inp[0])))

        return hook

    for k, part in enumerate(pipe.partitions):
        part.register_forward_pre_hook(pre(k))
        part.register_forward_hook(post(k))
    return busy


def sync(devices):
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def run_case(model, x, devices, reps):
    params = list(model.parameters())
    times = []
    for r in range(reps + 2):
        for p in params:
            p.grad = None
        sync(devices)
        start = time.perf_counter()
        model(x).float().pow(2).mean().backward()
        sync(devices)
        if r >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="cpu,cpu", help="two devices, comma-separated (default cpu,cpu)")
    ap.add_argument("--batch", type=int, default=None, help="batch (default 16 on CPU, 128 on CUDA)")
    ap.add_argument("--image", type=int, default=None, help="image side (default 64 on CPU, 224 on CUDA)")
    ap.add_argument("--reps", type=int, default=5, help="timed steps per case (median)")
    ap.add_argument(
        "--stage-threads",
        type=int,
        default=None,
        help="CPU: torch intra-op threads while the split cases run (stages on one device run one after "
        "another); the unsplit case keeps torch's default",
    )
    args = ap.parse_args()
    devices = checked_devices(ap, "--devices", args.devices.split(","))
    cuda = devices[0].type == "cuda"
    batch = args.batch or (128 if cuda else 16)
    image = args.image or (224 if cuda else 64)
    torch.manual_seed(0)
    x = torch.randn(batch, 3, image, image, device=devices[0])
    rows = []

    def peaks():
        return {str(d): torch.cuda.max_memory_allocated(d) / 2**20 for d in dict.fromkeys(devices) if d.type == "cuda"}

    def reset_peaks():
        for d in dict.fromkeys(devices):
            if d.type == "cuda":
                torch.cuda.reset_peak_memory_stats(d)

    unsplit = nn.Sequential(*resnet50_layers()).to(devices[0])
    reset_peaks()
    t = run_case(unsplit, x, devices, args.reps)
    rows.append(dict(case="unsplit, one device", chunks=None, step_s=t, peak_mib=peaks(), bubble_pred=None,
                     bubble_meas=None))  # fmt: skip
    default_threads = torch.get_num_threads()
    if args.stage_threads:
        torch.set_num_threads(args.stage_threads)
    sample = x[: max(2, batch // 8)]
    balance = PipelineModel.balance_by([m.to(devices[0]) for m in resnet50_layers()], sample, 2, by="time")
    for chunks in (1, 2, 4, 8):
        pipe = PipelineModel(resnet50_layers(), devices, chunks=chunks, balance=balance)
        busy = stage_timer(pipe)
        reset_peaks()
        t = run_case(pipe, x, devices, args.reps)
        for k in range(len(busy)):
            busy[k] = 0.0
        sync(devices)
        start = time.perf_counter()
        with torch.no_grad():
            pipe(x)
        sync(devices)
        wall = time.perf_counter() - start
        measured = 1.0 - sum(busy) / (len(busy) * wall)
        name = "naive split (no micro-batches)" if chunks == 1 else f"pipeline, {chunks} micro-batches"
        rows.append(dict(case=name, chunks=chunks, step_s=t, peak_mib=peaks(), bubble_pred=bubble_fraction(2, chunks),
                         bubble_meas=measured))  # fmt: skip
    base = rows[0]["step_s"]
    print(f"PipelineModel, ResNet-50 layout, batch {batch} x 3 x {image} x {image}, devices {args.devices}, "
          f"balance {balance} (by time), torch {torch.__version__}, intra-op threads: unsplit "
          f"{default_threads}, split {torch.get_num_threads()}")  # fmt: skip
    print(f"{'case':36} {'step ms':>9} {'vs unsplit':>10} {'bubble pred':>11} {'bubble meas':>11}  peak MiB per device")
    for r in rows:
        pred = "" if r["bubble_pred"] is None else f"{r['bubble_pred']:.2f}"
        meas = "" if r["bubble_meas"] is None else f"{r['bubble_meas']:.2f}"
        peak = ", ".join(f"{k}: {v:.0f}" for k, v in r["peak_mib"].items()) or "n/a (CPU)"
        print(f"{r['case']:36} {r['step_s'] * 1e3:9.1f} {r['step_s'] / base:9.2f}x {pred:>11} {meas:>11}  {peak}")
    path = os.path.join(out_dir(), f"bench_pipeline_{args.devices.replace(',', '_').replace(':', '')}.json")
    with open(path, "w") as f:
        json.dump(dict(devices=args.devices, batch=batch, image=image, balance=balance, torch=torch.__version__,
                       threads_unsplit=default_threads, threads_split=torch.get_num_threads(), rows=rows), f,
                  indent=1)  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
