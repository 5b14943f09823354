"""Bad arguments of shardkit.parallel (and its ops) raise errors that name them: stages that
change the batch size under micro-batching, split options, loss weights, allreduce,
balance_by and CUDA devices where none is visible. CPU devices only (the GPU cases patch
torch.cuda.is_available / device_count)."""

import math

import pytest
import torch
from torch import nn

from shardkit.ops import weighted_loss_reduce
from shardkit.parallel import DataParallelCriterion, DataParallelModel, PipelineModel, WeightedLoss, allreduce


class _BatchMean(nn.Module):
    def forward(self, x):
        return x.mean(0, keepdim=True)


class _Scalar(nn.Module):
    def forward(self, x):
        return x.sum()


# ---- PipelineModel: a stage must keep dim 0 -----------------------------------------


def test_pipeline_stage_changing_the_batch_is_named():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _BatchMean())
    x = torch.randn(8, 4)
    pipe = PipelineModel(model, ["cpu", "cpu"], chunks=4)
    with pytest.raises(ValueError, match=r"stage 1 .*micro-batches .*every stage must keep dim 0"):
        pipe(x)
    # one micro-batch: the whole batch goes through, as the unsplit model
    one = PipelineModel(model, ["cpu", "cpu"], chunks=1, batchnorm="micro")
    assert torch.equal(one(x), model(x))
    with pytest.raises(ValueError, match="stage 1 .*shape \\(\\)"):
        PipelineModel([nn.Linear(4, 4), _Scalar()], ["cpu", "cpu"], chunks=1)(x)


def test_pipeline_stages_that_keep_the_batch_still_work():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Unflatten(1, (2, 4)), nn.Flatten(), nn.Linear(8, 3)).double()
    x = torch.randn(7, 8, dtype=torch.float64)
    pipe = PipelineModel(model, ["cpu", "cpu"], chunks=3)
    assert torch.allclose(pipe(x), model(x))


# ---- DataParallelModel: dim, chunk_sizes, gpu0_bsz ----------------------------------


@pytest.mark.parametrize("dim", ["0", 0.0, True, None])
def test_dim_must_be_an_int(dim):
    with pytest.raises(TypeError, match="argument `dim` must be an int"):
        DataParallelModel(nn.Linear(4, 4), ["cpu"] * 2, dim=dim)
    with pytest.raises(TypeError, match="argument `dim` must be an int"):
        DataParallelCriterion(nn.MSELoss(), ["cpu"] * 2, dim=dim)


@pytest.mark.parametrize(
    "chunk_sizes, error, match",
    [
        ("12", TypeError, "argument `chunk_sizes` must be a list of ints"),
        (12, TypeError, "argument `chunk_sizes` must be a list of ints"),
        ([math.nan, 1], ValueError, r"argument `chunk_sizes` \(index 0\) must be a non-negative int, got nan"),
        ([1, math.inf], ValueError, r"argument `chunk_sizes` \(index 1\) must be a non-negative int"),
        ([1.5, 1], ValueError, r"argument `chunk_sizes` \(index 0\) must be a non-negative int, got 1.5"),
        ([None, 1], TypeError, r"argument `chunk_sizes` \(index 0\)"),
        (["1", "2"], TypeError, r"argument `chunk_sizes` \(index 0\)"),
        ([True, 1], TypeError, r"argument `chunk_sizes` \(index 0\)"),
        ([-1, 3], ValueError, "argument `chunk_sizes` must be non-negative with a positive sum, got \\[-1, 3\\]"),
    ],
)
def test_bad_chunk_sizes_are_named(chunk_sizes, error, match):
    with pytest.raises(error, match=match):
        DataParallelModel(nn.Linear(4, 4), ["cpu"] * 2, chunk_sizes=chunk_sizes)


@pytest.mark.parametrize(
    "gpu0_bsz, error",
    [(math.nan, ValueError), (math.inf, ValueError), (-1, ValueError), (1.5, ValueError), ("4", TypeError)],
)
def test_bad_gpu0_bsz_is_named(gpu0_bsz, error):
    with pytest.raises(error, match="argument `gpu0_bsz` must be a non-negative int"):
        DataParallelModel(nn.Linear(4, 4), ["cpu"] * 2, gpu0_bsz=gpu0_bsz)


def test_integral_split_options_still_work():
    model = DataParallelModel(nn.Linear(4, 4), ["cpu"] * 2, chunk_sizes=(1.0, 3))
    assert model.chunk_sizes == [1, 3]
    assert [o.shape[0] for o in model(torch.randn(8, 4))] == [2, 6]
    model = DataParallelModel(nn.Linear(4, 4), ["cpu"] * 3, gpu0_bsz=2.0)
    assert model.gpu0_bsz == 2 and type(model.gpu0_bsz) is int
    assert [o.shape[0] for o in model(torch.randn(8, 4))] == [2, 3, 3]


# ---- loss weights -------------------------------------------------------------------


@pytest.mark.parametrize(
    "weight, error, match",
    [
        (None, TypeError, "must be a one-element tensor or a real number, got NoneType"),
        ("3", TypeError, "must be a one-element tensor or a real number, got str"),
        (True, TypeError, "must be a one-element tensor or a real number, got bool"),
        (-1.0, ValueError, "must be finite and non-negative, got -1.0"),
        (math.nan, ValueError, "must be finite and non-negative, got nan"),
        (math.inf, ValueError, "must be finite and non-negative, got inf"),
        # the op's "argument `weights` must hold one-element tensors" named no WeightedLoss
        (torch.ones(2), ValueError, r"must be a one-element tensor or a real number, got shape \(2,\)"),
        (torch.ones(0), ValueError, r"must be a one-element tensor or a real number, got shape \(0,\)"),
    ],
)
def test_bad_weights_are_named(weight, error, match):
    losses = [torch.tensor(1.0), torch.tensor(2.0)]
    with pytest.raises(error, match=r"argument `weights` \(index 1\) " + match):
        weighted_loss_reduce(losses, [1, weight], "cpu")

    class Weighted(nn.Module):
        def forward(self, out, target):
            return WeightedLoss(((out - target) ** 2).mean(), weight)

    out, target = torch.randn(4, 3), torch.randn(4, 3)
    with pytest.raises(error, match=r"WeightedLoss.weight .*" + match):
        DataParallelCriterion(Weighted(), ["cpu"] * 2)([out[:2], out[2:]], target)
    with pytest.raises(error, match=r"WeightedLoss.weight .*" + match):  # the direct (one device) mode too
        DataParallelCriterion(Weighted(), ["cpu"])(out, target)


def test_weights_argument_must_be_a_list():
    with pytest.raises(TypeError, match="argument `weights` must be a list"):
        weighted_loss_reduce([torch.tensor(1.0)], None, "cpu")


def test_good_weights_still_reduce():
    losses = [torch.tensor(1.0, dtype=torch.float64), torch.tensor(4.0, dtype=torch.float64)]
    out = weighted_loss_reduce(losses, [torch.tensor(3), 1.0], "cpu")
    assert out.item() == pytest.approx((3 * 1.0 + 4.0) / 4)
    assert weighted_loss_reduce(losses, [0, 2], "cpu").item() == pytest.approx(4.0)


# ---- allreduce, balance_by ----------------------------------------------------------


def test_allreduce_arguments_are_named():
    t = torch.ones(2)
    with pytest.raises(TypeError, match="argument `tensors` is empty"):
        allreduce(2)
    with pytest.raises(TypeError, match="argument `num_inputs` is missing"):
        allreduce()
    with pytest.raises(TypeError, match="argument `num_inputs` must be an int"):
        allreduce(t, t)
    with pytest.raises(ValueError, match="argument `num_inputs` must be >= 1"):
        allreduce(0, t)
    with pytest.raises(TypeError, match="argument `tensors` must hold tensors, got list at index 1"):
        allreduce(1, t, [1.0])
    assert torch.equal(allreduce(1, t, t)[1], 2 * t)
    # a float64 group summed into group 0's float32 (1 + 1e-12 became 2.0), torch's broadcast
    # error, a meta tensor's copy error: each refused naming `tensors`
    with pytest.raises(ValueError, match=r"tensor 0 of group 1 is torch.float64\[2\], group 0's is torch.float32"):
        allreduce(1, t, torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"tensor 1 of group 1 is torch.float32\[3\]"):
        allreduce(2, t, t, t, torch.ones(3))
    with pytest.raises(ValueError, match="argument `tensors` holds a tensor on the meta device"):
        allreduce(1, t, torch.ones(2, device="meta"))


def test_gather_and_replication_callbacks_name_their_bad_arguments():
    from shardkit.parallel import execute_replication_callbacks, gather

    a, b = torch.ones(2, 3), torch.zeros(3, 3)
    for dim, exc in ((None, TypeError), ("0", TypeError), (True, TypeError), (2**63, ValueError), (2, ValueError)):
        with pytest.raises(exc, match="argument `dim`"):
            gather([a, b], "cpu", dim)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"argument `target_device`: cuda:0 is not available"):
            gather([a, b], "cuda")
    with pytest.raises(ValueError, match=r"argument `outputs\[0\]`: device 1's keys \['b'\] are not device 0's"):
        gather([({"a": a},), ({"b": a},)], "cpu")
    with pytest.raises(ValueError, match="argument `outputs`: device 1's entry has 1 items, device 0's 2"):
        gather([(a, a), (a,)], "cpu")
    with pytest.raises(TypeError, match="argument `outputs`: device 1's entry is a str, device 0's a Tensor"):
        gather([a, "x"], "cpu")
    assert torch.equal(gather([torch.tensor(1.0), torch.tensor(2.0)], "cpu"), torch.tensor([1.0, 2.0]))
    assert torch.equal(gather([{"x": (a,)}, {"x": (b,)}], "cpu", -2)["x"][0], torch.cat([a, b]))
    for bad in (None, [], nn.Linear(2, 2)):
        with pytest.raises(TypeError, match="argument `modules` must be a non-empty list of replicas"):
            execute_replication_callbacks(bad)
    with pytest.raises(TypeError, match="argument `modules` must hold nn.Modules, got int at index 1"):
        execute_replication_callbacks([nn.Linear(2, 2), 1])


def test_balance_by_needs_a_sample_tensor():
    layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(TypeError, match="argument `sample` must be a Tensor"):
        PipelineModel.balance_by(layers, None, 2)
    with pytest.raises(TypeError, match="argument `sample` must be a Tensor"):
        PipelineModel(layers, ["cpu", "cpu"], balance="memory", sample=[[0.0] * 4])


# ---- CUDA devices where none is visible ---------------------------------------------


def _no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.mark.parametrize("devices", [[0, 1], ["cuda:0"], ["cuda"], [torch.device("cuda", 0), "cuda:1"]])
def test_pipeline_cuda_devices_without_a_gpu(monkeypatch, devices):
    _no_gpu(monkeypatch)
    with pytest.raises(ValueError, match="argument `devices` names CUDA devices .* no CUDA GPU is visible"):
        PipelineModel(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), devices)


def test_pipeline_cuda_output_device_without_a_gpu(monkeypatch):
    _no_gpu(monkeypatch)
    with pytest.raises(ValueError, match="argument `output_device` names CUDA devices .* no CUDA GPU"):
        PipelineModel(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), ["cpu", "cpu"], output_device="cuda:0")


def test_pipeline_cuda_device_beyond_the_visible_ones(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"argument `devices` names cuda:1 but only 1 CUDA GPU\(s\) are visible"):
        PipelineModel(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), ["cuda:0", "cuda:1"])


@pytest.mark.parametrize("device_ids", [[0, 1], ["cuda:0", "cuda:1"], ["cuda"]])
def test_data_parallel_cuda_ids_without_a_gpu_call_the_module(monkeypatch, device_ids):
    # as nn.DataParallel (and the README): CUDA ids on a machine without GPUs run the module directly
    _no_gpu(monkeypatch)
    torch.manual_seed(0)
    net, x = nn.Linear(4, 4), torch.randn(6, 4)
    out = DataParallelModel(net, device_ids)(x)
    assert torch.equal(out, net(x))
    loss = DataParallelCriterion(nn.MSELoss(), device_ids)(out, torch.zeros(6, 4))
    assert torch.equal(loss, nn.MSELoss()(out, torch.zeros(6, 4)))


def test_legacy_mean_must_be_a_bool():
    with pytest.raises(TypeError, match="legacy_mean"):
        DataParallelCriterion(torch.nn.CrossEntropyLoss(), device_ids=["cpu"], legacy_mean="no")


def test_pipeline_balance_string_is_named():
    layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="argument `balance` must be a list of ints, 'time' or 'memory', got 'speed'"):
        PipelineModel(layers, devices=["cpu", "cpu"], balance="speed", sample=torch.randn(2, 4))


@pytest.mark.parametrize("balance", [[1.0, 1.0], [1, True], [1, "1"]])
def test_pipeline_balance_entries_that_are_not_ints_are_a_type_error(balance):
    layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="argument `balance` must hold ints"):
        PipelineModel(layers, devices=["cpu", "cpu"], balance=balance)
