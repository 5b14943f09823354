"""GPU tests of the per-shard ops shardkit::ce_shard_stats / ce_shard_stats_backward (marked
``gpu``: skipped with the reason where no GPU is visible). The CUDA kernels must give the
CPU kernel's results: the same float64 reference and tolerances (fp32 1e-5 with torch's
default of no TF32; bf16 / fp16 within 2x torch's own error)."""

import math

import pytest
import torch
from softmax_checks import (
    MARGINS,
    check_against_reference,
    check_large_scale,
    check_low_precision,
    check_module_low_precision,
    check_plain_by_rows,
    kw,
    make_case,
    opcheck_samples,
    ref_stats,
    rel,
    torch_low_precision_stats,
)
from softmax_reference import margin_psi

import shardkit
from shardkit.ops import ce_shard_stats, chunk_classes_for_budget

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, params=["unfused", "fused"])
def kernel_set(request, monkeypatch):
    # Every test here runs on both CUDA kernel sets of the op: the unfused kernels
    # (SHARDKIT_FUSED=0: cuBLAS logits, column-range statistics, vectorized dlogits, direct
    # 16-bit dW, fp32-accumulated dX), which run where the fused ones do not, and "fused" (the
    # default: the fused sm90 kernels where they apply, 16-bit inputs with D % 64 == 0 on a
    # compute-capability 9.0 GPU; the unfused kernels elsewhere), with the same tolerances.
    monkeypatch.setenv("SHARDKIT_FUSED", "1" if request.param == "fused" else "0")
    return request.param


@pytest.fixture(autouse=True)
def _no_tf32():
    # The 1e-5 tolerances assume true fp32 GEMMs (torch's default); fail loudly otherwise.
    assert not torch.backends.cuda.matmul.allow_tf32, "TF32 matmuls enabled: fp32 tolerances do not apply"


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MARGINS))
@pytest.mark.parametrize(
    "B,D,C,off,chunk",
    [
        (37, 29, 300, 50, 64),
        (256, 128, 5000, 7, 1024),
        (1, 3, 17, 0, 7),
        (9, 5, 0, 0, 4),
        (5, 16, 1, 3, 1),
        (300, 64, 777, 0, None),
        (5, 64, 20011, 3, None),  # one long chunk: rows split into column ranges (second kernels)
        (1030, 32, 4099, 0, None),  # odd row length: rows start off 16-byte boundaries
    ],
)
def test_cuda_matches_reference(name, B, D, C, off, chunk):
    assert shardkit.cuda_built(), "this build has no CUDA kernels"
    x, w, labels = make_case(B, D, C, off, device="cuda")
    check_against_reference(x, w, labels, off, name, chunk)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["plain", "arcface", "combined"])
def test_cuda_low_precision(dtype, name):
    check_low_precision("cuda", dtype, name)


@pytest.mark.gpu
def test_cuda_theta_past_pi_and_noncontiguous():
    w = torch.randn(80, 33, device="cuda")[::2]  # [40, 33], strided rows
    labels = torch.randint(0, 40, (10,), device="cuda")
    x = -w[labels] + 0.05 * torch.randn(10, 33, device="cuda")
    check_against_reference(x, w, labels, 0, "arcface", 16)
    check_against_reference(x.t().contiguous().t(), w, labels, 0, "combined", 5)


@pytest.mark.gpu
def test_cuda_opcheck():
    for x, w, labels, tref, *rest in opcheck_samples():
        args = (
            x.cuda().requires_grad_(),
            w.cuda().requires_grad_(),
            labels.cuda(),
            None if tref is None else tref.cuda(),
            *rest,
        )
        torch.library.opcheck(torch.ops.shardkit.ce_shard_stats.default, args)


@pytest.mark.gpu
def test_cuda_device_errors():
    x, w, labels = make_case(4, 8, 10, 0, device="cuda")
    op = torch.ops.shardkit.ce_shard_stats
    with pytest.raises(RuntimeError, match=r"argument `w` must be on the device of `x`"):
        op(x, w.cpu(), labels, None, 0, 1.0, 1.0, 0.0, 0.0, False, 4)
    with pytest.raises(RuntimeError, match=r"argument `labels` must be on the device of `x`"):
        op(x, w, labels.cpu(), None, 0, 1.0, 1.0, 0.0, 0.0, False, 4)
    with pytest.raises(RuntimeError, match=r"argument `target_ref` must be on the device of `x`"):
        op(x, w, labels, torch.zeros(4), 0, 1.0, 1.0, 0.0, 0.0, False, 4)
    lse = torch.zeros(4, device="cuda")
    with pytest.raises(RuntimeError, match=r"argument `grad_lse` must be on the device of `x`"):
        torch.ops.shardkit.ce_shard_stats_backward(
            lse.cpu(), lse, lse, x, w, labels, lse, 0, 1.0, 1.0, 0.0, 0.0, False, 4
        )


@pytest.mark.gpu
def test_cuda_more_than_2_31_logits_in_one_chunk():
    # B * C_chunk > 2^31: element offsets into the chunk's logit / dlogit buffers (row i at
    # i * n) do not fit an int32. About 12 GB of GPU memory at peak (8.6 GB logit buffer).
    B, D, C = 2049, 8, (1 << 20) + 3
    assert B * C > 2**31
    x = torch.randn(B, D, device="cuda")
    w = torch.randn(C, D, device="cuda")
    labels = torch.randint(0, C, (B,), device="cuda")
    labels[-1] = C - 1  # the very last logit of the buffer is a target
    check_plain_by_rows(x, w, labels, 0.7, C)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (a shard on cuda:1 while cuda:0 is current)")
@pytest.mark.parametrize("name", ["plain", "arcface"])
def test_cuda_shard_on_non_current_device(name):
    x, w, labels = make_case(33, 24, 500, 7, device="cuda:1")
    with torch.cuda.device(0):
        check_against_reference(x, w, labels, 7, name, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,D", [(torch.float32, 32), (torch.bfloat16, 128)])
def test_cuda_side_stream_captured_in_a_graph(dtype, D):
    # Kernels, GEMMs and temporaries all on the caller's current stream (or on streams joined to
    # it by events): the forward and backward captured into a CUDA graph on a side stream, then
    # replayed on new inputs, equal the eager step on those. A kernel launched on the legacy
    # default stream breaks the capture; one launched on another stream runs at capture time
    # only, and the replay's results are stale. (bf16, D = 128: the fused kernels.)
    B, C = 64, 3000
    x, w, labels = make_case(B, D, C, 0, device="cuda", dtype=dtype)
    x, w = x.requires_grad_(), w.requires_grad_()
    g = [torch.randn(B, device="cuda") for _ in range(3)]

    def step():
        # (The weighted sum without softmax_checks.weighted's finiteness filter: that reads a
        # flag on the host, a sync, which no capture allows; every statistic is finite here.)
        out = ce_shard_stats(x, w, labels, chunk_classes=256, target_ref=g[0], **kw("arcface"))
        loss = sum((o * gg.to(o.dtype)).sum() for o, gg in zip(out[:3], g))
        return list(out) + list(torch.autograd.grad(loss, (x, w)))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: cuBLAS handles and workspaces of this stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        captured = step()
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        w.copy_(torch.randn_like(w))
        labels.copy_(torch.randint(0, C, (B,), device="cuda"))
    graph.replay()
    eager = step()
    torch.cuda.synchronize()
    assert torch.equal(captured[3], eager[3])
    for i in (0, 1, 2, 4, 5):
        assert rel(captured[i], eager[i]) <= 1e-6, (i, rel(captured[i], eager[i]))


@pytest.mark.parametrize("name", list(MARGINS))
def test_cuda_float64_matches_reference_and_gradchecks(name):
    # float64 runs the kernels with double statistics (as the CPU kernel does): tight
    # agreement with the reference, and gradcheck.
    x, w, labels = make_case(19, 6, 70, 3, dtype=torch.float64, device="cuda")
    check_against_reference(x, w, labels, 3, name, 16, tol=1e-9)
    x = torch.randn(3, 4, dtype=torch.float64, device="cuda", requires_grad=True)
    w = torch.randn(7, 4, dtype=torch.float64, device="cuda", requires_grad=True)
    labels = torch.tensor([1, 9, 6], device="cuda")  # class_offset 2: rows 0 and 2 in the shard
    coef = torch.randn(3, 3, dtype=torch.float64, device="cuda")

    def fn(x, w):
        lse, t, s, _ = ce_shard_stats(x, w, labels, class_offset=2, chunk_classes=3, **kw(name))
        return coef[0] * lse + coef[1] * t + coef[2] * s

    assert torch.autograd.gradcheck(fn, (x, w))


def test_cuda_batch_above_grid_y_limit():
    # B > 65535: the backward's dlogit grid caps gridDim.y at 65535 and strides over rows;
    # the forward launches one block per row (gridDim.x, no such cap).
    B = 65535 + 38
    x, w, labels = make_case(B, 8, 40, 0, device="cuda")
    check_against_reference(x, w, labels, 0, "arcface", 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_low_precision_noncontiguous(dtype):
    # Column-major x and transposed w in 16-bit: the strided weight reads of the norm and
    # dW fix-up kernels, and the GEMMs on transposed operands.
    check_low_precision("cuda", dtype, "arcface", noncontiguous=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_low_precision_scale_64(dtype):
    # CosFace at s = 64 (the face-recognition setting): exp sums stay in fp32, the fp16
    # dlogits (at most s * |dpsi| * |g| / |w_j|) stay finite.
    check_low_precision("cuda", dtype, "cosface64", margin=(64.0, 1.0, 0.0, 0.35, True))


def test_cuda_default_budget_several_chunks_face_recognition_shape():
    # B = 1024, D = 512 at the default 192 MiB budget: several chunks, the last one partial,
    # statistics and gradients accumulated across chunks.
    B, D, C = 1024, 512, 50_003
    chunk = chunk_classes_for_budget(B, embedding_dim=D, num_classes=C)
    assert chunk < C and C % chunk != 0
    x = torch.randn(B, D, device="cuda") / math.sqrt(D)  # logits of order 1
    w = torch.randn(C, D, device="cuda")
    labels = torch.randint(0, C, (B,), device="cuda")
    check_plain_by_rows(x, w, labels, 1.0, None, rows=256)


@pytest.mark.parametrize("name", list(MARGINS))
def test_cuda_matches_cpu_kernel(name):
    # The same inputs through both kernels, chunked differently: the same statistics and
    # gradients (the top-k count may differ at exact ties only, so it is left out).
    x, w, labels = make_case(50, 40, 1000, 10)
    g = [torch.randn(50) for _ in range(3)]
    outs = []
    for device, chunk in (("cpu", 96), ("cuda", 128)):
        xx, ww = x.to(device).requires_grad_(), w.to(device).requires_grad_()
        lse, t, s, _ = ce_shard_stats(xx, ww, labels.to(device), class_offset=10, chunk_classes=chunk, **kw(name))
        gx, gw = torch.autograd.grad(sum((o * gg.to(device)).sum() for o, gg in zip((lse, t, s), g)), (xx, ww))
        outs.append([v.detach().cpu() for v in (lse, t, gx, gw)])
    floor = kw(name)["scale"] * math.sqrt(50)  # gradients: as in check_against_reference
    for a, b, fl in zip(*outs, (1e-30, 1e-30, floor, floor)):
        assert rel(b, a, fl) <= 2e-5


def _small_rows_case(x_dtype, w_dtype):
    """ArcFace case with a zero weight row (7) and rows with |w_j| ~ 5e-3 (11-19), targets
    among them, on CUDA; with the float64 reference stats and gradients of a random
    combination ``g`` of the three outputs."""
    k = kw("arcface")
    B, D, C = 24, 32, 200
    x32, w32, _ = make_case(B, D, C, 0)
    w32[7] = 0.0
    w32[11:20] *= 1e-3
    labels = torch.randint(0, C, (B,))
    labels[:3] = torch.tensor([7, 12, 15])
    x, w = x32.to("cuda", x_dtype), w32.to("cuda", w_dtype)
    g = [torch.randn(B, dtype=torch.float64) for _ in range(3)]
    xr, wr = x.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    ref = ref_stats(xr, wr, labels, 0, **k)[:3]
    rg = torch.autograd.grad(sum((o * gg).sum() for o, gg in zip(ref, g)), (xr, wr))
    return k, labels, x, w, g, ref, rg


def _within_twice_torch(case, torch_fn):
    """ce_shard_stats against ``torch_fn`` (torch's own low-precision computation) on a
    :func:`_small_rows_case`: every output and gradient within 2x torch's error from the
    float64 reference, the zero row's own weight gradient excepted. Returns our gradients."""
    k, labels, x, w, g, ref, rg = case
    results = []
    for fn in (lambda a, b: ce_shard_stats(a, b, labels.cuda(), chunk_classes=64, **k)[:3], torch_fn):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(a, b)
        grads = torch.autograd.grad(sum((o * gg.cuda().float()).sum() for o, gg in zip(out, g)), (a, b))
        results.append((out, grads))
    (ours, og), (tor, tg) = results
    keep = torch.arange(w.shape[0]) != 7
    assert torch.isfinite(og[0]).all() and torch.isfinite(og[1][keep.cuda()]).all()
    pairs = list(zip(ours, tor, ref)) + [(og[0], tg[0], rg[0]), (og[1][keep.cuda()], tg[1][keep.cuda()], rg[1][keep])]
    for a, b, r in pairs:
        assert rel(a.cpu(), r) <= 2 * rel(b.cpu(), r) + 1e-6, (rel(a.cpu(), r), rel(b.cpu(), r))
    return og


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_16bit_zero_and_small_weight_rows(dtype):
    # 1 / |w_j| must stay out of the 16-bit dlogits (fp16 would overflow to inf, and inf * 0
    # in the dX GEMM would make every row's dX NaN). Within 2x the error of torch's own 16-bit
    # path (normalized in fp32 as under autocast), except the zero row's own gradient
    # (1e12 * ..., inf in 16 bits for torch too).
    case = _small_rows_case(dtype, dtype)
    k, labels = case[0], case[1]
    _within_twice_torch(case, lambda a, b: torch_low_precision_stats(a, b, labels.cuda(), fp32_normalize=True, **k))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_mixed_zero_and_small_weight_rows(dtype):
    # Mixed mode (fp32 w, 16-bit x): the fp32 dW GEMM output is fixed up in place in grad_w,
    # including the clamped (zero) row, whose gradient 1e12 * ... fits in fp32 and must be
    # finite. Within 2x the error of torch's own autocast computation (normalized in fp32,
    # GEMM in dtype), the zero row's own gradient excepted (torch rounds it through 16 bits).
    case = _small_rows_case(dtype, torch.float32)
    k, labels = case[0], case[1]

    def torch_autocast(a, b):
        # F.normalize in fp32 on the fp32 rows, then the GEMM in dtype with fp32 logits.
        xh = torch.nn.functional.normalize(a.float(), dim=1).to(dtype)
        wh = torch.nn.functional.normalize(b, dim=1).to(dtype)
        z = (xh @ wh.t()).float()
        y = labels.cuda()[:, None]
        z = k["scale"] * z.scatter(1, y, margin_psi(z.gather(1, y), k["m1"], k["m2"], k["m3"]))
        return torch.logsumexp(z, 1), z.gather(1, y)[:, 0], z.sum(1)

    og = _within_twice_torch(case, torch_autocast)
    assert og[0].dtype == dtype and og[1].dtype == torch.float32
    assert torch.isfinite(og[1]).all()


@pytest.mark.parametrize("scale", [1e3, 1e7, 1e11])
def test_cuda_large_scales_keep_the_gradient_of_the_rounded_logits(scale):
    # nvcc fuses s * cos - lse into one fma unless told not to (the kernels round s * cos alone).
    check_large_scale(scale, 0.2, "cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("margin_name", ["plain", "arcface", "combined"])
@pytest.mark.parametrize("mixed", [False, True])
def test_cuda_module_loss_within_twice_torch(dtype, margin_name, mixed):
    # The module's own loss (label smoothing 0.1: the statistics weighted 1, -0.9, -0.1 / C) and
    # both gradients against float64, within 2x torch's own 16-bit error, at a shape the fused
    # kernels take (D % 64 == 0), on both kernel sets: a backward without its softmax term fails.
    check_module_low_precision("cuda", dtype, margin_name, shape=(96, 128, 3001), mixed=mixed)
