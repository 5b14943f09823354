"""python -m shardkit.train: safe and atomic checkpoints, resume into the run's directory with its
saved settings, the log, --help, and warnings."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from shardkit import train
from shardkit.train import checkpoint
from shardkit.train.cli import build_parser

TINY = "--classes 16 --per-class 8 --image-size 16 --batch 32 --val-classes 4 --val-per-class 3 --dim 32".split()
TINY += ["--no-progress", "--ema", "0.9", "--ema-tau", "2"]


def _state(run):
    return checkpoint.read(os.path.join(run, "checkpoint", checkpoint.CKPT_FILE))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 3-step CosFace run (not the default margin), finished."""
    out = str(tmp_path_factory.mktemp("runs") / "cos")
    assert train.main(TINY + ["--steps", "3", "--margin", "cosface", "--seed", "5", "--out", out]) == 0
    return out


def _copy(run, dst):
    import shutil

    shutil.copytree(run, dst)
    return str(dst)


def test_resume_continues_in_its_dir_with_its_settings(finished_run, tmp_path, capsys, monkeypatch):
    run = _copy(finished_run, tmp_path / "run")
    monkeypatch.chdir(tmp_path)  # where the default --out, runs/train, would land
    capsys.readouterr()
    # No --out, no --margin, no --seed: the run continues in its own directory as a CosFace run.
    assert train.main(["--resume", run, "--steps", "5", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"writing to {run}" in out and "CosFace s=32 m=0.25" in out and "seed 5" in out
    state = _state(run)
    assert state["step"] == 5 and state["args"]["margin"] == "cosface" and state["args"]["m"] == 0.25
    assert not (tmp_path / "runs").exists()  # nothing written to the default --out
    log = open(os.path.join(run, "log.txt")).read()
    assert log.count("shardkit.train: ") == 2 and "step 5/5" in log and "results" in log  # appended
    # --out elsewhere: the resumed run writes there and leaves the original alone.
    other = str(tmp_path / "other")
    assert train.main(["--resume", run, "--steps", "6", "--out", other]) == 0
    assert _state(other)["step"] == 6 and _state(run)["step"] == 5


@pytest.mark.parametrize(
    "flags, both",
    [
        (["--margin", "arcface"], ("--margin arcface", "--margin cosface")),
        (["--classes", "20"], ("--classes 20", "--classes 16")),
        (["--seed", "0"], ("--seed 0", "--seed 5")),
    ],
)
def test_resume_contradicting_flag_exits_2_naming_both(finished_run, flags, both, capsys):
    assert train.main(["--resume", finished_run, "--steps", "9"] + flags) == 2
    err = capsys.readouterr().err
    assert both[0] in err and both[1] in err and "Traceback" not in err
    assert _state(finished_run)["step"] == 3  # untouched


def test_resume_finished_run_says_so(finished_run, capsys):
    before = os.path.getmtime(os.path.join(finished_run, "curves.png"))
    assert train.main(["--resume", finished_run]) == 0
    out = capsys.readouterr().out
    assert "already finished (3 of 3 steps)" in out and "--steps N" in out and "train top-1" not in out
    assert os.path.getmtime(os.path.join(finished_run, "curves.png")) == before  # no re-evaluation


def test_checkpoint_gone_after_the_flags_were_read_exits_2(finished_run, tmp_path, capsys, monkeypatch):
    # --resume is looked up when the flags are read and again when the run starts; a checkpoint
    # removed in between is a user error naming the flag, not a crash.
    run = _copy(finished_run, tmp_path / "run")
    real_find, calls = checkpoint.find, []

    def find_once(path):
        calls.append(path)
        return real_find(path) if len(calls) == 1 else None

    monkeypatch.setattr(checkpoint, "find", find_once)
    assert train.main(["--resume", run, "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert len(calls) == 2 and f"--resume {run!r}: no checkpoint found there any more" in err


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("kind", ["crafted", "empty", "garbage", "truncated", "foreign"])
def test_bad_checkpoint_files_exit_2_and_run_nothing(finished_run, tmp_path, kind, capsys):
    run = _copy(finished_run, tmp_path / "run")
    path = os.path.join(run, "checkpoint", checkpoint.CKPT_FILE)
    marker = tmp_path / "pwned"
    if kind == "crafted":
        evil = _Evil()
        evil.marker = marker
        state = checkpoint.read(path)
        state["history"] = evil
        torch.save(state, path)
    elif kind == "empty":
        open(path, "wb").close()
    elif kind == "garbage":
        open(path, "wb").write(os.urandom(3000))
    elif kind == "truncated":
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    else:
        torch.save({"weights": torch.zeros(3)}, path)
    assert train.main(["--resume", run, "--steps", "9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and path in err, err
    assert not marker.exists()  # the crafted file's code never ran
    if kind == "crafted":
        assert "refusing to load" in err


def test_torchrun_checkpoint_in_one_process_exits_2(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path / "run")
    ck = os.path.join(run, "checkpoint")
    for r in range(2):
        os.link(os.path.join(ck, checkpoint.CKPT_FILE), os.path.join(ck, f"{checkpoint.CKPT_FILE}.rank{r}"))
    os.remove(os.path.join(ck, checkpoint.CKPT_FILE))
    assert train.main(["--resume", run, "--steps", "9"]) == 2
    assert "torchrun --nproc_per_node=2" in capsys.readouterr().err


_SLOW_SAVE = r"""
import os, sys, time, torch
from shardkit.train import checkpoint
path = sys.argv[1]
checkpoint.write_atomic({"step": 1, "w": torch.ones(4)}, path)
real = torch.save
def slow_save(obj, f):
    f.write(b"half of a checkpoint")
    f.flush()
    print("writing", flush=True)
    time.sleep(60)
    real(obj, f)
torch.save = slow_save
checkpoint.write_atomic({"step": 2, "w": torch.zeros(4)}, path)
"""


def test_checkpoint_write_killed_halfway_keeps_the_previous(tmp_path):
    import shardkit

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(shardkit.__file__))))
    path = str(tmp_path / checkpoint.CKPT_FILE)
    child = subprocess.Popen([sys.executable, "-c", _SLOW_SAVE, path], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "writing"  # the second save is halfway
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    state = torch.load(path, weights_only=True)
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(4))


def test_help_every_flag_documented_default_once():
    p = build_parser()
    for action in p._actions:
        if action.dest == "help":
            continue
        text = action.help % {"default": action.default} if action.help else ""
        assert text, action.option_strings
        assert text.count("default:") == 1, (action.option_strings, text)
    assert "cosine" in p.epilog and "--steps, --epochs, --lr" in p.epilog


def test_warnings_sampling_nothing_and_slow_bf16(tmp_path, capsys, monkeypatch):
    from shardkit.train import header

    monkeypatch.setattr(header, "_cpu_has_fast_bf16", lambda: False)
    argv = TINY + ["--steps", "1", "--sample-rate", "0.5", "--amp", "bf16", "--devices", "cpu"]
    assert train.main(argv + ["--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err.count("--sample-rate 0.5 samples nothing here") == 1
    assert err.count("--amp bf16 on a CPU without native bf16") == 1
    assert "samples nothing" in open(tmp_path / "log.txt").read()
    # 64 classes on 2 shards with a batch of 8: sampling does sample, no warning.
    argv = TINY + ["--classes", "64", "--batch", "8", "--steps", "1", "--sample-rate", "0.25"]
    assert train.main(argv + ["--devices", "cpu,cpu", "--out", str(tmp_path / "b")]) == 0
    assert "samples nothing" not in capsys.readouterr().err


def test_log_and_header(finished_run):
    log = open(os.path.join(finished_run, "log.txt")).read()
    for needle in ("MFLOPs/image", "M parameters", "classes [0, 16)", "head memory", "step 3/3", "verif. acc"):
        assert needle in log, needle


def test_verification_every_k_steps_in_history_and_plot(tmp_path):
    out = str(tmp_path / "run")
    assert train.main(TINY + ["--steps", "6", "--eval-every", "2", "--out", out]) == 0
    state = _state(out)
    ev = state["history"]["eval"]
    assert ev["step"] == [2, 4]  # every 2 steps (the final evaluation comes after the last save)
    for key in ("raw_acc", "raw_tar", "ema_acc", "ema_tar"):
        assert len(ev[key]) == 2 and all(0 <= v <= 1 for v in ev[key]), key
    assert len(state["history"]["img_s"]) == 6 and all(v > 0 for v in state["history"]["img_s"])
    assert os.path.getsize(os.path.join(out, "curves.png")) > 20000


def test_profile_prints_phases_verdict_trace_and_chart(tmp_path, capsys, monkeypatch):
    import json

    from shardkit.train import profile

    monkeypatch.setenv("KINETO_LOG_LEVEL", "0")  # (so that teardown restores the variable as it was)
    monkeypatch.delenv("KINETO_LOG_LEVEL")
    out = str(tmp_path / "prof")
    assert train.main(TINY + ["--profile", "3", "--out", out]) == 0
    if not torch.cuda.is_available():  # torch's profiler logs no device-query ERROR line there
        assert os.environ.get("KINETO_LOG_LEVEL") == "5"
    text = capsys.readouterr().out
    assert "profile: 3 steps" in text and "verdict: " in text
    for phase in profile.PHASES:
        assert f"  {phase} " in text, phase
    assert json.load(open(os.path.join(out, "profile_trace.json")))["traceEvents"]
    assert os.path.getsize(os.path.join(out, "profile.png")) > 5000
    assert not os.path.exists(os.path.join(out, "checkpoint"))  # profiling trains nothing to keep


@pytest.mark.gpu
def test_profile_on_a_gpu_times_phases_with_events(tmp_path, capsys):
    # GPU twin: the device column comes from CUDA events (no sync between phases).
    out = str(tmp_path / "prof")
    assert train.main(TINY + ["--profile", "3", "--devices", "cuda:0", "--out", out]) == 0
    text = capsys.readouterr().out
    assert "device ms" in text and "verdict: " in text
    rows = [line.split() for line in text.splitlines() if line.startswith("  backbone fwd ")]
    assert rows and float(rows[0][-2]) > 0  # the backbone's device time per step


def test_profile_device_times_from_event_pairs(monkeypatch):
    # The event bookkeeping, with a stand-in for CUDA events (no GPU here): a phase's device
    # time is the sum over its occurrences of the longest (start, end) span among the devices.
    from shardkit.train import profile

    clock = {"t": 0.0}

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self, stream):
            self.t = clock["t"] + (2.0 if stream == "s1" else 0.0)  # device 1 lags by 2 ms

        def elapsed_time(self, end):
            return end.t - self.t

    synced = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: f"s{d.index}")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: synced.append(d))
    timer = profile._Timer([torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 0)])
    for ms in (3.0, 5.0):
        with timer("head"):
            clock["t"] += ms
    with timer("EMA"):
        clock["t"] += 1.0
    out = timer.device_seconds()
    assert synced == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert out == pytest.approx({"head": 0.008, "EMA": 0.001})
    assert set(timer.total) == {"head", "EMA"}  # host times too


def test_profile_verdicts():
    from shardkit.train.profile import PHASES, verdict

    def shares(**kw):
        base = dict.fromkeys(PHASES, 0.0)
        base.update({k.replace("_", " "): v for k, v in kw.items()})
        return base

    assert verdict(shares(data_wait=0.5, backward=0.5), True).startswith("input-bound") and "--workers" in verdict(
        shares(data_wait=0.5), True
    )
    assert verdict(shares(backward=0.9, data_wait=0.1), True).startswith("GPU-bound")
    assert verdict(shares(optimizer=0.5, backward=0.5), True).startswith("host-bound")
    assert verdict(shares(backward=0.9, data_wait=0.1), False).startswith("host-bound (CPU")


@pytest.mark.parametrize("layout", ["empty", "no_images", "broken_image"])
def test_bad_data_folder_exits_2(tmp_path, layout, capsys):
    root = tmp_path / "faces"
    root.mkdir()
    if layout != "empty":
        for k in range(6):
            (root / f"id{k}").mkdir()
            if layout == "broken_image":
                for i in range(3):
                    (root / f"id{k}" / f"{i}.png").write_bytes(b"not a png")
    argv = ["--data", str(root), "--val-classes", "2", "--cache-ram", "decoded", "--out", str(tmp_path / "o")]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and str(root) in err, err


@pytest.mark.parametrize("kind", ["xavier", "kaiming"])
def test_init_backbone_and_whole_head(kind):
    import shardkit
    from shardkit.train.models import build_backbone
    from shardkit.train.setup import init_weights

    torch.manual_seed(0)
    backbone = build_backbone("tiny", 64)
    head = shardkit.ShardedSoftmaxLoss(64, 3000, devices=["cpu", "cpu"])
    init_weights(kind, backbone, head, 3000)
    w = torch.cat([p.detach() for p in head.parameters()])
    assert w.shape == (3000, 64)
    if kind == "xavier":  # U(-b, b), b from the whole [3000, 64] weight, on both shards
        bound = (6 / (64 + 3000)) ** 0.5
        assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound
        assert all(p.abs().max() > 0.9 * bound for p in head.parameters())
    else:  # N(0, 2 / fan_in)
        assert abs(w.std().item() - (2 / 64) ** 0.5) < 0.01
    conv = backbone.stem[0].weight
    fan_in = conv[0].numel()
    if kind == "kaiming":
        assert abs(conv.std().item() - (2 / fan_in) ** 0.5) < 0.3 * (2 / fan_in) ** 0.5
    else:
        assert conv.abs().max() <= (6 / (fan_in + conv.shape[0] * conv[0, 0].numel())) ** 0.5


def test_a_new_run_over_an_earlier_one_says_so(finished_run, tmp_path, capsys):
    out = _copy(finished_run, tmp_path / "again")
    capsys.readouterr()
    assert train.main(TINY + ["--steps", "1", "--out", out]) == 0
    err = capsys.readouterr().err
    assert err.count(f"warning: {out} held an earlier run: its log.txt is replaced") == 1, err
    assert f"--resume {out} continues one" in err
    # a fresh folder, and a resume, say nothing of the kind
    assert train.main(TINY + ["--steps", "1", "--out", str(tmp_path / "fresh")]) == 0
    assert "held an earlier run" not in capsys.readouterr().err
    assert train.main(["--resume", out, "--steps", "2", "--no-progress"]) == 0
    assert "held an earlier run" not in capsys.readouterr().err


def _flip_a_bit_inside(path, member_filter=lambda info: True):
    """Flip the low bit of one byte in the middle of the largest member's data (a float's
    mantissa: the value stays finite, nothing but the CRC32 tells)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if member_filter(i)), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
        at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 1]))


def test_bit_flipped_checkpoint_exits_2_naming_the_file(finished_run, tmp_path, capsys):
    # torch.load does not check the zip members' CRC32s: such a file resumed silently (exit 0)
    # with a wrong weight.
    run = _copy(finished_run, tmp_path / "run")
    path = os.path.join(run, "checkpoint", checkpoint.CKPT_FILE)
    _flip_a_bit_inside(path, lambda i: "/data/" in i.filename)
    torch.load(path, map_location="cpu", weights_only=True)  # what was read before: no error
    capsys.readouterr()
    assert train.main(["--resume", run, "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "corrupted" in err and path in err and "CRC32" in err, err


def test_checkpoint_that_is_no_zip_archive_is_corrupted(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path / "run")
    path = os.path.join(run, "checkpoint", checkpoint.CKPT_FILE)
    data = bytearray(open(path, "rb").read())
    data[-22:] = bytes(22)  # the end-of-central-directory record zeroed
    open(path, "wb").write(data)
    assert train.main(["--resume", run, "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "corrupted" in err and path in err, err


def test_bit_flipped_head_shard_file_is_refused(tmp_path):
    # The head shards a torchrun checkpoint keeps beside it (shardkit.save_sharded) get the
    # same check, for the files a rank reads.
    import types

    import shardkit
    from shardkit.train import resume
    from shardkit.train.errors import UsageError

    head = shardkit.ShardedSoftmaxLoss(8, 40, devices=["cpu", "cpu"])
    directory = str(tmp_path / "head")
    files = shardkit.save_sharded(head, directory)
    parts = types.SimpleNamespace(head=head)
    resume._verify_head_files(directory, parts)  # intact: no error
    _flip_a_bit_inside(files[-1], lambda i: "/data/" in i.filename)
    with pytest.raises(UsageError, match=r"head shard file .* is corrupted \(its member .* fails its CRC32"):
        resume._verify_head_files(directory, parts)


def test_head_shard_files_of_another_step_are_refused(tmp_path):
    # Under torchrun the head's shard files are saved beside the rank files; a save interrupted
    # between them left head rows of step N+1 with the optimizer and backbone of step N.
    import shardkit
    from shardkit.train import resume
    from shardkit.train.errors import UsageError

    head = shardkit.ShardedSoftmaxLoss(8, 40, devices=["cpu", "cpu"])
    directory = str(tmp_path / "head")
    shardkit.save_sharded(head, directory, tag=7)
    resume._check_head_tag(directory, 7, "ckpt.pt.rank0")  # the same save: no error
    resume._check_head_tag(directory, None, "ckpt.pt.rank0")  # a checkpoint from before the tags
    with pytest.raises(UsageError, match=r"checkpoint ckpt.pt.rank0 is of step 6 but its head's shard files .* step 7"):
        resume._check_head_tag(directory, 6, "ckpt.pt.rank0")
