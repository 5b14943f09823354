"""ImageFolder-style directory dataset (re-exported as :class:`shardkit.train.data.ImageFolderDataset`).

Pillow decodes; torchvision is not needed."""

from __future__ import annotations

import io
import os
from typing import List, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["ImageFolderDataset", "IMAGE_EXTENSIONS"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".pgm", ".tif", ".tiff")
_CACHE_MODES = ("none", "encoded", "decoded")


def _pil():
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - Pillow is installed with matplotlib
        raise ImportError("ImageFolderDataset needs Pillow: pip install pillow") from e
    return Image


class ImageFolderDataset(Dataset):
    """``root/<class>/<image file>``: one subfolder per class (sorted names -> labels 0..K-1).

    Args:
        root: the directory.
        image_size: every image is converted to RGB (or L for ``channels=1``) and resized
            to ``image_size x image_size`` (bilinear) on load.
        cache_ram: ``"none"`` (read and decode files on every access), ``"encoded"`` (file
            bytes kept in RAM, decoded on access: ~ the dataset's size on disk), or
            ``"decoded"`` (all images decoded once into one uint8 tensor
            ``[N, S, S, C]``: N * S * S * C bytes, no decoding afterwards).
        channels: 3 (RGB) or 1 (grayscale).
        extensions: file suffixes taken as images (case-insensitive).

    ``dataset[i]`` -> (uint8 ``[S, S, C]``, int64 label). ``classes`` lists the class names,
    ``samples`` the ``(path, label)`` pairs. Raises ValueError when ``root`` is not a
    directory, has no class subfolders, or no image files.
    """

    def __init__(
        self,
        root: str,
        image_size: int = 112,
        *,
        cache_ram: str = "none",
        channels: int = 3,
        extensions: Sequence[str] = IMAGE_EXTENSIONS,
    ):
        if cache_ram not in _CACHE_MODES:
            raise ValueError(f"argument `cache_ram` must be one of {_CACHE_MODES}, got {cache_ram!r}")
        if channels not in (1, 3):
            raise ValueError(f"argument `channels` must be 1 or 3, got {channels!r}")
        if not os.path.isdir(root):
            raise ValueError(f"--data {root!r}: not a directory")
        self.root, self.image_size, self.cache_ram, self.channels = root, image_size, cache_ram, channels
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        if not self.classes:
            raise ValueError(f"--data {root!r}: no class subfolders (expected root/<class>/<image files>)")
        exts = tuple(e.lower() for e in extensions)
        self.samples: List[Tuple[str, int]] = []
        for label, name in enumerate(self.classes):
            folder = os.path.join(root, name)
            for dirpath, _, files in sorted(os.walk(folder)):
                for f in sorted(files):
                    if f.lower().endswith(exts):
                        self.samples.append((os.path.join(dirpath, f), label))
        if not self.samples:
            raise ValueError(
                f"--data {root!r}: {len(self.classes)} class folders but no image files ({', '.join(exts)})"
            )
        self.labels = torch.tensor([lb for _, lb in self.samples], dtype=torch.int64)
        self._encoded: List[bytes] = []
        self._decoded = None
        if cache_ram == "encoded":
            for path, _ in self.samples:
                with open(path, "rb") as fh:
                    self._encoded.append(fh.read())
        elif cache_ram == "decoded":
            self._decoded = torch.empty(len(self.samples), image_size, image_size, channels, dtype=torch.uint8)
            for i, (path, _) in enumerate(self.samples):
                with open(path, "rb") as fh:
                    self._decoded[i] = self._decode(fh.read(), path)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def _decode(self, data: bytes, path: str) -> torch.Tensor:
        Image = _pil()
        try:
            with Image.open(io.BytesIO(data)) as im:
                im = im.convert("RGB" if self.channels == 3 else "L")
                if im.size != (self.image_size, self.image_size):
                    im = im.resize((self.image_size, self.image_size), Image.BILINEAR)
                arr = np.asarray(im, dtype=np.uint8)
        except Exception as e:  # Pillow raises several types for broken files
            raise ValueError(f"cannot decode image {path!r}: {e}") from e
        if arr.ndim == 2:
            arr = arr[:, :, None]
        return torch.from_numpy(arr.copy())

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        if self._decoded is not None:
            image = self._decoded[index]
        elif self._encoded:
            image = self._decode(self._encoded[index], path)
        else:
            with open(path, "rb") as fh:
                image = self._decode(fh.read(), path)
        return image, self.labels[index]

    def __getitems__(self, indices: Sequence[int]):
        if self._decoded is not None:
            idx = torch.as_tensor(list(indices), dtype=torch.int64)
            return self._decoded[idx], self.labels[idx]
        items = [self[i] for i in indices]
        return torch.stack([im for im, _ in items]), torch.stack([lb for _, lb in items])
