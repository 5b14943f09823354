"""PartialFC sampling op (shardkit::partial_fc_sample) and SparseRowSGD, in one process.

The distributed sampled loss (rate respected per rank, loss against a reference over the
sampled classes, unsampled rows untouched after a step) is in test_softmax_distributed.py."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import shardkit
from shardkit.distributed import sampled_class_counts
from shardkit.ops import partial_fc_sample
from shardkit.softmax.sampling import check_sample_rate, sample_shard


def _labels(batch, num_classes, offset, num_local, ignore=-100):
    """Global labels, about half inside [offset, offset + num_local), a few ignored."""
    inside = offset + torch.randint(0, max(num_local, 1), (batch,))
    anywhere = torch.randint(0, num_classes, (batch,))
    labels = torch.where(torch.rand(batch) < 0.5, inside, anywhere)
    labels[torch.rand(batch) < 0.1] = ignore
    return labels


@pytest.mark.parametrize(
    "batch,num_classes,offset,num_local,num_sample",
    [
        (7, 50, 10, 23, 9),
        (33, 1000, 0, 1000, 100),
        (1, 5, 2, 3, 1),
        (16, 40, 30, 10, 10),
        (5, 9, 0, 4, 4),
    ],
)
def test_sample_contains_positives_and_remaps(batch, num_classes, offset, num_local, num_sample):
    labels = _labels(batch, num_classes, offset, num_local)
    num_sample = max(num_sample, min(batch, num_local))
    index, remapped = partial_fc_sample(labels, class_offset=offset, num_local=num_local, num_sample=num_sample)
    assert index.shape == (num_sample,) and index.dtype == torch.int64
    assert remapped.shape == labels.shape and remapped.dtype == torch.int64
    assert torch.all(index[1:] > index[:-1]), "index must be sorted and unique"
    assert index.min() >= 0 and index.max() < num_local
    local = labels - offset
    mine = (local >= 0) & (local < num_local)
    positives = set(local[mine].tolist())
    assert positives <= set(index.tolist())
    # remapped points at the row's own class in index, -1 elsewhere
    assert torch.all(remapped[~mine] == -1)
    assert torch.equal(index[remapped[mine]], local[mine])


def test_sample_negatives_are_uniform():
    # 20 classes, no positives, 5 sampled: each class kept with probability 1/4.
    labels = torch.full((3,), -100, dtype=torch.int64)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    hits = torch.zeros(20)
    trials = 2000
    for _ in range(trials):
        index, _ = partial_fc_sample(labels, class_offset=0, num_local=20, num_sample=5, generator=gen)
        hits[index] += 1
    freq = hits / trials
    # binomial sd = sqrt(.25 * .75 / 2000) ~ 0.0097; 5 sd
    assert torch.all((freq - 0.25).abs() < 0.05), freq


def test_sample_negatives_are_uniform_with_positives_present():
    # 30 classes at offset 7; the batch of 10 holds 3 of them (twice each), labels of other
    # shards and an ignored row. 10 sampled: the 3 positives always, 7 of the 27 negatives,
    # each negative kept with probability 7/27 whatever its distance to a positive.
    offset, num_local, num_sample = 7, 30, 10
    positives = torch.randperm(num_local)[:3]
    labels = torch.cat([positives.repeat(2) + offset, torch.tensor([0, 6, 37, -100])])
    labels = labels[torch.randperm(labels.numel())]
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    hits = torch.zeros(num_local)
    trials = 2000
    for _ in range(trials):
        index, _ = partial_fc_sample(
            labels, class_offset=offset, num_local=num_local, num_sample=num_sample, generator=gen
        )
        hits[index] += 1
    freq = hits / trials
    negative = torch.ones(num_local, dtype=torch.bool)
    negative[positives] = False
    assert torch.all(freq[positives] == 1.0), freq
    # binomial sd = sqrt(7/27 * 20/27 / 2000) ~ 0.0098; 5 sd
    assert torch.all((freq[negative] - 7 / 27).abs() < 0.049), freq


def test_sample_generator_reproducible():
    labels = torch.randint(0, 100, (17,))
    seed = int(torch.randint(0, 2**31, ()).item())
    a = partial_fc_sample(
        labels, class_offset=20, num_local=60, num_sample=25, generator=torch.Generator().manual_seed(seed)
    )
    b = partial_fc_sample(
        labels, class_offset=20, num_local=60, num_sample=25, generator=torch.Generator().manual_seed(seed)
    )
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_sample_errors():
    labels = torch.randint(0, 10, (4,))
    with pytest.raises(RuntimeError, match="argument `labels` must be int64"):
        partial_fc_sample(labels.int(), class_offset=0, num_local=10, num_sample=5)
    with pytest.raises(RuntimeError, match="argument `labels` must be 1-D"):
        partial_fc_sample(labels.view(2, 2), class_offset=0, num_local=10, num_sample=5)
    with pytest.raises(RuntimeError, match="argument `num_sample` must be in"):
        partial_fc_sample(labels, class_offset=0, num_local=10, num_sample=11)
    with pytest.raises(RuntimeError, match="argument `num_local` must be >= 0"):
        partial_fc_sample(labels, class_offset=0, num_local=-1, num_sample=0)
    with pytest.raises(RuntimeError, match="argument `class_offset` must be >= 0"):
        partial_fc_sample(labels, class_offset=-3, num_local=10, num_sample=5)
    # fewer slots than the batch can have positives: a positive could lose its target
    with pytest.raises(RuntimeError, match=r"argument `num_sample` must be >= min\(B=4, num_local=10\) = 4"):
        partial_fc_sample(labels, class_offset=0, num_local=10, num_sample=3)
    with pytest.raises(RuntimeError, match=r"argument `num_sample` must be >= min\(B=4, num_local=2\) = 2"):
        partial_fc_sample(labels, class_offset=0, num_local=2, num_sample=1)
    for rate in (0, -1, 2, float("nan")):
        with pytest.raises(ValueError, match="argument `sample_rate` must be in"):
            sampled_class_counts([10, 10], rate, 4)
    with pytest.raises(ValueError, match="argument `sizes` must hold ints >= 0"):
        sampled_class_counts([10, -1], 0.5, 4)
    with pytest.raises(ValueError, match="argument `global_batch` must hold ints >= 0"):
        sampled_class_counts([10], 0.5, 2.5)
    with pytest.raises(ValueError, match="argument `sample_rate` must be in"):
        check_sample_rate(0.0)
    with pytest.raises(ValueError, match="argument `sample_rate` must be in"):
        check_sample_rate(1.5)
    with pytest.raises(TypeError, match="argument `sample_rate` must be a float"):
        check_sample_rate("0.1")
    # the fake kernel refuses a generator of another device type, like the op (GPU test below)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(RuntimeError, match="argument `generator` must be a generator of the labels'"):
        partial_fc_sample(
            torch.empty(9, dtype=torch.int64, device="cuda"),
            class_offset=0,
            num_local=10,
            num_sample=9,
            generator=torch.Generator(),
        )


def test_opcheck_partial_fc_sample():
    samples = [
        (torch.randint(0, 50, (9,)), 10, 30, 12),
        (torch.randint(0, 7, (1,)), 0, 7, 1),
        (torch.full((4,), -100, dtype=torch.int64), 0, 8, 4),
        (torch.randint(0, 200, (31,))[::2], 100, 100, 40),  # non-contiguous labels
    ]
    for labels, offset, num_local, num_sample in samples:
        # The op is random: test_aot_dispatch_dynamic compares two runs' outputs, so it is left out.
        torch.library.opcheck(
            torch.ops.shardkit.partial_fc_sample.default,
            (labels, offset, num_local, num_sample),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
        )


def test_sampled_class_counts():
    sizes = [34, 33, 33]
    assert sampled_class_counts(sizes, 0.1, 8) == [max(math.ceil(0.1 * c), 8) for c in sizes]
    assert sampled_class_counts(sizes, 0.1, 50) == sizes  # batch can hold up to 50 positives
    assert sampled_class_counts(sizes, 1.0, 1) == sizes
    assert sampled_class_counts([0, 5], 0.5, 3) == [0, 3]


def test_sample_shard_sparse_grad_rows():
    weight = torch.nn.Parameter(torch.randn(40, 6))
    labels = torch.randint(0, 80, (12,))
    sub_w, sub_labels, index = sample_shard(weight, labels, 20, 15)
    assert torch.equal(sub_w, weight[index])
    sub_w.pow(2).sum().backward()
    assert weight.grad.is_sparse
    rows = weight.grad.coalesce().indices()[0]
    assert torch.equal(rows, index)


def _sgd_pair(momentum, dampening, wd, nesterov):
    rows, dim = 13, 5
    start = torch.randn(rows, dim)
    p_ours = torch.nn.Parameter(start.clone())
    p_ref = torch.nn.Parameter(start.clone())
    ours = shardkit.SparseRowSGD(
        [p_ours], lr=0.1, momentum=momentum, dampening=dampening, weight_decay=wd, nesterov=nesterov
    )
    ref = torch.optim.SGD([p_ref], lr=0.1, momentum=momentum, dampening=dampening, weight_decay=wd, nesterov=nesterov)
    return p_ours, p_ref, ours, ref


@pytest.mark.parametrize(
    "momentum,dampening,wd,nesterov",
    [(0.0, 0.0, 0.0, False), (0.9, 0.0, 5e-4, False), (0.9, 0.1, 1e-2, False), (0.8, 0.0, 1e-3, True)],
)
def test_sparse_row_sgd_equals_sgd_when_every_row_is_present(momentum, dampening, wd, nesterov):
    p_ours, p_ref, ours, ref = _sgd_pair(momentum, dampening, wd, nesterov)
    for step in range(3):
        grad = torch.randn_like(p_ref)
        p_ref.grad = grad.clone()
        # all rows as a sparse gradient on even steps, dense on odd steps
        p_ours.grad = grad.to_sparse(1) if step % 2 == 0 else grad.clone()
        ref.step()
        ours.step()
        torch.testing.assert_close(p_ours.detach(), p_ref.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", [(), (1,), (6,), (2, 3, 2)])
@pytest.mark.parametrize("nesterov", [False, True])
def test_sparse_row_sgd_equals_sgd_on_dense_parameters_of_any_rank(shape, nesterov):
    # e.g. a learnable logit scale (0-dim) or a conv weight among the backbone's parameters
    start = torch.randn(shape)
    p_ours, p_ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    kw = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=nesterov)
    ours, ref = shardkit.SparseRowSGD([p_ours], **kw), torch.optim.SGD([p_ref], **kw)
    for _ in range(3):
        grad = torch.randn(shape)
        p_ours.grad, p_ref.grad = grad.clone(), grad.clone()
        ours.step()
        ref.step()
        torch.testing.assert_close(p_ours.detach(), p_ref.detach(), rtol=1e-6, atol=1e-7)
    assert ours.state[p_ours]["momentum_buffer"].shape == shape


def test_sparse_row_sgd_leaves_unsampled_rows_untouched():
    weight = torch.nn.Parameter(torch.randn(30, 4))
    opt = shardkit.SparseRowSGD([weight], lr=0.5, momentum=0.9, weight_decay=1e-2, dampening=0.1)
    for _ in range(3):
        index = torch.randperm(30)[:7]
        before = weight.detach().clone()
        buf_before = opt.state[weight]["momentum_buffer"].clone() if opt.state[weight] else None
        weight.grad = None
        F.embedding(index, weight, sparse=True).sin().sum().backward()
        opt.step()
        untouched = torch.ones(30, dtype=torch.bool)
        untouched[index] = False
        assert torch.equal(weight.detach()[untouched], before[untouched])  # bit-exact
        assert not torch.equal(weight.detach()[index], before[index])
        if buf_before is not None:
            assert torch.equal(opt.state[weight]["momentum_buffer"][untouched], buf_before[untouched])


def test_sparse_row_sgd_errors():
    p = torch.nn.Parameter(torch.randn(3, 2))
    with pytest.raises(ValueError, match="argument `lr` must be >= 0"):
        shardkit.SparseRowSGD([p], lr=-1.0)
    with pytest.raises(ValueError, match="argument `nesterov` needs momentum > 0"):
        shardkit.SparseRowSGD([p], lr=0.1, nesterov=True)


@pytest.mark.gpu
def test_sample_on_cuda_matches_contract():
    labels = torch.randint(0, 5000, (257,), device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ()).item()))
    index, remapped = partial_fc_sample(labels, class_offset=1000, num_local=2000, num_sample=300, generator=gen)
    assert index.device.type == "cuda" and remapped.device.type == "cuda"
    local = (labels - 1000).cpu()
    mine = (local >= 0) & (local < 2000)
    index, remapped = index.cpu(), remapped.cpu()
    assert torch.all(index[1:] > index[:-1])
    assert set(local[mine].tolist()) <= set(index.tolist())
    assert torch.equal(index[remapped[mine]], local[mine]) and torch.all(remapped[~mine] == -1)


def test_torch_sgd_with_momentum_on_a_sampled_shard_warns():
    from shardkit.softmax.sampling import mark_sampled

    weight = torch.nn.Parameter(torch.randn(8, 3))
    mark_sampled(weight)
    opt = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    F.embedding(torch.tensor([1, 4]), weight, sparse=True).sum().backward()
    with pytest.warns(UserWarning, match="use shardkit.SparseRowSGD"):
        opt.step()
    plain = torch.optim.SGD([weight], lr=0.1)  # no momentum, no decay: rows outside the grad stay
    ours = shardkit.SparseRowSGD([weight], lr=0.1, momentum=0.9, weight_decay=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain.step()
        ours.step()


def test_no_sampling_warning_for_a_head_whose_gradients_are_dense():
    # A head built with sampling whose rate went to 1 (or stepped after an eval-mode forward)
    # has dense gradients: torch.optim.SGD with momentum is then right and gets no warning; the
    # same optimizer warns at the first step that does see a sampled (row-sparse) gradient.
    head = shardkit.ShardedSoftmaxLoss(7, 11, devices=["cpu"] * 2, sample_rate=0.3)
    head.sample_rate = 1.0
    x, y = torch.randn(5, 7), torch.randint(0, 11, (5,))
    head(x, y).backward()
    opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    head.sample_rate = 0.3
    opt.zero_grad()
    head(x, y).backward()
    with pytest.warns(UserWarning, match="use shardkit.SparseRowSGD"):
        opt.step()


@pytest.mark.parametrize("later", ["sampling", "momentum"])
def test_sgd_warns_when_sampling_or_momentum_starts_after_its_first_steps(later):
    # a head trained densely first (or an SGD whose momentum a schedule raises later): the check
    # of the first step was cached and no later step warned
    head = shardkit.ShardedSoftmaxLoss(7, 200, devices=["cpu"] * 2, sample_rate=1.0 if later == "sampling" else 0.1)
    opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9 if later == "sampling" else 0.0)
    x, y = torch.randn(5, 7), torch.randint(0, 200, (5,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        head(x, y).backward()
        opt.step()
    if later == "sampling":
        head.sample_rate = 0.1
    else:
        opt.param_groups[0]["momentum"] = 0.9
    opt.zero_grad()
    head(x, y).backward()
    with pytest.warns(UserWarning, match="use shardkit.SparseRowSGD"):
        opt.step()
    opt.zero_grad()
    head(x, y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # once per optimizer


@pytest.mark.gpu
def test_sample_generator_must_be_on_the_labels_device():
    labels = torch.randint(0, 100, (9,), device="cuda")
    with pytest.raises(RuntimeError, match="argument `generator` must be a generator of the labels' device cuda"):
        partial_fc_sample(labels, class_offset=0, num_local=100, num_sample=20, generator=torch.Generator())
    with pytest.raises(RuntimeError, match="argument `generator` must be a generator of the labels' device cpu"):
        partial_fc_sample(
            labels.cpu(), class_offset=0, num_local=100, num_sample=20, generator=torch.Generator(device="cuda")
        )
    seed = int(torch.randint(0, 2**31, ()).item())
    a, b = (
        partial_fc_sample(
            labels,
            class_offset=0,
            num_local=100,
            num_sample=20,
            generator=torch.Generator(device="cuda").manual_seed(seed),
        )
        for _ in range(2)
    )
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.gpu
def test_sampled_shard_and_sparse_row_sgd_on_cuda_match_cpu():
    """sample_shard on CUDA gives a row-sparse CUDA gradient; SparseRowSGD (momentum, weight
    decay, Nesterov) on it equals the same steps on the CPU and leaves other rows bit-exact."""
    start = torch.randn(40, 6, dtype=torch.float64)
    p_gpu, p_cpu = torch.nn.Parameter(start.cuda()), torch.nn.Parameter(start.clone())
    opts = [shardkit.SparseRowSGD([p], lr=0.3, momentum=0.9, weight_decay=1e-2, nesterov=True) for p in (p_gpu, p_cpu)]
    for _ in range(3):
        labels = torch.randint(0, 80, (12,), device="cuda")
        sub_w, _, index = sample_shard(p_gpu, labels, 20, 15)
        sub_w.sin().sum().backward()
        F.embedding(index.cpu(), p_cpu, sparse=True).sin().sum().backward()
        assert p_gpu.grad.is_sparse and p_gpu.grad.device.type == "cuda"
        before = p_gpu.detach().clone()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        untouched = torch.ones(40, dtype=torch.bool, device="cuda")
        untouched[index] = False
        assert torch.equal(p_gpu.detach()[untouched], before[untouched])
        torch.testing.assert_close(p_gpu.detach().cpu(), p_cpu.detach(), rtol=1e-12, atol=1e-14)
