"""PartialFC sampling in the one-process mode (``ShardedSoftmaxLoss(..., sample_rate=r)``
without a process group, shards on repeated "cpu" devices): the loss and gradients are
those of a float64 cross-entropy over exactly the sampled classes."""

import pytest
import torch
from softmax_reference import margin_kwargs, reference_loss_and_grads

import shardkit
from shardkit.distributed import sampled_class_counts

MARGINS = {
    "plain": lambda: None,
    "arcface": lambda: shardkit.ArcFace(s=16.0, m=0.3),
    "cosface": lambda: shardkit.CosFace(s=16.0, m=0.2),
}


def _sampled_rows(head):
    """Per shard, the local row ids that got a gradient (the sampled classes), sorted."""
    rows = []
    for p in head.weight_shards:
        g = p.grad
        assert g is not None and g.is_sparse, "a sampled shard gets a sparse gradient"
        rows.append(g.coalesce().indices()[0].sort().values)
    return rows


@pytest.mark.parametrize("margin_name", list(MARGINS))
@pytest.mark.parametrize("shards,batch,smoothing", [(1, 9, 0.0), (3, 13, 0.1), (4, 5, 0.0)])
def test_sampled_loss_and_grads_match_reference_over_sampled_classes(margin_name, shards, batch, smoothing):
    num_classes, dim, rate = 61, 7, 0.3
    margin = MARGINS[margin_name]()
    head = shardkit.ShardedSoftmaxLoss(
        dim,
        num_classes,
        margin=margin,
        devices=["cpu"] * shards,
        sample_rate=rate,
        label_smoothing=smoothing,
        dtype=torch.float64,
    )
    x = torch.randn(batch, dim, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, num_classes, (batch,))
    labels[0] = -100  # an ignored row
    loss = head(x, labels)
    loss.backward()

    rows = _sampled_rows(head)
    counts = sampled_class_counts(list(head.shard_sizes), rate, batch)
    assert [len(r) for r in rows] == counts  # every sampled class gets a gradient row
    global_ids = torch.cat([r + off for r, off in zip(rows, head.class_offsets)])
    valid = labels[labels != -100]
    assert torch.isin(valid, global_ids).all(), "every positive class is sampled"

    # Reference: float64 CE over the sampled classes only, labels remapped to positions.
    full = head.full_weight()
    position = torch.full((num_classes,), -1, dtype=torch.long)
    position[global_ids] = torch.arange(len(global_ids))
    sub_labels = torch.where(labels == -100, labels, position[labels.clamp_min(0)])
    ref = reference_loss_and_grads(x, full[global_ids], sub_labels, label_smoothing=smoothing, **margin_kwargs(margin))
    torch.testing.assert_close(loss.double(), ref.loss, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(x.grad, ref.grad_x, rtol=1e-6, atol=1e-9)
    start = 0
    for p, r in zip(head.weight_shards, rows):
        dense = p.grad.to_dense()
        torch.testing.assert_close(dense[r], ref.grad_w[start : start + len(r)], rtol=1e-6, atol=1e-9)
        unsampled = torch.ones(p.shape[0], dtype=torch.bool)
        unsampled[r] = False
        assert (dense[unsampled] == 0).all()
        start += len(r)


def test_rate_one_and_eval_mode_use_every_class():
    x = torch.randn(11, 6, dtype=torch.float64)
    labels = torch.randint(0, 40, (11,))
    full = shardkit.ShardedSoftmaxLoss(6, 40, devices=["cpu"] * 2, dtype=torch.float64)
    sampled = shardkit.ShardedSoftmaxLoss(6, 40, devices=["cpu"] * 2, dtype=torch.float64, sample_rate=0.2)
    sampled.load_state_dict(full.state_dict())
    sampled.eval()
    torch.testing.assert_close(sampled(x, labels), full(x, labels), rtol=0, atol=0)
    ones = shardkit.ShardedSoftmaxLoss(6, 40, devices=["cpu"] * 2, dtype=torch.float64, sample_rate=1.0)
    ones.load_state_dict(full.state_dict())
    torch.testing.assert_close(ones(x, labels), full(x, labels), rtol=0, atol=0)


def test_sampling_generators_reproduce_and_sparse_row_sgd_leaves_unsampled_rows():
    def run(seed):
        torch.manual_seed(0)
        head = shardkit.ShardedSoftmaxLoss(8, 50, devices=["cpu"] * 2, sample_rate=0.2)
        head.sample_generator = [torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)]
        opt = shardkit.SparseRowSGD(head.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        before = head.full_weight().clone()
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
        labels = torch.randint(0, 50, (6,), generator=torch.Generator().manual_seed(2))
        head(x, labels).backward()
        rows = torch.cat([r + off for r, off in zip(_sampled_rows(head), head.class_offsets)])
        opt.step()
        return rows, before, head.full_weight()

    rows_a, before, after = run(5)
    rows_b, _, _ = run(5)
    assert torch.equal(rows_a, rows_b)  # same generators, same sampled classes
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[rows_a] = False
    assert untouched.any()
    assert torch.equal(after[untouched], before[untouched])
    assert not torch.equal(after[rows_a], before[rows_a])


def test_sampling_generator_errors():
    head = shardkit.ShardedSoftmaxLoss(4, 30, devices=["cpu"] * 3, sample_rate=0.5)
    x, labels = torch.randn(5, 4), torch.randint(0, 30, (5,))
    head.sample_generator = [torch.Generator()] * 2
    with pytest.raises(TypeError, match="argument `generator` must be None, a torch.Generator or one"):
        head(x, labels)
    with pytest.raises(TypeError, match="`sample_generator` must be None, a torch.Generator"):
        head.sample_generator = "seed"  # refused when set
    with pytest.raises(TypeError, match="argument `generator`"):
        shardkit.sharded_cross_entropy(x, list(head.weight_shards), labels, sample_rate=0.5, generator=5)
    with pytest.raises(ValueError, match="argument `sample_rate` must be in"):
        shardkit.sharded_cross_entropy(x, list(head.weight_shards), labels, sample_rate=1.5)


def test_functional_sampling_with_user_weights():
    w = [torch.randn(13, 5, requires_grad=True), torch.randn(8, 5, requires_grad=True)]
    x, labels = torch.randn(4, 5), torch.randint(0, 21, (4,))
    loss = shardkit.sharded_cross_entropy(x, w, labels, sample_rate=0.5, generator=torch.Generator().manual_seed(3))
    loss.backward()
    counts = sampled_class_counts([13, 8], 0.5, 4)
    assert [int(p.grad.coalesce().indices().shape[1]) for p in w] == counts
    assert torch.isfinite(loss)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_sampled_gradients_accumulate_over_backwards_in_every_dtype(dtype):
    # torch cannot add two float16 sparse COO tensors on the CPU: a second backward before the
    # optimizer step (gradient accumulation) raised NotImplementedError for float16 heads
    torch.manual_seed(20)
    head = shardkit.ShardedSoftmaxLoss(16, 11, devices=["cpu", "cpu"], dtype=dtype, sample_rate=0.5)
    ref = shardkit.ShardedSoftmaxLoss(16, 11, devices=["cpu", "cpu"], dtype=torch.float64, sample_rate=0.5)
    with torch.no_grad():
        for w, r in zip(head.weight_shards, ref.weight_shards):
            r.copy_(w)
    head.sample_generator = torch.Generator().manual_seed(5)
    ref.sample_generator = torch.Generator().manual_seed(5)
    batches = [(torch.randn(6, 16), torch.randint(0, 11, (6,))) for _ in range(3)]
    for x, y in batches:
        head(x.to(dtype), y).backward()
        ref(x.to(dtype).double(), y).backward()
    # torch.autograd.grad returns its gradient and leaves .grad alone
    x, y = batches[0]
    before = [w.grad.to_dense().clone() for w in head.weight_shards]
    (g,) = torch.autograd.grad(head(x.to(dtype), y), [head.weight_shards[0]])
    assert g.is_sparse and all(torch.equal(b, w.grad.to_dense()) for b, w in zip(before, head.weight_shards))
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}[dtype]
    for w, r in zip(head.weight_shards, ref.weight_shards):
        assert w.grad.is_sparse and w.grad.dtype == dtype
        torch.testing.assert_close(w.grad.to_dense().double(), r.grad.to_dense(), rtol=tol, atol=tol)
    shardkit.SparseRowSGD(head.parameters(), lr=0.1, momentum=0.9).step()  # the joined gradient steps


def test_a_float16_sampled_head_converts_with_swapped_parameters():
    # the accumulation hook held its shard weakly, and torch.utils.swap_tensors refuses a tensor
    # with a weak reference: conversions and loads failed under the swap setting
    head = shardkit.ShardedSoftmaxLoss(8, 20, devices=["cpu", "cpu"], dtype=torch.float16, sample_rate=0.5)
    x, y = torch.randn(6, 8), torch.randint(0, 20, (6,))
    head(x.half(), y).backward()
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        head.zero_grad()
        head.float()
        head.load_state_dict({k: v.clone() for k, v in head.state_dict().items()})
        for _ in range(2):
            head(x, y).backward()
        assert head.weight_shards[0].dtype == torch.float32 and head.weight_shards[0].grad.is_sparse
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
