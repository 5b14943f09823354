"""Ctrl-C under torchrun: every rank stops after the same step (two gloo processes). Each rank
used to act on its own flag: one entered the save's collectives while the other ran the next
step's, and the run hung (a real Ctrl-C reaches the ranks at different moments; a SIGINT to one
worker reaches one)."""

import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_teardown import end_rank

from shardkit.train import loop
from shardkit.train.world import World


def _rank(rank, init_file, tmp):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    out = {}
    try:
        world = World(2, rank, torch.device("cpu"), dist.new_group(backend="gloo"))
        out["one"] = loop._stop_agreed(rank == 1, world)  # Ctrl-C reached rank 1 only
        out["none"] = loop._stop_agreed(False, world)
        out["both"] = loop._stop_agreed(True, world)
    except Exception:
        out["fatal"] = traceback.format_exc()
    finally:
        torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
        end_rank()


def test_a_stop_seen_by_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt")
        assert "fatal" not in res, res.get("fatal")
        assert res == {"one": True, "none": False, "both": True}, (r, res)
    assert loop._stop_agreed(True, World()) and not loop._stop_agreed(False, World())  # one process: its own
