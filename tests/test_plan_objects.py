"""shardkit.plan's objects beyond the command line's text: DeviceMemory, MemoryPlan (its
fields against hand-computed figures, the most loaded device) and format_plan on a plan
built by hand (each figure in its row and column)."""

import re

import pytest

from shardkit.plan import DeviceMemory, MemoryPlan, format_plan, format_size, plan_memory

MiB, GiB = 2**20, 2**30


def _device(approach, classes, *mib, parts=None, fits=None):
    """A DeviceMemory with its five parts given in MiB."""
    weights, master, grads, state, loss = (m * MiB for m in mib)
    return DeviceMemory(approach, classes, weights, master, grads, state, loss, parts or {}, fits)


def _plan(devices, gpu_memory=None, reserve=0):
    return MemoryPlan(
        classes=1_000_003,
        dim=96,
        num_devices=len(devices),
        batch=12,
        global_batch=12 * len(devices),
        dtype="bf16",
        optimizer="adamw",
        sample_rate=0.25,
        master_weights=True,
        chunk_classes=4_032,
        gpu_memory=gpu_memory,
        reserve=reserve,
        devices=devices,
        partial_fc=_device("partial_fc", 333_335, 11, 0, 13, 17, 19, parts={"pfc part": 19 * MiB}, fits=False),
        naive=_device("naive", 1_000_003, 23, 29, 31, 37, 41, parts={"naive part": 41 * MiB}, fits=False),
    )


def test_device_memory_total_sums_its_five_parts():
    d = _device("shardkit", 7, 1, 2, 3, 5, 7)
    assert d.total == (1 + 2 + 3 + 5 + 7) * MiB
    assert d.loss_parts == {} and d.fits is None
    assert DeviceMemory("naive", 1, 1, 0, 0, 0, 0).loss_parts is not DeviceMemory("naive", 1, 1, 0, 0, 0, 0).loss_parts


def test_shardkit_max_is_the_most_loaded_device_wherever_it_is():
    devices = [_device("shardkit", 10, 1, 1, 1, 1, 1), _device("shardkit", 9, 1, 1, 1, 1, 9)]
    devices.append(_device("shardkit", 8, 2, 2, 2, 2, 2))
    assert _plan(devices).shardkit_max is devices[1]
    # plan_memory: the first shards take the remainder classes, so the first device is the most loaded
    p = plan_memory(10, 16, 3, 4)
    assert p.shardkit_max is p.devices[0] and p.shardkit_max.total > p.devices[1].total


def test_memory_plan_fields_are_the_inputs_and_hand_computed_figures():
    p = plan_memory(1_000_000, 512, 2, 64, dtype="bf16", gpu_memory="80GiB", reserve="2GiB", sample_rate=0.5)
    assert (p.classes, p.dim, p.num_devices, p.batch, p.global_batch) == (1_000_000, 512, 2, 64, 128)
    assert (p.dtype, p.optimizer, p.sample_rate, p.master_weights) == ("bf16", "sgd-momentum", 0.5, True)
    assert (p.gpu_memory, p.reserve) == (80 * GiB, 2 * GiB)
    # one class of a chunk: 128 fp32 logits + 128 bf16 gradient values + two fp32 rows of 512
    per_class = 128 * (4 + 2) + 2 * 512 * 4
    chunk = (192 * MiB) // per_class  # the default budget, rounded down to a multiple of 64
    assert p.chunk_classes == chunk - chunk % 64 == 41_344
    assert p.devices[0].loss_parts["chunk logits + weight rows"] == 41_344 * per_class
    assert plan_memory(1_000_000, 512, 2, 64).master_weights is False  # fp32: no master copy
    assert plan_memory(100, 512, 1, 64).chunk_classes == 100  # never more than a shard's classes
    for d in p.devices + [p.partial_fc, p.naive]:
        assert d.fits is (d.total + 2 * GiB <= 80 * GiB)


def _row(text, label, values):
    pattern = re.escape(label) + "".join(r"\s+" + re.escape(v) for v in values) + "$"
    return [line for line in text.splitlines() if re.fullmatch(pattern, line)]


def test_format_plan_puts_each_figure_in_its_row_and_column():
    heavy = _device("shardkit", 500_002, 2, 3, 5, 7, 101, parts={"heavy part": 101 * MiB}, fits=True)
    light = _device("shardkit", 500_001, 1, 1, 1, 1, 1, parts={"light part": MiB}, fits=True)
    p = _plan([light, heavy], gpu_memory=80 * GiB, reserve=2 * GiB)
    text = format_plan(p)
    assert text.splitlines()[0] == (
        "shardkit memory plan: 1,000,003 classes x 96-d head, 2 device(s), batch 12 per device (global 24)"
    )
    assert text.splitlines()[1] == (
        "dtype bf16 + fp32 master weights, optimizer adamw, sample rate 0.25, chunk 4,032 classes"
    )
    cols = [heavy, p.partial_fc, p.naive]  # the most loaded shardkit device, not the first
    assert _row(text, "classes held", ["500,002", "333,335", "1,000,003"])
    for label, attr in [
        ("weights", "weights"),
        ("master weights (fp32)", "master_weights"),
        ("gradients", "gradients"),
        ("optimizer state", "optimizer_state"),
        ("loss working set", "loss_working_set"),
        ("total", "total"),
    ]:
        assert _row(text, label, [format_size(getattr(d, attr)) for d in cols]), label
    assert _row(text, "total (GiB)", [f"{d.total / GiB:,.2f} GiB" for d in cols])
    assert _row(text, "fits in 80 GiB - 2 GiB reserve", ["yes", "NO", "NO"])
    assert "loss working set, shardkit: heavy part 101.0 MiB" in text and "light part" not in text
    assert "loss working set, naive: naive part 41.0 MiB" in text
    assert "fits in" not in format_plan(_plan([light, heavy]))  # no gpu_memory, no verdict


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_format_plan_of_plan_memory_shows_its_figures(dtype):
    p = plan_memory(2_000_000, 512, 2, 64, dtype=dtype, gpu_memory="80GiB")
    text = format_plan(p)
    assert _row(text, "weights", [format_size(d.weights) for d in (p.shardkit_max, p.partial_fc, p.naive)])
    assert ("+ fp32 master weights" in text) is (dtype == "fp16")
    assert f"chunk {p.chunk_classes:,} classes" in text
