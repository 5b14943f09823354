"""shardkit.parallel under faults and bad arguments: a PipelineModel call whose stage raises,
or a DataParallelModel call whose replica raises inside torch.utils.checkpoint, leaves nothing
behind (the next call equals the unsplit model in float64); devices PipelineModel cannot
compute on are refused before the caller's layers move, and `balance` / `sample` errors name
the argument."""

import copy
import os
import signal

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardkit.parallel import DataParallelModel, PipelineModel


class _Failing(nn.Module):
    """Tanh, or an exception while ``fail`` is set."""

    def __init__(self):
        super().__init__()
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("this stage fails on purpose")
        return torch.tanh(x)


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), _Failing(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


@pytest.mark.parametrize("ckpt", ["always", "except_last", "never"])
@pytest.mark.parametrize("balance", [[2, 3], [1, 4]])  # the failing layer on stage 0 (caller's thread) or 1 (a worker)
def test_a_failed_call_leaves_nothing_behind(ckpt, balance):
    ref = _net(int(torch.randint(0, 2**31, ()).item()))
    pipe = PipelineModel(copy.deepcopy(ref), ["cpu", "cpu"], chunks=3, balance=balance, checkpoint=ckpt)
    failing = next(m for m in pipe.modules() if isinstance(m, _Failing))
    x = torch.randn(7, 4, dtype=torch.float64)
    failing.fail = True
    stage = 0 if balance[0] >= 2 else 1
    for _ in range(2):
        with pytest.raises(RuntimeError, match="fails on purpose") as err:
            pipe(x)
        # the note names the task (the stage and micro-batch), not a position in the clock's task list
        assert f"call for stage {stage} (partitions[{stage}]), micro-batch 0 of 3" in " ".join(err.value.__notes__)
    failing.fail = False
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # no hooks left on this thread
    coef = torch.randn(7, 3, dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ref(x1) * coef).sum().backward()
    out = pipe(x2)
    (out * coef).sum().backward()
    torch.testing.assert_close(out, ref(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-12, atol=1e-12)
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    # work done on this thread afterwards is not saved into the failed call either
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    (w.exp() * 2).sum().backward()
    torch.testing.assert_close(w.grad, 2 * w.detach().exp())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(devices=["meta", "cpu"]), "argument `devices` must hold CPU or CUDA devices .*got meta"),
        (dict(devices=["cpu", "meta"]), "argument `devices` must hold CPU or CUDA devices .*got meta"),
        (dict(devices=["cpu", "bogus"]), "argument `devices`: not a device: 'bogus'"),
        (dict(output_device="meta"), "argument `output_device` must be a CPU or CUDA device .*got meta"),
        (dict(output_device="cuda:7"), "argument `output_device`"),
    ],
)
def test_devices_it_cannot_compute_on_are_refused_before_the_layers_move(kwargs, match):
    model = _net(1)
    before = copy.deepcopy(model.state_dict())
    args = dict(devices=["cpu", "cpu"])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        PipelineModel(model, **args)
    for key, value in model.state_dict().items():  # the caller's layers: where and what they were
        assert value.device.type == "cpu" and torch.equal(value, before[key]), key


@pytest.mark.parametrize("balance", [3, 2.0, {"a": 1}])
def test_balance_of_the_wrong_type_is_named(balance):
    with pytest.raises(TypeError, match="argument `balance` must be a list of ints"):
        PipelineModel(_net(2), ["cpu", "cpu"], balance=balance)


@pytest.mark.parametrize("by", ["time", "memory"])
@pytest.mark.parametrize(
    "sample, match",
    [
        (torch.randn(5, 3, dtype=torch.float64), "shape \\(5, 3\\).*layer 0 \\(Linear\\) raised RuntimeError"),
        (torch.randn(5, 4), "torch.float32.*layer 0 \\(Linear\\) raised RuntimeError"),
        (torch.randn(0, 4, dtype=torch.float64), "non-empty batch"),
        (torch.tensor(1.0, dtype=torch.float64), "non-empty batch"),
    ],
)
def test_a_sample_the_layers_cannot_take_is_named(by, sample, match):
    with pytest.raises(ValueError, match=f"argument `sample`.*{match}"):
        PipelineModel(_net(3), ["cpu", "cpu"], balance=by, sample=sample)
    with pytest.raises(ValueError, match=f"argument `sample`.*{match}"):
        PipelineModel.balance_by(_net(3), sample, 2, by=by)


@pytest.mark.parametrize("by", ["time", "memory"])
def test_profiling_leaves_the_layers_and_the_random_state_as_they_were(by):
    torch.manual_seed(int(torch.randint(0, 2**31, ()).item()))
    model = nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Tanh(), nn.Linear(6, 3), nn.BatchNorm1d(3)
    ).double()
    model(torch.randn(9, 4, dtype=torch.float64)).sum().backward()  # some gradients and statistics to keep
    state = copy.deepcopy(model.state_dict())
    grads = [p.grad.clone() for p in model.parameters()]
    sample = torch.randn(8, 4, dtype=torch.float64) * 5 + 3
    rng = torch.get_rng_state()
    plan = PipelineModel.balance_by(model, sample, 2, by=by)
    assert sum(plan) == 6
    for key, value in model.state_dict().items():  # BatchNorm's running statistics and counters
        assert torch.equal(value, state[key]), key
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)
    assert torch.equal(torch.get_rng_state(), rng)


class _CheckpointedNet(nn.Module):
    """A user model that recomputes its body (torch.utils.checkpoint), failing on a chunk size."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)
        self.fail_on = None

    def body(self, x):
        if x.shape[0] == self.fail_on:
            raise RuntimeError("this replica fails on purpose")
        return torch.tanh(self.a(x))

    def forward(self, x):
        return self.b(checkpoint(self.body, x, use_reentrant=False))


@pytest.mark.parametrize("fail_on", [4, 3])  # chunks of 4 and 3: the caller's thread, or a worker's
def test_a_data_parallel_call_that_failed_inside_a_checkpoint_leaves_nothing_behind(fail_on):
    torch.manual_seed(int(torch.randint(0, 2**31, ()).item()))
    net = _CheckpointedNet().double()
    ref = copy.deepcopy(net)
    model = DataParallelModel(net, device_ids=["cpu"] * 2)
    x = torch.randn(7, 4, dtype=torch.float64)
    net.fail_on = fail_on
    for _ in range(2):
        with pytest.raises(RuntimeError, match="fails on purpose"):
            model(x)
    net.fail_on = None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    out = torch.cat(model(x))
    coef = torch.randn(7, 3, dtype=torch.float64)
    (out * coef).sum().backward()
    (ref(x) * coef).sum().backward()
    torch.testing.assert_close(out, ref(x), rtol=1e-12, atol=1e-12)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("which", ["whole", "block"])
def test_a_compiled_module_is_refused_before_it_is_changed(which):
    # The shallow copy of an OptimizedModule writes through to the module it wraps: the
    # replicas took the user's parameters away (a block left without its weight, or a model
    # that contained itself) and then failed with a bare KeyError.
    from shardkit.parallel import DataParallelCriterion

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(4, 6)
    expected = net(x)
    if which == "block":
        net[0] = torch.compile(net[0], backend="eager")
        wrapped, name = net, "its sub-module '0'"
    else:
        wrapped, name = torch.compile(net, backend="eager"), "the module"
    model = DataParallelModel(wrapped, device_ids=["cpu", "cpu"])
    with pytest.raises(TypeError, match=f"DataParallelModel: {name} is a torch.compile'd module"):
        model(x)
    after = net.state_dict()
    assert {k.replace("_orig_mod.", "") for k in after} == set(before)
    assert all(torch.equal(v, before[k.replace("_orig_mod.", "")]) for k, v in after.items())
    assert torch.equal(net(x), expected)
    weighted = torch.compile(nn.CrossEntropyLoss(weight=torch.ones(3)), backend="eager")
    crit = DataParallelCriterion(weighted, device_ids=["cpu", "cpu"])
    with pytest.raises(TypeError, match="DataParallelCriterion: the module is a torch.compile'd module"):
        crit([torch.randn(2, 3), torch.randn(2, 3)], torch.tensor([0, 1, 2, 0]))
    assert weighted._orig_mod.weight is not None


def test_a_sharded_head_with_return_details_is_refused_by_name():
    # The details (a per-row lse among them) were taken for unreduced per-sample losses.
    import shardkit
    from shardkit.parallel import DataParallelCriterion

    head = shardkit.ShardedSoftmaxLoss(8, 10, devices=["cpu"] * 2)
    crit = DataParallelCriterion(head, device_ids=["cpu", "cpu"])
    x, y = torch.randn(6, 8), torch.randint(0, 10, (6,))
    with pytest.raises(ValueError, match="`return_details=True` is not supported"):
        crit([x[:3], x[3:]], y, return_details=True)
    assert torch.allclose(crit([x[:3], x[3:]], y), head(x, y))


def test_a_dim_no_input_has_is_named():
    model = DataParallelModel(nn.Linear(4, 2), device_ids=["cpu", "cpu"], dim=5)
    with pytest.raises(ValueError, match="argument `dim`=5"):
        model(torch.randn(6, 4))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
def test_a_process_forked_after_a_call_can_call_again():
    # The child inherited the worker slots without their threads: its next call waited forever.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh()).double()
    dp = DataParallelModel(net, device_ids=["cpu"] * 3)
    x = torch.randn(9, 4, dtype=torch.float64)
    first = torch.cat(dp(x))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a call, its result through the pipe, then out without cleanup
        code = 1
        try:
            signal.alarm(60)  # a hang ends the child, and the test fails on its exit status
            again = torch.cat(dp(x))
            os.write(write, b"same" if torch.equal(again, first) else b"diff")
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    answer = os.read(read, 16)
    os.close(read)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the child ended with status {status}"
    assert answer == b"same"
    assert torch.equal(torch.cat(dp(x)), first)  # and the parent's threads still serve it
