"""Where the trainer's checkpoints live (shardkit.train.layout): a torchrun save is a generation
folder named in LATEST only once complete, so a save killed halfway leaves the previous one the
one resumed; after a save one layout remains; where two are left, the newer is resumed."""

import os
import time

import pytest
import torch

from shardkit.train import checkpoint, layout
from shardkit.train.errors import UsageError

RANK_FILE = checkpoint.CKPT_FILE + ".rank{}"


def _torchrun_save(ckpt, step, ranks=2, commit=True, files=None):
    name = layout.generation_name(step, int.from_bytes(os.urandom(4), "little"))
    gen = os.path.join(ckpt, name)
    os.makedirs(os.path.join(gen, "head"))
    for r in range(ranks if files is None else files):
        torch.save({"step": step, "rank": r}, os.path.join(gen, RANK_FILE.format(r)))
    if commit:
        layout.commit(ckpt, name)
    return gen


def _one_process_save(ckpt, step):
    checkpoint.write_atomic({"step": step}, os.path.join(ckpt, checkpoint.CKPT_FILE))
    layout.remove_others(ckpt, keep=None)


def test_a_torchrun_save_killed_halfway_leaves_the_previous_one_resumed(tmp_path):
    ckpt = str(tmp_path / "checkpoint")
    os.makedirs(ckpt)
    first = _torchrun_save(ckpt, 10)
    _torchrun_save(ckpt, 20, commit=False, files=1)  # rank 1 killed before its file
    assert checkpoint.find(str(tmp_path)) == first
    assert checkpoint.file_for(first, 2, 1) == os.path.join(first, RANK_FILE.format(1))
    assert checkpoint.run_dir(first) == str(tmp_path)
    second = _torchrun_save(ckpt, 20)  # a complete save: named, and the others removed
    assert checkpoint.find(str(tmp_path)) == second
    assert sorted(os.listdir(ckpt)) == ["LATEST", os.path.basename(second)]


def test_one_layout_remains_after_a_save_and_the_newer_is_resumed(tmp_path):
    ckpt = str(tmp_path)
    _one_process_save(ckpt, 4)
    gen = _torchrun_save(ckpt, 7)  # a torchrun run in the same --out replaces it
    assert sorted(os.listdir(ckpt)) == ["LATEST", os.path.basename(gen)]
    _one_process_save(ckpt, 9)  # and the reverse
    assert os.listdir(ckpt) == [checkpoint.CKPT_FILE]
    # an earlier layout's files left beside a newer save (a clean-up cut short): the newer wins
    torch.save({"step": 1}, os.path.join(ckpt, RANK_FILE.format(0)))
    torch.save({"step": 1}, os.path.join(ckpt, RANK_FILE.format(1)))
    time.sleep(0.01)
    checkpoint.write_atomic({"step": 12}, os.path.join(ckpt, checkpoint.CKPT_FILE))
    assert layout.newest_file(ckpt) == os.path.join(ckpt, checkpoint.CKPT_FILE)
    assert checkpoint.file_for(ckpt, 1, 0) == os.path.join(ckpt, checkpoint.CKPT_FILE)
    with pytest.raises(UsageError, match="holds a checkpoint of a one-process run"):
        checkpoint.file_for(ckpt, 2, 0)  # (used to read the older torchrun run's files)
    time.sleep(0.01)
    os.utime(os.path.join(ckpt, RANK_FILE.format(0)))  # now the torchrun files are the newer
    with pytest.raises(UsageError, match="torchrun run with 2 processes"):
        checkpoint.file_for(ckpt, 1, 0)


def test_a_bad_latest_is_no_checkpoint(tmp_path):
    gen = _torchrun_save(str(tmp_path), 3)
    for text in ("../elsewhere", "step-1", "", "\xff"):
        with open(tmp_path / "LATEST", "w", encoding="utf-8") as f:
            f.write(text)
        assert layout.generation(str(tmp_path)) is None and checkpoint.find(str(tmp_path)) is None
    assert checkpoint.find(gen) == gen  # --resume given the generation folder itself


def test_what_killed_saves_leave_is_removed_by_the_next_save_or_a_resume(tmp_path):
    # A save killed before its rename left .checkpoint.pt.tmp<pid> / .LATEST.tmp<pid>, and a
    # clean-up cut short left a whole older generation, for good when the resume saved nothing.
    ckpt = str(tmp_path)
    _one_process_save(ckpt, 3)
    open(os.path.join(ckpt, ".checkpoint.pt.tmp4242"), "wb").close()
    _one_process_save(ckpt, 4)  # the next save removes it
    assert os.listdir(ckpt) == [checkpoint.CKPT_FILE]
    older = _torchrun_save(ckpt, 10)
    newer = _torchrun_save(ckpt, 20, commit=False)
    with open(os.path.join(ckpt, layout.LATEST), "w") as f:
        f.write(os.path.basename(newer))  # committed, then killed before removing the older
    open(os.path.join(ckpt, ".LATEST.tmp77"), "w").close()
    open(os.path.join(ckpt, "notes.txt"), "w").close()  # not the trainer's: left alone
    layout.tidy(ckpt, older)  # an older generation given to --resume is kept
    assert os.path.isdir(older)
    layout.tidy(ckpt)
    assert sorted(os.listdir(ckpt)) == sorted([layout.LATEST, os.path.basename(newer), "notes.txt"])
    assert not os.path.exists(older) and checkpoint.find(ckpt) == newer


def test_one_run_per_out_folder(tmp_path):
    # Two runs writing to one --out replaced each other's log and removed each other's
    # checkpoints (both exited 0, no checkpoint left).
    if os.name != "posix":
        pytest.skip("file locks (fcntl) are POSIX only; elsewhere the lock is not taken")
    held = layout.lock_out(str(tmp_path))
    with pytest.raises(UsageError, match="another run is writing there"):
        layout.lock_out(str(tmp_path))
    held.close()
    layout.lock_out(str(tmp_path)).close()  # free again once the first run ends


TINY = "--classes 16 --per-class 8 --image-size 16 --batch 32 --val-classes 4 --val-per-class 3 --dim 32".split()


def _parts(tmp_path):
    from shardkit.train import cli, setup
    from shardkit.train.world import World

    args = cli.parse(TINY + ["--steps", "1", "--no-progress", "--out", str(tmp_path / "run")])
    return setup.build(args, World())


def test_a_torchrun_save_that_cannot_write_is_one_line(tmp_path, monkeypatch):
    # A read-only or full checkpoint folder gave a traceback and exit 1 under torchrun (one
    # process said "cannot write <path>: <reason>" and exited 2, as documented).
    import errno

    import shardkit
    from shardkit.train import resume
    from shardkit.train.world import World

    parts, ckpt = _parts(tmp_path), str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    world = World(2, 0, torch.device("cpu"))  # (no process group: the agreements are local)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(shardkit, "save_sharded", full)
        with pytest.raises(UsageError, match=r"cannot write .*step-000000000003-.*: No space left on device"):
            resume.save_checkpoint(ckpt, parts, 3, {}, world)
    with monkeypatch.context() as m:
        m.setattr(layout, "commit", full)
        with pytest.raises(UsageError, match=r"cannot write .*LATEST: No space left on device"):
            resume.save_checkpoint(ckpt, parts, 4, {}, world)
    assert layout.generation(ckpt) is None  # nothing was committed


def test_a_checkpoint_of_more_ranks_is_refused_naming_their_number(tmp_path):
    # 3 ranks' checkpoint resumed by 2 (their files exist) failed deep in the optimizer state
    # ("momentum_buffer must have the parameter's shape"), pointing at another shardkit version.
    from shardkit.train import resume
    from shardkit.train.world import World

    parts, ckpt = _parts(tmp_path), str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    history = {k: [] for k in checkpoint.HISTORY_KEYS}
    history["eval"] = {k: [] for k in checkpoint.EVAL_KEYS}
    resume.save_checkpoint(ckpt, parts, 5, history, World(3, 0, torch.device("cpu")))
    gen = layout.generation(ckpt)
    with pytest.raises(UsageError, match=r"written by 3 process\(es\), this run has 2; .*--nproc_per_node=3"):
        resume.load_checkpoint(gen, parts, World(2, 0, torch.device("cpu")))
