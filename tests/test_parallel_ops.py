"""shardkit.parallel's operators (weighted_loss_reduce, split_to_devices: opcheck, gradcheck,
float64 references, errors) and its SyncBN support (allreduce, replication callbacks)."""

import copy

import pytest
import torch
from torch import nn

import shardkit
from shardkit.parallel import DataParallelModel, allreduce, patch_replication_callback


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def test_replication_callbacks():
    calls = []

    class Sync(nn.Module):
        def __data_parallel_replicate__(self, ctx, copy_id):
            calls.append((id(ctx), copy_id))

        def forward(self, x, *rest):
            return x.sum()

    model = DataParallelModel(nn.Sequential(nn.Linear(3, 3), Sync()), device_ids=["cpu"] * 3)
    model(torch.randn(5, 3))
    assert [c for _, c in calls] == [0, 1, 2] and len({i for i, _ in calls}) == 1

    class CopyingDP(nn.DataParallel):  # a customised DataParallel that replicates by copying
        def replicate(self, module, device_ids):
            return [copy.deepcopy(module) for _ in device_ids]

    calls.clear()
    dp = CopyingDP(Sync(), device_ids=None)
    patch_replication_callback(dp)
    patch_replication_callback(dp)  # patching twice does not run the callbacks twice
    dp.replicate(dp.module, [0, 1])
    assert [c for _, c in calls] == [0, 1] and len({i for i, _ in calls}) == 1
    with pytest.raises(TypeError, match="`data_parallel` must be an nn.DataParallel"):
        patch_replication_callback(nn.Linear(2, 2))


def test_allreduce_sums_groups_with_gradients():
    groups = [(torch.randn(4, dtype=torch.float64, requires_grad=True),
               torch.randn(2, 3, dtype=torch.float64, requires_grad=True)) for _ in range(3)]
    flat = [t for g in groups for t in g]
    out = allreduce(2, *flat)
    assert len(out) == 6
    for k in range(3):
        assert torch.allclose(out[2 * k], sum(g[0] for g in groups))
        assert torch.allclose(out[2 * k + 1], sum(g[1] for g in groups))
    torch.autograd.gradcheck(lambda *ts: allreduce(2, *ts), flat)
    with pytest.raises(ValueError, match="groups of `num_inputs`=2"):
        allreduce(2, *flat[:3])


# ---- ops ----------------------------------------------------------------------------

def test_ops_opcheck_and_gradcheck():
    cpu = torch.device("cpu")
    for losses, weights, norm in [
        ([torch.randn((), requires_grad=True) for _ in range(3)], [torch.tensor(3), torch.tensor(2.5), torch.tensor(7)], True),
        ([torch.randn(4, requires_grad=True) for _ in range(2)], [torch.tensor([2.0]), torch.tensor(5.0)], False),
        ([torch.randn((), dtype=torch.bfloat16) for _ in range(4)], [torch.tensor(i + 1) for i in range(4)], True),
        ([torch.randn((), dtype=torch.float64, requires_grad=True)], [torch.tensor(1.0)], True),
    ]:
        torch.library.opcheck(torch.ops.shardkit.weighted_loss_reduce, (losses, weights, cpu, norm))
        ref = sum(l.double() * w.double() for l, w in zip(losses, weights))
        if norm:
            ref = ref / sum(w.double() for w in weights)
        got = shardkit.ops.weighted_loss_reduce(losses, weights, cpu, norm)
        assert got.dtype == losses[0].dtype
        # bf16: fp32 accumulation, then ONE rounding to bf16 (relative error <= 2^-9)
        assert rel(got, ref) <= (2 ** -8 if got.dtype == torch.bfloat16 else 1e-6)
    ls = [torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    torch.autograd.gradcheck(lambda *l: shardkit.ops.weighted_loss_reduce(l, [2, 5, 1], "cpu"), ls)

    x = torch.randn(9, 4, 3)[:, ::2]  # non-contiguous
    for tensors, sizes, dim, n in [
        ([x, torch.randint(0, 5, (9,))], [4, 0, 5], 0, 3),
        ([torch.randn(2, 7).t()], [3, 4], 0, 2),
        ([torch.randn(5, 11, dtype=torch.float64, requires_grad=True)], [6, 1, 4], 1, 3),
        ([torch.randn(1, 3, requires_grad=True), torch.randn(1)], [1], 0, 1),
    ]:
        devices = [cpu] * n
        torch.library.opcheck(torch.ops.shardkit.split_to_devices, (tensors, sizes, dim, devices))
        pieces = shardkit.ops.split_to_devices(tensors, sizes, devices, dim)
        for i, t in enumerate(tensors):
            for p, r in zip([pc[i] for pc in pieces], t.split(sizes, dim)):
                assert torch.equal(p, r) and p.is_contiguous()
    t = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: tuple(p[0] for p in shardkit.ops.split_to_devices([t], [2, 0, 5], [cpu] * 3)), (t,))


def test_op_errors():
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match="`weights` must hold one weight per loss"):
        torch.ops.shardkit.weighted_loss_reduce([torch.randn(())], [], cpu, True)
    with pytest.raises(RuntimeError, match="`losses` must all have one shape"):
        torch.ops.shardkit.weighted_loss_reduce([torch.randn(()), torch.randn(2)], [torch.tensor(1)] * 2, cpu, True)
    with pytest.raises(RuntimeError, match="`losses` must be floating point"):
        torch.ops.shardkit.weighted_loss_reduce([torch.tensor(1)], [torch.tensor(1)], cpu, True)
    with pytest.raises(RuntimeError, match="`weights` must hold one-element tensors"):
        torch.ops.shardkit.weighted_loss_reduce([torch.randn(())], [torch.ones(2)], cpu, True)
    with pytest.raises(RuntimeError, match="`split_sizes` must hold one size per device"):
        torch.ops.shardkit.split_to_devices([torch.randn(3)], [1, 2], 0, [cpu])
    with pytest.raises(RuntimeError, match="`split_sizes` must be non-negative"):
        torch.ops.shardkit.split_to_devices([torch.randn(3)], [4, -1], 0, [cpu, cpu])
    with pytest.raises(RuntimeError, match="index 0 has size 3 along dim 0 but `split_sizes`"):
        torch.ops.shardkit.split_to_devices([torch.randn(3)], [1, 1], 0, [cpu, cpu])
