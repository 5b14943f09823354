"""shardkit.parallel on real devices (GPU-marked; real multi-GPU tests need >= 2 GPUs) and
with shardkit.ShardedSoftmaxLoss (the balanced million-class recipe of the README)."""

import copy
import threading

import pytest
import torch
from test_parallel import Lambda, Net, grads, rel
from torch import nn

import shardkit
from shardkit.parallel import DataParallelCriterion, DataParallelModel, WeightedLoss, gather, replication_order
from shardkit.parallel.replicate import replicate_module


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])  # cuda: [0, 0, 0]
@pytest.mark.parametrize("recipe", ["gather_then_head", "criterion_wraps_head"])
def test_with_sharded_softmax_loss(recipe, dev):
    ids = ["cpu"] * 3 if dev == "cpu" else [0, 0, 0]
    net = nn.Sequential(nn.Linear(9, 16), nn.Tanh(), nn.Linear(16, 8)).to(dev)
    head = shardkit.ShardedSoftmaxLoss(8, 101, margin=shardkit.ArcFace(16.0, 0.3), devices=[dev] * 3, ignore_index=-1)
    x, y = torch.randn(23, 9, device=dev), torch.randint(0, 101, (23,), device=dev)
    y[:6] = -1  # ignored rows, all in the first chunk
    ref_net, ref_head = copy.deepcopy(net), copy.deepcopy(head)
    ref = ref_head(ref_net(x), y)
    ref.backward()
    model = DataParallelModel(net, device_ids=ids)
    if recipe == "gather_then_head":
        loss = head(gather(model(x), dev), y)
    else:  # the head is shared by the worker threads; weights: rows != ignore_index
        loss = DataParallelCriterion(head, device_ids=ids)(model(x), y)
    loss.backward()
    assert rel(loss, ref) <= 1e-6
    mine = list(net.parameters()) + list(head.parameters())
    theirs = list(ref_net.parameters()) + list(ref_head.parameters())
    for a, b in zip(mine, theirs):  # CUDA: GEMMs of other shapes sum in another order
        assert rel(a.grad, b.grad) <= (1e-6 if dev == "cpu" else 1e-5)


def test_replication_order_puts_the_module_device_first():
    # torch's replicate() broadcasts from its first device, which must hold the module
    assert replication_order(0, [0, 1, 2]) == [0, 1, 2]
    assert replication_order(0, [1, 2]) == [0, 1, 2]  # gpu0_bsz=0: device 0 left out
    assert replication_order(1, [0, 1]) == [1, 0]  # a criterion whose state is on GPU 1
    with pytest.raises(ValueError, match=r"must all be on one CUDA device .* found them on \['cpu'\]"):
        replicate_module(nn.CrossEntropyLoss(weight=torch.rand(5)), [0, 1], "DataParallelCriterion")


# ---- real GPUs ----------------------------------------------------------------------


def _need_gpus(n):
    if torch.cuda.device_count() < n:
        pytest.skip(
            f"needs at least {n} GPUs for real multi-device data parallelism; {torch.cuda.device_count()} visible"
        )


@pytest.mark.parametrize("output_device", ["cpu", torch.device("cpu")])
def test_explicit_output_device_leaves_outputs_on_their_devices(output_device):
    # DataParallelModel keeps output_device for API compatibility only (nothing is gathered);
    # DataParallelCriterion returns the reduced loss there. Other devices: the GPU twin below.
    net = Net()
    ref_net = copy.deepcopy(net)
    model = DataParallelModel(net, device_ids=["cpu"] * 3, output_device=output_device)
    crit = DataParallelCriterion(nn.CrossEntropyLoss(), device_ids=["cpu"] * 3, output_device=output_device)
    assert model.output_device == crit.output_device == torch.device("cpu")
    x, y = torch.randn(8, 7), torch.randint(0, 5, (8,))
    outs = model(x)
    assert isinstance(outs, list) and [o.shape for o in outs] == [(3, 5), (3, 5), (2, 5)]
    loss = crit(outs, y)
    ref = nn.functional.cross_entropy(ref_net(x), y)
    assert loss.device == torch.device("cpu") and rel(loss, ref) <= 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("output_device", [1, "cuda:1", torch.device("cuda", 1)])
def test_gpu_output_device_other_than_device_0(output_device):
    _need_gpus(2)
    net = Net().cuda()
    ref_net = copy.deepcopy(net)
    x, y = torch.randn(9, 7, device="cuda"), torch.randint(0, 5, (9,), device="cuda")
    model = DataParallelModel(net, device_ids=[0, 1], output_device=output_device)
    crit = DataParallelCriterion(nn.CrossEntropyLoss(), device_ids=[0, 1], output_device=output_device)
    assert model.output_device == crit.output_device == 1
    outs = model(x)
    assert [o.device.index for o in outs] == [0, 1]  # not gathered onto the output device
    loss = crit(outs, y)
    assert loss.device == torch.device("cuda", 1)
    loss.backward()
    ref = nn.functional.cross_entropy(ref_net(x), y)
    ref.backward()
    assert rel(loss.cpu(), ref.cpu()) <= 1e-6
    for a, b in zip(grads(net), grads(ref_net)):
        assert rel(a, b) <= 1e-5


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
        seen.append(
            (
                out.device.index,
                torch.cuda.current_device(),
                torch.cuda.current_stream().stream_id,
                torch.is_autocast_enabled("cuda"),
                [torch.cuda.current_stream(d).stream_id for d in (0, 1)],
            )
        )
        return nn.functional.cross_entropy(out, target)

    crit = DataParallelCriterion(Lambda(probe), device_ids=[0, 1])
    outs = DataParallelModel(Net().cuda(), device_ids=[0, 1])(torch.randn(6, 7, device="cuda"))
    side = [torch.cuda.Stream(0), torch.cuda.Stream(1)]
    for d, s in enumerate(side):
        s.wait_stream(torch.cuda.current_stream(d))  # the outputs were made on the default streams
    with torch.cuda.stream(side[0]), torch.cuda.stream(side[1]), torch.autocast("cuda", dtype=torch.float16):
        crit(outs, torch.randint(0, 5, (6,)))
    for dev, cur, stream_id, ac, every in seen:
        assert dev == cur and stream_id == side[dev].stream_id and ac
        assert every == [s.stream_id for s in side]  # the caller's stream on the other device too


@pytest.mark.gpu
def test_gpu_repeated_device_on_one_gpu():
    net = Net().cuda()
    x, y = torch.randn(9, 7, device="cuda"), torch.randint(0, 5, (9,), device="cuda")
    ref = nn.functional.cross_entropy(net(x), y)
    outs = DataParallelModel(net, device_ids=[0, 0, 0])(x)
    loss = DataParallelCriterion(nn.CrossEntropyLoss(), device_ids=[0, 0, 0])(outs, y)
    assert rel(loss, ref) <= 1e-6


@pytest.mark.gpu
def test_gpu_default_device_ids_use_every_gpu():
    """device_ids=None with GPUs: every visible GPU, as encoding.parallel; with ONE GPU both
    classes call their module directly (the output is not wrapped in a list)."""
    n = torch.cuda.device_count()
    net = Net().cuda()
    ref_net = copy.deepcopy(net)
    x, y = torch.randn(2 * n + 3, 7), torch.randint(0, 5, (2 * n + 3,))
    model, crit = DataParallelModel(net), DataParallelCriterion(nn.CrossEntropyLoss(ignore_index=1))
    assert model.device_ids == crit.device_ids == list(range(n))
    outs = model(x)
    if n == 1:
        assert isinstance(outs, torch.Tensor) and outs.device == torch.device("cuda", 0)
    else:
        assert isinstance(outs, list) and [o.device.index for o in outs] == list(range(n))
    loss = crit(outs, y)
    loss.backward()
    ref = nn.functional.cross_entropy(ref_net(x.cuda()), y.cuda(), ignore_index=1)
    ref.backward()
    assert loss.device == torch.device("cuda", 0)
    assert rel(loss, ref) <= 1e-6
    for a, b in zip(grads(net), grads(ref_net)):
        assert rel(a, b) <= 1e-5


@pytest.mark.gpu
def test_gpu_one_gpu_threads_carry_stream_and_autocast():
    """Repeated device [0, 0, 0] on ONE GPU (split op, worker threads, reduction op on CUDA):
    model and criterion run under the caller's side stream and bf16 autocast, and the loss
    and gradients are within 2x of the single-device bf16 error (class weights, ignored
    rows, uneven chunks)."""
    net = Net().cuda()
    ref_net, ref32_net = copy.deepcopy(net), copy.deepcopy(net)
    weight = torch.rand(5, device="cuda") + 0.5
    x, y = torch.randn(11, 7, device="cuda"), torch.randint(0, 5, (11,), device="cuda")
    y[:2] = -1
    seen = []

    def probe(out, target):
        seen.append(
            (
                threading.get_ident(),
                torch.cuda.current_stream().stream_id,
                torch.is_autocast_enabled("cuda"),
                torch.get_autocast_dtype("cuda"),
            )
        )
        loss = nn.functional.cross_entropy(out, target, weight=weight, ignore_index=-1)
        return WeightedLoss(loss, (weight[target.clamp_min(0)] * (target != -1)).sum())

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs = DataParallelModel(net, device_ids=[0, 0, 0], chunk_sizes=[2, 4, 5])(x)
            loss = DataParallelCriterion(Lambda(probe), device_ids=[0, 0, 0])(outs, y)
        loss.backward()
    torch.cuda.synchronize()
    assert [o.dtype for o in outs] == [torch.bfloat16] * 3  # the model ran under autocast in every thread
    assert len({t for t, *_ in seen}) == 3
    assert all(s == side.stream_id and ac and dt == torch.bfloat16 for _, s, ac, dt in seen)
    ce = nn.functional.cross_entropy
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = ce(ref_net(x), y, weight=weight, ignore_index=-1)
    ref.backward()
    ref32 = ce(ref32_net(x), y, weight=weight, ignore_index=-1)
    ref32.backward()
    assert rel(loss, ref32) <= 2 * rel(ref, ref32) + 1e-3
    for a, b, c in zip(grads(net), grads(ref_net), grads(ref32_net)):
        assert rel(a, c) <= 2 * rel(b, c) + 1e-3


@pytest.mark.gpu
def test_gpu_split_leaving_device_0_out():
    """chunk_sizes with a 0 for GPU 0 (as gpu0_bsz=0): the model and a criterion with a class
    weight on GPU 0 are replicated onto the other GPUs only; loss and gradients equal one
    device. A criterion whose state is on the CPU gets a clear error."""
    _need_gpus(2)
    k = torch.cuda.device_count()
    net = Net().cuda()
    ref_net = copy.deepcopy(net)
    crit = nn.CrossEntropyLoss(weight=torch.rand(5) + 0.5, ignore_index=-1).cuda()
    x, y = torch.randn(3 * k + 1, 7), torch.randint(0, 5, (3 * k + 1,))
    y[0] = -1
    outs = DataParallelModel(net, device_ids=list(range(k)), chunk_sizes=[0] + [1] * (k - 1))(x)
    assert [o.device.index for o in outs] == list(range(1, k))
    loss = DataParallelCriterion(crit, device_ids=list(range(k)))(outs, y)
    loss.backward()
    ref = nn.functional.cross_entropy(ref_net(x.cuda()), y.cuda(), weight=crit.weight, ignore_index=-1)
    ref.backward()
    assert loss.device == torch.device("cuda", 0) and rel(loss, ref) <= 1e-6
    for a, b in zip(grads(net), grads(ref_net)):
        assert rel(a, b) <= 1e-5
    outs = DataParallelModel(Net().cuda(), device_ids=[0, 1])(x)
    with pytest.raises(ValueError, match="DataParallelCriterion: the module's parameters and buffers must all be"):
        DataParallelCriterion(nn.CrossEntropyLoss(weight=torch.rand(5)), device_ids=[0, 1])(outs, y)
