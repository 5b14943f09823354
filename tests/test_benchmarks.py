"""The benchmark scripts keep working with the library they measure: every script imports,
and bench_sharded_loss's shardkit step (how every GPU and CPU figure of the head is taken)
builds and runs. A library change that breaks a benchmark (as refusing "meta" shards once
silently emptied the head's rows) fails here, not on the next GPU run."""

import importlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
SCRIPTS = sorted(f[:-3] for f in os.listdir(BENCH) if f.endswith(".py"))


@pytest.fixture(scope="module")
def bench_path():
    sys.path.insert(0, BENCH)
    yield
    sys.path.remove(BENCH)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_benchmark_script_imports(bench_path, name):
    module = importlib.import_module(name)
    if name.startswith("bench_"):
        assert callable(getattr(module, "main", None)), f"{name} has no main()"


@pytest.mark.parametrize("method", ["shardkit", "shardkit+checks"])
def test_the_sharded_loss_benchmark_runs_shardkit(bench_path, method):
    bench = importlib.import_module("bench_sharded_loss")
    seed = int(torch.randint(0, 2**31, ()).item())
    torch.manual_seed(seed)
    step, params = bench.build_step(method, 9, 101, 16, torch.float32, torch.device("cpu"))
    torch.manual_seed(seed)  # build_step draws x, then the labels: draw them again
    x_ref = torch.randn(9, 16, requires_grad=True)
    y_ref = torch.randint(0, 101, (9,))
    loss = step()
    x, *shards = params
    w = torch.cat([s.detach() for s in shards])
    assert w.abs().max() <= 16**-0.5 and w.std() > 0.1 * 16**-0.5  # drawn on the device, not left empty
    ref = F.cross_entropy(x_ref @ w.T, y_ref)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-6)
    assert all(s.grad is not None for s in shards)
