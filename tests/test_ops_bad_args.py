"""Bad arguments of the shardkit.ops wrappers: a TypeError / ValueError naming the argument, never
a coerced value (int() / float() / bool() of a string or a float), uninitialized memory, a NaN,
torch's unnamed errors or an AttributeError / IndexError. Each case failed on the old wrappers."""

import math
import re

import numpy as np
import pytest
import torch

import shardkit
from shardkit import ops

# ---- 1. weighted_loss_reduce: meta losses, all-zero weights ------------------------------


@pytest.mark.parametrize(
    "losses, weights, error, match",
    [
        # uninitialized memory (a different value at each call), alone or mixed with a real loss
        ([torch.tensor(1.0, device="meta")], [1], ValueError, r"argument `losses` \(index 0\) is a meta tensor"),
        (
            [torch.tensor(3.0), torch.tensor(1.0, device="meta")],
            [1, 1],
            ValueError,
            r"argument `losses` \(index 1\) is a meta tensor",
        ),
        (
            [torch.tensor(3.0)],
            [torch.tensor(1.0, device="meta")],
            ValueError,
            r"argument `weights` \(index 0\) is a meta",
        ),
        # NaN (0/0) without a word
        ([torch.tensor(1.0), torch.tensor(2.0)], [0, 0], ValueError, r"argument `weights` sums to 0"),
        ([torch.tensor(1.0), torch.tensor(2.0)], [0.0, np.int64(0)], ValueError, r"argument `weights` sums to 0"),
        # a tensor taken for a list of its elements
        (torch.tensor([1.0, 2.0]), [1, 2], TypeError, r"argument `losses` must be a list of tensors, got Tensor"),
        ([1.0], [1], TypeError, r"argument `losses` \(index 0\) must be a tensor, got float"),
    ],
)
def test_weighted_loss_reduce_refuses_meta_and_zero_weights(losses, weights, error, match):
    with pytest.raises(error, match=match):
        ops.weighted_loss_reduce(losses, weights, "cpu")


def test_weighted_loss_reduce_zero_weights_still_valid_where_defined():
    losses = [torch.tensor(1.0), torch.tensor(2.0)]
    # not normalized: a weighted sum of 0, no division
    assert ops.weighted_loss_reduce(losses, [0, 0], "cpu", normalize=False).item() == 0.0
    # tensor weights are not read (a host sync): all-zero ones still give the one-device NaN
    assert torch.isnan(ops.weighted_loss_reduce(losses, [torch.tensor(0), torch.tensor(0)], "cpu"))
    assert ops.weighted_loss_reduce(losses, [0, np.int64(2)], "cpu").item() == pytest.approx(2.0)
    assert ops.weighted_loss_reduce(losses, torch.tensor([1.0, 3.0]), "cpu").item() == pytest.approx(1.75)
    # an all-meta call stays a shape-only call
    out = ops.weighted_loss_reduce([torch.tensor(1.0, device="meta")], [1], "meta")
    assert out.is_meta and out.shape == ()


# ---- 2. ce_shard_stats: strict types, margin ranges --------------------------------------


def _ce_case():
    torch.manual_seed(0)
    return torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, 4])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(normalize="no"), TypeError, "argument `normalize` must be a Python bool, got str"),  # was True
        (dict(normalize=None), TypeError, "argument `normalize` must be a Python bool, got NoneType"),
        (dict(normalize=1), TypeError, "argument `normalize` must be a Python bool, got int"),
        (dict(class_offset=1.7), TypeError, "argument `class_offset` must be an int, got float"),  # was 1
        (dict(class_offset="1"), TypeError, "argument `class_offset` must be an int, got str"),
        (dict(class_offset=None), TypeError, "argument `class_offset` must be an int, got NoneType"),
        (dict(class_offset=True), TypeError, "argument `class_offset` must be an int, got bool"),
        (dict(class_offset=2**63), ValueError, "argument `class_offset` must be <= "),
        (dict(scale="1"), TypeError, "argument `scale` must be a real number, got str"),
        (dict(scale=None), TypeError, "argument `scale` must be a real number, got NoneType"),
        (dict(scale=torch.tensor([2.0, 3.0])), TypeError, "argument `scale` must be a real number, got Tensor"),
        (dict(m3=True), TypeError, "argument `m3` must be a real number, got bool"),
        (dict(chunk_classes=2.5), TypeError, "argument `chunk_classes` must be an int, got float"),
        (dict(chunk_classes="2"), TypeError, "argument `chunk_classes` must be an int, got str"),
        (dict(chunk_classes=True), TypeError, "argument `chunk_classes` must be an int, got bool"),
        (
            dict(normalize=True, m2=4.0),
            ValueError,
            r"argument `m2` \(the angular margin, radians\) must be in \[0, pi\)",
        ),
        (dict(normalize=True, m2=-0.1), ValueError, r"argument `m2` .* must be in \[0, pi\)"),
        (dict(normalize=True, m2=math.pi), ValueError, r"argument `m2` .* must be in \[0, pi\)"),
        (dict(normalize=True, scale=-64.0), ValueError, r"argument `scale` must be > 0 with normalize=True"),
        (dict(memory_budget=1.5), ValueError, r"argument `memory_budget` must be an int >= 0"),
    ],
)
def test_ce_shard_stats_strict_arguments(kwargs, error, match):
    x, w, y = _ce_case()
    with pytest.raises(error, match=match):
        ops.ce_shard_stats(x, w, y, **kwargs)


@pytest.mark.parametrize("which", ["x", "w", "labels", "target_ref"])
def test_ce_shard_stats_tensor_arguments(which):
    x, w, y = _ce_case()
    args = dict(x=x, w=w, labels=y)
    kwargs = {}
    if which == "target_ref":
        kwargs["target_ref"] = [0.0] * 4
    else:
        args[which] = None  # was AttributeError: 'NoneType' object has no attribute 'dim'
    with pytest.raises(TypeError, match=f"argument `{which}` must be a Tensor"):
        ops.ce_shard_stats(args["x"], args["w"], args["labels"], **kwargs)


def test_ce_shard_stats_valid_arguments_unchanged():
    x, w, y = _ce_case()
    ref = ops.ce_shard_stats(x, w, y, class_offset=1, scale=2.0, chunk_classes=3)
    # numpy scalars are ints and reals; ints are reals
    got = ops.ce_shard_stats(x, w, y, class_offset=np.int64(1), scale=np.float32(2.0), chunk_classes=np.int32(3))
    got2 = ops.ce_shard_stats(x, w, y, class_offset=1, scale=2, chunk_classes=3)
    for a, b, c in zip(ref, got, got2):
        assert torch.equal(a, b) and torch.equal(a, c)
    margin = ops.ce_shard_stats(x, w, y, normalize=True, scale=30.0, m2=0.5, memory_budget=np.int64(1 << 20))
    assert torch.isfinite(margin[0]).all()
    # the kernels' own range checks keep their RuntimeError
    with pytest.raises(RuntimeError, match="argument `scale` must be finite"):
        ops.ce_shard_stats(x, w, y, scale=math.inf)
    with pytest.raises(RuntimeError, match="argument `class_offset` must be >= 0"):
        ops.ce_shard_stats(x, w, y, class_offset=-1)


# ---- 3. partial_fc_sample and the budget helpers -----------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_local="10"), TypeError, "argument `num_local` must be an int, got str"),
        (dict(num_sample=5.9), TypeError, "argument `num_sample` must be an int, got float"),  # was 5
        (dict(num_sample=None), TypeError, "argument `num_sample` must be an int, got NoneType"),
        (dict(class_offset=True), TypeError, "argument `class_offset` must be an int, got bool"),
        (dict(generator="seed"), TypeError, "argument `generator` must be a torch.Generator or None, got str"),
        (dict(num_local=2**40), ValueError, r"argument `num_local` = 1099511627776 cannot be allocated"),
        (dict(num_local=2**63 - 1), ValueError, r"argument `num_local` = \d+: the shard's class ids"),
    ],
)
def test_partial_fc_sample_strict_counts(kwargs, error, match):
    args = dict(class_offset=0, num_local=10, num_sample=5)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        ops.partial_fc_sample(torch.tensor([1, 2, 3, 4]), **args)


def test_partial_fc_sample_numpy_counts():
    y = torch.tensor([1, 2, 3, 4])
    a = ops.partial_fc_sample(y, class_offset=0, num_local=10, num_sample=5, generator=torch.Generator().manual_seed(3))
    b = ops.partial_fc_sample(
        y,
        class_offset=np.int64(0),
        num_local=np.int64(10),
        num_sample=np.int32(5),
        generator=torch.Generator().manual_seed(3),
    )
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: ops.chunk_classes_for_budget("4"), TypeError, "argument `batch` must be an int, got str"),
        (lambda: ops.chunk_classes_for_budget(4.5), TypeError, "argument `batch` must be an int, got float"),
        (lambda: ops.chunk_classes_for_budget(4, None), TypeError, "argument `budget_bytes` must be an int"),
        (lambda: ops.chunk_classes_for_budget(4, embedding_dim=True), TypeError, "argument `embedding_dim` must be"),
        (lambda: ops.chunk_classes_for_budget(4, dtype=torch.int32), TypeError, "argument `dtype` must be a floating"),
        (lambda: ops.chunk_classes_for_budget(4, num_classes=-5), ValueError, "argument `num_classes` must be >= 0"),
        (lambda: ops.chunk_classes_for_budget(4, num_classes=2.5), TypeError, "argument `num_classes` must be an int"),
        (lambda: ops.kept_logits_dtype(torch.int32), TypeError, "argument `dtype` must be a floating torch.dtype"),
        (lambda: ops.kept_logits_dtype("float32"), TypeError, "argument `dtype` must be a floating torch.dtype"),
    ],
)
def test_budget_helpers_strict(call, error, match):
    with pytest.raises(error, match=re.escape(match)):
        call()


def test_budget_helpers_valid_values_unchanged():
    assert ops.chunk_classes_for_budget(np.int64(4), num_classes=np.int64(0)) == 1
    assert ops.chunk_classes_for_budget(1024, 192 << 20, embedding_dim=512, dtype=torch.bfloat16) == (
        (192 << 20) // (1024 * 6 + 2 * 512 * 4) // 64 * 64
    )
    assert ops.kept_logits_dtype(torch.bfloat16, "cuda") == torch.bfloat16
    assert ops.kept_logits_dtype(torch.float64) == torch.float64


# ---- 4. device, dim and size arguments of the parallel ops -------------------------------

_CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")


@pytest.mark.parametrize(
    "device, error, match",
    [
        ("bogus", ValueError, r"must name a device such as 'cpu' or 'cuda:0', got 'bogus'"),
        (None, TypeError, r"must be a torch.device, a string such as 'cuda:0' or a CUDA index, got NoneType"),
        (True, TypeError, r"must be a torch.device, a string such as 'cuda:0' or a CUDA index, got bool"),
        (1.0, TypeError, r"must be a torch.device, a string such as 'cuda:0' or a CUDA index, got float"),
        (-1, ValueError, r"must be a CUDA index >= 0, got -1"),
        pytest.param("cuda", ValueError, "is cuda, but no CUDA device is visible", marks=_CPU_ONLY),
        pytest.param(0, ValueError, "is cuda:0, but no CUDA device is visible", marks=_CPU_ONLY),
        pytest.param(torch.device("cuda", 0), ValueError, "is cuda:0, but no CUDA device is visible", marks=_CPU_ONLY),
        (torch.device("cuda", 64), ValueError, r"is cuda:64, but (no|only \d+) CUDA device"),
    ],
)
def test_parallel_device_arguments_are_named(device, error, match):
    with pytest.raises(error, match=r"argument `output_device` " + match):
        ops.weighted_loss_reduce([torch.tensor(1.0)], [1], device)
    with pytest.raises(error, match=r"argument `devices` \(index 1\) " + match):
        ops.split_to_devices([torch.randn(4, 2)], [2, 2], ["cpu", device])


@pytest.mark.parametrize(
    "args, error, match",
    [
        (([torch.randn(4, 2)], [2, 2], ["cpu", "cpu"], 5), ValueError, r"argument `dim` = 5 is out of range"),
        (([torch.randn(4, 2)], [2, 2], ["cpu", "cpu"], -3), ValueError, r"argument `dim` = -3 is out of range"),
        (([torch.randn(4, 2)], [2, 2], ["cpu", "cpu"], 0.0), TypeError, r"argument `dim` must be an int, got float"),
        (([torch.randn(4, 2)], "22", ["cpu", "cpu"], 0), TypeError, r"argument `split_sizes` must be a list, got str"),
        (
            ([torch.randn(4, 2)], [1.9, 2.2], ["cpu"] * 2, 0),
            TypeError,
            r"argument `split_sizes` \(index 0\) must be an int",
        ),
        (
            ([torch.randn(4, 2)], [True, 3], ["cpu"] * 2, 0),
            TypeError,
            r"argument `split_sizes` \(index 0\) must be an int",
        ),
        (([torch.randn(4, 2)], [2, 2], "cpu", 0), TypeError, r"argument `devices` must be a list, got str"),
        (([torch.randn(4, 2, device="meta")], [2, 2], ["cpu"] * 2, 0), ValueError, r"`tensors` \(index 0\) is a meta"),
        ((torch.randn(4, 2), [2, 2], ["cpu"] * 2, 0), TypeError, r"argument `tensors` must be a list of tensors"),
        (([torch.randn(4, 2), "x"], [2, 2], ["cpu"] * 2, 0), TypeError, r"argument `tensors` \(index 1\) must be a"),
    ],
)
def test_split_to_devices_arguments_are_named(args, error, match):
    with pytest.raises(error, match=match):
        ops.split_to_devices(*args)


def test_split_to_devices_valid_arguments_unchanged():
    t = torch.randn(5, 3)
    pieces = ops.split_to_devices([t], [np.int64(2), 3], [torch.device("cpu"), "cpu"], dim=np.int64(-2))
    assert torch.equal(torch.cat([p[0] for p in pieces]), t)
    meta = ops.split_to_devices([torch.randn(4, 2, device="meta")], [2, 2], ["meta", "meta"])
    assert all(p[0].is_meta and p[0].shape == (2, 2) for p in meta)


# ---- 5. the ema ops: expanded tensors named, the swap pair's dtypes ----------------------

_D = torch.tensor(0.5, dtype=torch.float64)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda e, m: ops.ema_update_(e, m, 0.5), r"ema_update_: `ema\[1\]` overlaps itself: several of its elements"),
        (lambda e, m: ops.ema_update_device_decay_(e, m, _D), r"ema_update_device_decay_: `ema\[1\]` overlaps itself"),
        (ops.ema_swap_, r"ema_swap_: `ema\[1\]` overlaps itself: several of its elements"),
        (ops.ema_unswap_, r"ema_unswap_: `ema\[1\]` overlaps itself: several of its elements"),
    ],
)
def test_ema_expanded_ema_is_named(call, match):
    ema = [torch.zeros(3), torch.zeros(1).expand(3)]
    with pytest.raises(ValueError, match=match):
        call(ema, [torch.ones(3), torch.ones(3)])


def test_ema_swap_expanded_model_is_named_and_update_reads_it():
    with pytest.raises(ValueError, match=r"ema_swap_: `model\[0\]` overlaps itself"):
        ops.ema_swap_([torch.zeros(3)], [torch.ones(1).expand(3)])
    e = torch.zeros(3)
    ops.ema_update_([e], [torch.ones(1).expand(3)], 0.5)  # read only: fine
    assert torch.equal(e, torch.full((3,), 0.5))


@pytest.mark.parametrize("op", [ops.ema_swap_, ops.ema_unswap_], ids=["swap", "unswap"])
@pytest.mark.parametrize(
    "dtype",
    [torch.int64, torch.int32, torch.bool, torch.complex64, torch.float8_e4m3fn],
    ids=["int64", "int32", "bool", "complex64", "fp8"],
)
def test_ema_swap_refuses_what_update_refuses(op, dtype):
    e, m = torch.zeros(3).to(dtype), torch.ones(3).to(dtype)
    e0, m0 = e.clone(), m.clone()
    with pytest.raises(RuntimeError, match=r"argument `ema` must hold floating-point tensors"):
        ops.ema_update_([e], [m], 0.5)
    name = op.__name__
    with pytest.raises(TypeError, match=rf"{name}: argument `ema` must hold floating-point tensors .* at index 1"):
        op([torch.zeros(2), e], [torch.ones(2), m])
    for now, then in ((e, e0), (m, m0)):  # nothing was exchanged
        assert torch.equal(now.view(torch.uint8), then.view(torch.uint8))


def test_ema_swap_valid_pairs_and_model_ema_buffers_unchanged():
    e, m = torch.randn(5), torch.randn(5).bfloat16()
    d, d2 = torch.randn(4).double(), torch.randn(4).double()
    e0, m0, dd0, dd20 = e.clone(), m.clone(), d.clone(), d2.clone()
    ops.ema_swap_([e, d], [m, d2])
    assert torch.equal(d, dd20) and torch.equal(d2, dd0)
    ops.ema_unswap_([e, d], [m, d2])
    assert torch.equal(e, e0) and torch.equal(m, m0) and torch.equal(d, dd0)
    # ModelEMA.swap still exchanges a model's integer buffers (BatchNorm's num_batches_tracked)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    ema = shardkit.ModelEMA(model, decay=0.5, tau=None)
    model(torch.randn(8, 4))
    ema.update(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    averaged = {k: v.clone() for k, v in ema.state_dict()["module"].items()}
    with ema.swap(model):
        assert all(torch.equal(averaged[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("value", [None, 5, "ab"])
def test_ema_lists_must_be_lists(value):
    with pytest.raises(TypeError, match="argument `ema_tensors` must be a list or tuple of tensors"):
        ops.ema_update_(value, [torch.ones(3)], 0.5)


def test_scalar_tensors_numpy_bools_and_size_tensors_are_still_taken():
    # Taken before the strict checks (int() / float() read them), so kept: one-element integer
    # tensors for counts, one-element real tensors for scales, numpy bools, a 1-D size tensor.
    np = pytest.importorskip("numpy")
    x, w, y = torch.randn(6, 4), torch.randn(5, 4), torch.randint(0, 5, (6,))
    ref = ops.ce_shard_stats(x, w, y, class_offset=0, scale=30.0)
    got = ops.ce_shard_stats(x, w, y, class_offset=torch.tensor(0), scale=torch.tensor(30.0))
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    parts = ops.split_to_devices([x], torch.tensor([2, 4]), ["cpu", "cpu"], torch.tensor(0))
    assert [p[0].shape[0] for p in parts] == [2, 4]
    parts = ops.split_to_devices([x], [torch.tensor(3), np.int64(3)], ["cpu", "cpu"], 0)
    assert [p[0].shape[0] for p in parts] == [3, 3]
    assert ops.weighted_loss_reduce([torch.tensor(2.0)], [1], "cpu", normalize=np.True_).item() == 2.0
    with pytest.raises(TypeError, match=r"argument `split_sizes` \(index 0\) must be an int"):
        ops.split_to_devices([x], [torch.tensor(2.0), 4], ["cpu", "cpu"], 0)
