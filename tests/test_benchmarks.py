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
    # The scripts put their own folder (and, with an in-place build, ../python) on sys.path:
    # restore it, so later tests (and the processes they spawn) import what they imported before.
    saved = list(sys.path)
    sys.path.insert(0, BENCH)
    yield
    sys.path[:] = saved


def test_scripts_use_the_installed_shardkit_without_an_in_place_build(tmp_path):
    # a copy of the benchmarks next to a source tree with no built extension: the script must
    # not put that tree first (it would shadow the installed package with one lacking _C)
    import shutil
    import subprocess

    shutil.copytree(BENCH, tmp_path / "benchmarks", ignore=shutil.ignore_patterns("out", "__pycache__"))
    (tmp_path / "python" / "shardkit").mkdir(parents=True)
    (tmp_path / "python" / "shardkit" / "__init__.py").write_text("raise ImportError('the source tree, no _C')\n")
    import shardkit

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(shardkit.__file__)))
    for script in ("bench_sharded_loss.py", "bench_normalize.py", "bench_parallel.py"):
        r = subprocess.run(
            [sys.executable, str(tmp_path / "benchmarks" / script), "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert r.returncode == 0, (script, r.stderr[-800:])


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_benchmark_script_imports(bench_path, name):
    module = importlib.import_module(name)
    if name.startswith("bench_"):
        assert callable(getattr(module, "main", None)), f"{name} has no main()"


@pytest.mark.parametrize("method", ["shardkit", "shardkit+checks", "shardkit@full", "shardkit@50%", "shardkit@2KiB"])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_master_weights_step_is_sgd_with_momentum_through_fp32_copies(bench_path, dtype, monkeypatch):
    bench = importlib.import_module("bench_sharded_loss")
    monkeypatch.setattr(bench, "MASTER_LR", 0.5)  # steps well above a bf16 weight's rounding
    torch.manual_seed(int(torch.randint(0, 2**31, ()).item()))
    step, params = bench.build_step("shardkit", 7, 53, 16, dtype, torch.device("cpu"), master=True)
    _, *shards = params
    w0 = [s.detach().double().clone() for s in shards]
    step()
    g1 = [s.grad.double() for s in shards]
    step()
    g2 = [s.grad.double() for s in shards]
    lr, mu = bench.MASTER_LR, bench.MASTER_MOMENTUM
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3 * 16**-0.5)
    for s, w, a, b in zip(shards, w0, g1, g2):
        expected = w - lr * a - lr * (mu * a + b)  # two momentum steps from a zero buffer
        assert s.dtype == dtype
        torch.testing.assert_close(s.detach().double(), expected, **tol)
        assert not torch.equal(s.detach().double(), w)  # the update moved the weights


def test_the_largest_classes_search_runs_with_master_weights_on_the_cpu(bench_path):
    bench = importlib.import_module("bench_sharded_loss")
    res = bench.max_classes("shardkit", 4, 8, "fp32", torch.device("cpu"), 120, 1000, 2000, master=True)
    assert res["complete"], res
    assert [p["classes"] for p in res["probes"]] == [1000, 2000] and all(p["ok"] for p in res["probes"]), res
    assert res["largest"] == 2000


def test_the_budget_specs_grant_what_they_say(bench_path):
    from shardkit.ops import kept_bytes
    from shardkit.softmax.budget import shard_budgets

    methods = importlib.import_module("_sharded_loss_methods")
    for shards, batch, classes in ((1, 9, 101), (3, 7, 10), (4, 5, 1003)):
        # (CUDA keeps 16-bit logits for 16-bit inputs: "full" is about half the fp32 size there.)
        for dtype, device in ((torch.float32, "cpu"), (torch.bfloat16, "cpu"), (torch.bfloat16, "cuda")):
            full = methods.budget_bytes("full", batch, classes, dtype, shards, device)
            sizes = [classes // shards + (k < classes % shards) for k in range(shards)]
            fake = [torch.empty(c, 1) for c in sizes]  # one device: the shards share its budget
            for size, granted in zip(sizes, shard_budgets(full, fake)):
                assert granted >= kept_bytes(batch, size, 1, 1 << 62, dtype, device)  # every class of every shard
            assert methods.budget_bytes("50%", batch, classes, dtype, shards, device) == full // 2
        full32 = methods.budget_bytes("full", batch, classes, torch.float32, shards)
        full16 = methods.budget_bytes("full", batch, classes, torch.bfloat16, shards, "cuda")
        assert full16 < full32 <= 2 * full16
    assert methods.budget_bytes("1MiB", 9, 101, torch.float32) == 1 << 20
    assert methods.budget_of("shardkit@25%") == "25%" and methods.budget_of("shardkit") is None
    for bad in ("0%", "101%", "lots", "-1"):
        with pytest.raises(ValueError):
            methods.check_budget_spec(bad)


def test_the_baseline_is_timed_interleaved_with_each_method(bench_path):
    bench = importlib.import_module("bench_sharded_loss")
    calls = []
    times, floor = bench.time_interleaved(
        lambda: calls.append("m"), lambda: calls.append("g"), torch.device("cpu"), repeat=4
    )
    assert len(times) == len(floor) == 4
    assert calls == ["m", "g"] * 6  # two warm-up pairs, then method and baseline alternate
    row = bench.summarize({"times_s": [2.0, 4.0, 3.0], "floor_times_s": [1.0, 2.0, 2.0], "extra_mib": 0.0})
    assert row["time_s"] == 3.0 and row["gemm_floor_s"] == 2.0 and row["gemm_ratio"] == 1.5
    assert (row["gemm_ratio_p25"], row["gemm_ratio_p75"]) == (1.75, 2.0)  # of the pairs 2, 2, 1.5


@pytest.mark.parametrize("margin", ["none", "arcface"])
def test_the_host_overhead_benchmark_times_each_method_and_its_steps_learn(bench_path, tmp_path, margin):
    bench = importlib.import_module("bench_host_overhead")
    out = tmp_path / "host.json"
    argv = ["--shape", "5", "67", "16", "--steps", "3", "--warmup", "1", "--margin", margin, "--json", str(out)]
    rows = bench.main(argv)
    assert [r["method"] for r in rows] == list(bench.METHODS)
    for r in rows:
        assert 0 < r["issue_us"] <= r["whole_us"] and r["kernels"] is None  # no kernel count on the CPU
    import json

    assert json.loads(out.read_text())["rows"] == rows
    # each method's step is a real forward + backward: the op's and the module's gradients agree
    grads = []
    for method in ("op", "module"):
        torch.manual_seed(3)
        step, params = bench.make_step(method, 5, 67, 16, torch.float64, torch.device("cpu"), None)
        step()
        grads.append([p.grad.clone() for p in params])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_the_host_overhead_benchmark_names_the_kernels_the_module_adds(bench_path):
    bench = importlib.import_module("bench_host_overhead")
    op = {"method": "op", "kernel_names": {"gemm": (4, 100.0), "where": (1, 2.0)}}
    module = {"method": "module", "kernel_names": {"gemm": (4, 101.0), "where": (3, 7.0), "fill": (2, 3.0)}}
    assert bench.added_kernels([op, module]) == "where x2 (+5.0); fill x2 (+3.0)"
    assert bench.added_kernels([op, {"method": "module", "kernel_names": op["kernel_names"]}]) == "none"
    assert bench.added_kernels([{"method": "op", "kernel_names": None}]) == ""  # the CPU: no kernel list
