"""Bad arguments of the sharded loss, its ops, split_to_devices and normalize: each gets a clear
error that names the argument, at construction where possible, never a silent NaN / inf or a
wrong result (cases found by probing the API with bad inputs)."""

import numpy as np
import pytest
import torch

import shardkit
from shardkit import ops
from shardkit.softmax.margins import ArcFace, CombinedMargin, CosFace


def _head(**kw):
    return shardkit.ShardedSoftmaxLoss(8, 10, **kw)


@pytest.mark.parametrize(
    "shard_sizes, exc, match",
    [
        ([float("nan"), 1.0], ValueError, "shard_sizes"),
        ([float("inf"), 1.0], ValueError, "shard_sizes"),
        (10, TypeError, "shard_sizes"),
        ("55", TypeError, "shard_sizes"),
        ([5, "5"], TypeError, "shard_sizes"),
    ],
)
def test_shard_sizes_refused(shard_sizes, exc, match):
    with pytest.raises(exc, match=match):
        _head(devices=["cpu", "cpu"], shard_sizes=shard_sizes)


def test_numpy_integer_shard_sizes_are_ints():
    head = _head(devices=["cpu", "cpu"], shard_sizes=[np.int64(3), np.int64(7)])
    assert head.shard_sizes == (3, 7)
    with pytest.raises(ValueError, match="sums to 9"):
        _head(devices=["cpu", "cpu"], shard_sizes=[np.int64(3), np.int64(6)])


@pytest.mark.parametrize(
    "topk, exc",
    [
        ("15", TypeError),
        ((1.5,), TypeError),
        ((0,), ValueError),
        (None, None),
        (torch.tensor(2), TypeError),
        (np.array(2), TypeError),
    ],
)
def test_topk(topk, exc):
    if exc is None:
        assert _head(topk=topk).topk == ()
        return
    with pytest.raises(exc, match="argument `topk`"):
        _head(topk=topk)
    head, x, y = _head(), torch.randn(3, 8), torch.randint(0, 10, (3,))
    with pytest.raises(exc, match="argument `topk`"):
        head(x, y, return_details=True, topk=topk)
    with pytest.raises(exc, match="argument `topk`"):
        shardkit.sharded_cross_entropy(x, list(head.weight_shards), y, return_details=True, topk=topk)


def test_sample_generator_must_be_generators():
    head = _head(sample_rate=0.5)
    with pytest.raises(TypeError, match="sample_generator"):
        head.sample_generator = 5
    head.sample_generator = torch.Generator().manual_seed(0)  # accepted, and used
    head.sample_generator = [torch.Generator()]
    head.sample_generator = None


def test_devices_without_a_gpu_or_unsupported(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match=r"`devices`: cuda:0 is not available \(0 CUDA GPU"):
        _head(devices=["cuda:0"])
    with pytest.raises(ValueError, match="`devices`: meta is not supported"):
        _head(devices=["meta"])


def test_functional_form_bad_containers():
    e, y = torch.randn(4, 8), torch.randint(0, 10, (4,))
    with pytest.raises(TypeError, match="weight_shards"):
        shardkit.sharded_cross_entropy(e, None, y)
    w = [torch.randn(5, 8), torch.randn(5, 8)]
    with pytest.raises(TypeError, match="class_offsets"):
        shardkit.sharded_cross_entropy(e, w, y, class_offsets=[0.5, 5])
    with pytest.raises(TypeError, match="class_offsets"):
        shardkit.sharded_cross_entropy(e, w, y, class_offsets="05")
    with pytest.raises(ValueError, match=r"`weight_shards\[0\]` is on meta; shardkit's kernels run on cpu and cuda"):
        shardkit.sharded_cross_entropy(e.to("meta"), [t.to("meta") for t in w], y.to("meta"))
    with pytest.raises(ValueError, match=r"`embeddings` is on meta; shardkit's kernels run on cpu and cuda"):
        shardkit.sharded_cross_entropy(e.to("meta"), w, y.to("meta"))


def test_scale_beyond_float32():
    with pytest.raises(ValueError, match="`s`"):
        ArcFace(1e39, 0.5)
    # finite, but the logits (or their sums under label smoothing) overflowed float32 to inf
    with pytest.raises(ValueError, match=r"CosFace: arguments `s` and `m` give logits up to"):
        CosFace(64, 1e39)
    with pytest.raises(ValueError, match=r"arguments `s` and `m3` give logits up to"):
        CombinedMargin(64, 1.0, 0.0, 1e37)
    with pytest.raises(ValueError, match=r"arguments `s` and `m` give logits up to"):
        CosFace(3.4e38, 0.1)
    assert CosFace(1e29, 0.35).scale == 1e29
    with pytest.raises(ValueError, match="`s`"):
        CombinedMargin(float("inf"), 1.0, 0.3, 0.2)
    x, w, y = torch.randn(3, 4), torch.randn(6, 4), torch.randint(0, 6, (3,))
    with pytest.raises(RuntimeError, match="`scale`"):
        ops.ce_shard_stats(x, w, y, scale=1e300)
    # float64 computes in double: a large but finite scale is allowed there
    lse = ops.ce_shard_stats(x.double(), w.double(), y, scale=1e300)[0]
    assert not torch.isnan(lse).any()
    with pytest.raises(RuntimeError, match="`m2` and `m3` must be finite"):
        ops.ce_shard_stats(x, w, y, scale=30.0, m2=float("nan"), normalize=True)


def test_split_to_devices_sizes_that_wrap_int64():
    big = 2**63 - 1
    with pytest.raises(RuntimeError, match="split_sizes"):
        torch.ops.shardkit.split_to_devices([torch.arange(4.0)], [big, big, 6], 0, ["cpu"] * 3)


def test_normalize_ranges_and_construction_checks():
    img = torch.randint(0, 256, (2, 5, 5, 3), dtype=torch.uint8)
    # the op itself (not only the Python wrapper) refuses constants that overflow
    with pytest.raises(RuntimeError, match="beyond the range"):
        torch.ops.shardkit.normalize_images(img, [0.5] * 3, [1e-45] * 3, True, torch.float32, False)
    with pytest.raises(RuntimeError, match="beyond the range"):
        torch.ops.shardkit.normalize_images(img, [1e38] * 3, [1e-3] * 3, True, torch.float32, False)
    # the wrapper names mean when mean is the problem, and knows float16's range
    with pytest.raises(ValueError, match=r"`mean\[0\]` = 1e\+300"):
        shardkit.Normalize(mean=(1e300,) * 3, std=(0.5,) * 3)
    with pytest.raises(ValueError, match="float16"):
        ops.normalize_images(img, (0.5,) * 3, (1e-6,) * 3, dtype=torch.float16)
    out = ops.normalize_images(img, (0.5,) * 3, (1e-6,) * 3, dtype=torch.float32)  # fits float32
    assert torch.isfinite(out).all()
    # checked at construction, not at the first call
    with pytest.raises(ValueError, match="at most 64 channels"):
        shardkit.Normalize(mean=(0.5,) * 65, std=(0.5,) * 65)
    with pytest.raises(ValueError, match="`dtype`"):
        shardkit.Normalize(mean=(0.5,) * 3, std=(0.5,) * 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="`memory_format`"):
        shardkit.Normalize(mean=(0.5,) * 3, std=(0.5,) * 3, memory_format=torch.preserve_format)


# ---- layouts, kernel dtypes, meta tensors and sizes past int64 (second API probe) --------


def _sparse_and_nested(x):
    nested = torch.nested.nested_tensor([x[0], x[1]]) if x.dim() == 2 else None
    return [("sparse_coo", x.to_sparse()), ("nested", nested)]


def test_sparse_nested_and_fp8_inputs_are_named():
    head = _head(devices=["cpu", "cpu"])
    x, y = torch.randn(2, 8), torch.tensor([1, 7])
    for layout, bad in _sparse_and_nested(x):
        msg = f"argument `embeddings` must be a dense \\(strided\\) tensor, got a .*{layout}"
        with pytest.raises(TypeError, match=msg):
            head(bad, y)
    with pytest.raises(TypeError, match="argument `labels` must be a dense"):
        head(x, y.to_sparse())
    with pytest.raises(TypeError, match="argument `embeddings` must be float32, bfloat16, float16 or float64"):
        head(x.to(torch.float8_e4m3fn), y)
    with pytest.raises(TypeError, match="argument `dtype` must be float32, bfloat16, float16 or float64"):
        _head(dtype=torch.float8_e5m2)
    with pytest.raises(TypeError, match=r"argument `weight_shards\[0\]` must be a dense"):
        shardkit.sharded_cross_entropy(x, [torch.randn(10, 8).to_sparse()], y)
    with pytest.raises(ValueError, match=r"argument `weight_shards\[1\]` is on meta"):
        shardkit.sharded_cross_entropy(x, [torch.randn(5, 8), torch.randn(5, 8, device="meta")], y)
    with pytest.raises(ValueError, match=r"argument `weight_shards\[0\]` is on meta"):
        _head().to("meta")(x, y)


def test_sizes_past_int64_are_named():
    with pytest.raises(ValueError, match="arguments `num_classes` x `embedding_dim`"):
        shardkit.ShardedSoftmaxLoss(4, 2**63)
    with pytest.raises(ValueError, match="argument `ignore_index` must fit in int64"):
        _head(ignore_index=2**70)
    # finite proportions whose sum overflows to inf: still proportions
    assert _head(devices=["cpu"] * 2, shard_sizes=[1e308, 1e308]).shard_sizes == (5, 5)
    assert _head(devices=["cpu"] * 3, shard_sizes=[1.7e308, 0.0, 1.7e308]).shard_sizes == (5, 0, 5)


def test_ce_shard_stats_with_a_meta_tensor_among_real_ones_is_named():
    # the meta kernel would otherwise answer with uninitialized memory on x's device
    x, w, y = torch.randn(6, 8), torch.randn(10, 8), torch.randint(0, 10, (6,))
    for name, args, kw in (
        ("labels", (x, w, y.to("meta")), {}),
        ("w", (x, w.to("meta"), y), {}),
        ("target_ref", (x, w, y), {"target_ref": torch.zeros(6, device="meta")}),
    ):
        with pytest.raises(RuntimeError, match=f"argument `{name}` must be on the device of `x` \\(cpu\\), got meta"):
            ops.ce_shard_stats(*args, **kw)
    lse = ops.ce_shard_stats(*(t.to("meta") for t in (x, w, y)))[0]  # all on meta: shapes only
    assert lse.device.type == "meta" and lse.shape == (6,)


def test_import_full_weight_refuses_meta_and_sparse():
    head = _head(devices=["cpu", "cpu"])
    for bad in (torch.zeros(10, 8, device="meta"), torch.zeros(10, 8).to_sparse()):
        with pytest.raises(TypeError, match="argument `weight` must be a dense tensor with data"):
            shardkit.import_full_weight(head, bad)


def test_normalize_sparse_images_and_ema_decay_tensor_are_named():
    images = torch.zeros(2, 4, 4, 3, dtype=torch.uint8)
    with pytest.raises(TypeError, match="argument `images` must be a dense"):
        ops.normalize_images(images.to_sparse(), (0.5,) * 3, (0.5,) * 3)
    e, m = [torch.zeros(3)], [torch.ones(3)]
    with pytest.raises(TypeError, match="argument `decay` must be a float in"):
        ops.ema_update_(e, m, torch.tensor([0.9, 0.9]))
    ops.ema_update_(e, m, torch.tensor(0.75))  # a one-element tensor is a decay
    assert torch.allclose(e[0], torch.full((3,), 0.25))


def test_sparse_row_sgd_nesterov_must_be_a_bool():
    p = torch.nn.Parameter(torch.zeros(3, 2))
    with pytest.raises(TypeError, match="argument `nesterov` must be True or False, got 'no'"):
        shardkit.SparseRowSGD([p], lr=0.1, momentum=0.9, nesterov="no")


def test_full_weight_device_is_checked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    head = shardkit.ShardedSoftmaxLoss(4, 10)
    with pytest.raises(ValueError, match=r"argument `device`: cuda(:0)? is not available \(0 CUDA GPU"):
        head.full_weight("cuda")
    with pytest.raises(ValueError, match="argument `device` must name a device, got 'bogus'"):
        head.full_weight("bogus")
    assert torch.equal(head.full_weight("cpu"), head.weight_shards[0].detach())


def test_a_head_its_device_cannot_hold_is_a_memory_error_naming_its_size():
    # The allocator's own message ("[enforce fail at alloc_cpu.cpp] ... can't allocate memory")
    # named neither argument.
    with pytest.raises(
        MemoryError, match=r"1099511627776 classes x 1 \(`num_classes`, `embedding_dim`\) needs 4096.0 GiB"
    ):
        shardkit.ShardedSoftmaxLoss(1, 2**40)


@pytest.mark.parametrize("rate", [10**400, -(10**30), 0, 2])
def test_an_int_sample_rate_out_of_range_is_named(rate):
    # 10**400 raised Python's bare OverflowError ("int too large to convert to float").
    with pytest.raises(ValueError, match=r"argument `sample_rate` must be in \(0, 1\]"):
        shardkit.ShardedSoftmaxLoss(4, 10, sample_rate=rate)


def test_label_smoothing_takes_real_numbers_and_refuses_the_rest_by_name():
    # numpy scalars were refused ("must be a float, got float32") though nn.CrossEntropyLoss,
    # sample_rate and the margins take them; 10**400 raised a bare OverflowError.
    x, y = torch.randn(5, 8), torch.randint(0, 10, (5,))
    ref = _head(label_smoothing=0.25)
    for value in (np.float32(0.25), np.float64(0.25)):
        head = _head(label_smoothing=value)
        head.load_state_dict(ref.state_dict())
        torch.testing.assert_close(head(x, y), ref(x, y), rtol=0, atol=0)
    for value, exc in (
        (10**400, ValueError),
        (float("nan"), ValueError),
        (np.float32(1.5), ValueError),
        (True, TypeError),
        ("0.1", TypeError),
    ):
        with pytest.raises(exc, match="argument `label_smoothing`"):
            _head(label_smoothing=value)
        with pytest.raises(exc, match="argument `label_smoothing`"):
            shardkit.sharded_cross_entropy(x, list(ref.weight_shards), y, label_smoothing=value)


def test_a_shard_replaced_by_one_of_another_shape_is_refused_at_the_forward():
    # The loss ran over 22 classes (labels 20 and 21 accepted) while num_classes said 20, and
    # state_dict() saved a weight no 20-class head would load.
    head = shardkit.ShardedSoftmaxLoss(8, 20, devices=["cpu", "cpu"])
    x, y = torch.randn(4, 8), torch.randint(0, 20, (4,))
    good = head(x, y)
    kept = head.weight_shards[0]
    for shape in ((12, 8), (10, 6), (10,)):
        head.weight_shards[0] = torch.nn.Parameter(torch.randn(shape))
        with pytest.raises(ValueError, match=r"argument `weight_shards` was changed to shapes .* holds 20 classes"):
            head(x, y)
    head.weight_shards[0] = torch.nn.Parameter(kept.detach().clone())  # the same shape: a new Parameter is fine
    torch.testing.assert_close(head(x, y), good, rtol=0, atol=0)
