"""shardkit.parallel: DataParallelModel / DataParallelCriterion trained like encoding.parallel,
compared with single-device training. Without GPUs the device lists are repeated "cpu"
entries, which run the same code path (split op, threads, weighted reduction op)."""

import copy
import threading
import traceback

import pytest
import torch
from torch import nn

import shardkit
from shardkit.parallel import DataParallelCriterion, DataParallelModel, WeightedLoss, gather


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


class Net(nn.Module):
    """Odd sizes; returns a tensor, a tuple (logits, aux) or a dict; optional keyword mask."""

    def __init__(self, d_in=7, hidden=13, classes=5, out="tensor"):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, classes))
        self.aux = nn.Linear(d_in, classes)
        self.out = out

    def forward(self, x, *, mask=None):
        if mask is not None:
            x = x * mask
        logits = self.body(x)
        if self.out == "tuple":
            return logits, self.aux(x)
        if self.out == "dict":
            return {"logits": logits, "aux": self.aux(x)}
        return logits


class TupleLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.ce = nn.CrossEntropyLoss()

    def forward(self, logits, aux, target):  # encoding.parallel style: the tuple is unpacked
        return self.ce(logits, target) + 0.4 * self.ce(aux, target)


class DictLoss(nn.Module):
    def forward(self, out, target):
        ce = nn.functional.cross_entropy
        return {"main": ce(out["logits"], target), "aux": ce(out["aux"], target)}


def grads(net):
    return [p.grad.detach().clone() for p in net.parameters() if p.grad is not None]


def run_pair(net, criterion, x, y, k, model_kw=None, crit_kw=None, fwd_kw=None, steps=1):
    """Trains a copy of `net` single-device and one through the parallel pair; returns both
    (losses, grads) after `steps` SGD steps."""
    fwd_kw = fwd_kw or {}
    ref_net, dp_net = copy.deepcopy(net), copy.deepcopy(net)
    model = DataParallelModel(dp_net, device_ids=["cpu"] * k, **(model_kw or {}))
    crit = DataParallelCriterion(copy.deepcopy(criterion), device_ids=["cpu"] * k, **(crit_kw or {}))
    opt_ref = torch.optim.SGD(ref_net.parameters(), lr=0.1)
    opt_dp = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        opt_ref.zero_grad(), opt_dp.zero_grad()
        o = ref_net(x, **fwd_kw)
        ref = criterion(*o, y) if isinstance(o, tuple) else criterion(o, y)
        _total(ref).backward()
        outputs = model(x, **fwd_kw)
        assert isinstance(outputs, list) and len(outputs) <= k
        loss = crit(outputs, y)
        _total(loss).backward()
        out.append((ref, loss, grads(ref_net), grads(dp_net)))
        opt_ref.step(), opt_dp.step()
    return out, ref_net, dp_net


def _total(loss):
    return sum(loss.values()) if isinstance(loss, dict) else loss.sum()  # sum: reduction='none'


def assert_same(ref, loss, gref, gdp, tol=1e-6):
    if isinstance(ref, dict):
        assert ref.keys() == loss.keys()
        for key in ref:
            assert rel(loss[key], ref[key]) <= tol, key
    else:
        assert loss.shape == ref.shape
        assert rel(loss, ref) <= tol
    assert len(gref) == len(gdp) > 0
    for a, b in zip(gdp, gref):
        assert rel(a, b) <= tol


@pytest.mark.parametrize(
    "k,batch,model_kw",
    [
        (3, 11, {}),  # uneven default split 4/4/3
        (2, 9, {}),
        (3, 12, {"chunk_sizes": [2, 6, 4]}),  # explicit sizes
        (3, 10, {"chunk_sizes": [1, 2, 2]}),  # proportions, rescaled to the batch
        (3, 11, {"chunk_sizes": [0, 6, 5]}),  # device 0 left out
        (4, 13, {"gpu0_bsz": 1}),  # BalancedDataParallel-style
        (4, 2, {}),  # batch smaller than the device count
        (3, 1, {"gpu0_bsz": 0}),
    ],
)
def test_training_matches_single_device(k, batch, model_kw):
    net = Net()
    x, y = torch.randn(7, batch).t(), torch.randint(0, 5, (batch,))  # non-contiguous input
    steps, ref_net, dp_net = run_pair(net, nn.CrossEntropyLoss(), x, y, k, model_kw=model_kw, steps=3)
    for ref, loss, gref, gdp in steps:
        assert_same(ref, loss, gref, gdp)
    for a, b in zip(dp_net.parameters(), ref_net.parameters()):
        assert rel(a, b) <= 1e-6
    assert not torch.equal(next(dp_net.parameters()), next(net.parameters()))  # it trained
    assert steps[-1][1] < steps[0][1]


def test_encoding_style_script():
    # The usage of the encoding.parallel write-ups, with only the import changed.
    model, loss_function = Net(out="tuple"), TupleLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    parallel_model = DataParallelModel(model, device_ids=["cpu"] * 3)
    parallel_loss = DataParallelCriterion(loss_function, device_ids=["cpu"] * 3)
    inputs, labels = torch.randn(10, 7), torch.randint(0, 5, (10,))
    losses = []
    for _ in range(4):
        predictions = parallel_model(inputs)
        loss = parallel_loss(predictions, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    output_1, output_2 = zip(*predictions)  # per-device tuples, as in the write-up
    assert len(output_1) == 3 and all(o.shape[1] == 5 for o in output_2)
    assert losses[-1] < losses[0]


def test_batch_dim_1():
    # sequence-first tensors [T, B, D]: split along dim 1 in the model and the criterion
    net = nn.Linear(7, 5)
    x, y = torch.randn(4, 11, 7), torch.randint(0, 5, (4, 11))
    model = DataParallelModel(net, device_ids=["cpu"] * 3, dim=1)
    crit = DataParallelCriterion(
        Lambda(lambda o, t: nn.functional.cross_entropy(o.transpose(1, 2), t)), device_ids=["cpu"] * 3, dim=1
    )
    outs = model(x)
    assert [o.shape for o in outs] == [(4, 4, 5), (4, 4, 5), (4, 3, 5)]
    ref = nn.functional.cross_entropy(net(x).transpose(1, 2), y)
    assert rel(crit(outs, y), ref) <= 1e-6


def test_chunk_layout():
    model = DataParallelModel(Net(), device_ids=["cpu"] * 4, gpu0_bsz=2)
    assert [o.shape[0] for o in model(torch.randn(17, 7))] == [2, 5, 5, 5]
    model = DataParallelModel(Net(), device_ids=["cpu"] * 4)
    assert [o.shape[0] for o in model(torch.randn(3, 7))] == [1, 1, 1]
    model = DataParallelModel(Net(), device_ids=["cpu"] * 3, chunk_sizes=[1, 2, 3])
    assert [o.shape[0] for o in model(torch.randn(12, 7))] == [2, 4, 6]


@pytest.mark.parametrize("out,criterion", [("tuple", TupleLoss()), ("dict", DictLoss())])
def test_tuple_and_dict_outputs(out, criterion):
    net = Net(out=out)
    x, y = torch.randn(10, 7), torch.randint(0, 5, (10,))
    (step,), _, _ = run_pair(net, criterion, x, y, 3)
    assert_same(*step)


def test_keyword_inputs_are_split():
    x, y = torch.randn(11, 7), torch.randint(0, 5, (11,))
    mask = torch.rand(11, 7)
    (step,), _, _ = run_pair(Net(), nn.CrossEntropyLoss(), x, y, 3, fwd_kw={"mask": mask})
    assert_same(*step)
    net = Net()
    model = DataParallelModel(net, device_ids=["cpu"] * 3)
    only_kw = model(x=x, mask=mask)  # every tensor passed by keyword
    assert [o.shape[0] for o in only_kw] == [4, 4, 3]
    assert rel(torch.cat(only_kw), net(x, mask=mask)) <= 1e-6


class SegNet(nn.Module):
    def __init__(self, classes=6):
        super().__init__()
        self.conv = nn.Conv2d(3, classes, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


@pytest.mark.parametrize(
    "make",
    [
        lambda w: nn.CrossEntropyLoss(ignore_index=255),
        lambda w: nn.CrossEntropyLoss(ignore_index=255, weight=w),
        lambda w: nn.CrossEntropyLoss(ignore_index=255, weight=w, label_smoothing=0.1),
        lambda w: nn.NLLLoss(ignore_index=255, weight=w),
    ],
)
def test_ignore_index_weighted_ce(make):
    # Segmentation-like: per-pixel targets with a very uneven share of ignored pixels per
    # device, so the unweighted mean of per-device means would be far off.
    x = torch.randn(7, 3, 5, 9)
    y = torch.randint(0, 6, (7, 5, 9))
    y[:3][torch.rand(3, 5, 9) < 0.8] = 255
    y[5] = 255  # the last device (samples 5, 6) ...
    y[6] = 255  # ... has no valid pixel at all: NaN mean with weight 0 must add nothing
    criterion = make(torch.rand(6) + 0.5)
    net = SegNet()
    if isinstance(criterion, nn.NLLLoss):
        net = nn.Sequential(net, nn.LogSoftmax(dim=1))
    (step,), _, _ = run_pair(net, criterion, x, y, 3)
    assert_same(*step)
    (legacy,), _, _ = run_pair(net, criterion, x, y, 3, crit_kw={"legacy_mean": True})
    assert torch.isnan(legacy[1])  # encoding's unweighted mean: the all-ignored device poisons it


def test_soft_targets_and_reductions():
    x = torch.randn(8, 7)
    probs = torch.softmax(torch.randn(8, 5), 1)
    (step,), _, _ = run_pair(Net(), nn.CrossEntropyLoss(), x, probs, 3)
    assert_same(*step)
    y = torch.randint(0, 5, (8,))
    (step,), _, _ = run_pair(Net(), nn.CrossEntropyLoss(reduction="sum"), x, y, 3)
    assert_same(*step)
    (step,), _, _ = run_pair(Net(), nn.CrossEntropyLoss(reduction="none"), x, y, 3)
    assert step[1].shape == (8,)
    assert rel(step[1], step[0]) <= 1e-6


def test_criterion_reported_weights():
    class Weighted(nn.Module):  # a mean over positive targets only, reporting its count
        def forward(self, out, target, as_dict=False):
            keep = target > 1
            count = keep.sum()
            loss = (nn.functional.cross_entropy(out, target, reduction="none") * keep).sum() / count
            return {"loss": loss, "weight": count} if as_dict else WeightedLoss(loss, count)

    net = DataParallelModel(Net(), device_ids=["cpu"] * 3)
    x, y = torch.randn(13, 7), torch.randint(0, 5, (13,))
    y[:5] = 0
    ref = nn.functional.cross_entropy(net.module(x)[y > 1], y[y > 1])
    crit = DataParallelCriterion(Weighted(), device_ids=["cpu"] * 3)
    assert rel(crit(net(x), y), ref) <= 1e-6
    got = crit(net(x), y, as_dict=True)
    assert set(got) == {"loss"} and rel(got["loss"], ref) <= 1e-6


def test_ignore_index_attribute_rule():
    class RowLoss(nn.Module):  # like ShardedSoftmaxLoss: mean over rows whose label is not ignored
        reduction, ignore_index = "mean", -1

        def forward(self, out, labels):
            valid = labels != self.ignore_index
            return nn.functional.cross_entropy(out[valid], labels[valid], reduction="sum") / valid.sum()

    net = DataParallelModel(Net(), device_ids=["cpu"] * 3)
    x, y = torch.randn(14, 7), torch.randint(0, 5, (14,))
    y[:4] = -1
    ref = RowLoss()(net.module(x), y)
    assert rel(DataParallelCriterion(RowLoss(), device_ids=["cpu"] * 3)(net(x), y), ref) <= 1e-6


def test_legacy_mean_is_unweighted():
    net = DataParallelModel(Net(), device_ids=["cpu"] * 3, chunk_sizes=[2, 4, 5])
    x, y = torch.randn(11, 7), torch.randint(0, 5, (11,))
    outs = net(x)
    loss = DataParallelCriterion(nn.CrossEntropyLoss(), device_ids=["cpu"] * 3, legacy_mean=True)(outs, y)
    parts = [nn.functional.cross_entropy(o, t) for o, t in zip(outs, y.split([2, 4, 5]))]
    assert rel(loss, sum(parts) / 3) <= 1e-6


@pytest.mark.parametrize("batch,n", [(6, 4), (5, 4), (4, 3), (12, 4), (3, 4), (11, 3)])
def test_torch_split_with_legacy_mean_reproduces_encoding(batch, n):
    # encoding.parallel splits as nn.DataParallel does (Tensor.chunk: ceil(B / n) per device
    # while samples last) and averages the per-device losses: split="torch" with legacy_mean=True
    # gives that loss and gradient exactly.
    torch.manual_seed(batch * 10 + n)
    net = Net().body
    x, y = torch.randn(batch, 7), torch.randint(0, 5, (batch,))
    model = DataParallelModel(net, device_ids=["cpu"] * n, split="torch")
    outs = model(x)
    assert [o.shape[0] for o in outs] == [c.shape[0] for c in x.chunk(n)]
    loss = DataParallelCriterion(nn.CrossEntropyLoss(), device_ids=["cpu"] * n, legacy_mean=True)(outs, y)
    loss.backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    parts = [nn.functional.cross_entropy(net(a), b) for a, b in zip(x.chunk(n), y.chunk(n))]
    expected = sum(parts) / len(parts)
    expected.backward()
    assert rel(loss, expected) <= 1e-6
    for g, p in zip(grads, net.parameters()):
        assert rel(g, p.grad) <= 1e-5


def test_split_argument_checks():
    with pytest.raises(ValueError, match="argument `split` must be 'balanced' or 'torch'"):
        DataParallelModel(Net(), device_ids=["cpu"] * 2, split="even")
    with pytest.raises(ValueError, match="excludes `chunk_sizes` and `gpu0_bsz`"):
        DataParallelModel(Net(), device_ids=["cpu"] * 2, split="torch", gpu0_bsz=1)


def test_a_cross_entropy_subclass_with_its_own_forward_is_warned_once():
    # encoding's SegmentationLosses(se_loss=True) adds a per-image term to a CrossEntropyLoss:
    # weighing by valid pixels is then not exact, and DataParallelCriterion says so, once.
    class CEWithImageTerm(nn.CrossEntropyLoss):
        def forward(self, logits, target):
            return super().forward(logits, target) + logits.mean()

    class PlainSubclass(nn.CrossEntropyLoss):
        pass

    net = DataParallelModel(Net(), device_ids=["cpu"] * 2)
    x, y = torch.randn(6, 7), torch.randint(0, 5, (6,))
    with pytest.warns(UserWarning, match="CEWithImageTerm has a forward of its own"):
        DataParallelCriterion(CEWithImageTerm(), device_ids=["cpu"] * 2)(net(x), y)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DataParallelCriterion(CEWithImageTerm(), device_ids=["cpu"] * 2)(net(x), y)  # once per class
        DataParallelCriterion(PlainSubclass(), device_ids=["cpu"] * 2)(net(x), y)
        DataParallelCriterion(nn.CrossEntropyLoss(), device_ids=["cpu"] * 2)(net(x), y)
        DataParallelCriterion(CEWithImageTerm(), device_ids=["cpu"] * 2, legacy_mean=True)(net(x), y)


def test_worker_exception_propagates_with_traceback():
    class Fails(nn.Module):
        def forward(self, out, target):
            if out.shape[0] == 3:  # only the last chunk (sizes 4, 4, 3)
                raise_in_worker()
            return out.sum()

    def raise_in_worker():
        raise ValueError(f"bad chunk in {threading.current_thread().name}")

    net = DataParallelModel(Net(), device_ids=["cpu"] * 3)
    crit = DataParallelCriterion(Fails(), device_ids=["cpu"] * 3)
    with pytest.raises(ValueError, match="bad chunk in shardkit-parallel-2") as info:
        crit(net(torch.randn(11, 7)), torch.randint(0, 5, (11,)))
    tb = "".join(traceback.format_exception(info.value))
    assert "raise_in_worker" in tb and "chunk 2 of 3" in tb  # original frames + note naming the device
    with pytest.raises(ZeroDivisionError):  # model workers too
        DataParallelModel(nn.Sequential(Lambda(lambda x: 1 / 0)), device_ids=["cpu"] * 2)(torch.randn(4, 2))


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *a, **k):
        return self.fn(*a, **k)


def test_autocast_and_grad_mode_carried_into_workers():
    seen = []

    def probe(out, target):
        seen.append(
            (
                threading.current_thread().name,
                torch.is_autocast_enabled("cpu"),
                torch.get_autocast_dtype("cpu"),
                torch.is_grad_enabled(),
            )
        )
        return nn.functional.cross_entropy(out, target)

    net = DataParallelModel(Net(), device_ids=["cpu"] * 3)
    crit = DataParallelCriterion(Lambda(probe), device_ids=["cpu"] * 3)
    x, y = torch.randn(9, 7), torch.randint(0, 5, (9,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = net(x)
        loss = crit(outs, y)
    assert all(o.dtype == torch.bfloat16 for o in outs)  # the model's workers ran under autocast
    assert len(seen) == 3 and len({s[0] for s in seen}) == 3  # three threads
    assert all(s[1:] == (True, torch.bfloat16, True) for s in seen)
    loss.backward()
    seen.clear()
    with torch.no_grad():
        loss = crit(net(x), y)
    assert not loss.requires_grad and len(seen) == 3 and not any(s[1] or s[3] for s in seen)
    seen.clear()
    with torch.inference_mode():
        loss = crit(net(x), y)
    assert loss.is_inference() and len(seen) == 3 and not any(s[3] for s in seen)


def test_direct_and_single_device_modes(monkeypatch):
    net, x, y = Net(), torch.randn(6, 7), torch.randint(0, 5, (6,))
    ref = nn.functional.cross_entropy(net(x), y)
    one = DataParallelModel(net, device_ids=["cpu"])
    out = one(x)
    assert isinstance(out, torch.Tensor)  # encoding.parallel: one device, no list
    assert rel(DataParallelCriterion(nn.CrossEntropyLoss(), device_ids=["cpu"])(out, y), ref) <= 1e-6
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    direct = DataParallelModel(net)
    assert direct.device_ids == [] and direct.module is net
    out = direct(x)
    assert isinstance(out, torch.Tensor)
    assert rel(DataParallelCriterion(nn.CrossEntropyLoss())(out, y), ref) <= 1e-6
    gpu_ids = DataParallelModel(net, device_ids=[0, 1])  # no GPU: direct calls, as nn.DataParallel
    assert gpu_ids.device_ids == [] and rel(gpu_ids(x), net(x)) == 0
    for repeated in ([0, 0], ["cuda", "cuda"], ["cuda:1"]):  # repeated or single ids are dropped too
        model, crit = (
            DataParallelModel(net, device_ids=repeated),
            DataParallelCriterion(nn.CrossEntropyLoss(), repeated),
        )
        assert model.device_ids == [] and crit.device_ids == []
        assert rel(crit(model(x), y), ref) <= 1e-6
    tup = DataParallelModel(Net(out="tuple"))
    assert torch.isfinite(DataParallelCriterion(TupleLoss())(tup(x), y))


def test_data_parallel_compatibility():
    net = Net()
    model = DataParallelModel(net, device_ids=["cpu"] * 2)
    assert isinstance(model, nn.DataParallel) and model.module is net
    assert all(k.startswith("module.") for k in model.state_dict())
    assert model.dim == 0 and model.output_device == torch.device("cpu") and len(model.device_ids) == 2
    assert shardkit.parallel.DataParallelCriterion is DataParallelCriterion


def test_bad_inputs_get_clear_errors():
    net3 = DataParallelModel(Net(), device_ids=["cpu"] * 3)
    outs = net3(torch.randn(9, 7))
    crit3 = DataParallelCriterion(nn.CrossEntropyLoss(), device_ids=["cpu"] * 3)
    with pytest.raises(ValueError, match="batch size 9 along dim 0"):
        crit3(outs, torch.randint(0, 5, (8,)))
    with pytest.raises(ValueError, match="got 3 per-device outputs but has 2 devices.*same device_ids"):
        DataParallelCriterion(nn.CrossEntropyLoss(), device_ids=["cpu"] * 2)(outs, torch.randint(0, 5, (9,)))
    with pytest.raises(TypeError, match="expects the list of per-device outputs"):
        crit3(torch.randn(9, 5), torch.randint(0, 5, (9,)))
    with pytest.raises(ValueError, match="batch size 9 along dim 0.*0-dim"):
        net3(torch.randn(9, 7), mask=torch.tensor(1.0))
    with pytest.raises(ValueError, match="`chunk_sizes` must hold one size per device"):
        DataParallelModel(Net(), device_ids=["cpu"] * 3, chunk_sizes=[1, 2])
    with pytest.raises(ValueError, match="`chunk_sizes` must be non-negative"):
        DataParallelModel(Net(), device_ids=["cpu"] * 2, chunk_sizes=[-1, 2])
    with pytest.raises(ValueError, match="`chunk_sizes` and `gpu0_bsz` are exclusive"):
        DataParallelModel(Net(), device_ids=["cpu"] * 2, chunk_sizes=[1, 2], gpu0_bsz=1)
    with pytest.raises(ValueError, match="`gpu0_bsz` must be a non-negative int"):
        DataParallelModel(Net(), device_ids=["cpu"] * 2, gpu0_bsz=-3)
    with pytest.raises(ValueError, match="`device_ids` mixes device types"):
        DataParallelModel(Net(), device_ids=["cpu", "cuda:0"])
    with pytest.raises(ValueError, match="`device_ids` must not be empty"):
        DataParallelModel(Net(), device_ids=[])
    with pytest.raises(ValueError, match="`output_device`"):
        DataParallelModel(Net(), device_ids=["cpu"] * 2, output_device="cuda:0")
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        net3(3.0)
    with pytest.raises(ValueError, match="model output 1 holds no tensor with a batch dimension"):
        crit3([outs[0], torch.tensor(1.0)], torch.randint(0, 5, (3,)))
    with pytest.raises(ValueError, match="model output 0 is on meta, which is not in its device_ids"):
        crit3([torch.empty(3, 5, device="meta")], torch.randint(0, 5, (3,)))
    with pytest.raises(RuntimeError, match=r"parameters and buffers on device_ids\[0\] \(cpu\), found one on meta"):
        DataParallelModel(nn.Linear(7, 2, device="meta"), device_ids=["cpu"] * 2)(torch.randn(4, 7))
    with pytest.raises(TypeError, match="`device_ids` must be a list of devices"):
        DataParallelModel(Net(), device_ids="cpu")
    with pytest.raises(
        TypeError, match="`outputs` must be the list of per-device outputs.*returns its module's output"
    ):
        gather(DataParallelModel(nn.Linear(7, 2), device_ids=["cpu"])(torch.randn(4, 7)), "cpu")  # one device
    shape_varies = DataParallelCriterion(Lambda(lambda out, t: out.sum(0)[: out.shape[0]]), device_ids=["cpu"] * 3)
    with pytest.raises(ValueError, match="losses of shapes .*must be a scalar.*reduction='none'"):
        shape_varies(net3(torch.randn(8, 7)), torch.randint(0, 5, (8,)))  # chunks 3, 3, 2
    with pytest.raises(ValueError, match="different structures on different devices"):
        DataParallelCriterion(
            Lambda(lambda out, t: {"a": out.sum()} if out.shape[0] == 3 else out.sum()), device_ids=["cpu"] * 3
        )(net3(torch.randn(8, 7)), torch.randint(0, 5, (8,)))


def test_gather_helper():
    net = DataParallelModel(Net(out="dict"), device_ids=["cpu"] * 3)
    x = torch.randn(8, 7)
    got = gather(net(x), "cpu")
    ref = net.module(x)
    assert rel(got["logits"], ref["logits"]) <= 1e-6 and got["aux"].shape == (8, 5)


def test_profiler_ranges_appear_only_under_the_profiler():
    # The forward ranges are recorded while a profiler runs (and skipped otherwise, for speed).
    net = DataParallelModel(Net(), device_ids=["cpu"] * 2)
    crit = DataParallelCriterion(nn.CrossEntropyLoss(), device_ids=["cpu"] * 2)
    x, y = torch.randn(6, 7), torch.randint(0, 5, (6,))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        crit(net(x), y).backward()
    names = {e.name for e in prof.events()}
    assert {"shardkit.DataParallelModel.forward", "shardkit.DataParallelCriterion.forward"} <= names
    assert not torch._C._autograd._profiler_enabled()
