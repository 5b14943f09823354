"""shardkit.parallel under arguments of the wrong kind: a module that is not an nn.Module,
device indices that are negative or bools, and PipelineModel inputs that are not dense tensors
on a CPU or CUDA device get errors naming the argument (before: torch's "Device index must not
be negative", True taken as cuda:1, AttributeError / internal errors at the first call)."""

import pytest
import torch
from torch import nn

from shardkit.parallel import DataParallelCriterion, DataParallelModel, PipelineModel


@pytest.mark.parametrize("cls", [DataParallelModel, DataParallelCriterion])
@pytest.mark.parametrize("device_ids", [None, ["cpu", "cpu"]])
@pytest.mark.parametrize("module", [None, "model", lambda x: x])
def test_module_must_be_a_module(cls, device_ids, module):
    with pytest.raises(TypeError, match="argument `module` must be an nn.Module, got"):
        cls(module, device_ids)


@pytest.mark.parametrize("cls", [DataParallelModel, DataParallelCriterion])
@pytest.mark.parametrize("ids", [[-1], [0, -2], [True], [False, 1]])
def test_device_ids_negative_or_bool_are_named(cls, ids):
    with pytest.raises(ValueError, match=r"argument `device_ids`: not a device: (-\d|True|False)"):
        cls(nn.Linear(2, 2), ids)


@pytest.mark.parametrize("out", [-1, True])
def test_output_device_negative_or_bool_is_named(out):
    with pytest.raises(ValueError, match=r"argument `output_device`: not a device"):
        DataParallelCriterion(nn.MSELoss(), ["cpu", "cpu"], output_device=out)


@pytest.mark.parametrize("kwargs", [dict(devices=[-1, -1]), dict(devices=[True, 0]), dict(output_device=-3)])
def test_pipeline_device_indices_are_named(kwargs):
    args = dict(devices=["cpu", "cpu"])
    args.update(kwargs)
    name = "devices" if "devices" in kwargs else "output_device"
    with pytest.raises(ValueError, match=rf"argument `{name}`: not a device"):
        PipelineModel(nn.Sequential(nn.Linear(3, 3), nn.Tanh()), **args)


def _pipeline():
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    return layers, PipelineModel(layers, ["cpu", "cpu"], chunks=3)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: torch.randn(5, 4, dtype=torch.float64, device="meta"), ValueError, "argument `x` is on meta"),
        (lambda: torch.randn(5, 4, dtype=torch.float64).to_sparse(), TypeError, "dense .* got a torch.sparse_coo"),
        (
            lambda: torch.nested.nested_tensor([torch.randn(4, dtype=torch.float64)] * 3),
            TypeError,
            "dense .* got a nested one",
        ),
    ],
)
def test_pipeline_input_must_be_dense_on_a_device_it_computes_on(make, error, match):
    _, model = _pipeline()
    with pytest.raises(error, match=match):
        model(make())


def test_pipeline_still_takes_odd_and_strided_batches():
    layers, model = _pipeline()

    def by_micro_batch(x):  # bit-exact: a matmul's rounding may depend on its row count
        return torch.cat([layers(c) for c in x.tensor_split(min(3, x.shape[0]))])

    for x in (torch.randn(7, 4, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64).t()):
        torch.testing.assert_close(model(x), by_micro_batch(x), rtol=0, atol=0)
    x = torch.randn(4, 9, dtype=torch.float64).t()  # non-contiguous, 9 rows in 3 micro-batches
    torch.testing.assert_close(model(x), by_micro_batch(x), rtol=0, atol=0)
