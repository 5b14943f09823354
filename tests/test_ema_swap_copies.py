"""ModelEMA copied or pickled inside ``with ema.swap(model):`` (``copy.deepcopy``, ``torch.save``, a
parent module pickled): the copy holds the true EMA weights, bit for bit, and is not stuck in the
block; and ``swap`` of a model whose weights are tied by storage (two Parameters, one memory)."""

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import shardkit


def trained_pair(model_dtype, ema_dtype):
    """A model and its EMA after a few updates with fresh random steps (so the two differ)."""
    model = nn.Sequential(nn.Linear(7, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)).to(model_dtype)
    ema = shardkit.ModelEMA(model, 0.7, tau=None, dtype=ema_dtype)
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model(torch.randn(6, 7, dtype=model_dtype))  # (BatchNorm's running stats and count move)
        ema.update(model)
    return model, ema


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_bits(module, expected):
    got = module.state_dict()
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


PAIRS = [
    (torch.float32, None),  # exchanged in place
    (torch.bfloat16, torch.float32),  # packed in place (the model sees the EMA rounded to bf16)
    (torch.float16, torch.float32),  # stashed in host memory
]


@pytest.mark.parametrize("model_dtype,ema_dtype", PAIRS)
@pytest.mark.parametrize("how", ["deepcopy", "torch.save", "parent pickle"])
def test_a_copy_made_inside_swap_holds_the_ema_weights_and_is_not_swapped(model_dtype, ema_dtype, how):
    model, ema = trained_pair(model_dtype, ema_dtype)
    ema_before, model_before = snapshot(ema.module), snapshot(model)
    with ema.swap(model):
        inside = snapshot(model)  # the EMA weights as the model shows them
        if how == "deepcopy":
            twin = copy.deepcopy(ema)
        elif how == "torch.save":
            buf = io.BytesIO()
            torch.save(ema, buf)
            buf.seek(0)
            twin = torch.load(buf, weights_only=False)
        else:
            holder = nn.Module()
            holder.ema = ema
            twin = pickle.loads(pickle.dumps(holder)).ema
        assert_bits(model, inside)  # the block goes on as it was
    assert_bits(model, model_before)
    assert_bits(ema.module, ema_before)
    assert_bits(twin.module, ema_before)  # the true EMA, not the training weights
    assert (twin.updates, twin._calls) == (ema.updates, ema._calls)
    for e in (ema, twin):  # neither is stuck in the block: both update alike
        e.update(model)
        with e.swap(model):
            pass
    assert_bits(twin.module, snapshot(ema.module))
    twin.load_state_dict(twin.state_dict())


def test_a_copy_inside_swap_then_swaps_on_its_own():
    model, ema = trained_pair(torch.float32, None)
    ema_before = snapshot(ema.module)
    with ema.swap(model):
        twin = copy.deepcopy(ema)
        with pytest.raises(RuntimeError, match="called inside `with ema.swap"):
            ema.update(model)  # (the original is still in its block)
    other = copy.deepcopy(model)
    with twin.swap(other):
        assert_bits(other, ema_before)


class Tied(nn.Module):
    """An embedding and a head over one memory, as two Parameters (``nn.Parameter(emb.weight)``)."""

    def __init__(self, view=False):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = nn.Parameter(self.emb.weight[:5] if view else self.emb.weight)


def test_swap_of_storage_tied_parameters_puts_the_ema_in_once_and_restores_bit_exactly():
    model = Tied()
    ema = shardkit.ModelEMA(model, 0.6, tau=None)
    ref = {k: v.detach().double() for k, v in model.state_dict().items()}  # float64 reference
    for step in range(4):
        with torch.no_grad():
            model.emb.weight.add_(torch.randn_like(model.emb.weight))
            model.mid.weight.add_(torch.randn_like(model.mid.weight))
        ema.update(model)
        d = ema.get_decay(step + 1)
        ref = {k: d * v + (1 - d) * model.state_dict()[k].double() for k, v in ref.items()}
    got = ema.module.state_dict()
    for k, v in ref.items():
        assert ((got[k].double() - v).norm() / v.norm()).item() <= 1e-6, k
    before = snapshot(model)
    with ema.swap(model):
        assert model.emb.weight.data_ptr() == model.head.weight.data_ptr()  # still tied
        assert ((model.emb.weight.double() - ref["emb.weight"]).norm() / ref["emb.weight"].norm()) <= 1e-6
        assert ((model.mid.weight.double() - ref["mid.weight"]).norm() / ref["mid.weight"].norm()) <= 1e-6
    assert_bits(model, before)


def test_swap_of_overlapping_views_names_both_and_changes_nothing():
    model = Tied(view=True)
    ema = shardkit.ModelEMA(model, 0.6, tau=None)
    with torch.no_grad():
        model.mid.weight.add_(1.0)
    ema.update(model)
    before, ema_before = snapshot(model), snapshot(ema.module)
    with pytest.raises(ValueError, match=r"argument `model` has head\.weight and emb\.weight in one memory"):
        with ema.swap(model):
            pass
    assert_bits(model, before)
    assert_bits(ema.module, ema_before)
    ema.update(model)  # not left swapped


def test_swap_of_disjoint_views_of_one_buffer():
    # Parameters over disjoint parts of one flat buffer (a fused weight split into Parameters)
    # swapped fine before overlapping views were refused; they still do.
    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            flat = torch.randn(20, dtype=torch.float64)
            self.a = torch.nn.Parameter(flat[:8].view(2, 4))
            self.b = torch.nn.Parameter(flat[8:].view(3, 4))

    model = Flat()
    ema = shardkit.ModelEMA(model, 0.5, tau=None)
    with torch.no_grad():
        model.a.add_(2.0)
        model.b.add_(4.0)
    ema.update(model, step=10)
    before = snapshot(model)
    with ema.swap(model):
        torch.testing.assert_close(model.a, before["a"] - 1.0, rtol=0, atol=1e-15)
        torch.testing.assert_close(model.b, before["b"] - 2.0, rtol=0, atol=1e-15)
    assert_bits(model, before)
