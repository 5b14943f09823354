"""DataParallelModel / DataParallelCriterion against torch's replicate() and encoding.parallel:
buffers shared by two sub-modules or requiring grad, the first chunk left out (gpu0_bsz=0),
"cpu:0" device ids, legacy_mean with reduction='sum', integer entries of a criterion's
dict, and a criterion over fewer devices than the model. float64 references on one device."""

import copy

import pytest
import torch
from torch import nn

from shardkit.parallel import DataParallelCriterion, DataParallelModel


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


class Writer(nn.Module):
    def __init__(self, state):
        super().__init__()
        self.register_buffer("state", state)

    def forward(self, x):
        self.state.copy_(x.mean(0).detach())  # a buffer updated in forward...
        return x


class Reader(nn.Module):
    def __init__(self, state):
        super().__init__()
        self.register_buffer("state", state)

    def forward(self, x):
        return x - self.state  # ...and read by another sub-module holding the same tensor


class SharedBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        state = torch.zeros(3, dtype=torch.float64)
        self.w, self.r = Writer(state), Reader(state)

    def forward(self, x):
        return self.r(self.w(x))


@pytest.mark.parametrize("k", [2, 3])
def test_a_buffer_shared_by_two_submodules_stays_shared_in_every_replica(k):
    x = torch.randn(3 * k + 1, 3, dtype=torch.float64)
    outs = DataParallelModel(SharedBuffer(), ["cpu"] * k)(x)
    for out, chunk in zip(outs, x.split([o.shape[0] for o in outs])):
        torch.testing.assert_close(out, SharedBuffer()(chunk), rtol=0, atol=0)


class ShiftBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3).double()
        self.register_buffer("shift", torch.randn(4, dtype=torch.float64).requires_grad_())

    def forward(self, x):
        return self.lin(x + self.shift)


@pytest.mark.parametrize("k", [2, 3])
def test_a_buffer_that_requires_grad_gets_every_chunks_gradient(k):
    m = ShiftBuffer()
    ref = copy.deepcopy(m)
    x, y = torch.randn(3 * k + 1, 4, dtype=torch.float64), torch.randint(0, 3, (3 * k + 1,))
    devices = ["cpu"] * k
    DataParallelCriterion(nn.CrossEntropyLoss(), devices)(DataParallelModel(m, devices)(x), y).backward()
    nn.functional.cross_entropy(ref(x), y).backward()
    assert rel(m.shift.grad, ref.shift.grad) <= 1e-12
    assert rel(m.lin.weight.grad, ref.lin.weight.grad) <= 1e-12
    with torch.no_grad():  # no graph to a buffer without grad mode
        assert all(not o.requires_grad for o in DataParallelModel(m, devices)(x))


@pytest.mark.parametrize("split", [{"gpu0_bsz": 0}, {"chunk_sizes": [0, 2, 3]}])
def test_first_chunk_left_out_leaves_the_batchnorm_statistics_as_on_gpus(split):
    """On GPUs the first device's replica (the one with the module's buffers) is dropped when
    its chunk is empty, so the running statistics miss the step; "cpu" lists do the same."""
    net = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4)).double()
    before = copy.deepcopy(net[1].state_dict())
    outs = DataParallelModel(net, ["cpu"] * 3, **split)(torch.randn(10, 5, dtype=torch.float64))
    assert len(outs) == 2
    for key, value in net[1].state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_a_subclass_replicate_of_two_arguments_still_works_with_the_first_chunk_left_out():
    calls = []

    class Mine(DataParallelModel):
        def replicate(self, module, device_ids):  # nn.DataParallel's signature
            calls.append(len(device_ids))
            return super().replicate(module, device_ids)

    net = nn.Linear(5, 4).double()
    outs = Mine(net, ["cpu"] * 3, gpu0_bsz=0)(torch.randn(10, 5, dtype=torch.float64))
    assert len(outs) == 2 and calls == [2]


@pytest.mark.parametrize("ids", [["cpu:0", "cpu:0"], [torch.device("cpu", 0)] * 3, ["cpu:0", "cpu"]])
def test_cpu_device_ids_with_an_index_are_plain_cpu(ids):
    net = nn.Linear(4, 3).double()
    ref = copy.deepcopy(net)
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    model = DataParallelModel(net, ids, output_device="cpu:0")
    assert model.device_ids == [torch.device("cpu")] * len(ids) and model.output_device == torch.device("cpu")
    loss = DataParallelCriterion(nn.CrossEntropyLoss(), ids)(model(x), y)
    torch.testing.assert_close(loss, nn.functional.cross_entropy(ref(x), y), rtol=1e-12, atol=0)


@pytest.mark.parametrize("k", [2, 3])
def test_legacy_mean_with_sum_reduction_is_encodings_sum_over_devices(k):
    net = nn.Linear(4, 3).double()
    x, y = torch.randn(3 * k - 1, 4, dtype=torch.float64), torch.randint(0, 3, (3 * k - 1,))
    model = DataParallelModel(net, ["cpu"] * k, split="torch")
    crit = DataParallelCriterion(nn.CrossEntropyLoss(reduction="sum"), ["cpu"] * k, legacy_mean=True)
    outs = model(x)
    # encoding.parallel: Reduce.apply(*outputs) / len(outputs), whatever the reduction
    parts = [nn.functional.cross_entropy(net(a), b, reduction="sum") for a, b in zip(x.chunk(k), y.chunk(k))]
    torch.testing.assert_close(crit(outs, y), sum(parts) / len(parts), rtol=1e-12, atol=0)
    plain = DataParallelCriterion(nn.CrossEntropyLoss(reduction="sum"), ["cpu"] * k)
    torch.testing.assert_close(plain(outs, y), sum(parts), rtol=1e-12, atol=0)


class LossAndCounts(nn.Module):
    def __init__(self, reduction="mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, logits, target):
        pred = logits.argmax(1)
        return {
            "loss": nn.functional.cross_entropy(logits, target, reduction=self.reduction),
            "correct": (pred == target).sum(),  # a count
            "per_class": torch.bincount(pred, minlength=3),  # counts of one shape on every device
        }


@pytest.mark.parametrize("k", [2, 3])
def test_integer_entries_are_counts_summed_over_the_devices(k):
    net = nn.Linear(4, 3).double()
    x, y = torch.randn(3 * k + 1, 4, dtype=torch.float64), torch.randint(0, 3, (3 * k + 1,))
    outs = DataParallelModel(net, ["cpu"] * k)(x)
    got = DataParallelCriterion(LossAndCounts(), ["cpu"] * k)(outs, y)
    want = LossAndCounts()(net(x), y)
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-12, atol=0)
    assert got["correct"].dtype == torch.int64 and int(got["correct"]) == int(want["correct"])
    assert torch.equal(got["per_class"], want["per_class"])
    none = DataParallelCriterion(LossAndCounts("none"), ["cpu"] * k)(outs, y)  # per-sample losses
    torch.testing.assert_close(none["loss"], LossAndCounts("none")(net(x), y)["loss"], rtol=1e-12, atol=0)
    assert int(none["correct"]) == int(want["correct"])


def test_a_bool_entry_is_refused_naming_its_key():
    class AllCorrect(nn.Module):
        def forward(self, logits, target):
            return {"loss": nn.functional.cross_entropy(logits, target), "all": (logits.argmax(1) == target).all()}

    outs = DataParallelModel(nn.Linear(4, 3), ["cpu"] * 2)(torch.randn(5, 4))
    with pytest.raises(ValueError, match=r"DataParallelCriterion: the entry \['all'\] .* torch.bool tensor"):
        DataParallelCriterion(AllCorrect(), ["cpu"] * 2)(outs, torch.randint(0, 3, (5,)))


def test_integer_entries_of_different_shapes_are_refused_naming_the_key():
    class Hist(nn.Module):
        def forward(self, logits, target):
            return {"loss": nn.functional.cross_entropy(logits, target), "hist": torch.bincount(target)}

    outs = DataParallelModel(nn.Linear(4, 3), ["cpu"] * 2)(torch.randn(6, 4))
    y = torch.tensor([0, 0, 0, 2, 2, 2])  # bincount lengths 1 and 3
    with pytest.raises(ValueError, match=r"the entry \['hist'\] holds integer tensors .* different shapes"):
        DataParallelCriterion(Hist(), ["cpu"] * 2)(outs, y)


@pytest.mark.parametrize("ids", [None, ["cpu"]])
def test_a_criterion_over_fewer_devices_than_the_model_names_device_ids(ids):
    outs = DataParallelModel(nn.Linear(4, 3), ["cpu"] * 3)(torch.randn(7, 4))
    crit = DataParallelCriterion(nn.CrossEntropyLoss(ignore_index=-1), ids)
    with pytest.raises(ValueError, match=r"DataParallelCriterion over .* got a list of 3 outputs .* same device_ids"):
        crit(outs, torch.randint(0, 3, (7,)))


def test_a_list_input_that_fails_in_the_direct_mode_gets_a_note():
    outs = DataParallelModel(nn.Linear(4, 3), ["cpu"] * 2)(torch.randn(1, 4))  # one chunk: a list of one
    with pytest.raises(TypeError) as info:
        DataParallelCriterion(nn.CrossEntropyLoss(), None)(outs, torch.randint(0, 3, (1,)))
    assert "give both the same device_ids" in "".join(getattr(info.value, "__notes__", []))


def test_a_direct_criterion_taking_a_list_still_works():
    """A criterion whose input is a list (deep supervision: every element the whole batch)."""

    class DeepSupervision(nn.Module):
        def forward(self, preds, target):
            return sum(nn.functional.cross_entropy(p, target) for p in preds)

    preds, y = [torch.randn(5, 3), torch.randn(5, 3)], torch.randint(0, 3, (5,))
    got = DataParallelCriterion(DeepSupervision(), None)(preds, y)
    torch.testing.assert_close(got, DeepSupervision()(preds, y))


def test_seeded_randomness_repeats_on_a_repeated_device_list():
    # Calls sharing a device (its random generator) ran concurrently: dropout in the model and
    # PartialFC sampling in a shared head drew in thread-timing order (17 of 30 seeded calls differed).
    import shardkit

    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 8))
    model = DataParallelModel(net, device_ids=["cpu"] * 4)
    xb = torch.randn(32, 16)
    outs = set()
    for _ in range(12):
        torch.manual_seed(1)
        outs.add(torch.cat(model(xb)).sum().item())
    assert len(outs) == 1
    head = shardkit.ShardedSoftmaxLoss(16, 400, devices=["cpu", "cpu"], sample_rate=0.1)
    crit = DataParallelCriterion(head, device_ids=["cpu", "cpu"])
    x, y = torch.randn(64, 16), torch.randint(0, 400, (64,))
    losses = set()
    for _ in range(12):
        head.sample_generator = torch.Generator().manual_seed(1)
        losses.add(crit(list(x.split(32)), y).item())
    assert len(losses) == 1


def test_a_stateless_criterion_on_distinct_devices_stays_concurrent(monkeypatch):
    # The shared-criterion ordering (for a head spread over devices, with its sample_generator)
    # caught every criterion without state too, serializing CrossEntropyLoss across GPUs.
    from shardkit.parallel import data_parallel

    seen = []
    real = data_parallel.run_parallel

    def spy(calls, devices, owner, labels=None, after=None):
        seen.append((owner, list(after) if after is not None else None))
        return real(calls, devices, owner, labels, after)

    monkeypatch.setattr(data_parallel, "run_parallel", spy)
    monkeypatch.setattr(data_parallel, "same_device_order", lambda devices: [None] * len(devices))  # as distinct GPUs
    net = nn.Linear(4, 3).double()
    x, y = torch.randn(9, 4, dtype=torch.float64), torch.randint(0, 3, (9,))
    DataParallelCriterion(nn.CrossEntropyLoss(), ["cpu"] * 3)(DataParallelModel(net, ["cpu"] * 3)(x), y)
    assert seen == [("DataParallelModel", [None] * 3), ("DataParallelCriterion", [None] * 3)]
