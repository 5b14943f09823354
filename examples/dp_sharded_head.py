"""Balanced multi-device training with a million-class head: a data-parallel backbone
(shardkit.parallel.DataParallelModel) in front of a class-sharded ArcFace head
(shardkit.ShardedSoftmaxLoss) whose shards live on the same devices.

Per step:
  1. the backbone runs on every device on its chunk of the batch (no gather of activations);
  2. the embeddings [b_k, D] are gathered on device 0: B x D floats (2 KiB per sample at
     D=512), the only per-sample data that travels;
  3. the head sends the embeddings to every shard device, each shard computes its classes'
     softmax statistics chunk by chunk, and only [B] statistics come back: nothing of size
     [B, C] exists anywhere, and every device holds 1/K of the FC weight.

Runs on GPUs (--devices 0 1 2 3) or, to try it anywhere, on repeated CPU "devices"
(--devices cpu cpu cpu, the default without GPUs). --check compares the first step's
loss and gradients with the same model trained on one device.

    python examples/dp_sharded_head.py --check
    python examples/dp_sharded_head.py --devices 0 1 --classes 1000000 --dim 512 --batch 256
"""

import argparse
import copy

import torch
from torch import nn

import shardkit
from shardkit.parallel import DataParallelModel, gather


def make_backbone(d_in: int, dim: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, 256), nn.ReLU(), nn.Linear(256, dim))


def device_of(d: str) -> torch.device:
    return torch.device("cuda", int(d)) if d.isdigit() else torch.device(d)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", nargs="+", default=None, help='GPU indices or "cpu" entries')
    ap.add_argument("--classes", type=int, default=500)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=61, help="odd on purpose: uneven chunks")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--check", action="store_true", help="compare step 1 with single-device training")
    args = ap.parse_args()
    if args.devices is None:
        args.devices = [str(i) for i in range(torch.cuda.device_count())] or ["cpu"] * 3
    devices = [device_of(d) for d in args.devices]
    dev0 = devices[0]
    torch.manual_seed(0)

    # Synthetic identities: each class is a random point in input space, samples are noisy copies.
    d_in = 32
    centers = torch.randn(args.classes, d_in)

    backbone = make_backbone(d_in, args.dim).to(dev0)
    head = shardkit.ShardedSoftmaxLoss(args.dim, args.classes, margin=shardkit.ArcFace(s=32.0, m=0.3), devices=devices)
    if args.check:
        ref_backbone, ref_head = copy.deepcopy(backbone), copy.deepcopy(head).to(dev0)

    model = DataParallelModel(backbone, device_ids=[d.index if d.type == "cuda" else d for d in devices])
    opt = torch.optim.SGD(list(model.parameters()) + list(head.parameters()), lr=args.lr, momentum=0.9)

    for step in range(args.steps):
        labels = torch.randint(0, args.classes, (args.batch,))
        x = centers[labels] + 0.3 * torch.randn(args.batch, d_in)

        outputs = model(x)  # list: one [b_k, D] per device
        if not isinstance(outputs, list):  # a single device returns its output as is
            outputs = [outputs]
        embeddings = gather(outputs, dev0)  # [B, D] on device 0
        loss = head(embeddings, labels.to(dev0))  # shards work on their own devices
        opt.zero_grad()
        loss.backward()

        if args.check and step == 0:
            ref_loss = ref_head(ref_backbone(x.to(dev0)), labels.to(dev0))
            ref_loss.backward()

            def grads(net, hd):
                return [p.grad for p in net.parameters()] + [torch.cat([p.grad.to(dev0) for p in hd.weight_shards])]

            worst = max(
                ((a - b).norm() / b.norm()).item() for a, b in zip(grads(backbone, head), grads(ref_backbone, ref_head))
            )
            print(
                f"check: loss {loss.item():.6f} vs single-device {ref_loss.item():.6f}; "
                f"worst relative gradient difference {worst:.2e}"
            )
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}  chunks {[o.shape[0] for o in outputs]}")


if __name__ == "__main__":
    main()
