"""python -m shardkit.train under faults: optimizer and EMA settings
edited into a checkpoint, a history edited by hand, outputs it cannot write (a full disk, a
read-only place), a class folder that is a looping link, a Ctrl-C during the final
evaluation, and the genuine pairs of large held-out classes of --data. Each user error is one
line on stderr and exit status 2."""

import errno
import os

import pytest
import torch
from PIL import Image
from test_train_faults import _ckpt, _copy, _one_line

from shardkit import train
from shardkit.train import checkpoint, plots, report, setup

# 8 x 8 images, --batch 32: 2 steps an epoch (a checkpoint every 2 steps)
TINY = "--classes 8 --per-class 8 --image-size 16 --batch 32 --val-classes 4 --val-per-class 2 --dim 16".split()
TINY += ["--no-progress", "--devices", "cpu", "--ema", "0.9", "--ema-tau", "2", "--eval-every", "0"]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("runs") / "r")
    assert train.main(TINY + ["--steps", "2", "--out", out]) == 0
    return out


def _edit(run, edit):
    state = checkpoint.read(_ckpt(run))
    edit(state)
    torch.save(state, _ckpt(run))


def _groups(key, value):
    return lambda s: [g.__setitem__(key, value) for g in s["optimizers"][0]["param_groups"]]


@pytest.mark.parametrize(
    "edit, needle",
    [
        (_groups("weight_decay", -1.0), "backbone optimizer's param group 0: argument `weight_decay` must be >= 0"),
        (_groups("momentum", 1.5), "backbone optimizer's param group 0: argument `momentum` must be in [0, 1)"),
        (_groups("nesterov", "yes"), "argument `nesterov` must be True or False"),
        # valid, but not what the run's settings build: trained silently with it before
        (_groups("momentum", 0.5), "its backbone optimizer's param group 0 has momentum 0.5, not the 0.9"),
        (_groups("maximize", True), "has maximize True, not the False"),
        (lambda s: s["optimizers"][0]["param_groups"][0].__setitem__("weight_decay", 0.3), "(from --weight-decay)"),
        (lambda s: s["optimizers"][1]["group"].__setitem__("momentum", 0.2), "head optimizer's param group 0 has"),
        (lambda s: s["ema"].__setitem__("decay", 0.5), "its EMA has decay 0.5, not the 0.9 this run's settings give"),
        (lambda s: s["ema"].__setitem__("tau", 7.0), "its EMA has tau 7.0, not the 2.0"),
    ],
)
def test_resume_refuses_optimizer_and_ema_settings_edited_in(two_steps, tmp_path, capsys, edit, needle):
    run = _copy(two_steps, tmp_path / "run")
    _edit(run, edit)
    capsys.readouterr()
    assert train.main(["--resume", run, "--steps", "3"]) == 2
    _one_line(capsys, needle, _ckpt(run))


def test_ema_flag_given_again_on_resume_still_resumes(two_steps, tmp_path, capsys):
    run = _copy(two_steps, tmp_path / "run")
    assert train.main(["--resume", run, "--steps", "3", "--ema", "0.9"]) == 0


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda h: h.__setitem__("loss", h["loss"][:1]), "history lists have unequal lengths (one entry per step)"),
        (lambda h: h["eval"]["raw_acc"].append(0.5), "history lists have unequal lengths (one entry per evaluation)"),
        (lambda h: h["loss"].__setitem__(0, "x"), "history loss holds 'x', not a number"),
        (lambda h: h["step"].__setitem__(0, 1.5), "history step holds 1.5, not a step number"),
        (lambda h: h["mem_gib"].__setitem__(0, 3.0), "history mem_gib holds 3.0, not a list of numbers"),
        (lambda h: h["top1"].__setitem__(0, True), "history top1 holds True"),
    ],
)
def test_history_edited_by_hand_is_refused_at_resume(two_steps, tmp_path, capsys, edit, needle):
    run = _copy(two_steps, tmp_path / "run")
    _edit(run, lambda s: edit(s["history"]))
    capsys.readouterr()
    assert train.main(["--resume", run, "--steps", "3"]) == 2
    _one_line(capsys, needle)
    with open(os.path.join(run, "log.txt")) as f:
        assert "resumed from" not in f.read()  # refused before training, not by the plot at the end


def _failing_save(monkeypatch, exc, after=1):
    """torch.save in the checkpoint writer: the first ``after`` calls write, the next raise ``exc``."""
    calls = {"n": 0}
    real = torch.save

    def save(obj, f, *a, **kw):
        calls["n"] += 1
        if calls["n"] > after:
            f.write(b"partial")
            raise exc()
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(checkpoint.torch, "save", save)


def _enospc_as_torch_reports_it():
    """torch.save's error on a full disk: a RuntimeError whose context is the writer's OSError."""
    err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    err.__context__ = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return err


@pytest.mark.parametrize(
    "exc, reason",
    [
        (_enospc_as_torch_reports_it, "No space left on device"),
        (lambda: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "No space left on device"),
        (lambda: OSError(errno.EROFS, os.strerror(errno.EROFS)), "Read-only file system"),
    ],
)
def test_checkpoint_that_cannot_be_written_keeps_the_previous(tmp_path, capsys, monkeypatch, exc, reason):
    out = str(tmp_path / "r")
    _failing_save(monkeypatch, exc)
    assert train.main(TINY + ["--steps", "4", "--out", out]) == 2
    _one_line(capsys, f"cannot write {_ckpt(out)}: {reason}")
    assert os.listdir(os.path.join(out, "checkpoint")) == [checkpoint.CKPT_FILE]  # the temporary file removed
    assert checkpoint.read(_ckpt(out))["step"] == 2


def test_checkpoint_folder_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "r"
    real_open = open

    def read_only_open(path, mode="r", *a, **kw):  # a checkpoint/ linked into a read-only place
        if "w" in mode and os.path.basename(str(path)).startswith(f".{checkpoint.CKPT_FILE}.tmp"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr("builtins.open", read_only_open)
    assert train.main(TINY + ["--steps", "2", "--out", str(out)]) == 2
    _one_line(capsys, f"cannot write {_ckpt(str(out))}: Read-only file system")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("name", ["log.txt", "curves.png"])
def test_log_or_plot_on_a_full_disk_is_one_line(tmp_path, capsys, name):
    out = tmp_path / "r"
    out.mkdir()
    os.symlink("/dev/full", out / name)
    assert train.main(TINY + ["--steps", "2", "--out", str(out)]) == 2
    _one_line(capsys, f"cannot write {out / name}: No space left on device")


def test_class_folder_that_is_a_looping_link_is_one_line(tmp_path, capsys):
    root = tmp_path / "faces"
    for k in range(4):
        (root / f"id{k}").mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (8, 8), (k * 40, i * 60, 7)).save(root / f"id{k}" / f"{i}.png")
    os.symlink(root / "id9", root / "id9")
    flags = ["--data", str(root), "--val-classes", "2", "--image-size", "8", "--batch", "8"]
    assert train.main(flags + ["--steps", "1", "--dim", "8", "--devices", "cpu", "--out", str(tmp_path / "r")]) == 2
    _one_line(capsys, f"cannot read the entry {str(root / 'id9')!r}", "Too many levels of symbolic links")


@pytest.mark.parametrize("where", ["evaluation", "plot"])
def test_one_ctrl_c_during_the_final_evaluation_says_so(tmp_path, capsys, monkeypatch, where):
    out = str(tmp_path / "r")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    if where == "evaluation":
        monkeypatch.setattr(report, "evaluate", interrupted)
    else:
        monkeypatch.setattr(plots, "plot", interrupted)
    assert train.main(TINY + ["--steps", "2", "--out", out]) == 130
    said = capsys.readouterr()
    assert "second Ctrl-C" not in said.err and "Traceback" not in said.err, said.err
    assert f"interrupted during the final evaluation: the checkpoint of step 2 is in {out}" in said.out
    assert f"--resume {out} evaluates it" in said.out
    monkeypatch.undo()
    assert train.main(["--resume", out]) == 0
    assert "stopped before its final evaluation: evaluating it" in capsys.readouterr().out
    assert os.path.exists(os.path.join(out, "curves.png"))


def test_genuine_pairs_of_large_classes_are_bounded_and_deterministic(monkeypatch):
    monkeypatch.setattr(setup, "MAX_GENUINE_PER_CLASS", 50)
    ids = torch.tensor([0] * 3 + [1] * 12 + [2] * 40 + [3])  # 3, 66 (> 50, listed), 780 (drawn), 0 pairs
    pairs = setup._genuine_pairs(ids, seed=7)
    assert torch.equal(pairs, setup._genuine_pairs(ids, seed=7))
    assert not torch.equal(pairs, setup._genuine_pairs(ids, seed=8))
    assert [int((ids[pairs[:, 0]] == c).sum()) for c in range(4)] == [3, 50, 50, 0]
    assert bool((ids[pairs[:, 0]] == ids[pairs[:, 1]]).all()) and bool((pairs[:, 0] < pairs[:, 1]).all())
    assert len({tuple(p) for p in pairs.tolist()}) == len(pairs)  # distinct
    # small classes: every pair, in the order the whole-set triu_indices gave
    ids = torch.tensor([0] * 5 + [1] * 7 + [2] * 3)
    a, b = torch.triu_indices(len(ids), len(ids), offset=1)
    keep = ids[a] == ids[b]
    assert torch.equal(setup._genuine_pairs(ids, seed=0), torch.stack([a[keep], b[keep]], 1))
