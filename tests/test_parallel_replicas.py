"""The per-step replicas of shardkit.parallel on CPU devices: the same structure torch's
replicate() gives on distinct GPUs (one module object per chunk, parameters from the
module, replica 0 with the module's buffers, the others with copies, replication
callbacks on each), so the CPU tests run the GPU users' path. Also the empty-input errors."""

import queue

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardkit.parallel import DataParallelCriterion, DataParallelModel, gather
from shardkit.parallel.replicate import share_replicas


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def test_share_replicas_structure():
    net = _net(0)
    reps = share_replicas(net, 3)
    assert len({id(r) for r in reps}) == 3 and all(r is not net for r in reps)
    for j, r in enumerate(reps):
        # parameters: the module's own Parameter objects, exposed as attributes like torch's replicas
        assert r[0].weight is net[0].weight and r[3].bias is net[3].bias
        assert list(r.parameters()) == []  # as torch's replicas: not registered parameters
        assert r[1] is not net[1]
        same_buffer = r[1].running_mean is net[1].running_mean
        assert same_buffer == (j == 0)
        torch.testing.assert_close(r[1].running_var, net[1].running_var, rtol=0, atol=0)


@pytest.mark.parametrize("k", [2, 3])
def test_batchnorm_statistics_come_from_chunk_zero(k):
    """As on GPUs: replica 0 updates the module's running statistics from its chunk, the
    other replicas' updates are dropped; the output of every chunk uses its own batch stats."""
    net, ref = _net(1), _net(1)
    x = torch.randn(4 * k + 1, 5)
    dp = DataParallelModel(net, device_ids=["cpu"] * k)
    outs = dp(x)
    sizes = [o.shape[0] for o in outs]
    ref_outs = [ref(chunk) for chunk in x.split(sizes)]  # one train-mode forward per chunk
    for got, want in zip(outs, ref_outs):
        torch.testing.assert_close(got, want)
    first = _net(1)
    first(x[: sizes[0]])
    torch.testing.assert_close(net[1].running_mean, first[1].running_mean)
    torch.testing.assert_close(net[1].running_var, first[1].running_var)
    assert int(net[1].num_batches_tracked) == 1


def test_gradients_accumulate_into_the_module():
    net, ref = _net(2), _net(2)
    x, y = torch.randn(11, 5), torch.randint(0, 3, (11,))
    dp = DataParallelModel(net, device_ids=["cpu"] * 3)
    crit = DataParallelCriterion(nn.CrossEntropyLoss(), device_ids=["cpu"] * 3)
    loss = crit(dp(x), y)
    loss.backward()
    sizes = [4, 4, 3]
    ref_loss = sum(F.cross_entropy(ref(xc), yc, reduction="sum") for xc, yc in zip(x.split(sizes), y.split(sizes))) / 11
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


class _Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.calls = []

    def __data_parallel_replicate__(self, ctx, copy_id):
        self.calls.append((id(self), copy_id))

    def forward(self, x):
        return self.lin(x)


def test_replication_callbacks_run_on_distinct_replicas():
    rec = _Recorder()
    DataParallelModel(rec, device_ids=["cpu"] * 3)(torch.randn(6, 2))
    # the replicas share the `calls` list (a shallow copy), each registers itself once
    assert sorted(c for _, c in rec.calls) == [0, 1, 2]
    assert len({i for i, _ in rec.calls}) == 3


class _SyncBN(nn.BatchNorm1d):
    """SyncBN in the style of encoding / Synchronized-BatchNorm-PyTorch: copy 0 waits for every
    other copy's batch statistics, sums them and hands the totals back."""

    def __data_parallel_replicate__(self, ctx, copy_id):
        self.copy_id = copy_id
        if copy_id == 0:
            ctx.inbox, ctx.outboxes = queue.Queue(), {}
        else:
            ctx.outboxes[copy_id] = queue.Queue()
        self.ctx = ctx

    def forward(self, x):
        if getattr(self, "ctx", None) is None:
            return super().forward(x)
        stats = torch.stack([x.sum(0), (x * x).sum(0), torch.full_like(x[0], x.shape[0])])
        if self.copy_id == 0:
            total = stats
            for _ in self.ctx.outboxes:
                total = total + self.ctx.inbox.get(timeout=30)  # a hang fails here instead
            for box in self.ctx.outboxes.values():
                box.put(total)
        else:
            self.ctx.inbox.put(stats)
            total = self.ctx.outboxes[self.copy_id].get(timeout=30)
        mean = total[0] / total[2]
        var = total[1] / total[2] - mean * mean
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


@pytest.mark.parametrize("devices", [["cpu"] * 2, ["cpu"] * 3])
def test_syncbn_replicas_on_a_shared_device_run_concurrently(devices):
    # Calls on one device ran in chunk order: copy 0 waited for statistics of copies that
    # could only start after it had finished (a deadlock).
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), _SyncBN(6)).double()
    x = torch.randn(9, 4, dtype=torch.float64)
    out = torch.cat(DataParallelModel(net, device_ids=devices)(x))
    whole = F.batch_norm(net[0](x), None, None, net[1].weight, net[1].bias, training=True, eps=net[1].eps)
    torch.testing.assert_close(out, whole, rtol=1e-10, atol=1e-12)


def test_criterion_with_state_is_replicated_on_cpu():
    weight = torch.rand(4) + 0.5
    crit = nn.CrossEntropyLoss(weight=weight)
    out = [torch.randn(3, 4), torch.randn(5, 4)]
    y = torch.randint(0, 4, (8,))
    got = DataParallelCriterion(crit, device_ids=["cpu"] * 2)(out, y)
    torch.testing.assert_close(got, F.cross_entropy(torch.cat(out), y, weight=weight))


def test_empty_inputs_are_clear_errors():
    dp = DataParallelModel(nn.Linear(3, 4), device_ids=["cpu"] * 2)
    with pytest.raises(ValueError, match="DataParallelModel: the batch is empty"):
        dp(torch.randn(0, 3))
    crit = DataParallelCriterion(nn.CrossEntropyLoss(), device_ids=["cpu"] * 2)
    with pytest.raises(ValueError, match="DataParallelCriterion: the model outputs hold 0 samples"):
        crit([torch.randn(0, 4)], torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="argument `outputs` must be a non-empty list"):
        gather([], "cpu")


def test_a_subclass_s_scatter_and_parallel_apply_hooks_are_called():
    # forward split the inputs itself, bypassing a subclass's scatter (a caption list then
    # reached every replica whole), and called parallel_apply with a `devices` keyword that
    # an override with nn.DataParallel's signature does not take.
    class Captioner(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, images, captions):
            assert len(captions) == images.shape[0], "one caption per image"
            return self.lin(images)

    calls, chunk_sizes = [], []

    class ListAware(DataParallelModel):
        def scatter(self, inputs, kwargs, device_ids):
            args, kws = super().scatter(inputs, kwargs, device_ids)
            sizes = [a[0].shape[0] for a in args]
            starts = [sum(sizes[:k]) for k in range(len(sizes))]
            calls.append("scatter")
            chunk_sizes.extend(sizes)
            return tuple((a[0], inputs[1][s : s + n]) for a, s, n in zip(args, starts, sizes)), kws

        def parallel_apply(self, replicas, inputs, kwargs):  # torch's signature
            calls.append("parallel_apply")
            return super().parallel_apply(replicas, inputs, kwargs)

    net = Captioner().double()
    images = torch.randn(7, 4, dtype=torch.float64)
    outs = ListAware(net, ["cpu"] * 3)(images, [f"caption {i}" for i in range(7)])
    assert calls == ["scatter", "parallel_apply"]
    # bit-exact against the layer run chunk by chunk (a matmul's rounding may depend on its row count)
    by_chunk = torch.cat([net.lin(c) for c in images.split(chunk_sizes)])
    torch.testing.assert_close(torch.cat(outs), by_chunk, rtol=0, atol=0)
