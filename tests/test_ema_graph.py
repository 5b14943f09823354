"""The CUDA-graph path of ModelEMA: ``shardkit.ops.ema_update_device_decay_`` (the decay read
from a tensor) equals ``ema_update_`` bit for bit, ``shardkit._C.ema_layout`` notices every
change a captured graph could not follow, ``ModelEMA(cuda_graph=True)`` leaves the CPU path as
it was; with a GPU (marker ``gpu``): the op on CUDA, captured and replayed with new decays, and
ModelEMA's captured updates equal the eager ones and follow a changed model."""

import numpy as np
import pytest
import torch
from test_ema import PAIRS, Net, boundary_sizes, train_step

import shardkit
from shardkit.ops import ema_update_, ema_update_device_decay_

gpu = pytest.mark.gpu
SPECIAL = torch.tensor([float("inf"), -float("inf"), float("nan"), 3e38, -3e38, 1.0, 0.0, -2.5])


def same_bits(a, b):
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def check_equals_eager(device, ema_dtype, model_dtype, decays):
    sizes = boundary_sizes()
    ema = [torch.randn(n, device=device).to(ema_dtype) for n in sizes]
    model = [torch.randn(n, device=device).to(model_dtype) for n in sizes]
    ema[0] = SPECIAL.repeat(3).to(device, ema_dtype)  # the ends are exact whatever the values
    model[0] = SPECIAL.flip(0).repeat(3).to(device, model_dtype)
    ref = [e.clone() for e in ema]
    decay = torch.zeros((), dtype=torch.float64, device=device)
    for d in decays:
        decay.fill_(d)
        ema_update_device_decay_(ema, model, decay)
        ema_update_(ref, model, d)
        for e, r in zip(ema, ref):
            assert same_bits(e, r), (d, e.numel())


@pytest.mark.parametrize("ema_dtype,model_dtype", PAIRS)
def test_device_decay_op_equals_ema_update_on_the_cpu(ema_dtype, model_dtype):
    check_equals_eager("cpu", ema_dtype, model_dtype, [0.9, 0.0, 0.3, 1.0, 0.5, 0.9999])


def test_device_decay_op_checks_its_arguments():
    e, m = [torch.randn(3)], [torch.randn(3)]
    with pytest.raises(TypeError, match="argument `decay` must be a one-element float64 tensor, got float"):
        ema_update_device_decay_(e, m, 0.5)
    for bad in (torch.tensor(0.5), torch.zeros(2, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match="argument `decay` must be a one-element float64 tensor"):
            ema_update_device_decay_(e, m, bad)
    for bad in (1.5, -0.1, float("nan")):  # on the CPU the value is read and checked
        with pytest.raises(RuntimeError, match=r"argument `decay` must lie in \[0, 1\]"):
            ema_update_device_decay_(e, m, torch.tensor(bad, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="argument `decay` is on meta but `ema` is on cpu"):
        ema_update_device_decay_(e, m, torch.zeros((), dtype=torch.float64, device="meta"))
    with pytest.raises(RuntimeError, match=r"ema_update_device_decay_: `ema\[0\]` and `model\[0\]` must have"):
        ema_update_device_decay_(e, [torch.randn(4)], torch.zeros((), dtype=torch.float64))
    before = e[0].clone()
    with pytest.raises(RuntimeError, match="ema_update_device_decay_: a leaf Variable that requires grad"):
        ema_update_device_decay_([torch.nn.Parameter(e[0])], m, torch.zeros((), dtype=torch.float64))
    assert torch.equal(e[0], before)
    ema_update_device_decay_([], [], torch.zeros((), dtype=torch.float64))  # no-op


def test_device_decay_op_opcheck():
    decay = torch.tensor(0.25, dtype=torch.float64)
    samples = [
        ([torch.randn(5), torch.randn(3, 4)], [torch.randn(5), torch.randn(3, 4)]),
        ([torch.randn(70000)], [torch.randn(70000).bfloat16()]),
    ]
    for e, m in samples:
        torch.library.opcheck(torch.ops.shardkit.ema_update_device_decay_.default, (e, m, decay))


def test_layout_changes_with_everything_a_graph_bakes_in():
    layout = shardkit._C.ema_layout
    e, m = torch.randn(4, 6), torch.randn(4, 6)
    to, frm = torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long)
    base = layout([[e]], [[m]], [to], [frm])
    assert isinstance(base, bytes) and base == layout([[e]], [[m]], [to], [frm])
    assert base == layout([[e]], [[m.detach()]], [to], [frm])  # another object, the same memory
    others = [
        layout([[e]], [[m.clone()]], [to], [frm]),  # another address
        layout([[e]], [[m.view(6, 4)]], [to], [frm]),  # another shape, same memory
        layout([[e]], [[m]], [frm], [to]),  # the copy's direction
        layout([[e], []], [[m], []], [to], [frm]),  # another grouping
        layout([[e.double()]], [[m]], [to], [frm]),
    ]
    assert all(o != base for o in others) and len(set(others)) == len(others)
    assert layout([[e]], [[m.t().contiguous().t()]], [], []) is None  # not flat-compatible: no graph
    with pytest.raises(TypeError, match="ema_layout takes 4 arguments"):
        layout([[e]], [[m]], [])


def test_cuda_graph_switch_leaves_the_cpu_path_as_it_was():
    net = Net()
    graphed = shardkit.ModelEMA(net, 0.8, tau=3.0, cuda_graph=True)
    plain = shardkit.ModelEMA(net, 0.8, tau=3.0)
    assert graphed._graph is None  # a CPU EMA has no graph state
    for _ in range(3):
        train_step(net)
        graphed.update(net)
        plain.update(net)
    for a, b in zip(graphed.module.state_dict().values(), plain.module.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="argument `cuda_graph` must be a Python bool, got builtins.str"):
        shardkit.ModelEMA(net, cuda_graph="yes")
    with pytest.raises(TypeError, match="argument `cuda_graph` must be a Python bool, got numpy.bool"):
        shardkit.ModelEMA(net, cuda_graph=np.bool_(True))


# ---- with a CUDA GPU ---------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("ema_dtype,model_dtype", PAIRS)
def test_device_decay_op_on_cuda_equals_ema_update(ema_dtype, model_dtype):
    check_equals_eager("cuda", ema_dtype, model_dtype, [0.9, 0.0, 0.3, 1.0, 0.5, 0.9999])


@gpu
def test_device_decay_op_captured_and_replayed_with_new_decays():
    sizes = [1, 4097, 65537, 3 * 65536 + 5] + [7] * 100  # more tensors than one launch takes
    ema = [torch.randn(n, device="cuda") for n in sizes]
    model = [torch.randn(n, device="cuda").bfloat16() for n in sizes]
    ref = [e.clone() for e in ema]
    decay = torch.zeros((), dtype=torch.float64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ema_update_device_decay_(ema, model, decay)
    for d in (0.0, 0.7, 0.99, 1.0, 0.25):  # replays read the decay written before each
        decay.fill_(d)
        graph.replay()
        ema_update_(ref, model, d)
        with torch.no_grad():
            for m in model:
                m.add_(torch.randn_like(m))  # the graph reads the model's current values
    torch.cuda.synchronize()
    for e, r in zip(ema, ref):
        assert same_bits(e, r)


@gpu
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_model_ema_cuda_graph_equals_eager_and_follows_a_changed_model(model_dtype):
    net = Net().cuda().to(model_dtype)
    graphed = shardkit.ModelEMA(net, 0.9, tau=4.0, dtype=torch.float32, cuda_graph=True)
    eager = shardkit.ModelEMA(net, 0.9, tau=4.0, dtype=torch.float32)

    def step_and_compare(expected_captures):
        train_step(net)
        graphed.update(net)
        eager.update(net)
        torch.cuda.synchronize()
        assert graphed._graph.captures == expected_captures
        for (k, a), b in zip(graphed.module.state_dict().items(), eager.module.state_dict().values()):
            assert same_bits(a, b), k

    for _ in range(4):  # captured once, then replayed with the ramp's new decays
        step_and_compare(1)
    net.fc.weight = torch.nn.Parameter(torch.randn_like(net.fc.weight))  # a new tensor object
    step_and_compare(2)
    step_and_compare(2)
    with torch.no_grad():
        net.conv.weight.data = net.conv.weight.data.clone()  # new memory under the same object
    step_and_compare(3)
    with torch.no_grad():  # a pair the graph cannot take (not flat-compatible): eager runs
        net.conv.weight.data = net.conv.weight.data.to(memory_format=torch.channels_last)
    step_and_compare(3)
    step_and_compare(3)
