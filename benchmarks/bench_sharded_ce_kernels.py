"""Tuning benchmark of the per-shard kernels (``shardkit.ops.ce_shard_stats``) on one device.

Times forward and forward+backward of one shard holding all C classes, the loss
``lse - target_logit`` built from the statistics, against ``nn.Linear`` (no bias) +
``F.cross_entropy`` on the same data, for several chunk sizes. Prints a table (medians)
and the GEMM floor: the three GEMMs of the layer (logits, dX, dW) timed with torch.mm,
plus one more logits GEMM for the backward's recompute.

The default chunk size (what ``ce_shard_stats`` picks when ``chunk_classes`` is None, from
its working-set budget) is always measured, first, and ``--chunks`` adds sizes to compare
with it. Each variant's forward+backward is also timed alternately with the three cuBLAS GEMMs
of the layer (one GEMM, then one step, ``--reps`` times): the ratio of the pair's medians and
the spread of the per-pair ratios (min to max) do not depend on the clock or thermal state of
when the baseline ran. The JSON is rewritten after each variant, so a run stopped part-way
keeps the variants that finished.

    python benchmarks/bench_sharded_ce_kernels.py --device cpu --batch 256 --dim 128 --classes 200000
"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

import shardkit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing, whatever the cwd
from _timing import checked_devices, out_dir, time_median, time_once  # noqa: E402

# The environment of each kernel set (read by the op on every call).
KERNEL_ENV = {
    name: {
        "SHARDKIT_FUSED": fused,
        "SHARDKIT_FUSED_PDL": pdl,
        "SHARDKIT_FUSED_OVERLAP": overlap,
    }
    for name, fused, pdl, overlap in [
        ("unfused", "0", "0", "0"),
        ("fused", "1", "0", "0"),
        ("fused-pdl", "1", "1", "0"),
        ("fused-overlap", "1", "0", "1"),
        ("fused-pdl-overlap", "1", "1", "1"),
    ]
}


def interleaved(base, fn, device, reps):
    """(medians of base and fn, min and max of the per-pair ratios fn / base): ``reps`` pairs of
    one timed ``base()`` then one timed ``fn()`` (after a warm-up pair)."""
    base()
    fn()
    pairs = [(time_once(base, device, "device"), time_once(fn, device, "device")) for _ in range(reps)]
    ratios = [b / a for a, b in pairs]
    med = statistics.median
    return med(a for a, _ in pairs), med(b for _, b in pairs), min(ratios), max(ratios)


def _timeit(fn, device, reps):
    """Median seconds of fn() (2 warm-up calls; CUDA: events, device sync)."""
    return time_median(fn, device, reps, warmup=2, sync="device")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--classes", type=int, default=200_000)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--chunks", default="", help="more chunk sizes, comma-separated (the default always runs)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--normalize", action="store_true", help="cosine logits with an ArcFace margin (s=64, m=0.5)")
    ap.add_argument(
        "--out",
        default=None,
        help="JSON path (default: sharded_ce_kernels_<device>.json in $SHARDKIT_BENCH_OUT or benchmarks/out)",
    )
    ap.add_argument(
        "--kernels",
        default="fused",
        help="CUDA kernel sets to time, comma-separated: fused (the default: the fused sm90 GEMM epilogues, "
        "cooperative [128, 256] tiles, where they apply; the unfused kernels elsewhere), unfused "
        "(SHARDKIT_FUSED=0: cuBLAS logits, the wider statistics/dlogit kernels, direct 16-bit dW, fp32 dX "
        "accumulation), fused-pdl "
        "(programmatic dependent launches: SHARDKIT_FUSED_PDL=1), fused-overlap (the backward's dX / dW GEMMs on "
        "a second stream: SHARDKIT_FUSED_OVERLAP=1), fused-pdl-overlap (both); with several, the first one's "
        "loss and gradients are compared with each other's",
    )
    args = ap.parse_args()
    kernels = [k for k in args.kernels.split(",") if k]
    if not kernels or any(k not in KERNEL_ENV for k in kernels):
        ap.error(f"--kernels takes some of {', '.join(KERNEL_ENV)}, got {args.kernels!r}")

    (dev,) = checked_devices(ap, "--device", [args.device])
    args.out = args.out or os.path.join(out_dir(), f"sharded_ce_kernels_{dev.type}.json")
    dt = getattr(torch, args.dtype)
    B, D, C = args.batch, args.dim, args.classes
    x = torch.randn(B, D, device=dev, dtype=dt, requires_grad=True)
    lin = torch.nn.Linear(D, C, bias=False, device=dev, dtype=dt)
    w = lin.weight
    labels = torch.randint(0, C, (B,), device=dev)
    margin = dict(scale=64.0, m2=0.5, normalize=True) if args.normalize else {}

    def base_fwd():
        with torch.no_grad():
            return F.cross_entropy(lin(x).float(), labels)

    def base_fb():
        x.grad = None
        w.grad = None
        F.cross_entropy(lin(x).float(), labels).backward()

    rows = []
    t_bf = _timeit(base_fwd, dev, args.reps)
    t_bfb = _timeit(base_fb, dev, args.reps)
    rows.append(("nn.Linear + F.cross_entropy", None, t_bf, t_bfb, None))

    xd, wd = x.detach(), w.detach()
    gl = torch.randn(B, C, device=dev, dtype=dt)
    t_logits = _timeit(lambda: xd @ wd.t(), dev, args.reps)
    t_gemm3 = t_logits + _timeit(lambda: gl @ wd, dev, args.reps) + _timeit(lambda: gl.t() @ xd, dev, args.reps)
    t_gemm = t_gemm3 + t_logits

    # The op's own default first (always measured), then the sweep, without repeating it.
    default_chunk = shardkit.ops._kept.default_chunk(xd, wd)
    chunks = [None] + [c for c in dict.fromkeys(int(c) for c in args.chunks.split(",") if c) if c != default_chunk]
    print(
        f"device={dev} dtype={args.dtype} B={B} D={D} C={C} torch {torch.__version__} threads={torch.get_num_threads()}"
    )
    print(f"GEMM floor (4 GEMMs: logits x2, dX, dW): {t_gemm * 1e3:.2f} ms; the 3 GEMMs: {t_gemm3 * 1e3:.2f} ms")
    head = f"{'fwd ms':>10}{'fwd+bwd ms':>12}{'fwd ratio':>11}{'f+b ratio':>11}{'floor %':>9}{'x 3 GEMMs':>11}"
    print(f"{'variant':<40}{head}{'x 3 GEMMs interleaved [min, max]':>36}")

    def report(name, tf, tfb, inter=None):
        alt = f"{inter['ratio']:>10.2f} [{inter['ratio_min']:.2f}, {inter['ratio_max']:.2f}]" if inter else ""
        print(
            f"{name:<40}{tf * 1e3:>10.2f}{tfb * 1e3:>12.2f}{tf / t_bf:>11.2f}{tfb / t_bfb:>11.2f}"
            f"{100 * t_gemm / tfb:>9.0f}{tfb / t_gemm3:>11.2f}{alt:>36}",
            flush=True,
        )

    def three_gemms():  # the layer's GEMMs (gl: [B, C] dlogits in x's dtype, kept for this)
        xd @ wd.t()
        gl @ wd
        gl.t() @ xd

    def save():
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "torch": torch.__version__,
                    "default_chunk": default_chunk,
                    "gemm_floor_s": t_gemm,
                    "three_gemms_s": t_gemm3,
                    "rows": [
                        {"name": n, "chunk": c, "fwd_s": a, "fwd_bwd_s": b, "interleaved": i} for n, c, a, b, i in rows
                    ],
                },
                f,
                indent=1,
            )

    report(*(rows[0][i] for i in (0, 2, 3)))
    if len(kernels) > 1:  # the two kernel sets on the same data: loss and gradients
        got = {}
        for kv in kernels:
            os.environ.update(KERNEL_ENV[kv])
            x.grad = None
            w.grad = None
            lse, t, _, _ = shardkit.ops.ce_shard_stats(x, w, labels, **margin)
            loss = (lse - t).mean()
            loss.backward()
            got[kv] = [loss.detach().double(), x.grad.double(), w.grad.double()]
        for other in kernels[1:]:
            for name, a, b in zip(("loss", "dX", "dW"), got[kernels[0]], got[other]):
                rel = float((a - b).norm() / b.norm().clamp_min(1e-30))
                print(f"{kernels[0]} vs {other} {name}: relative difference {rel:.2e}", flush=True)
        del got
    for ch, kv in [(c, k) for c in chunks for k in kernels]:
        os.environ.update(KERNEL_ENV[kv])

        def ours_fwd(ch=ch):
            with torch.no_grad():
                lse, t, _, _ = shardkit.ops.ce_shard_stats(xd, wd, labels, chunk_classes=ch, **margin)
                return (lse - t).mean()

        def ours_fb(ch=ch):
            x.grad = None
            w.grad = None
            lse, t, _, _ = shardkit.ops.ce_shard_stats(x, w, labels, chunk_classes=ch, **margin)
            (lse - t).mean().backward()

        name = f"ce_shard_stats chunk={ch}" if ch else f"ce_shard_stats chunk={default_chunk} (default)"
        name += f" {kv}" if len(kernels) > 1 else ""
        tf, tfb = _timeit(ours_fwd, dev, args.reps), _timeit(ours_fb, dev, args.reps)
        base, ours, lo, hi = interleaved(three_gemms, ours_fb, dev, args.reps)
        inter = {"three_gemms_s": base, "fwd_bwd_s": ours, "ratio": ours / base, "ratio_min": lo, "ratio_max": hi}
        rows.append((name, ch or default_chunk, tf, tfb, inter))
        report(name, tf, tfb, inter)
        save()
    for key in KERNEL_ENV["fused"]:
        os.environ.pop(key, None)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
