"""ShardedSoftmaxLoss(process_group=...) on NCCL, one spawned process per GPU (GPU-marked;
one GPU is enough: world size 1). Scenarios and the reference check: dist_scenarios.py."""

import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dist_scenarios import check_against_reference, make_data, run_scenario


def _nccl_worker(rank, world, init_file, tmp, data):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    out = {}
    try:
        for rate in (1.0, 0.5):
            out[rate] = run_scenario(rank, world, "cos32_none", data, dist.group.WORLD,
                                     device=torch.device("cuda", rank), sample_rate=rate)
    except Exception:
        out["fatal"] = traceback.format_exc()
    finally:
        torch.save(out, os.path.join(tmp, f"nccl{rank}.pt"))
        dist.destroy_process_group()


@pytest.mark.gpu
def test_nccl_on_gpus_matches_reference(tmp_path):
    """NCCL on every visible GPU (up to 4; one is enough): the fp32 CosFace scenario, full
    and sampled, against the float64 reference."""
    world = min(torch.cuda.device_count(), 4)
    data = make_data(int.from_bytes(os.urandom(4), "little"))[(world, "cos32_none")]
    mp.spawn(_nccl_worker, args=(world, str(tmp_path / "init"), str(tmp_path), data), nprocs=world, join=True)
    per_rank = [torch.load(tmp_path / f"nccl{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(per_rank):
        assert "fatal" not in res, f"rank {r}: {res['fatal']}"
    for rate in (1.0, 0.5):
        fake = {world: [{"cos32_none": res[rate]} for res in per_rank]}
        check_against_reference({(world, "cos32_none"): data}, fake, world, "cos32_none", sample_rate=rate)
