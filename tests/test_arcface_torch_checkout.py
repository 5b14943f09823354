"""shardkit's drop-in against arcface_torch's own PartialFC_V2, on the CPU (one gloo rank,
float64), through benchmarks/arcface_torch_compare.py, and the runner's --check on that
checkout. arcface_torch is not part of this repository: these tests run where
$SHARDKIT_ARCFACE_TORCH names a checkout (insightface at the pinned commit) and skip,
saying so, elsewhere."""

import importlib
import os
import subprocess
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
setup = importlib.import_module("_arcface_torch_setup")
sys.path.remove(BENCH)


def _checkout():
    path = os.environ.get(setup.CHECKOUT_ENV)
    if not path:
        return None, (
            f"needs an arcface_torch checkout: set {setup.CHECKOUT_ENV} to a clone of "
            f"github.com/deepinsight/insightface at {setup.PINNED_COMMIT} (not part of this repository)"
        )
    try:
        root = setup.find_checkout(path)
        setup.check_pinned(root)
    except setup.CheckoutError as err:
        return None, f"{setup.CHECKOUT_ENV}={path}: {err}"
    return root, None


ROOT, WHY = _checkout()
pytestmark = pytest.mark.skipif(ROOT is None, reason=WHY or "")


@pytest.fixture(scope="module")
def compare_module():
    saved = list(sys.path)
    sys.path.insert(0, BENCH)
    try:
        yield importlib.import_module("arcface_torch_compare")
    finally:
        sys.path[:] = saved


SIZES = dict(classes=301, dim=128, batch=17)  # D = 128: no row's loss reaches PartialFC_V2's cap (see below)
# float64 rounding: a well-classified row's loss and gradient are differences of terms of the
# logits' scale (64), so they round at ~64 x 1e-16 however small they are (1e-10 "trained")
FLOOR = 64 * 1e-14


def agree(r, key, pair, tol=1e-12):
    return r[f"{key}:{pair}"] * r[f"{key}:norm"] <= tol * r[f"{key}:norm"] + FLOOR


@pytest.mark.parametrize("regime", ["init", "trained"])
def test_cosface_first_step_equals_partial_fc_v2(compare_module, regime):
    # CosFace at sample rate 1: the same math; float64 on the CPU agrees to rounding.
    seed = int(torch.randint(0, 2**31, ()))
    r = compare_module.compare(ROOT, "cosface", regime, seed=seed, **SIZES)
    assert r["same_init"], "the drop-in must draw PartialFC_V2's weights under the same seed"
    for key in ("loss", "grad_x", "grad_w"):
        assert agree(r, key, "theirs_vs_shardkit") and agree(r, key, "shardkit_vs_exact"), (key, r)


@pytest.mark.parametrize("regime", ["init", "trained"])
def test_arcface_gradient_is_partial_fc_v2_straight_through(compare_module, regime):
    # ArcFace: the same loss; PartialFC_V2's gradient is the float64 straight-through
    # reference (margin derivative taken as 1), the drop-in's the exact one; they differ.
    seed = int(torch.randint(0, 2**31, ()))
    r = compare_module.compare(ROOT, "arcface", regime, seed=seed, **SIZES)
    assert agree(r, "loss", "theirs_vs_shardkit"), r
    for key in ("grad_x", "grad_w"):
        assert agree(r, key, "theirs_vs_straight-through") and agree(r, key, "shardkit_vs_exact"), (key, r)
        assert r[f"{key}:theirs_vs_shardkit"] >= 0.05, (key, r)  # the documented difference is there
    # psi'(cos theta_y) = sin(theta_y + m) / sin(theta_y): about cos(0.5) = 0.88 at random angles,
    # about 1.85 at cos theta_y = 0.9
    assert r["psi_prime_mean"] == pytest.approx(0.88 if regime == "init" else 1.85, abs=0.1)


def test_loss_cap_of_partial_fc_v2(compare_module):
    # PartialFC_V2 clamps p_y at 1e-30 before its log: rows whose loss exceeds 69.08 count as
    # 69.08 (their gradient is not capped). At D = 16 with random angles some rows are there.
    r = compare_module.compare(ROOT, "arcface", "init", classes=2000, dim=16, batch=64, seed=5)
    assert r["loss:theirs_vs_straight-through"] > 1e-6 and agree(r, "grad_x", "theirs_vs_straight-through")


def test_checkpoints_load_both_ways(compare_module):
    from shardkit.softmax.partial_fc import PartialFC_V2

    theirs_cls, margin_cls = compare_module.their_classes(ROOT)
    device = torch.device("cpu")
    with compare_module.single_process_group(device), compare_module.their_forward_context(device, torch.float32):
        theirs = theirs_cls(margin_cls(64, 1.0, 0.5, 0.0), 8, 20, 1.0, False)
        ours = PartialFC_V2(margin_cls(64, 1.0, 0.5, 0.0), 8, 20)
        ours.load_state_dict(theirs.state_dict())
        assert torch.equal(ours.weight.detach(), theirs.weight.detach())
        with torch.no_grad():
            ours.weight.mul_(2.0)
        theirs.load_state_dict(ours.state_dict())
        assert torch.equal(ours.weight.detach(), theirs.weight.detach())


def test_runner_check_loads_the_checkout():
    # train_v2.py's modules load here with the runner's stand-ins and torch shim (a subprocess:
    # the stand-ins live in its sys.modules)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.environ.get("PYTHONPATH")] + sys.path if p))
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH, "arcface_torch_run.py"), "--arcface-torch", ROOT, "--check"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"pinned": true' in proc.stdout and '"rec": "synthetic"' in proc.stdout


def test_iresnet50_is_arcface_torch_layout():
    # shardkit.train's iresnet50 (written from the architecture's description) holds the same
    # tensors in the same order as arcface_torch's iresnet50, and with its weights computes
    # the same embeddings (eval mode, float64, one 112x112 image)
    from shardkit.train.models import build_backbone

    theirs_mod = setup.load_file_module(ROOT, "backbones/iresnet.py")
    theirs = theirs_mod.iresnet50(False, num_features=512).double().eval()
    ours = build_backbone("iresnet50", 512).double().eval()
    ts, os_ = theirs.state_dict(), ours.state_dict()
    assert [v.shape for v in ts.values()] == [v.shape for v in os_.values()]
    with torch.no_grad():
        for t in ts.values():  # fresh statistics and weights, so that every layer matters
            t.copy_(torch.rand_like(t.double()).to(t.dtype) + 0.5 if t.dtype.is_floating_point else t)
    ours.load_state_dict(dict(zip(os_.keys(), ts.values())))
    x = torch.randn(1, 3, 112, 112, dtype=torch.float64)
    with torch.no_grad():
        a, b = theirs(x), ours(x)
    assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), float((a - b).abs().max())
