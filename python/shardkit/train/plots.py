"""The run's curves, ``<--out>/curves.png``: loss, train top-1 and held-out verification
(raw and EMA, measured every --eval-every steps), TAR@FAR, and throughput and peak memory."""

from __future__ import annotations

from typing import Any, Dict, Sequence

import torch

from shardkit.train.errors import cannot_write


def plot(history: Dict[str, Any], devices: Sequence[torch.device], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
    (loss_ax, acc_ax), (tar_ax, speed_ax) = ax
    loss_ax.plot(history["step"], history["loss"], lw=1)
    loss_ax.set(xlabel="optimizer step", ylabel="training loss (log scale)", yscale="log", title="loss")

    tops = [(s, 100 * t) for s, t in zip(history["step"], history["top1"]) if t is not None]
    if tops:
        acc_ax.plot(*zip(*tops), lw=0.8, alpha=0.5, color="C0", label="train top-1 (each batch)")
    ev = history.get("eval", {})
    colors = {"raw": "C1", "ema": "C2"}
    for name in ("raw", "ema"):
        if ev.get(f"{name}_acc"):
            acc = [100 * a for a in ev[f"{name}_acc"]]
            tar = [100 * t for t in ev[f"{name}_tar"]]
            acc_ax.plot(ev["step"], acc, "o-", ms=3, color=colors[name], label=f"verification accuracy ({name})")
            tar_ax.plot(ev["step"], tar, "o-", ms=3, color=colors[name], label=f"TAR@FAR=1e-3 ({name})")
    acc_ax.set(xlabel="optimizer step", ylabel="%", ylim=(0, 100), title="accuracy")
    acc_ax.legend(loc="lower right", fontsize=8)
    tar_ax.set(xlabel="optimizer step", ylabel="%", ylim=(0, 100), title="held-out verification: TAR at FAR 1e-3")
    if ev.get("raw_tar"):
        tar_ax.legend(loc="lower right", fontsize=8)

    if history.get("img_s"):
        speed_ax.plot(history["step"][-len(history["img_s"]) :], history["img_s"], lw=0.8, color="C0")
    speed_ax.set(xlabel="optimizer step", ylabel="images / s", title="throughput and peak memory")
    mem = history.get("mem_gib")
    if mem:
        mem_ax = speed_ax.twinx()
        steps = history["step"][-len(mem) :]
        for k, dev in enumerate(devices):
            # (a resume may run on more devices than the steps before it: those have no figure)
            mem_k = [m[k] if k < len(m) else float("nan") for m in mem]
            mem_ax.plot(steps, mem_k, "--", lw=1, color=f"C{3 + k}", label=f"peak memory {dev}")
        mem_ax.set_ylabel("GiB (cpu: process peak RSS)")
        mem_ax.set_ylim(0, 1.15 * max(max(m) for m in mem))
        mem_ax.legend(loc="lower right", fontsize=8)
    fig.suptitle("python -m shardkit.train")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:  # a full disk, a read-only place
        raise cannot_write(path, e) from None
    finally:
        plt.close(fig)
