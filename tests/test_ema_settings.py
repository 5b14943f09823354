"""ModelEMA's settings set after construction take effect at the next update, as timm's ModelEmaV3
reads its attributes at every update: ``copy_float_buffers`` and its timm name ``exclude_buffers``,
``use_warmup``; each is saved by state_dict and restored by load_state_dict. ``enabled`` takes a
bool only (a numpy bool converted), so the state_dict it is saved in loads again."""

import numpy as np
import pytest
import torch
from torch import nn

import shardkit

BUFFERS = ("running_mean", "running_var")


def _net():
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 3))


def _train_step(model):
    model.train()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
        model(torch.randn(8, 5) * 2 + 1)  # the running stats move


def _reference_step(ref, model, d, copy_buffers):
    """timm ModelEmaV3's update in float64: lerp the floating entries, copy the others (and the
    float buffers with exclude_buffers)."""
    for k, v in model.state_dict().items():
        if v.is_floating_point() and not (copy_buffers and k.endswith(BUFFERS)):
            ref[k] = ref[k] + (1 - d) * (v.double() - ref[k])
        else:
            ref[k] = v.double().clone() if v.is_floating_point() else v.clone()


def _assert_close(ema, ref):
    for k, v in ema.module.state_dict().items():
        if v.is_floating_point():
            err = (v.double() - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)
            assert err.item() <= 1e-6, (k, err.item())
        else:
            assert torch.equal(v, ref[k]), k


@pytest.mark.parametrize("name", ["copy_float_buffers", "exclude_buffers"])
def test_copying_float_buffers_set_after_construction_takes_effect_and_back(name):
    model = _net()
    ema = shardkit.ModelEMA(model, decay=0.8, tau=None)
    ref = {k: v.double().clone() for k, v in model.state_dict().items()}
    schedule = [False, False, True, True, False, True]  # the setting at each update
    for n, copy_buffers in enumerate(schedule, start=1):
        setattr(ema, name, copy_buffers)
        assert ema.copy_float_buffers is copy_buffers and ema.exclude_buffers is copy_buffers
        _train_step(model)
        ema.update(model)
        _reference_step(ref, model, ema.get_decay(n), copy_buffers)
        _assert_close(ema, ref)
    assert ema.state_dict()["copy_float_buffers"] is True


def test_a_state_saved_with_copy_float_buffers_set_later_loads_into_a_default_ema():
    model = _net()
    saved = shardkit.ModelEMA(model, decay=0.8, tau=None)
    saved.copy_float_buffers = True
    _train_step(model)
    saved.update(model)
    fresh = shardkit.ModelEMA(model, decay=0.8, tau=None)
    fresh.load_state_dict(saved.state_dict())  # refused before ("was saved with copy_float_buffers=True")
    assert fresh.copy_float_buffers is True and fresh.exclude_buffers is True
    _train_step(model)
    for e in (saved, fresh):
        e.update(model)
    for k, v in saved.module.state_dict().items():
        assert torch.equal(fresh.module.state_dict()[k], v), k


def test_use_warmup_set_after_construction_selects_timm_warmup_and_back():
    model = _net()
    ema = shardkit.ModelEMA(model, decay=0.99, min_decay=0.1, update_after_step=1)  # the ramp (tau=2000)
    assert ema.use_warmup is False
    ema.use_warmup = True
    assert ema.use_warmup is True and ema.tau is None and (ema.warmup_gamma, ema.warmup_power) == (1.0, 2 / 3)
    ref = {k: v.double().clone() for k, v in model.state_dict().items()}
    for step in range(9):
        s = max(0, step - 1 - 1)  # timm ModelEmaV3.get_decay(step), use_warmup=True
        d = 0.0 if s <= 0 else max(min(1 - (1 + s) ** (-2 / 3), 0.99), 0.1)
        assert ema.get_decay(step) == pytest.approx(d, rel=1e-12, abs=1e-15)
        _train_step(model)
        ema.update(model, step=step)
        _reference_step(ref, model, d, False)
        _assert_close(ema, ref)
    state = ema.state_dict()
    assert (state["tau"], state["warmup_gamma"], state["warmup_power"]) == (None, 1.0, 2 / 3)
    ema.use_warmup = False  # timm's constant decay after update_after_step
    assert (ema.tau, ema.warmup_gamma, ema.warmup_power) == (None, None, None)
    assert ema.get_decay(50) == 0.99 and ema.get_decay(2) == 0.0


def test_use_warmup_keeps_a_warmup_already_set():
    ema = shardkit.ModelEMA(_net(), warmup_gamma=2.0, warmup_power=0.75)
    ema.use_warmup = True
    assert (ema.warmup_gamma, ema.warmup_power) == (2.0, 0.75)


@pytest.mark.parametrize(
    "name,value",
    [("copy_float_buffers", "yes"), ("exclude_buffers", 1), ("use_warmup", None), ("use_warmup", np.bool_(True))],
)
def test_settings_of_the_wrong_type_are_refused_naming_them(name, value):
    ema = shardkit.ModelEMA(_net())
    before = ema.state_dict()
    with pytest.raises(TypeError, match=f"argument `{name}` must be a Python bool"):
        setattr(ema, name, value)
    after = ema.state_dict()
    assert {k: v for k, v in after.items() if k != "module"} == {k: v for k, v in before.items() if k != "module"}


@pytest.mark.parametrize("value", [0, 1, "no", None, 0.0])
def test_enabled_must_be_a_bool(value):
    ema = shardkit.ModelEMA(_net())
    with pytest.raises(TypeError, match="argument `enabled` must be a bool"):
        ema.enabled = value
    assert ema.enabled is True


@pytest.mark.parametrize("flag", [False, True])
def test_enabled_takes_a_numpy_bool_and_its_state_loads(flag):
    model = _net()
    ema = shardkit.ModelEMA(model, decay=0.5, tau=None)
    ema.enabled = np.bool_(flag)
    assert ema.enabled is flag
    _train_step(model)
    ema.update(model)
    assert ema.updates == int(flag)
    other = shardkit.ModelEMA(model)
    other.load_state_dict(ema.state_dict())
    assert other.enabled is flag and other.updates == ema.updates
