"""Bad arguments of ``python -m shardkit.train``, SparseRowSGD and ``python -m shardkit.plan``:
each is refused up front with one line naming the flag (exit status 2) or a ValueError /
TypeError naming the argument, never a hang, a traceback or a silent NaN (cases found by
probing with bad inputs)."""

import re

import pytest
import torch

import shardkit
from shardkit import train
from shardkit.plan import plan_memory
from shardkit.plan.cli import main as plan_main
from shardkit.train import argtypes, checks, cli
from shardkit.train import loop as train_loop

TINY = (
    "--classes 16 --per-class 8 --image-size 16 --batch 32 --val-classes 4 --val-per-class 3 --dim 32 "
    "--no-progress --ema 0.9 --ema-tau 2 --steps 1"
).split()


@pytest.fixture
def no_training(monkeypatch):
    """A bad flag must be refused before training: reaching the run is a failure (and a
    --workers that forks forever, or a held-out set that exhausts RAM, never starts)."""

    def refuse(*a, **k):
        raise AssertionError("the run started: the bad flag was not refused up front")

    monkeypatch.setattr(train_loop, "run", refuse)


def _assert_one_line_error(capsys, flag, prog="python -m shardkit.train"):
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: error: ") and err.count("\n") == 1, err
    assert flag in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--workers", "99999999999999999"], "--workers"),
        (["--lr", "nan"], "--lr"),
        (["--lr", "inf"], "--lr"),
        (["--lr", "1e30"], "--lr"),
        (["--weight-decay", "nan"], "--weight-decay"),
        (["--weight-decay", "inf"], "--weight-decay"),
        (["--weight-decay", "-1"], "--weight-decay"),
        (["--scale", "nan"], "--scale"),
        (["--scale", "inf"], "--scale"),
        (["--scale", "1e39"], "--scale"),  # beyond float32: the margin would raise mid-setup
        (["--scale", "1e35"], "--scale"),  # finite in float32, but s * (1 + m) beyond the margins' 1e30
        (["--margin", "none", "--m", "0.5"], "--m 0.5 has no effect with --margin none"),
        (["--cache-ram", "decoded"], "--cache-ram decoded caches the images of --data"),
        (["--sample-rate", "nan"], "--sample-rate"),
        (["--ema-tau", "0"], "--ema-tau"),
        (["--ema-tau", "-5"], "--ema-tau"),
        (["--ema-tau", "nan"], "--ema-tau"),
        (["--margin", "none", "--m", "nan"], "--m"),
        (["--image-size", "1"], "--image-size"),
        (["--image-size", "3"], "--image-size"),
        (["--seed", "99999999999999999999999"], "--seed"),
        (["--seed", "-1"], "--seed"),
        (["--val-per-class", "99999999999999"], "--val-per-class"),
    ],
)
def test_bad_flag_exits_2_with_one_line(extra, flag, capsys, tmp_path, no_training):
    assert train.main(TINY + ["--out", str(tmp_path / "o")] + extra) == 2
    _assert_one_line_error(capsys, flag)


@pytest.mark.parametrize("below", ["", "sub"])
def test_out_under_or_at_a_file(below, capsys, tmp_path, no_training):
    f = tmp_path / "file"
    f.write_text("not a run directory")
    assert train.main(TINY + ["--out", str(f / below) if below else str(f)]) == 2
    _assert_one_line_error(capsys, "--out")


@pytest.mark.parametrize(
    "flag, good, bad",
    [
        ("--lr", ["10", "1000"], "1000.5"),
        ("--image-size", ["4"], "3"),
        ("--seed", ["0", str(2**63 - 1)], str(2**63)),
        ("--workers", ["0", "64"], str(10**6)),
        ("--weight-decay", ["0"], "-1e-9"),
    ],
)
def test_bounds_keep_legitimate_values(flag, good, bad, tmp_path, capsys, no_training):
    # The checks sit at the edge of what works: values a real run may use still parse.
    out = ["--out", str(tmp_path / "o")]
    for value in good:
        parsed = getattr(cli.parse(TINY + out + [flag, value]), flag[2:].replace("-", "_"))
        assert parsed == type(parsed)(value)
    assert train.main(TINY + out + [f"{flag}={bad}"]) == 2  # "=": argparse takes -1e-9 for an option
    _assert_one_line_error(capsys, flag)


def test_held_out_set_bounded_by_ram(monkeypatch, tmp_path, capsys, no_training):
    monkeypatch.setattr(checks, "_ram_bytes", lambda: 2**30)
    out = ["--out", str(tmp_path / "o")]
    assert cli.parse(TINY + out + ["--val-per-class", "50"]).val_per_class == 50  # ~10 MiB: fine
    # 4 x C(20000, 2) genuine pairs, each scored with two gathered 32-d embeddings: > 1 GiB.
    assert train.main(TINY + out + ["--val-per-class", "20000"]) == 2
    _assert_one_line_error(capsys, "--val-per-class")


# ---- SparseRowSGD -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(lr=float("nan")), ValueError, "argument `lr`"),
        (dict(lr=float("inf")), ValueError, "argument `lr`"),
        (dict(lr=torch.tensor(float("nan"))), ValueError, "argument `lr`"),
        (dict(lr=torch.tensor([0.1, 0.2])), ValueError, "argument `lr`"),
        (dict(lr=0.1, momentum=float("nan")), ValueError, "argument `momentum`"),
        (dict(lr=0.1, momentum=2.0), ValueError, r"argument `momentum` must be in \[0, 1\)"),
        (dict(lr=0.1, momentum=1.0), ValueError, "argument `momentum`"),
        (dict(lr=0.1, weight_decay=float("nan")), ValueError, "argument `weight_decay`"),
        (dict(lr=0.1, weight_decay=float("inf")), ValueError, "argument `weight_decay`"),
        (dict(lr=0.1, momentum=0.9, dampening=float("nan")), ValueError, "argument `dampening`"),
        (dict(lr="0.1"), TypeError, "argument `lr` must be a real number"),
        (dict(lr=None), TypeError, "argument `lr` must be a real number"),
        (dict(lr=0.1, momentum="0.9"), TypeError, "argument `momentum` must be a real number"),
    ],
)
def test_sparse_row_sgd_refuses_bad_hyperparameters(kwargs, exc, match):
    p = torch.nn.Parameter(torch.randn(3, 2))
    with pytest.raises(exc, match=match):
        shardkit.SparseRowSGD([p], **kwargs)


def test_sparse_row_sgd_checks_param_groups_and_keeps_good_values():
    p, q = torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4, 2))
    with pytest.raises(ValueError, match="param group 1: argument `lr`"):
        shardkit.SparseRowSGD([{"params": [p]}, {"params": [q], "lr": float("nan")}], lr=0.1)
    opt = shardkit.SparseRowSGD([p], lr=0.0, momentum=0.0)  # lr 0 is allowed, as in torch.optim.SGD
    with pytest.raises(ValueError, match="param group 1: argument `momentum`"):
        opt.add_param_group({"params": [q], "momentum": 1.5})
    assert len(opt.param_groups) == 1  # the bad group was not added
    opt = shardkit.SparseRowSGD([p], lr=torch.tensor(0.1), momentum=0.9, dampening=0.1, weight_decay=1e-3)
    p.grad = torch.ones_like(p)
    opt.step()
    assert torch.isfinite(p).all()


# ---- python -m shardkit.plan -------------------------------------------------------------

PLAN = ["--classes", "1000", "--dim", "64", "--batch", "8"]


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--gpu-memory", "0"], "--gpu-memory must be > 0"),
        (["--gpu-memory", "80GiB", "--reserve", "90GiB"], "--reserve (90 GiB) must be less than --gpu-memory"),
        (["--gpu-memory", "16GiB", "--reserve", "16GiB"], "--reserve (16 GiB) must be less than --gpu-memory"),
    ],
)
def test_plan_refuses_gpu_memory_and_reserve(extra, flag, capsys):
    with pytest.raises(SystemExit) as e:
        plan_main(PLAN + extra)
    assert e.value.code == 2
    _assert_one_line_error(capsys, flag, prog="python -m shardkit.plan")


def test_plan_memory_api_refuses_the_same():
    with pytest.raises(ValueError, match=r"argument `gpu_memory` must be > 0"):
        plan_memory(1000, 64, 1, 8, gpu_memory=0)
    with pytest.raises(ValueError, match=re.escape("argument `reserve` (2 GiB) must be less than")):
        plan_memory(1000, 64, 1, 8, gpu_memory="1GiB", reserve="2GiB")
    assert plan_memory(1000, 64, 1, 8, gpu_memory="1GiB", reserve="512MiB").devices[0].fits is True


def test_a_diverging_run_exits_2_naming_the_flags(tmp_path, capsys):
    # An absurd (but finite) weight decay blows the backbone up after one step: the head's
    # input check then sees NaN/inf embeddings; the run says it diverged and what to lower
    # instead of ending in a traceback.
    argv = TINY + ["--steps", "4", "--devices", "cpu", "--weight-decay", "1e30", "--out", str(tmp_path / "o")]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m shardkit.train: error: training diverged at step ") and err.count("\n") == 1
    assert "--weight-decay (now 1e+30)" in err and "Traceback" not in err, err


def test_a_head_that_cannot_fit_is_refused_up_front(tmp_path, capsys, no_training):
    # A billion classes x 512 on the CPU: terabytes by the planner's count. Refused before the
    # synthetic data (a per-class loop) or the head are built, naming the planner's figure.
    argv = ["--classes", "1000000000", "--dim", "512", "--devices", "cpu", "--out", str(tmp_path / "o")]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--classes 1000000000 x --dim 512: the head needs about" in err, err
    # the README's million-class CPU recipe (~1.2 GiB of head) is not refused
    args = cli.parse(["--classes", "1000000", "--per-class", "2", "--sample-rate", "0.1", "--devices", "cpu"])
    assert args.classes == 1_000_000


def test_activations_that_cannot_fit_are_refused_up_front(monkeypatch, tmp_path, capsys, no_training):
    # The bound comes from a meta-device forward of the chosen backbone: a size a real run
    # uses parses, one whose activations exceed the device's memory is one line, exit 2.
    monkeypatch.setattr(argtypes, "_ram_bytes", lambda: 2**30)
    args = TINY + ["--out", str(tmp_path / "o"), "--devices", "cpu"]
    assert cli.parse(args + ["--image-size", "64"]).image_size == 64
    assert train.main(args + ["--image-size", "4000"]) == 2
    _assert_one_line_error(capsys, "--image-size")
    # Weights the layers save do not grow with the batch: a CIFAR-sized r18 run of ~5 GiB of
    # activations fits 24 GiB even at --batch 2048.
    monkeypatch.setattr(argtypes, "_ram_bytes", lambda: 24 * 2**30)
    big = cli.parse(args + ["--backbone", "r18", "--image-size", "32", "--batch", "2048"])
    assert big.batch == 2048
    plain = argtypes._saved_bytes_per_image(cli.parse(args + ["--image-size", "64"]))
    assert argtypes._saved_bytes_per_image(cli.parse(args + ["--image-size", "64", "--checkpointing"])) < plain


def test_saved_bytes_grow_with_the_image_area(tmp_path):
    out = ["--out", str(tmp_path / "o")]
    small = argtypes._saved_bytes_per_image(cli.parse(TINY + out + ["--image-size", "256"]))
    big = argtypes._saved_bytes_per_image(cli.parse(TINY + out + ["--image-size", "512"]))
    assert 3.5 * small < big < 4.5 * small  # a conv net's activations scale with the pixels


def test_training_set_order_bounded_by_ram(monkeypatch, tmp_path, capsys, no_training):
    monkeypatch.setattr(checks, "_ram_bytes", lambda: 2**30)
    out = ["--out", str(tmp_path / "o")]
    assert cli.parse(TINY + out + ["--per-class", "1000"]).per_class == 1000
    assert train.main(TINY + out + ["--per-class", "10000000000"]) == 2
    _assert_one_line_error(capsys, "--per-class")


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
        MemoryError(),
    ],
)
def test_running_out_of_memory_mid_run_is_one_line_naming_the_flags(monkeypatch, tmp_path, capsys, error):
    # What the up-front bounds cannot foresee (they are lower bounds) still ends in one line.
    def oom(*a, **k):
        raise error

    monkeypatch.setattr(train_loop, "train_step", oom)
    assert train.main(TINY + ["--devices", "cpu", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m shardkit.train: error: out of memory (") and err.count("\n") == 1, err
    assert "--batch" in err and "--image-size" in err and "Traceback" not in err


def test_other_runtime_errors_keep_their_traceback(monkeypatch, tmp_path):
    def bug(*a, **k):
        raise RuntimeError("an internal error")

    monkeypatch.setattr(train_loop, "train_step", bug)
    with pytest.raises(RuntimeError, match="an internal error"):
        train.main(TINY + ["--devices", "cpu", "--out", str(tmp_path / "o")])
