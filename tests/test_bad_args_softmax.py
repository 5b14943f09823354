"""Bad arguments of the sharded loss, its ops, split_to_devices and normalize: each gets a clear
error that names the argument, at construction where possible, never a silent NaN / inf or a
wrong result (cases found by probing the API with bad inputs)."""

import numpy as np
import pytest
import torch

import shardkit
from shardkit import ops
from shardkit.softmax.margins import ArcFace, CombinedMargin


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


@pytest.mark.parametrize("topk, exc", [("15", TypeError), ((1.5,), TypeError), ((0,), ValueError), (None, None)])
def test_topk(topk, exc):
    if exc is None:
        assert _head(topk=topk).topk == ()
    else:
        with pytest.raises(exc, match="topk"):
            _head(topk=topk)


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
    with pytest.raises(ValueError, match="embeddings"):
        shardkit.sharded_cross_entropy(e.to("meta"), [t.to("meta") for t in w], y.to("meta"))


def test_scale_beyond_float32():
    with pytest.raises(ValueError, match="`s`"):
        ArcFace(1e39, 0.5)
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
