"""ModelEMA on models that real client code builds: non-persistent cache buffers (rotary
tables) are left alone as timm's ModelEmaV3 leaves them, lazy modules and inference mode at
construction, expanded buffers under swap, and the rounding settings carried by a checkpoint."""

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import shardkit
from shardkit.ema import structure


class Rotary(nn.Module):
    """A layer with a rotary-style cache, rebuilt larger when a longer input arrives."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))  # persistent: averaged
        self.register_buffer("cos_cached", torch.zeros(3, 4), persistent=False)

    def forward(self, x):
        if x.shape[0] > self.cos_cached.shape[0]:
            self.cos_cached = torch.cos(torch.arange(x.shape[0] * 4.0)).view(-1, 4)
        return self.proj(x) * self.scale + self.cos_cached[: x.shape[0]]


def test_non_persistent_buffers_are_neither_averaged_nor_checked():
    torch.manual_seed(0)
    model = Rotary()
    ema = shardkit.ModelEMA(model, decay=0.5, tau=None)
    ema.update(model)  # the first update copies (timm's rule)
    assert "cos_cached" not in ema._names and "scale" in ema._names
    model(torch.randn(7, 4))  # the cache grows: an update must not call the model changed
    with torch.no_grad():
        model.proj.weight.add_(1.0)
        model.scale.mul_(3.0)
    before = ema.module.proj.weight.clone()
    ema.update(model)
    torch.testing.assert_close(ema.module.proj.weight, 0.5 * before + 0.5 * model.proj.weight)
    torch.testing.assert_close(ema.module.scale, torch.full((4,), 2.0))
    assert ema.module.cos_cached.shape == (3, 4) and not ema.module.cos_cached.any()  # its own, untouched
    averaged = ema.module.proj.weight.clone()
    with ema.swap(model):  # the cache of another size is not exchanged
        assert torch.equal(model.proj.weight, averaged)
        assert model.cos_cached.shape == (7, 4)
    assert ema.module(torch.randn(5, 4)).shape == (5, 4)  # the EMA module rebuilds its own cache


def test_a_pickle_that_averaged_non_persistent_buffers_still_updates(monkeypatch):
    # an EMA pickled when _slots listed non-persistent buffers too
    model = Rotary()

    def old_slots(root):
        out, seen = [], set()
        for prefix, mod in root.named_modules():
            for is_param, table in ((True, mod._parameters), (False, mod._buffers)):
                for key, t in table.items():
                    if t is not None and id(t) not in seen:
                        seen.add(id(t))
                        out.append((f"{prefix}.{key}" if prefix else key, table, key, is_param))
        return out

    with monkeypatch.context() as m:
        for where in (structure, shardkit.ema.sharded, shardkit.ema.watch):
            m.setattr(where, "_slots", old_slots)
        old = shardkit.ModelEMA(model, decay=0.5, tau=None)
        old.update(model)
        assert "cos_cached" in old._names
        blob = pickle.dumps(old)
    ema = pickle.loads(blob)
    assert "cos_cached" not in ema._names
    model(torch.randn(6, 4))
    with torch.no_grad():
        model.proj.weight.add_(1.0)
    before = ema.module.proj.weight.clone()
    ema.update(model)
    torch.testing.assert_close(ema.module.proj.weight, 0.5 * before + 0.5 * model.proj.weight)


def test_a_lazy_module_is_refused_until_initialized():
    model = nn.Sequential(nn.Linear(3, 5), nn.LazyLinear(4))
    with pytest.raises(ValueError, match=r"ModelEMA: argument `model` has 1\.weight not yet initialized"):
        shardkit.ModelEMA(model)
    model(torch.randn(2, 3))
    ema = shardkit.ModelEMA(model, decay=0.0, tau=None)
    ema.update(model)
    assert torch.equal(ema.module[1].weight, model[1].weight)


def test_built_under_inference_mode_the_ema_still_updates():
    model = nn.Linear(4, 4)
    with torch.inference_mode():
        ema = shardkit.ModelEMA(model, decay=0.5, tau=None)
    assert not ema.module.weight.is_inference()
    ema.update(model)
    with torch.no_grad():
        model.weight.add_(2.0)
    before = ema.module.weight.clone()
    ema.update(model)
    torch.testing.assert_close(ema.module.weight, 0.5 * before + 0.5 * model.weight)


def test_swap_names_an_expanded_buffer_and_changes_nothing():
    model = nn.Linear(4, 4)
    model.register_buffer("pos", torch.ones(1).expand(4))
    ema = shardkit.ModelEMA(model, decay=0.5, tau=None)
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    averaged = {k: v.clone() for k, v in ema.module.state_dict().items()}
    with pytest.raises(ValueError, match=r"ModelEMA\.swap: argument `model` has pos as a view whose elements"):
        with ema.swap(model):
            pass
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(averaged[k], v) for k, v in ema.module.state_dict().items())
    ema.update(model)  # still usable


@pytest.mark.parametrize("rounding", [{"stochastic_rounding": False}, {"stochastic_rounding_seed": 7}])
def test_the_rounding_settings_resume_from_a_state_dict(rounding):
    torch.manual_seed(1)
    model = nn.Linear(16, 16).bfloat16()
    ema = shardkit.ModelEMA(model, decay=0.999, tau=None, **rounding)
    for _ in range(3):
        with torch.no_grad():
            model.weight.add_(torch.randn_like(model.weight) * 1e-3)
        ema.update(model)
    buf = io.BytesIO()
    torch.save(ema.state_dict(), buf)
    buf.seek(0)
    resumed = shardkit.ModelEMA(model)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert (resumed.stochastic_rounding, resumed.stochastic_rounding_seed) == (
        ema.stochastic_rounding,
        ema.stochastic_rounding_seed,
    )
    for _ in range(3):
        with torch.no_grad():
            model.weight.add_(torch.randn_like(model.weight) * 1e-3)
        ema.update(model)
        resumed.update(model)
    assert torch.equal(resumed.module.weight, ema.module.weight)


def test_a_state_without_rounding_settings_keeps_the_emas_own_and_bad_ones_are_named():
    model = nn.Linear(4, 4)
    ema = shardkit.ModelEMA(model, stochastic_rounding=False, stochastic_rounding_seed=3)
    state = ema.state_dict()
    older = {k: v for k, v in state.items() if not k.startswith("stochastic_rounding")}
    other = shardkit.ModelEMA(model, stochastic_rounding_seed=9)
    other.load_state_dict(copy.deepcopy(older))
    assert (other.stochastic_rounding, other.stochastic_rounding_seed) == (True, 9)
    for key, bad in (("stochastic_rounding", 1), ("stochastic_rounding_seed", -1), ("stochastic_rounding_seed", True)):
        with pytest.raises(ValueError, match=f"corrupt '{key}'"):
            other.load_state_dict(dict(state, **{key: bad}))
        assert (other.stochastic_rounding, other.stochastic_rounding_seed) == (True, 9)


def test_non_persistent_buffers_take_the_emas_dtype():
    # not averaged, but converted with the rest: a bf16 model's cache used in a matmul with
    # float32 EMA weights must be float32 too
    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("mix", torch.eye(4), persistent=False)

        def forward(self, x):
            return self.lin(x) @ self.mix

    model = Mixer().bfloat16()
    ema = shardkit.ModelEMA(model, dtype=torch.float32)
    assert ema.module.mix.dtype == torch.float32 and ema.module.lin.weight.dtype == torch.float32
    assert ema.module(torch.randn(2, 4)).dtype == torch.float32
