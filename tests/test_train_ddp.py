"""The trainer's step under DDP with gradient accumulation (two gloo processes): the backbone's
gradients are all-reduced once per optimizer step, on the last micro-batch (``no_sync()`` on
the others), and the ranks end the step with equal gradients and weights."""

import os
import traceback
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_teardown import end_rank
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.train import loop

STEPS, ACCUMULATE = 2, 3


def _rank(rank, init_file, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))  # fmt: skip
    result = {}
    model = ddp = parts = None
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
        ddp = DDP(model)
        reductions = []

        def counting_allreduce(state, bucket):
            reductions.append(bucket.index())
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(dist.group.WORLD, counting_allreduce)
        gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data

        def micro_step(parts, args, batch):  # the real step's backward through DDP
            x = batch
            loss = parts.backbone_train(x).pow(2).mean()
            loss.backward()
            return loss, None

        loop._micro_step = micro_step
        parts = SimpleNamespace(
            optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)],
            backbone_train=ddp,
            backbone=model,
            scaler=None,
            ema=None,
            batches=SimpleNamespace(get=lambda index, per_epoch: torch.randn(4, 5, generator=gen)),
        )
        args = SimpleNamespace(lr=0.1, accumulate=ACCUMULATE)
        per_step = []
        for step in range(STEPS):
            before = len(reductions)
            loop.train_step(parts, args, step, 10, 10, loop.World(size=2, rank=rank))
            per_step.append(len(reductions) - before)
        result["reductions_per_step"] = per_step
        result["buckets"] = len(set(reductions))
        result["weights"] = [p.detach().clone() for p in model.parameters()]
    except Exception:
        result["error"] = traceback.format_exc()
    torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
    del ddp, parts, model  # the reducer holds the group: gone before the teardown
    end_rank()


def test_ddp_accumulation_all_reduces_once_per_step(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in res:
        assert "error" not in r, r["error"]
        # one all-reduce per bucket per step, not one per micro-batch (that would be 3x)
        assert r["reductions_per_step"] == [r["buckets"]] * STEPS, r
    for a, b in zip(res[0]["weights"], res[1]["weights"]):  # the averaged gradients kept the ranks equal
        assert torch.equal(a, b)
