"""Face-recognition style training across processes: a DDP backbone, a class-sharded
ArcFace head (each rank owns a class range, optional PartialFC sampling) and an EMA of the
backbone for evaluation.

    torchrun --nproc_per_node=2 examples/train_ddp.py                  # GPUs (NCCL) or CPUs (gloo)
    torchrun --nproc_per_node=8 examples/train_ddp.py --classes 1000000 --sample-rate 0.1

Synthetic data: each class has a random prototype image; samples are noisy copies. Every
rank draws its own batch (sizes may differ per rank and step: --uneven).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import shardkit


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--dim", type=int, default=128, help="embedding width")
    p.add_argument("--batch", type=int, default=64, help="per-rank batch")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--sample-rate", type=float, default=1.0, help="PartialFC rate in (0, 1]")
    p.add_argument("--ema-decay", type=float, default=0.9999)
    p.add_argument("--uneven", action="store_true", help="vary the per-rank batch size each step")
    p.add_argument("--checkpoint", default="runs/train_ddp_head", help="directory for the sharded head")
    return p.parse_args()


def backbone(dim):
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, dim))


def main():
    args = parse()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # same backbone init and prototypes on every rank
    prototypes = torch.randn(args.classes, 3, 16, 16)

    model = DDP(backbone(args.dim).to(device), device_ids=[device.index] if use_cuda else None)
    # The head is NOT wrapped in DDP: its shards differ per rank, and it already returns
    # world_size * dL/dX_r as the embedding gradient so DDP's averaging of the backbone is exact.
    head = shardkit.ShardedSoftmaxLoss(
        args.dim,
        args.classes,
        margin=shardkit.ArcFace(s=64.0, m=0.5),
        process_group=dist.group.WORLD,
        devices=[device],
        sample_rate=args.sample_rate,
    )
    ema = shardkit.ModelEMA(model.module, decay=args.ema_decay)
    # SparseRowSGD: with sampling, rows not sampled this step keep weight and momentum.
    opt = shardkit.SparseRowSGD(
        list(model.parameters()) + list(head.parameters()), lr=args.lr, momentum=0.9, weight_decay=5e-4
    )
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own samples
    t0 = time.time()
    for step in range(args.steps):
        batch = (
            args.batch if not args.uneven else int(torch.randint(args.batch // 2, args.batch + 1, (1,), generator=gen))
        )
        labels = torch.randint(0, args.classes, (batch,), generator=gen)
        images = prototypes[labels] + 0.5 * torch.randn(batch, 3, 16, 16, generator=gen)
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        loss = head(model(images), labels)  # the loss of the global batch, on every rank
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ema.update(model.module)
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  {time.time() - t0:.1f}s", flush=True)

    # Evaluate on fresh samples: top-1 over ALL classes (eval() disables sampling); the loss
    # and counts are of the global batch, identical on every rank.
    head.eval()
    labels = torch.randint(0, args.classes, (args.batch,), generator=gen)
    images = (prototypes[labels] + 0.5 * torch.randn(args.batch, 3, 16, 16, generator=gen)).to(device)
    for name, net in (("live", model.module), ("EMA", ema.module)):
        net.eval()
        with torch.no_grad():
            out = head(net(images), labels.to(device), return_details=True, topk=(1,))
        if rank == 0:
            acc = out.correct[1].item() / max(out.num_valid.item(), 1)
            print(f"{name:4s} backbone: loss {out.loss.item():.4f}  top-1 {acc:.3f} on {world} x {args.batch} samples")
    shardkit.save_sharded(head, args.checkpoint, opt)  # reload with any number of ranks: load_sharded
    dist.barrier()  # leave together: a rank still writing must not see its peers' connections close
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
