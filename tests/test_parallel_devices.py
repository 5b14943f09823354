"""shardkit.parallel on real devices (GPU-marked; real multi-GPU tests need >= 2 GPUs) and
with shardkit.ShardedSoftmaxLoss (the balanced million-class recipe of the README)."""

import copy

import pytest
import torch
from torch import nn

import shardkit
from shardkit.parallel import DataParallelCriterion, DataParallelModel, gather
from test_parallel import Lambda, Net, grads, rel


@pytest.mark.parametrize("recipe", ["gather_then_head", "criterion_wraps_head"])
def test_with_sharded_softmax_loss(recipe):
    net = nn.Sequential(nn.Linear(9, 16), nn.Tanh(), nn.Linear(16, 8))
    head = shardkit.ShardedSoftmaxLoss(8, 101, margin=shardkit.ArcFace(16.0, 0.3), devices=["cpu"] * 3,
                                       ignore_index=-1)
    x, y = torch.randn(23, 9), torch.randint(0, 101, (23,))
    y[:6] = -1  # ignored rows, all in the first chunk
    ref_net, ref_head = copy.deepcopy(net), copy.deepcopy(head)
    ref = ref_head(ref_net(x), y)
    ref.backward()
    model = DataParallelModel(net, device_ids=["cpu"] * 3)
    if recipe == "gather_then_head":
        loss = head(gather(model(x), "cpu"), y)
    else:  # the head is shared by the worker threads; weights: rows != ignore_index
        loss = DataParallelCriterion(head, device_ids=["cpu"] * 3)(model(x), y)
    loss.backward()
    assert rel(loss, ref) <= 1e-6
    mine = list(net.parameters()) + list(head.parameters())
    theirs = list(ref_net.parameters()) + list(ref_head.parameters())
    for a, b in zip(mine, theirs):
        assert rel(a.grad, b.grad) <= 1e-6


# ---- real GPUs ----------------------------------------------------------------------

def _need_gpus(n):
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs at least {n} GPUs for real multi-device data parallelism; "
                    f"{torch.cuda.device_count()} visible")


@pytest.mark.gpu
def test_gpu_multi_device_matches_single_device():
    _need_gpus(2)
    k = torch.cuda.device_count()
    net = Net().cuda()
    x, y = torch.randn(4 * k + 1, 7), torch.randint(0, 5, (4 * k + 1,))
    ref_net = copy.deepcopy(net)
    ref = nn.functional.cross_entropy(ref_net(x.cuda()), y.cuda())
    ref.backward()
    model = DataParallelModel(net, device_ids=list(range(k)), gpu0_bsz=1)
    outs = model(x)
    assert [o.device.index for o in outs] == list(range(k))
    loss = DataParallelCriterion(nn.CrossEntropyLoss(), device_ids=list(range(k)))(outs, y)
    assert loss.device == torch.device("cuda", 0)
    loss.backward()
    assert rel(loss, ref) <= 1e-6
    for a, b in zip(grads(net), grads(ref_net)):
        assert rel(a, b) <= 1e-5


@pytest.mark.gpu
def test_gpu_streams_and_autocast_carried():
    _need_gpus(2)
    seen = []

    def probe(out, target):
        seen.append((out.device.index, torch.cuda.current_device(), torch.cuda.current_stream().stream_id,
                     torch.is_autocast_enabled("cuda")))
        return nn.functional.cross_entropy(out, target)

    crit = DataParallelCriterion(Lambda(probe), device_ids=[0, 1])
    outs = DataParallelModel(Net().cuda(), device_ids=[0, 1])(torch.randn(6, 7, device="cuda"))
    side = [torch.cuda.Stream(0), torch.cuda.Stream(1)]
    with torch.cuda.stream(side[0]), torch.cuda.stream(side[1]), torch.autocast("cuda", dtype=torch.float16):
        crit(outs, torch.randint(0, 5, (6,)))
    for dev, cur, stream_id, ac in seen:
        assert dev == cur and stream_id == side[dev].stream_id and ac


@pytest.mark.gpu
def test_gpu_repeated_device_on_one_gpu():
    net = Net().cuda()
    x, y = torch.randn(9, 7, device="cuda"), torch.randint(0, 5, (9,), device="cuda")
    ref = nn.functional.cross_entropy(net(x), y)
    outs = DataParallelModel(net, device_ids=[0, 0, 0])(x)
    loss = DataParallelCriterion(nn.CrossEntropyLoss(), device_ids=[0, 0, 0])(outs, y)
    assert rel(loss, ref) <= 1e-6
