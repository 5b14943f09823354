"""Tuning benchmark of the per-shard kernels (``shardkit.ops.ce_shard_stats``) on one device.

Times forward and forward+backward of one shard holding all C classes, the loss
``lse - target_logit`` built from the statistics, against ``nn.Linear`` (no bias) +
``F.cross_entropy`` on the same data, for several chunk sizes. Prints a table (medians)
and the GEMM floor: the three GEMMs of the layer (logits, dX, dW) timed with torch.mm,
plus one more logits GEMM for the backward's recompute.

The default chunk size (what ``ce_shard_stats`` picks when ``chunk_classes`` is None, from
its working-set budget) is always measured, first, and ``--chunks`` adds sizes to compare
with it. The JSON is rewritten after each variant, so a run stopped part-way keeps the
variants that finished.

    python benchmarks/bench_sharded_ce_kernels.py --device cpu --batch 256 --dim 128 --classes 200000
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

import shardkit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing, whatever the cwd
from _timing import out_dir, time_median  # noqa: E402

# The environment of each kernel set (read by the op on every call).
KERNEL_ENV = {
    name: {
        "SHARDKIT_CE_V2": v2,
        "SHARDKIT_FUSED": fused,
        "SHARDKIT_FUSED_SCHEDULE": sched,
        "SHARDKIT_FUSED_STORES": st,
        "SHARDKIT_FUSED_EPILOGUE": epi,
        "SHARDKIT_FUSED_FORWARD_TILES": fwd,
        "SHARDKIT_FUSED_BACKWARD_TILES": bwd,
    }
    for name, v2, fused, sched, st, epi, fwd, bwd in [
        ("v1", "0", "0", "cooperative", "wide", "short", "same", "same"),
        ("v2", "1", "0", "cooperative", "wide", "short", "same", "same"),
        ("fused", "1", "1", "cooperative", "wide", "short", "same", "same"),
        ("fused-pp", "1", "1", "pingpong", "wide", "short", "same", "same"),
        ("fused-pairs", "1", "1", "cooperative", "pairs", "short", "same", "same"),
        ("fused-general", "1", "1", "cooperative", "wide", "general", "same", "same"),
        ("fused-square", "1", "1", "cooperative", "wide", "short", "square", "square"),
        ("fused-square-bwd", "1", "1", "cooperative", "wide", "short", "same", "square"),
    ]
}


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
        default="v2",
        help="CUDA kernel sets to time, comma-separated: v2 (the default kernels: the wider statistics/dlogit "
        "kernels, direct 16-bit dW, fp32 dX accumulation), v1 (SHARDKIT_CE_V2=0: the first kernels), fused "
        "(SHARDKIT_FUSED=1: the fused sm90 GEMM epilogues, cooperative schedule), fused-pp (the same with "
        "SHARDKIT_FUSED_SCHEDULE=pingpong), fused-pairs (cooperative, the backward's dlogits stored two "
        "columns at a time: SHARDKIT_FUSED_STORES=pairs), fused-general (cooperative, every tile in the "
        "forward epilogue's general form: SHARDKIT_FUSED_EPILOGUE=general), fused-square (both GEMMs "
        "ping-pong on [128, 128] tiles: SHARDKIT_FUSED_FORWARD_TILES=square, SHARDKIT_FUSED_BACKWARD_TILES=square), "
        "fused-square-bwd (the backward's alone); with several, the first one's loss and gradients are compared "
        "with each other's",
    )
    args = ap.parse_args()
    kernels = [k for k in args.kernels.split(",") if k]
    if not kernels or any(k not in KERNEL_ENV for k in kernels):
        ap.error(f"--kernels takes some of {', '.join(KERNEL_ENV)}, got {args.kernels!r}")

    dev = torch.device(args.device)
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
    rows.append(("nn.Linear + F.cross_entropy", None, t_bf, t_bfb))

    xd, wd = x.detach(), w.detach()
    gl = torch.randn(B, C, device=dev, dtype=dt)
    t_logits = _timeit(lambda: xd @ wd.t(), dev, args.reps)
    t_gemm3 = (
        t_logits
        + _timeit(lambda: gl @ wd, dev, args.reps)  # noqa: F821 (deleted after timing)
        + _timeit(lambda: gl.t() @ xd, dev, args.reps)  # noqa: F821
    )
    t_gemm = t_gemm3 + t_logits
    del gl

    # The op's own default first (always measured), then the sweep, without repeating it.
    default_chunk = shardkit.ops._sharded_ce._default_chunk(xd, wd)
    chunks = [None] + [c for c in dict.fromkeys(int(c) for c in args.chunks.split(",") if c) if c != default_chunk]
    print(
        f"device={dev} dtype={args.dtype} B={B} D={D} C={C} torch {torch.__version__} threads={torch.get_num_threads()}"
    )
    print(f"GEMM floor (4 GEMMs: logits x2, dX, dW): {t_gemm * 1e3:.2f} ms; the 3 GEMMs: {t_gemm3 * 1e3:.2f} ms")
    head = f"{'fwd ms':>10}{'fwd+bwd ms':>12}{'fwd ratio':>11}{'f+b ratio':>11}{'floor %':>9}{'x 3 GEMMs':>11}"
    print(f"{'variant':<40}{head}")

    def report(name, tf, tfb):
        print(
            f"{name:<40}{tf * 1e3:>10.2f}{tfb * 1e3:>12.2f}{tf / t_bf:>11.2f}{tfb / t_bfb:>11.2f}"
            f"{100 * t_gemm / tfb:>9.0f}{tfb / t_gemm3:>11.2f}",
            flush=True,
        )

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
                    "rows": [{"name": n, "chunk": c, "fwd_s": a, "fwd_bwd_s": b} for n, c, a, b in rows],
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
        rows.append((name, ch or default_chunk, _timeit(ours_fwd, dev, args.reps), _timeit(ours_fb, dev, args.reps)))
        report(*(rows[-1][i] for i in (0, 2, 3)))
        save()
    for key in KERNEL_ENV["v1"]:
        os.environ.pop(key, None)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
