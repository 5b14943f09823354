"""ShardedSoftmaxLoss(process_group=...) on NCCL, one spawned process per GPU (GPU-marked;
one GPU is enough: world size 1). Scenarios and the reference check: softmax_dist_scenarios.py.
Each test is one spawned job whose workers save their results; the assertions run here."""

import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from softmax_dist_scenarios import check_against_reference, make_data, rel, run_scenario
from softmax_reference import margin_kwargs, margin_psi, reference_loss_and_grads

import shardkit
from shardkit.distributed import DistributedInputError, sampled_class_counts


def _nccl_worker(rank, world, init_file, tmp, data):
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    out = {}
    try:
        for rate in (1.0, 0.5):
            out[rate] = run_scenario(
                rank, world, "cos32_none", data, dist.group.WORLD, device=torch.device("cuda", rank), sample_rate=rate
            )
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


def _heads_compared(x, w, labels, margin, autocast):
    """Loss, lse, top-k and gradients of the one-process head on cuda:0 and of the world-size-1
    head built WITHOUT `devices` (it must find the GPU by itself); with ``autocast`` also torch's
    own bf16 computation of the loss ("torch": fp32 normalization, the GEMM in bf16)."""
    dim = x.shape[1]
    heads = {
        "one": shardkit.ShardedSoftmaxLoss(dim, w.shape[0], margin=margin, devices=["cuda:0"]),
        "ws1": shardkit.ShardedSoftmaxLoss(dim, w.shape[0], margin=margin, process_group=dist.group.WORLD),
    }
    res = {}
    for key, head in heads.items():
        shardkit.import_full_weight(head, w)
        xr = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            d = head(xr, labels, return_details=True, topk=(1, 3))
        d.loss.backward()
        res[key] = dict(
            device=str(head.weight_shards[0].device),
            loss=d.loss.detach().cpu(),
            lse=d.lse.detach().cpu(),
            grad_x=xr.grad.cpu(),
            grad_w=head.weight_shards[0].grad.cpu(),
            correct={k: int(v) for k, v in d.correct.items()},
        )
    if autocast:
        xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            cos = F.linear(F.normalize(xt, dim=1), F.normalize(wt, dim=1)).float()
        zt = cos.gather(1, labels[:, None])
        z = margin.scale * cos.scatter(1, labels[:, None], margin_psi(zt, margin.m1, margin.m2, margin.m3))
        loss = F.cross_entropy(z, labels)
        gx, gw = torch.autograd.grad(loss, (xt, wt))
        res["torch"] = dict(loss=loss.detach().cpu(), grad_x=gx.cpu(), grad_w=gw.cpu())
    return res, heads["ws1"]


def _world_one_worker(rank, init_file, tmp, data):
    torch.cuda.set_device(0)
    # No backend: torch picks NCCL for the GPU (the group's backend name is "undefined").
    dist.init_process_group(init_method=f"file://{init_file}", rank=rank, world_size=1, timeout=timedelta(seconds=120))
    out = {}
    try:
        x, w, labels = data["x"].cuda(), data["w"].cuda(), data["labels"].cuda()
        out["fp32"], head = _heads_compared(x, w, labels, None, False)
        out["arc_bf16_autocast"], _ = _heads_compared(x, w, labels, shardkit.ArcFace(16.0, 0.5), True)
        try:  # embeddings on the CPU: DistributedInputError before any collective
            head(x.cpu(), labels.cpu())
            out["cpu_input"] = None
        except DistributedInputError as err:
            out["cpu_input"] = str(err)
        sampled = shardkit.ShardedSoftmaxLoss(x.shape[1], w.shape[0], process_group=dist.group.WORLD, sample_rate=0.3)
        out["sampled_rows"] = []
        for _ in range(2):  # seeded by a generator on the shard's GPU: reproducible
            sampled.sample_generator = torch.Generator(device="cuda").manual_seed(1234)
            sampled.zero_grad(set_to_none=True)
            sampled(x, labels).backward()
            out["sampled_rows"].append(sampled.weight_shards[0].grad.coalesce().indices()[0].cpu())
        sampled.sample_generator = torch.Generator()  # a CPU generator for a CUDA shard
        try:
            sampled(x, labels)
            out["cpu_generator"] = None
        except RuntimeError as err:
            out["cpu_generator"] = str(err)
    except Exception:
        out["fatal"] = traceback.format_exc()
    finally:
        torch.save(out, os.path.join(tmp, "ws1.pt"))
        dist.destroy_process_group()


@pytest.mark.gpu
def test_nccl_world_size_one_equals_one_process(tmp_path):
    """One NCCL rank (what a one-GPU machine runs), the group made by init_process_group()
    without a backend: the shard lands on the GPU by itself; loss, lse, top-k counts and
    gradients equal the one-process mode's on the same GPU (fp32, and ArcFace under bf16
    autocast); CPU embeddings raise DistributedInputError; sampling seeded by a CUDA
    generator is reproducible and a CPU generator is refused with a clear message."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    # D = 128: under bf16 autocast a GPU of compute capability 9.0 runs the fused kernels.
    classes, batch, dim = 53, 19, 128
    data = dict(
        x=torch.randn(batch, dim, generator=gen),
        w=torch.randn(classes, dim, generator=gen) * 0.5,
        labels=torch.randint(0, classes, (batch,), generator=gen),
    )
    mp.spawn(_world_one_worker, args=(str(tmp_path / "init"), str(tmp_path), data), nprocs=1, join=True)
    out = torch.load(tmp_path / "ws1.pt", weights_only=False)
    assert "fatal" not in out, out["fatal"]
    for name, tol in (("fp32", 1e-6), ("arc_bf16_autocast", 1e-5)):
        one, ws1 = out[name]["one"], out[name]["ws1"]
        assert ws1["device"] == one["device"] == "cuda:0"
        for key in ("loss", "lse", "grad_x", "grad_w"):
            assert rel(ws1[key], one[key]) <= tol, (name, key)
        assert ws1["correct"] == one["correct"]
    # Both against the float64 loss of the embeddings autocast rounds to bf16 and the fp32 weights,
    # within 2x the error of torch's own bf16 computation.
    arc = shardkit.ArcFace(16.0, 0.5)
    ref = reference_loss_and_grads(data["x"].bfloat16(), data["w"], data["labels"], **margin_kwargs(arc))
    own = out["arc_bf16_autocast"]["torch"]
    for key, exact in (("loss", ref.loss), ("grad_x", ref.grad_x), ("grad_w", ref.grad_w)):
        for head in ("one", "ws1"):
            ours = out["arc_bf16_autocast"][head][key]
            assert rel(ours, exact) <= 2 * rel(own[key], exact) + 1e-6, (
                head,
                key,
                rel(ours, exact),
                rel(own[key], exact),
            )
    assert "argument `embeddings` is on cpu but this rank's weight shard is on cuda:0" in out["cpu_input"]
    rows = out["sampled_rows"]
    assert torch.equal(rows[0], rows[1]) and rows[0].numel() == sampled_class_counts([classes], 0.3, batch)[0]
    assert "argument `generator` must be a generator of the labels' device cuda:0" in out["cpu_generator"]
