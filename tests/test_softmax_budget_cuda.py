"""The memory budget on CUDA (``SHARDKIT_CUDA_KEEP=1``, experimental until measured on a GPU).

Run anywhere: the switch, the kept logits' dtype per device and the budget arithmetic that
follows from it, the fake kernel's dtypes, and "auto" on CUDA.

On a CUDA GPU (marker ``gpu``, skipped with the reason elsewhere): the kept kernels (unfused,
cuBLAS) at budgets keeping no, some and every chunk, against the float64 reference and budget 0
(fp32 / fp64 within 1e-5; bf16 / fp16 within 2x torch's own error, also with targets near their
class, where the fp32 target value matters); the kept slots' contents; margins, smoothing,
ignore_index, sampling, mixed fp32 weights, torch.compile, gradcheck, opcheck, a retained graph;
and the bytes held from forward to backward never above the budget (the tensors autograd
saves, and torch.cuda.memory_allocated)."""

import math
import warnings

import pytest
import torch
from softmax_checks import (
    LOSS_MARGINS,
    MARGINS,
    assert_matches_reference,
    check_against_reference,
    check_low_precision,
    check_module_low_precision,
    kw,
    make_case,
    make_labels,
    opcheck_samples,
    rel,
)
from test_softmax_budget import ALL, OpLog, module_extra_bytes, saved_bytes

import shardkit
from shardkit.ops import _kept, ce_shard_stats, kept_bytes, kept_chunks_for_budget, kept_logits_dtype
from shardkit.softmax import budget as budget_mod

LOW = (torch.bfloat16, torch.float16)


@pytest.fixture
def keep_on(monkeypatch):
    monkeypatch.setenv(_kept.CUDA_KEEP_ENV, "1")


def cuda_budgets(B, C, chunk, dtype=torch.float32):
    """Budgets keeping one chunk, about half the chunks, all but one, and all (CUDA's kept dtype)."""
    nchunks = -(-C // chunk)
    per = [kept_bytes(B, C, chunk, k, dtype, "cuda") for k in range(nchunks + 1)]
    return [per[k] for k in sorted({1, nchunks // 2, nchunks - 1, nchunks} - {0})]


# ---- anywhere: the switch, dtypes and bytes ---------------------------------------------------


def test_the_switch_reads_the_environment(monkeypatch):
    monkeypatch.setattr(_kept, "_warned_env", set())
    monkeypatch.delenv(_kept.CUDA_KEEP_ENV, raising=False)
    assert not _kept.cuda_keep_enabled()
    for value, on in (("0", False), ("", False), ("1", True)):
        monkeypatch.setenv(_kept.CUDA_KEEP_ENV, value)
        assert _kept.cuda_keep_enabled() is on
    monkeypatch.setenv(_kept.CUDA_KEEP_ENV, "yes")
    with pytest.warns(UserWarning, match=r"SHARDKIT_CUDA_KEEP='yes' is neither 0 nor 1: CUDA shards recompute"):
        assert not _kept.cuda_keep_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per value
        assert not _kept.cuda_keep_enabled()


def test_kept_dtype_and_bytes_per_device():
    for dt in LOW:
        assert kept_logits_dtype(dt, "cuda") == dt
        assert kept_logits_dtype(dt, torch.device("cuda", 1)) == dt and kept_logits_dtype(dt, "cuda:0") == dt
        assert kept_logits_dtype(dt, "cpu") == kept_logits_dtype(dt) == torch.float32
    for dt in (torch.float32, torch.float64):
        assert kept_logits_dtype(dt, "cuda") == kept_logits_dtype(dt, "cpu") == dt
    B, C, chunk = 10, 95, 20  # 5 chunks, the last one 15 classes
    assert kept_bytes(B, C, chunk, 2, torch.bfloat16, "cuda") == B * (2 * chunk * 2 + 4)  # + fp32 targets
    assert kept_bytes(B, C, chunk, 2, torch.bfloat16, "cpu") == B * (2 * chunk * 4 + 4)
    assert kept_bytes(B, C, chunk, 5, torch.float16, "cuda") == B * (C * 2 + 4)
    assert kept_bytes(B, C, chunk, 0, torch.float16, "cuda") == 0
    three = kept_bytes(B, C, chunk, 3, torch.bfloat16, "cuda")
    assert kept_chunks_for_budget(B, C, chunk, three, torch.bfloat16, "cuda") == 3
    assert kept_chunks_for_budget(B, C, chunk, three - 1, torch.bfloat16, "cuda") == 2
    assert kept_chunks_for_budget(B, C, chunk, three, torch.bfloat16, "cpu") == 1  # fp32 there: (1240-40)//800
    whole = kept_bytes(B, C, chunk, 5, torch.bfloat16, "cuda")
    assert kept_chunks_for_budget(B, C, chunk, whole, torch.bfloat16, "cuda") == 5


def test_fake_kernel_gives_the_kept_dtype_of_the_device():
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, D, C, chunk, keep = 5, 8, 13, 4, 2
    for device in ("cpu", "cuda"):
        for dt in (*LOW, torch.float32, torch.float64):
            with FakeTensorMode():
                try:
                    x = torch.empty(B, D, dtype=dt, device=device)
                except (RuntimeError, AssertionError) as err:  # a torch built without CUDA
                    pytest.skip(f"this torch cannot make fake {device} tensors: {err}")
                w = torch.empty(C, D, dtype=dt, device=device)
                y = torch.empty(B, dtype=torch.long, device=device)
                out = torch.ops.shardkit.ce_shard_stats_keep(x, w, y, None, 0, 1.0, 1.0, 0.0, 0.0, False, chunk, keep)
            assert out[4].dtype == kept_logits_dtype(dt, device) and out[4].shape == (B * keep * chunk,)
            assert out[5].dtype == (torch.float64 if dt == torch.float64 else torch.float32)


def test_auto_on_cuda_follows_the_switch(monkeypatch):
    monkeypatch.setattr(budget_mod, "cuda_available_bytes", lambda index: 80_000 + index)
    cuda1 = torch.device("cuda", 1)
    monkeypatch.delenv(_kept.CUDA_KEEP_ENV, raising=False)
    assert budget_mod.device_budget("auto", cuda1) == 0  # recompute: the device is not asked
    monkeypatch.setenv(_kept.CUDA_KEEP_ENV, "1")
    assert budget_mod.device_budget("auto", cuda1) == int(budget_mod.AUTO_SHARE * 80_001)
    assert budget_mod.device_budget(12345, cuda1) == 12345
    assert budget_mod.device_budget("auto", torch.device("meta")) == 0


# ---- on a CUDA GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_recomputes_without_the_switch(monkeypatch):
    monkeypatch.delenv(_kept.CUDA_KEEP_ENV, raising=False)
    x, w, labels = make_case(20, 64, 500, 0, device="cuda")
    outs = []
    for budget in (0, ALL):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        with OpLog() as log:
            lse, t, s, _ = ce_shard_stats(xx, ww, labels, memory_budget=budget, **kw("arcface"))
        assert log.names == ["ce_shard_stats"]
        outs.append((lse, *torch.autograd.grad((lse - t).sum(), (xx, ww))))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert math.isfinite(float(outs[0][0].sum()))
    monkeypatch.setenv(_kept.CUDA_KEEP_ENV, "1")
    with OpLog() as log:
        ce_shard_stats(x.clone().requires_grad_(), w, labels, memory_budget=ALL, **kw("arcface"))
    assert log.names == ["ce_shard_stats_keep"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(MARGINS))
# chunk * B % 4 != 0 in the last three: kept slots at every element phase
@pytest.mark.parametrize(
    "B,D,C,off,chunk", [(37, 29, 300, 50, 64), (6, 3, 17, 0, 3), (5, 8, 40, 3, 1), (33, 64, 999, 0, 63)]
)
def test_cuda_op_matches_reference_and_budget_zero(keep_on, dtype, name, B, D, C, off, chunk):
    x, w, labels = make_case(B, D, C, off, dtype=dtype, device="cuda")
    g = [torch.randn(B, dtype=torch.float64, device="cuda") for _ in range(3)]

    def run(budget):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = ce_shard_stats(xx, ww, labels, class_offset=off, chunk_classes=chunk, memory_budget=budget, **kw(name))
        loss = sum((o.double() * gg).sum() for o, gg in zip(out[:3], g))
        return out, torch.autograd.grad(loss, (xx, ww))

    base, base_g = run(0)
    for budget in cuda_budgets(B, C, chunk, dtype):
        tol = 1e-3 if D <= 3 and name in ("arcface", "combined") else 1e-5  # see test_softmax_ops
        check_against_reference(x, w, labels, off, name, chunk, tol=tol, memory_budget=budget)
        # Not bit for bit: cuBLAS may take another algorithm for a kept slot's alignment (and
        # D <= 3 margins magnify a last-bit difference as they do the reference's).
        out, grads = run(budget)
        for a, b in zip(out[:3], base[:3]):
            assert torch.equal(a, b) or rel(a, b) <= tol
        for a, b in zip(grads, base_g):
            assert rel(a, b, floor=1e-30) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("name", list(MARGINS))
def test_cuda_low_precision_within_2x_torch_error(keep_on, dtype, name):
    for budget in cuda_budgets(33, 257, 60, dtype):
        check_low_precision("cuda", dtype, name, memory_budget=budget)
        # Targets near their class (cosines ~0.995): there a 16-bit target cosine put the angular
        # margins' gradients up to 6.4x beyond the bound (emulated, benchmarks/RESULTS.md); the
        # kept fp32 target value keeps them near budget 0's error.
        check_low_precision("cuda", dtype, name, memory_budget=budget, near_target=0.1)
    check_low_precision("cuda", dtype, name, memory_budget=ALL, noncontiguous=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [*LOW, torch.float32])
@pytest.mark.parametrize("normalize", [False, True])
def test_cuda_kept_slots_hold_the_documented_values(dtype, normalize):
    # The op itself (no switch needed): kept chunk k's slot holds the raw dots x_in . w_j [B, n]
    # in kept_logits_dtype (x_in: x, or x / |x| rounded to x's dtype), and kept_target each row's
    # fp32 target value (x_in . w_t, times 1 / |w_t| when normalizing) where its target is kept.
    B, D, C, chunk = 7, 64, 301, 16  # 19 chunks, B * chunk % 4 == 0; the odd phases: other tests
    x, w, labels = make_case(B, D, C, 0, dtype=dtype, device="cuda")
    if normalize:
        xin = torch.nn.functional.normalize(x.float(), dim=1).to(dtype)
    else:
        xin = x
    raw = xin.double() @ w.double().T
    scale = 16.0 if normalize else 0.7
    nchunks, full = -(-C // chunk), C // chunk
    # Twice the unit roundoff of the kept dtype (a wrong slot is off by ~1.4); fp32: the GEMM's sums.
    rounding = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-5}[dtype]
    for keep in (1, 5, nchunks - 1, nchunks):
        args = (x, w, labels, None, 0, scale, 1.0, 0.0, 0.0, normalize, chunk, keep)
        out = torch.ops.shardkit.ce_shard_stats_keep(*args)
        kept, target = out[4], out[5]
        assert kept.dtype == kept_logits_dtype(dtype, "cuda") and target.dtype == torch.float32
        expect_all = keep >= nchunks
        slots = [k for k in range(nchunks) if expect_all or (k < full and (k + 1) * keep // full > k * keep // full)]
        assert kept.shape == (B * (C if expect_all else keep * chunk),)
        for slot, k in enumerate(slots):
            n = min(chunk, C - k * chunk)
            got = kept[slot * chunk * B : slot * chunk * B + B * n].view(B, n)
            assert rel(got.cpu(), raw[:, k * chunk : k * chunk + n].cpu()) <= rounding
        t = labels.cpu()
        want = raw.cpu()[torch.arange(B), t.clamp(0, C - 1)]
        if normalize:
            want = want / w.double().cpu()[t.clamp(0, C - 1)].norm(dim=1)
        for i in range(B):
            if 0 <= int(t[i]) < C and int(t[i]) // chunk in slots:
                assert abs(float(target[i]) - float(want[i])) <= 1e-5 * (1 + abs(float(want[i])))
            else:
                assert float(target[i]) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cuda_never_holds_more_than_its_budget(keep_on, dtype):
    B, D, C, chunk = 23, 11, 203, 16
    x, w, labels = make_case(B, D, C, 0, dtype=dtype, device="cuda")

    def held(budget):
        """(bytes autograd saves, bytes the CUDA allocator holds after the forward) at budget."""
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        saved, out = saved_bytes(lambda: ce_shard_stats(xx, ww, labels, chunk_classes=chunk, memory_budget=budget))
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated() - before
        del out
        return saved, allocated

    base_saved, base_alloc = held(0)
    elem = torch.empty((), dtype=kept_logits_dtype(dtype, "cuda")).element_size()
    row = 8 if dtype == torch.float64 else 4
    step = B * chunk * elem
    previous = 0
    for budget in [1, B * row, B * row + step - 1, B * row + step, 5 * step + 100, B * (C * elem + row), ALL]:
        saved, allocated = held(budget)
        extra = saved - base_saved
        keep = kept_chunks_for_budget(B, C, chunk, budget, dtype, "cuda")
        assert extra <= budget, (budget, extra)
        assert extra == kept_bytes(B, C, chunk, keep, dtype, "cuda")
        # The device memory held: the same two tensors, each rounded up to the allocator's 512 bytes.
        rounded = 0
        if keep:
            classes = C if keep >= -(-C // chunk) else keep * chunk
            rounded = sum(-(-nbytes // 512) * 512 for nbytes in (B * classes * elem, B * row))
        assert allocated - base_alloc == rounded, (budget, allocated - base_alloc, rounded)
        assert extra >= previous  # more budget never keeps less
        previous = extra
    assert previous == B * (C * elem + row)  # the whole shard once it fits


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_retained_graph_backs_up_twice_alike(keep_on, dtype):
    # The fp32 backward writes its dlogits beside the kept logits, never over them.
    x, w, labels = make_case(12, 64, 90, 0, dtype=dtype, device="cuda")
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    lse, t, s, _ = ce_shard_stats(xx, ww, labels, chunk_classes=16, memory_budget=ALL, **kw("arcface"))
    loss = (lse - t + 0.1 * s).sum()
    first = torch.autograd.grad(loss, (xx, ww), retain_graph=True)
    second = torch.autograd.grad(loss, (xx, ww))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("margin_name", list(LOSS_MARGINS))
@pytest.mark.parametrize("smoothing,ignore_index", [(0.0, -100), (0.1, 4)])
def test_cuda_module_matches_reference_at_every_budget(keep_on, margin_name, smoothing, ignore_index):
    D, C, B = 9, 131, 17
    margin = LOSS_MARGINS[margin_name]
    x = torch.randn(B, D)
    y = make_labels(B, C)
    y[2] = y[5] = ignore_index  # 4 is also a class id: those rows get no target
    for budget in (0, 6000, 12_000, ALL):
        head = shardkit.ShardedSoftmaxLoss(
            D,
            C,
            margin=margin,
            devices=["cuda"] * 3,
            shard_sizes=[50, 1, 80],
            label_smoothing=smoothing,
            ignore_index=ignore_index,
            reduction="none",
            chunk_memory=4096,  # a few classes per chunk: partial budgets keep some chunks
            memory_budget=budget,
        )
        xc, yc = x.cuda(), y.cuda()
        assert_matches_reference(
            head, xc, yc, margin, label_smoothing=smoothing, ignore_index=ignore_index, reduction="none"
        )
        extra = module_extra_bytes(head, xc, yc)
        assert extra <= budget  # all three shards share the one device's budget
        assert (extra > 0) == (budget > 0)


@pytest.mark.gpu
def test_cuda_module_sampling_equals_budget_zero(keep_on):
    head = shardkit.ShardedSoftmaxLoss(8, 300, devices=["cuda", "cuda"], sample_rate=0.4, chunk_memory=2048)
    x, y = torch.randn(10, 8, device="cuda"), torch.randint(0, 300, (10,), device="cuda")
    results = []
    for budget in (0, 5000, ALL):
        head.memory_budget = budget
        head.sample_generator = [torch.Generator("cuda").manual_seed(3), torch.Generator("cuda").manual_seed(4)]
        xx = x.clone().requires_grad_()
        loss = head(xx, y)
        loss.backward()
        results.append((loss.detach(), xx.grad, [p.grad.to_dense() for p in head.weight_shards]))
        head.zero_grad(set_to_none=True)
    for loss, gx, gws in results[1:]:
        assert rel(loss, results[0][0]) <= 1e-5 and rel(gx, results[0][1]) <= 1e-5
        for a, b in zip(gws, results[0][2]):
            assert rel(a, b) <= 1e-5
    head.sample_generator = None
    head.memory_budget = ALL
    assert 0 < module_extra_bytes(head, x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("margin_name", ["plain", "arcface"])
@pytest.mark.parametrize("mixed", [False, True])
def test_cuda_module_low_precision_with_a_budget(keep_on, dtype, margin_name, mixed):
    # (96, 128, 3001) over two shards of one device, 256-class chunks: 5-6 of each shard's 6
    # chunks kept, then all of them; mixed: fp32 weights under a 16-bit autocast.
    B, D, C = 96, 128, 3001
    chunk_memory = B * (4 + 2) * 256 + 2 * D * 4 * 256  # chunk_classes_for_budget's 256 classes
    for budget in (2 * kept_bytes(B, C // 2, 256, 6, dtype, "cuda"), ALL):
        check_module_low_precision(
            "cuda", dtype, margin_name, shape=(B, D, C), mixed=mixed, chunk_memory=chunk_memory, memory_budget=budget
        )


@pytest.mark.gpu
def test_cuda_compiled_module_with_a_budget_matches_eager_budget_zero(keep_on):
    torch._dynamo.reset()
    try:
        head = shardkit.ShardedSoftmaxLoss(16, 77, margin=shardkit.CosFace(s=16.0, m=0.3), devices=["cuda", "cuda"])
        head.chunk_memory = 4096
        x, y = torch.randn(8, 16, device="cuda"), torch.randint(0, 77, (8,), device="cuda")
        grads = {}
        for budget, compiled in ((0, False), (6000, True), (ALL, True), ("auto", True)):
            head.memory_budget = budget
            step = torch.compile(lambda e, t: head(e, t), fullgraph=True) if compiled else head
            xx = x.clone().requires_grad_()
            loss = step(xx, y)
            loss.backward()
            grads[budget] = (loss.detach(), xx.grad, [p.grad for p in head.weight_shards])
            head.zero_grad(set_to_none=True)
            torch._dynamo.reset()
        for budget in (6000, ALL, "auto"):  # "auto" reads the available memory at trace time
            torch.testing.assert_close(grads[budget][0], grads[0][0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(grads[budget][1], grads[0][1], rtol=1e-4, atol=1e-6)
            for a, b in zip(grads[budget][2], grads[0][2]):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
def test_cuda_gradcheck_float64(keep_on):
    B, D, C = 3, 4, 7
    labels = torch.tensor([1, 9, 6], device="cuda")
    coef = torch.randn(3, B, dtype=torch.float64, device="cuda")
    for name in MARGINS:
        x = torch.randn(B, D, dtype=torch.float64, device="cuda", requires_grad=True)
        w = torch.randn(C, D, dtype=torch.float64, device="cuda", requires_grad=True)
        for budget in (kept_bytes(B, C, 3, 1, torch.float64, "cuda"), ALL):  # chunks 0 and 2 of 3, all

            def fn(x, w, budget=budget):
                out = ce_shard_stats(x, w, labels, class_offset=2, chunk_classes=3, memory_budget=budget, **kw(name))
                return coef[0] * out[0] + coef[1] * out[1] + coef[2] * out[2]

            assert torch.autograd.gradcheck(fn, (x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_opcheck_the_keep_ops(dtype):
    # Checks the fake kernels against the CUDA kernels (the kept dtype among them).
    for x, w, labels, tref, off, s, m1, m2, m3, norm, chunk in opcheck_samples():
        x, w, labels = x.to("cuda", dtype), w.to("cuda", dtype), labels.cuda()
        tref = None if tref is None else tref.cuda()
        C = w.shape[0]
        for keep in (1, C + 1):
            args = (x.clone().requires_grad_(), w.clone().requires_grad_(), labels, tref, off, s, m1, m2, m3, norm)
            torch.library.opcheck(torch.ops.shardkit.ce_shard_stats_keep.default, (*args, chunk, keep))
            out = torch.ops.shardkit.ce_shard_stats_keep(x, w, labels, tref, off, s, m1, m2, m3, norm, chunk, keep)
            grads = [torch.randn(x.shape[0], device="cuda") for _ in range(3)]
            back = (*grads, x, w, labels, out[0], out[4], out[5], off, s, m1, m2, m3, norm, chunk, keep)
            torch.library.opcheck(torch.ops.shardkit.ce_shard_stats_backward_kept.default, back)


@pytest.mark.gpu
def test_cuda_backward_refuses_logits_of_another_dtype():
    x, w, labels = make_case(4, 8, 10, 0, dtype=torch.bfloat16, device="cuda")
    lse, _, _, _, kept, target = torch.ops.shardkit.ce_shard_stats_keep(
        x, w, labels, None, 0, 1.0, 1.0, 0.0, 0.0, False, 4, 1
    )
    tail = (0, 1.0, 1.0, 0.0, 0.0, False, 4, 1)
    back = torch.ops.shardkit.ce_shard_stats_backward_kept
    with pytest.raises(RuntimeError, match=r"argument `kept_logits` must be the contiguous \[16\] BFloat16 tensor"):
        back(lse, lse, lse, x, w, labels, lse, kept.float(), target, *tail)
    with pytest.raises(RuntimeError, match=r"argument `kept_target` must be the contiguous \[4\] Float tensor"):
        back(lse, lse, lse, x, w, labels, lse, kept, target.bfloat16(), *tail)
