"""The memory budget of the sharded loss (``memory_budget``): the forward keeps the logits of as
many class chunks as fit and the backward recomputes only the others.

Checked on the CPU kernels: the op and the module at budgets that keep nothing, some chunks
and every chunk give the float64 reference's results and budget 0's (margins, smoothing,
ignore_index, sampling, several shards, mixed fp32 weights, 16-bit inputs, torch.compile,
gradcheck, opcheck), the kept chunks are the documented ones, and the bytes held from forward
to backward (the tensors autograd saves) never exceed the budget. The process-group mode runs
with budgets in tests/softmax_dist_scenarios.py; the CUDA kept path (SHARDKIT_CUDA_KEEP=1) in
tests/test_softmax_budget_cuda.py."""

import math
import re

import pytest
import torch
from softmax_checks import (
    LOSS_MARGINS,
    MARGINS,
    OpLog,
    assert_matches_reference,
    check_against_reference,
    check_low_precision,
    kw,
    make_case,
    make_labels,
    opcheck_samples,
    rel,
)

import shardkit
from shardkit.ops import ce_shard_stats, kept_bytes, kept_chunks_for_budget
from shardkit.softmax import budget as budget_mod

ALL = 1 << 40  # a budget every test shape fits whole


def saved_bytes(fn):
    """Bytes of the distinct storages autograd saves while ``fn()`` runs (what the graph
    holds from the forward to the backward), and fn's result."""
    seen = {}

    def pack(t):
        if t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def budgets_for(B, C, chunk, dtype=torch.float32):
    """Budgets keeping nothing, one chunk, about half the chunks, all but one chunk, and all."""
    nchunks = -(-C // chunk)
    per = [kept_bytes(B, C, chunk, k, dtype) for k in range(nchunks + 1)]
    picks = {0, 1, nchunks // 2, nchunks - 1, nchunks}
    return [per[k] for k in sorted(picks)]


@pytest.mark.parametrize("name", list(MARGINS))
@pytest.mark.parametrize("B,D,C,off,chunk", [(37, 29, 300, 50, 64), (6, 3, 17, 0, 3), (5, 8, 40, 3, 1)])
def test_op_matches_reference_and_budget_zero(name, B, D, C, off, chunk):
    x, w, labels = make_case(B, D, C, off)
    g = [torch.randn(B, dtype=torch.float64) for _ in range(3)]

    def run(budget):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = ce_shard_stats(xx, ww, labels, class_offset=off, chunk_classes=chunk, memory_budget=budget, **kw(name))
        loss = sum((o.double() * gg).sum() for o, gg in zip(out[:3], g))
        return out, torch.autograd.grad(loss, (xx, ww))

    (base, base_g) = run(0)
    for budget in budgets_for(B, C, chunk):
        tol = 1e-3 if D <= 3 and name in ("arcface", "combined") else 1e-5  # see test_softmax_ops
        check_against_reference(x, w, labels, off, name, chunk, tol=tol, memory_budget=budget)
        out, grads = run(budget)
        for a, b in zip(out, base):
            assert torch.equal(a, b) or rel(a, b) <= 1e-6
        for a, b in zip(grads, base_g):
            assert rel(a, b, floor=1e-30) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["plain", "arcface"])
def test_low_precision_within_2x_torch_error(dtype, name):
    for budget in budgets_for(33, 257, 60)[1:]:
        check_low_precision("cpu", dtype, name, memory_budget=budget)
        check_low_precision("cpu", dtype, name, memory_budget=budget, near_target=0.1)  # cosines near 1


@pytest.mark.parametrize("C,chunk", [(301, 16), (300, 16), (17, 3), (40, 1), (9, 100)])
def test_kept_chunks_are_the_documented_ones(C, chunk):
    # Plain logits (scale 0.7): a kept chunk's slot holds 0.7 * x @ w_chunk^T, [B, n] row-major.
    B, D = 5, 7
    x, w, labels = make_case(B, D, C, 0)
    s = 0.7
    nchunks = -(-C // chunk)
    full = C // chunk
    for keep in sorted({0, 1, 2, nchunks // 2, max(nchunks - 1, 0), nchunks, nchunks + 3}):
        out = torch.ops.shardkit.ce_shard_stats_keep(x, w, labels, None, 0, s, 1.0, 0.0, 0.0, False, chunk, keep)
        kept, raw = out[4], out[5]
        assert kept.dtype == torch.float32 and raw.shape == (B,)
        expect_all = keep >= nchunks
        classes = C if expect_all else keep * min(chunk, C)
        assert kept.shape == (B * classes,)
        assert kept_bytes(B, C, chunk, keep) == (B * (classes + 1) * 4 if keep else 0)
        slots = [k for k in range(nchunks) if expect_all or (k < full and (k + 1) * keep // full > k * keep // full)]
        assert len(slots) == (nchunks if expect_all else keep)
        z = s * (x.double() @ w.double().T)
        for slot, k in enumerate(slots):
            n = min(chunk, C - k * chunk)
            got = kept[slot * chunk * B : slot * chunk * B + B * n].view(B, n)
            assert rel(got, z[:, k * chunk : k * chunk + n]) <= 1e-6
        # the raw target logit of rows whose target lies in a kept chunk
        for i in range(B):
            k = int(labels[i]) // chunk
            if 0 <= int(labels[i]) < C and k in slots:
                assert abs(float(raw[i]) - float(z[i, labels[i]] / s)) <= 1e-5 * (1 + abs(float(raw[i])))


def test_kept_chunks_for_budget():
    B, C, chunk = 10, 95, 20  # 5 chunks, the last one 15 classes
    assert kept_chunks_for_budget(B, C, chunk, 0) == 0
    assert kept_chunks_for_budget(B, C, chunk, kept_bytes(B, C, chunk, 1) - 1) == 0
    assert kept_chunks_for_budget(B, C, chunk, kept_bytes(B, C, chunk, 1)) == 1
    assert kept_chunks_for_budget(B, C, chunk, kept_bytes(B, C, chunk, 4)) == 4
    # all 5 chunks (95 classes) cost less than 5 full ones: they fit before 5 * 20 classes do
    assert kept_bytes(B, C, chunk, 5) == B * 96 * 4 < kept_bytes(B, C, chunk, 4) + B * chunk * 4
    assert kept_chunks_for_budget(B, C, chunk, kept_bytes(B, C, chunk, 5)) == 5
    assert kept_chunks_for_budget(B, C, chunk, ALL) == 5
    assert kept_bytes(B, C, chunk, 2, torch.float64) == 2 * kept_bytes(B, C, chunk, 2)
    assert kept_chunks_for_budget(0, C, chunk, ALL) == 0 and kept_chunks_for_budget(B, 0, chunk, ALL) == 0
    with pytest.raises(ValueError, match="argument `budget_bytes` must be >= 0"):
        kept_chunks_for_budget(B, C, chunk, -1)
    with pytest.raises(ValueError, match="argument `chunk_classes` must be >= 1"):
        kept_chunks_for_budget(B, C, 0, 10)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: kept_chunks_for_budget(8.5, 10, 2, 100), TypeError, "argument `batch` must be an int, got float"),
        (lambda: kept_chunks_for_budget("8", 10, 2, 100), TypeError, "argument `batch` must be an int, got str"),
        (lambda: kept_chunks_for_budget(8, 10, 2.7, 100), TypeError, "argument `chunk_classes` must be an int"),
        (lambda: kept_chunks_for_budget(8, 10, 2, True), TypeError, "argument `budget_bytes` must be an int, got bool"),
        (lambda: kept_chunks_for_budget(8, 10, 2, "1MiB"), TypeError, "argument `budget_bytes` must be an int"),
        (lambda: kept_chunks_for_budget(8, 10, 2, math.inf), TypeError, "argument `budget_bytes` must be an int"),
        (lambda: kept_chunks_for_budget(8, 10, 2, 1e9), TypeError, "argument `budget_bytes` must be an int"),
        (lambda: kept_chunks_for_budget(8, 10, 2, 100, "float64"), TypeError, "argument `dtype` must be a floating"),
        (lambda: kept_chunks_for_budget(8, 10, 2, 100, torch.int64), TypeError, "argument `dtype` must be a floating"),
        (lambda: kept_bytes(-8, 10, 2, 3), ValueError, "argument `batch` must be >= 0, got -8"),
        (lambda: kept_bytes(8, -10, 2, 3), ValueError, "argument `num_classes` must be >= 0, got -10"),
        (lambda: kept_bytes(8, 10, 0, 3), ValueError, "argument `chunk_classes` must be >= 1, got 0"),
        (lambda: kept_bytes(8, 10, 2, -3), ValueError, "argument `keep_chunks` must be >= 0, got -3"),
        (lambda: kept_bytes("8", 10, 2, 3), TypeError, "argument `batch` must be an int, got str"),
        (lambda: kept_bytes(True, 10, 2, 3), TypeError, "argument `batch` must be an int, got bool"),
        (lambda: kept_bytes(8, 10, 2, None), TypeError, "argument `keep_chunks` must be an int, got NoneType"),
        (lambda: kept_bytes(8, 10, 2, 1, "x"), TypeError, "argument `dtype` must be a floating"),
        # a misspelled device was taken for the CPU; None and floats raised torch's unnamed errors
        (lambda: kept_bytes(8, 10, 2, 1, torch.bfloat16, "bogus"), ValueError, "argument `device` must name a"),
        (lambda: kept_bytes(8, 10, 2, 1, torch.bfloat16, "cuda:x"), ValueError, "argument `device` must name a"),
        (lambda: kept_bytes(8, 10, 2, 1, torch.bfloat16, None), TypeError, "argument `device` must be a torch.device"),
        (lambda: kept_chunks_for_budget(8, 10, 2, 99, torch.float32, 1.5), TypeError, "argument `device` must be"),
    ],
)
def test_budget_helpers_refuse_bad_arguments(call, error, message):
    # Before: strings were repeated ("8" * ...), floats truncated, bools counted, negative sizes
    # gave negative byte counts and an infinite budget an OverflowError.
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_budget_helpers_take_numpy_ints():
    np = pytest.importorskip("numpy")
    B, C, chunk = np.int64(10), np.int64(95), np.int64(20)
    assert kept_chunks_for_budget(B, C, chunk, np.int64(kept_bytes(10, 95, 20, 2))) == 2
    assert kept_bytes(B, C, chunk, np.int32(2)) == kept_bytes(10, 95, 20, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_op_never_holds_more_than_its_budget(dtype):
    B, D, C, chunk = 23, 11, 203, 16
    x, w, labels = make_case(B, D, C, 0, dtype=dtype)

    def held(budget):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        return saved_bytes(lambda: ce_shard_stats(xx, ww, labels, chunk_classes=chunk, memory_budget=budget))[0]

    base = held(0)
    nchunks = -(-C // chunk)
    elem = 8 if dtype == torch.float64 else 4
    step = B * chunk * elem
    previous = 0
    for budget in [1, B * elem, B * elem + step - 1, B * elem + step, 5 * step + 100, B * (C + 1) * elem, ALL]:
        extra = held(budget) - base
        assert extra <= budget, (budget, extra)
        assert extra == kept_bytes(B, C, chunk, kept_chunks_for_budget(B, C, chunk, budget, dtype), dtype)
        assert extra >= previous  # more budget never keeps less
        previous = extra
    assert previous == B * (C + 1) * elem  # the whole shard once it fits
    assert kept_chunks_for_budget(B, C, chunk, ALL, dtype) == nchunks


def test_no_kept_logits_without_a_backward():
    x, w, labels = make_case(9, 5, 70, 0)
    with OpLog() as log:
        ce_shard_stats(x, w, labels, chunk_classes=8, memory_budget=ALL)  # nothing requires grad
        with torch.no_grad():
            ce_shard_stats(x.requires_grad_(), w, labels, chunk_classes=8, memory_budget=ALL)
        ce_shard_stats(x, w, labels, chunk_classes=8, memory_budget=10)  # not even one chunk fits
        ce_shard_stats(x, w, labels, chunk_classes=8, memory_budget=ALL)
    assert log.names == ["ce_shard_stats"] * 3 + ["ce_shard_stats_keep"]


def test_a_retained_graph_backs_up_twice_alike():
    x, w, labels = make_case(12, 6, 90, 0)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    lse, t, s, _ = ce_shard_stats(xx, ww, labels, chunk_classes=16, memory_budget=ALL, **kw("arcface"))
    loss = (lse - t + 0.1 * s).sum()
    first = torch.autograd.grad(loss, (xx, ww), retain_graph=True)
    second = torch.autograd.grad(loss, (xx, ww))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_gradcheck_float64():
    B, D, C = 3, 4, 7
    labels = torch.tensor([1, 9, 6])
    coef = torch.randn(3, B, dtype=torch.float64)
    for name in MARGINS:
        x = torch.randn(B, D, dtype=torch.float64, requires_grad=True)
        w = torch.randn(C, D, dtype=torch.float64, requires_grad=True)
        for budget in (kept_bytes(B, C, 3, 1, torch.float64), ALL):  # chunks 0 and 2 of 3, all

            def fn(x, w, budget=budget):
                out = ce_shard_stats(x, w, labels, class_offset=2, chunk_classes=3, memory_budget=budget, **kw(name))
                return coef[0] * out[0] + coef[1] * out[1] + coef[2] * out[2]

            assert torch.autograd.gradcheck(fn, (x, w))


def test_opcheck_the_keep_ops():
    for x, w, labels, tref, off, s, m1, m2, m3, norm, chunk in opcheck_samples():
        C = w.shape[0]
        for keep in (1, C + 1):
            args = (x.clone().requires_grad_(), w.clone().requires_grad_(), labels, tref, off, s, m1, m2, m3, norm)
            torch.library.opcheck(torch.ops.shardkit.ce_shard_stats_keep.default, (*args, chunk, keep))
            out = torch.ops.shardkit.ce_shard_stats_keep(x, w, labels, tref, off, s, m1, m2, m3, norm, chunk, keep)
            grads = [torch.randn(x.shape[0]) for _ in range(3)]
            back = (*grads, x, w, labels, out[0], out[4], out[5], off, s, m1, m2, m3, norm, chunk, keep)
            torch.library.opcheck(torch.ops.shardkit.ce_shard_stats_backward_kept.default, back)


def test_op_errors_name_the_argument():
    x, w, labels = make_case(4, 8, 10, 0)
    args = (x, w, labels, None, 0, 1.0, 1.0, 0.0, 0.0, False, 4)
    with pytest.raises(RuntimeError, match=r"argument `keep_chunks` must be >= 0, got -1"):
        torch.ops.shardkit.ce_shard_stats_keep(*args, -1)
    lse, _, _, _, kept, raw = torch.ops.shardkit.ce_shard_stats_keep(*args, 1)
    back = torch.ops.shardkit.ce_shard_stats_backward_kept
    tail = (0, 1.0, 1.0, 0.0, 0.0, False, 4)
    with pytest.raises(RuntimeError, match=r"argument `kept_logits` must be the contiguous \[16\] Float tensor"):
        back(lse, lse, lse, x, w, labels, lse, kept[:-1], raw, *tail, 1)
    with pytest.raises(RuntimeError, match=r"argument `kept_logits` must be the contiguous \[40\] Float tensor"):
        back(lse, lse, lse, x, w, labels, lse, kept, raw, *tail, 3)  # not what keep_chunks=3 keeps
    with pytest.raises(RuntimeError, match=r"argument `kept_target` must be the contiguous \[4\] Float tensor"):
        back(lse, lse, lse, x, w, labels, lse, kept, raw.double(), *tail, 1)
    with pytest.raises(ValueError, match=r"argument `memory_budget` must be an int >= 0 \(bytes\), got -5"):
        ce_shard_stats(x, w, labels, memory_budget=-5)


@pytest.mark.parametrize("value", [-1, "lots", 1.5, True, "-3MiB", None])
def test_module_refuses_a_bad_budget(value):
    with pytest.raises((ValueError, TypeError), match="argument `memory_budget`"):
        shardkit.ShardedSoftmaxLoss(4, 10, memory_budget=value)


def test_module_budget_forms():
    assert shardkit.ShardedSoftmaxLoss(4, 10).memory_budget == 0  # the default: recompute
    assert shardkit.ShardedSoftmaxLoss(4, 10, memory_budget="2GiB").memory_budget == 2 << 30
    assert shardkit.ShardedSoftmaxLoss(4, 10, memory_budget="0").memory_budget == 0
    for zero in ("0B", "0 MiB", " 0.0 gib ", "00"):  # were refused: "must be positive (... or 0 to keep nothing)"
        assert shardkit.ShardedSoftmaxLoss(4, 10, memory_budget=zero).memory_budget == 0
    assert shardkit.ShardedSoftmaxLoss(4, 10, memory_budget=" Auto ").memory_budget == "auto"
    assert "memory_budget=1000" in repr(shardkit.ShardedSoftmaxLoss(4, 10, memory_budget=1000))
    # "full" (the README's and the planner's name for keeping every chunk) was refused by the module
    assert shardkit.ShardedSoftmaxLoss(4, 10, memory_budget=" FULL ").memory_budget == "full"


def test_full_budget_keeps_every_logit_and_equals_budget_zero():
    torch.manual_seed(3)
    B, D, C = 16, 12, 3000
    x, y = torch.randn(B, D, dtype=torch.float64), torch.randint(0, C, (B,))
    head = shardkit.ShardedSoftmaxLoss(D, C, dtype=torch.float64, memory_budget="full", chunk_memory=4096)
    extra = module_extra_bytes(head, x, y)
    assert extra >= B * C * 8  # every chunk's logits kept (float64 statistics on the CPU)
    grads = []
    for budget in ("full", 0):
        head.memory_budget = budget
        xx = x.clone().requires_grad_()
        head.weight_shards[0].grad = None
        head(xx, y).backward()
        grads.append((xx.grad, head.weight_shards[0].grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)


def module_extra_bytes(head, x, y, **kwargs):
    """Bytes a module's forward saves for its backward beyond what it saves at budget 0."""
    keep = head.memory_budget
    head.memory_budget = 0
    base = saved_bytes(lambda: head(x.clone().requires_grad_(), y, **kwargs))[0]
    head.memory_budget = keep
    return saved_bytes(lambda: head(x.clone().requires_grad_(), y, **kwargs))[0] - base


@pytest.mark.parametrize("margin_name", list(LOSS_MARGINS))
@pytest.mark.parametrize("smoothing,ignore_index", [(0.0, -100), (0.1, 4)])
def test_module_matches_reference_at_every_budget(margin_name, smoothing, ignore_index):
    D, C, B = 9, 131, 17
    margin = LOSS_MARGINS[margin_name]
    x = torch.randn(B, D)
    y = make_labels(B, C)
    y[2] = y[5] = ignore_index  # 4 is also a class id: those rows get no target
    chunk_memory = 4096  # a few classes per chunk: partial budgets keep some chunks
    for budget in (0, 6000, 12_000, ALL):
        head = shardkit.ShardedSoftmaxLoss(
            D,
            C,
            margin=margin,
            devices=["cpu"] * 3,
            shard_sizes=[50, 1, 80],
            label_smoothing=smoothing,
            ignore_index=ignore_index,
            reduction="none",
            chunk_memory=chunk_memory,
            memory_budget=budget,
        )
        assert_matches_reference(
            head, x, y, margin, label_smoothing=smoothing, ignore_index=ignore_index, reduction="none"
        )
        extra = module_extra_bytes(head, x, y)
        assert extra <= budget  # all three shards share the one device's budget
        assert (extra > 0) == (budget > 0)


def test_module_several_shards_share_the_device_budget_by_classes():
    head = shardkit.ShardedSoftmaxLoss(6, 400, devices=["cpu"] * 2, shard_sizes=[100, 300], chunk_memory=2048)
    x, y = torch.randn(8, 6), torch.randint(0, 400, (8,))
    head.memory_budget = 8 * 401 * 4  # the whole head's logits, not each shard's
    extra = module_extra_bytes(head, x, y)
    assert 0 < extra <= head.memory_budget
    budgets = budget_mod.shard_budgets(head.memory_budget, list(head.weight_shards))
    assert budgets == [head.memory_budget * 100 // 400, head.memory_budget * 300 // 400]


def test_module_sampling_equals_budget_zero():
    head = shardkit.ShardedSoftmaxLoss(8, 300, devices=["cpu", "cpu"], sample_rate=0.4, chunk_memory=2048)
    x, y = torch.randn(10, 8), torch.randint(0, 300, (10,))
    results = []
    for budget in (0, 5000, ALL):
        head.memory_budget = budget
        head.sample_generator = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)]
        xx = x.clone().requires_grad_()
        loss = head(xx, y)
        loss.backward()
        results.append((loss.detach(), xx.grad, [p.grad.to_dense() for p in head.weight_shards]))
        head.zero_grad(set_to_none=True)
    for loss, gx, gws in results[1:]:
        assert rel(loss, results[0][0]) <= 1e-6 and rel(gx, results[0][1]) <= 1e-6
        for a, b in zip(gws, results[0][2]):
            assert rel(a, b) <= 1e-6
    head.sample_generator = None
    head.memory_budget = ALL
    assert 0 < module_extra_bytes(head, x, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_module_mixed_fp32_weights_under_autocast_equals_budget_zero(dtype):
    head = shardkit.ShardedSoftmaxLoss(16, 250, margin=shardkit.ArcFace(s=16.0, m=0.4), chunk_memory=8192)
    x, y = torch.randn(12, 16), torch.randint(0, 250, (12,))
    results = []
    for budget in (0, 20_000, ALL):
        head.memory_budget = budget
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            loss = head(xx, y)
        loss.backward()
        assert head.weight_shards[0].grad.dtype == torch.float32
        results.append((loss.detach(), xx.grad, head.weight_shards[0].grad))
        head.zero_grad(set_to_none=True)
    for res in results[1:]:
        for a, b in zip(res, results[0]):
            assert rel(a, b) <= 1e-6


def test_auto_takes_its_share_of_the_available_memory(monkeypatch):
    monkeypatch.setattr(budget_mod, "cpu_available_bytes", lambda: 64_000)
    assert budget_mod.device_budget("auto", torch.device("cpu")) == int(budget_mod.AUTO_SHARE * 64_000)
    monkeypatch.delenv("SHARDKIT_CUDA_KEEP", raising=False)
    assert budget_mod.device_budget("auto", torch.device("cuda", 0)) == 0  # CUDA: test_softmax_budget_cuda.py
    head = shardkit.ShardedSoftmaxLoss(8, 2000, chunk_memory=4096, memory_budget="auto")
    x, y = torch.randn(16, 8), torch.randint(0, 2000, (16,))
    extra = module_extra_bytes(head, x, y)
    assert 0 < extra <= 16_000


def test_compiled_module_with_a_budget_matches_eager_budget_zero():
    torch._dynamo.reset()
    try:
        head = shardkit.ShardedSoftmaxLoss(16, 77, margin=shardkit.CosFace(s=16.0, m=0.3), devices=["cpu", "cpu"])
        head.chunk_memory = 4096
        x, y = torch.randn(8, 16), torch.randint(0, 77, (8,))
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
