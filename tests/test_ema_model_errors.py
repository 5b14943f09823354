"""ModelEMA and models it cannot average: a failed ``update`` names the parameter (its state-dict
name) and the argument ``model``, and leaves the EMA and its counters as they were; a model on
the meta device and a float8 parameter are refused at construction, naming the tensor; float8
buffers are copied (as integer ones), as timm's ModelEmaV3 does with ``exclude_buffers``."""

import pytest
import torch
from torch import nn

import shardkit

FLOAT8 = torch.float8_e4m3fn


def _net():
    return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 5), nn.Linear(5, 3))


def _state(ema):
    return {k: v.detach().clone() for k, v in ema.module.state_dict().items()}


def _assert_unchanged(ema, weights, counters):
    assert (ema.updates, ema._calls) == counters
    for k, v in ema.module.state_dict().items():
        assert torch.equal(v, weights[k]), k


def _move(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))


@pytest.mark.parametrize("update_every", [1, 2])
def test_a_model_reshaped_in_place_is_named_and_the_counters_stay(update_every):
    model = _net()
    ema = shardkit.ModelEMA(model, decay=0.7, tau=None, update_every=update_every)
    for _ in range(update_every):
        ema.update(model)
    weights, counters = _state(ema), (ema.updates, ema._calls)
    old = model[1].weight.data
    model[1].weight.data = torch.randn(7, 6)
    for _ in range(update_every):  # every call that would update raises
        try:
            ema.update(model)
        except ValueError as err:
            assert "argument `model` has 1.weight of shape (7, 6)" in str(err)
            break
    else:
        pytest.fail("no update raised")
    _assert_unchanged(ema, weights, (counters[0], counters[1] + update_every - 1))
    model[1].weight.data = old
    # the schedule goes on from where it was: the next applied update is update 2 (float64 reference)
    ref = {k: v.double() for k, v in weights.items()}
    _move(model)
    for _ in range(update_every):
        ema.update(model)
    assert ema.updates == counters[0] + 1
    d = ema.get_decay(counters[0] + 1)
    for k, v in model.state_dict().items():
        expected = d * ref[k] + (1 - d) * v.double()
        assert ((ema.module.state_dict()[k].double() - expected).norm() / expected.norm()).item() <= 1e-6, k


def test_updating_from_the_ema_own_module_names_it_and_changes_nothing():
    model = _net()
    ema = shardkit.ModelEMA(model, decay=0.7, tau=None)
    ema.update(model)
    weights, counters = _state(ema), (ema.updates, ema._calls)
    for _ in range(3):
        with pytest.raises(RuntimeError, match=r"ModelEMA\.update: argument `model` has 0\.weight in the memory of"):
            ema.update(ema.module)
    _assert_unchanged(ema, weights, counters)


def test_a_parameter_converted_to_float8_in_place_is_named_and_the_counters_stay():
    model = _net()
    ema = shardkit.ModelEMA(model, decay=0.7, tau=None)
    ema.update(model)
    weights, counters = _state(ema), (ema.updates, ema._calls)
    model[1].weight.data = model[1].weight.data.to(FLOAT8)
    with pytest.raises(RuntimeError, match=r"argument `model` has 1\.weight of dtype torch\.float8_e4m3fn"):
        ema.update(model)
    _assert_unchanged(ema, weights, counters)


@pytest.mark.parametrize("sparse", ["parameter", "buffer"])
def test_a_sparse_tensor_is_refused_at_construction_naming_it(sparse):
    # (it failed inside the EMA's watch: "Cannot access data pointer of Tensor that doesn't have storage")
    model = nn.Sequential(nn.Linear(3, 3))
    if sparse == "parameter":
        model.emb = nn.Parameter(torch.eye(3).to_sparse())
    else:
        model.register_buffer("emb", torch.eye(3).to_sparse())
    with pytest.raises(TypeError, match=r"argument `model` has emb of layout torch.sparse_coo, not a dense tensor"):
        shardkit.ModelEMA(model)


@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_model_on_the_meta_device_is_refused_at_construction_naming_the_tensor(device):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match=r"argument `model` has 0\.weight on the meta device"):
        shardkit.ModelEMA(model, device=device)
    model.to_empty(device="cpu")  # materialized: accepted
    for p in model.parameters():
        nn.init.normal_(p)
    ema = shardkit.ModelEMA(model)
    ema.update(model)


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_a_float8_parameter_is_refused_at_construction_naming_it(dtype):
    model = _net()
    model[2].weight.data = model[2].weight.data.to(FLOAT8)
    with pytest.raises(TypeError, match=r"argument `model` has the parameter 2\.weight of dtype torch\.float8_e4m3fn"):
        shardkit.ModelEMA(model, dtype=dtype)


@pytest.mark.parametrize("dtype", [None, torch.float64])
@pytest.mark.parametrize("copy_float_buffers", [False, True])
def test_a_float8_buffer_is_copied_and_swapped(dtype, copy_float_buffers):
    model = _net()
    model[1].register_buffer("scale", torch.randn(6).to(FLOAT8))
    ema = shardkit.ModelEMA(model, decay=0.6, tau=None, dtype=dtype, copy_float_buffers=copy_float_buffers)
    assert ema.module[1].scale.dtype == FLOAT8  # kept: not converted to `dtype`
    ref = {k: v.double() for k, v in model.state_dict().items() if k != "1.scale"}
    for n in range(1, 4):
        _move(model)
        model[1].scale.copy_(torch.randn(6).to(FLOAT8))
        ema.update(model)
        d = ema.get_decay(n)
        for k in ref:
            ref[k] = d * ref[k] + (1 - d) * model.state_dict()[k].double()
        got = ema.module.state_dict()
        assert torch.equal(got["1.scale"].view(torch.uint8), model[1].scale.view(torch.uint8))
        for k, v in ref.items():
            assert ((got[k].double() - v).norm() / v.norm()).item() <= 1e-6, k
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ema_scale = ema.module[1].scale.clone()
    with torch.no_grad():
        model[1].scale.copy_(torch.randn(6).to(FLOAT8))
        before["1.scale"] = model[1].scale.clone()
    with ema.swap(model):
        assert torch.equal(model[1].scale.view(torch.uint8), ema_scale.view(torch.uint8))
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k].view(torch.uint8), v.view(torch.uint8)), k
    fresh = shardkit.ModelEMA(model, dtype=dtype, copy_float_buffers=copy_float_buffers)
    fresh.load_state_dict(ema.state_dict())
    assert torch.equal(fresh.module[1].scale.view(torch.uint8), ema_scale.view(torch.uint8))
