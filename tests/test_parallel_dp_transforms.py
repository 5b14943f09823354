"""DataParallelModel / DataParallelCriterion under torch.func transforms (grad, jacrev, vmap,
jvp) and forward-mode AD: the C++ ops have no functorch support, so a pure-torch composite
of the same math runs (scatter.composite_split, loss_reduce.composite_weighted_reduce); the
results equal the unsplit model + criterion in float64."""

import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.func import grad, jacrev, jvp, vmap

from shardkit.parallel import DataParallelCriterion, DataParallelModel, WeightedLoss

# torch's own functorch code calls torch.jit.script on first use (deprecated in this torch)
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
ce = nn.functional.cross_entropy


def _net():
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _setup(k, batch=7, ignore=False):
    net = _net()
    devices = ["cpu"] * k
    crit = nn.CrossEntropyLoss(ignore_index=-1)
    x, y = torch.randn(batch, 4, dtype=torch.float64), torch.randint(0, 3, (batch,))
    if ignore:
        y[-(batch // k) :] = -1  # the last chunk fully ignored (weight 0)
    return net, DataParallelModel(net, devices), DataParallelCriterion(crit, devices), x, y


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("ignore", [False, True])
def test_grad_and_jacrev_of_the_loss(k, ignore):
    net, model, crit, x, y = _setup(k, ignore=ignore)
    ref = lambda i: ce(net(i), y, ignore_index=-1)  # noqa: E731
    got = grad(lambda i: crit(model(i), y))(x)
    assert not got.isnan().any()
    _close(got, grad(ref)(x))
    _close(jacrev(lambda i: crit(model(i), y))(x), jacrev(ref)(x))


def test_vmap_of_the_model_and_of_the_criterion():
    net, model, crit, x, y = _setup(3)
    xs = torch.randn(2, 7, 4, dtype=torch.float64)
    _close(vmap(lambda i: torch.cat(model(i)))(xs), vmap(net)(xs))
    outs = torch.randn(2, 7, 3, dtype=torch.float64)  # an ensemble of outputs, one target
    sizes = [3, 2, 2]
    got = vmap(lambda o: crit(list(o.split(sizes)), y))(outs)
    _close(got, vmap(lambda o: ce(o, y, ignore_index=-1))(outs))
    ys = torch.randint(0, 3, (2, 7))
    ys[0, 5:] = -1  # a chunk of weight 0 in one member of the batch only
    got = vmap(lambda o, t: crit(list(o.split(sizes)), t))(outs, ys)
    _close(got, vmap(lambda o, t: ce(o, t, ignore_index=-1))(outs, ys))
    g = vmap(grad(lambda o, t: crit(list(o.split(sizes)), t)))(outs, ys)
    _close(g, vmap(grad(lambda o, t: ce(o, t, ignore_index=-1)))(outs, ys))


# torch 2.15's own jvp decompositions (torch/_decomp/decompositions_for_jvp.py) call the
# deprecated torch.jit.script when first used on nll_loss: plain F.cross_entropy warns the same
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_forward_mode_ad_and_jvp():
    net, model, crit, x, y = _setup(2, ignore=True)
    tangent = torch.randn_like(x)
    with fwAD.dual_level():
        got = fwAD.unpack_dual(crit(model(fwAD.make_dual(x, tangent)), y)).tangent
        want = fwAD.unpack_dual(ce(net(fwAD.make_dual(x, tangent)), y, ignore_index=-1)).tangent
    _close(got, want)
    value, t = jvp(lambda i: crit(model(i), y), (x,), (tangent,))
    ref_value, ref_t = jvp(lambda i: ce(net(i), y, ignore_index=-1), (x,), (tangent,))
    _close(value, ref_value)
    _close(t, ref_t)


def test_weighted_loss_and_sum_reduction_under_grad():
    """A WeightedLoss criterion with an empty chunk and a reduction='sum' one."""

    class MaskedMSE(nn.Module):
        def forward(self, pred, target, mask):
            return WeightedLoss(((pred - target) ** 2 * mask).sum() / mask.sum(), mask.sum())

    net = _net()
    ref = copy.deepcopy(net)
    x, tgt = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    mask = torch.ones(6, 3, dtype=torch.float64)
    mask[3:] = 0
    model = DataParallelModel(net, ["cpu", "cpu"])
    crit = DataParallelCriterion(MaskedMSE(), ["cpu", "cpu"])
    got = grad(lambda i: crit(model(i), tgt, mask))(x)
    _close(got, grad(lambda i: ((ref(i) - tgt) ** 2 * mask).sum() / mask.sum())(x))
    y = torch.randint(0, 3, (6,))
    crit_sum = DataParallelCriterion(nn.CrossEntropyLoss(reduction="sum"), ["cpu", "cpu"])
    _close(grad(lambda i: crit_sum(model(i), y))(x), grad(lambda i: ce(ref(i), y, reduction="sum"))(x))
