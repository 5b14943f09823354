"""python -m shardkit.train under faults found by probing: a resume onto another shard layout,
checkpoints edited by hand, unreadable files in --data, an --out it cannot write, batches
BatchNorm cannot take, a run that diverges before its final evaluation. Each user error is
one line on stderr and exit status 2; what the README lets change on resume works."""

import os
import shutil

import pytest
import torch
from PIL import Image

import shardkit
from shardkit import train
from shardkit.train import checkpoint
from shardkit.train import loop as train_loop
from shardkit.train import resume as train_resume
from shardkit.train.errors import UsageError

TINY = "--classes 16 --per-class 8 --image-size 16 --batch 8 --val-classes 4 --val-per-class 3 --dim 16".split()
TINY += ["--no-progress", "--devices", "cpu", "--ema", "0.9", "--ema-tau", "2"]


def _one_line(capsys, *needles):
    err = capsys.readouterr().err
    assert err.startswith("python -m shardkit.train: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and all(n in err for n in needles), err
    return err


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A 2-step run on one CPU shard (its head optimizer has momentum on the sampled rows)."""
    out = str(tmp_path_factory.mktemp("runs") / "r")
    assert train.main(TINY + ["--steps", "2", "--out", out]) == 0
    return out


def _copy(run, dst):
    shutil.copytree(run, dst)
    return str(dst)


def _ckpt(run):
    return os.path.join(run, "checkpoint", checkpoint.CKPT_FILE)


@pytest.mark.parametrize("flags", [["--devices", "cpu,cpu"], ["--devices", "cpu,cpu,cpu", "--dp"]])
def test_resume_on_another_shard_layout_keeps_the_head_momentum(two_steps, tmp_path, flags, monkeypatch):
    # --devices and --dp may change on resume: the head optimizer's state is saved in class
    # order and split over the new shards; each new shard's momentum rows and flags are the
    # saved ones of its classes, bit for bit, when the resumed run starts stepping.
    saved = checkpoint.read(_ckpt(two_steps))["optimizers"][1]
    saved_buf, saved_seen = torch.cat(saved["momentum_buffer"]), torch.cat(saved["seen"])
    assert saved["class_ordered"] and saved_buf.abs().sum() > 0 and saved_seen.any()
    loaded, real_load = [], train_resume.load_checkpoint

    def load_and_record(ckpt_dir, parts, world):
        out = real_load(ckpt_dir, parts, world)
        opt, head = parts.optimizers[1], parts.head
        for offset, p in zip(head.class_offsets, head.weight_shards):
            buf, seen = (opt.state.get(p, {}).get(key) for key in ("momentum_buffer", "seen"))
            loaded.append(
                (offset, p.shape[0], None if buf is None else buf.clone(), None if seen is None else seen.clone())
            )
        return out

    monkeypatch.setattr(train_resume, "load_checkpoint", load_and_record)
    run = _copy(two_steps, tmp_path / "run")
    assert train.main(["--resume", run, "--steps", "3", "--no-progress"] + flags) == 0
    assert len(loaded) > 1 and sum(n for _, n, _, _ in loaded) == saved_buf.shape[0]  # another layout
    for offset, n, buf, seen in loaded:
        assert buf is not None and seen is not None, f"no momentum restored for the shard at class {offset}"
        assert torch.equal(buf, saved_buf[offset : offset + n]), f"momentum rows of classes {offset}..{offset + n}"
        assert torch.equal(seen, saved_seen[offset : offset + n]) and seen.dtype == torch.bool
    after = checkpoint.read(_ckpt(run))["optimizers"][1]
    assert torch.cat(after["momentum_buffer"]).shape == saved_buf.shape


def test_head_optimizer_state_round_trips_over_any_shard_count():
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    src = shardkit.ShardedSoftmaxLoss(5, 23, devices=["cpu"], sample_rate=0.5)
    opt = shardkit.SparseRowSGD(src.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        src(torch.randn(6, 5), torch.randint(0, 23, (6,))).backward()
        opt.step()
        opt.zero_grad()
    state = checkpoint.head_optimizer_state(opt, src)
    for sizes in ([23], [10, 13], [7, 0, 9, 7]):
        dst = shardkit.ShardedSoftmaxLoss(5, 23, devices=["cpu"] * len(sizes), shard_sizes=sizes)
        opt2 = shardkit.SparseRowSGD(dst.parameters(), lr=0.5, momentum=0.9)
        checkpoint.load_head_optimizer_state(opt2, dst, state)
        back = checkpoint.head_optimizer_state(opt2, dst)
        assert torch.equal(torch.cat(back["momentum_buffer"]), torch.cat(state["momentum_buffer"]))
        assert torch.equal(torch.cat(back["seen"]), torch.cat(state["seen"])) and back["seen"][0].dtype == torch.bool
        assert opt2.param_groups[0]["lr"] == 0.1  # the saved hyper-parameters
    wrong = shardkit.ShardedSoftmaxLoss(5, 24, devices=["cpu"])
    with pytest.raises(ValueError, match="does not hold 24 classes"):
        checkpoint.load_head_optimizer_state(shardkit.SparseRowSGD(wrong.parameters(), lr=0.1), wrong, state)


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda s: s.pop("args"), "no settings"),
        (lambda s: s.__setitem__("args", [1, 2]), "no settings"),
        (lambda s: s["args"].__setitem__("batch", 0), "--batch is 0"),
        (lambda s: s["args"].__setitem__("classes", "16"), "--classes is '16'"),
        (lambda s: s["args"].__setitem__("classes", 16.0), "--classes is 16.0"),
        (lambda s: s["args"].__setitem__("classes", -3), "--classes is -3"),
        (lambda s: s["args"].pop("classes"), "no classes setting"),
        (lambda s: s["args"].__setitem__("lr", float("nan")), "--lr is nan"),
        (lambda s: s["args"].__setitem__("margin", "foo"), "--margin is 'foo'"),
        (lambda s: s["args"].__setitem__("checkpointing", "yes"), "--checkpointing"),
        (lambda s: s.__setitem__("step", "5"), "step '5'"),
        (lambda s: s.__setitem__("step", 2.0), "step 2.0"),
        (lambda s: s.__setitem__("step", -5), "step -5"),
        (lambda s: s.__setitem__("history", [1]), "history"),
        (lambda s: s.__setitem__("history", {"step": 5}), "history"),
        (lambda s: s["history"].pop("loss"), "history keys"),
        (lambda s: s["history"]["eval"].pop("raw_acc"), "history keys"),
        (lambda s: s.__setitem__("optimizers", s["optimizers"][:1]), "optimizers"),
        (lambda s: s.__setitem__("ema", None), "EMA"),
        (lambda s: s["optimizers"][1].__setitem__("momentum_buffer", torch.zeros(3)), "does not fit this run"),
        (lambda s: s["optimizers"][1].__setitem__("momentum_buffer", [torch.zeros(3, 16)]), "does not fit this run"),
        # the backbone optimizer's momentum of the wrong shape: a broadcast traceback at the next step
        (
            lambda s: [st.update(momentum_buffer=torch.zeros(1)) for st in s["optimizers"][0]["state"].values()],
            "the backbone optimizer's momentum of parameter 0 is (1,), not (",
        ),
        # non-finite momentum: the first step made the weights NaN ("diverged ... lower --lr")
        (
            lambda s: next(iter(s["optimizers"][0]["state"].values()))["momentum_buffer"].fill_(float("inf")),
            "the backbone optimizer's momentum of parameter 0 holds NaN or infinite values",
        ),
        (
            lambda s: s["optimizers"][1]["momentum_buffer"][0][1].fill_(float("nan")),
            "the head optimizer's momentum of parameter 0 holds NaN or infinite values",
        ),
        # every line of load_state_dict's error, not its first ("Error(s) in loading state_dict for Backbone:")
        (lambda s: s["backbone"].pop("stem.0.weight"), 'Missing key(s) in state_dict: "stem.0.weight"'),
    ],
)
def test_checkpoint_edited_by_hand_is_one_line(two_steps, tmp_path, capsys, edit, needle):
    run = _copy(two_steps, tmp_path / "run")
    state = checkpoint.read(_ckpt(run))
    edit(state)
    torch.save(state, _ckpt(run))
    capsys.readouterr()
    assert train.main(["--resume", run, "--steps", "3", "--no-progress"]) == 2
    _one_line(capsys, needle)


def _faces(root, classes=6, per=6, size=8):
    for k in range(classes):
        (root / f"id{k}").mkdir(parents=True)
        for i in range(per):
            Image.new("RGB", (size, size), (k * 40, i * 60, 7)).save(root / f"id{k}" / f"{i}.png")
    return root


# --batch 8: BatchNorm gets the 8 images below which the trainer warns (the tests expect one line)
DATA = ["--val-classes", "2", "--image-size", "8", "--batch", "8", "--steps", "2"]
DATA += ["--dim", "8", "--devices", "cpu", "--no-progress", "--ema", "0"]


@pytest.mark.parametrize("fault", ["dangling", "loop", "fifo", "dir", "held_out_empty_file", "held_out_empty"])
def test_unreadable_files_in_data_are_one_line(tmp_path, capsys, fault):
    root = _faces(tmp_path / "faces")
    if fault == "dangling":
        os.symlink(tmp_path / "nowhere.png", root / "id0" / "zz.png")
    elif fault == "loop":
        os.symlink(root / "id0" / "loop.png", root / "id0" / "loop.png")
    elif fault == "fifo":
        os.mkfifo(root / "id0" / "pipe.png")  # reading it would block forever
    elif fault == "dir":
        (root / "id0" / "sub.png").mkdir()
        (root / "id0" / "sub.png" / "x.png").write_bytes(b"")  # a folder named like an image: walked into
    elif fault == "held_out_empty_file":
        (root / "id5" / "zz.png").write_bytes(b"")
    else:
        for f in (root / "id4").iterdir():
            f.unlink()
        for f in (root / "id5").iterdir():
            f.unlink()
    assert train.main(["--data", str(root), "--out", str(tmp_path / "o")] + DATA) == 2
    _one_line(capsys, str(root))


def test_a_broken_image_read_only_by_the_evaluation_is_one_line(tmp_path, capsys, monkeypatch):
    # The steps never read it (the data order is patched to skip it); the final train top-1 does.
    root = _faces(tmp_path / "faces")
    (root / "id0" / "0.png").write_bytes(b"truncated")
    bad = str(root / "id0" / "0.png")
    monkeypatch.setattr(train_loop.setup.Batches, "get", lambda self, i, n: _good_batch(self.dataset, bad))
    assert train.main(["--data", str(root), "--out", str(tmp_path / "o")] + DATA) == 2
    _one_line(capsys, bad, "cannot decode image")


def _good_batch(dataset, bad):
    idx = [i for i in range(len(dataset)) if dataset.dataset.samples[dataset.indices[i]][0] != bad][:8]
    items = [dataset[i] for i in idx]
    return torch.stack([im for im, _ in items]), torch.stack([lb for _, lb in items])


def test_decode_errors_from_loader_workers_name_the_file(tmp_path, capsys):
    root = _faces(tmp_path / "faces")
    for k in range(4):
        for image in (root / f"id{k}").iterdir():
            image.write_bytes(b"garbage")
    assert train.main(["--data", str(root), "--workers", "2", "--out", str(tmp_path / "o")] + DATA) == 2
    err = _one_line(capsys, "cannot decode image", ".png")
    assert "worker process" not in err


def test_a_broken_image_decoded_up_front_says_to_replace_it(tmp_path, capsys):
    # --cache-ram decoded decodes every image while the folder is read: the hint is the file's,
    # not the folder layout's, and Pillow's name for its in-memory buffer stays out of the line.
    root = _faces(tmp_path / "faces")
    (root / "id1" / "0.png").write_bytes(b"garbage")
    argv = ["--data", str(root), "--cache-ram", "decoded", "--out", str(tmp_path / "o")] + DATA
    assert train.main(argv) == 2
    err = _one_line(capsys, str(root / "id1" / "0.png"), "remove or replace that file in --data")
    assert "BytesIO" not in err and "class subfolders" not in err


def test_held_out_classes_of_one_image_each_say_what_they_need(tmp_path, capsys):
    root = _faces(tmp_path / "faces")
    held_out = sorted(p for p in root.iterdir() if p.is_dir())[-2:]  # DATA holds out the last 2 classes
    for folder in held_out:
        for extra in sorted(folder.iterdir())[1:]:
            extra.unlink()
    assert train.main(["--data", str(root), "--out", str(tmp_path / "o")] + DATA) == 2
    _one_line(capsys, "held-out classes", "two or more images each")


def test_data_path_that_is_not_utf8_is_logged_escaped(tmp_path, capsys):
    root = _faces(tmp_path / os.fsdecode(b"bad\xffname"))
    assert train.main(["--data", str(root), "--out", str(tmp_path / "o")] + DATA) == 0
    assert "bad\\udcffname" in open(tmp_path / "o" / "log.txt", encoding="utf-8").read()


@pytest.mark.parametrize("fault", ["checkpoint_file", "log_dir", "curves_dir", "too_long", "proc"])
def test_out_that_cannot_be_written_is_one_line(tmp_path, capsys, fault):
    out = tmp_path / "o"
    out.mkdir()
    if fault == "checkpoint_file":
        (out / "checkpoint").write_bytes(b"")
    elif fault == "log_dir":
        (out / "log.txt").mkdir()
    elif fault == "curves_dir":
        (out / "curves.png").mkdir()
    elif fault == "too_long":
        out = out / ("x" * 300)
    else:
        out = "/proc/shardkit_out"
    assert train.main(TINY + ["--steps", "1", "--out", str(out)]) == 2
    _one_line(capsys, "--out")


@pytest.mark.parametrize(
    "flags",
    [
        ["--batch", "1"],
        ["--batch", "1", "--checkpointing"],
        ["--dp", "--devices", "cpu,cpu", "--batch", "3"],
        ["--dp", "--devices", "cpu,cpu,cpu,cpu", "--batch", "7"],
        ["--pipeline", "--devices", "cpu,cpu", "--chunks", "64"],
    ],
)
def test_batches_batch_norm_cannot_take_are_refused(tmp_path, capsys, flags):
    assert train.main(TINY + ["--steps", "1", "--out", str(tmp_path / "o")] + flags) == 2
    _one_line(capsys, "--batch", "BatchNorm")


def test_divergence_found_by_the_final_evaluation_is_one_line(tmp_path, capsys, monkeypatch):
    # The step's own check did not fire (patched out); the evaluation's head call finds NaN.
    real = train_loop.train_step

    def step_then_break(parts, *a, **k):
        out = real(parts, *a, **k)
        with torch.no_grad():
            for p in parts.backbone.parameters():
                p.fill_(float("nan"))
        return out

    monkeypatch.setattr(train_loop, "train_step", step_then_break)
    assert train.main(TINY + ["--steps", "1", "--ema", "0", "--out", str(tmp_path / "o")]) == 2
    _one_line(capsys, "diverged", "--lr")


def test_a_subfolder_it_may_not_read_is_skipped_as_os_walk_did(tmp_path, monkeypatch):
    # e.g. lost+found on a data disk, for a user who is not root (simulated: tests run as root)
    from shardkit.train import imagefolder

    root = _faces(tmp_path / "faces")
    (root / "id0" / "noperm").mkdir()
    (root / "id0" / "noperm" / "x.png").write_bytes(b"")
    real = os.scandir

    def scandir(path):
        if os.path.basename(path) == "noperm":
            raise PermissionError(13, "Permission denied", path)
        return real(path)

    monkeypatch.setattr(imagefolder.os, "scandir", scandir)
    ds = imagefolder.ImageFolderDataset(str(root), 8)
    assert len(ds) == 36 and not any("noperm" in p for p, _ in ds.samples)


def test_header_gives_each_shard_the_planner_figure_of_its_own_size(tmp_path, capsys):
    # --pipeline sizes the head shards unevenly (possibly 0 classes on a device): each line must
    # give the planner's figure for that shard's own class count.
    import re

    from shardkit.plan import format_size, plan_memory

    assert train.main(TINY + ["--steps", "1", "--devices", "cpu,cpu", "--pipeline", "--out", str(tmp_path / "o")]) == 0
    lines = re.findall(r"cpu: classes \[(\d+), (\d+)\), head memory (.+?) \(weights", capsys.readouterr().out)
    assert len(lines) == 2 and int(lines[0][0]) == 0 and int(lines[-1][1]) == 16
    for lo, hi, text in lines:
        size = int(hi) - int(lo)
        want = format_size(plan_memory(size, 16, 1, 8).devices[0].total) if size else "none (no classes)"
        assert text == want, (lo, hi, text, want)


def test_checkpoint_state_holds_the_head_tensors_without_copies():
    # A 10M-class head is ~5 GB per copy: saving must not duplicate the weight or the momentum.
    head = shardkit.ShardedSoftmaxLoss(5, 23, devices=["cpu"])
    opt = shardkit.SparseRowSGD(head.parameters(), lr=0.1, momentum=0.9)
    head(torch.randn(6, 5), torch.randint(0, 23, (6,))).backward()
    opt.step()
    assert head.state_dict()["weight"].data_ptr() == head.weight_shards[0].data_ptr()
    state = checkpoint.head_optimizer_state(opt, head)
    assert state["momentum_buffer"][0].data_ptr() == opt.state[head.weight_shards[0]]["momentum_buffer"].data_ptr()


def test_an_empty_data_flag_and_synthetic_sizes_with_data_are_refused(tmp_path, capsys, monkeypatch):
    # `--data "$DATA"` with DATA unset trained on the current folder; --classes, --per-class and
    # --val-per-class were ignored silently with --data.
    monkeypatch.chdir(_faces(tmp_path / "faces"))
    assert train.main(["--data", "", "--out", str(tmp_path / "o")] + DATA) == 2
    _one_line(capsys, "--data is empty")
    root = str(tmp_path / "faces")
    for extra in (["--classes", "5000"], ["--per-class", "3", "--val-per-class", "50"]):
        assert train.main(["--data", root, "--out", str(tmp_path / "o")] + DATA + extra) == 2
        _one_line(capsys, "size the synthetic data; with --data", extra[0])


def test_an_empty_class_folder_is_refused_naming_it(tmp_path, capsys):
    # It became a class of the head that no image is of, silently.
    root = _faces(tmp_path / "faces")
    (root / "id2b").mkdir()
    (root / "id2c").mkdir()
    (root / "id2c" / "notes.txt").write_text("not an image")
    assert train.main(["--data", str(root), "--out", str(tmp_path / "o")] + DATA) == 2
    _one_line(capsys, "2 class folder(s) hold no image files", "'id2b', 'id2c'")


def test_images_are_read_upright_and_16_bit_grayscale_is_scaled(tmp_path):
    import numpy as np

    from shardkit.train.data import ImageFolderDataset

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ramp = (np.arange(64, dtype=np.uint32).reshape(8, 8) * 1040).astype(np.uint16)  # 0 .. 65520
    Image.fromarray(ramp).save(tmp_path / "a" / "ramp16.png")  # mode I;16
    Image.fromarray((ramp / 65535.0).astype(np.float32)).save(tmp_path / "a" / "float.tif")  # mode F, 0..1
    photo = np.zeros((8, 8, 3), dtype=np.uint8)
    photo[:, :4] = 255  # stored left white; EXIF orientation 6: shown rotated 90 degrees clockwise
    im = Image.fromarray(photo)
    exif = im.getexif()
    exif[0x0112] = 6
    im.save(tmp_path / "b" / "phone.jpg", exif=exif, quality=100)
    (tmp_path / "b" / "._phone.jpg").write_bytes(b"\x00\x05\x16\x07 macOS metadata")  # hidden: not taken
    (tmp_path / "b" / ".picasaoriginals").mkdir()
    (tmp_path / "b" / ".picasaoriginals" / "phone.jpg").write_bytes(b"")
    ds = ImageFolderDataset(str(tmp_path), image_size=8, channels=1)
    assert sorted(os.path.basename(p) for p, _ in ds.samples) == ["float.tif", "phone.jpg", "ramp16.png"]
    by_name = {os.path.basename(p): ds[i][0][..., 0].float() for i, (p, _) in enumerate(ds.samples)}
    expected = torch.from_numpy(ramp / 257.0).round()
    for name in ("ramp16.png", "float.tif"):  # clipped at 255 (16-bit) or truncated to 0 / 1 (float)
        assert (by_name[name] - expected).abs().max() <= 1, name
    shown = by_name["phone.jpg"]
    assert shown[:4].mean() > 200 and shown[4:].mean() < 50  # top white, bottom black, as a viewer shows it


def test_an_image_failing_mid_epoch_keeps_the_steps_before_it(tmp_path, capsys):
    # The run exited 2 with nothing saved: every step of the epoch before the bad file was lost.
    root = _faces(tmp_path / "faces", classes=6, per=16)
    good = (root / "id1" / "3.png").read_bytes()
    (root / "id1" / "3.png").write_bytes(good[:40])  # a truncated download
    out = str(tmp_path / "o")
    flags = ["--val-classes", "2", "--image-size", "8", "--batch", "8", "--epochs", "2", "--eval-every", "0"]
    flags += ["--dim", "8", "--devices", "cpu", "--no-progress", "--ema", "0"]
    assert train.main(["--data", str(root), "--out", out] + flags) == 2
    err = _one_line(capsys, "cannot decode image", "3.png", "steps before it are saved", f"--resume {out}")
    saved = int(err.split("(the ")[1].split(" steps")[0])
    assert saved >= 1
    found = checkpoint.find(out)
    assert found is not None and checkpoint.read(checkpoint.layout.newest_file(found))["step"] == saved
    (root / "id1" / "3.png").write_bytes(good)  # replaced: the run continues from there
    assert train.main(["--resume", out]) == 0


def test_a_resume_finds_the_same_data_folder_or_says_what_changed(tmp_path, capsys):
    # The folder's path alone was compared: one class swapped for another (same count) resumed
    # silently onto other labels; a class added said "resume it with the version of shardkit
    # that wrote it"; the unchanged folder moved could not be resumed at all.
    root = _faces(tmp_path / "faces", classes=6, per=8)
    out = str(tmp_path / "o")
    assert train.main(["--data", str(root), "--out", out] + DATA) == 0
    capsys.readouterr()

    moved = tmp_path / "moved"
    shutil.move(str(root), moved)
    assert train.main(["--resume", out, "--steps", "3"]) == 2
    _one_line(capsys, "the checkpoint's, is not a directory any more", "give --data with the folder's new place")
    assert train.main(["--resume", out, "--data", str(moved), "--steps", "3"]) == 0  # the same folder, moved
    capsys.readouterr()

    shutil.rmtree(moved / "id2")  # a class swapped for another: the same counts
    _faces(tmp_path / "other", classes=1, per=8)
    shutil.move(str(tmp_path / "other" / "id0"), moved / "zz")
    assert train.main(["--resume", out, "--data", str(moved), "--steps", "4"]) == 2
    _one_line(capsys, "has changed since checkpoint", "the same counts, but other class folders")
    (moved / "zz" / "0.png").unlink()  # and an image fewer
    assert train.main(["--resume", out, "--data", str(moved), "--steps", "4"]) == 2
    _one_line(capsys, "it held 6 class folders and 48 images, now 6 and 47")


def test_data_runs_get_the_fit_checks_of_the_synthetic_data(tmp_path, capsys, monkeypatch):
    # They were skipped for --data: a head or a held-out set larger than the machine started anyway.
    import argparse

    from shardkit.train import argtypes
    from shardkit.train import setup as train_setup

    root = tmp_path / "faces"
    _faces(root, classes=4, per=4)
    for k in (4, 5):  # two held-out classes of 120 images: 14,280 genuine pairs
        (root / f"id{k}").mkdir()
        for i in range(120):
            Image.new("RGB", (4, 4), (k, i, 7)).save(root / f"id{k}" / f"{i}.png")
    monkeypatch.setattr(train_setup, "_ram_bytes", lambda: 64 * 2**20)
    flags = ["--val-classes", "2", "--image-size", "8", "--batch", "8", "--steps", "1", "--dim", "512"]
    flags += ["--devices", "cpu", "--no-progress", "--ema", "0"]
    assert train.main(["--data", str(root), "--out", str(tmp_path / "o")] + flags) == 2
    _one_line(capsys, "--data's held-out classes", "240 images and 14280 genuine pairs need over", "--val-classes")

    args = argparse.Namespace(devices=[torch.device("cpu")], batch=8, dim=4096, sample_rate=1.0, val_classes=2)
    args.image_size = 8
    monkeypatch.setattr(argtypes, "_ram_bytes", lambda: 2**30)
    monkeypatch.setattr(train_setup, "_ram_bytes", lambda: 2**30)
    with pytest.raises(UsageError, match="--data.s 20022 training classes x --dim 4096: the head needs about"):
        train_setup._check_folder_fits(args, 1, 20022, [0, 0, 1, 1])
    train_setup._check_folder_fits(args, 1, 100, [0, 0, 1, 1])  # fits


def test_a_checkpoint_without_a_data_record_keeps_its_folder(tmp_path, capsys):
    # Written before checkpoints recorded --data's contents: another folder given on resume was
    # accepted silently (nothing to check it against).
    root = _faces(tmp_path / "faces", classes=6, per=8)
    other = _faces(tmp_path / "other", classes=6, per=8)
    out = str(tmp_path / "o")
    assert train.main(["--data", str(root), "--out", out] + DATA) == 0
    path = checkpoint.layout.newest_file(checkpoint.find(out))
    state = checkpoint.read(path)
    del state["data"]
    checkpoint.write_atomic(state, path)
    capsys.readouterr()
    assert train.main(["--resume", out, "--data", str(other), "--steps", "3"]) == 2
    _one_line(capsys, "contradicts the checkpoint")
