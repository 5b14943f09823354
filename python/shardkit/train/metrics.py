"""Face-verification metrics from embeddings alone (no logits, no classifier).

A pair is declared "same identity" when its cosine similarity is **greater than** a
threshold. All metrics run in float64 on the CPU (a few thousand pairs: negligible cost).

* :func:`best_threshold_accuracy`: the best accuracy over every possible threshold (an
  optimistic figure: threshold chosen on the data it is scored on).
* :func:`kfold_accuracy`: the LFW protocol: split the pairs in ``folds`` parts, choose the
  threshold on ``folds - 1`` parts, score the held-out part, average. This is the accuracy
  to report.
* :func:`tar_at_far`: true-accept rate at a false-accept rate. With ``n`` impostor pairs the
  achievable FAR values are multiples of ``1/n``: the threshold is the highest impostor score
  at which at most ``floor(far * n)`` impostors are accepted. When ``far * n < 1`` no
  impostor may be accepted (threshold = the largest impostor score) and the figure measures
  FAR = 0 on this data, not FAR = ``far``; ``VerificationResult.far_reliable`` says whether
  there were at least ``10 / far`` impostors (about 10 accepted impostors at the operating
  point, a figure with roughly +-30% relative noise on the FAR).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import torch

__all__ = [
    "cosine_scores",
    "impostor_pairs",
    "best_threshold_accuracy",
    "kfold_accuracy",
    "tar_at_far",
    "VerificationResult",
    "evaluate_verification",
]


def _check_pairs(scores: torch.Tensor, is_same: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    if scores.dim() != 1 or is_same.shape != scores.shape:
        raise ValueError(
            f"`scores` and `is_same` must be 1-D of the same length, got {tuple(scores.shape)} "
            f"and {tuple(is_same.shape)}"
        )
    if scores.numel() == 0:
        raise ValueError("need at least one pair")
    return scores.detach().to("cpu", torch.float64), is_same.detach().to("cpu").bool()


def cosine_scores(emb1: torch.Tensor, emb2: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each pair: ``emb1, emb2 [P, D]`` (any float dtype/device) -> ``[P]`` float64 CPU."""
    if emb1.dim() != 2 or emb1.shape != emb2.shape:
        raise ValueError(f"`emb1` and `emb2` must both be [P, D], got {tuple(emb1.shape)} and {tuple(emb2.shape)}")
    a = torch.nn.functional.normalize(emb1.detach().to("cpu", torch.float64), dim=1)
    b = torch.nn.functional.normalize(emb2.detach().to("cpu", torch.float64), dim=1)
    return (a * b).sum(dim=1)


def _accuracy_at_candidates(scores: torch.Tensor, is_same: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Accuracy of the rule ``score > t`` for every t in ``candidates`` (vectorized)."""
    gen = torch.sort(scores[is_same]).values
    imp = torch.sort(scores[~is_same]).values
    gen_accepted = gen.numel() - torch.searchsorted(gen, candidates, right=True)
    imp_rejected = torch.searchsorted(imp, candidates, right=True)
    return (gen_accepted + imp_rejected).double() / scores.numel()


def _candidates(scores: torch.Tensor) -> torch.Tensor:
    # Every distinct score, plus -inf (accept everything): covers every distinct decision.
    return torch.cat([scores.new_tensor([-math.inf]), torch.unique(scores)])


def best_threshold_accuracy(scores: torch.Tensor, is_same: torch.Tensor) -> Tuple[float, float]:
    """Best accuracy of ``score > threshold`` over all thresholds, and that threshold.

    Args: scores ``[P]`` float, is_same ``[P]`` bool. Returns ``(accuracy, threshold)``:
    among equally good decisions the one accepting the most pairs, its threshold placed
    midway between the last rejected and the first accepted score.
    """
    scores, is_same = _check_pairs(scores, is_same)
    cand = _candidates(scores)
    acc = _accuracy_at_candidates(scores, is_same, cand)
    i = int(torch.argmax(acc))
    # Midway to the next distinct score: same accuracy here, more margin on unseen pairs.
    thr = cand[i] if i + 1 == cand.numel() else (cand[i] + cand[i + 1]) / 2
    return float(acc[i]), float(thr)


def kfold_accuracy(scores: torch.Tensor, is_same: torch.Tensor, folds: int = 10, seed: int = 0) -> Tuple[float, float]:
    """LFW-style accuracy: mean and std over ``folds`` held-out folds (threshold from the rest).

    Pairs are assigned to folds by a permutation drawn from ``seed`` (deterministic). Needs
    ``folds >= 2`` and at least ``folds`` pairs.
    """
    scores, is_same = _check_pairs(scores, is_same)
    if folds < 2 or scores.numel() < folds:
        raise ValueError(f"`folds` must be >= 2 and at most the number of pairs ({scores.numel()}), got {folds}")
    perm = torch.randperm(scores.numel(), generator=torch.Generator().manual_seed(seed))
    parts = torch.tensor_split(perm, folds)
    accs = []
    for k in range(folds):
        test = parts[k]
        train = torch.cat([parts[j] for j in range(folds) if j != k])
        _, thr = best_threshold_accuracy(scores[train], is_same[train])
        accs.append(float(((scores[test] > thr) == is_same[test]).double().mean()))
    t = torch.tensor(accs, dtype=torch.float64)
    return float(t.mean()), float(t.std(unbiased=False))


def tar_at_far(scores: torch.Tensor, is_same: torch.Tensor, far: float = 1e-3) -> Tuple[float, float, float]:
    """True-accept rate at a false-accept rate: ``(tar, threshold, achieved_far)``.

    The threshold is the ``floor(far * n_impostor)``-th highest impostor score (0-based), so
    at most that many impostors score above it: ``achieved_far <= far`` always. Needs at
    least one genuine and one impostor pair.
    """
    scores, is_same = _check_pairs(scores, is_same)
    if not 0.0 < far < 1.0:
        raise ValueError(f"`far` must be in (0, 1), got {far}")
    gen, imp = scores[is_same], scores[~is_same]
    if gen.numel() == 0 or imp.numel() == 0:
        raise ValueError(f"need genuine and impostor pairs, got {gen.numel()} and {imp.numel()}")
    k = int(math.floor(far * imp.numel()))
    thr = torch.sort(imp, descending=True).values[k]
    return float((gen > thr).double().mean()), float(thr), float((imp > thr).double().mean())


@dataclass
class VerificationResult:
    """Everything :func:`evaluate_verification` measures (floats in [0, 1] unless noted)."""

    accuracy: float  # k-fold held-out accuracy (report this)
    accuracy_std: float
    best_accuracy: float  # best threshold on all pairs (optimistic)
    best_threshold: float  # cosine
    tar: float
    far: float  # requested FAR
    far_threshold: float  # cosine
    far_achieved: float
    far_resolution: float  # 1 / number of impostor pairs
    far_reliable: bool  # at least 10 / far impostor pairs
    num_genuine: int
    num_impostor: int
    num_balanced: int = 0  # genuine pairs (and as many impostors) the accuracy is on; 0: all genuine

    def summary(self) -> str:
        note = (
            ""
            if self.far_reliable
            else f" (only {self.num_impostor} impostor pairs: FAR resolution {self.far_resolution:.1e})"
        )
        return (
            f"verification accuracy {100 * self.accuracy:.2f}% +- {100 * self.accuracy_std:.2f} "
            f"({self.num_genuine} genuine / {self.num_impostor} impostor pairs), "
            f"TAR@FAR={self.far:g}: {100 * self.tar:.2f}%{note}"
        )


def evaluate_verification(
    emb1: torch.Tensor, emb2: torch.Tensor, is_same: torch.Tensor, *, far: float = 1e-3, folds: int = 10, seed: int = 0
) -> VerificationResult:
    """All verification metrics from pair embeddings ``emb1, emb2 [P, D]`` and ``is_same [P]`` bool."""
    scores = cosine_scores(emb1, emb2)
    scores, same = _check_pairs(scores, is_same)
    acc, std = kfold_accuracy(scores, same, folds=min(folds, scores.numel()), seed=seed)
    best, thr = best_threshold_accuracy(scores, same)
    tar, fthr, fach = tar_at_far(scores, same, far)
    n_imp = int((~same).sum())
    return VerificationResult(
        acc, std, best, thr, tar, far, fthr, fach, 1.0 / n_imp, n_imp >= 10.0 / far, int(same.sum()), n_imp
    )


def impostor_pairs(ids: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """``[K, 2]`` int64 indices of distinct unordered pairs (``i < j``) of images of different
    classes (``ids [M]``), in random order: ``count`` of them drawn without replacement, or
    every such pair when there are fewer (pairs drawn twice would count twice in TAR@FAR and
    overstate its resolution)."""
    m = len(ids)
    sizes = torch.unique(ids, return_counts=True)[1].tolist() if m else []
    total = m * (m - 1) // 2 - sum(n * (n - 1) // 2 for n in sizes)
    if total <= count:  # all of them, shuffled
        parts = [
            torch.stack([torch.full_like(js, i), js], 1)
            for i in range(m)
            for js in [(ids[i + 1 :] != ids[i]).nonzero().flatten() + i + 1]
            if len(js)
        ]
        every = torch.cat(parts) if parts else torch.empty(0, 2, dtype=torch.int64)
        return every[torch.randperm(len(every), generator=generator)]
    keys: dict = {}  # insertion-ordered: the order drawn
    while len(keys) < count:
        i = torch.randint(0, m, (2 * count,), generator=generator)
        j = torch.randint(0, m, (2 * count,), generator=generator)
        lo, hi = torch.minimum(i, j), torch.maximum(i, j)
        ok = ids[lo] != ids[hi]
        for key in (lo[ok] * m + hi[ok]).tolist():
            keys.setdefault(key, None)
    drawn = torch.tensor(list(keys)[:count], dtype=torch.int64)
    return torch.stack([drawn // m, drawn % m], 1)
