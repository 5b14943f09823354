"""GPU tests of the fused sm90 kernels of the sharded cross-entropy (``SHARDKIT_FUSED=1``):
the GEMM whose epilogue folds each logits tile into row statistics, and the one that writes
the dlogits. They must run where they apply (checked in the profiler's kernel list), fall
back where they do not, and give torch's accuracy: every output and gradient within 2x the
error of torch's own bf16 / fp16 computation from the float64 reference. Skipped, with the
reason, where the build has no fused kernels or the GPU is not of compute capability 9.0."""

import math

import pytest
import torch
from softmax_checks import (
    MARGINS,
    check_low_precision,
    check_module_low_precision,
    count_bracket,
    gradient_weights,
    kw,
    make_case,
    ref_stats,
    rel,
    weighted,
)

import shardkit
from shardkit.ops import ce_shard_stats, chunk_classes_for_budget

pytestmark = pytest.mark.gpu


def _why_not():
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    if not shardkit.build_info()["fused_kernels"]:
        return "this build has no fused kernels (no CUTLASS headers at build time)"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return f"the fused kernels need a compute-capability 9.0 GPU (H100 / H200), this one is {cap}"
    return None


# The fused variants every test here runs on: the default (cooperative [128, 256] tiles, the one
# kernel set: ping-pong [128, 128] tiles took 3-22% longer at five shapes and were removed), each
# kernel launched as a programmatic dependent of the previous one, and the backward's dX / dW
# GEMMs on a second stream (both off by default, for measuring each alone).
VARIANTS = {
    "default": {},
    "pdl": {"SHARDKIT_FUSED_PDL": "1"},
    "overlap": {"SHARDKIT_FUSED_OVERLAP": "1"},
}
SWITCHES = {"SHARDKIT_FUSED_PDL": "0", "SHARDKIT_FUSED_OVERLAP": "0"}
# The names of the fused GEMM kernels: (forward, backward).
GEMM_KERNELS = ("sce_forward_gemm_128x256_cooperative", "sce_backward_gemm_128x256_cooperative")


@pytest.fixture(autouse=True, params=list(VARIANTS))
def variant(request, monkeypatch):
    why = _why_not()
    if why:
        pytest.skip(why)
    monkeypatch.setenv("SHARDKIT_FUSED", "1")
    for name, value in {**SWITCHES, **VARIANTS[request.param]}.items():
        monkeypatch.setenv(name, value)
    return request.param


def _kernel_events(fn):
    """The CUDA kernel events of what ``fn`` launches (name, stream: ``device_resource_id``)."""
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _kernels(fn):
    """Names of the CUDA kernels ``fn`` launches."""
    return " ".join(e.name for e in _kernel_events(fn))


def _fwd_bwd(x, w, labels, **k):
    xx, ww = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    lse, t, s, _ = ce_shard_stats(xx, ww, labels, chunk_classes=1000, **k)
    (lse.sum() - t.sum() + 0.1 * s.sum()).backward()


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_fused_kernels_run_where_they_apply(monkeypatch, variant, wdtype):
    x = torch.randn(100, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3000, 128, device="cuda", dtype=wdtype)
    labels = torch.randint(0, 3000, (100,), device="cuda")
    names = _kernels(lambda: _fwd_bwd(x, w, labels, **kw("arcface")))
    assert "merge_tiles_kernel" in names and "fix_target_kernel" in names
    assert "row_stats" not in names and "dlogit" not in names
    # The fused GEMMs ran (named for what they run).
    fwd, bwd = GEMM_KERNELS
    assert fwd in names and bwd in names, (fwd, bwd, names)
    # D not a multiple of 64, fp32 inputs, and SHARDKIT_FUSED=0 take the unfused kernels.
    for xx, ww, flag in ((x[:, :96], w[:, :96], "1"), (x.float(), w.float(), "1"), (x, w, "0")):
        monkeypatch.setenv("SHARDKIT_FUSED", flag)
        names = _kernels(lambda: _fwd_bwd(xx.contiguous(), ww.contiguous(), labels, **kw("arcface")))
        assert "merge_tiles_kernel" not in names and "row_stats" in names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(MARGINS))
@pytest.mark.parametrize(
    "shape,chunk",
    [
        ((33, 64, 257), 60),  # tiles of a few columns, several chunks
        ((300, 128, 5000), 1000),  # rows across three row tiles, the last partial
        ((129, 512, 3001), None),  # one chunk, a partial column tile
        ((256, 64, 1096), None),  # full tiles of 16-byte dlogit stores (rows of 8k), a partial one
    ],
)
def test_fused_within_twice_torch(dtype, name, shape, chunk):
    check_low_precision("cuda", dtype, name, chunk=chunk, shape=shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(MARGINS))
def test_fused_tiles_without_targets(dtype, name):
    # Every target among the first 256 classes: the other column tiles hold no row's target
    # (the forward epilogue's short form, as nearly every tile at large C), the first holds many,
    # the last is partial and so is the last row tile.
    check_low_precision("cuda", dtype, name, chunk=None, shape=(300, 128, 5000), labels_below=256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_cosface_scale_64(dtype):
    check_low_precision("cuda", dtype, "cosface64", margin=(64.0, 1.0, 0.0, 0.35, True), shape=(260, 256, 4100))


@pytest.mark.parametrize("name", ["plain", "arcface", "combined"])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("spread", [None, 600])
def test_fused_matches_unfused_outside_targets_and_count(monkeypatch, name, wdtype, spread):
    # A shard at class offset 500: a third of the rows have their target elsewhere (no target
    # logit here; spread 600: labels below 600, so most rows and all column tiles but the first
    # hold no target), the count against a reference logit, mixed mode (fp32 w) too. The fused
    # results must match the unfused kernels' (the same bf16 inputs, fp32 accumulation in both)
    # and the count must lie in the float64 bracket of the logits of the GEMM's own inputs: x
    # (normalized in fp32 and rounded to bf16 when normalizing, as both kernels do) and w's bf16
    # rows (times 1 / |w_j| when normalizing).
    B, D, C, off = 257, 192, 2345, 500
    x32, w32, labels = make_case(B, D, C, off)
    if spread:
        labels = torch.randint(0, spread, (B,))
    x, w = x32.to("cuda", torch.bfloat16), w32.to("cuda", wdtype)
    k = kw(name)
    xr, wr = x.double().cpu(), w.to(torch.bfloat16).double().cpu()
    r_t = ref_stats(xr, wr, labels, off, **k)[1]
    if k["normalize"]:
        # As both kernels do: the norm of the fp32 row from float64 squares, rounded to fp32, the
        # division in fp32, then bf16. (An fp32 norm here differs in its last bit now and then,
        # which moves an element of the bf16 row by a bf16 unit and a logit by ~1e-3, ten times
        # the count's band.)
        xf = x.float()
        nrm = xf.double().norm(dim=1, keepdim=True).clamp_min(1e-12).float()
        xin = (xf / nrm).to(torch.bfloat16).double().cpu()
        plain = k["scale"] * (xin @ wr.t()) / wr.norm(dim=1).clamp_min(1e-12)
    else:
        plain = k["scale"] * (xr @ wr.t())
    tref = (r_t + 0.3 * torch.randn(B, dtype=torch.float64)).float()
    weights = gradient_weights(B, C)  # each statistic's gradient alone, and the module's loss's
    got = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("SHARDKIT_FUSED", flag)
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = ce_shard_stats(xx, ww, labels.cuda(), class_offset=off, chunk_classes=700, target_ref=tref.cuda(), **k)
        got[flag] = [o.detach().float().cpu() for o in out]
        for what, g in weights.items():
            grads = torch.autograd.grad(weighted(out[:3], g), (xx, ww), retain_graph=True)
            got[flag] += [t.float().cpu() for t in grads]
    fused, unfused = got["1"], got["0"]
    for a, b in zip(fused[:3], unfused[:3]):
        assert rel(a, b, 1.0) <= 2e-5, rel(a, b, 1.0)
    lo, hi = count_bracket(plain, tref)
    assert ((fused[3] >= lo) & (fused[3] <= hi)).all()
    # (bf16 dlogits from the same fp32 logits up to summation order: rarely a last bit apart.)
    floor = 1e-6 * k["scale"] * math.sqrt(B)
    labels_of = [f"{what} d{t}" for what in weights for t in "xw"]
    for what, a, b in zip(labels_of, fused[4:], unfused[4:]):
        assert torch.isfinite(a).all(), what
        assert rel(a, b, floor) <= 2e-2, (what, rel(a, b, floor))


def test_fused_nan_row_stays_in_its_row(monkeypatch):
    # A NaN embedding makes its own row's statistics NaN, no other row's (as unfused).
    x = torch.randn(140, 64, device="cuda", dtype=torch.bfloat16)
    x[7, 3] = float("nan")
    w = torch.randn(700, 64, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, 700, (140,), device="cuda")
    lse, t, s, _ = ce_shard_stats(x, w, labels, chunk_classes=300, **kw("cosface"))
    bad = torch.zeros(140, dtype=torch.bool, device="cuda")
    bad[7] = True
    assert torch.isnan(lse[bad]).all() and torch.isfinite(lse[~bad]).all() and torch.isfinite(t[~bad]).all()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_fused_non_finite_rows_as_unfused(monkeypatch, value):
    # Plain logits (no normalization) of rows with a NaN or infinite embedding value: NaN, or
    # infinite maxima, which the forward epilogue's short form does not take. Every output and gradient
    # is NaN, infinite or finite where the unfused kernels' are, and the finite ones agree.
    B, D, C = 200, 128, 3000
    x = torch.randn(B, D, device="cuda", dtype=torch.bfloat16)
    x[[5, 77, 150], 3] = value
    w = (torch.randn(C, D, device="cuda") / D**0.5).to(torch.bfloat16)
    labels = torch.randint(0, 256, (B,), device="cuda")
    got = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("SHARDKIT_FUSED", flag)
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = ce_shard_stats(xx, ww, labels, chunk_classes=1000, target_ref=torch.zeros(B, device="cuda"))
        (out[0] - out[1] + 0.1 * torch.nan_to_num(out[2])).sum().backward()
        got[flag] = [o.detach().float().cpu() for o in out] + [xx.grad.float().cpu()]
    for a, b in zip(got["1"], got["0"]):
        assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.isposinf(), b.isposinf())
        assert torch.equal(a.isneginf(), b.isneginf())
        fin = torch.isfinite(a)
        assert rel(a[fin], b[fin], 1.0) <= 2e-2, rel(a[fin], b[fin], 1.0)


@pytest.mark.parametrize("name", ["plain", "arcface"])
def test_fused_forward_walks_larger_chunks(name, variant):
    # The fused backward holds no fp32 logits, so it walks chunks larger than the caller's
    # chunk_classes within the memory the unfused kernels take for them (at most 3x larger
    # here: B fp32 logits and B bf16 dlogits per class there, the dlogits alone here, plus the
    # normalized rows with ArcFace). The fused forward holds only [B, tiles] partials, so it
    # walks larger chunks still, each merged into the running statistics. The results keep
    # torch's accuracy, the forward launches fewer merges than the backward launches dlogit
    # GEMMs, and those are fewer than the caller's 64-class chunks.
    check_low_precision("cuda", torch.bfloat16, name, chunk=64, shape=(100, 128, 5000))
    x = torch.randn(100, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(5000, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 5000, (100,), device="cuda")
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        lse, t, s, _ = ce_shard_stats(x, w, labels, chunk_classes=64, **kw(name))
        (lse - t).sum().backward()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    merges = sum("merge_tiles_kernel" in n for n in names)
    fixes = sum("fix_target_kernel" in n for n in names)
    # (SHARDKIT_FUSED_OVERLAP: two chunks in flight take half-size chunks each.)
    most = math.ceil(5000 / 64) * (2 if VARIANTS[variant].get("SHARDKIT_FUSED_OVERLAP") == "1" else 1)
    assert math.ceil(5000 / (3 * 64)) <= fixes < most, (fixes, most)
    assert 1 < merges < fixes, (merges, fixes)


def test_fused_forward_memory_within_the_backward_chunk():
    # B=1024, 256-class chunks of D=64 over 200k classes (plain: no fp32 copies of x). The
    # unfused kernels would hold 1024 x 256 fp32 logits and bf16 dlogits (1.5 MiB); the fused
    # backward's larger dlogits chunk and the forward's larger chunks still must stay within
    # that (the forward's partials for the whole shard would take 16 MiB).
    B, C, chunk = 1024, 200_000, 256
    x = torch.randn(B, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(C, 64, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, C, (B,), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = ce_shard_stats(x, w, labels, chunk_classes=chunk, **kw("plain"))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert torch.isfinite(out[0]).all()
    assert extra <= B * chunk * 6 + (64 << 10), extra


def test_fused_backward_chunk_within_64_mib(variant):
    # B=1024, D=512, bf16, 100k classes at the default chunk (19,648 classes, sized for the
    # unfused kernels' fp32 logits): the fused backward takes fewer, larger chunks, and the
    # forward and backward together hold at most 64 MiB beyond the weights and gradients.
    B, D, C = 1024, 512, 100_000
    x = torch.randn(B, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(C, D, device="cuda") / D**0.5).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, C, (B,), device="cuda")
    unfused_chunks = math.ceil(C / chunk_classes_for_budget(B, embedding_dim=D, dtype=torch.bfloat16))
    # A step first: the cuBLAS workspaces of the streams it uses stay allocated (per stream, not
    # per call), and do not count.
    lse, t, s, _ = ce_shard_stats(x, w, labels)
    (lse - t + 0.1 * s).sum().backward()
    x.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        lse, t, s, _ = ce_shard_stats(x, w, labels)
        (lse - t + 0.1 * s).sum().backward()
        torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - w.grad.numel() * 2 - x.grad.numel() * 2
    fixes = sum("fix_target_kernel" in e.name for e in prof.events())
    assert torch.isfinite(w.grad.float()).all() and torch.isfinite(x.grad.float()).all()
    # (Two chunks in flight take half-size chunks each.)
    most = unfused_chunks * (2 if VARIANTS[variant].get("SHARDKIT_FUSED_OVERLAP") == "1" else 1)
    assert 1 < fixes < most, (fixes, most)
    assert extra <= 64 << 20, extra / 2**20


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("margin_name", ["plain", "cosface", "arcface"])
@pytest.mark.parametrize("mixed", [False, True])
def test_fused_module_loss_within_twice_torch(dtype, margin_name, mixed):
    # The module's own loss (label smoothing 0.1: the statistics weighted 1, -0.9, -0.1 / C) and
    # both gradients against float64, within 2x torch's own error: two shards of 2,500 classes
    # walked in several chunks, partial row and column tiles, 16-bit weights or fp32 ones under
    # autocast. A backward without its softmax term fails it.
    check_module_low_precision("cuda", dtype, margin_name, shape=(300, 192, 5001), mixed=mixed, chunk_memory="2MiB")


def test_fused_backward_streams(variant):
    # The backward's kernels all on the caller's stream; with SHARDKIT_FUSED_OVERLAP=1 its cuBLAS
    # dX / dW GEMMs (two per chunk) on one other stream, the dlogits GEMMs on the caller's.
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(20_000, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 20_000, (256,), device="cuda")
    lse, t, s, _ = ce_shard_stats(x, w, labels, chunk_classes=2048)
    events = _kernel_events(lambda: torch.autograd.grad((lse - t).sum(), (x, w)))
    _, bwd = GEMM_KERNELS
    fused = {e.device_resource_id for e in events if bwd in e.name or "fix_target_kernel" in e.name}
    chunks = sum("fix_target_kernel" in e.name for e in events)
    streams = {e.device_resource_id for e in events}
    assert len(fused) == 1 and chunks > 2, (fused, chunks)
    if VARIANTS[variant].get("SHARDKIT_FUSED_OVERLAP") == "1":
        assert len(streams) == 2, streams
        side = sum(e.device_resource_id not in fused for e in events)
        assert side >= 2 * chunks, (side, chunks)
    else:
        assert streams == fused, (streams, fused)


CAPTURED_STEP = """
import json, sys
import torch
import shardkit

# cuBLAS and autograd set up by steps that do not touch shardkit (the GEMMs its backward runs:
# bf16 in and out, bf16 in and fp32 out): its first call is the capture.
a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
(a @ a).sum().backward()
torch.mm(a.detach(), a.detach(), out_dtype=torch.float32)
torch.cuda.synchronize()
# argv[1]: the head's check_inputs ("False" by default; "True", the module's default, acts as
# "async" under capture, where its host read would fail the capture).
checks = {"False": False, "True": True, "async": "async"}[sys.argv[1] if len(sys.argv) > 1 else "False"]
head = shardkit.ShardedSoftmaxLoss(
    128, 5000, margin=shardkit.ArcFace(), devices=["cuda"], dtype=torch.bfloat16, check_inputs=checks,
    label_smoothing=0.1, chunk_memory="1MiB",
)
x = torch.randn(96, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
y = torch.randint(0, 5000, (96,), device="cuda")
w = head.weight_shards[0]
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    loss = head(x, y)
    loss.backward()
# New inputs: a kernel left out of the graph would leave the replay's results stale.
with torch.no_grad():
    x.copy_(torch.randn_like(x))
    y.copy_(torch.randint(0, 5000, (96,), device="cuda"))
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    graph.replay()
    torch.cuda.synchronize()
names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
captured = [loss.detach().clone(), x.grad.clone(), w.grad.clone()]
x.grad = None
w.grad = None
eager_loss = head(x, y)
eager_loss.backward()
eager = [eager_loss.detach(), x.grad, w.grad]
torch.cuda.synchronize()
diffs = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(captured, eager)]
print(json.dumps({"names": names, "diffs": diffs}))
"""


@pytest.mark.parametrize("checks", ["False", "True"])
def test_fused_first_call_under_graph_capture(variant, checks):
    # A process whose first sharded-loss call is made while a CUDA graph is captured: the graph
    # runs the fused kernels (the sm_90a probe does not wait on the capturing stream), and
    # replaying it gives the eager step's loss and gradients. With the default check_inputs=True
    # too: under capture the check is the asynchronous assert (a host read would fail the capture).
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run(
        [sys.executable, "-c", CAPTURED_STEP, checks], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stdout + run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    names = " ".join(out["names"])
    fwd, bwd = GEMM_KERNELS
    assert fwd in names and bwd in names and "row_stats" not in names, names
    assert max(out["diffs"]) <= 1e-3, out["diffs"]
