"""PipelineModel against the unsplit model where client code found it wrong: a layer held
twice in the Sequential, torch.func transforms and dispatch modes over the worker threads,
the caller's own model after the in-place BatchNorm conversion, the training/eval switch
between forward and backward with checkpointing, a BatchNorm used twice per forward."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from shardkit.parallel import DataParallelModel, PipelineModel
from shardkit.parallel.pipeline_bn import DeferredBatchNorm, DeferredBatchNorm2d
from shardkit.parallel.pipeline_tasks import check_shared


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def test_a_layer_held_twice_runs_at_each_place():
    act = nn.Tanh()  # one activation module reused: 6 positions, 4 distinct modules
    ref = nn.Sequential(nn.Linear(4, 6), act, nn.Linear(6, 6), act, nn.Linear(6, 3), act).double()
    pipe = PipelineModel(copy.deepcopy(ref), ["cpu", "cpu"], chunks=2)
    assert sum(pipe.balance) == 6
    x = _x(5, 4)

    def by_micro_batch(model, x):  # bit-exact: a matmul's rounding may depend on its row count
        return torch.cat([model(c) for c in x.tensor_split(2)])

    torch.testing.assert_close(pipe(x), by_micro_batch(ref, x), rtol=0, atol=0)
    lin = nn.Linear(4, 4)  # a tied layer, in two stages on one device
    ref = nn.Sequential(lin, nn.ReLU(), lin).double()
    pipe = PipelineModel(copy.deepcopy(ref), ["cpu", "cpu"], chunks=2, balance=[2, 1])
    torch.testing.assert_close(pipe(x), by_micro_batch(ref, x), rtol=0, atol=0)


def test_a_tensor_shared_by_stages_on_two_devices_is_refused():
    lin = nn.Linear(4, 4)
    layers = [lin, nn.ReLU(), lin]
    with pytest.raises(ValueError, match=r"argument `stages`: the tensor at layer '0.weight' of stage 0 .* stage 1"):
        check_shared(layers, [2, 1], [torch.device("cpu"), torch.device("cuda", 0)])
    check_shared(layers, [2, 1], [torch.device("cpu"), torch.device("cpu")])  # one device: fine


def test_torch_func_transforms_and_modes_see_every_stage():
    # Stages ran on worker threads, outside the caller's functorch transform and modes:
    # torch.func.grad was off by 0.32 and FlopCounterMode counted half the FLOPs.
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    pipe = PipelineModel(copy.deepcopy(ref), ["cpu", "cpu"], chunks=2)
    x = _x(4, 4)
    g_ref = torch.func.grad(lambda i: ref(i).pow(2).sum())(x)
    torch.testing.assert_close(torch.func.grad(lambda i: pipe(i).pow(2).sum())(x), g_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.func.jacrev(pipe)(x), torch.func.jacrev(ref)(x), rtol=1e-12, atol=1e-12)
    params = {k: v.detach() for k, v in pipe.named_parameters()}
    ref_params = {k: v.detach() for k, v in ref.named_parameters()}
    gp = torch.func.grad(lambda p: torch.func.functional_call(pipe, p, (x,)).pow(2).sum())(params)
    gr = torch.func.grad(lambda p: torch.func.functional_call(ref, p, (x,)).pow(2).sum())(ref_params)
    for a, b in zip(gp.values(), gr.values()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    counts = []
    for model in (ref, pipe):
        with FlopCounterMode(display=False) as counter:
            model(_x(64, 4)).sum().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0
    with torch.autograd.graph.save_on_cpu():  # saved-tensor hooks: the same gradients
        xx = x.clone().requires_grad_()
        pipe(xx).pow(2).sum().backward()
    torch.testing.assert_close(xx.grad, g_ref, rtol=1e-12, atol=1e-12)


def test_the_callers_model_stays_batchnorm_after_the_conversion():
    torch.manual_seed(1)
    backbone = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1)).double()
    ref = copy.deepcopy(backbone)
    pipe = PipelineModel(backbone, ["cpu", "cpu"], chunks=4)
    assert isinstance(backbone[1], nn.BatchNorm2d) and isinstance(backbone[1], DeferredBatchNorm)
    x = _x(8, 3, 6, 6)
    pipe(x)
    ref(x)
    for _ in range(3):  # called directly: plain BatchNorm (was: an update every 4th call)
        x = _x(8, 3, 6, 6)
        torch.testing.assert_close(backbone(x), ref(x), rtol=1e-12, atol=1e-12)
    assert int(backbone[1].num_batches_tracked) == int(ref[1].num_batches_tracked) == 4
    torch.testing.assert_close(backbone[1].running_mean, ref[1].running_mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(backbone[1].running_var, ref[1].running_var, rtol=1e-10, atol=1e-12)
    micro = PipelineModel(backbone, ["cpu", "cpu"], chunks=4, batchnorm="micro")  # re-wrapped
    micro(_x(8, 3, 6, 6))
    assert int(backbone[1].num_batches_tracked) == 4 + 4  # every micro-batch updates
    bn_first = PipelineModel(nn.Sequential(nn.BatchNorm2d(3), nn.ReLU()).double(), ["cpu", "cpu"], chunks=2)
    with pytest.raises(ValueError, match="expected 4D input"):  # BatchNorm2d's own input check
        bn_first(_x(8, 3))
    copied = pickle.loads(pickle.dumps(backbone))
    assert type(copied[1]) is DeferredBatchNorm2d


@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
def test_eval_between_forward_and_backward_keeps_the_training_gradients(checkpoint):
    torch.manual_seed(2)
    ref = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = _x(8, 4)
    expected = None
    for ckpt in ("never", checkpoint):
        pipe = PipelineModel(copy.deepcopy(ref), ["cpu", "cpu"], chunks=2, checkpoint=ckpt)
        xx = x.clone().requires_grad_()
        loss = pipe(xx).pow(2).sum()
        pipe.eval()  # e.g. a validation hook between forward and backward
        loss.backward()
        assert not any(m.training for m in pipe.modules())  # the switch itself is kept
        if expected is None:
            expected = xx.grad
        else:
            torch.testing.assert_close(xx.grad, expected, rtol=1e-10, atol=1e-12)


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(self.bn(x)) * 3 + 5)  # one BatchNorm, two uses


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_batchnorm_used_twice_updates_once_per_use_as_unsplit(checkpoint):
    torch.manual_seed(3)
    ref = nn.Sequential(_Twice(), nn.Tanh(), nn.Linear(4, 2)).double()
    pipe = PipelineModel(copy.deepcopy(ref), ["cpu", "cpu"], chunks=1, checkpoint=checkpoint)
    for _ in range(3):
        x = _x(8, 4) * 2 + 1
        pipe(x).sum().backward()
        ref(x).sum().backward()
    bn = pipe.partitions[0][0].bn
    assert int(bn.num_batches_tracked) == int(ref[0].bn.num_batches_tracked) == 6
    torch.testing.assert_close(bn.running_mean, ref[0].bn.running_mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(bn.running_var, ref[0].bn.running_var, rtol=1e-10, atol=1e-12)
    pipe4 = PipelineModel(copy.deepcopy(ref), ["cpu", "cpu"], chunks=4)  # micro-batches merged per use
    before = int(pipe4.partitions[0][0].bn.num_batches_tracked)
    pipe4(_x(8, 4))
    assert int(pipe4.partitions[0][0].bn.num_batches_tracked) == before + 2


def test_a_failed_step_updates_the_uses_that_saw_every_micro_batch():
    class FailOnSecondCall(nn.Module):
        calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("boom")
            return x

    torch.manual_seed(4)
    model = nn.Sequential(nn.BatchNorm1d(4), FailOnSecondCall(), nn.Linear(4, 4), nn.BatchNorm1d(4)).double()
    pipe = PipelineModel(model, ["cpu", "cpu"], chunks=2, balance=[2, 2])
    with pytest.raises(RuntimeError, match="boom"):  # micro-batch 1 fails after the first BatchNorm
        pipe(_x(8, 4))
    first, second = model[0], model[3]
    assert int(first.num_batches_tracked) == 1 and int(second.num_batches_tracked) == 0
    pipe(_x(8, 4))  # the next step starts clean
    assert int(first.num_batches_tracked) == 2 and int(second.num_batches_tracked) == 1


class _Where(nn.Module):
    """Records the default device and the thread its forward ran on."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def forward(self, x):
        import threading

        self.log.append((str(torch.empty(0).device), threading.current_thread().name))
        return x


@pytest.mark.parametrize("wrapper", ["pipeline", "data_parallel"])
def test_workers_carry_the_default_device_and_stay_concurrent(wrapper):
    # torch.set_default_device / `with torch.device` are per thread: workers made factory
    # tensors on the CPU under a caller's default device of another kind.
    log = []
    if wrapper == "pipeline":
        model = PipelineModel([_Where(log), _Where(log)], ["cpu", "cpu"], chunks=2)
    else:
        model = DataParallelModel(_Where(log), device_ids=["cpu", "cpu"])
    x = torch.randn(4, 3)
    with torch.device("meta"):
        model(x)
    assert {where for where, _ in log} == {"meta"}, log
    if wrapper == "data_parallel":  # still on the worker threads, not run one after another
        assert len({thread for _, thread in log}) == 2, log


@pytest.mark.parametrize("switch", ["eval_then_train", "train_then_eval"])
def test_a_recomputation_under_another_mode_leaves_batchnorm_counters(switch):
    # The recomputation froze the layers by their flags at backward time (before replaying the
    # forward's): num_batches_tracked went to -2, or the stats were updated a second time.
    torch.manual_seed(5)
    seq = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    pipe = PipelineModel(seq, ["cpu", "cpu"], chunks=2, checkpoint="always", batchnorm="micro")
    pipe.train(switch == "train_then_eval")
    out = pipe(torch.randn(8, 4))
    bns = [m for m in pipe.modules() if isinstance(m, nn.BatchNorm1d)]
    after_forward = [(int(m.num_batches_tracked), m.running_mean.clone()) for m in bns]
    pipe.train(switch == "eval_then_train")
    out.sum().backward()
    for m, (count, mean) in zip(bns, after_forward):
        assert int(m.num_batches_tracked) == count
        assert torch.equal(m.running_mean, mean)


def test_a_batchnorm_given_in_a_list_of_layers_is_the_callers_own():
    # A top-level BatchNorm of a list was replaced by a new object sharing its tensors: after
    # pipe.double() (or a move to a GPU) the caller's layer kept stale running statistics.
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)]
    ref = copy.deepcopy(nn.Sequential(*layers)).double()
    pipe = PipelineModel(layers, ["cpu"] * 2, chunks=2).double()
    assert layers[1] is pipe.partitions[0][1] and isinstance(layers[1], DeferredBatchNorm)
    for _ in range(3):
        x = _x(8, 4) * 3 + 2
        pipe(x)
        ref(x)
    saved = nn.Sequential(*layers).state_dict()  # "save the model you passed"
    assert saved["1.running_mean"].dtype == torch.float64
    torch.testing.assert_close(saved["1.running_mean"], ref[1].running_mean, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(saved["1.running_var"], ref[1].running_var, rtol=1e-12, atol=1e-14)


def test_a_batchnorm_subclass_is_not_deferred_and_says_so():
    class BatchNormAct2d(nn.BatchNorm2d):  # timm-style: BatchNorm and an activation in one layer
        def forward(self, x):
            return torch.relu(super().forward(x))

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 4, 1), BatchNormAct2d(4), nn.Conv2d(4, 4, 1)).double()
    with pytest.warns(UserWarning, match="BatchNormAct2d is a subclass of a BatchNorm class.*not deferred"):
        pipe = PipelineModel(copy.deepcopy(ref), ["cpu", "cpu"], chunks=4)
    bn = pipe.partitions[0][1]
    assert type(bn) is BatchNormAct2d  # its forward kept (the activation)
    x = _x(8, 3, 4, 4)
    pipe(x)
    assert int(bn.num_batches_tracked) == 4  # once per micro-batch, as the warning says


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("balance", [[1, 4], [3, 2]])
def test_a_stage_starting_with_an_in_place_layer_trains_under_checkpointing(checkpoint, balance):
    # The checkpoint saved the stage's input, which LeakyReLU(inplace=True) changed before the
    # recomputation: torch's bare version-counter error in the backward.
    torch.manual_seed(0)
    ref = nn.Sequential(
        nn.Linear(6, 16), nn.LeakyReLU(0.1, inplace=True), nn.Linear(16, 16), nn.LeakyReLU(0.1, inplace=True),
        nn.Linear(16, 3),
    ).double()  # fmt: skip
    model = copy.deepcopy(ref)
    x, y = _x(8, 6), torch.randint(0, 3, (8,))
    nn.functional.cross_entropy(ref(x), y).backward()
    pipe = PipelineModel(model, ["cpu", "cpu"], chunks=2, balance=balance, checkpoint=checkpoint)
    nn.functional.cross_entropy(pipe(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def test_a_checkpointed_stage_that_changes_its_input_in_place_is_named_at_the_forward():
    class Shift(nn.Module):  # not one of torch's in-place layers: it changes its input anyway
        def forward(self, x):
            return x.add_(1.0)

    pipe = PipelineModel(
        nn.Sequential(nn.Linear(4, 4), Shift(), nn.Linear(4, 2)).double(), ["cpu", "cpu"], balance=[1, 2],
        checkpoint="always",
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="changed the stage's input in place") as err:
        pipe(_x(4, 4))
    assert "stage 1" in "".join(getattr(err.value, "__notes__", []))


def test_balance_by_time_profiles_in_place_layers():
    # The profiler fed each layer a leaf requiring grad, which an in-place ReLU refuses: the
    # error blamed `sample`.
    layers = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
    )  # fmt: skip
    plan = PipelineModel.balance_by(layers, torch.randn(8, 3, 16, 16), 2, by="time")
    assert sum(plan) == 9 and len(plan) == 2 and min(plan) >= 1


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("chunks", [2, 3])
def test_a_first_stage_starting_with_an_in_place_layer_trains(checkpoint, chunks):
    # The micro-batches were views of the input, sharing its version counter: the in-place
    # layer's change of one made the others' saved tensors stale (torch's version error).
    torch.manual_seed(0)
    ref = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 3)).double()
    model = copy.deepcopy(ref)
    x, y = _x(6, 6), torch.randint(0, 3, (6,))
    nn.functional.cross_entropy(ref(x.clone()), y).backward()
    pipe = PipelineModel(model, ["cpu", "cpu"], chunks=chunks, balance=[2, 2], checkpoint=checkpoint)
    nn.functional.cross_entropy(pipe(x.clone()), y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


class _TwiceBN(nn.Module):
    """One cumulative-average BatchNorm applied twice in one forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8, momentum=None)

    def forward(self, x):
        return self.bn(self.lin(self.bn(x)))


def test_micro_batchnorm_used_twice_in_a_checkpointed_stage_counts_each_use_once():
    # the recomputation counted both uses and one was taken back: num_batches_tracked grew by
    # one per recomputed micro-batch, and momentum=None statistics drifted from the unsplit model's
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(8, 8), _TwiceBN(), nn.ReLU(), nn.Linear(8, 4))
    piped, plain = copy.deepcopy(net), copy.deepcopy(net)
    pm = PipelineModel(piped, ["cpu", "cpu"], chunks=2, checkpoint="always", batchnorm="micro", balance=[2, 2])
    for i in range(3):
        x = torch.randn(8, 8) + i
        pm(x).sum().backward()
        for chunk in x.tensor_split(2):
            plain(chunk).sum().backward()
    assert piped[1].bn.num_batches_tracked.item() == plain[1].bn.num_batches_tracked.item() == 12
    torch.testing.assert_close(piped[1].bn.running_mean, plain[1].bn.running_mean)
    torch.testing.assert_close(piped[1].bn.running_var, plain[1].bn.running_var)


@pytest.mark.parametrize("batchnorm", ["micro", "deferred"])
def test_a_recomputation_that_fails_leaves_batchnorm_counters(batchnorm):
    # a backward whose recomputation raised before reaching the BatchNorm (an out-of-memory in
    # the recompute, say) took one off its counter
    class Fails(nn.Module):
        armed = False

        def forward(self, x):
            if Fails.armed:
                raise RuntimeError("recomputation failed")
            return x

    net = nn.Sequential(nn.Linear(8, 8), Fails(), nn.BatchNorm1d(8, momentum=None), nn.ReLU(), nn.Linear(8, 4))
    pm = PipelineModel(net, ["cpu", "cpu"], chunks=2, checkpoint="always", batchnorm=batchnorm, balance=[3, 2])
    out = pm(torch.randn(8, 8))
    before = net[2].num_batches_tracked.item()
    Fails.armed = True
    try:
        with pytest.raises(RuntimeError, match="recomputation failed"):
            out.sum().backward()
    finally:
        Fails.armed = False
    assert net[2].num_batches_tracked.item() == before
    pm(torch.randn(8, 8)).sum().backward()
    assert net[2].num_batches_tracked.item() == 2 * before
