"""benchmarks/arcface_torch_run.py without arcface_torch and without a GPU: its arguments, the
checkout and pin checks, the class-count search and the loss-curve summary on made-up runs,
and whole child runs of a stand-in checkout (a few lines of our own that call the head, the
config and the optimizer the way train_v2.py does) on the CPU."""

import importlib
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture(scope="module")
def runner():
    saved = list(sys.path)
    sys.path.insert(0, BENCH)
    try:
        yield importlib.import_module("arcface_torch_run")
    finally:
        sys.path[:] = saved


@pytest.fixture(scope="module")
def search():
    saved = list(sys.path)
    sys.path.insert(0, BENCH)
    try:
        yield importlib.import_module("_arcface_torch_search")
    finally:
        sys.path[:] = saved


# A stand-in checkout: the layout and entry points the runner relies on, our own code.
STANDIN = {
    "train_v2.py": """
        import sys
        import torch
        from losses import CombinedMarginLoss
        from partial_fc_v2 import PartialFC_V2
        from utils.utils_config import get_config

        cfg = get_config(sys.argv[1])
        torch.manual_seed(cfg.seed)
        backbone = torch.nn.Linear(8, cfg.embedding_size)
        head = PartialFC_V2(CombinedMarginLoss(64, *cfg.margin_list), cfg.embedding_size, cfg.num_classes,
                            cfg.sample_rate, False)
        opt = torch.optim.SGD([{"params": backbone.parameters()}, {"params": head.parameters()}], lr=cfg.lr,
                              momentum=0.9, weight_decay=cfg.weight_decay)
        for step in range(1000):
            images = torch.randn(cfg.batch_size, 8)
            loss = head(backbone(images), torch.randint(0, cfg.num_classes, (cfg.batch_size,)))
            loss.backward()
            opt.step()
            opt.zero_grad()
    """,
    "partial_fc_v2.py": """
        import torch

        class PartialFC_V2(torch.nn.Module):  # a plain softmax head; "out of memory" above 5000 classes
            def __init__(self, margin_loss, embedding_size, num_classes, sample_rate=1.0, fp16=False):
                super().__init__()
                if num_classes > 5000:
                    raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
                self.weight = torch.nn.Parameter(torch.normal(0, 0.01, (num_classes, embedding_size)))

            def forward(self, x, labels):
                return torch.nn.functional.cross_entropy(x @ self.weight.t(), labels)
    """,
    "losses.py": """
        class CombinedMarginLoss:
            def __init__(self, s, m1, m2, m3, interclass_filtering_threshold=0):
                self.s, self.m1, self.m2, self.m3 = s, m1, m2, m3
                self.interclass_filtering_threshold = interclass_filtering_threshold
    """,
    "configs/__init__.py": "",
    "configs/base.py": """
        from easydict import EasyDict
        config = EasyDict()
        config.weight_decay = 5e-4
        config.lr = 0.1
        config.seed = 2048
    """,
    "configs/3millions.py": """
        from easydict import EasyDict
        config = EasyDict()
        config.rec = "synthetic"
        config.num_classes = 300000
        config.sample_rate = 0.1
        config.margin_list = (1.0, 0.0, 0.4)
    """,
    "utils/__init__.py": "",
    "utils/utils_config.py": """
        import importlib

        def get_config(path):
            cfg = importlib.import_module("configs.base").config
            cfg.update(importlib.import_module("configs." + path.split("/")[-1]).config)
            return cfg
    """,
}


@pytest.fixture
def standin(tmp_path):
    root = tmp_path / "insightface" / "recognition" / "arcface_torch"
    for rel, text in STANDIN.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def test_arguments(runner, standin, capsys):
    args = runner.parse_args(["--arcface-torch", str(standin.parent.parent), "--classes", "1e6,10000000"])
    assert args.arcface_torch == str(standin)  # an insightface root is followed to its arcface_torch
    assert args.classes == [1_000_000, 10_000_000] and args.head == ["pfc", "shardkit"] and args.fp16
    args = runner.parse_args(
        [
            "--arcface-torch",
            str(standin),
            "--head",
            "shardkit-sparse,pfc",
            "--sample-rate",
            "1,0.1",
            "--batch",
            "128,512",
        ]
    )
    grid = runner.settings(args)
    assert len(grid) == 8 and {s["head"] for s in grid} == {"pfc", "shardkit-sparse"}
    assert [s["head"] for s in grid[:2]] == ["shardkit-sparse", "pfc"] and grid[0]["batch"] == grid[1]["batch"]
    over = runner.config_overrides(grid[0], args, "/tmp/w")
    assert over["margin_list"] == (1.0, 0.0, 0.4) and over["rec"] == "synthetic" and over["val_targets"] == []
    bad = [
        (["--head", "pfc,fast"], "heads must be among pfc, shardkit, shardkit-sparse"),
        (["--sample-rate", "0"], "sample rates must be in (0, 1]"),
        (["--classes", "0"], "must be integers >= 1"),
        (["--batch", "x"], "not a comma-separated list of integers"),
        (["--steps", "0"], "argument --steps: must be >= 1"),
        (["--resolution", "1.5"], "argument --resolution: must be in (0, 1)"),
        (["--arcface-torch", str(standin.parent)], "holds no train_v2.py and partial_fc_v2.py"),
        # an OverflowError traceback, a truncation to 1, no check, a failure after every run
        (["--classes", "inf"], "argument --classes: must be whole numbers, got 'inf'"),
        (["--classes", "1e6,1.7"], "argument --classes: must be whole numbers, got '1e6,1.7'"),
        (["--batch", "nan"], "argument --batch: must be whole numbers"),
        (["--timeout", "-1"], "argument --timeout: must be a finite number of seconds > 0, got -1.0"),
        (["--timeout", "nan"], "argument --timeout: must be a finite number of seconds > 0, got nan"),
        (["--out", str(standin / "no" / "such" / "r.json")], "argument --out: the folder of"),
        (["--out", str(standin)], "is a folder; give the JSON file's path"),
    ]
    for extra, message in bad:
        with pytest.raises(SystemExit) as err:
            runner.parse_args(["--arcface-torch", str(standin)] + extra)
        assert err.value.code == 2
        assert message in capsys.readouterr().err


def test_pin_check(runner, standin):
    setup = sys.modules["_arcface_torch_setup"]
    with pytest.raises(setup.CheckoutError, match=r"differs from the pinned arcface_torch .* in train_v2.py, "):
        setup.check_pinned(str(standin))
    info = setup.check_pinned(str(standin), allow_other=True)
    assert not info["pinned"] and "partial_fc_v2.py" in info["mismatched"] and "dataset.py" in info["mismatched"]
    path = standin / "losses.py"
    git = subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True)
    if git.returncode == 0:  # our blob id is git's
        assert setup.git_blob_id(str(path)) == git.stdout.strip()


def _fake_run(limit, total=80e9, fixed=6e9, per_class=8000.0):
    """A run that fits up to ``limit`` classes; its peak grows linearly as a head's does."""
    calls = []

    def run(setting):
        calls.append(setting)
        c = setting["classes"]
        assert setting["steps"] >= 2
        if c > limit:
            return dict(setting, status="oom")
        return dict(setting, status="ok", peak_reserved=fixed + per_class * c, device_total=total)

    return run, calls


@pytest.mark.parametrize("start", [1_000_000, 20_000_000])
def test_max_class_search_brackets_the_limit(search, start):
    limit = 7_123_457  # memory full at (80e9 - 6e9) / 8000 = 9.25M; the "device" fails earlier
    run, calls = _fake_run(limit)
    args = SimpleNamespace(classes=[start], max_probes=8, resolution=0.03)
    out = search.search_max_classes(dict(head="pfc", sample_rate=0.1, batch=128, seed=1), run, args)
    assert out["largest_fit"] <= limit < out["smallest_oom"]
    assert out["smallest_oom"] <= out["largest_fit"] * 1.03 or len(calls) >= 2 + args.max_probes
    assert all(p["status"] in ("ok", "oom") for p in out["probes"]) and len(out["probes"]) == len(calls)
    if start == 1_000_000:
        assert out["predicted"] == pytest.approx(9.25e6, rel=1e-3)


def test_max_class_search_stops_on_an_error(search):
    def run(setting):
        return dict(setting, status="error", error="boom")

    out = search.search_max_classes(
        dict(head="pfc"), run, SimpleNamespace(classes=[1000], max_probes=4, resolution=0.03)
    )
    assert out["largest_fit"] is None and out["probes"][0]["error"] == "boom" and len(out["probes"]) == 1


def test_loss_curve_summary(search):
    runs = []
    for seed, shift in ((1, 0.0), (2, 0.2)):
        runs.append(dict(head="pfc", classes=10, sample_rate=1.0, batch=4, seed=seed, status="ok",
                         losses=[5.0 + shift, 4.0 + shift, 3.0 + shift]))  # fmt: skip
        runs.append(dict(head="shardkit", classes=10, sample_rate=1.0, batch=4, seed=seed, status="ok",
                         losses=[5.0 + shift, 4.1 + shift, 3.5 + shift]))  # fmt: skip
    (entry,) = search.loss_curve_summary(runs)
    assert entry["first_loss"][1]["rel_diff"] == 0.0
    assert entry["steps"] == 3 and entry["steps_within_spread"] == 2  # 0.5 at the last step > spread 0.2
    assert entry["max_gap"] == pytest.approx(0.5)


def _child_run(runner, standin, *extra):
    args = runner.parse_args(["--arcface-torch", str(standin), "--allow-unpinned", "--steps", "3", "--warmup", "1"])
    args.timeout = 300.0
    setting = dict(head=extra[0], classes=extra[1], sample_rate=extra[2], batch=4, seed=3)
    return runner.run_one(setting, args)


def test_child_runs_the_script_with_each_head(runner, standin):
    for head, rate, optimizer in (
        ("pfc", 1.0, "SGD"),
        ("shardkit", 0.5, "SGD"),
        ("shardkit-sparse", 0.5, "SparseRowSGD"),
    ):
        cls = {"pfc": "partial_fc_v2.PartialFC_V2", "shardkit": "shardkit.softmax.partial_fc.PartialFC_V2"}.get(
            head, "shardkit.softmax.partial_fc.SparseRowPartialFC_V2"
        )
        res = _child_run(runner, standin, head, 3000, rate)
        assert res["status"] == "ok", res.get("error")
        assert res["timed_steps"] == 3 and res["images_per_s"] > 0 and len(res["losses"]) == 4
        assert res["optimizer"] == optimizer and res["head_class"] == cls
        assert "easydict" in res["stubs"] or importlib.util.find_spec("easydict") is not None
        assert res["checkout"]["pinned"] is False and res["device"] == (
            "cpu" if not torch.cuda.is_available() else res["device"]
        )
    oom = _child_run(runner, standin, "pfc", 6000, 1.0)
    assert oom["status"] == "oom" and "out of memory" in oom["error"]


def test_step_probe_waits_for_optimizer_steps(runner):
    setup = sys.modules["_arcface_torch_setup"]
    probe = setup.StepProbe(warmup=1, steps=2, batch=4, min_optimizer_steps=2, max_calls=10)
    calls = 0
    with pytest.raises(setup.StopRun):
        while True:
            calls += 1
            probe.before_forward()
            if calls >= 5:  # the first four steps were skipped (as fp16's GradScaler does)
                probe.after_optimizer_step("opt")
    res = probe.result()
    assert calls == 7 and res["optimizer_steps"] == 2 and res["enough_optimizer_steps"] and res["timed_steps"] == 5
    probe = setup.StepProbe(warmup=0, steps=1, batch=4, min_optimizer_steps=1, max_calls=3)
    with pytest.raises(setup.StopRun):
        for _ in range(10):
            probe.before_forward()
    assert probe.calls == 3 and not probe.result()["enough_optimizer_steps"]
