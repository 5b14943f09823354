"""Re-shardable checkpoints: save with N shards, load with M, back to N, bit-exact.

Saving and loading need no collective, so "rank r of N" is simulated in one process by a
head holding the shard rank r would own (shardkit.distributed.split_classes). The real
multi-process path is exercised in test_softmax_distributed.py."""

import os
from types import SimpleNamespace

import pytest
import torch

import shardkit
from shardkit.distributed import class_offsets, split_classes
from shardkit.softmax import shard_files
from shardkit.softmax.checkpoint import read_rows, save_shard_file


def _rank_head(num_classes, dim, world, rank, dtype=torch.float32):
    """What rank ``rank`` of ``world`` holds: one Parameter (garbage until loaded)."""
    sizes = split_classes(num_classes, world)
    offsets = class_offsets(sizes)
    shard = torch.nn.Parameter(torch.randn(sizes[rank], dim, dtype=dtype) * 1e3)
    return SimpleNamespace(weight_shards=[shard], class_offsets=[offsets[rank]], num_classes=num_classes)


def _save_world(full, world, directory, momentum=None):
    for rank in range(world):
        head = _rank_head(full.shape[0], full.shape[1], world, rank, full.dtype)
        shardkit.import_full_weight(head, full)
        opt = None
        if momentum is not None:
            opt = shardkit.SparseRowSGD(head.weight_shards, lr=0.1, momentum=0.9)
            p = head.weight_shards[0]
            off = head.class_offsets[0]
            opt.state[p]["momentum_buffer"] = momentum[off : off + p.shape[0]].clone()
            opt.state[p]["seen"] = torch.ones(p.shape[0], dtype=torch.bool)
        shardkit.save_sharded(head, directory, opt)


def _load_world(num_classes, dim, world, directory, dtype, with_momentum=False):
    weights, bufs = [], []
    for rank in range(world):
        head = _rank_head(num_classes, dim, world, rank, dtype)
        opt = shardkit.SparseRowSGD(head.weight_shards, lr=0.1, momentum=0.9) if with_momentum else None
        shardkit.load_sharded(head, directory, opt)
        weights.append(head.weight_shards[0].detach())
        if with_momentum:
            bufs.append(opt.state[head.weight_shards[0]]["momentum_buffer"])
    return torch.cat(weights), (torch.cat(bufs) if with_momentum else None)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_reshard_n_m_n_bit_exact(tmp_path, n):
    num_classes, dim = 11, 5  # 11 classes: uneven splits for every world size > 1
    full = torch.randn(num_classes, dim)
    momentum = torch.randn(num_classes, dim)
    _save_world(full, n, tmp_path / f"n{n}", momentum)
    for m in (1, 2, 3, 4):
        w_m, buf_m = _load_world(num_classes, dim, m, tmp_path / f"n{n}", full.dtype, with_momentum=True)
        assert torch.equal(w_m, full) and torch.equal(buf_m, momentum)
        _save_world(w_m, m, tmp_path / f"n{n}m{m}", buf_m)
        back, buf_back = _load_world(num_classes, dim, n, tmp_path / f"n{n}m{m}", full.dtype, with_momentum=True)
        assert torch.equal(back, full) and torch.equal(buf_back, momentum)


def test_more_ranks_than_classes_and_bf16(tmp_path):
    full = torch.randn(3, 7).bfloat16()
    _save_world(full, 4, tmp_path / "a")  # rank 3 holds no class
    assert len(os.listdir(tmp_path / "a")) == 4
    w, _ = _load_world(3, 7, 2, tmp_path / "a", torch.bfloat16)
    assert torch.equal(w, full)
    assert torch.equal(read_rows(str(tmp_path / "a"), 1, 2), full[1:3])
    assert read_rows(str(tmp_path / "a"), 0, 2, "momentum_buffer") is None


def test_checkpoint_files_load_weights_only(tmp_path):
    full = torch.randn(6, 3)
    _save_world(full, 2, tmp_path / "c")
    for name in os.listdir(tmp_path / "c"):
        blob = torch.load(tmp_path / "c" / name, weights_only=True)
        assert blob["format"] == "shardkit.sharded_weight" and blob["version"] == 1
        assert blob["num_classes"] == 6 and blob["embedding_dim"] == 3
        off = blob["class_offset"]
        assert torch.equal(blob["weight"], full[off : off + blob["weight"].shape[0]])


def test_checkpoint_errors(tmp_path):
    full = torch.randn(10, 4)
    _save_world(full, 2, tmp_path / "x")
    head = _rank_head(12, 4, 1, 0)
    with pytest.raises(ValueError, match="holds 10 classes x 4, the module has 12 classes x 4"):
        shardkit.load_sharded(head, str(tmp_path / "x"))
    # a second sharding saved into the same directory overlaps the first
    _save_world(full, 3, tmp_path / "x")
    with pytest.raises(ValueError, match="without gaps or overlaps"):
        shardkit.load_sharded(_rank_head(10, 4, 1, 0), str(tmp_path / "x"))
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        shardkit.load_sharded(head, str(tmp_path / "missing"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="holds no shard files"):
        shardkit.load_sharded(head, str(tmp_path / "empty"))
    save_shard_file(str(tmp_path / "gap"), torch.randn(3, 4), 0, 10)
    with pytest.raises(ValueError, match=r"cover \[0, 3\) of 10 classes"):
        shardkit.load_sharded(_rank_head(10, 4, 1, 0), str(tmp_path / "gap"))
    with pytest.raises(ValueError, match="argument `weight` must be"):
        shardkit.import_full_weight(head, torch.randn(5, 4))
    with pytest.raises(ValueError, match="argument `class_offset`"):
        save_shard_file(str(tmp_path / "bad"), torch.randn(3, 4), 9, 10)


@pytest.mark.gpu
def test_cuda_shards_with_momentum_round_trip(tmp_path):
    """Shards and SparseRowSGD momentum on the GPU: saved as CPU tensors, loaded bit-exact
    into GPU or CPU heads, the optimizer state on each parameter's device."""
    head = shardkit.ShardedSoftmaxLoss(5, 23, devices=["cuda:0", "cuda:0"])
    opt = shardkit.SparseRowSGD(head.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    head(torch.randn(6, 5, device="cuda"), torch.randint(0, 23, (6,), device="cuda")).backward()
    opt.step()
    shardkit.save_sharded(head, str(tmp_path / "ck"), opt)
    buf = torch.cat([opt.state[p]["momentum_buffer"].cpu() for p in head.weight_shards])
    for devices in (["cuda:0"], ["cpu"] * 3):
        other = shardkit.ShardedSoftmaxLoss(5, 23, devices=devices)
        opt2 = shardkit.SparseRowSGD(other.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        shardkit.load_sharded(other, str(tmp_path / "ck"), opt2)
        assert torch.equal(other.full_weight("cpu"), head.full_weight("cpu"))
        for p in other.weight_shards:
            assert opt2.state[p]["momentum_buffer"].device == p.device == opt2.state[p]["seen"].device
        assert torch.equal(torch.cat([opt2.state[p]["momentum_buffer"].cpu() for p in other.weight_shards]), buf)


class _RunsCode:
    """A pickle payload that would create a file when unpickled (a stand-in for os.system)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_momentum_rows_without_seen_flags_load_as_started(tmp_path):
    # A shard file may hold `momentum_buffer` without `momentum_seen` (the format makes both
    # optional): its rows' buffers count as started, as a torch.optim.SGD buffer does.
    num_classes, dim = 7, 3
    full, momentum = torch.randn(num_classes, dim), torch.randn(num_classes, dim)
    _save_world(full, 2, str(tmp_path), momentum)
    for name in os.listdir(tmp_path):
        blob = torch.load(tmp_path / name, weights_only=True)
        del blob["momentum_seen"]
        torch.save(blob, tmp_path / name)
    weight, buf = _load_world(num_classes, dim, 3, str(tmp_path), full.dtype, with_momentum=True)
    assert torch.equal(weight, full) and torch.equal(buf, momentum)
    head = _rank_head(num_classes, dim, 1, 0)
    opt = shardkit.SparseRowSGD(head.weight_shards, lr=0.1, momentum=0.9)
    shardkit.load_sharded(head, str(tmp_path), opt)
    state = opt.state[head.weight_shards[0]]
    assert state["seen"].dtype == torch.bool and bool(state["seen"].all()) and state["seen"].shape == (num_classes,)


def _valid_checkpoint(tmp_path, num_classes=10, dim=4, world=2):
    full = torch.randn(num_classes, dim)
    directory = tmp_path / "ckpt"
    _save_world(full, world, str(directory))
    return full, directory


def test_crafted_pickle_is_refused_and_runs_nothing(tmp_path):
    _, directory = _valid_checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    victim = directory / "classes-000000000000-000000000005.pt"
    blob = torch.load(victim, weights_only=True)
    blob["weight"] = _RunsCode(str(marker))
    torch.save(blob, victim)  # a plain pickle of an object whose __reduce__ calls open()
    head = _rank_head(10, 4, 1, 0)
    with pytest.raises(ValueError, match=r"classes-000000000000-000000000005\.pt' cannot be read .*weights-only"):
        shardkit.load_sharded(head, str(directory))
    with pytest.raises(ValueError, match="cannot be read"):
        read_rows(str(directory), 0, 10)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "not_a_dict", "other_format"])
def test_damaged_shard_file_names_the_file(tmp_path, damage):
    _, directory = _valid_checkpoint(tmp_path)
    victim = directory / "classes-000000000005-000000000010.pt"
    data = victim.read_bytes()
    if damage == "empty":
        victim.write_bytes(b"")
    elif damage == "truncated":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        victim.write_bytes(os.urandom(len(data)))
    elif damage == "not_a_dict":
        torch.save(torch.zeros(5, 4), victim)
    else:
        torch.save({"format": "something.else", "version": 1, "weight": torch.zeros(5, 4)}, victim)
    head = _rank_head(10, 4, 1, 0)
    before = head.weight_shards[0].detach().clone()
    with pytest.raises(ValueError, match=r"shard file '.*classes-000000000005-000000000010\.pt'"):
        shardkit.load_sharded(head, str(directory))
    # the rows are read before anything is copied: the module is left untouched
    assert torch.equal(head.weight_shards[0].detach(), before)


def test_shard_with_fewer_rows_than_its_name(tmp_path):
    full, directory = _valid_checkpoint(tmp_path)
    victim = directory / "classes-000000000005-000000000010.pt"
    blob = torch.load(victim, weights_only=True)
    blob["weight"] = blob["weight"][:3].clone()
    torch.save(blob, victim)
    head = _rank_head(10, 4, 1, 0)
    msg = r"000000000010\.pt': its name says classes \[5, 10\) \(5 rows\), the file holds 3"
    with pytest.raises(ValueError, match=msg):
        shardkit.load_sharded(head, str(directory))


def test_stray_files_are_ignored(tmp_path):
    full, directory = _valid_checkpoint(tmp_path)
    (directory / "README.txt").write_text("notes")
    (directory / "classes-000000000000-000000000005.pt.tmp1234").write_bytes(b"half a save")
    (directory / "classes-notes.pt").write_bytes(b"x")
    head = _rank_head(10, 4, 1, 0)
    shardkit.load_sharded(head, str(directory))
    assert torch.equal(head.weight_shards[0].detach(), full)


def test_shard_of_another_checkpoint_is_named(tmp_path):
    _, directory = _valid_checkpoint(tmp_path)
    other = tmp_path / "other"
    _save_world(torch.randn(10, 6), 2, str(other))
    os.replace(other / "classes-000000000005-000000000010.pt", directory / "classes-000000000005-000000000010.pt")
    with pytest.raises(ValueError, match=r"000000000010\.pt' holds 10 classes x 6, the other shard files 10 x 4"):
        shardkit.load_sharded(_rank_head(10, 4, 1, 0), str(directory))


def test_type_errors_name_the_argument(tmp_path):
    head = _rank_head(10, 4, 1, 0)
    with pytest.raises(TypeError, match=r"argument `weight` must be a \[C, D\] torch.Tensor, got list"):
        shardkit.import_full_weight(head, [[0.0] * 4] * 10)
    with pytest.raises(TypeError, match="argument `weight` must be floating point, got torch.int64"):
        shardkit.import_full_weight(head, torch.ones(10, 4, dtype=torch.int64))
    for fn in (
        lambda m: shardkit.save_sharded(m, str(tmp_path / "x")),
        lambda m: shardkit.load_sharded(m, str(tmp_path / "x")),
        lambda m: shardkit.import_full_weight(m, torch.zeros(10, 4)),
    ):
        with pytest.raises(TypeError, match="argument `module` must be a shardkit.ShardedSoftmaxLoss .*got Linear"):
            fn(torch.nn.Linear(4, 10))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "sizes,dtype", [([3, 0, 5, 2], torch.float64), ([10], torch.float32), ([6, 4], torch.bfloat16)]
)
def test_export_full_weight_in_one_process(sizes, dtype):
    # The class-ordered [C, D] weight of every shard (an empty one included), detached, in the
    # shards' dtype, a copy: written into after export, the head keeps its rows.
    head = shardkit.ShardedSoftmaxLoss(4, 10, devices=["cpu"] * len(sizes), shard_sizes=sizes, dtype=dtype)
    full = torch.randn(10, 4).to(dtype)
    with torch.no_grad():
        for offset, p in zip(head.class_offsets, head.weight_shards):
            p.copy_(full[offset : offset + p.shape[0]])
    out = shardkit.export_full_weight(head)
    assert out.dtype == dtype and out.shape == (10, 4) and not out.requires_grad
    assert torch.equal(out, full) and torch.equal(out, head.state_dict()["weight"])
    out.zero_()
    assert torch.equal(shardkit.export_full_weight(head), full)
    with pytest.raises(TypeError, match="argument `module` must be a shardkit.ShardedSoftmaxLoss .*got Linear"):
        shardkit.export_full_weight(torch.nn.Linear(4, 10))


def test_a_rank_refuses_mixed_momentum_in_files_it_reads_no_rows_from(tmp_path):
    # Rank 0 of 2 reads only the first file, which has momentum; the second file lacks it:
    # every rank refuses the checkpoint (a rank must not restore momentum the other cannot).
    num_classes, dim = 10, 4
    full, momentum = torch.randn(num_classes, dim), torch.randn(num_classes, dim)
    _save_world(full, 2, str(tmp_path), momentum)
    last = os.path.join(tmp_path, sorted(os.listdir(tmp_path))[-1])
    blob = torch.load(last, weights_only=True)
    del blob["momentum_buffer"], blob["momentum_seen"]
    torch.save(blob, last)
    for rank in range(2):
        head = _rank_head(num_classes, dim, 2, rank)
        before = head.weight_shards[0].detach().clone()
        opt = shardkit.SparseRowSGD(head.weight_shards, lr=0.1, momentum=0.9)
        with pytest.raises(ValueError, match="lacks the `momentum_buffer`") as err:
            shardkit.load_sharded(head, str(tmp_path), opt)
        assert repr(last) in str(err.value)
        assert torch.equal(head.weight_shards[0], before) and not opt.state


def test_a_parametrized_head_round_trips_its_own_state_dict():
    # With a parametrization on a shard (weight_norm, say) the state dict is torch's own (the
    # parametrizations' originals): it loads into a head parametrized alike; a class-ordered
    # `weight` offered to it is refused with an error saying why.
    from torch.nn.utils import parametrizations

    def make(seed):
        torch.manual_seed(seed)
        head = shardkit.ShardedSoftmaxLoss(8, 10, devices=["cpu"] * 2)
        parametrizations.weight_norm(head.weight_shards, name="0")
        return head

    src, dst = make(0), make(1)
    assert not torch.equal(src.full_weight(), dst.full_weight())
    dst.load_state_dict(src.state_dict())
    assert torch.equal(src.full_weight(), dst.full_weight())
    x, y = torch.randn(4, 8), torch.randint(0, 10, (4,))
    assert torch.equal(src(x, y), dst(x, y))
    with pytest.raises(RuntimeError, match="weight shards are\\s+parametrized"):
        make(2).load_state_dict(shardkit.ShardedSoftmaxLoss(8, 10, devices=["cpu"] * 2).state_dict())


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to stand for a full disk")
@pytest.mark.parametrize(
    "error", [RuntimeError("[enforce fail at inline_container.cc] disk full"), KeyboardInterrupt()]
)
def test_a_failed_write_leaves_no_partial_file_and_keeps_the_old_one(tmp_path, monkeypatch, error):
    # torch's writer raised a bare RuntimeError on a full disk and left the temporary file;
    # Ctrl-C during a save left a partial temporary file too.
    w = torch.randn(5, 4)
    path = save_shard_file(str(tmp_path), w, 0, 5)

    def failing_save(obj, f):
        f.write(b"partial")
        raise error

    monkeypatch.setattr(shard_files.torch, "save", failing_save)
    with pytest.raises(OSError if isinstance(error, RuntimeError) else KeyboardInterrupt):
        save_shard_file(str(tmp_path), w * 2, 0, 5)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]
    monkeypatch.undo()
    assert torch.equal(torch.load(path, weights_only=True)["weight"], w)
