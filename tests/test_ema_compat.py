"""ModelEMA where timm's ModelEmaV3 or ultralytics' ModelEMA was: their constructor arguments,
``set``, ``get_decay()``, the nn.Module face (``ema(x)``, ``eval()``, buffers, a parent's
state_dict) and a ModelEmaV3 state_dict, each against what those classes do."""

import math

import pytest
import torch
from torch import nn

import shardkit


def _net():
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 3))


def _train_step(model):
    model.train()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        model(torch.randn(8, 5))


def _timm_v3_decay(step, decay, min_decay=0.0, update_after_step=0, use_warmup=False, gamma=1.0, power=2 / 3):
    """timm ModelEmaV3.get_decay, as its source defines it."""
    step = max(0, step - update_after_step - 1)
    if step <= 0:
        return 0.0
    if use_warmup:
        return max(min(1 - (1 + step / gamma) ** -power, decay), min_decay)
    return decay


def _lerp_reference(ref, model, d):
    for k, v in model.state_dict().items():
        ref[k] = ref[k] + (1 - d) * (v.double() - ref[k]) if v.is_floating_point() else v.clone()


@pytest.mark.parametrize("use_warmup", [True, False])
@pytest.mark.parametrize("exclude_buffers", [False, True])
def test_timm_v3_arguments_give_timm_v3_updates(use_warmup, exclude_buffers):
    # timm's train.py: ModelEmaV3(model, decay=..., use_warmup=..., device=None), then
    # update(model, step=num_updates) after each optimizer step.
    torch.manual_seed(0)
    model = _net()
    kw = dict(decay=0.99, use_warmup=use_warmup, device=None, foreach=True, exclude_buffers=exclude_buffers)
    ema = shardkit.ModelEMA(model, min_decay=0.1, update_after_step=2, **kw)
    ref = {k: v.double().clone() for k, v in model.state_dict().items()}
    for step in range(12):
        _train_step(model)
        ema.update(model, step=step)
        d = _timm_v3_decay(step, 0.99, 0.1, 2, use_warmup)
        assert ema.get_decay(step) == pytest.approx(d, rel=1e-12, abs=1e-15)
        for k, v in model.state_dict().items():
            buffer = k.endswith(("running_mean", "running_var"))
            if v.is_floating_point() and not (exclude_buffers and buffer):
                ref[k] = ref[k] + (1 - d) * (v.double() - ref[k])
            else:
                ref[k] = v.double().clone() if v.is_floating_point() else v.clone()
        for k, v in ema.module.state_dict().items():
            torch.testing.assert_close(v.double() if v.is_floating_point() else v, ref[k], rtol=1e-6, atol=1e-6)


def test_timm_argument_checks():
    model = _net()
    for name in ("use_warmup", "exclude_buffers", "foreach"):
        with pytest.raises(TypeError, match=f"argument `{name}` must be a Python bool"):
            shardkit.ModelEMA(model, **{name: 1})
    # timm ignores warmup_gamma / warmup_power without the warmup (configs pass them always)
    ema = shardkit.ModelEMA(model, decay=0.9, use_warmup=False, warmup_gamma=1.0, warmup_power=0.75)
    assert (ema.tau, ema.warmup_gamma, ema.warmup_power) == (None, None, None)
    assert ema.get_decay(3) == 0.9
    ema = shardkit.ModelEMA(model, use_warmup=True, warmup_power=0.75)
    assert (ema.tau, ema.warmup_gamma, ema.warmup_power) == (None, 1.0, 0.75)


def test_ultralytics_positional_arguments_and_ramp():
    # ultralytics: ModelEMA(model, decay=0.9999, tau=2000, updates=0), d = decay * (1 - exp(-updates / tau))
    model = _net()
    ema = shardkit.ModelEMA(model, 0.9, 3.0, 5)
    assert (ema.decay, ema.tau, ema.updates) == (0.9, 3.0, 5)
    ref = {k: v.double().clone() for k, v in model.state_dict().items()}
    for _ in range(3):
        _train_step(model)
        ema.update(model)
        _lerp_reference(ref, model, 0.9 * (1 - math.exp(-ema.updates / 3.0)))
    for k, v in ema.ema.state_dict().items():
        torch.testing.assert_close(v.double() if v.is_floating_point() else v, ref[k], rtol=1e-6, atol=1e-6)


def test_set_copies_the_model_and_get_decay_without_a_step():
    model = _net()
    ema = shardkit.ModelEMA(model, decay=0.9, tau=None)
    for _ in range(3):
        _train_step(model)
        ema.update(model)
    assert ema.get_decay() == ema.get_decay(ema.updates + 1) == 0.9
    _train_step(model)
    ema.set(model)
    assert ema.updates == 3
    for (k, e), m in zip(ema.module.state_dict().items(), model.state_dict().values()):
        assert torch.equal(e, m), k


def test_the_ema_is_a_module_holding_its_average():
    torch.manual_seed(1)
    model = _net()
    ema = shardkit.ModelEMA(model, decay=0.5, tau=None)
    _train_step(model)
    ema.update(model)
    x = torch.randn(4, 5)
    assert isinstance(ema, nn.Module)
    assert torch.equal(ema.eval()(x), ema.module(x))  # timm: validate(model_ema, ...)
    names = [n for n, _ in ema.named_buffers()]  # timm: distribute_bn(model_ema, ...)
    assert names == ["module." + n for n, _ in model.named_buffers()]
    # Held by a parent: the EMA weights in the parent's state_dict, and loaded back.
    parent = nn.Module()
    parent.ema = ema
    state = parent.state_dict()
    assert set(state) == {"ema.module." + k for k in model.state_dict()}
    _train_step(model)
    ema.update(model)
    parent.load_state_dict(state)
    for k, v in ema.module.state_dict().items():
        assert torch.equal(v, state["ema.module." + k]), k
    # ema.to(dtype) converts the average, and updates follow it
    ema.to(torch.float64)
    ref = {k: v.double().clone() for k, v in ema.module.state_dict().items()}
    _train_step(model)
    ema.update(model)
    _lerp_reference(ref, model, 0.5)
    for k, v in ema.module.state_dict().items():
        assert v.dtype == ref[k].dtype, k
        torch.testing.assert_close(v, ref[k], rtol=1e-12, atol=1e-12)


def test_load_a_timm_v3_state_dict_keeps_the_counters():
    model = _net()
    ema = shardkit.ModelEMA(model, decay=0.9, tau=None)
    _train_step(model)
    ema.update(model)
    timm_state = {"module." + k: v.clone() for k, v in model.state_dict().items()}  # ModelEmaV3.state_dict()
    _train_step(model)
    ema.load_state_dict(timm_state)
    assert ema.updates == 1
    for k, v in ema.module.state_dict().items():
        assert torch.equal(v, timm_state["module." + k]), k
    bad = dict(timm_state)
    bad["module.0.weight"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="0.weight"):
        ema.load_state_dict(bad)


def _three_bn():
    return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(5, 5), nn.BatchNorm1d(5))])


@pytest.mark.parametrize("change", ["middle_bn_double", "replace_module", "assign_load"])
def test_the_ema_follows_any_change_of_its_module(change):
    # Converting only a middle BatchNorm (neither the first nor the last buffer's owner),
    # replacing ema.module, or loading with assign=True leaves the EMA's lists on tensors the
    # module no longer holds: the module's running stats froze, silently.
    torch.manual_seed(5)
    model = _three_bn()
    ema = shardkit.ModelEMA(model, decay=0.5, tau=None)
    if change == "middle_bn_double":
        ema.module[3].double()  # the model stays float32: a float64 EMA of that layer
    elif change == "replace_module":
        ema.module = _three_bn().eval()
    else:
        ema.load_state_dict({"module." + k: v.clone() for k, v in ema.module.state_dict().items()}, assign=True)
    ref = {k: v.double().clone() for k, v in ema.module.state_dict().items()}
    for _ in range(3):
        model.train()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            model(torch.randn(8, 5))
        ema.update(model)
        _lerp_reference(ref, model, ema.get_decay(ema.updates))
    for k, v in ema.module.state_dict().items():
        torch.testing.assert_close(v.double() if v.is_floating_point() else v, ref[k], rtol=1e-6, atol=1e-6, msg=k)


def test_load_state_dict_signature_and_an_empty_module():
    model = _net()
    ema = shardkit.ModelEMA(model)
    result = ema.load_state_dict(ema.state_dict())
    assert tuple(result) == ([], [])
    partial = {"module.0.weight": torch.zeros(7, 5)}
    result = ema.load_state_dict(partial, strict=False)
    assert "module.0.bias" in result.missing_keys and torch.equal(ema.module[0].weight, torch.zeros(7, 5))
    empty = shardkit.ModelEMA(nn.ReLU())
    empty.load_state_dict(empty.state_dict(prefix=""))  # {}: a module without tensors
    with pytest.raises(ValueError, match="0.weight"):
        ema.load_state_dict({})
