"""DataParallelCriterion with a chunk that has nothing valid (weight 0: a mask of zeros, every
target ignored): the loss AND the gradients equal the unsplit model + criterion on one device
in float64. The chunk's own criterion backward computes 0 * (1/0) = NaN; the chunk gate
(shardkit.parallel.loss_reduce) selects it away, so no parameter gradient is NaN."""

import copy

import pytest
import torch
from torch import nn

from shardkit.parallel import DataParallelCriterion, DataParallelModel, WeightedLoss


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


class MaskedMSE(nn.Module):  # the guide's criterion: its weight is the valid elements
    def forward(self, pred, target, mask):
        return WeightedLoss(((pred - target) ** 2 * mask).sum() / mask.sum(), mask.sum())


class ScaledMaskedMSE(nn.Module):  # a criterion with a learnable parameter
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand((), dtype=torch.float64) + 0.5)

    def forward(self, pred, target, mask):
        return WeightedLoss((self.scale * (pred - target) ** 2 * mask).sum() / mask.sum(), mask.sum())


class MaskedCE(nn.Module):  # an int `ignore_index` attribute: weighed by its valid targets
    reduction = "mean"

    def __init__(self, ignore_index=-1):
        super().__init__()
        self.ignore_index = ignore_index

    def forward(self, logits, target):
        valid = target != self.ignore_index
        ce = nn.functional.cross_entropy(logits, target.clamp_min(0), reduction="none")
        return (ce * valid).sum() / valid.sum()


def _net():
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _sizes(batch, k):
    q, r = divmod(batch, k)
    return [q + (1 if i < r else 0) for i in range(k)]


def _check_grads(model, ref, tol=1e-12):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and not p.grad.isnan().any(), name
        assert rel(p.grad, q.grad) <= tol, name


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("empty", [0, -1])  # the first or the last chunk holds nothing valid
def test_masked_mse_with_an_empty_chunk(k, empty):
    net = _net()
    ref = copy.deepcopy(net)
    batch = 3 * k + 1
    x, tgt = torch.randn(batch, 4, dtype=torch.float64), torch.randn(batch, 3, dtype=torch.float64)
    mask = (torch.rand(batch, 3) > 0.3).double()
    sizes = _sizes(batch, k)
    start = 0 if empty == 0 else batch - sizes[-1]
    stop = sizes[0] if empty == 0 else batch
    mask[start:stop] = 0
    mask[stop % batch] = 1  # another chunk keeps valid elements
    devices = ["cpu"] * k
    loss = DataParallelCriterion(MaskedMSE(), devices)(DataParallelModel(net, devices)(x), tgt, mask)
    loss.backward()
    ref_loss = ((ref(x) - tgt) ** 2 * mask).sum() / mask.sum()
    ref_loss.backward()
    assert rel(loss, ref_loss) <= 1e-12
    _check_grads(net, ref)


@pytest.mark.parametrize("k", [2, 3])
def test_ignore_index_criterion_with_a_fully_ignored_chunk(k):
    net = _net()
    ref = copy.deepcopy(net)
    batch = 2 * k + 1
    x, y = torch.randn(batch, 4, dtype=torch.float64), torch.randint(0, 3, (batch,))
    y[_sizes(batch, k)[0] :] = -1  # every chunk but the first fully ignored
    devices = ["cpu"] * k
    loss = DataParallelCriterion(MaskedCE(), devices)(DataParallelModel(net, devices)(x), y)
    loss.backward()
    ref_loss = MaskedCE()(ref(x), y)
    ref_loss.backward()
    assert rel(loss, ref_loss) <= 1e-12
    _check_grads(net, ref)


def test_learnable_criterion_parameter_gets_no_nan():
    """The criterion's per-chunk replicas have their parameters gated too."""
    net, crit = _net(), ScaledMaskedMSE()
    ref, ref_crit = copy.deepcopy(net), copy.deepcopy(crit)
    x, tgt = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    mask = torch.ones(7, 3, dtype=torch.float64)
    mask[4:] = 0  # chunk 1 of [4, 3]
    devices = ["cpu", "cpu"]
    loss = DataParallelCriterion(crit, devices)(DataParallelModel(net, devices)(x), tgt, mask)
    loss.backward()
    ref_crit(ref(x), tgt, mask).loss.backward()
    _check_grads(net, ref)
    assert not crit.scale.grad.isnan() and rel(crit.scale.grad, ref_crit.scale.grad) <= 1e-12


def test_double_backward_with_an_empty_chunk():
    """A gradient penalty (grad of the loss with create_graph, then backward) equals one device."""
    net = _net()
    ref = copy.deepcopy(net)
    x, tgt = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    mask = (torch.rand(6, 3) > 0.3).double()
    mask[0] = 1
    mask[3:] = 0
    devices = ["cpu", "cpu"]
    model, crit = DataParallelModel(net, devices), DataParallelCriterion(MaskedMSE(), devices)

    def penalty(loss, params):
        grads = torch.autograd.grad(loss, params, create_graph=True)
        return loss + sum(g.pow(2).sum() for g in grads)

    penalty(crit(model(x), tgt, mask), list(net.parameters())).backward()
    ref_loss = ((ref(x) - tgt) ** 2 * mask).sum() / mask.sum()
    penalty(ref_loss, list(ref.parameters())).backward()
    _check_grads(net, ref, tol=1e-10)


def test_all_chunks_valid_is_unchanged_and_eval_needs_no_gate():
    """No empty chunk: the same results as before; under no_grad nothing is gated."""
    net = _net()
    ref = copy.deepcopy(net)
    x, y = torch.randn(9, 4, dtype=torch.float64), torch.randint(0, 3, (9,))
    y[1] = -1
    devices = ["cpu"] * 3
    crit = DataParallelCriterion(nn.CrossEntropyLoss(ignore_index=-1), devices)
    loss = crit(DataParallelModel(net, devices)(x), y)
    loss.backward()
    ref_loss = nn.functional.cross_entropy(ref(x), y, ignore_index=-1)
    ref_loss.backward()
    assert rel(loss, ref_loss) <= 1e-12
    _check_grads(net, ref)
    with torch.no_grad():
        assert rel(crit(DataParallelModel(net, devices)(x), y), ref_loss) <= 1e-12


def test_a_criterion_that_modifies_its_input_in_place_runs_once_and_gated():
    """The gate's output may be changed in place. The criterion used to run twice per chunk
    (first on the gate's view, where torch refused the in-place op, then ungated): a counter
    counted twice, labels shifted in place were shifted twice (a wrong loss)."""

    class InPlaceCE(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, logits, target):
            self.calls += 1
            target.sub_(1)  # dataset ids 0 = void, 1..C: in place on the target
            logits.sub_(logits.max(1, keepdim=True).values.detach())  # in place on the model output
            loss = nn.functional.cross_entropy(logits, target, ignore_index=-1)
            return WeightedLoss(loss, (target != -1).sum()) if split else loss

    net = _net()
    ref = copy.deepcopy(net)
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(1, 4, (7,))
    y[3:] = 0  # the second chunk (rows 4..6) is all void: weight 0, gated
    devices = ["cpu"] * 2
    crit = InPlaceCE()
    split = True
    loss = DataParallelCriterion(crit, devices)(DataParallelModel(net, devices)(x), y.clone())
    loss.backward()
    assert int(crit.calls) == 1  # chunk 0 runs on the criterion itself, once (it ran twice)
    split = False
    ref_loss = InPlaceCE()(ref(x), y.clone())
    ref_loss.backward()
    assert rel(loss, ref_loss) <= 1e-12
    _check_grads(net, ref)  # no NaN from the void chunk: it was gated


def test_an_in_place_change_of_a_leaf_that_requires_grad_is_refused_as_on_one_device():
    # The gate's output shared the leaf's storage without being its view: the change went
    # through silently, onto the caller's leaves.
    class InPlace(nn.Module):
        def forward(self, logits, target):
            logits.sub_(1.0)
            return nn.functional.cross_entropy(logits, target)

    outs = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    before = [o.detach().clone() for o in outs]
    with pytest.raises(RuntimeError, match="in-?place"):
        DataParallelCriterion(InPlace(), ["cpu"] * 2)(outs, torch.randint(0, 4, (6,)))
    assert all(torch.equal(o.detach(), b) for o, b in zip(outs, before))
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        InPlace()(outs[0], torch.randint(0, 4, (3,)))  # (what one device says)
