"""ImageFolder-style directory dataset (re-exported as :class:`shardkit.train.data.ImageFolderDataset`).

Pillow decodes; torchvision is not needed."""

from __future__ import annotations

import io
import os
import re
from types import ModuleType
from typing import Any, Dict, List, Literal, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["ImageFolderDataset", "IMAGE_EXTENSIONS"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".pgm", ".tif", ".tiff")
_CACHE_MODES = ("none", "encoded", "decoded")


def _pil() -> ModuleType:
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - Pillow is installed with matplotlib
        raise ImportError("ImageFolderDataset needs Pillow: pip install pillow") from e
    return Image


def _image_files(folder: str, exts: Tuple[str, ...]) -> List[str]:
    """The image files under ``folder`` (recursively; symlinked folders not followed, hidden
    entries skipped): folder by folder in sorted path order, each folder's files sorted
    (``sorted(os.walk(folder))``'s order). A name with an image suffix that is not a regular
    file (a broken or looping link, a pipe, a device) is a ValueError naming it: reading it
    would fail or block forever."""
    found: Dict[str, List[str]] = {}
    todo = [folder]
    while todo:
        here = todo.pop()
        names = found.setdefault(here, [])
        try:
            it = os.scandir(here)
        except OSError:  # a folder it may not read (lost+found): skipped, as os.walk does
            continue
        with it:
            for e in it:
                if e.name.startswith("."):  # hidden: macOS's "._x.jpg" metadata files, ".picasaoriginals/"
                    continue
                if e.is_dir(follow_symlinks=False):
                    todo.append(e.path)
                elif e.name.lower().endswith(exts):
                    try:
                        regular = e.is_file()
                    except OSError:  # a link looping onto itself
                        regular = False
                    if not regular:
                        raise ValueError(f"cannot decode image {e.path!r}: not a regular file (a broken link, a pipe?)")
                    names.append(e.name)
    return [os.path.join(d, f) for d in sorted(found) for f in sorted(found[d])]


def _class_folders(root: str) -> List[str]:
    """The names of ``root``'s class folders (sorted; hidden ones skipped). An entry whose
    kind cannot be read (a link looping onto itself: ELOOP) is a ValueError naming it, as an
    image file that is not a regular file is."""
    names = []
    try:
        it = os.scandir(root)
    except OSError as err:
        raise ValueError(f"--data {root!r}: cannot list it ({err.strerror or err})") from None
    with it:
        for e in it:
            if e.name.startswith("."):
                continue
            try:
                is_dir = e.is_dir()
            except OSError as err:
                raise ValueError(
                    f"--data {root!r}: cannot read the entry {e.path!r} ({err.strerror or err}: a link looping "
                    "onto itself?); remove or fix it"
                ) from None
            if is_dir:
                names.append(e.name)
    return sorted(names)


def _eight_bit(im: Any) -> Any:
    """``im`` with 8-bit samples: Pillow's convert() clips 16-bit grayscale (``I;16``, ``I``:
    a 16-bit PNG or TIFF) at 255 and truncates float (``F``) samples; scaled here instead,
    16-bit from 0..65535 (``I`` too when a value passes 255), float from 0..1 (0..255 when a
    value passes 1)."""
    if not (im.mode.startswith("I") or im.mode == "F"):
        return im
    a = np.asarray(im).astype(np.float64)
    if im.mode.startswith("I;16") or (im.mode == "I" and a.size and a.max() > 255):
        a = a / 257.0
    elif im.mode == "F" and a.size and np.nanmax(a) <= 1.0:
        a = a * 255.0
    return _pil().fromarray(np.clip(np.nan_to_num(a), 0, 255).round().astype(np.uint8), mode="L")


def _upright(im: Any) -> Any:
    """``im`` as a viewer shows it: a photo's EXIF orientation (phones store the rotation
    there) applied; an image without one as it is (no copy)."""
    orientation = im.getexif().get(0x0112, 1)  # (read from the header)
    if orientation in (None, 1):
        return im
    from PIL import ImageOps

    return ImageOps.exif_transpose(im)


def _read(path: str) -> bytes:
    """A file's bytes; a ValueError naming it when it cannot be read."""
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as e:
        raise ValueError(f"cannot decode image {path!r}: cannot read it ({e.strerror or e})") from None


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
    ``samples`` the ``(path, label)`` pairs. Images are taken upright (their EXIF orientation
    applied) and 16-bit or float grayscale is scaled to 8 bits (not clipped). Raises ValueError
    when ``root`` is not a directory, has no class subfolders, or a class folder holds no
    image files.
    """

    def __init__(
        self,
        root: str,
        image_size: int = 112,
        *,
        cache_ram: Literal["none", "encoded", "decoded"] = "none",
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
        self.classes = _class_folders(root)
        if not self.classes:
            raise ValueError(f"--data {root!r}: no class subfolders (expected root/<class>/<image files>)")
        exts = tuple(e.lower() for e in extensions)
        self.samples: List[Tuple[str, int]] = []
        for label, name in enumerate(self.classes):
            self.samples += [(path, label) for path in _image_files(os.path.join(root, name), exts)]
        if not self.samples:
            raise ValueError(
                f"--data {root!r}: {len(self.classes)} class folders but no image files ({', '.join(exts)})"
            )
        counts = np.bincount([lb for _, lb in self.samples], minlength=len(self.classes))
        empty = [self.classes[k] for k in np.flatnonzero(counts == 0)]
        if empty:  # (a class of the head that no image is of: as torchvision's ImageFolder, refused)
            names = ", ".join(repr(n) for n in empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
            raise ValueError(
                f"--data {root!r}: {len(empty)} class folder(s) hold no image files ({', '.join(exts)}): {names}; "
                "remove them or add images"
            )
        self.labels = torch.tensor([lb for _, lb in self.samples], dtype=torch.int64)
        self._encoded: List[bytes] = []
        self._decoded = None
        if cache_ram == "encoded":
            self._encoded = [_read(path) for path, _ in self.samples]
        elif cache_ram == "decoded":
            self._decoded = torch.empty(len(self.samples), image_size, image_size, channels, dtype=torch.uint8)
            for i, (path, _) in enumerate(self.samples):
                self._decoded[i] = self._decode(_read(path), path)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def _decode(self, data: bytes, path: str) -> torch.Tensor:
        Image = _pil()
        try:
            with Image.open(io.BytesIO(data)) as im:
                im = _upright(_eight_bit(im))
                im = im.convert("RGB" if self.channels == 3 else "L")
                if im.size != (self.image_size, self.image_size):
                    im = im.resize((self.image_size, self.image_size), Image.BILINEAR)
                arr = np.asarray(im, dtype=np.uint8)
        except Exception as e:  # Pillow raises several types for broken files
            # (Pillow names the in-memory buffer, "<_io.BytesIO object at 0x...>": the path says which file)
            why = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", str(e)) or type(e).__name__
            raise ValueError(f"cannot decode image {path!r}: {why}") from e
        if arr.ndim == 2:
            arr = arr[:, :, None]
        return torch.from_numpy(arr.copy())

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        path, label = self.samples[index]
        if self._decoded is not None:
            image = self._decoded[index]
        elif self._encoded:
            image = self._decode(self._encoded[index], path)
        else:
            image = self._decode(_read(path), path)
        return image, self.labels[index]

    def __getitems__(self, indices: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._decoded is not None:
            idx = torch.as_tensor(list(indices), dtype=torch.int64)
            return self._decoded[idx], self.labels[idx]
        items = [self[i] for i in indices]
        return torch.stack([im for im, _ in items]), torch.stack([lb for _, lb in items])
