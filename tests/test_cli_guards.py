"""python -m shardkit.train: values past what a float32 or an int64 holds are refused while
the flags are read (exit 2, one line naming the flag), never a traceback further on."""

import pytest

from shardkit import train
from shardkit.train import loop as train_loop

TINY = (
    "--classes 16 --per-class 8 --image-size 16 --batch 32 --val-classes 4 --val-per-class 3 --dim 32 "
    "--no-progress --ema 0.9 --ema-tau 2 --steps 1 --devices cpu"
).split()
HUGE = str(10**400)


@pytest.fixture
def no_training(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the run started: the bad flag was not refused up front")

    monkeypatch.setattr(train_loop, "run", refuse)


@pytest.mark.parametrize(
    "extra, flag",
    [
        # SGD's weight decay is a float32: 1e39 passed the flags, then torch raised (exit 1).
        (["--weight-decay", "1e39"], "--weight-decay"),
        (["--weight-decay", "1e300"], "--weight-decay"),
        (["--ema-tau", "1e39"], "--ema-tau"),
        (["--m", "-1e300"], "--m"),
        (["--lr", "1e39"], "--lr"),
        # ints past a float: OverflowError in the flag's own check
        (["--classes", HUGE], "--classes"),
        (["--dim", HUGE], "--dim"),
        (["--per-class", HUGE], "--per-class"),
        (["--val-classes", HUGE], "--val-classes"),
        (["--batch", HUGE], "--batch"),
        (["--steps", HUGE], "--steps"),
        (["--epochs", HUGE], "--epochs"),
        (["--accumulate", HUGE], "--accumulate"),
        (["--dim", "-" + HUGE], "--dim"),
        # image sides whose input batch torch cannot even describe (int64 overflow on the
        # meta device) or that exceed any memory
        (["--image-size", str(10**30)], "--image-size"),
        (["--image-size", str(2**40)], "--image-size"),
        (["--image-size", str(2**62)], "--image-size"),
        (["--image-size", "100000000"], "--image-size"),
    ],
)
def test_huge_values_exit_2_with_one_line(extra, flag, tmp_path, capsys, no_training):
    assert train.main(TINY + ["--out", str(tmp_path / "o")] + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m shardkit.train: error: ") and err.count("\n") == 1, err
    assert flag in err and "Traceback" not in err and len(err) < 400, err


def test_float32_bound_keeps_large_finite_values(tmp_path):
    from shardkit.train import cli

    args = cli.parse(TINY + ["--out", str(tmp_path / "o"), "--weight-decay", "1e38", "--ema-tau", "3e38"])
    assert args.weight_decay == 1e38 and args.ema_tau == 3e38  # refused later, as a diverged run
    big = cli.parse(TINY + ["--out", str(tmp_path / "o"), "--seed", str(2**63 - 1)])
    assert big.seed == 2**63 - 1
