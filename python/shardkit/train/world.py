"""The processes of a ``python -m shardkit.train`` run: one, or torchrun's ranks joined in a
process group with one device each."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from shardkit.train.errors import UsageError

__all__ = ["World", "init_distributed"]


@dataclass
class World:
    size: int = 1
    rank: int = 0
    device: Optional[torch.device] = None
    # under torchrun with NCCL: a gloo group of every rank for host-side agreements (the
    # per-step stop flag) without a device sync; None: the default group is gloo already
    host_group: Optional[dist.ProcessGroup] = None


def init_distributed(args: argparse.Namespace) -> World:
    """Under torchrun (WORLD_SIZE > 1): join the process group; one device per rank."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if any(d.type == "cuda" for d in args.devices):  # (the default where a GPU is visible)
        visible = torch.cuda.device_count()
        if local >= visible:
            raise UsageError(
                f"torchrun: local rank {local} has no GPU of its own ({visible} visible on this node); start at "
                f"most {visible} processes per node (--nproc_per_node={visible}), or pass --devices cpu to train "
                "on the CPU with gloo"
            )
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
        host: Optional[dist.ProcessGroup] = dist.new_group(backend="gloo")
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
        host = None
    args.devices = [dev]
    return World(size, rank, dev, host)
