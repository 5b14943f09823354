"""python -m shardkit.train under torchrun (2 gloo processes on the CPU) when one rank meets a
user error: that rank prints its line, whichever rank it is, the other one stops promptly
naming it (not gloo's "Connection closed by peer" traceback), and torchrun exits non-zero."""

import os
import socket
import subprocess
import sys

import pytest
from PIL import Image

import shardkit
from shardkit.train.imagefolder import ImageFolderDataset
from shardkit.train.setup import _RankBatches
from shardkit.train.world import World

BATCH, VAL_CLASSES = 4, 2
FLAGS = ["--val-classes", str(VAL_CLASSES), "--image-size", "8", "--batch", str(BATCH)]
FLAGS += ["--steps", "6", "--dim", "8", "--devices", "cpu", "--no-progress", "--ema", "0"]


def _faces(root, classes=8, per=8):
    for k in range(classes):
        (root / f"id{k}").mkdir(parents=True)
        for i in range(per):
            Image.new("RGB", (8, 8), (k * 30, i * 30, 7)).save(root / f"id{k}" / f"{i}.png")
    return root


def _first_image_of(rank, root):
    """A training image that ``rank`` reads in its first step (and the other rank does not)."""
    samples = ImageFolderDataset(str(root), 8).samples
    train = [path for path, label in samples if label < 8 - VAL_CLASSES]
    first = next(iter(_RankBatches(train, BATCH, World(2, rank), 0, 0, 0)))
    return train[first[0]]


def _torchrun(args, cwd):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = os.path.dirname(os.path.dirname(os.path.abspath(shardkit.__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    env["PYTHONPATH"] = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=0", "--local-addr=127.0.0.1",
           f"--log-dir={os.path.join(cwd, 'torchrun-logs')}", "-m", "shardkit.train", *args]  # fmt: skip
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("failing", [1, 0])
def test_a_data_error_on_one_rank_reaches_the_user(tmp_path, failing):
    root = _faces(tmp_path / "faces")
    bad = _first_image_of(failing, root)
    assert bad != _first_image_of(1 - failing, root)
    with open(bad, "wb") as f:
        f.write(b"not an image")
    r = _torchrun(["--data", str(root), "--out", str(tmp_path / "out"), *FLAGS], tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    own = f"python -m shardkit.train: error: [rank {failing} of 2] cannot decode image '{bad}'"
    assert out.count(own) == 1, out[-3000:]
    other = f"python -m shardkit.train: error: [rank {1 - failing} of 2] stopped ("
    assert other in out and f"because rank {failing} failed: cannot decode image '{bad}'" in out, out[-3000:]
    assert "Connection closed by peer" not in out and f"[rank{1 - failing}]: Traceback" not in out, out[-3000:]


def test_an_error_before_the_group_exists_is_printed_by_every_rank(tmp_path):
    r = _torchrun(["--data", str(tmp_path / "missing"), *FLAGS], tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    for rank in (0, 1):
        assert f"python -m shardkit.train: error: [rank {rank} of 2] --data " in out, out[-3000:]


@pytest.mark.parametrize("flag", ["--dp", "--pipeline"])
def test_one_process_flags_are_refused_under_torchrun(tmp_path, monkeypatch, flag):
    # --dp under torchrun left the backbone without DDP: every rank trained a backbone of its own.
    from shardkit.train import cli
    from shardkit.train.errors import UsageError

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match=f"{flag} runs in one process"):
        cli.parse([flag, "--devices", "cpu,cpu", "--out", str(tmp_path)])


@pytest.mark.parametrize(
    "error, lost",
    [
        (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:5"), True),
        (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:590] Connection reset by peer"), True),
        (RuntimeError("Timed out waiting 1800000ms for recv operation to complete"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),  # a bug: traceback, as before
    ],
)
def test_a_rank_killed_outright_leaves_the_others_one_line(error, lost, capsys):
    # A peer killed by SIGKILL (the out-of-memory killer) records no failure: the survivors'
    # collective raised gloo's transport error, printed as an internal error with its traceback.
    from types import SimpleNamespace

    from shardkit.train import cli

    got = cli._failed(error, SimpleNamespace(out="o"), World(2, 1))
    err = capsys.readouterr().err
    if lost:
        assert got == 1 and err.count("\n") == 1, err
        assert "[rank 1 of 2] stopped because a collective failed" in err and "another rank stopped" in err
    else:
        assert got is None  # re-raised by main(): an internal error keeps its traceback
