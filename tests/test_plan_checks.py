"""Argument checks of the planner's public helpers: bad input is a ValueError naming the
argument, never a bare AssertionError, an OverflowError naming nothing, a coerced value or
a silently wrong figure; and balance_shards is exact at any size."""

import re

import numpy as np
import pytest

from shardkit.plan import (
    balance_shards,
    format_size,
    head_bytes_per_class,
    kept_logits,
    largest_classes,
    main,
    parse_size,
    plan_memory,
)

GiB = 1 << 30
ARGS = dict(classes=1000, dim=64, devices=1, batch=8)


@pytest.mark.parametrize(
    "classes, used",
    [
        (10, [2**62, 2**62]),  # was [1, 1]: the float level lost the classes under 2**62 bytes
        (2**62, [0, 0, 0]),  # was 253 short
        (2**63 - 1, [2**63, 0, 5, 2**40]),
        (7, [2**63, 2**63 - 1, 2**63 - 2]),
    ],
)
def test_balance_shards_sums_exactly_at_huge_sizes(classes, used):
    sizes = balance_shards(classes, 1, used)
    assert sum(sizes) == classes and min(sizes) >= 0 and len(sizes) == len(used)


def test_balance_shards_huge_and_small_agree():
    assert balance_shards(10, 1, [2**62, 2**62]) == [5, 5]
    per = head_bytes_per_class(1)
    assert balance_shards(3, 1, [2**62 + 3 * per, 2**62]) == [0, 3]
    assert balance_shards(5, 1, [2**62 + per, 2**62]) == balance_shards(5, 1, [per, 0]) == [2, 3]


def test_balance_shards_takes_any_iterable_of_used():
    assert balance_shards(10, 8, (x for x in [0, 0])) == [5, 5]
    assert balance_shards(10, 4, {"cuda:0": "1GiB", "cuda:1": 0}.values()) == [0, 10]
    for bad in ({"cuda:0": 0}, 5, "1GiB", iter([]), None):
        with pytest.raises(ValueError, match="argument `used` must list the bytes used on each device"):
            balance_shards(10, 4, bad)


@pytest.mark.parametrize(
    "dim, message",
    [(-1, "got -1"), (0, "got 0"), ("8", "got str '8'"), (8.0, "got float 8.0"), (True, "got bool True")],
)
def test_head_bytes_per_class_checks_dim(dim, message):
    with pytest.raises(ValueError, match=re.escape(f"argument `dim` must be an integer >= 1, {message}")):
        head_bytes_per_class(dim)


def test_head_bytes_per_class_takes_numpy_ints():
    assert head_bytes_per_class(np.int64(8)) == head_bytes_per_class(8) == 8 * 12 + 1  # + the row flag


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("optimizer", ["sgd", "sgd-momentum", "adam"])
def test_head_bytes_per_class_is_plan_memorys_head_per_class(dtype, optimizer):
    d = plan_memory(1000, 24, 1, 1, dtype=dtype, optimizer=optimizer).devices[0]
    assert (
        head_bytes_per_class(24, dtype, optimizer) * 1000
        == d.weights + d.master_weights + d.gradients + d.optimizer_state
    )


@pytest.mark.parametrize(
    "args, name",
    [
        ((4, 10.5, 4, 10**6), "classes"),  # was (10.5, 184.0)
        (("4", 10, 4, 100), "batch"),
        ((-1, 10, 4, 100), "batch"),
        ((4, -3, 4, 100), "classes"),
        ((4, 10, 0, 100), "chunk"),
        ((4, 10, 2.5, 100), "chunk"),
        ((True, 10, 4, 100), "batch"),
    ],
)
def test_kept_logits_checks_its_counts(args, name):
    with pytest.raises(ValueError, match=f"argument `{name}` must be an integer"):
        kept_logits(*args)


def test_kept_logits_still_takes_empty_shards_and_numpy_ints():
    assert kept_logits(4, 0, 4, 10**6) == kept_logits(0, 10, 4, 10**6) == (0, 0)
    assert kept_logits(np.int64(4), np.int32(10), np.int64(4), 10**6) == kept_logits(4, 10, 4, 10**6) == (10, 176)


def test_largest_classes_needs_gpu_memory():
    for extra in ({}, {"gpu_memory": None}):
        with pytest.raises(ValueError, match="argument `gpu_memory` is needed"):
            largest_classes(0, classes=1, dim=8, devices=1, batch=8, **extra)
    with pytest.raises(ValueError, match="argument `devices` must be an integer >= 1"):
        largest_classes(0, dim=8, devices="2", batch=8, gpu_memory="1GiB")


@pytest.mark.parametrize("rate", [10**400, -(10**400), float("inf"), float("nan")])
def test_plan_memory_huge_sample_rate_names_it(rate):
    with pytest.raises(ValueError, match=r"argument `sample_rate` must be in \(0, 1\]"):
        plan_memory(**ARGS, sample_rate=rate)


@pytest.mark.parametrize("name", ["master_weights", "sparse_grad"])
@pytest.mark.parametrize("value", ["no", "False", 2, 0, 1.0])
def test_plan_memory_flags_must_be_bools(name, value):
    with pytest.raises(ValueError, match=f"argument `{name}` must be True, False or None, got"):
        plan_memory(**ARGS, dtype="fp16", sample_rate=0.5, **{name: value})
    if name == "master_weights":
        with pytest.raises(ValueError, match=f"argument `{name}` must be True, False or None"):
            head_bytes_per_class(8, "fp16", master_weights=value)


def test_plan_memory_flags_take_numpy_bools():
    for name in ("master_weights", "sparse_grad"):
        for value in (True, False):
            ref = plan_memory(**ARGS, dtype="fp16", sample_rate=0.5, **{name: value})
            assert plan_memory(**ARGS, dtype="fp16", sample_rate=0.5, **{name: np.bool_(value)}) == ref
    assert plan_memory(**ARGS, dtype="fp16", master_weights=False).master_weights is False


@pytest.mark.parametrize(
    "value, message", [(-1, "got -1"), (1.5, "got float 1.5"), ("8", "got str '8'"), (None, "got NoneType None")]
)
def test_format_size_checks_nbytes(value, message):
    with pytest.raises(ValueError, match=re.escape(f"argument `nbytes` must be an integer >= 0, {message}")):
        format_size(value)


def test_format_size_of_huge_ints():
    # 2**1100 raised an OverflowError (int / float); plans of 2**62 classes reach 2**67 bytes
    assert format_size(2**1100) == f"{2**1070:,}.0 GiB"
    assert format_size(2**1000 + 2**29) == f"{2**970:,}.5 GiB"
    assert format_size(2**67) == f"{2**37:,}.0 GiB"
    assert format_size(np.int64(200 * GiB)) == "200.0 GiB"
    assert format_size(0) == "0.0 MiB"


@pytest.mark.parametrize("value", ["-0", "5e", "e", "+5", "1e"])
def test_cli_size_hint_never_suggests_what_fails(value, capsys):
    # "-0" hinted "write e.g. -0GiB" and "5e" "5eGiB", both then refused.
    with pytest.raises(SystemExit) as e:
        main(["--classes", "1000", "--dim", "8", "--batch", "4", "--gpu-memory", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "has no unit" not in err and "cannot parse size" in err, err


@pytest.mark.parametrize("value", ["80", "1.5", "1e3", "1e10", "1e18", " 7 "])
def test_cli_size_hint_suggests_only_values_that_parse(value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--classes", "1000", "--dim", "8", "--batch", "4", "--gpu-memory", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "has no unit" in err, err
    hint = err.split("has no unit: ", 1)[1]
    suggested = re.findall(r"[0-9.eE+-]+(?:GiB|GB|B)\b", hint)
    assert suggested and all(parse_size(s) > 0 for s in suggested), hint


def test_a_reserve_without_gpu_memory_is_refused():
    # it used to be ignored: nothing is checked against the memory it is taken off
    with pytest.raises(ValueError, match="argument `reserve` needs argument `gpu_memory`"):
        plan_memory(**ARGS, reserve="8GiB")
    assert plan_memory(**ARGS, reserve=0).devices[0].fits is None  # 0 is the default
