"""A process-group head inside a model that DistributedDataParallel wraps as a whole (gloo, two
spawned CPU processes).

DDP copies rank 0's parameters over the other ranks' when it is built and averages every
gradient it manages: for a head's shard that means other classes' rows and gradients. Unmarked,
the head's forward refuses on every rank; with ``shardkit.distributed.ddp_ignore_heads(model)``
before wrapping, DDP leaves the shards alone and training equals the documented layout (DDP
around the backbone alone, the head outside)."""

import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_teardown import end_rank
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import shardkit
from shardkit.distributed import DistributedInputError, ddp_ignore_heads

D, C, HIDDEN, STEPS = 6, 14, 5, 3  # C even: equal shards, which DDP accepts (unequal ones it refuses itself)


class Net(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(HIDDEN, D, dtype=torch.float64), nn.Tanh())
        self.head = shardkit.ShardedSoftmaxLoss(
            D, C, process_group=group, margin=shardkit.CosFace(s=8.0, m=0.2), dtype=torch.float64
        )

    def forward(self, x, y):
        return self.head(self.backbone(x), y)


def _net(group, data):
    torch.manual_seed(0)  # the same backbone on every rank, as DDP expects
    net = Net(group)
    shardkit.import_full_weight(net.head, data["weight"])
    return net


def _train(rank, net, call, data):
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = data["x"][step][rank], data["y"][step][rank]
        loss = call(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, net.backbone[0].weight.detach().clone(), net.head.full_weight()


def _rank(rank, init_file, tmp, data):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    group = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    out = {}
    try:
        # the documented layout: DDP around the backbone alone
        net = _net(group, data)
        backbone = DistributedDataParallel(net.backbone)
        out["reference"] = _train(rank, net, lambda x, y: net.head(backbone(x), y), data)

        # the whole model wrapped, the shards unmarked: refused on every rank at the first step
        net = _net(group, data)
        shard_before = net.head.weight_shards[0].detach().clone()
        whole = DistributedDataParallel(net)
        out["overwritten"] = not torch.equal(net.head.weight_shards[0], shard_before)
        try:
            whole(data["x"][0][rank], data["y"][0][rank])
            out["unmarked"] = None
        except DistributedInputError as err:
            out["unmarked"] = str(err)
        del whole

        # marked before wrapping: the shards stay this rank's and the steps equal the reference
        net = _net(group, data)
        net.register_buffer("existing", torch.zeros(1))  # a name ignored already is kept
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ["existing"])
        out["names"] = ddp_ignore_heads(net)
        shard_before = net.head.weight_shards[0].detach().clone()
        whole = DistributedDataParallel(net)
        out["kept"] = torch.equal(net.head.weight_shards[0], shard_before)
        out["marked"] = _train(rank, net, whole, data)
        try:
            ddp_ignore_heads(whole)
            out["wrapped"] = None
        except TypeError as err:
            out["wrapped"] = str(err)
        del whole

        # DDP around the compiled model, marked: the check read the running DDP's module while
        # dynamo traced the head (dynamo's own AssertionError on every rank)
        net = _net(group, data)
        compiled = torch.compile(net)
        ddp_ignore_heads(compiled)
        whole = DistributedDataParallel(compiled)
        out["compiled"] = _train(rank, net, whole, data)
        del whole, compiled
    except Exception:
        out["fatal"] = traceback.format_exc()
    finally:
        torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
        end_rank()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    data = {
        "weight": torch.randn(C, D, generator=gen, dtype=torch.float64),
        "x": [[torch.randn(4, HIDDEN, generator=gen, dtype=torch.float64) for _ in range(2)] for _ in range(STEPS)],
        "y": [[torch.randint(0, C, (4,), generator=gen) for _ in range(2)] for _ in range(STEPS)],
    }
    mp.spawn(_rank, args=(str(tmp / "init"), str(tmp), data), nprocs=2, join=True)
    out = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r, res in enumerate(out):
        assert "fatal" not in res, f"rank {r}: {res['fatal']}"
    return out


def test_an_unmarked_head_inside_ddp_is_refused_on_every_rank(ranks):
    assert ranks[1]["overwritten"]  # what DDP did to rank 1's shard, hence the refusal
    for res in ranks:
        msg = res["unmarked"]
        assert msg is not None and "inside a DistributedDataParallel" in msg and "ddp_ignore_heads" in msg, msg
        assert "'head.weight_shards.0'" in msg


def test_a_marked_head_trains_inside_ddp_as_with_the_backbone_alone(ranks):
    for res in ranks:
        assert res["kept"]
        assert res["names"] == ["existing", "head.weight_shards.0"]
        ref_losses, ref_backbone, ref_head = res["reference"]
        losses, backbone, head = res["marked"]
        torch.testing.assert_close(losses, ref_losses, rtol=1e-12, atol=0)
        torch.testing.assert_close(backbone, ref_backbone, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(head, ref_head, rtol=1e-12, atol=1e-14)
        assert "already a DistributedDataParallel" in res["wrapped"]
        losses, backbone, head = res["compiled"]  # DistributedDataParallel(torch.compile(model))
        torch.testing.assert_close(losses, ref_losses, rtol=1e-10, atol=0)
        torch.testing.assert_close(backbone, ref_backbone, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(head, ref_head, rtol=1e-10, atol=1e-12)
    assert ranks[0]["marked"][0] == ranks[1]["marked"][0]  # the global batch's loss on both ranks


def test_ddp_ignore_heads_refuses_a_model_without_a_process_group_head():
    with pytest.raises(ValueError, match="holds no ShardedSoftmaxLoss with a process_group"):
        ddp_ignore_heads(nn.Sequential(nn.Linear(3, 3), shardkit.ShardedSoftmaxLoss(3, 5)))
    with pytest.raises(TypeError, match="argument `model` must be an nn.Module"):
        ddp_ignore_heads([nn.Linear(3, 3)])
