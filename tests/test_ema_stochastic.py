"""Stochastic rounding of bfloat16 EMAs (ModelEMA's default for them, as timm's ModelEmaV3):
each update rounded up or down to bfloat16 with the expected value of the fp32 update."""

import pytest
import torch
from torch import nn

import shardkit

OP = torch.ops.shardkit.ema_update_stochastic_.default


def SR(ema, model, decay, seed, counter, salts=None):
    """The op with each tensor's salt its index in the list (as ModelEMA gives a plain model)."""
    OP(ema, model, decay, seed, counter, list(range(len(ema))) if salts is None else salts)


def fp32_update(e, m, decay):
    """The kernels' fp32 value before rounding: both forms of lerp, each op rounded."""
    ev, mv = e.float(), m.float()
    w = 1.0 - decay
    diff = mv - ev
    return (
        ev + torch.tensor(w, dtype=torch.float32) * diff
        if w < 0.5
        else mv - torch.tensor(decay, dtype=torch.float32) * diff
    )


def bf16_neighbours(v):
    """The bf16 values either side of fp32 v in magnitude: truncation and one ulp further."""
    bits = v.view(torch.int32)
    lo = (bits & -65536).view(torch.float32)
    hi = ((bits & -65536) + 65536).view(torch.float32)
    return lo, hi


@pytest.mark.parametrize("decay", [0.3, 0.7, 0.9999])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_each_value_rounds_to_a_neighbour_with_the_right_odds(decay, model_dtype):
    torch.manual_seed(0)
    n = 200_003
    e = torch.randn(n).to(torch.bfloat16)
    m = (torch.randn(n) * 3).to(model_dtype)
    out = e.clone()
    SR([out], [m], decay, 1234, 7)
    v = fp32_update(e, m if model_dtype != torch.float64 else m.float(), decay)
    if model_dtype == torch.float64:  # fp64 arithmetic, then one rounding to fp32
        ed, md = e.double(), m
        v = (ed + (1.0 - decay) * (md - ed) if decay < 0.5 else md - decay * (md - ed)).float()
    lo, hi = bf16_neighbours(v)
    got = out.float()
    assert ((got == lo) | (got == hi)).all()
    exact = v.view(torch.int32) & 65535 == 0
    assert (got[exact] == v[exact]).all()  # a value bf16 holds stays itself
    frac = (v.view(torch.int32) & 65535).double() / 65536  # the odds of rounding up in magnitude
    up = (got == hi).double()
    inexact = ~exact
    # the mean rounding-up rate matches the mean fraction (binomial spread: about 1 / sqrt(n))
    assert abs(up[inexact].mean() - frac[inexact].mean()) < 5e-3
    # and rises with it: above 3/4 rounds up far more often than below 1/4
    assert up[inexact & (frac > 0.75)].mean() > 0.8 and up[inexact & (frac < 0.25)].mean() < 0.2


def test_the_bits_are_keyed_by_seed_counter_and_tensor():
    torch.manual_seed(1)
    e = torch.randn(50_000).to(torch.bfloat16)
    m = torch.randn(50_000)

    def run(seed, counter, threads=None):
        out = [e.clone(), e.clone()]
        old = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            SR(out, [m, m], 0.9, seed, counter)
        finally:
            torch.set_num_threads(old)
        return out

    a = run(3, 5)
    assert all(torch.equal(x, y) for x, y in zip(a, run(3, 5, threads=1)))  # same whatever the threads
    assert not torch.equal(a[0], a[1])  # another tensor index, other bits
    same = [e.clone(), e.clone()]
    SR(same, [m, m], 0.9, 3, 5, salts=[7, 7])  # the salt keys the bits, not the position
    assert torch.equal(same[0], same[1]) and torch.equal(same[1], a[1]) is False
    assert not torch.equal(a[0], run(3, 6)[0]) and not torch.equal(a[0], run(4, 5)[0])


def test_special_values_and_the_ends():
    e = torch.tensor([1.0, -2.0, 3.0, 0.5, 3.3e38, -1.0], dtype=torch.bfloat16)
    m = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.25, 3.39e38, -1.0])
    out = e.clone()
    SR([out], [m], 0.7, 0, 0)  # (e + 0.3 (m - e): infinities stay; ema_update_'s lerp forms)
    assert out[0] == float("inf") and out[1] == float("-inf") and out[2].isnan()
    assert out[5] == -1.0  # exact in bf16: unchanged by the random bits
    assert out[4] > 3.3e38  # finite or rounded past the bf16 maximum, never NaN
    keep, copy = e.clone(), e.clone()
    SR([keep], [m], 1.0, 0, 0)
    SR([copy], [m], 0.0, 0, 0)
    assert torch.equal(keep, e)
    assert torch.equal(copy.float()[~m.isnan()], m.to(torch.bfloat16).float()[~m.isnan()]) and copy[2].isnan()


def test_other_dtypes_are_updated_as_ema_update_does():
    torch.manual_seed(5)
    ema = [torch.randn(300).to(dt) for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64)]
    model = [torch.randn(300) for _ in ema]
    out, ref = [e.clone() for e in ema], [e.clone() for e in ema]
    SR(out, model, 0.7, 1, 2)
    shardkit.ops.ema_update_([ref[i] for i in (0, 2, 3)], [model[i] for i in (0, 2, 3)], 0.7)
    assert all(torch.equal(out[i], ref[i]) for i in (0, 2, 3))
    lo, hi = bf16_neighbours(fp32_update(ema[1], model[1], 0.7))
    assert ((out[1].float() == lo) | (out[1].float() == hi)).all()


def test_argument_checks_name_the_argument():
    e, m = torch.zeros(4, dtype=torch.bfloat16), torch.ones(4)
    with pytest.raises(RuntimeError, match="argument `salts` must have one entry per `ema` tensor"):
        OP([e], [m], 0.5, 0, 0, [])
    with pytest.raises(RuntimeError, match="argument `seed` must be >= 0"):
        SR([e], [m], 0.5, -1, 0)
    with pytest.raises(RuntimeError, match="argument `decay` must lie in"):
        SR([e], [m], 1.5, 0, 0)
    with pytest.raises(RuntimeError, match="same shape"):
        SR([e], [torch.ones(5)], 0.5, 0, 0)
    strided = torch.zeros(4, 2, dtype=torch.bfloat16)[:, 0]  # strided views run on copies
    SR([strided], [m], 0.0, 0, 0)
    assert (strided == 1).all()


def same_state(a, b, settings=True):
    """The same weights and counters (and, with ``settings``, the same rounding settings)."""
    sa, sb = a.state_dict(), b.state_dict()
    ma, mb = sa.pop("module"), sb.pop("module")
    if not settings:
        for key in ("stochastic_rounding", "stochastic_rounding_seed"):
            sa.pop(key), sb.pop(key)
    return sa == sb and ma.keys() == mb.keys() and all(torch.equal(v, mb[k]) for k, v in ma.items())


def bf16_net():
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64)).to(torch.bfloat16)
    with torch.no_grad():
        net[0].weight.fill_(0.5)
    return net


def test_a_bf16_ema_moves_where_rounding_to_nearest_freezes():
    # decay 0.999: each update moves the EMA by 1e-4, far below a bf16 ulp at 0.5 (2^-8):
    # rounded to nearest it never moves; rounded stochastically it follows the exact EMA.
    net = bf16_net()
    sr = shardkit.ModelEMA(net, decay=0.999, tau=None)
    rne = shardkit.ModelEMA(net, decay=0.999, tau=None, stochastic_rounding=False)
    with torch.no_grad():
        net[0].weight.fill_(0.6)
    for step in range(1000):
        sr.update(net, step=step + 2)
        rne.update(net, step=step + 2)
    exact = 0.6 - 0.1 * 0.999**1000
    assert (rne.module[0].weight == 0.5).all()
    assert abs(sr.module[0].weight.double().mean().item() - exact) < 2e-3
    assert sr.module[0].weight.dtype == torch.bfloat16


def test_round_to_nearest_when_off_and_fp32_emas_untouched():
    net = bf16_net()
    off = shardkit.ModelEMA(net, decay=0.9, tau=None, stochastic_rounding=False)
    fp32 = shardkit.ModelEMA(net, decay=0.9, tau=None, dtype=torch.float32)
    fp32_off = shardkit.ModelEMA(net, decay=0.9, tau=None, dtype=torch.float32, stochastic_rounding=False)
    ref = [e.clone() for e in off.module.state_dict().values()]
    with torch.no_grad():
        net[0].weight.add_(torch.randn_like(net[0].weight))
    for ema in (off, fp32, fp32_off):
        ema.update(net, step=5)
    floats = [r for r in ref if r.is_floating_point()]
    shardkit.ops.ema_update_(floats, [v for v in net.state_dict().values() if v.is_floating_point()], 0.9)
    got = [v for v in off.module.state_dict().values() if v.is_floating_point()]
    assert all(torch.equal(a, b) for a, b in zip(got, floats))
    assert same_state(fp32, fp32_off, settings=False)


def test_resume_continues_the_same_bits():
    net = bf16_net()
    a = shardkit.ModelEMA(net, decay=0.99, stochastic_rounding_seed=9)
    b = shardkit.ModelEMA(net, decay=0.99, stochastic_rounding_seed=9)
    for i in range(6):
        with torch.no_grad():
            net[0].weight.add_(0.01)
        a.update(net)
        if i == 2:
            state = a.state_dict()
            b.load_state_dict(state)
        elif i > 2:
            b.update(net)
    assert same_state(a, b)
    c = shardkit.ModelEMA(net, decay=0.99, stochastic_rounding_seed=10)
    c.load_state_dict(state)
    with torch.no_grad():
        net[0].weight.add_(0.01)
    c.update(net)
    b.update(net)
    assert not torch.equal(c.module[0].weight, b.module[0].weight)  # another seed, other bits


@pytest.mark.parametrize("bad", [-1, 1.5, True, "0", 2**63])
def test_seed_and_flag_checks(bad):
    net = bf16_net()
    with pytest.raises((TypeError, ValueError), match="stochastic_rounding_seed"):
        shardkit.ModelEMA(net, stochastic_rounding_seed=bad)
    with pytest.raises(TypeError, match="stochastic_rounding"):
        shardkit.ModelEMA(net, stochastic_rounding=1)


@pytest.mark.gpu
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_cuda_equals_cpu_bit_for_bit(model_dtype):
    # 63 tensors: more than one launch's 48, chunks of 16384 elements straddled, a strided pair
    torch.manual_seed(4)
    sizes = [1, 1000, 300_001, 16384, 16385] + [int(n) for n in torch.randint(1, 5000, (58,))]
    e = [torch.randn(n).to(torch.bfloat16) for n in sizes]
    m = [(torch.randn(x.numel()) * 2).to(model_dtype) for x in e]
    for decay in (0.3, 0.9999):
        cpu = [x.clone() for x in e]
        gpu = [x.cuda() for x in e]
        SR(cpu, m, decay, 77, 12)
        SR(gpu, [x.cuda() for x in m], decay, 77, 12)
        assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu))
    base = torch.randn(300, 2).to(torch.bfloat16)
    cpu, gpu = base.clone(), base.cuda()
    SR([cpu[:, 0]], [m[2][:300]], 0.3, 5, 1)
    SR([gpu[:, 0]], [m[2][:300].cuda()], 0.3, 5, 1)
    assert torch.equal(cpu, gpu.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_cuda_model_ema_equals_cpu(cuda_graph):
    net = bf16_net()
    gnet = bf16_net().cuda()
    cpu = shardkit.ModelEMA(net, decay=0.99, tau=None)
    gpu = shardkit.ModelEMA(gnet, decay=0.99, tau=None, cuda_graph=cuda_graph)
    for step in range(4):
        with torch.no_grad():
            net[0].weight.add_(0.003)
            gnet[0].weight.add_(0.003)
        cpu.update(net, step=step + 2)
        gpu.update(gnet, step=step + 2)
    gs = gpu.state_dict()["module"]
    assert all(torch.equal(v, gs[k].cpu()) for k, v in cpu.state_dict()["module"].items())


def test_a_converted_submodule_keeps_updating():
    # One submodule of a bf16 EMA converted to fp32 (ema.module[1].float()): the update raised
    # "must hold bfloat16 tensors"; it now rounds that submodule to nearest, the others at random.
    torch.manual_seed(6)
    net = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)).bfloat16()
    ema = shardkit.ModelEMA(net, decay=0.5, tau=None)
    ema.module[1].float()
    ref = {k: v.double() for k, v in ema.module.state_dict().items()}
    ema.update(net, step=3)
    for k, v in ema.module.state_dict().items():
        exact = ref[k] + 0.5 * (net.state_dict()[k].double() - ref[k])
        assert (v.double() - exact).abs().max() <= (2**-7 if v.dtype == torch.bfloat16 else 1e-6) * exact.abs().max()
    assert ema.module[1].weight.dtype == torch.float32


def test_the_flag_and_seed_are_read_at_each_update_and_checked_when_set():
    net = bf16_net()
    ema = shardkit.ModelEMA(net, decay=0.999, tau=None)
    ema.stochastic_rounding = False  # as timm's ModelEmaV3 reads it: at each update
    with torch.no_grad():
        net[0].weight.fill_(0.6)
    for step in range(50):
        ema.update(net, step=step + 2)
    assert (ema.module[0].weight == 0.5).all()
    ema.stochastic_rounding = True
    for step in range(300):
        ema.update(net, step=step + 52)
    assert ema.module[0].weight.float().mean() > 0.51
    with pytest.raises(ValueError, match="stochastic_rounding_seed"):
        ema.stochastic_rounding_seed = -1
    with pytest.raises(TypeError, match="stochastic_rounding"):
        ema.stochastic_rounding = "yes"


def test_a_pickle_from_before_stochastic_rounding_updates():
    import pickle

    net = bf16_net()
    ema = shardkit.ModelEMA(net, decay=0.9, tau=None)
    state = ema.__getstate__()
    for key in ("stochastic_rounding", "stochastic_rounding_seed", "_bf16", "_salts"):
        del state[key]  # what a ModelEMA pickled by an earlier release holds
    old = shardkit.ModelEMA.__new__(shardkit.ModelEMA)
    old.__setstate__(pickle.loads(pickle.dumps(state)))
    twin = shardkit.ModelEMA(net, decay=0.9, tau=None)
    with torch.no_grad():
        net[0].weight.add_(0.01)
    old.update(net, step=5)
    twin.update(net, step=5)
    assert same_state(old, twin)
