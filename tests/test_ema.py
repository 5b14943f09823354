"""Tests of the ema op family (shardkit.ops.ema_update_/ema_swap_/ema_unswap_) and of
shardkit.ModelEMA. GPU tests are marked `gpu` (see tests/test_ema_gpu.py)."""

import io
import math

import pytest
import torch
from torch import nn

import shardkit
from shardkit.ops import ema_swap_, ema_unswap_, ema_update_

CPU_CHUNK = 1 << 15  # csrc/cpu/ema_cpu.cpp kCpuChunk
CUDA_CHUNK = 1 << 16  # csrc/cuda/multi_tensor.cuh kChunkSize
FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
PAIRS = [
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float64, torch.float64),
    (torch.float64, torch.float32),
    (torch.bfloat16, torch.float32),
]


def boundary_sizes():
    """Sizes straddling the CPU and CUDA chunk sizes exactly +-1, plus odd small ones."""
    out = [1, 3, 17, 255, 1001]
    for c in (CPU_CHUNK, CUDA_CHUNK, 2 * CUDA_CHUNK):
        out += [c - 1, c, c + 1]
    return out


def bits(t):
    """The raw bytes of a tensor, so NaNs and signed zeros compare exactly."""
    return t.reshape(-1).view(torch.uint8)


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def check_update(ema, model, decay):
    """Runs ema_update_ on ema and compares with a float64 reference; the tolerance is
    1e-5 for float32/float64 EMAs and 2x torch's own error at the EMA dtype otherwise."""
    w = 1.0 - decay
    ref = [e.double() + w * (m.double() - e.double()) for e, m in zip(ema, model)]
    torch_own = [(e.float() + w * (m.float() - e.float())).to(e.dtype) for e, m in zip(ema, model)]
    ema_update_(ema, model, decay)
    for e, r, t in zip(ema, ref, torch_own):
        if r.norm() == 0:
            continue
        if e.dtype in (torch.float32, torch.float64):
            assert rel_err(e, r) <= 1e-5
        else:
            assert rel_err(e, r) <= 2 * rel_err(t, r) + 1e-7


@pytest.mark.parametrize("ema_dtype,model_dtype", PAIRS)
def test_update_matches_reference_across_chunk_boundaries(ema_dtype, model_dtype):
    sizes = boundary_sizes()
    ema = [torch.randn(n).to(ema_dtype) for n in sizes]
    model = [torch.randn(n).to(model_dtype) for n in sizes]
    check_update(ema, model, 0.9)


@pytest.mark.parametrize("count", [1, 2, 97, 313])
def test_update_many_tensors_mixed_dtypes(count):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    ema, model = [], []
    for i in range(count):
        ed, md = PAIRS[i % len(PAIRS)]
        n = int(torch.randint(1, 3000, (), generator=gen))
        shape = (n,) if i % 3 else (n % 7 + 1, n // 7 + 1)
        ema.append(torch.randn(shape).to(ed))
        model.append(torch.randn(shape).to(md))
    check_update(ema, model, float(torch.rand(())))


def test_update_non_contiguous_pairs():
    base_e, base_m = torch.randn(64, 33), torch.randn(64, 33)
    ema = [
        base_e.t(),
        torch.randn(301)[::3],
        torch.randn(2, 5, 7, 3).to(memory_format=torch.channels_last),
        torch.randn(4, 5, 6, 7).to(memory_format=torch.channels_last),
    ]
    model = [
        base_m.t().contiguous(),
        torch.randn(101),
        torch.randn(2, 5, 7, 3).to(memory_format=torch.channels_last),
        torch.randn(4, 5, 6, 7).bfloat16(),
    ]
    check_update(ema, model, 0.75)
    assert ema[0].data_ptr() == base_e.data_ptr()  # updated in place, through the view


@pytest.mark.parametrize("decay", [0.9, 0.3, 0.0])
@pytest.mark.parametrize(
    "ema_dtype,model_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
    ],
)
def test_update_strided_pair_leaves_model_untouched(ema_dtype, model_dtype, decay, device="cpu"):
    # Pairs that are not flat-compatible take the ATen fallback; with decay <= 0.5 it once
    # computed the result in place in the model's tensor (Tensor.to returned the model itself).
    ema = [torch.randn(37, 65, device=device).to(ema_dtype), torch.randn(2, 3, 5, 7, device=device).to(ema_dtype)]
    model = [
        torch.randn(65, 37, device=device).to(model_dtype).t(),
        torch.randn(2, 3, 5, 7, device=device).to(model_dtype).to(memory_format=torch.channels_last),
    ]
    model_before = [bits(m.clone()) for m in model]
    check_update(ema, model, decay)
    for m, b in zip(model, model_before):
        assert torch.equal(bits(m.clone()), b)


def test_update_edge_decays_and_empty():
    e, m = torch.randn(1000), torch.randn(1000)
    e0 = e.clone()
    ema_update_([e], [m], 1.0)
    assert torch.equal(e, e0)
    ema_update_([e], [m], 0.0)
    assert torch.equal(e, m)
    ema_update_([], [], 0.5)  # no-op
    z = torch.empty(0, 3)
    ema_update_([z, e], [torch.empty(0, 3), m * 2], 0.5)
    assert torch.allclose(e, 1.5 * m)


def test_opcheck():
    samples = [
        ([torch.randn(5), torch.randn(3, 4)], [torch.randn(5), torch.randn(3, 4)], 0.9),
        ([torch.randn(70000)], [torch.randn(70000).bfloat16()], 0.5),
        ([torch.randn(2, 3).double()], [torch.randn(2, 3).double()], 0.0),
    ]
    for e, m, d in samples:
        torch.library.opcheck(torch.ops.shardkit.ema_update_.default, (e, m, d))
    for op in (torch.ops.shardkit.ema_swap_.default, torch.ops.shardkit.ema_unswap_.default):
        torch.library.opcheck(op, ([torch.randn(7), torch.randn(3)], [torch.randn(7).bfloat16(), torch.randn(3)]))
        torch.library.opcheck(op, ([torch.randint(0, 9, (4,))], [torch.randint(0, 9, (4,))]))


def test_update_bad_inputs():
    e, m = torch.randn(4), torch.randn(4)
    with pytest.raises(ValueError, match="`ema_tensors` and `model_tensors` must have the same length"):
        ema_update_([e, e], [m], 0.5)
    with pytest.raises(RuntimeError, match="`ema` and `model` must have the same length"):
        torch.ops.shardkit.ema_update_([e, e], [m], 0.5)
    with pytest.raises(RuntimeError, match=r"`ema\[1\]` and `model\[1\]` must have the same shape"):
        ema_update_([e, e], [m, torch.randn(5)], 0.5)
    with pytest.raises(RuntimeError, match="argument `ema` must hold floating-point tensors"):
        ema_update_([torch.ones(4, dtype=torch.long)], [m], 0.5)
    with pytest.raises(RuntimeError, match="argument `model` must hold floating-point tensors"):
        ema_update_([e], [torch.ones(4, dtype=torch.int32)], 0.5)
    for bad in (1.5, -0.1, float("nan"), 10**400):
        with pytest.raises(ValueError, match="argument `decay` must lie in"):
            ema_update_([e], [m], bad)
        if isinstance(bad, int):
            continue  # (the op's schema takes a float: torch refuses the int itself)
        with pytest.raises(RuntimeError, match="argument `decay` must lie in"):
            torch.ops.shardkit.ema_update_([e], [m], bad)
    with pytest.raises(TypeError, match="argument `ema_tensors` must be a list"):
        ema_update_(e, [m], 0.5)
    with pytest.raises(RuntimeError, match="must have the same dtype, or be float32 EMA with a bfloat16 model"):
        ema_swap_([e], [m.half()])


def test_swap_ops_bit_exact_on_every_pattern():
    n = 200003
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.0e38, -3.0e38, 1e-40])
    bits[: specials.numel()] = specials.view(torch.int32)
    e = bits.view(torch.float32).clone()
    m = torch.randint(-(2**15), 2**15 - 1, (n,), dtype=torch.int16).view(torch.bfloat16)
    same_e, same_m = torch.randn(1001).double(), torch.randn(1001).double()
    e0, m0, se0, sm0 = e.clone(), m.clone(), same_e.clone(), same_m.clone()
    ema_swap_([e, same_e], [m, same_m])
    assert torch.equal(same_m, se0) and torch.equal(same_e, sm0)
    finite = torch.isfinite(e0) & (e0.abs() < 3.0e38)
    # The model holds the EMA rounded to bfloat16 (within half a bfloat16 ulp).
    assert torch.all((m.float()[finite] - e0[finite]).abs() <= e0[finite].abs() * 2.0**-8 + 1e-38)
    ema_unswap_([e, same_e], [m, same_m])
    assert torch.equal(e.view(torch.int32), e0.view(torch.int32))
    assert torch.equal(m.view(torch.int16), m0.view(torch.int16))
    assert torch.equal(same_e, se0) and torch.equal(same_m, sm0)


# ---- ModelEMA ------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(self.bn(self.conv(x)).mean((2, 3)))


def train_step(model, opt=None):
    model.train()
    p0 = next(model.parameters())
    out = model(torch.randn(4, 3, 9, 9, dtype=p0.dtype, device=p0.device))
    out.float().square().mean().backward()
    if opt is None:
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    else:
        opt.step()
        opt.zero_grad()


def ramp(t, decay, tau):
    return decay * (1 - math.exp(-t / tau))


def timm_decay(step, decay, uas, warmup, gamma=1.0, power=2 / 3, min_decay=0.0):
    step = max(0, step - uas - 1)
    if step <= 0:
        return 0.0
    if warmup:
        return max(min(1 - (1 + step / gamma) ** -power, decay), min_decay)
    return decay


@pytest.mark.parametrize("kind", ["ramp", "warmup", "constant", "ramp_after", "warmup_after"])
def test_schedules_match_formula_over_1000_updates(kind):
    net = nn.Linear(1, 1, bias=False)
    uas = 7 if kind.endswith("after") else 0
    if kind.startswith("ramp"):
        ema = shardkit.ModelEMA(net, 0.999, tau=50, update_after_step=uas)
        expected = [0.0 if t <= uas else ramp(t - uas, 0.999, 50) for t in range(1, 1001)]
    elif kind.startswith("warmup"):
        ema = shardkit.ModelEMA(net, 0.999, warmup_gamma=2.0, warmup_power=0.75, min_decay=0.1, update_after_step=uas)
        expected = [timm_decay(t, 0.999, uas, True, 2.0, 0.75, 0.1) for t in range(1, 1001)]
    else:
        ema = shardkit.ModelEMA(net, 0.99, tau=None)
        expected = [timm_decay(t, 0.99, 0, False) for t in range(1, 1001)]
    ref = net.weight.double().clone()
    for t in range(1, 1001):
        with torch.no_grad():
            net.weight.normal_()
        ema.update(net)
        d = expected[t - 1]
        assert ema.get_decay(t) == pytest.approx(d, rel=1e-12, abs=1e-15)
        ref = d * ref + (1 - d) * net.weight.double()
    assert ema.updates == 1000
    assert torch.allclose(ema.module.weight.double(), ref, rtol=1e-5, atol=1e-6)


def test_update_every_and_explicit_step():
    net = nn.Linear(3, 2)
    ema = shardkit.ModelEMA(net, 0.9, tau=None, update_every=3)
    w = [ema.module.weight.clone()]
    for i in range(1, 10):
        with torch.no_grad():
            net.weight.add_(1.0)
        ema.update(net)
        w.append(ema.module.weight.clone())
        assert ema.updates == i // 3
        assert torch.equal(w[-1], w[-2]) == (i % 3 != 0)
    e2 = shardkit.ModelEMA(net, 0.9, warmup_power=1.0)  # timm: decay from the given step
    before = e2.module.weight.clone()
    e2.update(net, step=5)
    d = timm_decay(5, 0.9, 0, True, power=1.0)
    assert torch.allclose(e2.module.weight, d * before + (1 - d) * net.weight)


def test_matches_ultralytics_per_tensor_loop():
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    net = Net()
    ema = shardkit.ModelEMA(net, 0.99, tau=20)
    ref = {k: v.clone() for k, v in net.state_dict().items()}
    for updates in range(1, 31):
        train_step(net)
        ema.update(net)
        d = 0.99 * (1 - math.exp(-updates / 20))
        for k, v in net.state_dict().items():  # the per-tensor loop of yolov3's ModelEMA
            if v.dtype.is_floating_point:
                ref[k] *= d
                ref[k] += (1 - d) * v
            else:
                ref[k].copy_(v)  # integer buffers are copied
    for k, v in ema.module.state_dict().items():
        assert torch.allclose(v, ref[k], rtol=1e-5, atol=1e-6), k
    assert not ema.module.training and not any(p.requires_grad for p in ema.module.parameters())
    assert ema.ema is ema.module


def test_dtype_buffers_and_wrappers():
    net = Net().bfloat16()
    ema = shardkit.ModelEMA(nn.DataParallel(net), 0.5, tau=None, dtype=torch.float32, copy_float_buffers=True)
    assert all(p.dtype == torch.float32 for p in ema.module.parameters())
    assert ema.module.bn.num_batches_tracked.dtype == torch.long
    train_step(net)
    ema.update(torch.compile(net))  # unwrapped through _orig_mod; first update copies (timm rule)
    first = net.fc.weight.float().clone()
    assert torch.equal(ema.module.fc.weight, first)
    train_step(net)
    with torch.no_grad():  # the second update must see a changed model, or it is not observed
        net.fc.weight.add_(torch.randn_like(net.fc.weight))  # (a bf16 SGD step may round to no change)
    assert not torch.equal(net.fc.weight.float(), first)
    ema.update(nn.DataParallel(net))
    torch.testing.assert_close(ema.module.fc.weight, 0.5 * first + 0.5 * net.fc.weight.float(), rtol=1e-6, atol=1e-7)
    assert torch.equal(ema.module.bn.running_mean, net.bn.running_mean.float())  # copied, not averaged
    assert int(ema.module.bn.num_batches_tracked) == int(net.bn.num_batches_tracked) == 2


def test_state_dict_round_trip_and_resume():
    net = Net()
    a = shardkit.ModelEMA(net, 0.98, warmup_gamma=3.0, update_every=2)
    for _ in range(5):
        train_step(net)
        a.update(net)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    b = shardkit.ModelEMA(Net(), 0.5)  # different schedule: the state_dict restores it
    b.load_state_dict(sd)
    assert (b.updates, b._calls, b.warmup_gamma, b.update_every) == (a.updates, a._calls, 3.0, 2)
    for _ in range(5):
        train_step(net)
        a.update(net)
        b.update(net)
    for (k, va), vb in zip(a.module.state_dict().items(), b.module.state_dict().values()):
        assert torch.equal(va, vb), k
    plain = Net()
    plain.load_state_dict(a.module.state_dict())
    with pytest.raises(ValueError, match="argument `state_dict` is not a ModelEMA state_dict"):
        b.load_state_dict(a.module.state_dict())


@pytest.mark.parametrize(
    "model_dtype,ema_dtype",
    [(torch.float32, None), (torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.bfloat16, None)],
)
def test_swap_restores_bit_exactly(model_dtype, ema_dtype):
    net = Net().to(model_dtype)
    ema = shardkit.ModelEMA(net, 0.9, dtype=ema_dtype)
    for _ in range(3):
        train_step(net)
        ema.update(net)
    model_before = {k: v.clone() for k, v in net.state_dict().items()}
    ema_before = {k: v.clone() for k, v in ema.module.state_dict().items()}
    with ema.swap(net) as swapped:
        assert swapped is net
        for k, v in net.state_dict().items():  # the model holds the EMA (rounded to its dtype)
            assert torch.equal(v, ema_before[k].to(v.dtype)) or (
                model_dtype == torch.bfloat16 and torch.allclose(v.float(), ema_before[k].float(), rtol=2**-8)
            ), k
        with pytest.raises(RuntimeError, match="called inside `with ema.swap"):
            ema.update(net)
    for k, v in net.state_dict().items():
        assert torch.equal(bits(v), bits(model_before[k])), k
    for k, v in ema.module.state_dict().items():
        assert torch.equal(bits(v), bits(ema_before[k])), k
    with pytest.raises(KeyError):
        with ema.swap(net):
            raise KeyError("restored on exceptions too")
    assert all(torch.equal(v, model_before[k]) for k, v in net.state_dict().items())


def test_attach_updates_after_optimizer_step():
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ema = shardkit.ModelEMA(net, 0.9)
    handle = ema.attach(opt)
    for _ in range(3):
        train_step(net, opt)
    assert ema.updates == 3
    handle.remove()
    train_step(net, opt)
    assert ema.updates == 3


def test_model_ema_bad_inputs():
    net = Net()
    for kwargs, msg in [
        ({"decay": 1.5}, "argument `decay` must lie in"),
        ({"decay": 0.9, "min_decay": 0.95}, "argument `min_decay` must lie in"),
        ({"tau": 0}, "argument `tau` must be > 0"),
        ({"warmup_gamma": -1.0}, "argument `warmup_gamma` must be > 0"),
        ({"update_every": 0}, "argument `update_every` must be an int >= 1"),
        ({"update_after_step": -1}, "argument `update_after_step` must be an int >= 0"),
        ({"dtype": torch.int64}, "argument `dtype` must be a floating"),
    ]:
        with pytest.raises(ValueError, match=msg):
            shardkit.ModelEMA(net, **kwargs)
    with pytest.raises(TypeError, match="argument `model` must be an nn.Module"):
        shardkit.ModelEMA([torch.randn(3)])
    ema = shardkit.ModelEMA(net)
    with pytest.raises(ValueError, match="argument `model` does not have the EMA's structure"):
        ema.update(nn.Linear(8, 5))
    other = Net()
    other.fc = nn.Linear(8, 6)
    with pytest.raises(ValueError, match=r"argument `model` has fc.weight of shape \(6, 8\)"):
        ema.update(other)
    with pytest.raises(TypeError, match="argument `optimizer` must be a torch.optim.Optimizer"):
        ema.attach(net)


# ---- torch's in-place rules (csrc/composite/ema_inplace.cpp, csrc/ema_common.h) ------------


def test_update_bumps_version_so_autograd_sees_the_write():
    w = torch.randn(5, requires_grad=True)
    y = w * w  # saves w
    e = w.detach()  # shares w's memory and version counter
    v0 = e._version
    ema_update_([e], [torch.randn(5)], 0.5)
    assert e._version == v0 + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    # the raw op too (no Python wrapper), and the swap pair on both lists
    a, b = torch.randn(4), torch.randn(4)
    torch.ops.shardkit.ema_update_([a], [b], 0.3)
    ema_swap_([a], [b])
    ema_unswap_([a], [b])
    assert (a._version, b._version) == (3, 2)


def test_writes_into_a_leaf_that_requires_grad_are_refused():
    p, m = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    before = p.detach().clone()
    with pytest.raises(
        RuntimeError, match=r"ema_update_: a leaf Variable that requires grad is being used in an in-pla"
    ):
        ema_update_([p], [torch.randn(3)], 0.5)
    with pytest.raises(RuntimeError, match=r"ema_swap_: a leaf Variable .*\(`model\[0\]`\)"):
        ema_swap_([torch.randn(3)], [m])
    with pytest.raises(RuntimeError, match=r"ema_update_: `ema\[0\]` requires grad, but the op is not differentiable"):
        ema_update_([p * 1], [torch.randn(3)], 0.5)
    assert torch.equal(p.detach(), before)
    e = torch.randn(3)
    ema_update_([e], [m], 0.5)  # reading a parameter is fine
    with torch.no_grad():  # as torch's in-place ops: allowed without grad mode
        ema_update_([p], [torch.randn(3)], 0.5)
        ema_swap_([e], [m])
        ema_unswap_([e], [m])


def test_overlapping_memory_is_refused():
    x = torch.randn(10)
    before = x.clone()
    # the pair is named in address order
    with pytest.raises(
        RuntimeError, match=r"ema_update_: `(model\[0\]` and `ema|ema\[0\]` and `model)\[0\]` share memo"
    ):
        ema_update_([x[2:7]], [x[:5]], 0.5)
    with pytest.raises(RuntimeError, match=r"`ema\[0\]` and `ema\[1\]` share memory"):
        ema_update_([x[:4], x[3:7]], [torch.randn(4), torch.randn(4)], 0.5)
    with pytest.raises(
        RuntimeError, match=r"ema_swap_: `(ema\[1\]` and `model\[0|model\[0\]` and `ema\[1)\]` share memory"
    ):
        ema_swap_([torch.randn(2), x[:2]], [x[1:3], torch.randn(2)])
    with pytest.raises(RuntimeError, match="share memory"):
        ema_update_([x[::2]], [x[1::2]], 0.5)  # conservative: interleaved views count as shared
    assert torch.equal(x, before)
    m = torch.randn(6)
    ema_update_([torch.randn(3), torch.randn(3)], [m[:3], m[:3]], 0.5)  # read-only model memory may repeat
    ema_update_([x[:5], x[5:]], [m[:5], m[1:]], 0.5)  # adjacent, not overlapping


@pytest.mark.parametrize("bad", [None, "0.5", True, torch.tensor(True)])
def test_update_decay_type(bad):
    with pytest.raises(TypeError, match="argument `decay` must be a float in"):
        ema_update_([torch.randn(2)], [torch.randn(2)], bad)


def test_other_device_types_and_mixed_devices_raise():
    cpu, meta = torch.randn(3), torch.empty(3, device="meta")
    with pytest.raises(RuntimeError, match="ema_update_: tensors on meta are not supported"):
        ema_update_([meta], [torch.empty(3, device="meta")], 0.5)
    with pytest.raises(RuntimeError, match=r"ema_update_: `model\[0\]` is on meta but `ema` is on cpu"):
        ema_update_([cpu], [meta], 0.5)
    with pytest.raises(RuntimeError, match=r"`ema\[0\]` is on cpu but `ema\[1\]` is on meta"):
        ema_swap_([cpu, meta], [torch.randn(3), torch.randn(3)])


# ---- ModelEMA: a model changed after the EMA was made ----------------------------------


def test_model_changed_after_first_update_is_named():
    net = Net()
    ema = shardkit.ModelEMA(net, decay=0.5, tau=None)
    ema.update(net)
    net.extra = nn.Parameter(torch.randn(2))  # added
    with pytest.raises(ValueError, match=r"structure \(missing \[\], unexpected \['extra'\]\); a parameter"):
        ema.update(net)
    del net.extra
    ema.update(net)
    net.fc = nn.Linear(8, 6)  # replaced by another shape
    with pytest.raises(ValueError, match=r"argument `model` has fc.weight of shape \(6, 8\), the EMA has \(5, 8\)"):
        ema.update(net)
    net.fc = nn.Linear(8, 5)  # same shapes again: averaged (new tensors are picked up)
    ema.update(net)
    with torch.no_grad():
        net.fc.weight.data = torch.randn(4, 8)  # reshaped in place: same Parameter object
    with pytest.raises(ValueError, match=r"has fc.weight of shape \(4, 8\), the EMA has \(5, 8\)"):
        ema.update(net)
    net.fc.weight = nn.Parameter(torch.randn(5, 8))
    net.fc.bias = None  # removed
    with pytest.raises(ValueError, match=r"missing \['fc.bias'\]"):
        ema.update(net)


def test_model_ema_picks_up_a_replaced_tensor_of_the_same_shape():
    net = Net()
    ema = shardkit.ModelEMA(net, decay=0.0, tau=None)
    ema.update(net)
    net.fc.weight = nn.Parameter(torch.randn(5, 8))
    ema.update(net)  # decay 0 copies: the EMA must follow the new tensor
    assert torch.equal(ema.module.fc.weight, net.fc.weight.detach())


@pytest.mark.parametrize(
    "name,bad",
    [("decay", None), ("min_decay", None)] + [(n, "0.9") for n in ("decay", "min_decay", "tau", "warmup_gamma")],
)
def test_model_ema_float_arguments_type(name, bad):
    with pytest.raises(TypeError, match=rf"argument `{name}` must be a float, got"):
        shardkit.ModelEMA(Net(), **{name: bad})


def test_model_ema_none_selects_the_constant_decay_or_the_default_warmup():
    # None is valid for tau (the constant decay) and for warmup_gamma (its default, 1.0)
    net = nn.Linear(2, 2)
    const = shardkit.ModelEMA(net, 0.9, tau=None, warmup_gamma=None)
    assert const.tau is None and [const.get_decay(t) for t in (1, 2, 50)] == [0.0, 0.9, 0.9]
    warm = shardkit.ModelEMA(net, 0.9, warmup_gamma=None, warmup_power=1.0)
    assert warm.warmup_gamma is None
    assert warm.get_decay(3) == pytest.approx(1 - (1 + 2 / 1.0) ** -1.0, rel=1e-12)


def test_model_ema_load_state_dict_missing_or_corrupt_key():
    net = Net()
    ema = shardkit.ModelEMA(net)
    ema.update(net)
    good = ema.state_dict()
    for key in ("decay", "module", "updates"):
        sd = dict(good)
        del sd[key]
        with pytest.raises(ValueError, match=rf"argument `state_dict` lacks the key '{key}'"):
            ema.load_state_dict(sd)
    for key, value in (("decay", "0.99"), ("updates", 1.5), ("module", [1]), ("enabled", 1), ("tau", True)):
        with pytest.raises(ValueError, match=rf"argument `state_dict` has a corrupt '{key}'"):
            ema.load_state_dict({**good, key: value})
    with pytest.raises(ValueError, match=r"argument `state_dict`: argument `decay` must lie in \[0, 1\]"):
        ema.load_state_dict({**good, "decay": 2.0})
    assert ema.decay == good["decay"]  # the refused schedule is not half-applied
    ema.load_state_dict(good)


def test_model_spread_over_devices_gets_one_update_per_device():
    """A pipelined backbone spreads a model over devices: ModelEMA calls the fused op once
    per device. CPU stands in; the op sees two groups when the EMA lives on two 'devices'
    of the same type only on GPUs, so here the grouping is checked to equal a plain update."""
    torch.manual_seed(int(torch.randint(0, 2**31, ()).item()))
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    ema = shardkit.ModelEMA(model, decay=0.9, tau=None)
    ref = [t.detach().clone().double() for t in ema.module.state_dict().values()]
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model(torch.randn(5, 3))
        ema.update(model)
        d = ema.get_decay(ema.updates)  # the first update copies (decay 0)
        for r, m in zip(ref, model.state_dict().values()):
            if m.is_floating_point():
                r.add_((1 - d) * (m.double() - r))
            else:
                r.copy_(m)
    assert len(ema._avg_groups) == 1
    for r, e in zip(ref, ema.module.state_dict().values()):
        torch.testing.assert_close(e.double(), r, rtol=1e-6, atol=1e-6)


def test_model_ema_pickles_with_its_weights_schedule_and_counters(tmp_path):
    import io

    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4))
    ema = shardkit.ModelEMA(model, decay=0.9, tau=None)
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model)
    buf = io.BytesIO()
    torch.save(ema, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert back.updates == ema.updates == 3
    for a, b in zip(back.module.state_dict().values(), ema.module.state_dict().values()):
        assert torch.equal(a, b)
    back.update(model)  # the next update follows the model it is given
    ema.update(model)
    for a, b in zip(back.module.state_dict().values(), ema.module.state_dict().values()):
        assert torch.equal(a, b)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="attach\\(optimizer, model\\)"):
        back.attach(opt)
        model(torch.randn(3, 5)).sum().backward()
        opt.step()


@pytest.mark.parametrize("ema_dtype, model_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
def test_decays_0_and_1_are_exact_whatever_the_values(ema_dtype, model_dtype, device="cpu"):
    # The lerp formulas give NaN where m - e is infinite (0 * inf): decay 0 must still copy
    # the model (resetting a diverged EMA) and decay 1 keep the EMA, strided pairs included.
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 3e38, -3e38, 1.0, 0.0, -2.5])
    e = special.repeat(9000)[: 2 * 65536 + 5].to(device, ema_dtype)
    m = special.flip(0).repeat(9000)[: 2 * 65536 + 5].to(device, model_dtype)
    for ema_t, model_t in ((e, m), (e.view(-1, 5)[:, ::2], m.view(-1, 5)[:, ::2])):  # flat, strided
        keep = ema_t.clone()
        ema_update_([ema_t], [model_t], 1.0)
        assert torch.equal(ema_t.nan_to_num(), keep.nan_to_num()) and torch.equal(ema_t.isnan(), keep.isnan())
        ema_update_([ema_t], [model_t], 0.0)
        want = model_t.to(ema_dtype)
        assert torch.equal(ema_t.nan_to_num(), want.nan_to_num()) and torch.equal(ema_t.isnan(), want.isnan())


def test_updates_through_the_cached_lists_equal_the_op_and_follow_the_model():
    # ModelEMA builds the argument lists of shardkit._C.ema_update_lists once per set of model
    # tensors and then passes only the decay with them; the result must equal the op called on
    # fresh lists, after parameters are replaced (new objects: new lists) and after a tensor's
    # storage is swapped under the same object (the lists hold the object, which reads the new
    # storage).
    net = Net()
    ema = shardkit.ModelEMA(net, decay=0.7, tau=None)
    names = list(ema.module.state_dict())
    ref = [t.detach().clone() for t in ema.module.state_dict().values()]
    for i in range(7):
        train_step(net)
        if i == 2:
            net.fc.weight = nn.Parameter(torch.randn(5, 8))
        if i == 4:
            with torch.no_grad():
                net.conv.weight.data = torch.randn_like(net.conv.weight)
        d = ema.get_decay(ema.updates + 1)
        ema.update(net)
        built = ema._tracker._lists[0][1]
        sd = net.state_dict()
        for r, k in zip(ref, names):
            if r.is_floating_point():
                shardkit.ops.ema_update_([r], [sd[k]], d)
            else:
                r.copy_(sd[k])
        out = ema.module.state_dict()
        for r, k in zip(ref, names):
            assert torch.equal(out[k], r), (i, k)
        ema.update(net)  # the same tensors: the same lists
        assert ema._tracker._lists[0][1] is built
        for r, k in zip(ref, names):
            if r.is_floating_point():
                shardkit.ops.ema_update_([r], [sd[k]], ema.get_decay(ema.updates))
            else:
                r.copy_(sd[k])


def test_update_lists_entry_point_checks_its_arguments():
    update_lists = shardkit._C.ema_update_lists
    e, m = torch.zeros(3), torch.ones(3)
    with pytest.raises(TypeError, match="takes 5 arguments"):
        update_lists([[e]], [[m]], [], [])
    with pytest.raises(TypeError, match="`ema_groups` and `model_groups` must be lists of lists"):
        update_lists(([e],), [[m]], [], [], 0.5)
    with pytest.raises(RuntimeError, match="must hold the same number of groups, got 1 and 2"):
        update_lists([[e]], [[m], [m]], [], [], 0.5)
    with pytest.raises(TypeError, match=r"`model_groups\[0\]\[1\]` is a str, not a tensor"):
        update_lists([[e, e]], [[m, "x"]], [], [], 0.5)
    with pytest.raises(RuntimeError, match=r"`ema_groups\[0\]` and `model_groups\[0\]` must have the same length"):
        update_lists([[e]], [[m, m]], [], [], 0.5)
    with pytest.raises(RuntimeError, match="`copy_to` and `copy_from` must have the same length, got 1 and 0"):
        update_lists([], [], [e], [], 0.5)
    with pytest.raises(TypeError, match="must be real number"):
        update_lists([], [], [], [], "0.5")
    with pytest.raises(RuntimeError, match="argument `decay` must lie in"):  # the op's own checks run
        update_lists([[e]], [[m]], [], [], 1.5)
    assert torch.equal(e, torch.zeros(3))
    update_lists([[e], []], [[m], []], [torch.zeros(2, dtype=torch.long)], [torch.ones(2, dtype=torch.long)], 0.25)
    assert torch.equal(e, torch.full((3,), 0.75))
