"""GPU tests of the ema op family and of ModelEMA (marked `gpu`; conftest skips them,
with the reason, where no CUDA GPU is visible). They exercise the CUDA multi-tensor
launcher: chunk boundaries, more tensors than one launch takes, views at every alignment
(vector and element-wise paths) compared with the CPU kernel, mixed dtypes, empty tensors,
non-default streams and CUDA-graph capture (no host sync, current stream only), the bf16
packing of swap, ModelEMA swap of float32/bfloat16/float16 and channels_last models, and
a CPU-resident EMA fed by non-blocking copies that are still in flight."""

import math

import pytest
import test_ema as cpu_tests  # module import: its test functions are not collected twice
import torch
from test_ema import CUDA_CHUNK, PAIRS, Net, bits, rel_err, train_step

import shardkit
from shardkit.ops import ema_swap_, ema_unswap_, ema_update_

MAX_TENSORS_PER_LAUNCH = 96  # csrc/cuda/multi_tensor.cuh Caps<2>::kMaxTensors

pytestmark = pytest.mark.gpu


def needs_cuda_build():
    if not shardkit.cuda_built():
        pytest.fail("a GPU is visible but shardkit was built without CUDA kernels (build with FORCE_CUDA=1)")


def check_cuda_update(ema, model, decay):
    w = 1.0 - decay
    ref = [e.double().cpu() + w * (m.double().cpu() - e.double().cpu()) for e, m in zip(ema, model)]
    torch_own = [(e.float() + w * (m.float() - e.float())).to(e.dtype).cpu() for e, m in zip(ema, model)]
    ema_update_(ema, model, decay)
    torch.cuda.synchronize()
    for e, r, t in zip(ema, ref, torch_own):
        if e.dtype in (torch.float32, torch.float64):
            assert rel_err(e.cpu(), r) <= 1e-5
        else:
            assert rel_err(e.cpu(), r) <= 2 * rel_err(t, r) + 1e-7


@pytest.mark.parametrize("ema_dtype,model_dtype", PAIRS)
def test_cuda_update_chunk_boundaries_and_tensor_cap(ema_dtype, model_dtype):
    needs_cuda_build()
    sizes = [1, 7, CUDA_CHUNK - 1, CUDA_CHUNK, CUDA_CHUNK + 1, 3 * CUDA_CHUNK + 1]
    sizes += [int(s) for s in torch.randint(1, 5000, (2 * MAX_TENSORS_PER_LAUNCH + 11,))]
    ema = [torch.randn(n, device="cuda").to(ema_dtype) for n in sizes]
    model = [torch.randn(n, device="cuda").to(model_dtype) for n in sizes]
    check_cuda_update(ema, model, 0.9)


@pytest.mark.parametrize("decay", [0.3, 0.9])
@pytest.mark.parametrize(
    "ema_dtype,model_dtype",
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_cuda_update_views_at_every_alignment(ema_dtype, model_dtype, decay):
    # Every view has its own base tensor (views of one EMA base would overlap, and an update
    # of overlapping EMA tensors has no defined result). Element offsets on either side: both
    # aligned (the vector path on views with a storage offset), one side or both misaligned
    # (element-wise path), and lengths leaving a tail after the last full vector.
    needs_cuda_build()
    offsets = [(0, 0), (8, 8), (16, 8), (1, 0), (0, 1), (4, 0), (0, 4), (3, 5), (7, 2)]
    ema, model = [], []
    for k, (oe, om) in enumerate(offsets):
        n = CUDA_CHUNK + 2 * k + 3
        ema.append(torch.randn(n + oe, device="cuda").to(ema_dtype)[oe:])
        model.append(torch.randn(n + om, device="cuda").to(model_dtype)[om:])
    ema.append(torch.randn(33, 17, device="cuda").to(ema_dtype).t())  # different strides: the ATen fallback
    model.append(torch.randn(17, 33, device="cuda").to(model_dtype))
    ema_cpu, model_cpu = [e.cpu() for e in ema], [m.cpu() for m in model]
    check_cuda_update(ema, model, decay)
    ema_update_(ema_cpu, model_cpu, decay)  # the CPU kernel agrees (up to fma contraction)
    for e, c in zip(ema, ema_cpu):
        torch.testing.assert_close(e.cpu(), c)


@pytest.mark.parametrize("decay", [0.9, 0.3, 0.0])
def test_cuda_strided_pair_leaves_model_untouched(decay):
    needs_cuda_build()
    for ema_dtype, model_dtype in [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)]:
        cpu_tests.test_update_strided_pair_leaves_model_untouched(ema_dtype, model_dtype, decay, device="cuda")


def test_cuda_update_empty_tensors_and_exact_decays():
    needs_cuda_build()
    e = torch.randn(CUDA_CHUNK + 3, device="cuda")
    m = torch.randn(CUDA_CHUNK + 3, device="cuda").bfloat16()
    e0 = e.clone()
    z = torch.empty(0, 3, device="cuda")
    ema_update_([z, z.clone()], [z.bfloat16(), z.clone()], 0.5)  # only empty tensors: nothing to launch
    ema_update_([z, e], [torch.empty(0, 3, device="cuda"), m], 1.0)
    assert torch.equal(e, e0)  # decay 1 keeps the EMA exactly
    ema_update_([e, z], [m, torch.empty(0, 3, device="cuda")], 0.0)
    assert torch.equal(e, m.float())  # decay 0 copies the model exactly


def test_cuda_ops_capture_in_a_cuda_graph():
    # Capture fails if an op launches on a stream other than the current one or waits for
    # the host; replaying the graphs must then update / swap the same tensors.
    needs_cuda_build()
    sizes = [int(s) for s in torch.randint(1, 3 * CUDA_CHUNK, (MAX_TENSORS_PER_LAUNCH + 7,))]
    ema = [torch.randn(n, device="cuda") for n in sizes] + [torch.randn(9, 5, device="cuda").t()]
    model = [torch.randn(n, device="cuda").bfloat16() for n in sizes] + [torch.randn(5, 9, device="cuda")]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graph advises
        ema_update_(ema, model, 0.5)
    torch.cuda.current_stream().wait_stream(side)
    update, swap, unswap = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(update):
        ema_update_(ema, model, 0.8)
    with torch.cuda.graph(swap):
        ema_swap_(ema[:-1], model[:-1])
    with torch.cuda.graph(unswap):
        ema_unswap_(ema[:-1], model[:-1])
    ref = [e.double() for e in ema]
    for _ in range(2):
        update.replay()
        ref = [r + 0.2 * (m.double() - r) for r, m in zip(ref, model)]
    for e, r in zip(ema, ref):
        assert rel_err(e, r) <= 1e-5
    e0, m0 = [e.clone() for e in ema[:-1]], [m.clone() for m in model[:-1]]
    swap.replay()
    assert all(torch.allclose(m.float(), e, rtol=2**-8, atol=0) for m, e in zip(model, e0))
    unswap.replay()
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(ema[:-1] + model[:-1], e0 + m0))


def cuda_kernel_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("first_launcher", [False, True])
def test_cuda_update_on_current_stream_and_launch_count(first_launcher, monkeypatch):
    # The table path: one launch per dtype pair, whatever the tensor count (plus the table's
    # copy the first time these tensors are seen). SHARDKIT_EMA_V1=1: the chunked launcher,
    # one launch per MAX_TENSORS_PER_LAUNCH tensors.
    needs_cuda_build()
    monkeypatch.setenv("SHARDKIT_EMA_V1", "1" if first_launcher else "0")
    n = 3 * MAX_TENSORS_PER_LAUNCH + 5
    ema = [torch.randn(1000, device="cuda") for _ in range(n)]
    model = [torch.randn(1000, device="cuda") for _ in range(n)]
    ref = [e.double() for e in ema]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def update():
        with torch.cuda.stream(stream):
            ema_update_(ema, model, 0.75)

    for _ in range(2):  # the second call finds the table in the cache
        names = cuda_kernel_names(update)
        ref = [r + 0.25 * (m.double() - r) for r, m in zip(ref, model)]
        chunked = [k for k in names if "multi_tensor_kernel" in k]
        table = [k for k in names if "ema_table_kernel" in k]
        if first_launcher:
            assert len(chunked) == math.ceil(n / MAX_TENSORS_PER_LAUNCH) and not table
        else:
            assert len(table) == 1 and not chunked
    for e, r in zip(ema, ref):
        assert rel_err(e, r) <= 1e-5


def test_cuda_update_table_cache_follows_the_tensors():
    # The device table is cached by (device, stream, dtypes, every address and size): lists
    # that change between calls (a tensor replaced, reordered, resized, another dtype pair,
    # another stream), and tensors freed and reallocated at the same addresses, must each
    # be updated exactly as a fresh call would.
    needs_cuda_build()
    sizes = [int(s) for s in torch.randint(1, 3 * CUDA_CHUNK, (40,))]
    ema = [torch.randn(n, device="cuda") for n in sizes]
    model = [torch.randn(n, device="cuda").bfloat16() for n in sizes]
    side = torch.cuda.Stream()
    for step in range(12):
        if step == 3:  # replace one tensor (a new address)
            ema[5], model[5] = torch.randn(sizes[5], device="cuda"), torch.randn(sizes[5], device="cuda").bfloat16()
        if step == 5:  # reorder
            ema, model = ema[::-1], model[::-1]
        if step == 6:  # free and reallocate everything: the same addresses may come back
            n_all = [e.numel() for e in ema]
            ema = model = None
            ema = [torch.randn(n, device="cuda") for n in n_all]
            model = [torch.randn(n, device="cuda").bfloat16() for n in n_all]
        if step == 8:  # resize one tensor in place of another's size
            ema[0], model[0] = torch.randn(CUDA_CHUNK + 5, device="cuda"), torch.randn(CUDA_CHUNK + 5, device="cuda")
        if step == 10:  # another stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                check_cuda_update(ema, model, 0.6)
            torch.cuda.current_stream().wait_stream(side)
            continue
        check_cuda_update(ema, model, 0.9 if step % 2 else 0.3)


def test_cuda_opcheck_and_device_errors():
    needs_cuda_build()
    e = [torch.randn(70000, device="cuda"), torch.randn(5, device="cuda")]
    m = [torch.randn(70000, device="cuda").bfloat16(), torch.randn(5, device="cuda")]
    torch.library.opcheck(torch.ops.shardkit.ema_update_.default, (e, m, 0.9))
    torch.library.opcheck(torch.ops.shardkit.ema_swap_.default, (e, m))
    with pytest.raises(RuntimeError, match=r"`model\[0\]` is on cpu"):
        ema_update_([e[0]], [m[0].cpu()], 0.5)


def test_cuda_swap_packing_bit_exact():
    needs_cuda_build()
    n = 2 * CUDA_CHUNK + 3
    e = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda").view(torch.float32)
    m = torch.randn(n, device="cuda").bfloat16()
    x, y = torch.randn(1001, device="cuda").half(), torch.randn(1001, device="cuda").half()
    e0, m0, x0, y0 = e.clone(), m.clone(), x.clone(), y.clone()
    ema_swap_([e, x], [m, y])
    assert torch.equal(x, y0) and torch.equal(y, x0)
    ema_unswap_([e, x], [m, y])
    assert torch.equal(bits(e), bits(e0)) and torch.equal(bits(m), bits(m0))
    assert torch.equal(x, x0) and torch.equal(y, y0)
    # The CPU kernel packs identically.
    ec, mc = e0.cpu(), m0.cpu()
    ema_swap_(
        [
            e,
        ],
        [m],
    )
    ema_swap_([ec], [mc])
    assert torch.equal(bits(e.cpu()), bits(ec)) and torch.equal(bits(m.cpu()), bits(mc))


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_model_ema_cuda_matches_foreach_and_swap(model_dtype, channels_last):
    # float32 and bfloat16 models swap in place (exchange, bf16 packing, also for the
    # channels_last conv weight); a float16 model goes through the host stash.
    needs_cuda_build()
    net = Net().cuda().to(model_dtype)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    ema = shardkit.ModelEMA(net, 0.95, tau=None, dtype=torch.float32)
    # Floating tensors in float32; integer buffers keep their dtype (they are copied, not averaged).
    ref = [
        t.detach().float().clone() if t.is_floating_point() else t.detach().clone() for t in net.state_dict().values()
    ]
    for step in range(1, 8):
        train_step(net)
        ema.update(net)
        d = 0.0 if step == 1 else 0.95  # constant schedule: the first update copies (timm)
        cur = list(net.state_dict().values())
        fl = [(r, c.float()) for r, c in zip(ref, cur) if r.is_floating_point()]
        torch._foreach_lerp_([a for a, _ in fl], [b for _, b in fl], 1.0 - d)
        for r, c in zip(ref, cur):
            if not r.is_floating_point():
                r.copy_(c)
    ema_sd = {k: v.clone() for k, v in ema.module.state_dict().items()}
    for r, v in zip(ref, ema_sd.values()):
        assert torch.allclose(v.float(), r.float(), rtol=1e-5, atol=1e-6)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with ema.swap(net):
        for k, v in net.state_dict().items():  # the model holds the EMA, rounded to its dtype
            assert v.is_cuda and torch.allclose(v.double(), ema_sd[k].double(), rtol=2**-8, atol=1e-7), k
    assert all(torch.equal(bits(v), bits(before[k])) for k, v in net.state_dict().items())
    assert all(torch.equal(bits(v), bits(ema_sd[k])) for k, v in ema.module.state_dict().items())


def test_cpu_resident_ema_fed_from_cuda():
    needs_cuda_build()
    net = Net().cuda()
    on_gpu = shardkit.ModelEMA(net, 0.9, tau=5)
    on_cpu = shardkit.ModelEMA(net, 0.9, tau=5, device="cpu")
    assert all(p.device.type == "cpu" for p in on_cpu._module.parameters())
    for _ in range(6):
        train_step(net)
        on_gpu.update(net)
        on_cpu.update(net)  # enqueues copies; averages on the CPU once they landed
    assert on_cpu._stage is not None and len(on_cpu._stage._pending) >= 1
    sd = on_cpu.state_dict()  # drains the pending updates first
    assert not on_cpu._stage._pending
    for k, v in on_gpu.module.state_dict().items():
        assert torch.allclose(sd["module"][k], v.cpu(), rtol=1e-5, atol=1e-6), k
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with on_cpu.swap(net):  # host-stash path (different devices)
        assert torch.allclose(net.fc.weight.cpu(), on_cpu.module.fc.weight)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


def test_cpu_resident_ema_with_copies_in_flight():
    # torch.cuda._sleep keeps the stream busy, so each update's device-to-host copies are
    # still queued when the next training step is enqueued behind them and the host goes on:
    # the CPU must average what each copy read at its update (stream order, then the
    # event), never a staging buffer that is still being written or about to be rewritten.
    needs_cuda_build()
    net = Net().cuda().to(memory_format=torch.channels_last)  # a channels_last conv weight
    ema = shardkit.ModelEMA(net, 0.8, tau=None, device="cpu")
    averaged = [t.is_floating_point() for t in net.state_dict().values()]  # integer buffers are copied
    ref = [t.detach().double().cpu() for t in net.state_dict().values()]
    snaps = []
    for _ in range(7):
        train_step(net)
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time
        ema.update(net)
        snaps.append([t.detach().clone() for t in net.state_dict().values()])  # after the copies, same stream
    assert len(ema._stage._pending) >= 1
    assert all(b.is_pinned() for bufs in ema._stage._bufs for b in bufs)
    # Staging keeps the channels_last strides: one memcpy per tensor, and the fused CPU update.
    assert [b.stride() for b in ema._stage._bufs[0] if b.dim() == 4] == [net.conv.weight.stride()]
    sd = ema.state_dict()  # drains
    for step, snap in enumerate(snaps, 1):
        d = 0.0 if step == 1 else 0.8
        ref = [d * r + (1 - d) * s.double().cpu() if a else s.double().cpu() for r, s, a in zip(ref, snap, averaged)]
    for (k, v), r in zip(sd["module"].items(), ref):
        assert v.device.type == "cpu" and torch.allclose(v.double(), r, rtol=1e-5, atol=1e-6), k


def test_cuda_update_and_swap_more_than_2_31_elements():
    # Element offsets past 2^31 (int32 would wrap), a tensor that ends mid-chunk, and the
    # fused fp32 EMA / bf16 model pair. About 26 GB of GPU memory.
    needs_cuda_build()
    n = 2**31 + 3 * CUDA_CHUNK // 2 + 7
    e = torch.randn(n, device="cuda")
    m = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    e0 = e.clone()
    ema_update_([e], [m], 0.75)
    step = 1 << 27
    for i in range(0, n, step):
        r = e0[i : i + step].double()
        r += 0.25 * (m[i : i + step].double() - r)
        assert rel_err(e[i : i + step], r) <= 1e-5, f"elements [{i}, {i + step})"
    e0.copy_(e)
    m0 = m.clone()
    ema_swap_([e], [m])
    assert torch.allclose(m[-5:].float(), e0[-5:], rtol=1e-2, atol=0)  # the model shows bf16(ema)
    ema_unswap_([e], [m])
    assert torch.equal(bits(e), bits(e0)) and torch.equal(bits(m), bits(m0))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (tensors on cuda:1 while cuda:0 is current)")
def test_cuda_tensors_on_non_current_device():
    needs_cuda_build()
    sizes = [CUDA_CHUNK + 5, 33, 1]
    with torch.cuda.device(0):
        ema = [torch.randn(s, device="cuda:1") for s in sizes]
        model = [torch.randn(s, device="cuda:1").bfloat16() for s in sizes]
        check_cuda_update(ema, model, 0.9)
        e0, m0 = [t.clone() for t in ema], [t.clone() for t in model]
        ema_swap_(ema, model)
        ema_unswap_(ema, model)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(ema + model, e0 + m0))


def test_cuda_decays_0_and_1_are_exact_whatever_the_values():
    needs_cuda_build()
    for ema_dtype, model_dtype in [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)]:
        cpu_tests.test_decays_0_and_1_are_exact_whatever_the_values(ema_dtype, model_dtype, device="cuda")
