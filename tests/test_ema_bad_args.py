"""Bad arguments to shardkit.ModelEMA: a failed load_state_dict leaves the EMA untouched, the
float schedule arguments must be finite and in range, and update's `step` must be an int >= 0
(each raises a ValueError/TypeError naming the argument or the state entry)."""

import math

import numpy as np
import pytest
import torch
from torch import nn

import shardkit


def make_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


def trained_ema(**kwargs):
    net = make_net()
    ema = shardkit.ModelEMA(net, 0.9, **kwargs)
    for _ in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        ema.update(net)
    return net, ema


def perturb(net):
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p))
        net.train()
        net(torch.randn(5, 4))


def documented_decay(t, decay=0.9999, tau=2000, warmup_gamma=None, warmup_power=None, min_decay=0.0, **_):
    """The decay at schedule step t as the ModelEMA docstring gives it (update_after_step 0)."""
    decay, min_decay = float(decay), float(min_decay)
    if warmup_gamma is not None or warmup_power is not None:
        if t - 1 <= 0:
            return 0.0
        gamma = 1.0 if warmup_gamma is None else warmup_gamma
        power = 2 / 3 if warmup_power is None else warmup_power
        return max(min(1 - (1 + (t - 1) / gamma) ** -power, decay), min_decay)
    if tau is None:
        return 0.0 if t <= 1 else decay
    return max(decay * (1 - math.exp(-t / float(tau))), min_decay)


def assert_follows(ema, net, ref, d):
    """One float64 EMA step of ``ref`` towards ``net`` with decay ``d``, compared with the EMA."""
    for k, v in net.state_dict().items():
        ref[k] = d * ref[k] + (1 - d) * v.double() if v.is_floating_point() else v.double()
    for k, v in ema.module.state_dict().items():
        torch.testing.assert_close(v.double(), ref[k], rtol=1e-6, atol=1e-6, msg=k)


def snapshot(ema):
    return {k: v.clone() for k, v in ema.module.state_dict().items()}, ema.state_dict()


def assert_unchanged(ema, before):
    tensors, state = before
    now = ema.module.state_dict()
    assert now.keys() == tensors.keys()
    for k, v in tensors.items():
        assert torch.equal(now[k], v), k
    after = ema.state_dict()
    for k, v in state.items():
        if k != "module":
            assert after[k] == v, k


# ---- 1. load_state_dict: checked as a whole before anything is copied -----------------


def test_load_state_dict_wrong_shape_in_a_later_tensor_changes_nothing():
    _, ema = trained_ema()
    _, other = trained_ema(tau=None)
    sd = other.state_dict()
    module = dict(sd["module"])
    names = list(module)
    assert names[0] == "0.weight" and not torch.equal(module["0.weight"], ema.module[0].weight)
    module["2.weight"] = torch.zeros(5, 5)  # the first entries are fine, a later one is not
    before = snapshot(ema)
    with pytest.raises(ValueError, match=r"corrupt 'module' entry '2.weight': shape \(5, 5\), the EMA has \(2, 3\)"):
        ema.load_state_dict({**sd, "module": module})
    assert_unchanged(ema, before)


@pytest.mark.parametrize(
    "edit,msg",
    [
        (lambda m: m.pop("1.running_var"), r"missing \['1.running_var'\], unexpected \[\]"),
        (lambda m: m.__setitem__("extra", torch.zeros(1)), r"missing \[\], unexpected \['extra'\]"),
        (lambda m: m.__setitem__("2.bias", [0.0, 0.0]), r"entry '2.bias': expected a tensor, got list"),
        (lambda m: m.__setitem__("2.bias", torch.zeros(2, dtype=torch.int64)), r"entry '2.bias': dtype torch.int64"),
        (lambda m: m.__setitem__("1.num_batches_tracked", torch.tensor(2.5)), r"entry '1.num_batches_tracked'"),
        (lambda m: m.__setitem__("2.bias", torch.zeros(2, device="meta")), r"entry '2.bias': a torch.strided"),
        (lambda m: m.__setitem__("2.bias", torch.zeros(2).to_sparse()), r"entry '2.bias': a torch.sparse_coo"),
        # the shape check raised torch's "Internal error: NestedTensorImpl doesn't support sizes"
        (
            lambda m: m.__setitem__("2.bias", torch.nested.nested_tensor([torch.zeros(1), torch.zeros(1)])),
            r"entry '2.bias': a nested tensor, the EMA has a dense one of shape \(2,\)",
        ),
    ],
    ids=["missing", "unexpected", "not_tensor", "int_into_float", "float_into_int", "meta", "sparse", "nested"],
)
def test_load_state_dict_bad_module_entry_changes_nothing(edit, msg):
    _, ema = trained_ema()
    _, other = trained_ema(tau=None, update_every=2)
    sd = other.state_dict()
    module = dict(sd["module"])
    edit(module)
    before = snapshot(ema)
    with pytest.raises(ValueError, match=msg):
        ema.load_state_dict({**sd, "module": module})
    assert_unchanged(ema, before)


@pytest.mark.parametrize("key", ["updates", "calls"])
@pytest.mark.parametrize("bad", [-7, -1, 2**63])
def test_load_state_dict_refuses_bad_counters(key, bad):
    _, ema = trained_ema()
    sd = ema.state_dict()
    with pytest.raises(ValueError, match=rf"corrupt '{key}': expected an int in \[0, 2\*\*63 - 1\]"):
        ema.load_state_dict({**sd, key: bad})
    with pytest.raises(ValueError, match=rf"corrupt '{key}'"):
        ema.load_state_dict({**sd, key: 3.0})


def test_load_state_dict_refuses_infinite_schedule_and_keeps_the_old():
    _, ema = trained_ema()
    sd = ema.state_dict()
    before = snapshot(ema)
    for key in ("tau", "warmup_gamma", "warmup_power"):
        with pytest.raises(ValueError, match=rf"argument `state_dict`: argument `{key}` must be > 0 and finite"):
            ema.load_state_dict({**sd, key: math.inf})
    with pytest.raises(ValueError, match=r"argument `state_dict`: argument `update_every` must be an int >= 1"):
        ema.load_state_dict({**sd, "update_every": 0})
    assert_unchanged(ema, before)


def test_load_state_dict_good_state_still_loads_across_dtypes():
    net, ema = trained_ema()
    b = shardkit.ModelEMA(make_net(), 0.5, tau=None, dtype=torch.float64)
    b.load_state_dict(ema.state_dict())  # float32 tensors into a float64 EMA: converted
    for (k, va), vb in zip(ema.module.state_dict().items(), b.module.state_dict().values()):
        assert torch.equal(va.to(vb.dtype), vb), k
    assert (b.updates, b._calls, b.tau, b.decay) == (ema.updates, ema._calls, ema.tau, ema.decay)


# ---- 2. float schedule arguments: finite and in range ----------------------------------


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"tau": math.inf}, "tau"),
        ({"tau": math.nan}, "tau"),
        ({"tau": 10**400}, "tau"),
        ({"warmup_gamma": math.inf}, "warmup_gamma"),
        ({"warmup_gamma": math.nan}, "warmup_gamma"),
        ({"warmup_power": math.inf}, "warmup_power"),
        ({"warmup_power": -math.inf}, "warmup_power"),
        ({"warmup_power": 0.0}, "warmup_power"),
        ({"decay": math.nan}, "decay"),
        ({"decay": math.inf}, "decay"),
        ({"decay": 10**400}, "decay"),
        ({"min_decay": math.nan}, "min_decay"),
        ({"min_decay": -math.inf}, "min_decay"),
        ({"min_decay": math.inf}, "min_decay"),
        ({"updates": 2**63}, "updates"),
    ],
)
def test_float_arguments_must_be_finite_and_in_range(kwargs, name):
    with pytest.raises(ValueError, match=rf"argument `{name}` must"):
        shardkit.ModelEMA(make_net(), **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tau": None},
        {"tau": 1e-300},
        {"tau": 1e300},
        {"tau": torch.tensor(5.0)},
        {"decay": 0},
        {"decay": 1},
        {"decay": 0.5, "min_decay": 0.5},
        {"warmup_gamma": 1e-300, "warmup_power": 1e300},
        {"warmup_power": 1.0, "min_decay": 0.0},
        {"updates": 2**63 - 1},
    ],
)
def test_valid_float_arguments_stay_valid(kwargs):
    # Valid at the edges, and the weights follow the documented schedule there (an update at
    # tau=1e300 copies the model, at tau=1e-300 uses `decay` at once, ...).
    net = make_net()
    ema = shardkit.ModelEMA(net, **kwargs)
    ref = {k: v.double().clone() for k, v in ema.module.state_dict().items()}
    for step in (None, 7):
        perturb(net)
        d = documented_decay(ema.updates + 1 if step is None else step, **kwargs)
        ema.update(net, step=step)
        assert_follows(ema, net, ref, d)


def test_infinite_tau_no_longer_turns_the_ema_into_a_copy():
    # The reproducer: tau=inf was accepted and gave decay 0 for ever.
    with pytest.raises(ValueError, match="argument `tau` must be > 0 and finite, or None, got inf"):
        shardkit.ModelEMA(make_net(), 0.9, tau=float("inf"))
    with pytest.raises(ValueError, match="argument `warmup_gamma` must be > 0 and finite, or None, got inf"):
        shardkit.ModelEMA(make_net(), 0.9, warmup_gamma=float("inf"))


# ---- 3. update's step -------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad,exc",
    [
        ("5", TypeError),
        (1.7, TypeError),
        (5.0, TypeError),
        (math.nan, TypeError),
        (True, TypeError),
        (torch.tensor(5.0), TypeError),
        (torch.tensor([1, 2]), TypeError),
        (torch.tensor(-2), ValueError),
        (np.float64(3.0), TypeError),
        (-1, ValueError),
        (np.int64(-3), ValueError),
        (10**400, ValueError),
        (2**63, ValueError),
    ],
    ids=[
        "str",
        "float",
        "float_integral",
        "nan",
        "bool",
        "float_tensor",
        "two_steps",
        "neg_tensor",
        "np_float",
        "neg",
        "np_neg",
        "10**400",
        "2**63",
    ],
)
def test_update_step_must_be_an_int_at_least_zero(bad, exc):
    net, ema = trained_ema(warmup_power=1.0)
    before = snapshot(ema)
    with pytest.raises(exc, match="argument `step` must be an int"):
        ema.update(net, step=bad)
    assert_unchanged(ema, before)  # counters and weights untouched


def test_update_step_accepts_numpy_integers_and_large_ints():
    net = make_net()
    a = shardkit.ModelEMA(net, 0.9, warmup_power=1.0)
    b = shardkit.ModelEMA(net, 0.9, warmup_power=1.0)
    t = shardkit.ModelEMA(net, 0.9, warmup_power=1.0)
    ref = {k: v.double().clone() for k, v in a.module.state_dict().items()}
    perturb(net)
    a.update(net, step=5)
    b.update(net, step=np.int64(5))
    t.update(net, step=torch.tensor(5))  # timm takes a tensor step too
    assert_follows(a, net, ref, documented_decay(5, 0.9, warmup_power=1.0))
    assert torch.equal(a.module[0].weight, b.module[0].weight)
    assert torch.equal(a.module[0].weight, t.module[0].weight)
    for step in (0, np.uint32(9), 2**63 - 1):  # the warmup's float math at the largest step: decay
        perturb(net)
        a.update(net, step=step)
        assert_follows(a, net, ref, documented_decay(int(step), 0.9, warmup_power=1.0))
    assert documented_decay(2**63 - 1, 0.9, warmup_power=1.0) == 0.9
    c = shardkit.ModelEMA(net, 0.9, tau=3.0)
    ref = {k: v.double().clone() for k, v in c.module.state_dict().items()}
    perturb(net)
    c.update(net, step=2**63 - 1)  # the ramp's float math at the largest step: decay
    assert_follows(c, net, ref, 0.9)
    assert a.updates == 4 and c.updates == 1


def test_device_must_be_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"`device`: cuda is not available \(0 CUDA GPU"):
        shardkit.ModelEMA(model, device="cuda")
    with pytest.raises(ValueError, match="`device` must name a device"):
        shardkit.ModelEMA(model, device="nonsense")
    for other in ("meta", "xpu"):  # accepted by torch.device, not by the EMA's update
        with pytest.raises(ValueError, match=f"argument `device` must be a cpu or cuda device, got {other}"):
            shardkit.ModelEMA(model, device=other)
    assert shardkit.ModelEMA(model, device="cpu").module.weight.device.type == "cpu"


def test_complex_tensors_are_refused_and_dtype_changes_named():
    m = torch.nn.Module()
    m.p = torch.nn.Parameter(torch.ones(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match="argument `model` has p of dtype torch.complex64; ModelEMA averages real"):
        shardkit.ModelEMA(m)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    ema = shardkit.ModelEMA(model)
    model[1].running_mean = torch.zeros(3, dtype=torch.long)  # a float buffer replaced by an int one
    with pytest.raises(ValueError, match="has 1.running_mean of dtype torch.int64, the EMA has torch.float32"):
        ema.update(model)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    ema = shardkit.ModelEMA(model)
    model.to("meta")
    with pytest.raises(ValueError, match="has 0.weight on the meta device"):
        ema.update(model)


def test_loose_types_are_refused_and_numpy_integers_taken():
    np = pytest.importorskip("numpy")
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    with pytest.raises(TypeError, match="argument `copy_float_buffers` must be a Python bool"):
        shardkit.ModelEMA(model, copy_float_buffers="no")  # was truthy: buffers silently copied
    ema = shardkit.ModelEMA(model, updates=np.int64(2), update_every=np.int32(1))
    assert ema.updates == 2 and type(ema.updates) is int
    with pytest.raises(TypeError, match="argument `model` must be an nn.Module, got str"):
        ema.attach(torch.optim.SGD(model.parameters(), lr=0.1), model="x")
    with pytest.raises(TypeError, match="argument `model` must be an nn.Module, got NoneType"):
        ema.update_attr(None)
    with pytest.raises(TypeError, match="argument `step` must be an int"):
        ema.get_decay("3")
    with pytest.raises(TypeError, match="argument `step` must be an int"):
        ema.get_decay(float("nan"))
    with pytest.raises(ValueError, match="argument `step` must be an int in"):
        ema.get_decay(-1)
    assert ema.get_decay(np.int64(5)) == ema.get_decay(5)
    head = shardkit.ShardedSoftmaxLoss(np.int64(8), np.int32(10))
    assert head.embedding_dim == 8 and head.num_classes == 10
    with pytest.raises(ValueError, match="argument `embedding_dim` must be a positive int"):
        shardkit.ShardedSoftmaxLoss(np.float64(8.0), 10)


@pytest.mark.parametrize(
    "name, value, exc",
    [
        ("update_every", 2.5, ValueError),
        ("update_every", 0, ValueError),
        ("update_every", -1, ValueError),
        ("min_decay", 2.0, ValueError),
        ("tau", 0.0, ValueError),
        ("warmup_gamma", 0.0, ValueError),
        ("decay", "0.9", TypeError),
        ("decay", 1.5, ValueError),
        ("updates", "3", ValueError),
        ("updates", -1, ValueError),
    ],
)
def test_schedule_attributes_are_checked_when_set(name, value, exc):
    # timm and ultralytics users set `ema.decay = ...`: a bad value was taken as it was and
    # failed later (ZeroDivisionError in update) or never updated at all (update_every=2.5).
    net, ema = trained_ema(tau=None)
    before = snapshot(ema)
    with pytest.raises(exc, match=f"`{name}`"):
        setattr(ema, name, value)
    assert_unchanged(ema, before)
    ema.decay = 0.5  # a good value is taken, and used
    ema.update_every = 1
    ema.update(net)
    assert ema.get_decay() == 0.5
