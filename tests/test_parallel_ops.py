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
    groups = [
        (
            torch.randn(4, dtype=torch.float64, requires_grad=True),
            torch.randn(2, 3, dtype=torch.float64, requires_grad=True),
        )
        for _ in range(3)
    ]
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
        (
            [torch.randn((), requires_grad=True) for _ in range(3)],
            [torch.tensor(3), torch.tensor(2.5), torch.tensor(7)],
            True,
        ),
        ([torch.randn(4, requires_grad=True) for _ in range(2)], [torch.tensor([2.0]), torch.tensor(5.0)], False),
        ([torch.randn((), dtype=torch.bfloat16) for _ in range(4)], [torch.tensor(i + 1) for i in range(4)], True),
        ([torch.randn((), dtype=torch.float64, requires_grad=True)], [torch.tensor(1.0)], True),
    ]:
        torch.library.opcheck(torch.ops.shardkit.weighted_loss_reduce, (losses, weights, cpu, norm))
        ref = sum(l.double() * w.double() for l, w in zip(losses, weights))
        scale = sum((l.double() * w.double()).abs() for l, w in zip(losses, weights))  # cancellation-free size
        if norm:
            ref = ref / sum(w.double() for w in weights)
            scale = scale / sum(w.double() for w in weights)
        got = shardkit.ops.weighted_loss_reduce(losses, weights, cpu, norm)
        assert got.dtype == losses[0].dtype
        # bf16: fp32 accumulation, then ONE rounding to bf16 (relative error <= 2^-9 of the
        # result); fp32/fp64: the rounding of each term, relative to the terms' size (the sum
        # of random losses may cancel, which no accumulation order avoids)
        if got.dtype == torch.bfloat16:
            assert rel(got, ref) <= 2**-8
        else:
            assert ((got.double() - ref).abs() <= 1e-6 * scale).all(), (got, ref)
    ls = [torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    torch.autograd.gradcheck(lambda *l: shardkit.ops.weighted_loss_reduce(l, [2, 5, 1], "cpu"), ls)
    # float64 losses keep float64 precision with weights that float32 would round (gradcheck's
    # tolerance would not notice a float32 scale)
    ws = [0.3, 0.7, torch.tensor(0.11, dtype=torch.float64)]
    got = shardkit.ops.weighted_loss_reduce(ls, ws, "cpu")
    got.sum().backward()
    total = 0.3 + 0.7 + 0.11
    assert rel(got, (ls[0] * 0.3 + ls[1] * 0.7 + ls[2] * 0.11) / total) <= 1e-14
    for l, w in zip(ls, [0.3, 0.7, 0.11]):
        assert rel(l.grad, torch.full_like(l, w / total)) <= 1e-14

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
    torch.autograd.gradcheck(
        lambda t: tuple(p[0] for p in shardkit.ops.split_to_devices([t], [2, 0, 5], [cpu] * 3)), (t,)
    )


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


# ---- real GPU (one is enough) -----------------------------------------------------------


@pytest.mark.gpu
def test_gpu_ops_across_host_and_device():
    """Both ops with CUDA tensors, host tensors and both as sources / destinations; a
    NaN loss of weight 0 (a chunk whose targets are all ignored) adds nothing."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    losses = [
        torch.randn((), device=cuda, requires_grad=True),
        torch.randn((), requires_grad=True),
        torch.randn((), device=cuda, dtype=torch.float64, requires_grad=True),
    ]
    # device counts (int64 on the GPU, as the criterion computes them) and host numbers
    weights = [torch.tensor(4, device=cuda), torch.tensor(2.5), torch.tensor(3.0, device=cuda)]
    for out in (cuda, cpu):
        torch.library.opcheck(torch.ops.shardkit.weighted_loss_reduce, (losses, weights, out, True))
        got = shardkit.ops.weighted_loss_reduce(losses, weights, out)
        ref = sum(l.detach().double().cpu() * w.double().cpu() for l, w in zip(losses, weights)) / 9.5
        assert got.device == out and got.dtype == torch.float64 and rel(got, ref) <= 1e-12
        for l in losses:
            l.grad = None
        got.backward()
        for l, w in zip(losses, weights):  # each gradient rounded once to its loss's dtype
            tol = 1e-12 if l.dtype == torch.float64 else 1e-7
            assert l.grad.device == l.device and l.grad.dtype == l.dtype
            assert rel(l.grad, w.double().cpu() / 9.5) <= tol
    nan = torch.full((), float("nan"), device=cuda, requires_grad=True)
    got = shardkit.ops.weighted_loss_reduce([losses[0], nan], [weights[0], torch.tensor(0, device=cuda)], cuda)
    got.backward()
    assert torch.isfinite(got) and rel(got, losses[0].detach()) <= 1e-6 and nan.grad.item() == 0.0

    x = torch.randn(9, 6, 3).pin_memory()[:, ::2]  # pinned host memory, non-contiguous
    labels = torch.randint(0, 5, (9,), device=cuda)
    devices = [cuda, cuda, cpu]
    torch.library.opcheck(torch.ops.shardkit.split_to_devices, ([x, labels], [4, 0, 5], 0, devices))
    pieces = shardkit.ops.split_to_devices([x, labels], [4, 0, 5], devices)
    for i, t in enumerate([x, labels]):
        for piece, dev, r in zip([pc[i] for pc in pieces], devices, t.split([4, 0, 5])):
            assert piece.device == dev and piece.is_contiguous() and torch.equal(piece.cpu(), r.cpu())
    host = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    dev = torch.randn(3, 7, dtype=torch.float64, device=cuda, requires_grad=True)
    torch.autograd.gradcheck(
        lambda h, d: (
            tuple(p[0] * (k + 1) for k, p in enumerate(shardkit.ops.split_to_devices([h], [2, 0, 5], devices)))
            + tuple(p[0] for p in shardkit.ops.split_to_devices([d], [3, 4], [cpu, cuda], 1))
        ),
        (host, dev),
    )


@pytest.mark.gpu
def test_gpu_allreduce():
    groups = [
        tuple(torch.randn(n, dtype=torch.float64, device=d, requires_grad=True) for n in (4, 3))
        for d in ("cuda", "cpu", "cuda")
    ]
    flat = [t for g in groups for t in g]
    out = allreduce(2, *flat)
    for k, g in enumerate(groups):
        for j in range(2):
            assert out[2 * k + j].device == g[j].device
            assert rel(out[2 * k + j].cpu(), sum(h[j].detach().cpu() for h in groups)) <= 1e-12
    torch.autograd.gradcheck(lambda *ts: allreduce(2, *ts), flat)


def test_double_backward_of_the_parallel_ops_is_exact():
    # Their backwards are plain differentiable torch code: gradgradcheck holds (float64).
    losses = [torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    weights = [torch.tensor(2.0, dtype=torch.float64), torch.tensor(5.0, dtype=torch.float64), 1.0]

    def reduce(*ls):
        return shardkit.ops.weighted_loss_reduce(list(ls), weights, "cpu")

    assert torch.autograd.gradgradcheck(reduce, losses)
    x = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)

    def split(t):
        pieces = shardkit.ops.split_to_devices([t], [2, 4], ["cpu", "cpu"])
        return tuple(p[0] ** 2 for p in pieces)  # a non-linear use, so the second order is not 0

    assert torch.autograd.gradgradcheck(split, (x,))
    # gradient penalty through split_to_devices equals the same penalty without it
    (g,) = torch.autograd.grad(sum(p.pow(3).sum() for p in split(x)), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.pow(2).sum(), x)
    (g_ref,) = torch.autograd.grad(x.pow(6).sum(), x, create_graph=True)
    (gg_ref,) = torch.autograd.grad(g_ref.pow(2).sum(), x)
    torch.testing.assert_close(gg, gg_ref)
