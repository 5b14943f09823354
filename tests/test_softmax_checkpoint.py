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
