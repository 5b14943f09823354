"""DataParallelCriterion in its keyword forms and with per-sample losses: a target passed as a
keyword weighs the devices exactly as a positional one (ignored labels, class weights), and
per-sample losses are gathered in batch order with reduction='none' or refused, alike for
every split. Repeated "cpu" devices, float64 references."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardkit.parallel import DataParallelCriterion, DataParallelModel

SPLITS = [(2, 8), (3, 11), (4, 5)]  # (devices, batch): even, uneven, a batch barely over the devices


def _logits(batch, classes=5):
    return torch.randn(batch, classes, dtype=torch.float64, requires_grad=True)


def _labels(batch, classes=5, ignored=-100, first_chunk_ignored=0):
    y = torch.randint(0, classes, (batch,))
    y[torch.rand(batch) < 0.4] = ignored
    y[:first_chunk_ignored] = ignored
    return y


class _MaskedMSE(nn.Module):
    """A criterion of its own with an int ``ignore_index``: the mean over valid rows."""

    def __init__(self, ignore_index=-1):
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, "mean"

    def forward(self, pred, labels):
        keep = labels != self.ignore_index
        return (pred.sum(1) - labels.double()).pow(2)[keep].mean()


CRITERIA = {
    "ce": lambda: nn.CrossEntropyLoss(),
    "ce_weighted": lambda: nn.CrossEntropyLoss(weight=torch.rand(5, dtype=torch.float64) + 0.1, ignore_index=3),
    "nll": lambda: nn.NLLLoss(),
    "own": lambda: _MaskedMSE(ignore_index=-100),
}


@pytest.mark.parametrize("name", sorted(CRITERIA))
@pytest.mark.parametrize("k, batch", SPLITS)
def test_a_keyword_target_weighs_the_devices_as_a_positional_one(name, k, batch):
    criterion = CRITERIA[name]()
    target_name = "labels" if name == "own" else "target"
    crit = DataParallelCriterion(criterion, device_ids=["cpu"] * k)
    # the first chunk entirely ignored: its loss is NaN, its weight 0 (not NaN in the result)
    y = _labels(batch, first_chunk_ignored=-(-batch // k))
    y[-1] = 0  # one valid label at least (a loss over none is NaN on one device too)
    if name == "ce_weighted":
        y[y == -100] = 3
    logits = _logits(batch)

    def inp():
        return logits.log_softmax(1) if name == "nll" else logits

    ref = criterion(inp(), y)
    ref_grad = torch.autograd.grad(ref, logits)[0]
    for call in ("positional", "keyword"):
        outputs = list(inp().tensor_split(k))
        loss = crit(outputs, y) if call == "positional" else crit(outputs, **{target_name: y})
        assert torch.isfinite(loss), call
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12, msg=call)
        torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], ref_grad, rtol=1e-12, atol=1e-12, msg=call)


def test_a_keyword_target_through_the_model_pair():
    net = nn.Linear(4, 5).double()
    model = DataParallelModel(net, device_ids=["cpu"] * 3)
    crit = DataParallelCriterion(nn.CrossEntropyLoss(ignore_index=255), device_ids=["cpu"] * 3)
    x, y = torch.randn(10, 4, dtype=torch.float64), _labels(10, ignored=255)
    torch.testing.assert_close(crit(model(x), target=y), F.cross_entropy(net(x), y, ignore_index=255))


class _Anything(nn.Module):
    """A criterion whose target cannot be told from its signature."""

    ignore_index, reduction = -100, "mean"

    def forward(self, *args, **kwargs):
        return F.cross_entropy(args[0], kwargs["y"])


def test_a_keyword_target_that_cannot_be_found_is_refused():
    crit = DataParallelCriterion(_Anything(), device_ids=["cpu"] * 2)
    with pytest.raises(ValueError, match=r"cannot tell which of the keyword arguments \['y'\].*pass the target"):
        crit(list(_logits(6).tensor_split(2)), y=_labels(6))


class _PerSample(nn.Module):
    """Per-sample cross-entropy; ``reduction`` set only when asked for."""

    def __init__(self, declare=False):
        super().__init__()
        if declare:
            self.reduction = "none"

    def forward(self, out, target):
        return F.cross_entropy(out, target, reduction="none")


@pytest.mark.parametrize("k, batch", SPLITS)
def test_per_sample_losses_are_gathered_in_order_with_reduction_none(k, batch):
    logits, y = _logits(batch), torch.randint(0, 5, (batch,))
    ref = F.cross_entropy(logits, y, reduction="none")
    for criterion in (nn.CrossEntropyLoss(reduction="none"), _PerSample(declare=True)):
        loss = DataParallelCriterion(criterion, device_ids=["cpu"] * k)(list(logits.tensor_split(k)), target=y)
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k, batch", SPLITS)
def test_per_sample_losses_without_reduction_none_are_refused_on_every_split(k, batch):
    logits, y = _logits(batch), torch.randint(0, 5, (batch,))
    crit = DataParallelCriterion(_PerSample(), device_ids=["cpu"] * k)
    with pytest.raises(ValueError, match=r"losses of shapes .*must be a scalar.*reduction='none'"):
        crit(list(logits.tensor_split(k)), y)


def test_reduction_none_that_returns_no_per_sample_losses_is_refused():
    class Summed(_PerSample):
        def forward(self, out, target):
            return super().forward(out, target).sum()

    crit = DataParallelCriterion(Summed(declare=True), device_ids=["cpu"] * 2)
    with pytest.raises(ValueError, match=r"reduction='none' but returned losses of shapes \[\(\), \(\)\]"):
        crit(list(_logits(6).tensor_split(2)), torch.randint(0, 5, (6,)))
