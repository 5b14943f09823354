"""Strict bool and top-k arguments of the sharded loss (found by a bad-input probe): a string
or a number given for a bool flag is refused, not taken by its truthiness, and a top-k k
above the class count (every row would count as a hit) is refused as torch.topk does."""

import numpy as np
import pytest
import torch

import shardkit


def _inputs(num_classes=10, dim=8, batch=4):
    return torch.randn(batch, dim), torch.randint(0, num_classes, (batch,))


@pytest.mark.parametrize("value", ["no", "", 1, 0, 1.0, None, torch.tensor(True)])
def test_forward_return_details_must_be_a_bool(value):
    head = shardkit.ShardedSoftmaxLoss(8, 10, devices=["cpu"] * 2)
    x, y = _inputs()
    with pytest.raises(TypeError, match="return_details"):
        head(x, y, return_details=value)
    with pytest.raises(TypeError, match="return_details"):
        shardkit.sharded_cross_entropy(x, list(head.weight_shards), y, return_details=value)


def test_forward_return_details_takes_python_and_numpy_bools():
    head = shardkit.ShardedSoftmaxLoss(8, 10)
    x, y = _inputs()
    assert isinstance(head(x, y, return_details=np.bool_(True)), shardkit.ShardedLossOutput)
    assert isinstance(head(x, y, return_details=np.bool_(False)), torch.Tensor)
    assert isinstance(head(x, y, return_details=False), torch.Tensor)


@pytest.mark.parametrize("value", [1.0, 1, 0, None, torch.tensor(True)])
def test_check_inputs_must_be_a_bool_or_async(value):
    with pytest.raises(TypeError, match="check_inputs"):
        shardkit.ShardedSoftmaxLoss(8, 10, check_inputs=value)
    x, y = _inputs()
    with pytest.raises(TypeError, match="check_inputs"):
        shardkit.sharded_cross_entropy(x, [torch.randn(10, 8)], y, check_inputs=value)
    with pytest.raises(ValueError, match="check_inputs"):
        shardkit.ShardedSoftmaxLoss(8, 10, check_inputs="yes")


def test_check_inputs_numpy_bool_becomes_a_python_bool():
    head = shardkit.ShardedSoftmaxLoss(8, 10, check_inputs=np.bool_(False))
    assert head.check_inputs is False
    assert shardkit.ShardedSoftmaxLoss(8, 10, check_inputs="async").check_inputs == "async"
    x, y = _inputs()
    with pytest.raises(ValueError, match="labels"):
        shardkit.ShardedSoftmaxLoss(8, 10, check_inputs=np.bool_(True))(x, y + 10)


@pytest.mark.parametrize("topk", [11, 2**63, (1, 11), [0], -1])
def test_topk_above_num_classes_or_below_one_is_refused(topk):
    x, y = _inputs()
    with pytest.raises(ValueError, match="topk"):
        shardkit.ShardedSoftmaxLoss(8, 10, topk=topk)
    head = shardkit.ShardedSoftmaxLoss(8, 10, devices=["cpu"] * 2)
    with pytest.raises(ValueError, match="topk"):
        head(x, y, return_details=True, topk=topk)
    with pytest.raises(ValueError, match="topk"):
        shardkit.sharded_cross_entropy(x, list(head.weight_shards), y, return_details=True, topk=topk)


def test_topk_bound_is_the_full_class_count_with_sampling():
    # Sampling uses fewer classes per step; k is still bounded by num_classes (10), not by them.
    head = shardkit.ShardedSoftmaxLoss(8, 10, devices=["cpu"] * 2, sample_rate=0.3, topk=(1, 10))
    x, y = _inputs()
    out = head(x, y, return_details=True)
    assert set(out.correct) == {1, 10}
    with pytest.raises(ValueError, match="topk"):
        head(x, y, return_details=True, topk=11)
    shards = list(head.weight_shards)
    out = shardkit.sharded_cross_entropy(x, shards, y, return_details=True, topk=10, sample_rate=0.3)
    assert set(out.correct) == {10}


def test_topk_equal_to_num_classes_counts_every_valid_row():
    head = shardkit.ShardedSoftmaxLoss(8, 10)
    x, y = _inputs()
    out = head(x, y, return_details=True, topk=(1, 10))
    assert int(out.correct[10]) == 4


def test_default_topk_drops_ks_above_a_small_class_count():
    assert shardkit.ShardedSoftmaxLoss(8, 3).topk == (1,)
    assert shardkit.ShardedSoftmaxLoss(8, 10).topk == (1, 5)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    assert set(shardkit.ShardedSoftmaxLoss(8, 3)(x, y, return_details=True).correct) == {1}
    with pytest.raises(ValueError, match="topk"):
        shardkit.ShardedSoftmaxLoss(8, 3, topk=(1, 5))
