"""Datasets that deliver uint8 images for GPU-side normalization (:class:`shardkit.Normalize`).

* :class:`SyntheticIdentities`: a built-in, procedurally generated identity dataset for
  face-recognition-style training. Each identity is a distinct pattern (a colour gradient,
  two oriented gratings and three coloured blobs, drawn from the identity's own seed); each
  sample adds nuisance (shift, rotation, scale jitter, brightness/contrast/colour change,
  pixel noise, a random occluding rectangle), so identities are learnable but not
  trivially. Deterministic: image ``i`` depends only on ``(seed, i)``; rendering is
  vectorized torch (~10k 32x32 images/s on one core).
* :func:`verification_split`: held-out identities (never in training) with genuine and
  impostor pairs, for :mod:`shardkit.train.metrics`.
* :class:`ImageFolderDataset` (in :mod:`shardkit.train.imagefolder`, re-exported): class
  subfolders of image files, decoded with Pillow, optionally cached in RAM.
* :func:`collate_uint8` / :func:`make_loader`: uint8 NHWC batches (pinned when CUDA is
  available) in a deterministic, resumable order.

Every image is a uint8 tensor ``[H, W, C]``; batches are ``[N, H, W, C]`` uint8 + ``[N]`` int64.
"""

from __future__ import annotations

import math
from collections.abc import Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from shardkit.train.imagefolder import ImageFolderDataset

if TYPE_CHECKING:
    from shardkit.train.metrics import VerificationResult

__all__ = [
    "Nuisance",
    "SyntheticIdentities",
    "VerificationSet",
    "verification_split",
    "ImageFolderDataset",
    "collate_uint8",
    "EpochBatchSampler",
    "make_loader",
]

_MASK64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 finalizer over the sequence)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h >> 1


@dataclass(frozen=True)
class Nuisance:
    """Per-sample variation of :class:`SyntheticIdentities` (coordinates span [-1, 1])."""

    shift: float = 0.15  # max translation, fraction of the half-width
    rotation_deg: float = 12.0  # max rotation
    scale: float = 0.12  # scale in [1 - scale, 1 + scale]
    brightness: float = 0.12  # additive, in [0, 1] intensity units
    contrast: float = 0.25  # multiplicative in [1 - contrast, 1 + contrast]
    color: float = 0.10  # per-channel gain in [1 - color, 1 + color]
    noise: float = 0.05  # pixel noise std
    occlusion_prob: float = 0.5  # chance of one occluding rectangle
    occlusion_size: Tuple[float, float] = (0.2, 0.45)  # its side, fraction of the image side


_GRATINGS, _BLOBS = 2, 3
# Prototype parameter layout (per identity): background 7, gratings 6 each, blobs 6 each.
_PROTO_LEN = 7 + 6 * _GRATINGS + 6 * _BLOBS
_NUIS_LEN = 17


class SyntheticIdentities(Dataset):
    """``num_classes`` generated identities x ``per_class`` images, labels ``0..num_classes-1``.

    Args:
        num_classes: identities (int >= 1); image ``i`` has label ``i // per_class``.
        per_class: images per identity (int >= 1).
        image_size: side length S (int >= 4).
        seed: dataset seed; the same seed gives bit-identical images.
        channels: C (1 or 3).
        identity_offset: identity ``k`` of this dataset is global identity ``identity_offset + k``
            (held-out identities use offsets past the training ones).
        nuisance: per-sample variation (:class:`Nuisance`).
        cache: keep every rendered image in RAM (``len * S * S * C`` bytes, e.g. 61 MiB for
            1000 x 20 images of 32x32x3), so only the first epoch pays for rendering.
            Default (None): cache when that is at most 1 GiB.

    ``dataset[i]`` -> (uint8 ``[S, S, C]``, int64 scalar label); ``dataset.get_batch(indices)``
    -> (uint8 ``[N, S, S, C]``, int64 ``[N]``), rendered in one vectorized pass (DataLoader
    uses it through ``__getitems__``).
    """

    def __init__(
        self,
        num_classes: int,
        per_class: int,
        image_size: int = 32,
        seed: int = 0,
        *,
        channels: int = 3,
        identity_offset: int = 0,
        nuisance: Nuisance = Nuisance(),
        cache: Optional[bool] = None,
    ) -> None:
        for name, v, lo in [
            ("num_classes", num_classes, 1),
            ("per_class", per_class, 1),
            ("image_size", image_size, 4),
        ]:
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"argument `{name}` must be an integer >= {lo}, got {v!r}")
        if channels not in (1, 3):
            raise ValueError(f"argument `channels` must be 1 or 3, got {channels!r}")
        self.num_classes, self.per_class, self.image_size = num_classes, per_class, image_size
        self.seed, self.channels, self.identity_offset, self.nuisance = seed, channels, identity_offset, nuisance
        g = torch.Generator()
        protos = []
        for k in range(num_classes):
            g.manual_seed(_mix(seed, 1, identity_offset + k))
            protos.append(torch.rand(_PROTO_LEN, generator=g))
        self._protos = torch.stack(protos)  # [num_classes, _PROTO_LEN] uniforms in [0, 1)
        lin = (torch.arange(image_size, dtype=torch.float32) + 0.5) / image_size * 2 - 1
        self._gy, self._gx = torch.meshgrid(lin, lin, indexing="ij")
        if cache is None:
            cache = num_classes * per_class * image_size * image_size * channels <= 1 << 30
        self._cache = torch.empty(len(self), image_size, image_size, channels, dtype=torch.uint8) if cache else None
        self._cached = torch.zeros(len(self), dtype=torch.bool) if cache else None

    def __len__(self) -> int:
        return self.num_classes * self.per_class

    @property
    def labels(self) -> torch.Tensor:
        """int64 ``[len(self)]``: the label of every index."""
        return torch.arange(len(self)) // self.per_class

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        images, labels = self.get_batch([index])
        return images[0], labels[0]

    def __getitems__(self, indices: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.get_batch(indices)

    def get_batch(self, indices: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """uint8 ``[N, S, S, C]`` images and int64 ``[N]`` labels of ``indices``."""
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= len(self)):
            raise IndexError(f"index out of range for a dataset of {len(self)} images")
        labels = idx // self.per_class
        if self._cache is None or self._cached is None:  # (both or neither)
            return self.render(labels, idx), labels
        missing = idx[~self._cached[idx]].unique()
        if missing.numel():
            self._cache[missing] = self.render(missing // self.per_class, missing)
            self._cached[missing] = True
        return self._cache[idx], labels

    def render(self, identities: torch.Tensor, sample_keys: torch.Tensor) -> torch.Tensor:
        """Images of ``identities`` (local ids ``[N]``) with nuisance drawn from ``sample_keys`` ``[N]``."""
        n, S, C = identities.numel(), self.image_size, self.channels
        g = torch.Generator()
        nuis = torch.empty(n, _NUIS_LEN)
        noise = torch.empty(n, C, S, S)
        for j, key in enumerate(sample_keys.tolist()):
            g.manual_seed(_mix(self.seed, 2, self.identity_offset, key))
            nuis[j] = torch.rand(_NUIS_LEN, generator=g)
            noise[j] = torch.randn(C, S, S, generator=g)
        img = self._draw(self._protos[identities], nuis)  # [N, 3, S, S] in ~[0, 1]
        img = self._photometric(img, nuis, noise)
        return (img.clamp(0, 1) * 255).round_().to(torch.uint8).permute(0, 2, 3, 1).contiguous()

    def _draw(self, p: torch.Tensor, u01: torch.Tensor) -> torch.Tensor:
        nz = self.nuisance
        sym = u01 * 2 - 1  # uniforms in [-1, 1)
        dx, dy = (sym[:, 0] * nz.shift)[:, None, None], (sym[:, 1] * nz.shift)[:, None, None]
        rot = (sym[:, 2] * math.radians(nz.rotation_deg))[:, None, None]
        scale = (1 + sym[:, 3] * nz.scale)[:, None, None]
        x, y = self._gx - dx, self._gy - dy  # sample coordinates in the identity's frame
        u = (torch.cos(rot) * x + torch.sin(rot) * y) / scale
        v = (-torch.sin(rot) * x + torch.cos(rot) * y) / scale
        # Background: a linear gradient between two colours along a per-identity direction.
        alpha = p[:, 6, None, None] * 2 * math.pi
        t = ((u * torch.cos(alpha) + v * torch.sin(alpha)) * 0.5 + 0.5).clamp(0, 1)[:, None]
        img = p[:, 0:3, None, None] * (1 - t) + p[:, 3:6, None, None] * t
        # Oriented gratings with their own colour vector.
        q = p[:, 7 : 7 + 6 * _GRATINGS].reshape(-1, _GRATINGS, 6)
        theta = q[..., 0, None, None] * math.pi
        freq = 1.5 + 3.0 * q[..., 1, None, None]
        phase = q[..., 2, None, None] * 2 * math.pi
        proj = u[:, None] * torch.cos(theta) + v[:, None] * torch.sin(theta)
        wave = (0.15 + 0.15 * q[..., 3, None, None]) * torch.cos(math.pi * freq * proj + phase)
        img = img + torch.einsum("nghw,ngc->nchw", wave, q[..., 3:6] * 2 - 1)
        # Coloured Gaussian blobs.
        b = p[:, 7 + 6 * _GRATINGS :].reshape(-1, _BLOBS, 6)
        cx, cy = (b[..., 0, None, None] * 1.2 - 0.6), (b[..., 1, None, None] * 1.2 - 0.6)
        sigma = 0.15 + 0.2 * b[..., 2, None, None]
        blob = torch.exp(-((u[:, None] - cx) ** 2 + (v[:, None] - cy) ** 2) / (2 * sigma**2))
        img = img + torch.einsum("nghw,ngc->nchw", blob, (b[..., 3:6] * 2 - 1) * 0.6)
        if self.channels == 1:
            img = img.mean(dim=1, keepdim=True)
        return img

    def _photometric(self, img: torch.Tensor, u01: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        nz, S = self.nuisance, self.image_size
        sym = u01 * 2 - 1
        contrast = (1 + sym[:, 4] * nz.contrast)[:, None, None, None]
        bright = (sym[:, 5] * nz.brightness)[:, None, None, None]
        gain = (1 + sym[:, 6:9] * nz.color)[:, : img.shape[1], None, None]
        img = ((img - 0.5) * contrast + 0.5 + bright) * gain + noise * nz.noise
        # One occluding rectangle of a random colour, with probability occlusion_prob.
        lo, hi = nz.occlusion_size
        w = (lo + (hi - lo) * u01[:, 9]) * S
        h = (lo + (hi - lo) * u01[:, 10]) * S
        x0, y0 = u01[:, 11] * (S - w), u01[:, 12] * (S - h)
        pix = torch.arange(S, dtype=torch.float32) + 0.5
        inside_x = (pix[None] >= x0[:, None]) & (pix[None] < (x0 + w)[:, None])
        inside_y = (pix[None] >= y0[:, None]) & (pix[None] < (y0 + h)[:, None])
        mask = (inside_y[:, :, None] & inside_x[:, None, :]) & (u01[:, 13] < nz.occlusion_prob)[:, None, None]
        fill = u01[:, 14:17][:, : img.shape[1], None, None].expand_as(img)
        return torch.where(mask[:, None], fill, img)


@dataclass
class VerificationSet:
    """Held-out identities for verification.

    ``images`` uint8 ``[M, S, S, C]``; ``identities`` int64 ``[M]``; ``pairs`` int64 ``[P, 2]``
    (indices into ``images``), ``is_same`` bool ``[P]``: the first ``num_genuine`` pairs are
    genuine, then impostors. Accuracy uses as many genuine as impostor pairs (balanced, as LFW:
    the genuine pairs and the first as many impostors, or, where there are more genuine pairs,
    a subset of them spread over the identities); TAR@FAR uses every pair.
    """

    images: torch.Tensor
    identities: torch.Tensor
    pairs: torch.Tensor
    is_same: torch.Tensor
    num_genuine: int

    @torch.no_grad()
    def embed(self, embed_fn: Callable[[torch.Tensor], torch.Tensor], batch_size: int = 256) -> torch.Tensor:
        """Embeddings ``[M, D]`` (CPU float32) of every image; ``embed_fn`` maps a uint8
        ``[n, S, S, C]`` CPU batch to ``[n, D]`` (move it to the device and normalize inside)."""
        out = [embed_fn(self.images[i : i + batch_size]).float().cpu() for i in range(0, len(self.images), batch_size)]
        return torch.cat(out)

    def evaluate(self, embeddings: torch.Tensor, *, far: float = 1e-3, folds: int = 10) -> VerificationResult:
        """:class:`shardkit.train.metrics.VerificationResult` from per-image ``embeddings [M, D]``:
        accuracy on the balanced pairs, TAR@FAR on all pairs."""
        from shardkit.train import metrics

        e1, e2 = embeddings[self.pairs[:, 0]], embeddings[self.pairs[:, 1]]
        # Balanced, so that accepting every pair scores 50% (with more genuine than impostor pairs,
        # taking them all scored the share of genuine pairs for a model that learned nothing).
        genuine, impostor = self.num_genuine, len(self.is_same) - self.num_genuine
        n = min(genuine, impostor)
        spread = torch.linspace(0, genuine - 1, n).round().long() if n < genuine else torch.arange(n)
        bal = torch.cat([spread, genuine + torch.arange(n)])
        res = metrics.evaluate_verification(e1[bal], e2[bal], self.is_same[bal], far=far, folds=folds)
        scores = metrics.cosine_scores(e1, e2)
        res.tar, res.far_threshold, res.far_achieved = metrics.tar_at_far(scores, self.is_same, far)
        res.num_genuine, res.num_balanced = genuine, n
        res.num_impostor = impostor
        res.far_resolution = 1.0 / res.num_impostor
        res.far_reliable = res.num_impostor >= 10.0 / far
        return res


def verification_split(
    num_identities: int,
    per_identity: int,
    image_size: int = 32,
    seed: int = 0,
    *,
    train_classes: int,
    channels: int = 3,
    num_impostor: int = 10000,
    nuisance: Nuisance = Nuisance(),
) -> VerificationSet:
    """Held-out identities ``train_classes .. train_classes + num_identities - 1`` (never seen by
    a :class:`SyntheticIdentities` with ``num_classes <= train_classes``), ``per_identity``
    images each; every genuine pair (all same-identity combinations) and ``num_impostor``
    distinct pairs of different identities (all of them if there are fewer), drawn
    deterministically from ``seed``."""
    if num_identities < 2 or per_identity < 2:
        raise ValueError(f"need >= 2 identities with >= 2 images each, got {num_identities} x {per_identity}")
    ds = SyntheticIdentities(
        num_identities,
        per_identity,
        image_size,
        seed,
        channels=channels,
        identity_offset=train_classes,
        nuisance=nuisance,
    )
    images, ids = ds.get_batch(range(len(ds)))
    a, b = torch.triu_indices(per_identity, per_identity, offset=1)
    base = torch.arange(num_identities)[:, None] * per_identity
    genuine = torch.stack([(base + a).reshape(-1), (base + b).reshape(-1)], dim=1)
    from shardkit.train.metrics import impostor_pairs

    g = torch.Generator().manual_seed(_mix(seed, 3, train_classes))
    impostor = impostor_pairs(ids, num_impostor, g)
    pairs = torch.cat([genuine, impostor])
    is_same = torch.cat([torch.ones(len(genuine), dtype=torch.bool), torch.zeros(len(impostor), dtype=torch.bool)])
    return VerificationSet(images, ids, pairs, is_same, len(genuine))


def collate_uint8(batch: Sequence[Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stack ``[(uint8 [H, W, C], label), ...]`` to (uint8 ``[N, H, W, C]``, int64 ``[N]``); an
    already batched ``(images, labels)`` pair (from ``__getitems__``) passes through."""
    if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[0], torch.Tensor) and batch[0].dim() == 4:
        return batch
    images = torch.stack([torch.as_tensor(im) for im, _ in batch])
    labels = torch.as_tensor([int(lb) for _, lb in batch], dtype=torch.int64)
    return images, labels


class EpochBatchSampler(Sampler[List[int]]):
    """Batches of indices of a random permutation fixed by ``(seed, epoch)``, starting at batch
    ``start_batch``: recreating it with the same arguments resumes an epoch exactly."""

    def __init__(
        self,
        n: int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        epoch: int = 0,
        drop_last: bool = True,
        start_batch: int = 0,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"argument `batch_size` must be >= 1, got {batch_size}")
        self.n, self.batch_size, self.shuffle, self.seed = n, batch_size, shuffle, seed
        self.epoch, self.drop_last, self.start_batch = epoch, drop_last, start_batch

    def __len__(self) -> int:
        full = self.n // self.batch_size if self.drop_last else -(-self.n // self.batch_size)
        return max(0, full - self.start_batch)

    def __iter__(self) -> Iterator[List[int]]:
        if self.shuffle:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(_mix(self.seed, 4, self.epoch)))
        else:
            order = torch.arange(self.n)
        for b in range(self.start_batch, self.start_batch + len(self)):
            yield order[b * self.batch_size : (b + 1) * self.batch_size].tolist()


def make_loader(
    dataset: Dataset[Any],
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    start_batch: int = 0,
    drop_last: bool = True,
    num_workers: int = 0,
    pin_memory: Optional[bool] = None,
) -> DataLoader[Tuple[torch.Tensor, torch.Tensor]]:
    """A DataLoader of (uint8 ``[N, H, W, C]``, int64 ``[N]``) batches in the order of
    :class:`EpochBatchSampler`; ``pin_memory`` defaults to ``torch.cuda.is_available()`` so
    ``images.to(device, non_blocking=True)`` overlaps the copy with compute."""
    if not isinstance(dataset, Sized):
        raise TypeError(f"argument `dataset` must be a map-style dataset with a length, got {type(dataset).__name__}")
    sampler = EpochBatchSampler(
        len(dataset), batch_size, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last, start_batch=start_batch
    )
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_uint8,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )
