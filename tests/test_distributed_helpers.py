"""shardkit.distributed's public helpers check their arguments: a TypeError / ValueError
naming the argument (Python and numpy ints taken; bool, floats and strings refused), never
a float result, a cryptic TypeError or an OverflowError naming nothing."""

import re

import numpy as np
import pytest

from shardkit.distributed import class_offsets, sampled_class_counts, split_classes


def test_split_classes_and_offsets_still_work():
    assert split_classes(10, 3) == [4, 3, 3]
    assert split_classes(np.int64(10), np.int32(3)) == [4, 3, 3]
    assert all(type(s) is int for s in split_classes(np.int64(10), 4))
    assert class_offsets([4, 3, 3]) == [0, 4, 7]
    assert class_offsets(x for x in [np.int64(2), 0, 5]) == [0, 2, 2]
    assert class_offsets([]) == []


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((10.5, 2), TypeError, "argument `num_classes` must be an int >= 1, got float 10.5"),  # was [6.0, 5.0]
        (("10", 2), TypeError, "argument `num_classes` must be an int >= 1, got str '10'"),
        ((True, 2), TypeError, "argument `num_classes` must be an int >= 1, got bool True"),
        ((0, 2), ValueError, "argument `num_classes` must be an int >= 1, got 0"),
        ((10, 2.0), TypeError, "argument `world_size` must be an int >= 1, got float 2.0"),
        ((10, True), TypeError, "argument `world_size` must be an int >= 1, got bool True"),
        ((10, 0), ValueError, "argument `world_size` must be an int >= 1, got 0"),
        # (a list that long used to be built until memory ran out)
        ((10, 2**63), ValueError, f"argument `world_size` must be an int in [1, {2**20}], got {2**63}"),
        ((10, 2**20 + 1), ValueError, f"argument `world_size` must be an int in [1, {2**20}], got {2**20 + 1}"),
    ],
)
def test_split_classes_refuses_bad_arguments(args, error, message):
    with pytest.raises(error, match=re.escape(message)):
        split_classes(*args)


@pytest.mark.parametrize(
    "sizes, error, message",
    [
        ([-5, 1.5], ValueError, "argument `sizes[0]` must be an int >= 0, got -5"),  # was [0, -5]
        ([5, 1.5], TypeError, "argument `sizes[1]` must be an int >= 0, got float 1.5"),
        ([5, True], TypeError, "argument `sizes[1]` must be an int >= 0, got bool True"),
        (["5"], TypeError, "argument `sizes[0]` must be an int >= 0, got str '5'"),
        ("55", TypeError, "argument `sizes` must be a list of ints >= 0, got str"),
        (5, TypeError, "argument `sizes` must be a list of ints >= 0, got int"),
    ],
)
def test_class_offsets_refuses_bad_sizes(sizes, error, message):
    with pytest.raises(error, match=re.escape(message)):
        class_offsets(sizes)


@pytest.mark.parametrize("rate", [10**400, -(10**400)])
def test_sampled_class_counts_huge_rate_names_it(rate):
    # was an OverflowError (int too large to convert to float) naming nothing
    with pytest.raises(ValueError, match=r"argument `sample_rate` must be in \(0, 1\], got a 401-digit integer"):
        sampled_class_counts([10], rate, 4)


def test_sampled_class_counts_checks_and_numpy_ints():
    assert sampled_class_counts([np.int64(10), 20], np.float32(0.5), np.int32(4)) == [5, 10]
    assert sampled_class_counts((c for c in [10, 20]), 0.5, 4) == [5, 10]
    with pytest.raises(TypeError, match="argument `sample_rate` must be a float in"):
        sampled_class_counts([10], "0.5", 4)
    with pytest.raises(ValueError, match="argument `global_batch` must hold ints >= 0"):
        sampled_class_counts([10], 0.5, True)
    with pytest.raises(ValueError, match="argument `sizes` must hold ints >= 0"):
        sampled_class_counts(5, 0.5, 4)


def test_sampled_class_counts_exact_at_decimal_rates_and_huge_shards():
    # ceil(rate * C) in float rounded 0.07 * 100 = 7.000000000000001 up to 8 (22 of the
    # (rate, C) pairs with rate in 0.01..0.99, C < 200), and overflowed for a huge shard.
    for r in range(1, 100):
        for c in range(1, 200):
            assert sampled_class_counts([c], r / 100, 0) == [-((-r * c) // 100)], (r, c)
    assert sampled_class_counts([10**400], 0.5, 4) == [10**400 // 2]
    assert sampled_class_counts([4 * 10**30 + 1], 0.25, 0) == [10**30 + 1]
