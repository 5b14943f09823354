"""A job for tests/test_softmax_multinode.py, launched by torchrun: the distributed head (and a
small backbone under DDP) trained for a few steps on gloo, saved with save_sharded, or loaded
into whatever world size this launch has. Usage:

    torchrun ... tests/softmax_multinode_job.py train DIR STEPS
    torchrun ... tests/softmax_multinode_job.py resume DIR STEPS

Both modes write DIR/<mode>-rank<r>.pt with what the test compares (weights, losses, and the
rank's shards: rows, momentum buffers and their flags)."""

import os
import sys

import torch
import torch.distributed as dist
from dist_teardown import end_rank

import shardkit

C, D, B = 37, 6, 5


def main():
    mode, directory, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same backbone on every rank
    backbone = torch.nn.Linear(8, D).double()
    head = shardkit.ShardedSoftmaxLoss(D, C, process_group=dist.group.WORLD, dtype=torch.float64,
                                       margin=shardkit.ArcFace(s=8.0, m=0.2))  # fmt: skip
    params = list(backbone.parameters()) + list(head.parameters())
    opt = shardkit.SparseRowSGD(params, lr=0.5, momentum=0.9)
    if mode == "resume":
        shardkit.load_sharded(head, os.path.join(directory, "head"), optimizer=opt)
        backbone.load_state_dict(torch.load(os.path.join(directory, "backbone.pt"), weights_only=True))
    ddp = torch.nn.parallel.DistributedDataParallel(backbone)
    losses = []
    g = torch.Generator().manual_seed(1000 + (0 if mode == "train" else 1))
    # one GLOBAL batch, drawn alike on every rank (each rank takes its own rows), seen every step
    x_all = torch.randn(B * 6, 8, generator=g, dtype=torch.float64)
    y_all = torch.randint(0, C, (B * 6,), generator=g)
    for _ in range(steps):
        rows = torch.arange(B * 6).tensor_split(world)[rank]
        loss = head(ddp(x_all[rows]), y_all[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    full = shardkit.export_full_weight(head)
    # this rank's shards as the optimizer holds them: {class offset: (rows, momentum, seen)}
    shards = {
        off: (p.detach().clone(), *(opt.state.get(p, {}).get(k) for k in ("momentum_buffer", "seen")))
        for off, p in zip(head.class_offsets, head.weight_shards)
    }
    if mode == "train":
        shardkit.save_sharded(head, os.path.join(directory, "head"), optimizer=opt)
        if rank == 0:
            torch.save(backbone.state_dict(), os.path.join(directory, "backbone.pt"))
    torch.save({"losses": losses, "full": full, "world": world, "backbone": backbone.state_dict(), "shards": shards},
               os.path.join(directory, f"{mode}-rank{rank}.pt"))  # fmt: skip
    # Tear down together and in order: drop what holds the groups (DDP's reducer, the head's
    # exchange), wait for every rank with a barrier that completes by explicit
    # acknowledgements, then destroy. A rank that exits while a peer's gloo threads still read
    # its sockets aborts that peer ("terminate called without an active exception"), which
    # failed one CI run of this job.
    del ddp, head, opt, params
    end_rank()


if __name__ == "__main__":
    main()
