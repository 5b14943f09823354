"""python -m shardkit.train: tiny runs (seconds), exact resume, Ctrl-C, CLI errors."""

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from shardkit import train
from shardkit.train import layout
from shardkit.train import loop as train_loop
from shardkit.train.models import build_backbone
from shardkit.train.world import init_distributed

TINY = [
    "--classes",
    "16",
    "--per-class",
    "8",
    "--image-size",
    "16",
    "--batch",
    "32",
    "--val-classes",
    "4",
    "--val-per-class",
    "3",
    "--dim",
    "32",
    "--no-progress",
    "--ema",
    "0.9",
    "--ema-tau",
    "2",
]


def _history(out):
    state = torch.load(os.path.join(out, "checkpoint", train_loop.CKPT_FILE), weights_only=True)
    return state


def test_tiny_run_learns_and_writes_outputs(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert train.main(TINY + ["--steps", "24", "--lr", "0.1", "--out", out, "--seed", "3"]) == 0
    state = _history(out)
    losses = state["history"]["loss"]
    assert len(losses) == 24 and state["step"] == 24
    assert all(torch.isfinite(torch.tensor(losses)))
    # Loss goes down: the mean of the last 4 steps is well below the first 4.
    assert sum(losses[-4:]) / 4 < 0.85 * sum(losses[:4]) / 4, losses
    text = capsys.readouterr().out
    assert "train top-1" in text and "TAR@FAR=1e-3" in text and "ema" in text
    assert os.path.getsize(os.path.join(out, "curves.png")) > 1000


def _interrupt_after(monkeypatch, n_steps):
    """Make the run receive SIGINT (as from Ctrl-C) right after its n-th step."""
    real = train_loop.train_step
    count = {"n": 0}

    def step_then_interrupt(*a, **k):
        result = real(*a, **k)
        count["n"] += 1
        if count["n"] == n_steps:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(train_loop, "train_step", step_then_interrupt)


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--accumulate", "2", "--margin", "cosface"],
        # PartialFC samples its negatives from the global generator, which a loader made for the
        # resume (mid-epoch) must not draw from: resumed runs once sampled other negatives.
        ["--sample-rate", "0.5", "--classes", "64", "--batch", "8"],
        ["--sample-rate", "0.5", "--classes", "64", "--batch", "8", "--devices", "cpu,cpu", "--workers", "1"],
    ],
)
def test_ctrl_c_saves_and_resume_is_exact(tmp_path, monkeypatch, capsys, extra):
    args = TINY + ["--steps", "5", "--seed", "1"] + ([] if "--devices" in extra else ["--devices", "cpu"]) + extra
    _ctrl_c_then_resume(tmp_path, monkeypatch, capsys, args)


@pytest.mark.gpu
def test_ctrl_c_saves_and_resume_is_exact_on_a_gpu(tmp_path, monkeypatch, capsys):
    # cuDNN's default convolution backward is not deterministic: two identical GPU runs differ
    # in the last bits from the first step on (seen on an H200), so bit-exact needs --deterministic.
    args = TINY + ["--steps", "5", "--seed", "1", "--devices", "cuda:0", "--deterministic", "--margin", "cosface"]
    _ctrl_c_then_resume(tmp_path, monkeypatch, capsys, args)


def _ctrl_c_then_resume(tmp_path, monkeypatch, capsys, args):
    full = str(tmp_path / "full")
    assert train.main(args + ["--out", full]) == 0
    ref = _history(full)["history"]["loss"]

    part = str(tmp_path / "part")
    _interrupt_after(monkeypatch, 3)
    assert train.main(args + ["--out", part]) == 130
    assert "interrupted: checkpoint of step 3" in capsys.readouterr().out
    assert _history(part)["step"] == 3
    monkeypatch.undo()

    assert train.main(args + ["--out", part, "--resume", os.path.join(part, "checkpoint")]) == 0
    resumed = _history(part)["history"]["loss"]
    assert len(resumed) == 5
    # The steps after the resume reproduce the uninterrupted run bit for bit.
    assert resumed[3:] == ref[3:], (resumed, ref)


def test_data_parallel_and_sampling_modes_run(tmp_path):
    for extra in (
        ["--dp", "--devices", "cpu,cpu"],
        ["--sample-rate", "0.5"],
        ["--devices", "cpu,cpu,cpu"],
        ["--sample-rate", "0.5", "--devices", "cpu,cpu"],
    ):
        out = str(tmp_path / "_".join(e.strip("-") for e in extra))
        assert train.main(TINY + ["--steps", "3", "--out", out] + extra) == 0
        assert all(torch.isfinite(torch.tensor(_history(out)["history"]["loss"])))
    assert not torch.distributed.is_initialized()  # no process group is left behind


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--devices", "cuda:7"], "--devices: cuda:7 is not available"),
        (["--devices", "tpu"], "not a device"),
        (["--data", "/nonexistent/dir"], "is not a directory"),
        (["--resume", "/nonexistent/dir"], "no checkpoint found"),
        (["--sample-rate", "1.5"], "must be in (0, 1]"),
        (["--classes", "0"], "must be > 0"),
        (["--classes", "1"], "--classes must be >= 2, got 1"),
        (["--margin", "sphere"], "invalid choice"),
        (["--ema", "1.0"], "--ema must be in [0, 1)"),
        (["--val-per-class", "1"], "must be >= 2"),
        (["--amp", "fp16", "--devices", "cpu"], "--amp fp16 needs a CUDA device"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (TINY + ["--batch", "4096"], "smaller than one step's batch"),
    ],
)
def test_cli_errors_exit_2(argv, message, capsys, tmp_path):
    # One line on stderr saying what is wrong, no traceback, exit status 2.
    assert train.main(argv + ["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.startswith("python -m shardkit.train: error: ") and err.count("\n") == 1, err


def test_module_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "shardkit.train", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--sample-rate" in r.stdout and "--resume" in r.stdout
    assert "cosine" in r.stdout and "may change on resume" in r.stdout


def _image_folder(root, classes=8, per_class=4, size=20):
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for k in range(classes):
        os.makedirs(root / f"id{k:02d}")
        base = torch.randint(0, 256, (3,), generator=g)
        for i in range(per_class):
            img = (base + torch.randint(-30, 30, (size, size, 3), generator=g)).clamp(0, 255).to(torch.uint8)
            Image.fromarray(img.numpy()).save(root / f"id{k:02d}" / f"{i}.png")


@pytest.mark.parametrize("cache", ["encoded", "decoded"])
def test_image_folder_data(tmp_path, cache, capsys):
    _image_folder(tmp_path / "faces")
    out = str(tmp_path / "run")
    argv = [
        "--data",
        str(tmp_path / "faces"),
        "--cache-ram",
        cache,
        "--image-size",
        "16",
        "--batch",
        "8",
        "--val-classes",
        "3",
        "--dim",
        "16",
        "--steps",
        "3",
        "--no-progress",
        "--out",
        out,
    ]
    assert train.main(argv) == 0
    assert _history(out)["step"] == 3
    assert "verification on 3 held-out identities" in capsys.readouterr().out
    # Too few classes for the held-out split: a clear error, not a crash.
    assert train.main(argv[:-2] + ["--val-classes", "8", "--out", out + "2"]) == 2
    assert "need more than --val-classes=8, by 2 or more" in capsys.readouterr().err
    # one training class left (it used to train at loss 0, "100% top-1"): refused too
    assert train.main(argv[:-2] + ["--val-classes", "7", "--out", out + "3"]) == 2
    assert "--data has 8 classes; need more than --val-classes=7, by 2 or more" in capsys.readouterr().err


def test_torchrun_two_ranks_and_resume(tmp_path):
    import shardkit

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(shardkit.__file__))))
    out = str(tmp_path / "ddp")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd = (
        torchrun
        + [f"--log-dir={tmp_path / 'torchrun-logs'}", "-m", "shardkit.train"]
        + TINY
        + ["--batch", "16", "--sample-rate", "0.5", "--devices", "cpu", "--out", out]
    )
    r = subprocess.run(cmd + ["--steps", "3"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = os.path.join(out, "checkpoint")
    first = layout.generation(ckpt)  # the save's generation folder, named in LATEST
    assert first is not None and sorted(os.listdir(ckpt)) == ["LATEST", os.path.basename(first)]
    assert sorted(os.listdir(os.path.join(first, "head")))  # one file per rank's class range
    r = subprocess.run(cmd + ["--steps", "4", "--resume", out], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout
    second = layout.generation(ckpt)
    state = torch.load(os.path.join(second, train_loop.CKPT_FILE + ".rank1"), weights_only=True)
    assert state["step"] == 4 and not os.path.exists(first)  # the older generation is removed


def test_pipeline_over_two_cpu_devices(tmp_path, capsys):
    out = str(tmp_path / "pipe")
    argv = TINY + ["--steps", "4", "--out", out, "--pipeline", "--devices", "cpu,cpu", "--chunks", "3"]
    assert train.main(argv) == 0
    text = capsys.readouterr().out
    assert "backbone pipelined (--pipeline): layers per stage" in text and "3 micro-batches" in text
    state = torch.load(os.path.join(out, "checkpoint", train_loop.CKPT_FILE), weights_only=True)
    assert state["step"] == 4
    # the checkpoint holds the backbone under its usual keys (the stages share its modules)
    plain = build_backbone("tiny", 32)
    plain.load_state_dict(state["backbone"])


@pytest.mark.parametrize(
    "extra, match",
    [(["--pipeline", "--dp"], "--pipeline and --dp"), (["--pipeline", "--chunks", "0"], "--chunks must be >= 1")],
)
def test_pipeline_flag_errors(tmp_path, capsys, extra, match):
    assert train.main(TINY + ["--steps", "1", "--out", str(tmp_path / "x"), "--devices", "cpu,cpu"] + extra) == 2
    assert match in capsys.readouterr().err


def test_torchrun_with_more_ranks_than_gpus_is_a_usage_error(monkeypatch):
    # A second rank on a node with one GPU: a clear error naming the fix, not CUDA's
    # "invalid device ordinal" from inside the process-group start (seen on a one-GPU machine).
    from shardkit.train.errors import UsageError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = SimpleNamespace(devices=[torch.device("cuda", 0)])
    with pytest.raises(UsageError, match=r"local rank 1 has no GPU of its own \(1 visible.*--devices cpu"):
        init_distributed(args)


def test_ctrl_c_in_the_last_step_then_resume_evaluates(tmp_path, monkeypatch, capsys):
    # The last step's checkpoint is saved, the run stops before its final evaluation (exit 130);
    # its resume has no step left and runs that evaluation (it once said the run had finished,
    # with results in a log that had none, and never wrote them).
    args = TINY + ["--steps", "3", "--seed", "2", "--devices", "cpu"]
    full = str(tmp_path / "full")
    assert train.main(args + ["--out", full]) == 0
    part = str(tmp_path / "part")
    _interrupt_after(monkeypatch, 3)
    assert train.main(args + ["--out", part]) == 130
    monkeypatch.undo()
    assert not os.path.exists(os.path.join(part, "curves.png"))
    capsys.readouterr()
    assert train.main(args + ["--out", part, "--resume", os.path.join(part, "checkpoint")]) == 0
    out = capsys.readouterr().out
    assert "stopped before its final evaluation: evaluating it" in out
    assert os.path.exists(os.path.join(part, "curves.png"))
    results = [open(os.path.join(d, "log.txt")).read().split("results", 1)[-1] for d in (full, part)]
    assert "verification" in results[1] and results[0].splitlines()[:6] == results[1].splitlines()[:6]


def test_epochs_given_on_resume_sets_the_length_of_a_run_saved_with_steps(tmp_path, capsys):
    # The saved --steps used to win over an --epochs given on resume, though the trainer's own
    # hint for a finished run suggests "more --epochs".
    out = str(tmp_path / "run")
    assert train.main(TINY + ["--steps", "2", "--devices", "cpu", "--out", out]) == 0
    assert train.main(["--resume", out, "--epochs", "2"]) == 0
    assert "at step 2 of 8" in capsys.readouterr().out  # 4 steps per epoch: 128 images, batch 32
    assert _history(out)["step"] == 8
    assert train.main(["--resume", out, "--steps", "9"]) == 0  # and --steps still sets it
    assert _history(out)["step"] == 9
