"""SparseRowSGD's guards against bad input: load_state_dict checks every state entry (its
key too) before anything changes, and number arguments too large for a float are refused
with an error naming the argument (not a bare OverflowError)."""

import copy
from fractions import Fraction

import pytest
import torch
from test_softmax_load_checks import _assert_same, _stepped_sgd

import shardkit

# ---- load_state_dict: state keys that name no parameter ----


@pytest.mark.parametrize(
    "entry",
    [
        {"momentum_buffer": "x"},  # the probe's case: an AttributeError after loading
        {"momentum_buffer": torch.zeros(5, 3), "seen": torch.ones(5, dtype=torch.bool)},  # well-formed
        {},
        "x",
    ],
)
def test_load_refuses_a_state_key_naming_no_parameter_changing_nothing(entry):
    params, opt = _stepped_sgd()
    before = copy.deepcopy(opt.state_dict())
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["lr"] = 0.5  # would be loaded if the check came late
    saved["state"][0]["momentum_buffer"] = torch.full((5, 3), 7.0)
    saved["state"][99] = entry
    with pytest.raises(ValueError, match=r"argument `state_dict`: state\[99\] names no parameter") as err:
        opt.load_state_dict(saved)
    assert "0" in str(err.value).split("state keys:")[1]  # the keys that do name one
    _assert_same(opt.state_dict(), before)
    assert opt.param_groups[0]["lr"] == 0.1 and 99 not in opt.state
    params[0].grad = torch.ones(5, 3)
    opt.step()  # still steps


def test_load_refuses_a_state_key_naming_two_parameters():
    _, opt = _stepped_sgd(groups=2)
    before = copy.deepcopy(opt.state_dict())
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][1]["params"] = [0]  # both groups' parameter under key 0
    with pytest.raises(ValueError, match=r"param group 1: parameter 0: state key 0 names two parameters"):
        opt.load_state_dict(saved)
    _assert_same(opt.state_dict(), before)


def test_load_refuses_an_unhashable_parameter_key():
    _, opt = _stepped_sgd()
    before = copy.deepcopy(opt.state_dict())
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["params"] = [[0]]
    with pytest.raises(TypeError, match=r"param group 0: parameter 0: its state key must be hashable"):
        opt.load_state_dict(saved)
    _assert_same(opt.state_dict(), before)


def test_load_with_a_bad_entry_beside_a_good_one_changes_nothing():
    # the first entry valid (and different), the second bad: neither is loaded
    params, opt = _stepped_sgd(groups=2)
    before = copy.deepcopy(opt.state_dict())
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["lr"] = 0.5
    saved["state"][0] = {"momentum_buffer": torch.full((5, 3), 7.0), "seen": torch.zeros(5, dtype=torch.bool)}
    saved["state"][1] = {"momentum_buffer": torch.zeros(5, 3), "seen": torch.ones(5, dtype=torch.float16)}
    with pytest.raises(TypeError, match=r"param group 1, parameter 0 \(state key 1.*`seen`"):
        opt.load_state_dict(saved)
    _assert_same(opt.state_dict(), before)


def test_valid_loads_still_work():
    params, opt = _stepped_sgd(groups=2)
    saved = copy.deepcopy(opt.state_dict())
    del saved["state"][1]  # a parameter without state: fine
    saved["param_groups"][1]["lr"] = 0.5
    other = shardkit.SparseRowSGD(
        [{"params": [torch.nn.Parameter(p.detach().clone())]} for p in params], lr=0.1, momentum=0.9
    )
    other.load_state_dict(saved)
    assert other.param_groups[1]["lr"] == 0.5
    _assert_same(other.state_dict()["state"], saved["state"])


# ---- number arguments too large for a float ----

_HUGE = [10**400, -(10**400), Fraction(10**400, 3)]
_NAMES = ["lr", "momentum", "dampening", "weight_decay"]


@pytest.mark.parametrize("value", _HUGE, ids=["int", "negative-int", "Fraction"])
@pytest.mark.parametrize("name", _NAMES)
def test_constructor_names_a_number_too_large_for_a_float(name, value):
    p = torch.nn.Parameter(torch.randn(3, 2))
    kind = type(value).__name__
    with pytest.raises(ValueError, match=rf"^argument `{name}` must be a finite number, got an? {kind} too large"):
        shardkit.SparseRowSGD([p], **{name: value})


@pytest.mark.parametrize("name", _NAMES)
def test_add_param_group_and_load_name_a_number_too_large_for_a_float(name):
    params, opt = _stepped_sgd()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=rf"param group 1: argument `{name}` must be a finite number"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2, 2))], name: 10**400})
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0][name] = 10**400
    with pytest.raises(ValueError, match=rf"argument `state_dict`, param group 0: argument `{name}` must be a finite"):
        opt.load_state_dict(saved)
    _assert_same(opt.state_dict(), before)
    assert len(opt.param_groups) == 1


def test_sgd_only_arguments_are_taken_as_torch_sgd_takes_them():
    # A call written for torch.optim.SGD runs unchanged: foreach / fused are kernel choices
    # (ignored), maximize / differentiable at their defaults; their other values are refused.
    torch.manual_seed(0)
    start = torch.randn(5, 3)
    grad = torch.randn(5, 3)
    ref = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([ref], lr=0.1, momentum=0.9, maximize=False, foreach=False, differentiable=False)
    ref.grad = grad.clone()
    sgd.step()
    for extra in (dict(foreach=True), dict(foreach=False, fused=None), dict(maximize=False, differentiable=False)):
        p = torch.nn.Parameter(start.clone())
        opt = shardkit.SparseRowSGD([p], lr=0.1, momentum=0.9, **extra)
        p.grad = grad.clone()
        opt.step()
        assert torch.equal(p.detach(), ref.detach()), extra
    p = [torch.nn.Parameter(torch.randn(2))]
    for name in ("maximize", "differentiable"):
        with pytest.raises(ValueError, match=f"argument `{name}`=True is not supported"):
            shardkit.SparseRowSGD(p, lr=0.1, **{name: True})
    with pytest.raises(TypeError, match="argument `foreach` must be None or a bool"):
        shardkit.SparseRowSGD(p, lr=0.1, foreach="yes")
