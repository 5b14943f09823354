"""ShardedSoftmaxLoss(process_group=...) with 2 and 4 ranks sharing ONE GPU (GPU-marked).

NCCL refuses two ranks on one device, so the ranks run gloo with CUDA tensors (gloo stages
them through host memory): every shard, embedding, statistic and gradient lives on cuda:0
and the kernels are the CUDA ones, while the collectives are gloo's. The closest a
one-GPU machine comes to the multi-GPU runs users make. Each rank's loss and gradients
must equal the one-process mode's on the same GPU (and the float64 reference): every rank
the global loss, rank r's embedding gradient world_size * dL/dX_r, each shard's gradient
its rows of the one-process gradient.

Not covered here (see the README's distributed section): NCCL itself, transfers between
devices (peer copies, NVLink), several nodes, and the timing of any of them."""

import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_teardown import end_rank
from softmax_dist_scenarios import IGNORE, SCENARIOS, D, check_against_reference, make_data, margins, rel, run_scenario

import shardkit
from shardkit.distributed import class_offsets, split_classes

# fp32 and fp64, margins, smoothing, an empty shard, the replicated layout, sampling
NAMES = ("cos32_none", "arc64_smooth_sum", "combined64_empty_rank", "replicated64", "sampled64")


def _worker(rank, world, init_file, tmp, data):
    torch.cuda.set_device(0)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    out = {}
    try:
        device = torch.device("cuda", 0)
        for name in NAMES:
            out[name] = run_scenario(rank, world, name, data[(world, name)], dist.group.WORLD, device=device)
            out[name]["device"] = str(device)
    except Exception:
        out["fatal"] = traceback.format_exc()
    finally:
        torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
        end_rank()


def _one_process(name, d):
    """The one-process head on cuda:0 over the global batch: loss, grad_x, full grad_w."""
    margin_name, dtype, reduction, eps, _, _, classes, _ = SCENARIOS[name]
    head = shardkit.ShardedSoftmaxLoss(
        D,
        classes,
        margin=margins()[margin_name],
        label_smoothing=eps,
        ignore_index=IGNORE.get(name, -100),
        reduction=reduction,
        dtype=dtype,
        devices=["cuda:0"],
    )
    shardkit.import_full_weight(head, d["w"].to(dtype))
    x = d["x"].to("cuda", dtype).requires_grad_()
    loss = head(x, d["labels"].cuda())
    loss.backward(d["grad_out"].to("cuda", loss.dtype) if reduction == "none" else None)
    return loss.detach().cpu(), x.grad.cpu(), head.weight_shards[0].grad.cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_sharing_one_gpu_equal_the_one_process_mode(tmp_path, world):
    seed = int(os.environ.get("SHARDKIT_TEST_DATA_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"data seed {seed} (replay: SHARDKIT_TEST_DATA_SEED={seed})")
    data = make_data(seed)
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), str(tmp_path), data), nprocs=world, join=True)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(per_rank):
        assert "fatal" not in res, f"rank {r}: {res['fatal']}"
        assert all(res[name]["device"] == "cuda:0" for name in NAMES)
    results = {world: per_rank}
    for name in NAMES:
        check_against_reference(data, results, world, name)  # float64 reference, incl. the sampled rows
    for name in NAMES:
        if SCENARIOS[name][5] < 1.0:
            continue  # sampled: random classes per rank; checked against the reference above
        d = data[(world, name)]
        dtype, layout = SCENARIOS[name][1], SCENARIOS[name][4]
        tol = 1e-12 if dtype == torch.float64 else 1e-6
        loss, grad_x, grad_w = _one_process(name, d)
        offsets, sizes = (
            class_offsets(split_classes(SCENARIOS[name][6], world)),
            split_classes(SCENARIOS[name][6], world),
        )
        start = 0
        for r, res in enumerate(per_rank):
            out = res[name]
            assert rel(out["loss"], loss) <= tol, (name, r, "loss")
            if layout == "replicated":
                assert rel(out["grad_x"], grad_x) <= tol, (name, r, "grad_x")
            else:
                rows = d["sizes"][r]
                if rows:
                    assert rel(out["grad_x"], world * grad_x[start : start + rows]) <= tol, (name, r, "grad_x")
                start += rows
            if sizes[r]:
                assert rel(out["grad_w"], grad_w[offsets[r] : offsets[r] + sizes[r]]) <= tol, (name, r, "grad_w")
