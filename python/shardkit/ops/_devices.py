"""Which CUDA devices this process can use: one count and one check, shared by every wing that
takes device arguments (a clear error naming the argument at construction, instead of the
driver's message at the first copy)."""

from typing import Iterable

import torch


def visible_gpus() -> int:
    """CUDA GPUs this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def unavailable_cuda(devices: Iterable[torch.device]) -> list[torch.device]:
    """The CUDA devices of ``devices`` whose index is past the visible GPUs (``cuda`` counts as
    ``cuda:0``), in order, each once."""
    visible = visible_gpus()
    return list(dict.fromkeys(d for d in devices if d.type == "cuda" and (d.index or 0) >= visible))


def check_visible(devices: Iterable[torch.device], name: str) -> None:
    """ValueError naming argument ``name`` for the first CUDA device that is not visible."""
    missing = unavailable_cuda(devices)
    if missing:
        raise ValueError(
            f"argument `{name}`: {missing[0]} is not available ({visible_gpus()} CUDA GPU(s) visible on this machine)"
        )
