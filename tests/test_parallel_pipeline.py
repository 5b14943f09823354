"""shardkit.parallel.PipelineModel on repeated CPU devices (the GPU twins are marked):
outputs and gradients against the unsplit model in float64, BatchNorm semantics of both
modes against references, recomputation that does not count BatchNorm twice, a schedule
that really overlaps the stages, balance plans, and the errors."""

import copy
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardkit.parallel import PipelineModel
from shardkit.parallel.pipeline import bubble_fraction, layer_costs, partition

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible on this machine")


def _mlp(seed, width=6, depth=5):
    torch.manual_seed(seed)
    layers = []
    for i in range(depth):
        layers += [nn.Linear(width if i else 4, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 3)).double()


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("chunks", [1, 2, 3, 7, 9])
@pytest.mark.parametrize("ckpt", ["never", "except_last", "always"])
def test_matches_unsplit_model(stages, chunks, ckpt):
    seed = int(torch.randint(0, 2**31, ()).item())
    ref = _mlp(seed)
    pipe = PipelineModel(copy.deepcopy(ref), ["cpu"] * stages, chunks=chunks, checkpoint=ckpt)
    x = torch.randn(7, 4, dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    coef = torch.randn(7, 3, dtype=torch.float64)
    (ref(x1) * coef).sum().backward()
    out = pipe(x2)
    (out * coef).sum().backward()
    torch.testing.assert_close(out, ref(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-12, atol=1e-12)
    for g, h in zip(_grads(pipe), _grads(ref)):
        torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-12)


def test_dtype_conversions_reach_every_stage():
    # .to(dtype) / .float() / .double() go through nn.Module._apply, which the pipeline must
    # not shadow: the stages change dtype and the pipeline still equals the unsplit model.
    seed = int(torch.randint(0, 2**31, ()).item())
    ref = _mlp(seed).float()
    pipe = PipelineModel(copy.deepcopy(ref).double(), ["cpu", "cpu"], chunks=3)
    assert pipe.float() is pipe and all(p.dtype == torch.float32 for p in pipe.parameters())
    x = torch.randn(5, 4)
    torch.testing.assert_close(pipe(x), ref(x))
    pipe.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in pipe.parameters())
    torch.testing.assert_close(pipe(x.double()), ref.double()(x.double()), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("balance", [[1, 10], [4, 7], [9, 2], [3, 3, 5], "time", "memory"])
def test_balance_lists_and_automatic_plans(balance):
    ref = _mlp(3)
    parts = len(balance) if isinstance(balance, list) else 2
    sample = torch.randn(5, 4, dtype=torch.float64)
    pipe = PipelineModel(copy.deepcopy(ref), ["cpu"] * parts, chunks=3, balance=balance, sample=sample)
    assert sum(pipe.balance) == 11 and len(pipe.balance) == parts and min(pipe.balance) >= 1
    if isinstance(balance, list):
        assert pipe.balance == balance
    x = torch.randn(8, 4, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), ref(x), rtol=1e-12, atol=1e-12)


def test_partition_minimizes_the_largest_stage():
    costs = [5.0, 1.0, 1.0, 1.0, 1.0, 5.0]
    plan = partition(costs, 2)
    assert plan == [3, 3]
    assert partition([1, 1, 1, 10], 2) == [3, 1]
    assert partition([3, 1, 1, 1], 3) in ([1, 1, 2], [1, 2, 1])
    # exhaustive check of optimality on random costs
    torch.manual_seed(0)
    for _ in range(20):
        c = torch.rand(7).tolist()
        best = min(max(sum(c[:i]), sum(c[i:j]), sum(c[j:])) for i in range(1, 6) for j in range(i + 1, 7))
        plan = partition(c, 3)
        got = max(sum(c[: plan[0]]), sum(c[plan[0] : plan[0] + plan[1]]), sum(c[plan[0] + plan[1] :]))
        assert abs(got - best) < 1e-12


class _Pause(nn.Module):
    """Identity that holds its stage's thread (GIL released) long enough for the other stage
    of the same clock to draw random numbers."""

    def forward(self, x):
        time.sleep(0.01)
        return x


@pytest.mark.parametrize("ckpt", ["always", "except_last"])
def test_checkpointed_dropout_replays_the_forward_masks(ckpt):
    # Two CPU stages share the CPU generator; the recomputation must draw the same masks as
    # the forward (another stage's draws in between would change them): d(sum y)/dx = y / x.
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    model = nn.Sequential(_Pause(), nn.Dropout(0.5), nn.Dropout(0.5), nn.Dropout(0.5))
    pipe = PipelineModel(model, ["cpu", "cpu"], chunks=6, balance=[2, 2], checkpoint=ckpt)
    for _ in range(3):
        x = (torch.rand(60, 2000) + 0.5).requires_grad_()
        y = pipe(x)
        y.sum().backward()
        assert torch.equal(x.grad, y.detach() / x.detach())


def test_memory_costs_are_the_documented_bytes_and_the_plan_their_partition():
    # float32, sample [2, 4]: a layer costs 2 x its parameter bytes (the parameters and their
    # gradients) + its buffer bytes + its output's bytes.
    def linear(i, o):
        return 2 * 4 * (i * o + o) + 4 * 2 * o

    batchnorm = 2 * 4 * 1024 + (4 * 1024 + 8) + 4 * 2 * 512  # weight, bias; mean, var, int64 count
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 512), nn.BatchNorm1d(512), nn.Linear(512, 4))
    sample = torch.randn(2, 4)
    costs = [linear(4, 4), linear(4, 4), linear(4, 512), batchnorm, linear(512, 4)]
    assert costs == [192, 192, 24576, 16392, 16448]
    state = copy.deepcopy(model.state_dict())
    assert layer_costs(list(model), sample, "memory") == costs
    # the heavy Linear(4, 512) ends the first stage: [2, 2, 1] (an even split) would hold
    # 40968 bytes on stage 1, 64% more than the 24960 of the best plan's largest stage
    assert partition(costs, 3) == [3, 1, 1]
    assert PipelineModel.balance_by(model, sample, 3, by="memory") == [3, 1, 1]
    without_bn = nn.Sequential(*[m for m in model if not isinstance(m, nn.BatchNorm1d)])
    assert partition(costs[:3] + costs[4:], 2) == [3, 1]  # [2, 2]: 41024 bytes against 24960
    assert PipelineModel.balance_by(without_bn, sample, 2, by="memory") == [3, 1]
    layer_costs(list(model), sample, "time")
    for key, value in model.state_dict().items():  # profiling left BatchNorm's statistics alone
        assert torch.equal(value, state[key]), key
    pipe = PipelineModel(model, ["cpu"] * 3, chunks=2, balance="memory", sample=sample)
    assert pipe.balance == [3, 1, 1]


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class _Timed(nn.Module):
    """A layer that takes ``forward_ms`` in its forward and ``backward_ms`` in its backward."""

    def __init__(self, forward_ms, backward_ms):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.forward_s, self.backward_s = forward_ms / 1000, backward_ms / 1000

    def forward(self, x):
        time.sleep(self.forward_s)
        return _SleepInBackward.apply(x * self.scale, self.backward_s)


def test_time_plan_is_the_partition_of_forward_plus_backward_times():
    # costs 22, 50, 60, 50, 12, 4 ms: [2, 1, 3] (largest stage 72 ms) beats the next plan by
    # 38 ms; an even split (110 ms), constant costs, or forward times alone ([1, 1, 4]) differ.
    forward_ms, backward_ms = [20, 40, 20, 10, 2, 2], [2, 10, 40, 40, 10, 2]
    costs = [f + b for f, b in zip(forward_ms, backward_ms)]
    assert partition(costs, 3) == [2, 1, 3] and partition(forward_ms, 3) == [1, 1, 4]
    model = nn.Sequential(*[_Timed(f, b) for f, b in zip(forward_ms, backward_ms)])
    sample = torch.randn(3, 2)
    measured = layer_costs(list(model), sample, "time")
    assert all(m >= c / 1000 for m, c in zip(measured, costs)), (measured, costs)  # a sleep lasts at least that
    assert PipelineModel.balance_by(model, sample, 3, by="time") == [2, 1, 3]
    assert PipelineModel(model, ["cpu"] * 3, balance="time", sample=sample).balance == [2, 1, 3]


def _bn_net(seed, bns=2):
    torch.manual_seed(seed)
    layers = [nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 6), nn.BatchNorm1d(6)]
    return nn.Sequential(*layers[: 3 + 2 * (bns - 1)]).double()


def _bn_layers(model):
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


@pytest.mark.parametrize("ckpt", ["never", "always"])
def test_deferred_batchnorm_keeps_whole_batch_running_stats(ckpt):
    # One BatchNorm: a later one would see inputs normalized per micro-batch, which the
    # whole-batch reference cannot reproduce.
    ref = _bn_net(4, bns=1)
    pipe = PipelineModel(copy.deepcopy(ref), ["cpu", "cpu"], chunks=3, checkpoint=ckpt)
    x = torch.randn(10, 4, dtype=torch.float64)
    out = pipe(x)
    out.sum().backward()
    ref(x)  # one forward of the whole batch
    bns, ref_bns = _bn_layers(pipe), _bn_layers(ref)
    assert len(bns) == 1
    for b, r in zip(bns, ref_bns):
        torch.testing.assert_close(b.running_mean, r.running_mean, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(b.running_var, r.running_var, rtol=1e-10, atol=1e-12)
        assert int(b.num_batches_tracked) == 1
    # each micro-batch normalized with its own statistics
    fresh = _bn_net(4, bns=1)
    want = torch.cat([fresh(c) for c in x.tensor_split(3)])
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    # evaluation uses the running statistics, like the unsplit model
    pipe.eval()
    ref.eval()
    torch.testing.assert_close(pipe(x), ref(x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_batchnorm_variance_of_a_small_spread_around_a_large_mean(dtype):
    # Features of mean 1000 and spread 0.01 (or 100 and 0.1): the running variance (momentum 1:
    # the step's unbiased variance itself) is the float64 variance of the same numbers to 2e-3
    # (an fp32 variance of such data is good to ~4e-4), where E[x^2] - E[x]^2 in float32 gave 0
    # or 630x the variance. bf16 activations, fp32 buffers.
    torch.manual_seed(11)
    for mean, std in ((1000.0, 0.01), (100.0, 0.1)):
        x = (torch.randn(64, 5, dtype=torch.float64) * std + mean).to(dtype)
        ref = nn.Sequential(nn.BatchNorm1d(5, momentum=1.0), nn.Linear(5, 3))
        pipe = PipelineModel(
            copy.deepcopy(ref).to(dtype if dtype != torch.bfloat16 else torch.float32), ["cpu", "cpu"], chunks=4
        )
        pipe(x.float() if dtype == torch.bfloat16 else x)
        want = x.double().var(0, unbiased=True)
        got = _bn_layers(pipe)[0].running_var.double()
        torch.testing.assert_close(got, want, rtol=2e-3, atol=0)
        torch.testing.assert_close(_bn_layers(pipe)[0].running_mean.double(), x.double().mean(0), rtol=1e-6, atol=0)


@pytest.mark.parametrize("ckpt", ["never", "always"])
def test_deferred_batchnorm_keeps_the_running_stats_of_each_layers_own_inputs(ckpt):
    # What holds for every layer: one update per step from all the inputs the layer saw in
    # the step's micro-batches (their mean and unbiased variance, momentum applied once).
    # Those inputs equal the unsplit model's only up to the first BatchNorm: a later layer
    # sees activations normalized per micro-batch, so its statistics differ from the
    # unsplit model's (the README says so).
    ref = _bn_net(5, bns=2)
    pipe = PipelineModel(copy.deepcopy(ref), ["cpu", "cpu"], chunks=3, checkpoint=ckpt)
    x = torch.randn(11, 4, dtype=torch.float64)
    pipe(x).sum().backward()
    per_micro = copy.deepcopy(ref)  # plain BatchNorm run micro-batch by micro-batch: the inputs each layer sees
    seen = {id(m): [] for m in _bn_layers(per_micro)}
    for m in _bn_layers(per_micro):
        m.register_forward_pre_hook(lambda mod, args: seen[id(mod)].append(args[0].detach()))
    for c in x.tensor_split(3):
        per_micro(c)
    for b, r, plain in zip(_bn_layers(pipe), _bn_layers(ref), _bn_layers(per_micro)):
        inputs = torch.cat(seen[id(plain)])
        want_mean = 0.9 * r.running_mean + 0.1 * inputs.mean(0)
        want_var = 0.9 * r.running_var + 0.1 * inputs.var(0, unbiased=True)
        torch.testing.assert_close(b.running_mean, want_mean, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(b.running_var, want_var, rtol=1e-10, atol=1e-12)
        assert int(b.num_batches_tracked) == 1
    ref(x)  # the unsplit model: equal statistics for the first layer only
    first, second = _bn_layers(pipe)
    torch.testing.assert_close(first.running_var, _bn_layers(ref)[0].running_var, rtol=1e-10, atol=1e-12)
    assert (second.running_var - _bn_layers(ref)[1].running_var).abs().max() > 1e-6


@pytest.mark.parametrize("ckpt", ["never", "except_last", "always"])
def test_micro_batchnorm_updates_per_micro_batch_once(ckpt):
    ref = _bn_net(5)
    pipe = PipelineModel(copy.deepcopy(ref), ["cpu", "cpu"], chunks=4, checkpoint=ckpt, batchnorm="micro")
    x = torch.randn(9, 4, dtype=torch.float64)
    pipe(x).sum().backward()  # the backward recomputes checkpointed micro-batches
    for c in x.tensor_split(4):
        ref(c)
    for b, r in zip(
        [m for m in pipe.modules() if isinstance(m, nn.BatchNorm1d)],
        [m for m in ref.modules() if isinstance(m, nn.BatchNorm1d)],
    ):
        torch.testing.assert_close(b.running_mean, r.running_mean, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(b.running_var, r.running_var, rtol=1e-10, atol=1e-12)
        assert int(b.num_batches_tracked) == 4


def test_one_chunk_equals_unsplit_model_with_batchnorm():
    ref = _bn_net(6)
    pipe = PipelineModel(copy.deepcopy(ref), ["cpu", "cpu", "cpu"], chunks=1, checkpoint="always")
    x = torch.randn(6, 4, dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(x1).pow(2).sum().backward()
    pipe(x2).pow(2).sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-10, atol=1e-12)
    for g, h in zip(_grads(pipe), _grads(ref)):
        torch.testing.assert_close(g, h, rtol=1e-10, atol=1e-12)


class _Sleep(nn.Module):
    def __init__(self, stage, log, lock, seconds=0.1):
        super().__init__()
        self.stage, self.log, self.lock, self.seconds = stage, log, lock, seconds

    def forward(self, x):
        start = time.perf_counter()
        time.sleep(self.seconds)
        with self.lock:
            self.log.append((self.stage, int(x[0, 0].item()), start, time.perf_counter()))
        return x


def test_schedule_runs_the_clocks_in_order():
    # fill-drain: at clock t stage s runs micro-batch t - s; stages on one device (here the
    # CPU) run in stage order within a clock, in one thread (they share its random generator)
    log, lock = [], threading.Lock()
    pipe = PipelineModel([_Sleep(0, log, lock, 0.0), _Sleep(1, log, lock, 0.0)], ["cpu", "cpu"], chunks=4)
    x = torch.arange(4, dtype=torch.float32).repeat_interleave(2).view(8, 1)  # micro-batch i holds value i
    torch.testing.assert_close(pipe(x), x)
    order = [(s, i) for s, i, _, _ in log]
    assert order == [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (0, 3), (1, 2), (1, 3)]
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_dropout_draws_the_same_numbers_under_one_seed(checkpoint):
    # Stages sharing a device used to draw from its generator in thread-timing order: a seeded
    # training step gave another output on every run (15 of 15) without checkpointing.
    import random

    class Jitter(nn.Module):
        def forward(self, x):
            time.sleep(0.002 * random.random())  # uneven stage times
            return x

    model = nn.Sequential(nn.Linear(16, 16), Jitter(), nn.Dropout(0.5), nn.Linear(16, 16), Jitter(), nn.Dropout(0.5))
    pipe = PipelineModel(model, ["cpu", "cpu"], chunks=4, checkpoint=checkpoint)
    outs, grads = [], []
    for _ in range(6):
        torch.manual_seed(123)
        x = torch.ones(8, 16, requires_grad=True)
        out = pipe(x)
        out.sum().backward()
        outs.append(out.detach())
        grads.append(x.grad)
    for o, g in zip(outs[1:], grads[1:]):
        assert torch.equal(o, outs[0]) and torch.equal(g, grads[0])


class _Pair(nn.Module):
    def forward(self, x):
        return x, x


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(balance=[2, 2]), "argument `balance` \\[2, 2\\] sums to 4, but the model has 3 layers"),
        (dict(balance=[3, 0]), "argument `balance` must hold one positive int per device"),
        (dict(devices=["cpu"] * 4), "argument `devices` names 4 devices for 3 layers"),
        (dict(chunks=0), "argument `chunks` must be an int >= 1"),
        (dict(checkpoint="sometimes"), "argument `checkpoint` must be one of"),
        (dict(batchnorm="full"), "argument `batchnorm` must be one of"),
        (dict(balance="time"), "pass `sample`"),
        (dict(devices=[]), "argument `devices` must be a non-empty list"),
    ],
)
def test_errors_name_the_argument(kwargs, match):
    args = dict(devices=["cpu", "cpu"])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        PipelineModel(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)), **args)


def test_stage_returning_a_non_tensor_is_named():
    pipe = PipelineModel([nn.Linear(2, 2), _Pair()], ["cpu", "cpu"], chunks=2)
    with pytest.raises(TypeError, match="stage 1 .* returned tuple"):
        pipe(torch.randn(4, 2))
    with pytest.raises(TypeError, match="argument `stages` must be an nn.Sequential"):
        PipelineModel("not a model", ["cpu"])
    with pytest.raises(ValueError, match="argument `x` must have a non-empty batch"):
        PipelineModel([nn.Linear(2, 2)], ["cpu"])(torch.randn(0, 2))


def test_with_sharded_head_on_the_pipeline_devices():
    import shardkit

    torch.manual_seed(7)
    backbone = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6)).double()
    ref_backbone = copy.deepcopy(backbone)
    pipe = PipelineModel(backbone, ["cpu", "cpu"], chunks=3)
    head = shardkit.ShardedSoftmaxLoss(6, 11, devices=pipe.devices * 2, dtype=torch.float64)
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randint(0, 11, (7,))
    loss = head(pipe(x), y)
    loss.backward()
    ref = F.cross_entropy(ref_backbone(x) @ head.full_weight().t(), y)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-10, atol=1e-12)
    for p, q in zip(pipe.parameters(), ref_backbone.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    assert set(pipe.memory_per_device()) == {torch.device("cpu")}


def test_output_device_defaults_to_the_last_stage_and_must_compute():
    # Without a GPU the CPU is the one device an output can go to: the default is the last
    # stage's device, and "meta" (where values are lost) is refused. The GPU twin below moves
    # the output to a device other than the last stage's and checks values and gradients.
    ref = _mlp(int(torch.randint(0, 2**31, ()).item()))
    assert PipelineModel(copy.deepcopy(ref), ["cpu", "cpu"]).output_device == torch.device("cpu")
    with pytest.raises(ValueError, match=r"argument `output_device` must be a CPU or CUDA device"):
        PipelineModel(copy.deepcopy(ref), ["cpu", "cpu"], chunks=3, output_device="meta")


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("devices,output_device", [(["cuda:0", "cuda:0"], "cpu"), (["cpu", "cpu"], "cuda:0")])
def test_gpu_output_device_other_than_the_last_stage(devices, output_device):
    ref = _mlp(9)
    pipe = PipelineModel(copy.deepcopy(ref), devices, chunks=3, output_device=output_device)
    x = torch.randn(11, 4, dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().to(devices[0]).requires_grad_()
    coef = torch.randn(11, 3, dtype=torch.float64)
    (ref(x1) * coef).sum().backward()
    out = pipe(x2)  # to the CPU: read at once, as a user would (no synchronize in between)
    assert out.device == torch.device(output_device)
    torch.testing.assert_close(out.detach().cpu(), ref(x).detach(), rtol=1e-12, atol=1e-12)
    (out * coef.to(output_device)).sum().backward()  # the backward crosses back to the stages
    torch.testing.assert_close(x2.grad.cpu(), x1.grad, rtol=1e-12, atol=1e-12)
    for g, h in zip(_grads(pipe), _grads(ref)):
        torch.testing.assert_close(g.cpu(), h, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("ckpt", ["never", "except_last"])
def test_gpu_matches_unsplit_model(ckpt):
    devices = [f"cuda:{i % torch.cuda.device_count()}" for i in range(2)]
    ref = _mlp(8).cuda()
    pipe = PipelineModel(copy.deepcopy(ref).cpu(), devices, chunks=4, checkpoint=ckpt)
    x = torch.randn(13, 4, dtype=torch.float64, device=devices[0])
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(x1).pow(2).sum().backward()
    out = pipe(x2)
    out.pow(2).sum().backward()
    torch.testing.assert_close(out.to(x.device), ref(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-12, atol=1e-12)
    for g, h in zip(_grads(pipe), _grads(ref)):
        torch.testing.assert_close(g.to(h.device), h, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("devices", [["cuda:0", "cpu"], ["cpu", "cuda:0", "cpu"]])
def test_gpu_stage_then_cpu_stage_reads_finished_activations(devices):
    # A CPU stage copies a GPU stage's output on its device's current stream; that output was
    # made on the GPU stage's side stream, so the copy must wait for it. A wide first stage
    # keeps the GPU busy long enough for an unordered copy to read unfinished values.
    torch.manual_seed(0)
    width = 2048
    layers = [nn.Linear(4, width), nn.Tanh()] + [m for _ in range(6) for m in (nn.Linear(width, width), nn.Tanh())]
    ref = nn.Sequential(*layers, nn.Linear(width, 3)).double()
    k = len(ref)
    balance = [k - 1, 1] if len(devices) == 2 else [1, k - 2, 1]
    pipe = PipelineModel(copy.deepcopy(ref), devices, chunks=4, balance=balance)
    for _ in range(3):
        x = torch.randn(64, 4, dtype=torch.float64)
        out = pipe(x.to(devices[0]))
        assert out.device == torch.device("cpu")
        torch.testing.assert_close(out, ref(x), rtol=1e-10, atol=1e-10)
