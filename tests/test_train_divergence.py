"""python -m shardkit.train's guards on a run: a step that leaves NaN weights writes no
checkpoint (the last good one stays the one to resume), a checkpoint of NaN weights is refused
on --resume, BatchNorm forwards of fewer than 8 images are warned about before training, and
--profile is bounded, its trace holding the first steps only."""

import os

import pytest
import torch

from shardkit import train
from shardkit.train import checkpoint, checks, cli
from shardkit.train import loop as train_loop

# 128 training images, --batch 32: 4 steps per epoch, a checkpoint at steps 4, 8, ... and the last
TINY = "--classes 16 --per-class 8 --image-size 16 --batch 32 --val-classes 4 --val-per-class 3 --dim 16".split()
TINY += ["--no-progress", "--devices", "cpu", "--ema", "0.9", "--ema-tau", "2"]
CKPT = os.path.join("checkpoint", checkpoint.CKPT_FILE)


def _one_line(capsys, *needles):
    err = capsys.readouterr().err
    assert err.startswith("python -m shardkit.train: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and all(n in err for n in needles), err
    return err


def _nan_after_step(monkeypatch, at_step, value=float("nan")):
    """The step that ends the run at ``at_step`` leaves NaN weights, as a diverging step does
    (or, with a large finite ``value``, finite weights whose activations overflow)."""
    real = train_loop.train_step

    def step(parts, args, index, *a, **k):
        out = real(parts, args, index, *a, **k)
        if index + 1 == at_step:
            with torch.no_grad():
                for p in list(parts.backbone.parameters())[: 1 if value != value else None]:
                    p.view(-1)[0] = value
        return out

    monkeypatch.setattr(train_loop, "train_step", step)


def test_a_step_that_diverges_writes_no_checkpoint(tmp_path, capsys, monkeypatch):
    _nan_after_step(monkeypatch, 1)
    out = tmp_path / "run"
    assert train.main(TINY + ["--steps", "1", "--out", str(out)]) == 2
    _one_line(capsys, "training diverged by step 1", "NaN or infinite", "backbone ", "no checkpoint of it was written")
    assert not (out / CKPT).exists()


def test_finite_weights_whose_embeddings_overflow_write_no_checkpoint(tmp_path, capsys, monkeypatch):
    # e.g. BatchNorm over 2 images per device: the weights stay finite, evaluation overflows
    _nan_after_step(monkeypatch, 1, value=1e30)
    out = tmp_path / "run"
    assert train.main(TINY + ["--steps", "1", "--out", str(out)]) == 2
    _one_line(capsys, "diverged by step 1", "backbone's embeddings of held-out images are NaN or infinite")
    assert not (out / CKPT).exists()


def test_the_last_good_checkpoint_stays_the_one_to_resume(tmp_path, capsys, monkeypatch):
    _nan_after_step(monkeypatch, 6)
    out = tmp_path / "run"
    assert train.main(TINY + ["--steps", "6", "--out", str(out)]) == 2
    _one_line(capsys, "diverged by step 6", "no checkpoint of step 6 was written", "keeps step 4's")
    state = checkpoint.read(str(out / CKPT))
    assert state["step"] == 4 and all(torch.isfinite(t).all() for t in state["backbone"].values())
    monkeypatch.undo()
    assert train.main(["--resume", str(out), "--steps", "5", "--no-progress"]) == 0  # it resumes
    assert checkpoint.read(str(out / CKPT))["step"] == 5


def test_a_checkpoint_of_nan_weights_is_refused_on_resume(tmp_path, capsys):
    out = tmp_path / "run"
    assert train.main(TINY + ["--steps", "1", "--out", str(out)]) == 0
    state = checkpoint.read(str(out / CKPT))  # as an older version could have left it
    key = next(k for k, v in state["backbone"].items() if v.is_floating_point())
    state["backbone"][key].fill_(float("inf"))
    checkpoint.write_atomic(state, str(out / CKPT))
    capsys.readouterr()
    assert train.main(["--resume", str(out), "--steps", "2"]) == 2
    _one_line(capsys, "is of a diverged run", "NaN or infinite values", key, "nothing to resume")


@pytest.mark.parametrize(
    "flags, images",
    [
        (["--pipeline", "--devices", "cpu,cpu", "--batch", "8"], 2),  # the default --chunks 4
        (["--accumulate", "4", "--batch", "2"], 2),
        (["--dp", "--devices", "cpu,cpu", "--batch", "10"], 5),
        (["--pipeline", "--devices", "cpu,cpu", "--batch", "32", "--chunks", "5"], 6),
    ],
)
def test_batch_norm_forwards_of_few_images_are_warned_about(tmp_path, flags, images):
    args = cli.parse(TINY[: TINY.index("--devices")] + flags + ["--out", str(tmp_path)])
    text = checks.batch_norm_warning(args, 1)
    assert text is not None and f"gives BatchNorm {images} images per forward" in text, text


@pytest.mark.parametrize(
    "flags",
    [["--batch", "8"], ["--pipeline", "--devices", "cpu,cpu", "--batch", "32"], ["--dp", "--devices", "cpu,cpu"]],
)
def test_batch_norm_forwards_of_8_images_or_more_are_not(tmp_path, flags):
    assert checks.batch_norm_warning(cli.parse(flags + ["--out", str(tmp_path)]), 1) is None


def test_the_warning_is_printed_before_training(tmp_path, capsys):
    argv = TINY + ["--pipeline", "--devices", "cpu,cpu", "--batch", "8", "--steps", "1", "--out", str(tmp_path)]
    assert train.main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err.count("warning: --batch 8 in --chunks 4 micro-batches (--pipeline) gives BatchNorm 2") == 1
    assert "gives BatchNorm 2 images" in open(tmp_path / "log.txt").read()


@pytest.mark.parametrize("steps", ["1000000000000", "1001", "-1"])
def test_profile_steps_are_bounded(tmp_path, steps):
    from shardkit.train.errors import UsageError

    with pytest.raises(UsageError, match=r"--profile must be in \[0, 1000\]"):
        cli.parse(TINY + ["--profile", steps, "--out", str(tmp_path)])


def test_the_profiler_keeps_the_events_of_the_first_steps_only(tmp_path, capsys, monkeypatch):
    import json

    from shardkit.train import profile

    monkeypatch.setattr(profile, "TRACE_STEPS", 2)  # the profiler's memory grows with each traced step
    assert train.main(TINY + ["--profile", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "profile: 4 steps" in out and "(steps 1-2;" in out
    events = json.load(open(tmp_path / "profile_trace.json"))["traceEvents"]
    assert sum(e.get("name") == "optimizer" for e in events) == 2  # one range per traced step


def test_the_profile_headline_leaves_out_the_profilers_own_event_processing(tmp_path, capsys, monkeypatch):
    # The last active prof.step() processes every recorded event (1.9 s once in a 20-step
    # profile): it was counted in the headline ms/step and img/s, which then disagreed with the
    # phase table by 10x.
    import re
    import time

    step = torch.profiler.profile.step

    def slow_step(self):
        time.sleep(0.5)
        return step(self)

    monkeypatch.setattr(torch.profiler.profile, "step", slow_step)
    assert train.main(TINY + ["--profile", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    ms = float(re.search(r"profile: 3 steps, ([0-9.]+) ms/step", out).group(1))
    phases = sum(float(m) for m in re.findall(r"^  [a-zA-Z -]+?\s+([0-9.]+)\s+[0-9.]+%$", out, re.M))
    assert ms < 500 and phases <= ms * 1.05, (ms, phases, out)
