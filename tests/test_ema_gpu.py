"""GPU tests of the ema op family and of ModelEMA (marked `gpu`; conftest skips them,
with the reason, where no CUDA GPU is visible). They exercise the CUDA multi-tensor
launcher: chunk boundaries, more tensors than one launch takes, unaligned views, mixed
dtypes, non-default streams, the bf16 packing of swap, and a CPU-resident EMA fed by
non-blocking copies from a CUDA model."""

import math

import pytest
import torch

import shardkit
from shardkit.ops import ema_swap_, ema_unswap_, ema_update_

from test_ema import CUDA_CHUNK, PAIRS, Net, bits, rel_err, train_step

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


def test_cuda_update_unaligned_views_and_strides():
    needs_cuda_build()
    base_e = torch.randn(CUDA_CHUNK * 2 + 50, device="cuda")
    base_m = torch.randn(CUDA_CHUNK * 2 + 50, device="cuda").bfloat16()
    ema, model = [], []
    for off in range(1, 9):  # every misalignment of the 16-byte vectors
        n = CUDA_CHUNK + off
        ema.append(base_e[off:off + n])
        model.append(base_m[9 - off:9 - off + n])
    ema.append(torch.randn(33, 17, device="cuda").t())
    model.append(torch.randn(17, 33, device="cuda"))
    check_cuda_update(ema, model, 0.6)


def test_cuda_update_on_current_stream_and_launch_count():
    needs_cuda_build()
    n = 3 * MAX_TENSORS_PER_LAUNCH + 5
    ema = [torch.randn(1000, device="cuda") for _ in range(n)]
    model = [torch.randn(1000, device="cuda") for _ in range(n)]
    ref = [e.double() + 0.25 * (m.double() - e.double()) for e, m in zip(ema, model)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with torch.cuda.stream(stream):
            ema_update_(ema, model, 0.75)
        torch.cuda.synchronize()
    launches = [e for e in prof.events() if "multi_tensor_kernel" in e.name]
    assert len(launches) == math.ceil(n / MAX_TENSORS_PER_LAUNCH)
    for e, r in zip(ema, ref):
        assert rel_err(e, r) <= 1e-5


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
    ema_swap_([e, ], [m])
    ema_swap_([ec], [mc])
    assert torch.equal(bits(e.cpu()), bits(ec)) and torch.equal(bits(m.cpu()), bits(mc))


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_model_ema_cuda_matches_foreach_and_swap(model_dtype):
    needs_cuda_build()
    net = Net().cuda().to(model_dtype)
    ema = shardkit.ModelEMA(net, 0.95, tau=None, dtype=torch.float32)
    ref = [t.detach().float().clone() for t in net.state_dict().values()]
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
    for r, v in zip(ref, ema.module.state_dict().values()):
        assert torch.allclose(v.float(), r.float(), rtol=1e-5, atol=1e-6)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with ema.swap(net):
        pass
    assert all(torch.equal(bits(v), bits(before[k])) for k, v in net.state_dict().items())


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
        r = e0[i:i + step].double()
        r += 0.25 * (m[i:i + step].double() - r)
        assert rel_err(e[i:i + step], r) <= 1e-5, f"elements [{i}, {i + step})"
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
