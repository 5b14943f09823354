"""shardkit.train.data: synthetic identities, verification pairs, image folders, loaders."""

import os

import numpy as np
import pytest
import torch

import shardkit
from shardkit.train.data import (
    EpochBatchSampler,
    ImageFolderDataset,
    Nuisance,
    SyntheticIdentities,
    collate_uint8,
    make_loader,
    verification_split,
)


def test_synthetic_shapes_labels_determinism():
    ds = SyntheticIdentities(7, 5, 20, seed=11)
    assert len(ds) == 35
    x, y = ds.get_batch(range(35))
    assert x.shape == (35, 20, 20, 3) and x.dtype == torch.uint8 and x.is_contiguous()
    assert torch.equal(y, torch.arange(35) // 5) and y.dtype == torch.int64
    assert torch.equal(ds.labels, y)
    # Bit-identical from a fresh instance (no cache) and per item; different seeds differ.
    x2, _ = SyntheticIdentities(7, 5, 20, seed=11, cache=False).get_batch(torch.arange(34, -1, -1))
    assert torch.equal(x2.flip(0), x)
    im, lb = ds[13]
    assert torch.equal(im, x[13]) and int(lb) == 2
    assert not torch.equal(SyntheticIdentities(7, 5, 20, seed=12).get_batch(range(35))[0], x)
    # Nuisance: two images of one identity are not identical.
    assert not torch.equal(x[0], x[1])


def test_synthetic_grayscale_and_no_nuisance():
    ds = SyntheticIdentities(3, 2, 16, seed=0, channels=1, nuisance=Nuisance(0, 0, 0, 0, 0, 0, 0, 0.0))
    x, _ = ds.get_batch(range(6))
    assert x.shape == (6, 16, 16, 1)
    assert torch.equal(x[0], x[1])  # without nuisance both samples equal the prototype


def test_identities_are_learnable_not_trivial():
    # Nearest class mean on raw pixels: far above chance, yet images of one identity vary.
    ds = SyntheticIdentities(20, 12, 24, seed=int(torch.randint(0, 1000, ()).item()))
    x, y = ds.get_batch(range(len(ds)))
    x = x.float().flatten(1) / 255
    train, test = (torch.arange(len(ds)) % 12) < 8, (torch.arange(len(ds)) % 12) >= 8
    means = torch.stack([x[train & (y == k)].mean(0) for k in range(20)])
    pred = torch.cdist(x[test], means).argmin(1)
    acc = (pred == y[test]).float().mean().item()
    assert acc > 0.3  # chance is 0.05
    within = (x[train] - means[y[train]]).norm(dim=1).mean()
    assert within > 0.05 * x.norm(dim=1).mean()  # real intra-class variation


def test_verification_split_pairs():
    vs = verification_split(9, 4, 16, seed=3, train_classes=50, num_impostor=500)
    assert vs.images.shape == (36, 16, 16, 3) and vs.images.dtype == torch.uint8
    assert vs.num_genuine == 9 * 6 and vs.pairs.shape == (54 + 500, 2)
    same_id = vs.identities[vs.pairs[:, 0]] == vs.identities[vs.pairs[:, 1]]
    assert torch.equal(same_id, vs.is_same)
    assert vs.is_same[:54].all() and not vs.is_same[54:].any()
    # Held-out identities are not the training identities (different prototypes).
    train = SyntheticIdentities(50, 4, 16, seed=3, nuisance=Nuisance(0, 0, 0, 0, 0, 0, 0, 0.0))
    held = SyntheticIdentities(9, 4, 16, seed=3, identity_offset=50, nuisance=Nuisance(0, 0, 0, 0, 0, 0, 0, 0.0))
    assert not torch.equal(train[0][0], held[0][0])
    # Deterministic.
    again = verification_split(9, 4, 16, seed=3, train_classes=50, num_impostor=500)
    assert torch.equal(again.pairs, vs.pairs) and torch.equal(again.images, vs.images)


def test_verification_evaluate_with_oracle_embeddings():
    vs = verification_split(10, 3, 8, seed=0, train_classes=5, num_impostor=2000)
    emb = torch.nn.functional.one_hot(vs.identities, 10).float() + 0.01 * torch.randn(30, 10)
    res = vs.evaluate(emb, far=1e-2)
    # 30 images give 405 distinct impostor pairs: all of them, each once (2000 were asked for),
    # too few for a reliable FAR of 1e-2 (10 / far = 1000)
    assert res.accuracy == 1.0 and res.tar == 1.0 and res.num_impostor == 405 and not res.far_reliable
    emb2 = vs.embed(lambda imgs: imgs.float().flatten(1)[:, :5], batch_size=7)
    assert emb2.shape == (30, 5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_classes=0, per_class=2), r"argument `num_classes` must be an integer >= 1"),
        (dict(num_classes=2, per_class=2, image_size=2), r"argument `image_size` must be an integer >= 4"),
        (dict(num_classes=2, per_class=2, channels=4), r"argument `channels` must be 1 or 3"),
    ],
)
def test_synthetic_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyntheticIdentities(**kwargs)
    with pytest.raises(IndexError, match=r"index out of range"):
        SyntheticIdentities(2, 2).get_batch([4])


def _write_folder(root, sizes):
    from PIL import Image

    rng = np.random.default_rng(int(torch.randint(0, 2**31, ()).item()))
    for c, (name, n) in enumerate(sizes):
        os.makedirs(root / name)
        for i in range(n):
            h, w = int(rng.integers(5, 40)), int(rng.integers(5, 40))
            mode = ["RGB", "L", "RGBA"][i % 3]
            arr = rng.integers(0, 256, (h, w, {"RGB": 3, "L": 1, "RGBA": 4}[mode]), dtype=np.uint8)
            Image.fromarray(arr.squeeze(-1) if mode == "L" else arr, mode).save(root / name / f"{i}.png")
    (root / sizes[0][0] / "notes.txt").write_text("not an image")


def test_image_folder_cache_modes(tmp_path):
    _write_folder(tmp_path, [("alice", 4), ("bob", 3), ("carol", 2)])
    plain = ImageFolderDataset(str(tmp_path), 16)
    assert plain.classes == ["alice", "bob", "carol"] and plain.num_classes == 3 and len(plain) == 9
    assert plain.labels.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2]
    ref = torch.stack([plain[i][0] for i in range(9)])
    assert ref.shape == (9, 16, 16, 3) and ref.dtype == torch.uint8
    for mode in ("encoded", "decoded"):
        ds = ImageFolderDataset(str(tmp_path), 16, cache_ram=mode)
        imgs, labels = ds.__getitems__(list(range(9)))
        assert torch.equal(imgs, ref) and torch.equal(labels, plain.labels)
    gray = ImageFolderDataset(str(tmp_path), 8, channels=1)
    assert gray[0][0].shape == (8, 8, 1)
    batch = next(iter(make_loader(ImageFolderDataset(str(tmp_path), 16, cache_ram="decoded"), 4, seed=1)))
    assert batch[0].shape == (4, 16, 16, 3) and batch[1].dtype == torch.int64


def test_image_folder_errors(tmp_path):
    with pytest.raises(ValueError, match=r"not a directory"):
        ImageFolderDataset(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"no class subfolders"):
        ImageFolderDataset(str(tmp_path))
    (tmp_path / "a").mkdir()
    with pytest.raises(ValueError, match=r"1 class folders but no image files"):
        ImageFolderDataset(str(tmp_path))
    (tmp_path / "a" / "x.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match=r"cannot decode image .*x.jpg"):
        ImageFolderDataset(str(tmp_path))[0]
    with pytest.raises(ValueError, match=r"argument `cache_ram` must be one of"):
        ImageFolderDataset(str(tmp_path), cache_ram="gpu")


def test_sampler_resume_and_order():
    full = list(EpochBatchSampler(50, 8, seed=5, epoch=2))
    assert len(full) == 6 and all(len(b) == 8 for b in full)
    assert list(EpochBatchSampler(50, 8, seed=5, epoch=2, start_batch=4)) == full[4:]
    assert list(EpochBatchSampler(50, 8, seed=5, epoch=3)) != full
    assert len(EpochBatchSampler(50, 8, drop_last=False)) == 7
    flat = sum(list(EpochBatchSampler(50, 8, seed=5, epoch=2, drop_last=False)), [])
    assert sorted(flat) == list(range(50))


def test_loader_batches_feed_normalize():
    ds = SyntheticIdentities(5, 4, 12, seed=0)
    loader = make_loader(ds, 6, seed=0, pin_memory=False)
    images, labels = next(iter(loader))
    assert images.shape == (6, 12, 12, 3) and images.dtype == torch.uint8 and labels.shape == (6,)
    ref_imgs, ref_labels = ds.get_batch(next(iter(EpochBatchSampler(20, 6, seed=0))))
    assert torch.equal(images, ref_imgs) and torch.equal(labels, ref_labels)
    out = shardkit.Normalize([0.5] * 3, [0.5] * 3)(images)
    assert out.shape == (6, 3, 12, 12) and out.min() >= -1 and out.max() <= 1
    # collate of single items equals the batched path
    items = [ds[i] for i in range(3)]
    imgs, lbs = collate_uint8(items)
    assert torch.equal(imgs, ds.get_batch(range(3))[0]) and lbs.tolist() == [0, 0, 0]


def test_rank_batches_are_distributed_sampler_batches_and_resume_exactly():
    from types import SimpleNamespace

    from torch.utils.data import DistributedSampler

    from shardkit.train.setup import _RankBatches

    data = list(range(103))

    def batches(size, rank, epoch, start=0, batch=4):
        return list(_RankBatches(data, batch, SimpleNamespace(size=size, rank=rank), 7, epoch, start))

    # Exactly torch's DistributedSampler (with set_epoch) cut into batches.
    ref = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=7, drop_last=True)
    ref.set_epoch(3)
    idx = list(ref)
    assert batches(2, 1, 3) == [idx[b * 4 : (b + 1) * 4] for b in range(len(idx) // 4)]
    for n, size in [(103, 3), (96, 4), (7, 8), (50, 1), (1000, 7)]:
        for rank in range(size):
            ref = DistributedSampler(range(n), num_replicas=size, rank=rank, shuffle=True, seed=11, drop_last=True)
            ref.set_epoch(2)
            idx = list(ref)
            got = list(_RankBatches(list(range(n)), 3, SimpleNamespace(size=size, rank=rank), 11, 2, 0))
            assert got == [idx[b * 3 : (b + 1) * 3] for b in range(len(idx) // 3)], (n, size, rank)
    # The ranks' batches b are disjoint and together form global batch b of a one-rank run
    # with the global batch size; a resume at batch 5 continues exactly; epochs differ.
    one = batches(1, 0, 3, batch=8)
    r0, r1 = batches(2, 0, 3), batches(2, 1, 3)
    assert len(r0) == len(r1) == 12
    for b in range(12):
        assert not set(r0[b]) & set(r1[b]) and sorted(r0[b] + r1[b]) == sorted(one[b])
    assert batches(2, 1, 3, start=5) == r1[5:]
    assert batches(2, 1, 4) != r1
