"""Loading checks of the sharded head's checkpoints and of SparseRowSGD's state: a bad
entry raises a TypeError / ValueError naming the argument, file, param group or key when it
is loaded, and leaves the object exactly as it was (never a failure at the next step, never
a silent load); valid states (a torch.optim.SGD one, a re-sharded checkpoint) still load."""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import shardkit
from shardkit.softmax.checkpoint import save_shard_file

# ---- SparseRowSGD.load_state_dict ----


def _stepped_sgd(groups=1):
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(groups)]
    opt = shardkit.SparseRowSGD([{"params": [p]} for p in params], lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones(5, 3)
    opt.step()
    return params, opt


def _snapshot(opt):
    return copy.deepcopy(opt.state_dict())


def _assert_same(a, b):
    """Two optimizer state_dicts (or nested parts) equal: tensors bit for bit, dtypes too."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize(
    "change, error, names",
    [
        ({"momentum": 5.0}, ValueError, "`momentum`"),
        ({"lr": -3.0}, ValueError, "`lr`"),
        ({"lr": "x"}, TypeError, "`lr`"),
        ({"lr": float("nan")}, ValueError, "`lr`"),
        ({"dampening": 2.0}, ValueError, "`dampening`"),
        ({"weight_decay": -1.0}, ValueError, "`weight_decay`"),
        ({"nesterov": 1}, TypeError, "`nesterov`"),
        ({"nesterov": True, "dampening": 0.5}, ValueError, "`nesterov`"),
        ({"momentum": True}, TypeError, "`momentum`"),
    ],
)
def test_sgd_load_refuses_hyperparameters_the_constructor_refuses(change, error, names):
    _, opt = _stepped_sgd(groups=2)
    saved, before = _snapshot(opt), _snapshot(opt)
    saved["param_groups"][1].update(change)
    with pytest.raises(error, match="argument `state_dict`, param group 1") as err:
        opt.load_state_dict(saved)
    assert names in str(err.value)
    _assert_same(opt.state_dict(), before)


def test_sgd_load_refuses_a_missing_hyperparameter():
    _, opt = _stepped_sgd()
    saved, before = _snapshot(opt), _snapshot(opt)
    del saved["param_groups"][0]["lr"]
    with pytest.raises(ValueError, match=r"param group 0: lacks the hyper-parameter\(s\) `lr`"):
        opt.load_state_dict(saved)
    _assert_same(opt.state_dict(), before)


def _bad_states():
    ok_seen = torch.ones(5, dtype=torch.bool)
    return [
        (
            {"momentum_buffer": torch.zeros(4, 3), "seen": torch.ones(4, dtype=torch.bool)},
            ValueError,
            "momentum_buffer",
        ),
        ({"momentum_buffer": torch.zeros(5, 3, 1), "seen": ok_seen}, ValueError, "momentum_buffer"),
        ({"momentum_buffer": torch.zeros(15)}, ValueError, "momentum_buffer"),
        ({"momentum_buffer": "x"}, TypeError, "momentum_buffer"),
        ({"momentum_buffer": torch.zeros(5, 3, dtype=torch.long), "seen": ok_seen}, TypeError, "momentum_buffer"),
        ({"momentum_buffer": torch.zeros(5, 3, dtype=torch.complex64)}, TypeError, "momentum_buffer"),
        ({"momentum_buffer": torch.zeros(5, 3).to_sparse(), "seen": ok_seen}, TypeError, "momentum_buffer"),
        ({"momentum_buffer": torch.zeros(5, 3), "seen": torch.ones(4, dtype=torch.bool)}, ValueError, "`seen`"),
        ({"momentum_buffer": torch.zeros(5, 3), "seen": torch.ones(5, 1, dtype=torch.bool)}, ValueError, "`seen`"),
        ({"momentum_buffer": torch.zeros(5, 3), "seen": torch.rand(5)}, TypeError, "`seen`"),
        ({"momentum_buffer": torch.zeros(5, 3), "seen": torch.tensor([0, 1, 2, 1, 0])}, ValueError, "`seen`"),
        ({"momentum_buffer": torch.zeros(5, 3), "seen": [True] * 5}, TypeError, "`seen`"),
        ({"momentum_buffer": torch.zeros(5, 3), "seen": None}, TypeError, "`seen`"),
        ("x", TypeError, "the state must be a dict"),
    ]


@pytest.mark.parametrize("entry, error, key", _bad_states())
def test_sgd_load_refuses_a_bad_state_entry(entry, error, key):
    params, opt = _stepped_sgd(groups=2)
    saved, before = _snapshot(opt), _snapshot(opt)
    saved["state"][1] = entry
    with pytest.raises(error, match=r"argument `state_dict`, param group 1, parameter 0 \(state key 1") as err:
        opt.load_state_dict(saved)
    assert key in str(err.value)
    _assert_same(opt.state_dict(), before)
    assert opt.state[params[1]]["seen"].dtype == torch.bool  # the live state, as it was
    for p in params:  # and it still steps
        p.grad = torch.ones(5, 3)
    opt.step()


def test_sgd_load_refuses_other_group_layouts_naming_them():
    _, opt = _stepped_sgd(groups=2)
    before = _snapshot(opt)
    saved = _snapshot(opt)
    saved["param_groups"] = saved["param_groups"][:1]
    with pytest.raises(ValueError, match="argument `state_dict` holds 1 param groups, this optimizer 2"):
        opt.load_state_dict(saved)
    saved = _snapshot(opt)
    saved["param_groups"][0]["params"] = [0, 7]
    with pytest.raises(ValueError, match="param group 0: holds 2 parameters, this optimizer's group 1"):
        opt.load_state_dict(saved)
    saved = _snapshot(opt)
    saved["param_groups"][1] = "x"
    with pytest.raises(TypeError, match="param group 1: must be a dict"):
        opt.load_state_dict(saved)
    _assert_same(opt.state_dict(), before)


def test_sgd_load_converts_integer_seen_flags():
    params, opt = _stepped_sgd()
    saved = _snapshot(opt)
    saved["state"][0]["seen"] = torch.tensor([1, 0, 1, 1, 0])
    other = shardkit.SparseRowSGD([torch.nn.Parameter(params[0].detach().clone())], lr=0.1, momentum=0.9)
    other.load_state_dict(saved)
    (p,) = other.param_groups[0]["params"]
    assert other.state[p]["seen"].dtype == torch.bool
    assert other.state[p]["seen"].tolist() == [True, False, True, True, False]


def test_sgd_load_of_a_momentum_free_torch_sgd_state_with_a_tensor_lr():
    # (a torch.optim.SGD state with momentum: test_softmax_optim.py's resume test)
    # momentum 0: SGD's None buffer starts fresh; a tensor lr loads
    w_ref = torch.nn.Parameter(torch.randn(6, 3, dtype=torch.float64))
    w = torch.nn.Parameter(w_ref.detach().clone())
    grads = [torch.randn(6, 3, dtype=torch.float64) for _ in range(2)]
    plain = torch.optim.SGD([w_ref], lr=torch.tensor(0.05))
    w_ref.grad = grads[0].clone()
    plain.step()
    opt = shardkit.SparseRowSGD([w], lr=0.1)
    opt.load_state_dict(plain.state_dict())
    assert "momentum_buffer" not in opt.state[w]
    w.grad = grads[1].clone()
    opt.step()


# ---- load_sharded / save_sharded: the momentum entries of the shard files ----


def _trained_head(tmp_path, shards=2, name="ck"):
    head = shardkit.ShardedSoftmaxLoss(8, 10, devices=["cpu"] * shards)
    opt = shardkit.SparseRowSGD(head.parameters(), lr=0.1, momentum=0.9)
    head(torch.randn(6, 8), torch.arange(6)).backward()
    opt.step()
    directory = str(tmp_path / name)
    shardkit.save_sharded(head, directory, opt)
    return head, opt, directory


def _fresh(shards=3):
    head = shardkit.ShardedSoftmaxLoss(8, 10, devices=["cpu"] * shards)
    opt = shardkit.SparseRowSGD(head.parameters(), lr=0.1, momentum=0.9)
    head(torch.randn(4, 8), torch.arange(4)).backward()
    opt.step()  # some state to keep
    return head, opt


def _files(directory):
    return [os.path.join(directory, f) for f in sorted(os.listdir(directory))]


def _edit(path, **entries):
    blob = torch.load(path, weights_only=True)
    blob.update(entries)
    torch.save(blob, path)


def _assert_load_refused(head, opt, directory, error, *names):
    weights, state = head.full_weight().clone(), _snapshot(opt)
    with pytest.raises(error) as err:
        shardkit.load_sharded(head, directory, opt)
    for name in names:
        assert name in str(err.value), (name, str(err.value))
    assert torch.equal(head.full_weight(), weights)
    _assert_same(opt.state_dict(), state)
    return err


@pytest.mark.parametrize(
    "entries, key",
    [
        ({"momentum_buffer": torch.randn(5, 7)}, "momentum_buffer"),  # wrong width
        ({"momentum_buffer": torch.randn(5)}, "momentum_buffer"),  # 1-D
        ({"momentum_buffer": torch.ones(5, 8, dtype=torch.long)}, "momentum_buffer"),
        ({"momentum_buffer": "x"}, "momentum_buffer"),
        ({"momentum_seen": torch.rand(5)}, "momentum_seen"),  # float flags
        ({"momentum_seen": torch.ones(5, 1, dtype=torch.bool)}, "momentum_seen"),  # 2-D
        ({"momentum_seen": torch.full((5,), 3)}, "momentum_seen"),
        ({"weight": torch.ones(5, 8, dtype=torch.bool)}, "`weight`"),
        ({"weight": torch.ones(5, 8, dtype=torch.long)}, "`weight`"),
        ({"weight": torch.ones(5, 8, dtype=torch.complex64)}, "`weight`"),
    ],
)
@pytest.mark.parametrize("which", [0, 1])
def test_load_sharded_refuses_a_bad_entry_naming_the_file(tmp_path, entries, key, which):
    _, _, directory = _trained_head(tmp_path)
    path = _files(directory)[which]
    _edit(path, **entries)
    head, opt = _fresh()
    # the last file is bad: the first shard, whose rows come before it, must not have loaded either
    _assert_load_refused(head, opt, directory, ValueError, repr(path), key)


def test_save_and_load_sharded_check_their_arguments(tmp_path):
    head, opt, directory = _trained_head(tmp_path)
    adamw = torch.optim.AdamW(head.parameters())  # its state is not SGD's momentum: refused, untouched
    for bad, says in (
        ("sgd", "must be a torch.optim.Optimizer"),
        (torch.nn.Linear(2, 2), "must be a torch.optim.Optimizer"),
        (adamw, "must be shardkit.SparseRowSGD or torch.optim.SGD .*got AdamW"),
    ):
        with pytest.raises(TypeError, match=f"argument `optimizer` {says}"):
            shardkit.save_sharded(head, str(tmp_path / "new"), bad)
        weights = head.full_weight().clone()
        with pytest.raises(TypeError, match=f"argument `optimizer` {says}"):
            shardkit.load_sharded(head, directory, bad)
        assert torch.equal(head.full_weight(), weights)
    assert not adamw.state
    sgd = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)  # torch's SGD: the same momentum
    shardkit.load_sharded(head, directory, sgd)
    assert all(sgd.state[p]["momentum_buffer"].shape == p.shape for p in head.parameters())
    assert not os.path.exists(tmp_path / "new")
    for bad in (None, 5):
        with pytest.raises(TypeError, match="argument `directory` must be a path"):
            shardkit.save_sharded(head, bad)
        with pytest.raises(TypeError, match="argument `directory` must be a path"):
            shardkit.load_sharded(head, bad)


@pytest.mark.parametrize(
    "state, key",
    [
        ({"seen": torch.rand(4)}, "`seen`"),
        ({"momentum_buffer": torch.zeros(4, 7)}, "`momentum_buffer`"),
        ({"momentum_buffer": "x"}, "`momentum_buffer`"),
    ],
)
def test_save_sharded_refuses_a_bad_optimizer_state_writing_nothing(tmp_path, state, key):
    head, opt = _fresh(shards=3)
    p = head.weight_shards[2]
    opt.state[p].update(state)
    with pytest.raises(
        (TypeError, ValueError), match=r"argument `optimizer`: the state of shard 2 \(classes \[7, 10\)\)"
    ):
        shardkit.save_sharded(head, str(tmp_path / "x"), opt)
    assert not os.path.exists(tmp_path / "x")


def test_save_and_load_sharded_name_an_optimizer_without_the_shards(tmp_path):
    trained, _, directory = _trained_head(tmp_path)
    head, opt = _fresh()
    other = shardkit.SparseRowSGD([torch.nn.Parameter(torch.randn(3))], lr=0.1, momentum=0.9)
    weights = head.full_weight().clone()
    with pytest.raises(ValueError, match="argument `optimizer` does not optimize shard 0 of `module`"):
        shardkit.load_sharded(head, directory, other)
    assert torch.equal(head.full_weight(), weights) and not other.state
    # saving with it (e.g. the backbone's optimizer) used to write no momentum, silently
    with pytest.raises(ValueError, match="argument `optimizer` does not optimize shard 0 of `module`"):
        shardkit.save_sharded(trained, str(tmp_path / "other"), other)
    assert not os.path.exists(tmp_path / "other")


def test_resharded_checkpoints_with_momentum_still_round_trip(tmp_path):
    head, opt, directory = _trained_head(tmp_path, shards=2)
    buf = torch.cat([opt.state[p]["momentum_buffer"] for p in head.weight_shards])
    seen = torch.cat([opt.state[p]["seen"] for p in head.weight_shards])
    for shards in (1, 3, 4):
        other, other_opt = _fresh(shards)
        shardkit.load_sharded(other, directory, other_opt)
        assert torch.equal(other.full_weight(), head.full_weight())
        assert torch.equal(torch.cat([other_opt.state[p]["momentum_buffer"] for p in other.weight_shards]), buf)
        got = torch.cat([other_opt.state[p]["seen"] for p in other.weight_shards])
        assert got.dtype == torch.bool and torch.equal(got, seen)
        shardkit.save_sharded(other, str(tmp_path / f"m{shards}"), other_opt)
        back, back_opt = _fresh(2)
        shardkit.load_sharded(back, str(tmp_path / f"m{shards}"), back_opt)
        assert torch.equal(back.full_weight(), head.full_weight())
        assert torch.equal(torch.cat([back_opt.state[p]["momentum_buffer"] for p in back.weight_shards]), buf)
    # a torch.optim.SGD's buffers save (seen: all True), and 0/1 integer flags load as bool
    sgd = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    head(torch.randn(6, 8), torch.arange(6)).backward()
    sgd.step()
    shardkit.save_sharded(head, str(tmp_path / "sgd"), sgd)
    path = _files(str(tmp_path / "sgd"))[0]
    _edit(path, momentum_seen=torch.tensor([1, 0, 1, 1, 1]))
    other, other_opt = _fresh(1)
    shardkit.load_sharded(other, str(tmp_path / "sgd"), other_opt)
    assert other_opt.state[other.weight_shards[0]]["seen"].tolist() == [True, False] + [True] * 8
    save_shard_file(
        str(tmp_path / "int"), torch.randn(10, 8), 0, 10, torch.randn(10, 8), torch.ones(10, dtype=torch.int)
    )
    assert torch.load(_files(str(tmp_path / "int"))[0], weights_only=True)["momentum_seen"].dtype == torch.bool


# ---- the head's load_state_dict ----


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.complex64])
@pytest.mark.parametrize("shards", [1, 3])
def test_head_load_refuses_a_non_floating_weight_naming_the_key(dtype, shards):
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), shardkit.ShardedSoftmaxLoss(8, 10, devices=["cpu"] * shards))
    head = net[1]
    before = head.full_weight().clone()
    with pytest.raises(TypeError, match=rf"`weight` must be floating point, got {dtype}"):
        head.load_state_dict({"weight": torch.ones(10, 8, dtype=dtype)})
    state = net.state_dict()
    state["1.weight"] = state["1.weight"].to(dtype)
    with pytest.raises(TypeError, match=r"`1\.weight` must be floating point"):
        net.load_state_dict(state)
    key = f"weight_shards.{shards - 1}"
    per_shard = {f"weight_shards.{k}": p.detach().clone() for k, p in enumerate(head.weight_shards)}
    per_shard[key] = per_shard[key].to(dtype)
    with pytest.raises(TypeError, match=rf"`{key}` must be floating point"):
        head.load_state_dict(per_shard)
    assert torch.equal(head.full_weight(), before)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_head_load_refuses_sparse_and_meta_weights_naming_the_key():
    head = shardkit.ShardedSoftmaxLoss(8, 10, devices=["cpu"] * 3)
    before = head.full_weight().clone()
    for bad in (torch.randn(10, 8).to_sparse(), torch.randn(10, 8).to_sparse_csr(), torch.empty(10, 8, device="meta")):
        with pytest.raises(TypeError, match=r"`weight` must be a dense tensor with data"):
            head.load_state_dict({"weight": bad})
    assert torch.equal(head.full_weight(), before)


def test_head_load_refuses_both_forms_naming_the_keys():
    head = shardkit.ShardedSoftmaxLoss(8, 10, devices=["cpu"] * 3)
    before = head.full_weight().clone()
    bad = {"weight": torch.randn(10, 8), "weight_shards.0": torch.full((4, 8), 123.0)}
    with pytest.raises(ValueError, match=r"holds both `weight` \(the class-ordered form\) and `weight_shards\.0`"):
        head.load_state_dict(bad)
    with pytest.raises(ValueError, match="holds both"):
        head.load_state_dict(bad, strict=False)
    assert torch.equal(head.full_weight(), before)


def test_head_per_shard_load_is_all_or_none():
    head = shardkit.ShardedSoftmaxLoss(8, 10, devices=["cpu"] * 3)
    before = head.full_weight().clone()
    per_shard = {f"weight_shards.{k}": torch.zeros_like(p) for k, p in enumerate(head.weight_shards)}
    per_shard["weight_shards.2"] = torch.zeros(4, 8)  # the shard holds 3 rows
    with pytest.raises(RuntimeError, match=r"size mismatch for weight_shards\.2") as err:
        head.load_state_dict(per_shard)
    assert "weight_shards.0" not in str(err.value)
    assert torch.equal(head.full_weight(), before)  # shard 0 and 1 kept theirs too


def test_head_valid_loads_still_work():
    head = shardkit.ShardedSoftmaxLoss(8, 10, devices=["cpu"] * 3)
    full = torch.randn(10, 8, dtype=torch.float64)
    head.load_state_dict({"weight": full})  # cast to the shards' dtype
    assert torch.equal(head.full_weight(), full.float())
    other = shardkit.ShardedSoftmaxLoss(8, 10, devices=["cpu"] * 2)
    other.load_state_dict(head.state_dict())
    assert torch.equal(other.full_weight(), head.full_weight())
    per_shard = {f"weight_shards.{k}": torch.full_like(p, float(k)) for k, p in enumerate(head.weight_shards)}
    head.load_state_dict(per_shard)
    assert head.full_weight()[:, 0].tolist() == [0.0] * 4 + [1.0] * 3 + [2.0] * 3


def test_distributed_head_load_checks_the_dtype(tmp_path):
    # One gloo rank (world size 1) in a child process: the rank's `weight_shards.0`.
    script = textwrap.dedent(
        f"""
        import os, torch, torch.distributed as dist, shardkit
        dist.init_process_group("gloo", init_method="file://{tmp_path / "store"}", rank=0, world_size=1)
        head = shardkit.ShardedSoftmaxLoss(4, 10, process_group=dist.group.WORLD)
        before = head.weight_shards[0].detach().clone()
        for bad in (torch.ones(10, 4, dtype=torch.bool), torch.randn(10, 4).to_sparse()):
            try:
                head.load_state_dict({{"weight_shards.0": bad}})
                print("accepted")
            except TypeError as err:
                print("TypeError", err)
        assert torch.equal(head.weight_shards[0], before)
        head.load_state_dict({{"weight_shards.0": torch.ones(10, 4, dtype=torch.float64)}})
        assert torch.equal(head.weight_shards[0], torch.ones(10, 4))
        print("ok")
        dist.destroy_process_group()
        os._exit(0)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("TypeError") and "`weight_shards.0` must be floating point" in lines[0]
    assert lines[1].startswith("TypeError") and "`weight_shards.0` must be a dense tensor" in lines[1]
    assert lines[2] == "ok"


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("given", [[0], [1], [0, 2]])
def test_head_refuses_a_partial_set_of_per_shard_entries(strict, given):
    # "per-shard entries load all or none" (docs/errors.md): a partial set is refused even with
    # strict=False, naming the missing keys, and no shard is loaded (shard 0 was overwritten).
    head = shardkit.ShardedSoftmaxLoss(8, 10, devices=["cpu"] * 3)
    before = head.full_weight().clone()
    partial = {f"weight_shards.{k}": torch.zeros_like(head.weight_shards[k]) for k in given}
    with pytest.raises(RuntimeError, match="all or none") as err:
        head.load_state_dict(partial, strict=strict)
    for k in range(3):
        assert (f'"weight_shards.{k}"' in str(err.value).split("(given")[0]) == (k not in given)
    assert torch.equal(head.full_weight(), before)


def test_head_partial_per_shard_entries_under_a_prefix():
    model = torch.nn.Sequential(torch.nn.Identity(), shardkit.ShardedSoftmaxLoss(8, 10, devices=["cpu"] * 2))
    before = model[1].full_weight().clone()
    with pytest.raises(RuntimeError, match=r'missing key\(s\) "1\.weight_shards\.1"'):
        model.load_state_dict({"1.weight_shards.0": torch.zeros(5, 8)}, strict=False)
    assert torch.equal(model[1].full_weight(), before)


@pytest.mark.parametrize("which", [0, 1])
def test_load_sharded_refuses_momentum_in_some_files_only(tmp_path, which):
    # One file without `momentum_buffer` / `momentum_seen`: restoring the momentum of some
    # shards only went unnoticed (1 of 3 shards).
    _, _, directory = _trained_head(tmp_path)
    path = _files(directory)[which]
    blob = torch.load(path, weights_only=True)
    del blob["momentum_buffer"], blob["momentum_seen"]
    torch.save(blob, path)
    head, opt = _fresh()
    err = _assert_load_refused(head, opt, directory, ValueError, repr(path), "momentum_buffer")
    assert repr(_files(directory)[1 - which]) in str(err.value)
    shardkit.load_sharded(head, directory)  # without an optimizer the momentum is not read: the weights load


def test_load_sharded_refuses_momentum_added_to_one_file_of_a_checkpoint_without(tmp_path):
    head0 = shardkit.ShardedSoftmaxLoss(8, 10, devices=["cpu"] * 2)
    directory = str(tmp_path / "ck")
    shardkit.save_sharded(head0, directory)
    path = _files(directory)[1]
    _edit(path, momentum_buffer=torch.randn(5, 8), momentum_seen=torch.ones(5, dtype=torch.bool))
    head, opt = _fresh()
    _assert_load_refused(head, opt, directory, ValueError, repr(path), repr(_files(directory)[0]))
