"""ModelEMA inside ``with ema.swap(model):`` (where the EMA's tensors hold the model's weights):
load_state_dict and ema(x) are refused, leaving the model and the EMA as they were; and the
constructor's ``dtype``, refused unless the fused update averages it."""

import pytest
import torch
from torch import nn

import shardkit


def make_pair(model_dtype=torch.float32, ema_dtype=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)).to(model_dtype)
    ema = shardkit.ModelEMA(model, 0.5, tau=None, dtype=ema_dtype)
    for _ in range(3):  # the EMA and the model differ from here on
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model)
    return model, ema


def snapshot(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def assert_same(module, before):
    after = module.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k


def checkpoint_of(ema):
    """A full ModelEMA state, its weights moved (so loading it changes something)."""
    state = ema.state_dict()
    state["module"] = {k: v + 100 if v.is_floating_point() else v.clone() for k, v in state["module"].items()}
    return state


@pytest.mark.parametrize("kind", ["full", "timm", "timm_non_strict", "parent"])
def test_load_state_dict_inside_swap_is_refused_and_changes_nothing(kind):
    model, ema = make_pair()
    state = checkpoint_of(ema)
    if kind != "full":  # timm ModelEmaV3's weights-only state (nn.Module's keys)
        state = {f"module.{k}": v for k, v in state["module"].items()}
    holder = nn.Module()
    holder.ema = ema
    model_before, ema_before, counters = snapshot(model), snapshot(ema.module), (ema.updates, ema._calls)
    with ema.swap(model):
        with pytest.raises(RuntimeError, match=r"load_state_dict.*inside `with ema.swap\(model\)`"):
            if kind == "parent":
                holder.load_state_dict({f"ema.{k}": v for k, v in state.items()})
            else:
                ema.load_state_dict(state, strict=kind != "timm_non_strict")
    assert_same(model, model_before)
    assert_same(ema.module, ema_before)
    assert (ema.updates, ema._calls) == counters
    ema.load_state_dict(state, strict=kind != "timm_non_strict")  # after the block: loads
    assert_same(model, model_before)
    torch.testing.assert_close(ema.module[0].weight, ema_before["0.weight"] + 100)


@pytest.mark.parametrize(
    "model_dtype, ema_dtype",
    [(torch.float32, None), (torch.bfloat16, torch.float32), (torch.float16, torch.float32)],
    ids=["same-dtype", "fp32-ema-of-bf16-packed", "fp32-ema-of-fp16-stashed"],
)
def test_forward_inside_swap_is_refused(model_dtype, ema_dtype):
    model, ema = make_pair(model_dtype, ema_dtype)
    model.eval()
    x = torch.randn(6, 5, dtype=model_dtype)
    expected = ema(x.to(ema.module[0].weight.dtype))
    model_before, ema_before = snapshot(model), snapshot(ema.module)
    with ema.swap(model):
        with pytest.raises(RuntimeError, match=r"ModelEMA.forward: called inside `with ema.swap.*call the model"):
            ema(x)
        inside, swapped_in = model(x), snapshot(model)  # the way to evaluate the EMA inside the block
    assert_same(model, model_before)
    assert_same(ema.module, ema_before)
    torch.testing.assert_close(ema(x.to(ema.module[0].weight.dtype)), expected, rtol=0, atol=0)
    if ema_dtype is None:
        torch.testing.assert_close(inside, expected, rtol=0, atol=0)
    else:  # the model held the EMA in its own dtype (packed bfloat16 rounds ties away from zero)
        rounded = {k: v.to(model_dtype) if v.is_floating_point() else v for k, v in ema_before.items()}
        torch.testing.assert_close(swapped_in, rounded)


@pytest.mark.parametrize(
    "dtype",
    [torch.float8_e4m3fn, torch.float8_e5m2, torch.int64, torch.bool, torch.complex64, "float32", 32],
    ids=str,
)
def test_dtype_outside_the_averaged_ones_is_refused_at_construction(dtype):
    allowed = "torch.float32, torch.float64, torch.float16 or torch.bfloat16"
    with pytest.raises(ValueError, match=rf"argument `dtype` must be .*\({allowed}\) or None"):
        shardkit.ModelEMA(nn.Linear(4, 3), dtype=dtype)


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_documented_dtypes_are_accepted_and_update(dtype):
    model = nn.Linear(4, 3)
    ema = shardkit.ModelEMA(model, 0.5, tau=None, dtype=dtype)
    assert ema.module.weight.dtype == (dtype or torch.float32)
    with torch.no_grad():
        model.weight.add_(1)
    ema.update(model)
    ema.update(model)
    assert ema.updates == 2
