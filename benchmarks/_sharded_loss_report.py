"""The targets (issues 3 and 10) and the saved JSON/PNG of benchmarks/bench_sharded_loss.py.

The benchmark calls these as it goes: :func:`check_shape_targets` and :func:`save` after each
shape, :func:`check_largest_target` once both largest-C searches it compares have run."""

import json
import os
import sys

import torch
from _timing import out_dir, target_line

PEERS = (
    "linear+cross_entropy",
    "torch.linear_cross_entropy",
    "cce_filtered",
    "cce_exact",
    "cce_torch_compile",
    "liger_flce",
)
CPU_PEERS = ("linear+cross_entropy", "torch.linear_cross_entropy", "cce_torch_compile")


def check_targets(rows, largest, device, dtype_name):
    """Every target of a whole run (the shapes' and the largest-C one), one TARGET line each."""
    return check_shape_targets(rows, device, dtype_name) + check_largest_target(largest)


def check_shape_targets(rows, device, dtype_name):
    """The per-shape targets of ``rows``, one TARGET line each. GPU (bf16): shardkit fwd+bwd
    <= 1.5x the three GEMMs (issue 3) and, at B=1024, <= 2.0x (issue 10), <= 256 MiB beyond
    weights and gradients at B=1024 C=1M, faster than every peer that ran. CPU (fp32, issue
    16): <= 1.0x the time of every CPU peer that ran, extra memory <= 8 MiB, >= 80% of the
    speed of the three plain matmuls."""
    out = []
    by_shape = {}
    for r in rows:
        by_shape.setdefault((r["batch"], r["classes"], r["dim"]), {})[r["method"]] = r
    for (b, c, d), res in by_shape.items():
        ours, tag = res.get("shardkit"), f"B={b} C={c} D={d} {dtype_name}"
        if ours is None:
            out.append(target_line(f"sharded loss {tag}", None, "shardkit did not run"))
            continue
        if device.type == "cuda":
            x = ours["time_s"] / ours["gemm_floor_s"]
            out.append(target_line(f"sharded loss {tag} <= 1.5x the 3 GEMMs (issue 3)", x <= 1.5, f"{x:.2f}x"))
            if b == 1024:
                out.append(target_line(f"sharded loss {tag} <= 2.0x the 3 GEMMs (issue 10)", x <= 2.0, f"{x:.2f}x"))
            if (b, c) == (1024, 1_000_000):
                out.append(
                    target_line(
                        f"sharded loss {tag} <= 256 MiB beyond weights+grads",
                        ours["extra_mib"] <= 256,
                        f"{ours['extra_mib']:.1f} MiB",
                    )
                )
            for peer in PEERS:
                if peer in res:
                    x = res[peer]["time_s"] / ours["time_s"]
                    out.append(target_line(f"sharded loss {tag} faster than {peer}", x > 1.0, f"{x:.2f}x"))
                else:
                    out.append(target_line(f"sharded loss {tag} faster than {peer}", None, "peer did not run"))
        else:
            for peer in CPU_PEERS:
                if peer in res:
                    x = ours["time_s"] / res[peer]["time_s"]
                    out.append(target_line(f"sharded loss {tag} <= 1.0x the time of {peer}", x <= 1.0, f"{x:.2f}x"))
                else:
                    out.append(target_line(f"sharded loss {tag} <= 1.0x the time of {peer}", None, "peer did not run"))
            out.append(
                target_line(
                    f"sharded loss {tag} extra memory <= 8 MiB", ours["extra_mib"] <= 8, f"{ours['extra_mib']:.1f} MiB"
                )
            )
            share = ours["gemm_floor_s"] / ours["time_s"]
            out.append(
                target_line(f"sharded loss {tag} >= 80% of the 3 GEMMs' speed", share >= 0.8, f"{100 * share:.0f}%")
            )
    return out


def check_largest_target(largest):
    """The largest-C target (shardkit vs (a)) once both searches have run, else nothing."""
    out = []
    if largest.get("shardkit") and largest.get("linear+cross_entropy"):
        la, lo = largest["linear+cross_entropy"], largest["shardkit"]
        a, o = la["largest"], lo["largest"]
        # A search cut short by its budget gives a lower bound: a verdict only where it holds.
        ok = True if o > a and la["complete"] else (False if lo["complete"] and la["complete"] else None)
        out.append(
            target_line(
                "largest C one GPU trains, shardkit vs (a)",
                ok,
                f"{o:,d}{'' if lo['complete'] else '+'} vs {a:,d}{'' if la['complete'] else '+'} "
                f"({o / max(a, 1):.1f}x)",
            )
        )
    return out


def save(rows, largest, targets, args, notes=None, complete=True):
    """(Re)writes the JSON (and the PNG, when there are rows): ``complete`` False while the
    run is still going. The JSON is written to a temporary name and renamed, so a run killed
    mid-write leaves the previous version whole."""
    folder = out_dir()
    stem = "bench_sharded_loss" + ("_maxc" if args.max_classes_only else "")
    stem += "_master" if getattr(args, "master_weights", False) else ""
    path = os.path.join(folder, stem + ".json")
    with open(path + ".tmp", "w") as f:
        json.dump(
            dict(
                torch=torch.__version__,
                argv=sys.argv,
                complete=complete,
                method_notes=notes or {},
                rows=rows,
                largest_classes=largest,
                targets=targets,
            ),
            f,
            indent=1,
        )
    os.replace(path + ".tmp", path)
    if not rows:
        print(f"wrote {path}", flush=True)
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {path} (no matplotlib: no plot)")
        return
    labels = [f"{r['method']}\nB={r['batch']} C={r['classes'] // 1000}k" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(rows)), 4.5))
    axes[0].bar(labels, [r["time_s"] * 1e3 for r in rows])
    axes[0].set_ylabel("fwd+bwd time (ms, median)")
    axes[1].bar(labels, [r["extra_mib"] for r in rows])
    axes[1].set_ylabel("extra memory of one step (MiB)")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    fig.suptitle(f"sharded cross-entropy, {rows[0]['device'] if rows else ''}, {args.dtype}")
    fig.tight_layout()
    fig.savefig(os.path.join(folder, stem + ".png"), dpi=110)
    plt.close(fig)
    print(f"wrote {path} and {stem}.png", flush=True)
