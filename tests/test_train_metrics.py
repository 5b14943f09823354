"""shardkit.train.metrics against brute-force float64 computations."""

import math

import pytest
import torch

from shardkit.train.metrics import (
    best_threshold_accuracy,
    cosine_scores,
    evaluate_verification,
    kfold_accuracy,
    tar_at_far,
)


def random_pairs(n, rounded=False):
    is_same = torch.rand(n) < 0.5
    is_same[0], is_same[1] = True, False  # both kinds present
    scores = torch.randn(n, dtype=torch.float64) * 0.3 + is_same.double() * 0.6
    if rounded:  # many ties
        scores = (scores * 4).round() / 4
    return scores, is_same


def brute_accuracy(scores, is_same, t):
    return sum(1 for s, y in zip(scores.tolist(), is_same.tolist()) if (s > t) == y) / len(scores)


def brute_best(scores, is_same):
    cands = [-math.inf] + sorted(set(scores.tolist()))
    best = max(brute_accuracy(scores, is_same, t) for t in cands)
    return best


@pytest.mark.parametrize("n,rounded", [(2, False), (7, False), (200, False), (300, True)])
def test_best_threshold_accuracy(n, rounded):
    scores, is_same = random_pairs(n, rounded)
    acc, thr = best_threshold_accuracy(scores, is_same)
    assert acc == pytest.approx(brute_best(scores, is_same), abs=1e-12)
    assert brute_accuracy(scores, is_same, thr) == pytest.approx(acc, abs=1e-12)


def test_kfold_accuracy_matches_manual_folds():
    scores, is_same = random_pairs(157)
    mean, std = kfold_accuracy(scores, is_same, folds=10, seed=3)
    perm = torch.randperm(157, generator=torch.Generator().manual_seed(3))
    parts = torch.tensor_split(perm, 10)
    accs = []
    for k in range(10):
        train = torch.cat([parts[j] for j in range(10) if j != k])
        cands = [-math.inf] + sorted(set(scores[train].tolist()))
        train_acc = [brute_accuracy(scores[train], is_same[train], t) for t in cands]
        i = max(range(len(cands)), key=lambda i: (train_acc[i], -i))  # first best
        t = (cands[i] + cands[i + 1]) / 2 if i + 1 < len(cands) else cands[i]
        accs.append(brute_accuracy(scores[parts[k]], is_same[parts[k]], t))
    ref = torch.tensor(accs, dtype=torch.float64)
    assert mean == pytest.approx(float(ref.mean()), abs=1e-12)
    assert std == pytest.approx(float(ref.std(unbiased=False)), abs=1e-12)


@pytest.mark.parametrize("far", [1e-3, 0.01, 0.1, 0.37])
@pytest.mark.parametrize("rounded", [False, True])
def test_tar_at_far_brute_force(far, rounded):
    scores, is_same = random_pairs(3000, rounded)
    tar, thr, achieved = tar_at_far(scores, is_same, far)
    imp = scores[~is_same].tolist()
    gen = scores[is_same].tolist()
    # Brute force: the lowest impostor score t with #{imp > t} <= floor(far * n_imp).
    allowed = math.floor(far * len(imp))
    feasible = [t for t in imp if sum(1 for s in imp if s > t) <= allowed]
    t_ref = min(feasible)
    assert thr == t_ref
    assert achieved == pytest.approx(sum(1 for s in imp if s > t_ref) / len(imp), abs=1e-12)
    assert achieved <= far
    assert tar == pytest.approx(sum(1 for s in gen if s > t_ref) / len(gen), abs=1e-12)


def test_tar_with_few_impostors_is_far_zero():
    # 50 impostors: FAR 1e-3 is below the resolution 1/50: nothing may be accepted.
    scores, is_same = random_pairs(100)
    tar, thr, achieved = tar_at_far(scores, is_same, 1e-3)
    assert achieved == 0.0 and thr == float(scores[~is_same].max())
    emb = torch.randn(100, 8)
    res = evaluate_verification(emb, emb + 0.1 * torch.randn(100, 8), is_same)
    assert res.far_reliable is False and res.far_resolution == pytest.approx(1 / int((~is_same).sum()))
    assert "FAR resolution" in res.summary()


def test_cosine_and_evaluate():
    e1, e2 = torch.randn(64, 5), torch.randn(64, 5)
    s = cosine_scores(e1.float(), e2.float())
    ref = torch.tensor(
        [float(a.double() @ b.double() / (a.double().norm() * b.double().norm())) for a, b in zip(e1, e2)]
    )
    assert torch.allclose(s, ref.double(), atol=1e-12)
    # Genuine pairs = near copies, impostors = independent: accuracy near 1.
    is_same = torch.arange(64) % 2 == 0
    e2 = torch.where(is_same[:, None], e1 + 0.05 * torch.randn(64, 5), e2)
    res = evaluate_verification(e1, e2, is_same, far=0.1, folds=8)
    assert res.accuracy > 0.9 and res.num_genuine == 32 and res.num_impostor == 32
    assert 0.0 <= res.tar <= 1.0 and res.far_achieved <= 0.1


def test_errors():
    with pytest.raises(ValueError, match=r"must be 1-D of the same length"):
        best_threshold_accuracy(torch.zeros(3), torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"`far` must be in \(0, 1\)"):
        tar_at_far(torch.rand(4), torch.tensor([True, False, True, False]), far=0.0)
    with pytest.raises(ValueError, match=r"need genuine and impostor pairs, got 4 and 0"):
        tar_at_far(torch.rand(4), torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"`folds` must be >= 2"):
        kfold_accuracy(torch.rand(4), torch.tensor([True, False, True, False]), folds=5)
    with pytest.raises(ValueError, match=r"must both be \[P, D\]"):
        cosine_scores(torch.rand(3, 2), torch.rand(3, 3))


def test_evaluation_batches_are_not_tiny():
    # The evaluation forwards hold no gradients: a tiny training batch (--accumulate 4
    # --batch 2) evaluates 32 images at a time (8x the batch below that), a batch of 32 or
    # more as it is.
    from shardkit.train.report import eval_batch

    assert [eval_batch(b) for b in (1, 2, 3, 4, 5, 31, 32, 33, 128, 1000)] == [8, 16, 24, 32, 32, 32, 32, 33, 128, 1000]


@pytest.mark.parametrize("classes, per_class, count", [(10, 4, 10000), (20, 3, 10000), (50, 8, 5000), (3, 1, 10)])
def test_impostor_pairs_are_distinct_pairs_of_different_classes(classes, per_class, count):
    # They used to be drawn with replacement: 10 x 4 held-out images (720 impostor pairs) gave
    # "10000 impostor pairs" and a FAR resolution of 1e-4 it did not have.
    from shardkit.train.data import verification_split
    from shardkit.train.metrics import impostor_pairs

    ids = torch.arange(classes).repeat_interleave(per_class)[torch.randperm(classes * per_class)]
    total = math.comb(len(ids), 2) - classes * math.comb(per_class, 2)
    pairs = impostor_pairs(ids, count, torch.Generator().manual_seed(3))
    assert len(pairs) == min(count, total)
    assert bool((pairs[:, 0] < pairs[:, 1]).all()) and bool((ids[pairs[:, 0]] != ids[pairs[:, 1]]).all())
    assert len({tuple(p) for p in pairs.tolist()}) == len(pairs)
    assert torch.equal(pairs, impostor_pairs(ids, count, torch.Generator().manual_seed(3)))  # seeded
    if per_class >= 2:
        res = verification_split(classes, per_class, 8, seed=1, train_classes=5).evaluate(
            torch.randn(classes * per_class, 6, dtype=torch.float64), far=1e-3
        )
        assert res.num_impostor == min(10000, total) and res.far_reliable == (min(10000, total) >= 1e4)


@pytest.mark.parametrize("per_class, classes", [(20, 3), (12, 2), (4, 6)])
def test_verification_accuracy_is_balanced_whatever_the_pair_counts(per_class, classes):
    # With more genuine than impostor pairs (large held-out classes, few of them) accuracy took
    # every genuine pair: a model that learned nothing scored the genuine share (65-80%) beside
    # "chance accuracy 50%".
    from shardkit.train.setup import _pairs_from

    ids = torch.arange(classes).repeat_interleave(per_class)
    ids = torch.cat([ids, torch.tensor([classes] * 2)])  # and one small class (uneven classes)
    images = torch.zeros(len(ids), 4, 4, 3, dtype=torch.uint8)
    vs = _pairs_from(images, ids, seed=0, num_impostor=100)
    genuine, impostor = vs.num_genuine, len(vs.is_same) - vs.num_genuine
    constant = torch.ones(len(ids), 8)  # every pair scores 1: accepted
    res = vs.evaluate(constant)
    assert res.best_accuracy == 0.5 and res.accuracy <= 0.5  # (k-fold thresholds on constant scores: <= chance)
    assert (res.num_genuine, res.num_impostor, res.num_balanced) == (genuine, impostor, min(genuine, impostor))
    perfect = torch.nn.functional.one_hot(ids).float()  # same class: cosine 1, else 0
    assert vs.evaluate(perfect).accuracy == 1.0
