"""ModelEMA and the model's life around it: conversions that swap the model's tensors
(torch.__future__.set_swap_module_params_on_conversion), and the arguments and methods that
shape what an update does (min_decay, updates=, enabled, update_attr, attach with a model)."""

import contextlib
import copy
import gc
import math
import weakref

import pytest
import torch
from torch import nn

import shardkit


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.bn = nn.BatchNorm1d(7)
        self.fc2 = nn.Linear(7, 3)

    def forward(self, x):
        return self.fc2(self.bn(self.fc1(x)))


def perturb(model):
    """A training step's worth of change: every floating tensor moves, BatchNorm counts."""
    model.train()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
        model(torch.randn(6, 5, dtype=next(model.parameters()).dtype))


def ema_by_hand(ref, model, d):
    """The float64 EMA step on a dict of reference tensors (integer buffers copied)."""
    for k, v in model.state_dict().items():
        if v.is_floating_point():
            ref[k] = d * ref[k] + (1 - d) * v.double()
        else:
            ref[k] = v.clone()


def assert_ema_equals(ema, ref, rtol=1e-6, atol=1e-6):
    for k, v in ema.module.state_dict().items():
        if v.is_floating_point():
            torch.testing.assert_close(v.double(), ref[k], rtol=rtol, atol=atol, msg=k)
        else:
            assert torch.equal(v, ref[k]), k


@contextlib.contextmanager
def swap_on_conversion():
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


# ---- conversions that swap tensors ------------------------------------------------------


def test_swap_conversion_of_the_model_after_updates_and_the_ema_follows():
    # The EMA's C++ updater held references to the model's tensors between updates, so
    # torch.utils.swap_tensors (model.double() under swap_module_params_on_conversion) refused
    # with "Couldn't swap Linear.weight".
    net = Net()
    ema = shardkit.ModelEMA(net, decay=0.8, tau=None)
    ref = {k: v.double().clone() for k, v in net.state_dict().items()}
    objects = [id(p) for p in net.parameters()]
    for _ in range(3):
        perturb(net)
        ema.update(net)
        ema_by_hand(ref, net, ema.get_decay(ema.updates))
    with swap_on_conversion():
        net.double()  # raised before the fix
    assert [id(p) for p in net.parameters()] == objects  # the same Python objects, new TensorImpls
    assert all(p.dtype == torch.float64 for p in net.parameters())
    for _ in range(3):
        perturb(net)  # the float64 model's new values must reach the EMA
        ema.update(net)
        ema_by_hand(ref, net, ema.get_decay(ema.updates))
    assert ema.module.fc1.weight.dtype == torch.float32  # the EMA keeps its own dtype
    assert_ema_equals(ema, ref)
    with swap_on_conversion():
        net.float()  # and back, after updates from the float64 tensors
    perturb(net)
    ema.update(net)
    ema_by_hand(ref, net, ema.get_decay(ema.updates))
    assert_ema_equals(ema, ref)


def test_swap_conversion_of_the_ema_module_and_swap_blocks():
    # The EMA's own parameters were held by the C++ updater as well. (Buffers are not swapped by
    # a conversion but replaced, so this model has none: see ModelEMA's `dtype`/`device`.)
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    ema = shardkit.ModelEMA(net, decay=0.5, tau=None)
    ref = {k: v.double().clone() for k, v in net.state_dict().items()}
    for _ in range(2):
        perturb(net)
        ema.update(net)
        ema_by_hand(ref, net, ema.get_decay(ema.updates))
    with ema.swap(net):
        pass
    with swap_on_conversion():
        ema.module.float()
        net.float()
    assert ema.module[0].weight.dtype == torch.float32
    perturb(net)
    ema.update(net)
    ema_by_hand(ref, net, ema.get_decay(ema.updates))
    assert_ema_equals(ema, ref)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with ema.swap(net):
        for k, v in net.state_dict().items():
            torch.testing.assert_close(v.double(), ref[k], rtol=1e-6, atol=1e-6, msg=k)
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("update_while_converted", [False, True])
@pytest.mark.parametrize("conversion", ["half", "double", "bn_only", "pickled"])
def test_the_ema_follows_a_conversion_of_its_own_module(conversion, update_while_converted):
    # ultralytics' validator runs `trainer.ema.ema.half()` (then `.float()`) between epochs: the
    # conversion replaces the EMA module's buffers (BatchNorm's running stats) and changes its
    # parameters' dtype, and the EMA kept averaging into the old buffers (its module's running
    # stats froze at their first values, and state_dict() saved those).
    torch.manual_seed(3)
    net = Net()
    ema = shardkit.ModelEMA(net, decay=0.7, tau=None)
    ref = {k: v.double().clone() for k, v in net.state_dict().items()}

    def step(tol=1e-6):
        perturb(net)
        ema.update(net)
        ema_by_hand(ref, net, ema.get_decay(ema.updates))
        assert_ema_equals(ema, ref, rtol=tol, atol=tol)

    for _ in range(3):
        step()
    dtype = {"half": torch.float16, "double": torch.float64, "bn_only": torch.float64}.get(conversion)
    if conversion == "pickled":
        ema = copy.deepcopy(ema)
        ema.module.half()
        dtype = torch.float16
    elif conversion == "bn_only":
        ema.module.bn.to(dtype)  # a submodule in the middle, holding every buffer
    else:
        ema.module.to(dtype)
    for k, v in ema.module.state_dict().items():
        if v.is_floating_point():
            ref[k] = v.double().clone()  # what the conversion rounded
    if conversion != "bn_only":
        with torch.no_grad():
            ema.module(torch.randn(4, 5, dtype=dtype))  # evaluation in the converted dtype
    if update_while_converted:
        step(tol=2e-2 if dtype == torch.float16 else 1e-6)
    ema.module.float()
    for k, v in ema.module.state_dict().items():
        if v.is_floating_point():
            ref[k] = v.double().clone()
    for _ in range(3):
        step(tol=2e-2 if dtype == torch.float16 and update_while_converted else 1e-6)
    running = ema.state_dict()["module"]["bn.running_mean"]
    torch.testing.assert_close(running.double(), ref["bn.running_mean"], rtol=1e-5, atol=1e-5)


def test_no_reference_to_the_model_outlives_an_update():
    net = Net()
    ema = shardkit.ModelEMA(net, decay=0.9, tau=None)
    counts = [t._use_count() for t in net.state_dict().values()]
    ema.update(net)
    ema.update(net)
    assert [t._use_count() for t in net.state_dict().values()] == counts
    assert [e._use_count() for e in ema.module.state_dict().values()] == [1] * len(counts)
    # once the model is gone, the EMA keeps none of its tensors alive
    gone = weakref.ref(net.fc1.weight)
    del net
    gc.collect()
    assert gone() is None


def test_large_cpu_update_without_the_gil_equals_the_op():
    # Above 2**20 EMA elements on the CPU the update owns its tensors and releases the GIL
    # (csrc/composite/ema_lists.cpp); the result is the op's.
    net = nn.Sequential(nn.Linear(1031, 1024), nn.BatchNorm1d(1024))
    assert sum(p.numel() for p in net.parameters()) > 2**20
    ema = shardkit.ModelEMA(net, decay=0.75, tau=None)
    ref = {k: v.double().clone() for k, v in net.state_dict().items()}
    for _ in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
            net(torch.randn(4, 1031))
        ema.update(net)
        ema_by_hand(ref, net, ema.get_decay(ema.updates))
    assert_ema_equals(ema, ref, rtol=1e-5, atol=1e-5)


# ---- arguments and methods that shape an update -----------------------------------------


@pytest.mark.parametrize("schedule", ["ramp", "warmup"])
def test_min_decay_clamps_the_early_decays(schedule):
    # The ramp starts at decay * (1 - exp(-1 / tau)) = 0.02 and timm's warmup at 1 - 2^(-2/3)
    # = 0.37: min_decay=0.6 must replace both until the schedules pass it.
    net = Net()
    if schedule == "ramp":
        ema = shardkit.ModelEMA(net, 0.999, tau=50, min_decay=0.6)
        raw = [0.999 * (1 - math.exp(-t / 50)) for t in range(1, 81)]
    else:
        ema = shardkit.ModelEMA(net, 0.999, warmup_power=2 / 3, min_decay=0.6)
        raw = [0.0] + [min(1 - (1 + s) ** (-2 / 3), 0.999) for s in range(1, 80)]
    expected = [r if (schedule == "warmup" and t == 1) else max(r, 0.6) for t, r in enumerate(raw, 1)]
    assert sum(r < 0.6 for r in raw[1:]) >= 2 and sum(r > 0.6 for r in raw) >= 2  # it binds, then not
    ref = {k: v.double().clone() for k, v in net.state_dict().items()}
    for d in expected:
        perturb(net)
        ema.update(net)
        ema_by_hand(ref, net, d)
        assert_ema_equals(ema, ref)


def test_initial_updates_continue_the_ramp():
    # ModelEMA(updates=N) resumes the count (ultralytics): the next update uses t = N + 1, so
    # the ramp is nearly at `decay` instead of copying the model.
    net = Net()
    ema = shardkit.ModelEMA(net, 0.9, tau=20, updates=100)
    ref = {k: v.double().clone() for k, v in net.state_dict().items()}
    for t in (101, 102):
        perturb(net)
        ema.update(net)
        ema_by_hand(ref, net, 0.9 * (1 - math.exp(-t / 20)))
        assert_ema_equals(ema, ref)
    assert ema.updates == 102


def test_enabled_false_makes_update_a_no_op_and_is_saved():
    net = Net()
    ema = shardkit.ModelEMA(net, 0.5, tau=None)
    perturb(net)
    ema.update(net)
    frozen = {k: v.clone() for k, v in ema.module.state_dict().items()}
    ema.enabled = False
    for _ in range(2):
        perturb(net)
        ema.update(net)
    assert ema.updates == 1 and ema.state_dict()["calls"] == 1
    for k, v in ema.module.state_dict().items():
        assert torch.equal(v, frozen[k]), k
    state = ema.state_dict()
    other = shardkit.ModelEMA(Net(), 0.5, tau=None)
    other.load_state_dict(state)
    assert other.enabled is False
    ema.enabled = True
    ref = {k: v.double() for k, v in frozen.items()}
    ema.update(net)  # the second applied update: decay 0.5
    ema_by_hand(ref, net, 0.5)
    assert_ema_equals(ema, ref)


def test_attach_with_another_model_updates_from_that_model():
    built_from, trained = Net(), Net()
    opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    ema = shardkit.ModelEMA(built_from, 0.5, tau=None)
    ref = {k: v.double().clone() for k, v in built_from.state_dict().items()}
    handle = ema.attach(opt, model=trained)
    for _ in range(2):
        trained(torch.randn(6, 5)).square().mean().backward()
        opt.step()  # the hook updates the EMA from `trained`, not from `built_from`
        opt.zero_grad()
        ema_by_hand(ref, trained, ema.get_decay(ema.updates))
        assert_ema_equals(ema, ref)
    assert ema.updates == 2
    handle.remove()
    opt2 = torch.optim.SGD([nn.Parameter(torch.randn(2))], lr=0.1)
    ema.attach(opt2, model=Net())  # held weakly: this model is gone at once, and named at the step
    with pytest.raises(RuntimeError, match=r"ModelEMA.attach: no model \(garbage-collected"):
        opt2.step()


def test_update_attr_copies_public_attributes_with_include_and_exclude():
    net = Net()
    ema = shardkit.ModelEMA(net, 0.9)
    net.names = ["a", "b"]
    net.stride = 8
    net.process_group = "pg"  # excluded by default
    net._private = 1  # never copied
    ema.update_attr(net)
    assert ema.module.names == ["a", "b"] and ema.module.stride == 8
    assert not hasattr(ema.module, "process_group") and not hasattr(ema.module, "_private")
    net.train()
    ema.update_attr(net)
    assert ema.module.training is False  # `training` is not an attribute to copy
    net.names, net.stride = ["c"], 16
    ema.update_attr(nn.DataParallel(net), include=("stride",))  # unwrapped; only `stride`
    assert ema.module.stride == 16 and ema.module.names == ["a", "b"]
    ema.update_attr(net, exclude=("stride",))
    assert ema.module.names == ["c"] and ema.module.stride == 16
    assert ema.module.process_group == "pg"  # exclude replaced the default
