"""arcface_torch_run.py's two analyses of its runs: the search for the largest class count
that fits the GPU, and the comparison of the heads' loss curves. Pure Python over the runs'
result dicts (tested without a GPU)."""

from __future__ import annotations

import math

# A probe runs until the optimizer has stepped twice (its state then exists and a gradient is
# alive beside it; fp16's GradScaler may skip the first steps), 40 training steps at most.
SEARCH_STEPS, SEARCH_WARMUP, SEARCH_OPTIMIZER_STEPS, SEARCH_MAX_STEPS = 2, 1, 2, 40


def _nice(classes: float) -> int:
    """A class count rounded to 3 significant digits (probes read better, nothing is lost)."""
    classes = max(1, int(classes))
    digits = max(0, len(str(classes)) - 3)
    return max(1, int(round(classes, -digits)))


def search_max_classes(base: dict, run, args) -> dict:
    """The largest class count of ``base``'s setting (head, sample rate, batch, seed) that runs.

    ``run(setting) -> result`` runs one (status "ok" or "oom"; anything else stops the search).
    Starts at ``args.classes[0]`` (halved while it does not fit) and twice that; the peak
    memory of those two, a straight line in the class count (the head's weights, gradients,
    optimizer state and logits all grow linearly), predicts where the device is full; then
    probes around the prediction and bisects (geometric midpoints) until the smallest
    failing count is within ``args.resolution`` of the largest fitting one, or
    ``args.max_probes`` more runs were made. Returns the bracket, the prediction and every
    probe."""
    probes = []

    def probe(classes):
        setting = dict(base, classes=classes, steps=SEARCH_STEPS, warmup=SEARCH_WARMUP)
        res = run(dict(setting, min_optimizer_steps=SEARCH_OPTIMIZER_STEPS, max_calls=SEARCH_MAX_STEPS + 1))
        probes.append(
            dict(
                classes=classes,
                status=res.get("status"),
                peak_allocated=res.get("peak_allocated"),
                peak_reserved=res.get("peak_reserved"),
                device_total=res.get("device_total"),
                error=None if res.get("status") in ("ok", "oom") else res.get("error"),
            )
        )
        return probes[-1]

    out = dict(base, largest_fit=None, smallest_oom=None, predicted=None, probes=probes)
    start = args.classes[0]
    first = probe(start)
    while first["status"] == "oom" and start > 1 and len(probes) < args.max_probes:
        out["smallest_oom"] = start
        start = _nice(start / 2)
        first = probe(start)
    if first["status"] != "ok":
        return out
    lo, hi = start, out["smallest_oom"]
    second = probe(_nice(2 * start)) if hi is None or hi > 2 * start else None
    if second is not None:
        if second["status"] == "ok":
            lo = second["classes"]
            out["predicted"] = predict(first, second)
        elif second["status"] == "oom":
            hi = second["classes"]
        else:
            out.update(largest_fit=lo, smallest_oom=hi)
            return out
    tried = {p["classes"] for p in probes}
    budget = args.max_probes
    while budget > 0 and not (hi is not None and hi <= lo * (1 + args.resolution)):
        pred = out["predicted"]
        if hi is None:
            cand = _nice(pred) if pred and pred > lo * (1 + args.resolution) else _nice(2 * lo)
        elif pred and lo * (1 + args.resolution) < pred < hi / (1 + args.resolution) and _nice(pred) not in tried:
            cand = _nice(pred)
        else:
            cand = _nice(math.sqrt(lo * hi))
        if cand in tried or cand <= lo or (hi is not None and cand >= hi):
            break  # the bracket is as fine as 3-digit counts go
        tried.add(cand)
        budget -= 1
        res = probe(cand)
        if res["status"] == "ok":
            lo = cand
        elif res["status"] == "oom":
            hi = cand
        else:
            break
    out.update(largest_fit=lo, smallest_oom=hi)
    return out


def predict(a: dict, b: dict):
    """Class count at which the line through two runs' (classes, peak reserved) reaches the
    device's memory; None when the peaks do not grow with the class count."""
    ya, yb = a.get("peak_reserved"), b.get("peak_reserved")
    total = b.get("device_total") or a.get("device_total")
    if None in (ya, yb, total) or b["classes"] == a["classes"]:
        return None
    slope = (yb - ya) / (b["classes"] - a["classes"])
    if slope <= 0:
        return None
    return b["classes"] + (total - yb) / slope


def loss_curve_summary(results: list) -> list:
    """Per setting (classes, sample rate, batch) run by the pfc head and a shardkit head:
    the first-step losses side by side per seed, and with two or more seeds per head the
    mean curves' gap against the seed-to-seed spread. A step agrees when
    ``|mean_pfc - mean_shardkit| <= max(spread_pfc, spread_shardkit)`` (spread: max - min
    over that head's seeds)."""
    groups = {}
    for r in results:
        if r.get("status") != "ok" or not r.get("losses"):
            continue
        key = (r["classes"], r["sample_rate"], r["batch"])
        groups.setdefault(key, {}).setdefault(r["head"], {})[r["seed"]] = r["losses"]
    out = []
    for (classes, rate, batch), heads in sorted(groups.items()):
        if "pfc" not in heads:
            continue
        for other in (h for h in heads if h != "pfc"):
            a, b = heads["pfc"], heads[other]
            entry = dict(classes=classes, sample_rate=rate, batch=batch, heads=["pfc", other])
            common = sorted(set(a) & set(b))
            entry["first_loss"] = {
                seed: dict(pfc=a[seed][0], other=b[seed][0], rel_diff=abs(a[seed][0] - b[seed][0]) / abs(a[seed][0]))
                for seed in common
                if a[seed][0] != 0
            }
            if len(a) >= 2 and len(b) >= 2:
                n = min(len(c) for c in list(a.values()) + list(b.values()))
                agree, gaps = 0, []
                for step in range(n):
                    va, vb = [c[step] for c in a.values()], [c[step] for c in b.values()]
                    gap = abs(sum(va) / len(va) - sum(vb) / len(vb))
                    spread = max(max(va) - min(va), max(vb) - min(vb))
                    agree += gap <= spread
                    gaps.append(gap)
                entry.update(steps=n, steps_within_spread=agree, fraction_within_spread=agree / n, max_gap=max(gaps))
            out.append(entry)
    return out
