"""shardkit.ops.normalize_images / shardkit.Normalize against a float64 reference."""

import io
import pickle

import pytest
import torch

import shardkit
from shardkit.ops import normalize_images

GPU = pytest.mark.gpu


def reference(images, mean, std, input_layout):
    """float64 (x / 255 - mean) / std, NCHW (CHW for a single image)."""
    x = images.double()
    if input_layout == "NHWC":
        x = x.movedim(-1, -3)
    shape = (-1, 1, 1)
    m = torch.tensor(mean, dtype=torch.float64, device=x.device).view(shape)
    s = torch.tensor(std, dtype=torch.float64, device=x.device).view(shape)
    return (x / 255.0 - m) / s


def torch_chain(images, mean, std, input_layout, dtype):
    """The usual eager chain computed at `dtype`: torch's own error at that dtype."""
    x = images.movedim(-1, -3) if input_layout == "NHWC" else images
    m = torch.tensor(mean, dtype=dtype, device=x.device).view(-1, 1, 1)
    s = torch.tensor(std, dtype=dtype, device=x.device).view(-1, 1, 1)
    return (x.to(dtype) / 255 - m) / s


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def random_stats(c):
    mean = (torch.rand(c, dtype=torch.float64) * 0.8 + 0.1).tolist()
    std = (torch.rand(c, dtype=torch.float64) * 0.4 + 0.1).tolist()
    return mean, std


def random_images(shape, device="cpu"):
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=device)


def check_against_reference(images, mean, std, layout, dtype, memory_format):
    out = normalize_images(images, mean, std, input_layout=layout, dtype=dtype, memory_format=memory_format)
    ref = reference(images, mean, std, layout)
    assert out.dtype == dtype and out.shape == ref.shape and out.device == images.device
    if out.dim() == 4:
        assert out.is_contiguous(memory_format=memory_format)
    if dtype in (torch.float32, torch.float64):
        # Element by element against the size of the two terms x / (255 std) and mean / std
        # (a norm-relative bound is ill-posed when the result cancels to ~0, e.g. one pixel).
        terms = reference(images, [0.0] * len(mean), std, layout).abs() + (
            reference(torch.zeros_like(images), mean, std, layout).abs()
        )
        eps = torch.finfo(dtype).eps
        assert ((out.double() - ref).abs() <= 8 * eps * terms).all()
        assert rel_err(out, ref) <= (1e-5 if dtype == torch.float32 else 1e-12) or ref.numel() < 8
    else:
        # One rounding of the fp32 result: at most 2x torch's own chain at that dtype.
        own = rel_err(torch_chain(images, mean, std, layout, dtype), ref)
        assert rel_err(out, ref) <= 2 * own + 1e-7


# (N, H, W, C): 1x1 images, C = 1/3/4, B = 1, odd planes, planes divisible by 4.
SHAPES = [(1, 1, 1, 1), (1, 1, 1, 3), (2, 5, 7, 3), (3, 4, 4, 4), (1, 17, 13, 1), (4, 32, 32, 3), (2, 3, 6, 2)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_matches_reference_fp32(shape, layout, memory_format):
    n, h, w, c = shape
    images = random_images((n, h, w, c) if layout == "NHWC" else (n, c, h, w))
    mean, std = random_stats(c)
    check_against_reference(images, mean, std, layout, torch.float32, memory_format)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_other_dtypes(dtype, layout):
    images = random_images((3, 9, 11, 3) if layout == "NHWC" else (3, 3, 9, 11))
    mean, std = random_stats(3)
    check_against_reference(images, mean, std, layout, dtype, torch.contiguous_format)


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_single_image(layout):
    images = random_images((6, 5, 3) if layout == "NHWC" else (3, 6, 5))
    mean, std = random_stats(3)
    check_against_reference(images, mean, std, layout, torch.float32, torch.contiguous_format)
    out = normalize_images(images, mean, std, input_layout=layout, memory_format=torch.channels_last)
    assert out.shape == (3, 6, 5)
    assert torch.allclose(out.double(), reference(images, mean, std, layout), rtol=1e-5, atol=1e-5)


def test_non_contiguous_inputs():
    mean, std = random_stats(3)
    base = random_images((4, 10, 12, 4))
    cases = [
        ("NHWC", base[:, ::2, 1:, :3]),  # strided crop and channel slice: copied once
        ("NHWC", base[..., 1:]),  # channel slice of RGBA-like data
        ("NCHW", base[..., :3].contiguous().permute(0, 3, 1, 2)),  # HWC memory seen as NCHW: read in place
        ("NHWC", random_images((4, 3, 10, 12)).permute(0, 2, 3, 1)),  # CHW memory seen as NHWC
        ("NCHW", random_images((10, 12, 3)).permute(2, 0, 1)),  # single HWC image as CHW
        ("NHWC", random_images((8, 10, 12, 3))[::2]),  # every other image
    ]
    for layout, images in cases:
        assert not images.is_contiguous()
        for fmt in (torch.contiguous_format, torch.channels_last):
            check_against_reference(images, mean, std, layout, torch.float32, fmt)


def test_empty_batch():
    out = normalize_images(torch.empty(0, 4, 4, 3, dtype=torch.uint8), [0.5] * 3, [0.5] * 3)
    assert out.shape == (0, 3, 4, 4) and out.dtype == torch.float32


def test_module_matches_functional():
    mean, std = random_stats(3)
    images = random_images((2, 8, 8, 3))
    mod = shardkit.Normalize(mean, std)
    assert torch.equal(mod(images), normalize_images(images, mean, std))
    mod_bf16 = shardkit.Normalize(
        torch.tensor(mean, dtype=torch.float64),
        torch.tensor(std, dtype=torch.float64),
        input_layout="NCHW",
        dtype=torch.bfloat16,
    )
    x = images.permute(0, 3, 1, 2).contiguous()
    assert torch.equal(mod_bf16(x), normalize_images(x, mean, std, input_layout="NCHW", dtype=torch.bfloat16))
    assert "NCHW" in repr(mod_bf16)


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_a_model_holding_the_module_saves_and_loads_whole(fmt):
    # torch.save pickles with protocol 2, which cannot pickle a torch.memory_format
    mean, std = random_stats(3)
    model = torch.nn.Sequential(shardkit.Normalize(mean, std, memory_format=fmt), torch.nn.Conv2d(3, 4, 3))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    images = random_images((2, 8, 8, 3))
    assert loaded[0].memory_format == fmt and loaded[0](images).is_contiguous(memory_format=fmt)
    assert torch.equal(loaded(images), model(images))
    with pytest.raises(ValueError, match="memory_format"):
        loaded[0].memory_format = torch.preserve_format
    # a Normalize pickled before (it held the torch.memory_format itself) loads and runs
    old = shardkit.Normalize(mean, std)
    del old.__dict__["_channels_last"]
    old.__dict__["memory_format"] = fmt
    revived = pickle.loads(pickle.dumps(old))
    assert revived.memory_format == fmt and torch.equal(revived(images), model[0](images))


def test_opcheck():
    mean, std = random_stats(3)
    samples = [
        (random_images((2, 5, 7, 3)), mean, std, True, torch.float32, False),
        (random_images((1, 3, 4, 4)), mean, std, False, torch.bfloat16, False),
        (random_images((3, 4, 4, 3)), mean, std, True, torch.float16, True),
        (random_images((6, 5, 3)), mean, std, True, torch.float32, True),
        (random_images((1, 2, 2, 1)), mean[:1], std[:1], True, torch.float64, False),
        (random_images((4, 6, 8, 3))[:, ::2], mean, std, True, torch.float32, False),
    ]
    for args in samples:
        torch.library.opcheck(torch.ops.shardkit.normalize_images.default, args)


def test_error_not_uint8():
    with pytest.raises(RuntimeError, match=r"argument `images` must be uint8, got Float"):
        normalize_images(torch.rand(1, 4, 4, 3), [0.5] * 3, [0.5] * 3)


@pytest.mark.parametrize("shape", [(4, 3), (1, 2, 4, 4, 3)])
def test_error_rank(shape):
    with pytest.raises(RuntimeError, match=r"must be 4-D \(N, H, W, C\) or 3-D"):
        normalize_images(random_images(shape), [0.5] * 3, [0.5] * 3)


def test_error_channel_mismatch():
    with pytest.raises(RuntimeError, match=r"`images` has 4 channels .* but `mean`/`std` have 3 entries"):
        normalize_images(random_images((2, 4, 4, 4)), [0.5] * 3, [0.5] * 3)
    with pytest.raises(RuntimeError, match=r"`images` has 4 channels"):
        normalize_images(random_images((2, 4, 5, 3)), [0.5] * 3, [0.5] * 3, input_layout="NCHW")


def test_error_mean_std_lengths():
    with pytest.raises(ValueError, match=r"`mean` and `std` must have the same length, got 3 and 2"):
        normalize_images(random_images((1, 4, 4, 3)), [0.5] * 3, [0.5] * 2)
    with pytest.raises(ValueError, match=r"`mean` and `std` must have the same length, got 3 and 2"):
        shardkit.Normalize([0.5] * 3, [0.5] * 2)


def test_error_zero_std():
    with pytest.raises(ValueError, match=r"`std\[1\]` must be non-zero and finite, got 0"):
        normalize_images(random_images((1, 4, 4, 3)), [0.5] * 3, [0.5, 0.0, 0.5])
    with pytest.raises(ValueError, match=r"`std\[0\]` must be non-zero and finite, got inf"):
        normalize_images(random_images((1, 4, 4, 1)), [0.5], [float("inf")])
    with pytest.raises(ValueError, match=r"`std\[2\]` must be non-zero"):
        shardkit.Normalize([0.5] * 3, [0.5, 0.5, 0.0])


def test_error_zero_std_raw_op():
    # The op itself (no Python wrapper) keeps its own check.
    with pytest.raises(RuntimeError, match=r"`std\[1\]` must be non-zero and finite, got 0"):
        torch.ops.shardkit.normalize_images(
            random_images((1, 4, 4, 3)), [0.5] * 3, [0.5, 0.0, 0.5], True, torch.float32, False
        )


@pytest.mark.parametrize("std", [1e-45, -1e-45, 1e-40])
def test_error_denormal_std(std):
    # 1e-45 is non-zero, but 1 / (255 std) overflows float32; with 1e-40 the reciprocal fits
    # but the normalized values (up to 0.5 / std) do not: the output would be NaN/inf.
    bad = r"`std\[1\]` = .*(is too close to zero: 255 / \(255 std\)|the normalized values reach .* beyond the range)"
    with pytest.raises(ValueError, match=bad):
        normalize_images(random_images((1, 4, 4, 3)), [0.5] * 3, [0.5, std, 0.5])
    with pytest.raises(ValueError, match=bad):
        shardkit.Normalize([0.5] * 3, [0.5, std, 0.5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_std_whose_product_overflows_float32_is_refused(dtype):
    # Outputs up to 255 * scale + shift ~ 2e38 fit float32, but the product x * scale, formed
    # first, overflows: refused by the wrapper and by the op itself, not inf.
    x = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16)
    with pytest.raises(ValueError, match=r"`std\[0\]` = 2.5e-39 is too close to zero"):
        normalize_images(x, [0.5], [2.5e-39], input_layout="NCHW", dtype=dtype)
    with pytest.raises(RuntimeError, match=r"`std\[0\]` = .* is too close to zero"):
        torch.ops.shardkit.normalize_images(x, [0.5], [2.5e-39], False, dtype, False)


def test_small_std_that_fits_is_accepted():
    x = random_images((1, 2, 2, 1))
    out = normalize_images(x, [0.0], [1e-30])
    ref = x.permute(0, 3, 1, 2).double() / 255.0 / 1e-30
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=0)


def test_error_mean_std_types_and_channels():
    x = random_images((1, 4, 4, 3))
    for make in (lambda m, s: normalize_images(x, m, s), shardkit.Normalize):
        with pytest.raises(TypeError, match=r"argument `mean` must be a sequence of numbers, got str '0.5'"):
            make("0.5", [0.5])
        with pytest.raises(TypeError, match=r"argument `std` must hold numbers, got str '0.5' at index 1"):
            make([0.5, 0.5], [0.5, "0.5"])
        with pytest.raises(ValueError, match=r"argument `mean` must hold one value per channel, got 0 values"):
            make([], [])
        with pytest.raises(ValueError, match=r"argument `mean\[0\]` must be finite, got nan"):
            make([float("nan")], [0.5])
        with pytest.raises(ValueError, match=r"argument `mean\[0\]` is an int too large for a float"):
            make((10**400, 0.5, 0.5), (0.5,) * 3)
        with pytest.raises(ValueError, match=r"argument `std\[1\]` is an int too large for a float"):
            make((0.5,) * 3, (0.5, 10**400, 0.5))
        with pytest.raises(ValueError, match=r"argument `mean` is a meta tensor"):
            make(torch.zeros(3, device="meta"), (0.5,) * 3)


def test_error_bad_arguments():
    x = random_images((1, 4, 4, 3))
    with pytest.raises(ValueError, match=r"argument `input_layout` must be .NHWC. or .NCHW."):
        normalize_images(x, [0.5] * 3, [0.5] * 3, input_layout="HWC")
    with pytest.raises(ValueError, match=r"argument `input_layout` must be 'NHWC' or 'NCHW'"):
        shardkit.Normalize([0.5] * 3, [0.5] * 3, input_layout="CHW")
    with pytest.raises(ValueError, match=r"argument `dtype` must be one of"):
        normalize_images(x, [0.5] * 3, [0.5] * 3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"argument `memory_format` must be"):
        normalize_images(x, [0.5] * 3, [0.5] * 3, memory_format=torch.channels_last_3d)
    with pytest.raises(RuntimeError, match=r"argument `out_dtype` must be float32, float64, bfloat16 or float16"):
        torch.ops.shardkit.normalize_images(x, [0.5] * 3, [0.5] * 3, True, torch.int64, False)
    with pytest.raises(ValueError, match=r"at most 64 channels are supported, got 65"):
        normalize_images(random_images((1, 2, 2, 65)), [0.5] * 65, [0.5] * 65)
    with pytest.raises(RuntimeError, match=r"at most 64 channels are supported, got 65"):  # the op's own check
        torch.ops.shardkit.normalize_images(
            random_images((1, 2, 2, 65)), [0.5] * 65, [0.5] * 65, True, torch.float32, False
        )
    with pytest.raises(TypeError, match=r"argument `mean` must be a sequence of numbers"):
        normalize_images(x, 0.5, [0.5] * 3)


# ---- GPU ------------------------------------------------------------------------------

# Plane sizes divisible by 4 (vectorized path for C = 1, 3, 4) and not (generic path); the
# vectorized kernel's threads take 4 groups of 4 pixels each, and 37 x 64 x 52 leaves a last
# turn with only some of them valid.
GPU_SHAPES = [
    (1, 1, 1, 3),
    (2, 4, 4, 3),
    (3, 8, 12, 1),
    (2, 6, 6, 4),
    (4, 7, 9, 3),
    (2, 5, 8, 2),
    (37, 64, 52, 3),
    (64, 112, 112, 3),
]


@GPU
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_cuda_matches_reference(shape, dtype, layout):
    n, h, w, c = shape
    images = random_images((n, h, w, c) if layout == "NHWC" else (n, c, h, w), device="cuda")
    mean, std = random_stats(c)
    for fmt in (torch.contiguous_format, torch.channels_last):
        check_against_reference(images, mean, std, layout, dtype, fmt)
    # The CUDA result equals the CPU kernel's up to the last bit of fp32 rounding.
    cpu = normalize_images(images.cpu(), mean, std, input_layout=layout, dtype=dtype)
    gpu = normalize_images(images, mean, std, input_layout=layout, dtype=dtype).cpu()
    assert torch.allclose(
        gpu.double(), cpu.double(), rtol=1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-6, atol=1e-5
    )


@GPU
def test_cuda_misaligned_and_strided():
    mean, std = random_stats(3)
    flat = random_images((1 + 2 * 8 * 8 * 3,), device="cuda")
    misaligned = flat[1:].view(2, 8, 8, 3)  # data pointer not 4-byte aligned: generic path
    check_against_reference(misaligned, mean, std, "NHWC", torch.float32, torch.contiguous_format)
    strided = random_images((4, 16, 16, 4), device="cuda")[:, 1::2, :, :3]
    check_against_reference(strided, mean, std, "NHWC", torch.float32, torch.contiguous_format)


@GPU
@pytest.mark.parametrize("offset", [2, 4, 12])
def test_cuda_views_with_storage_offsets(offset):
    # Dense views that start `offset` bytes into their storage: 4-byte aligned starts keep
    # the vectorized NHWC -> NCHW kernel, the others take the generic one; both must agree
    # with the reference, and batch slices of an aligned batch stay aligned.
    mean, std = random_stats(3)
    flat = random_images((offset + 3 * 8 * 12 * 3,), device="cuda")
    images = flat[offset:].view(3, 8, 12, 3)
    for fmt in (torch.contiguous_format, torch.channels_last):
        check_against_reference(images, mean, std, "NHWC", torch.float32, fmt)
        check_against_reference(images[1:], mean, std, "NHWC", torch.bfloat16, fmt)
    check_against_reference(images.permute(0, 3, 1, 2), mean, std, "NCHW", torch.float32, torch.contiguous_format)


@GPU
def test_cuda_captures_in_a_cuda_graph():
    # Capture fails if the op launches on a stream other than the current one or waits for
    # the host; replays must read the images' current contents.
    mean, std = random_stats(3)
    images = random_images((4, 16, 16, 3), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        normalize_images(images, mean, std)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = normalize_images(images, mean, std)  # vectorized kernel
        out_cl = normalize_images(images[:, :, 1:8], mean, std, memory_format=torch.channels_last)  # copy + generic
    images.copy_(random_images(images.shape, device="cuda"))
    graph.replay()
    assert rel_err(out, reference(images, mean, std, "NHWC")) <= 1e-5
    assert rel_err(out_cl, reference(images[:, :, 1:8], mean, std, "NHWC")) <= 1e-5


@GPU
def test_cuda_opcheck_and_module():
    mean, std = random_stats(3)
    images = random_images((2, 8, 8, 3), device="cuda")
    for args in [(images, mean, std, True, torch.float32, False), (images, mean, std, True, torch.bfloat16, True)]:
        torch.library.opcheck(torch.ops.shardkit.normalize_images.default, args)
    out = shardkit.Normalize(mean, std)(images)
    assert out.is_cuda and out.shape == (2, 3, 8, 8)


@GPU
@pytest.mark.parametrize(
    "layout,fmt",
    [
        ("NHWC", torch.contiguous_format),  # vectorized path
        ("NHWC", torch.channels_last),
        ("NCHW", torch.contiguous_format),
    ],
)
def test_cuda_more_than_2_31_output_elements(layout, fmt):
    # N * C * H * W > 2^31: int32 element offsets would wrap. About 11 GB of GPU memory.
    h = w = 26760  # H * W divisible by 4: NHWC -> NCHW takes the vectorized kernel
    assert 3 * h * w > 2**31
    images = random_images((1, h, w, 3) if layout == "NHWC" else (1, 3, h, w), device="cuda")
    mean, std = random_stats(3)
    out = normalize_images(images, mean, std, input_layout=layout, dtype=torch.float32, memory_format=fmt)
    assert out.is_contiguous(memory_format=fmt)
    rows = 2048
    for r0 in range(0, h, rows):
        part = images[:, r0 : r0 + rows] if layout == "NHWC" else images[:, :, r0 : r0 + rows]
        assert rel_err(out[:, :, r0 : r0 + rows], reference(part, mean, std, layout)) <= 1e-5, f"rows from {r0}"


@GPU
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (images on cuda:1 while cuda:0 is current)")
def test_cuda_images_on_non_current_device():
    mean, std = random_stats(3)
    with torch.cuda.device(0):
        for shape, layout in [((2, 8, 12, 3), "NHWC"), ((2, 3, 5, 7), "NCHW")]:
            images = random_images(shape, device="cuda:1")
            for fmt in (torch.contiguous_format, torch.channels_last):
                check_against_reference(images, mean, std, layout, torch.float32, fmt)
