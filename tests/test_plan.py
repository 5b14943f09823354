"""shardkit.plan: figures against hand-computed cases (computed here from first principles)."""

import math
import os
import subprocess
import sys

import pytest
import torch

from shardkit.plan import balance_shards, format_size, main, parse_size, plan_memory

MiB, GiB = 2**20, 2**30


def test_million_classes_write_up():
    # The write-up: 1M classes x 512-d fp32 weights = 1953 MB (MiB): 10^6 * 512 * 4 bytes.
    p = plan_memory(10**6, 512, devices=1, batch=64, dtype="fp32")
    assert p.naive.weights == 10**6 * 512 * 4
    assert p.naive.weights / MiB == pytest.approx(1953.125)
    assert p.devices[0].weights == p.naive.weights
    # and 2M / 5M classes: 3906 / 9765 MiB
    for millions, mib in [(2, 3906), (5, 9765)]:
        assert int(plan_memory(millions * 10**6, 512, 1, 64).naive.weights / MiB) == mib


def test_fp16_master_weights_sgd_momentum_two_devices():
    c, d, n, b = 2_000_000, 512, 2, 64
    p = plan_memory(c, d, n, b, dtype="fp16", optimizer="sgd-momentum")
    rows = c // n
    for dev in p.devices:
        assert dev.classes == rows
        assert dev.weights == rows * d * 2  # fp16 storage
        assert dev.gradients == rows * d * 2
        assert dev.master_weights == rows * d * 4  # fp32 master copy
        assert dev.optimizer_state == rows * d * 4 + rows  # one fp32 momentum buffer + SparseRowSGD's row flags
    assert p.global_batch == n * b
    # Naive: the whole head on one device, logits [B, C] fp16 + fp32 log-softmax + fp32 grad.
    B = n * b
    assert p.naive.loss_parts["logits [B, C]"] == B * c * 2
    assert p.naive.loss_working_set >= B * c * (2 + 4 + 4)


@pytest.mark.parametrize("optimizer,states", [("sgd", 0), ("sgd-momentum", 1), ("adam", 2), ("adamw", 2)])
def test_optimizer_states_fp32(optimizer, states):
    p = plan_memory(1000, 64, 1, 8, optimizer=optimizer)
    flags = 1000 if optimizer == "sgd-momentum" else 0  # SparseRowSGD's bool per row
    assert p.devices[0].optimizer_state == states * 1000 * 64 * 4 + flags
    assert p.devices[0].master_weights == 0


def test_sgd_momentum_state_equals_what_sparse_row_sgd_allocates():
    import shardkit

    head = shardkit.ShardedSoftmaxLoss(16, 203, devices=["cpu"], sample_rate=0.5)
    opt = shardkit.SparseRowSGD(head.parameters(), lr=0.1, momentum=0.9)
    head(torch.randn(8, 16), torch.randint(0, 203, (8,))).backward()
    opt.step()
    held = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values())
    assert held == plan_memory(203, 16, 1, 8, sample_rate=0.5).devices[0].optimizer_state


def test_no_master_weights_keeps_state_in_dtype():
    p = plan_memory(1000, 64, 1, 8, dtype="bf16", optimizer="adam", master_weights=False)
    assert p.devices[0].master_weights == 0
    assert p.devices[0].optimizer_state == 2 * 1000 * 64 * 2


def test_uneven_shards_cover_all_classes():
    p = plan_memory(10, 16, 3, 4)
    assert [d.classes for d in p.devices] == [4, 3, 3]
    assert sum(d.weights for d in p.devices) == 10 * 16 * 4
    assert p.shardkit_max.classes == 4


def test_shardkit_working_set_independent_of_classes():
    # Chunked logits: the working set depends on the batch and the budget, not on C.
    small = plan_memory(10**6, 512, 1, 128).devices[0]
    large = plan_memory(10**7, 512, 1, 128).devices[0]
    assert small.loss_working_set == large.loss_working_set
    assert small.loss_parts["chunk logits + weight rows"] <= 192 * MiB
    # The naive working set grows linearly with C: B * C * (4 + 4 + 4) bytes in fp32.
    n1, n2 = plan_memory(10**6, 512, 1, 128).naive, plan_memory(2 * 10**6, 512, 1, 128).naive
    assert n2.loss_working_set - n1.loss_working_set == 128 * 10**6 * 12


def test_sampling():
    c, d, n, b, rate = 1_000_000, 128, 4, 32, 0.1
    full = plan_memory(c, d, n, b)
    p = plan_memory(c, d, n, b, sample_rate=rate)
    rows = c // n
    s = math.ceil(rate * rows)
    # shardkit keeps the whole weight and its optimizer state under sampling.
    assert p.devices[0].weights == full.devices[0].weights
    assert p.devices[0].optimizer_state == full.devices[0].optimizer_state
    # shardkit's sampled mode gives a row-sparse gradient (the sampled rows only) by default.
    assert p.devices[0].gradients == s * d * 4
    assert plan_memory(c, d, n, b, sample_rate=rate, sparse_grad=True).devices[0].gradients == s * d * 4
    assert plan_memory(c, d, n, b, sample_rate=rate, sparse_grad=False).devices[0].gradients == rows * d * 4
    # PartialFC_V2 keeps [B_global, S] fp32 logits (held, grad, one-hot).
    B = n * b
    assert p.partial_fc.loss_parts["logits [B, S] fp32 (held, backward grad, one-hot)"] == 3 * B * s * 4
    assert p.partial_fc.weights == rows * d * 4 and p.partial_fc.gradients == rows * d * 4


def test_sampling_keeps_every_positive():
    # 100 classes, 64 labels in the batch: at least 64 rows are used even at rate 0.01.
    p = plan_memory(100, 8, 1, 64, sample_rate=0.01, sparse_grad=True)
    assert p.devices[0].gradients == 64 * 8 * 4


def test_fits_and_reserve():
    p = plan_memory(1000, 64, 1, 8)
    total = p.devices[0].total
    assert plan_memory(1000, 64, 1, 8, gpu_memory=total).devices[0].fits is True
    assert plan_memory(1000, 64, 1, 8, gpu_memory=total - 1).devices[0].fits is False
    assert plan_memory(1000, 64, 1, 8, gpu_memory=total, reserve=1).devices[0].fits is False
    assert p.devices[0].fits is None
    # 2M classes fp32, 128 global batch: the naive head does not fit an 11 GB card, sharded does.
    q = plan_memory(2_000_000, 512, 2, 64, gpu_memory="11178MiB")
    assert q.naive.fits is False and all(d.fits for d in q.devices)


def test_total_is_sum_of_parts():
    d = plan_memory(12345, 77, 3, 5, dtype="bf16", optimizer="adamw", sample_rate=0.3).devices[1]
    assert d.total == d.weights + d.master_weights + d.gradients + d.optimizer_state + d.loss_working_set
    assert d.loss_working_set == sum(d.loss_parts.values())


@pytest.mark.parametrize(
    "text,expected",
    [
        ("80GiB", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("81920MiB", 80 * 2**30),
        ("1.5 TiB", 3 * 2**39),
        ("512", 512),
        ("64m", 64 * 2**20),
        ("2kb", 2000),
        (1024, 1024),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["80XB", "GiB", "-1GiB", "", "1e400GiB"])
def test_parse_size_errors(text):
    with pytest.raises(ValueError, match=r"cannot parse size|must be a finite non-negative"):
        parse_size(text)


def test_format_size():
    assert format_size(10**6 * 512 * 4) == "1,953.1 MiB"
    assert format_size(200 * GiB) == "200.0 GiB"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(classes=0), r"argument `classes` must be an integer >= 1"),
        (dict(dim=2.5), r"argument `dim` must be an integer"),
        (dict(dtype="fp8"), r"argument `dtype` must be one of"),
        (dict(optimizer="lamb"), r"argument `optimizer` must be one of"),
        (dict(sample_rate=1.5), r"argument `sample_rate` must be in \(0, 1\]"),
        (dict(chunk_budget=0), r"argument `chunk_budget` must be > 0"),
        (dict(dtype=["fp16"]), r"argument `dtype` must be one of .*, got \['fp16'\]"),  # unhashable
        (dict(optimizer={"sgd": 1}), r"argument `optimizer` must be one of"),
        (dict(sample_rate=True), r"argument `sample_rate` must be in \(0, 1\], got True"),
        (dict(classes=True), r"argument `classes` must be an integer >= 1, got bool"),
    ],
)
def test_plan_errors(kwargs, match):
    args = dict(classes=10, dim=4, devices=1, batch=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan_memory(**args)


def test_cli_table(capsys):
    assert (
        main(
            [
                "--classes",
                "2000000",
                "--dim",
                "512",
                "--devices",
                "2",
                "--batch",
                "64",
                "--dtype",
                "fp16",
                "--optimizer",
                "sgd-momentum",
                "--sample-rate",
                "0.1",
                "--gpu-memory",
                "80GiB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for text in [
        "2,000,000 classes",
        "global 128",
        "shardkit / device",
        "naive, 1 device",
        "fits in 80 GiB",
        "optimizer state",
        "loss working set",
    ]:
        assert text in out
    # fp16 weights of one shard: 10^6 * 512 * 2 bytes = 976.6 MiB
    assert f"{10**6 * 512 * 2 / MiB:,.1f} MiB" in out


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--classes", "0", "--dim", "4", "--batch", "2"], r"--classes must be an integer >= 1"),
        (
            ["--classes", "10", "--dim", "4", "--batch", "2", "--gpu-memory", "80XB"],
            r"argument --gpu-memory: cannot parse size",
        ),
        (["--classes", "10", "--dim", "4", "--batch", "2", "--sample-rate", "0"], r"--sample-rate must be in \(0, 1\]"),
        (["--classes", "10", "--dim", "4", "--batch", "2", "--dtype", "fp8"], r"argument --dtype: invalid choice"),
        (["--dim", "4", "--batch", "2"], r"the following arguments are required: --classes"),
    ],
)
def test_cli_errors_exit_2(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert __import__("re").search(match, err)
    # One line saying what is wrong and where to look, no usage block, no traceback.
    assert err.startswith("python -m shardkit.plan: error: ") and err.count("\n") == 1, err


def test_module_entry_point():
    # The subprocess imports the same shardkit as this test (installed, or the source tree).
    import shardkit

    here = os.path.dirname(os.path.dirname(os.path.abspath(shardkit.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(
        [sys.executable, "-m", "shardkit.plan", "--classes", "1000000", "--dim", "512", "--batch", "8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "1,953.1 MiB" in r.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "shardkit.plan", "--classes", "x"], capture_output=True, text=True, env=env, timeout=120
    )
    assert bad.returncode == 2 and "invalid int value" in bad.stderr


@pytest.mark.parametrize("devices", [1, 2, 3, 5])
def test_balance_shards_evens_out_memory(devices):
    from shardkit.plan import balance_shards, head_bytes_per_class

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    per_class = head_bytes_per_class(512, "fp16", "sgd-momentum")
    assert per_class == 512 * (2 + 4 + 4 + 2) + 1  # weight, fp32 master, fp32 momentum, gradient; row flag
    classes = int(torch.randint(1, 5_000_000, (), generator=g))
    used = [int(u) for u in torch.randint(0, 8 * 2**30, (devices,), generator=g)]
    sizes = balance_shards(classes, 512, used, dtype="fp16")
    assert len(sizes) == devices and sum(sizes) == classes and min(sizes) >= 0
    totals = [u + s * per_class for u, s in zip(used, sizes)]
    filled = [t for t, s in zip(totals, sizes) if s > 0]
    assert max(filled) - min(filled) <= 2 * per_class  # one class of rounding either way
    for t, s in zip(totals, sizes):
        if s == 0:  # a device left empty is already at least as full as the others end up
            assert t >= min(filled) - per_class


def test_balance_shards_examples_and_errors():
    from shardkit.plan import balance_shards

    assert balance_shards(10, 4, [0, 0]) == [5, 5]
    per = 4 * (4 + 4 + 4)  # fp32: weight, gradient, momentum
    assert balance_shards(10, 4, [4 * per, 0]) == [3, 7]
    assert balance_shards(10, 4, ["1GiB", 0]) == [0, 10]
    with pytest.raises(ValueError, match="argument `used`"):
        balance_shards(10, 4, [])
    with pytest.raises(ValueError, match="argument `dtype`"):
        balance_shards(10, 4, [0], dtype="fp8")


def test_negative_sizes_name_their_argument():
    for name, value in (("gpu_memory", -1), ("reserve", -5), ("chunk_budget", "x")):
        kw = {name: value}
        with pytest.raises(ValueError, match=f"argument `{name}`: "):
            plan_memory(1000, 64, 1, 8, **kw)
    with pytest.raises(ValueError, match=r"argument `used\[0\]`: size must be a finite non-negative number"):
        balance_shards(100, 8, used=[-1, 0])


def test_device_count_bounds_and_many_devices_stay_fast():
    # --devices 1e9 ran for minutes (a table row per device); more devices than classes is
    # allowed (some hold none, as ShardedSoftmaxLoss allows); the largest-C search scales.
    with pytest.raises(ValueError, match="argument `devices` must be at most 65,536, got 1,000,000,000"):
        plan_memory(classes=10**10, dim=8, devices=10**9, batch=4)
    assert [d.classes for d in plan_memory(classes=3, dim=8, devices=5, batch=4).devices] == [1, 1, 1, 0, 0]
    from shardkit.plan.budgets import largest_classes

    kw = dict(dim=8, devices=4096, batch=4, gpu_memory="80GiB")
    big = largest_classes(0, classes=10**9, **kw)
    assert big >= 4096
    plan = plan_memory(classes=big, **kw)
    assert all(d.fits for d in plan.devices)
    assert not all(d.fits for d in plan_memory(classes=big + 4096, **kw).devices)


@pytest.mark.parametrize("value", ["80", "0.5"])
@pytest.mark.parametrize("flag", ["--gpu-memory", "--reserve", "--chunk-budget", "--memory-budget"])
def test_cli_sizes_need_a_unit(flag, value, capsys):
    # "--gpu-memory 80" read as 80 bytes: every row then said "fits in 0.0 MiB: NO"; "0.5" was
    # refused as "got 0", "--memory-budget 4" planned 4 bytes
    args = ["--classes", "1000", "--dim", "8", "--batch", "4", "--gpu-memory", "80GiB", flag, value]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: '{value}' has no unit: write e.g. {value}GiB" in err, err
    assert ("for bytes, 80B" in err) == (value == "80"), err


def test_cli_a_zero_needs_no_unit(capsys):
    args = ["--classes", "1000", "--dim", "8", "--batch", "4", "--gpu-memory", "80GiB", "--reserve", "0"]
    assert main([*args, "--memory-budget", "0", "0.0", "full"]) == 0
    assert capsys.readouterr().out.count("0 (recompute)") == 2


_HUGE = str(10**400)


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--gpu-memory", "1e300TiB"], "--gpu-memory"),
        (["--gpu-memory", "80GiB", "--reserve", "1e300TiB"], "--reserve"),
        (["--chunk-budget", "1e300TiB"], "--chunk-budget"),
        (["--memory-budget", "1e300TiB"], "--memory-budget"),
        (["--gpu-memory", "9000000TiB"], "--gpu-memory"),  # finite, but past 2**63 bytes
        (["--classes", _HUGE], "--classes"),
        (["--dim", _HUGE], "--dim"),
        (["--batch", _HUGE], "--batch"),
        (["--devices", _HUGE], "--devices"),
    ],
)
def test_cli_huge_values_exit_2_naming_the_flag(extra, flag, capsys):
    # 1e300TiB was an OverflowError (float infinity to int) and a 400-digit --classes one
    # in the table's float division: tracebacks, exit 1.
    argv = ["--classes", "1000", "--dim", "8", "--batch", "4"] + extra
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m shardkit.plan: error: ") and err.count("\n") == 1, err
    assert flag in err and "Traceback" not in err and len(err) < 300, err


def test_sizes_and_counts_are_bounded_in_the_api():
    assert parse_size("8388608TiB") == 2**63  # the largest size taken
    for bad in ("8388609TiB", "1e300TiB", 2**63 + 1, 10**400, 1e300):
        with pytest.raises(ValueError, match=r"at most 2\*\*63 bytes"):
            parse_size(bad)
    with pytest.raises(ValueError, match=r"argument `classes` must be at most 2\*\*63 - 1, got a 401-digit integer"):
        plan_memory(10**400, 8, 1, 4)
    with pytest.raises(ValueError, match=r"argument `budgets\[0\]` must be at most 2\*\*63 bytes"):
        __import__("shardkit").plan.plan_budgets([10**400], classes=10, dim=8, devices=1, batch=4)
    assert plan_memory(2**62, 8, 1, 4).naive.classes == 2**62  # large but in range: figures, no error


def test_plan_takes_numpy_numbers_as_python_ones():
    import numpy as np

    args = dict(classes=1000, dim=64, devices=2, batch=8, sample_rate=0.5)
    ref = plan_memory(**args)
    got = plan_memory(
        classes=np.int64(1000), dim=np.int32(64), devices=np.int64(2), batch=np.int16(8), sample_rate=np.float32(0.5)
    )
    assert got == ref
