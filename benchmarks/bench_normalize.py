"""Benchmark: shardkit.ops.normalize_images vs the usual eager chains, uint8 NHWC -> float NCHW.

Peers (same run, same inputs):
  chain     x.permute(0, 3, 1, 2).float().div(255).sub(mean).div(std)   (torchvision-style;
            four passes, output strided like channels_last)
  chain+ct  the same followed by .contiguous() (what a contiguous NCHW result costs eagerly)
  affine    x.permute(0, 3, 1, 2).float().mul(scale).add(shift)          (two passes)

Floor: the op's bytes (1 read + out_bytes written per element) over the measured copy
bandwidth (a same-size float copy). Medians over repeats; CUDA timing with events after a
warm-up, over --burst calls back to back (5 by default on CUDA: a single call's host cost,
~20-30 us, would otherwise be timed too). Table on stdout; JSON + PNG in benchmarks/out/.

    python benchmarks/bench_normalize.py --device cpu
    python benchmarks/bench_normalize.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # _timing, whatever the cwd (also under python -m)
import _timing  # noqa: E402

_timing.prefer_in_place_build()  # before the first import of shardkit
from _timing import burst_of, copy_bandwidth, out_dir, time_median  # noqa: E402

from shardkit.ops import normalize_images  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SHAPES = [(256, 32, 32, 3), (128, 112, 112, 3), (64, 224, 224, 3)]
# On a GPU the shapes above fit (or nearly fit) in L2 (50 MB on an H100), so the floor they
# measure is a cache's; the larger batch's 154 MB fp32 output is well past it.
GPU_SHAPES = SHAPES + [(256, 224, 224, 3)]
# 3 warm-up calls, then (CUDA) a device sync so the first timed call starts on an idle GPU
TIMING = dict(warmup=3, sync_after_warmup=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument(
        "--burst",
        type=int,
        default=0,
        help="calls timed back to back between two events, the figure per call (default: 1 on CPU, 5 on CUDA, "
        "where one call's host time would otherwise be timed as well)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out", default=None, help="output folder (default: $SHARDKIT_BENCH_OUT or benchmarks/out)")
    args = ap.parse_args(argv)
    args.out = args.out or out_dir()
    device = torch.device(args.device)
    if args.burst < 0:
        ap.error("--burst takes a count >= 0 (0: the default)")
    burst = args.burst or (1 if device.type == "cpu" else 5)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is visible")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    mean_t = torch.tensor(MEAN, device=device, dtype=dtype).view(1, 3, 1, 1)
    std_t = torch.tensor(STD, device=device, dtype=dtype).view(1, 3, 1, 1)
    scale = (1 / (255 * std_t.double())).to(dtype)
    shift = (-mean_t.double() / std_t.double()).to(dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"normalize_images benchmark: {name}, torch {torch.__version__}, out dtype {args.dtype}")
    peers = {
        "shardkit": lambda x: normalize_images(x, MEAN, STD, dtype=dtype),
        "chain": lambda x: x.permute(0, 3, 1, 2).to(dtype).div(255).sub(mean_t).div(std_t),
        "chain+ct": lambda x: x.permute(0, 3, 1, 2).to(dtype).div(255).sub(mean_t).div(std_t).contiguous(),
        "affine": lambda x: x.permute(0, 3, 1, 2).to(dtype).mul(scale).add(shift),
    }
    rows = []
    header = f"{'shape (NHWC)':>20} {'floor ms':>9} " + " ".join(f"{k + ' ms':>12}" for k in peers)
    header += f" {'vs chain':>9} {'vs chain+ct':>11} {'% floor':>8}"
    print(header)
    for shape in GPU_SHAPES if device.type == "cuda" else SHAPES:
        x = torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
        out_elem = torch.empty((), dtype=dtype).element_size()
        n = x.numel()
        # bytes/s of a same-size float copy (read + write), timed like the peers below
        bandwidth = copy_bandwidth(n * 4, device, args.repeats, burst=burst, **TIMING)
        floor = n * (1 + out_elem) / bandwidth
        ref = peers["chain"](x).double()
        got = peers["shardkit"](x).double()
        rel = float((got - ref).norm() / ref.norm())
        times = {
            k: time_median(burst_of(lambda f=f: f(x), burst), device, args.repeats, **TIMING) / burst
            for k, f in peers.items()
        }
        row = dict(
            shape=list(shape),
            burst=burst,
            floor_s=floor,
            copy_bandwidth_GBps=bandwidth / 1e9,
            rel_err_vs_chain=rel,
            times_s=times,
            speedup_vs_chain=times["chain"] / times["shardkit"],
            speedup_vs_chain_contiguous=times["chain+ct"] / times["shardkit"],
            pct_of_floor=100 * floor / times["shardkit"],
        )
        rows.append(row)
        print(
            f"{str(tuple(shape)):>20} {floor * 1e3:9.3f} "
            + " ".join(f"{times[k] * 1e3:12.3f}" for k in peers)
            + f" {row['speedup_vs_chain']:8.2f}x {row['speedup_vs_chain_contiguous']:10.2f}x"
            + f" {row['pct_of_floor']:7.0f}%"
        )
    print(
        f"copy bandwidth (float copy, last shape): {rows[-1]['copy_bandwidth_GBps']:.1f} GB/s; "
        f"max rel. difference vs chain: {max(r['rel_err_vs_chain'] for r in rows):.1e}"
    )
    os.makedirs(args.out, exist_ok=True)
    tag = f"normalize_{device.type}_{args.dtype}"
    with open(os.path.join(args.out, tag + ".json"), "w") as f:
        json.dump(dict(device=name, torch=torch.__version__, dtype=args.dtype, rows=rows), f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        labels = ["x".join(map(str, r["shape"])) for r in rows]
        width = 0.18
        for i, k in enumerate(list(peers) + ["floor"]):
            vals = [r["floor_s"] * 1e3 if k == "floor" else r["times_s"][k] * 1e3 for r in rows]
            ax.bar([j + (i - 2) * width for j in range(len(rows))], vals, width, label=k)
        ax.set_xticks(range(len(rows)), labels)
        ax.set_yscale("log")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"uint8 NHWC -> {args.dtype} NCHW, {name}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, tag + ".png"), dpi=100)
        print(f"wrote {os.path.join(args.out, tag)}.json/.png")
    except ImportError:
        print(f"wrote {os.path.join(args.out, tag)}.json (matplotlib missing: no plot)")


if __name__ == "__main__":
    main()
