"""SparseRowSGD against a per-row float64 loop over partial-row steps, and its exact resume
from a state_dict (a checkpoint round trip and a torch.optim.SGD state)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import shardkit


def _sparse_step(weight, opt, rows):
    opt.zero_grad(set_to_none=True)
    F.embedding(rows, weight, sparse=True).pow(2).sum().backward()
    opt.step()


def test_sparse_row_sgd_state_dict_round_trip_is_exact():
    w = torch.nn.Parameter(torch.randn(11, 5))
    opt = shardkit.SparseRowSGD([w], lr=0.1, momentum=0.9, weight_decay=1e-3)
    _sparse_step(w, opt, torch.tensor([1, 4, 7]))
    saved_w, saved = w.detach().clone(), copy.deepcopy(opt.state_dict())

    _sparse_step(w, opt, torch.tensor([4, 9]))
    expected = w.detach().clone()

    w2 = torch.nn.Parameter(saved_w.clone())
    opt2 = shardkit.SparseRowSGD([w2], lr=0.1, momentum=0.9, weight_decay=1e-3)
    opt2.load_state_dict(saved)
    assert opt2.state[w2]["seen"].dtype == torch.bool
    _sparse_step(w2, opt2, torch.tensor([4, 9]))
    assert torch.equal(w2.detach(), expected)


@pytest.mark.parametrize("dampening,nesterov", [(0.0, False), (0.3, False), (0.0, True)])
def test_resume_from_torch_sgd_state_continues_like_sgd(dampening, nesterov):
    # The docs say the layouts match: a torch.optim.SGD state_dict loads, and the steps that
    # follow equal torch.optim.SGD's (dense gradients: every row was seen).
    torch.manual_seed(0)
    w_ref = torch.nn.Parameter(torch.randn(6, 3, dtype=torch.float64))
    w = torch.nn.Parameter(w_ref.detach().clone())
    kw = dict(lr=0.1, momentum=0.9, dampening=dampening, weight_decay=0.01, nesterov=nesterov)
    sgd = torch.optim.SGD([w_ref], **kw)
    grads = [torch.randn(6, 3, dtype=torch.float64) for _ in range(4)]
    grads[0][2] = 0  # a row with a zero gradient at first: its buffer starts at 0
    for g in grads[:2]:
        w_ref.grad = g.clone()
        sgd.step()
    with torch.no_grad():
        w.copy_(w_ref)
    opt = shardkit.SparseRowSGD([w], **kw)
    # deepcopy: as from a file (Optimizer.load_state_dict keeps the very buffer tensors)
    opt.load_state_dict(copy.deepcopy(sgd.state_dict()))
    assert opt.state[w]["seen"].dtype == torch.bool and opt.state[w]["seen"].all()
    for g in grads[2:]:
        w_ref.grad, w.grad = g.clone(), g.clone()
        sgd.step()
        opt.step()
    torch.testing.assert_close(w.detach(), w_ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(opt.state[w]["momentum_buffer"], sgd.state[w_ref]["momentum_buffer"])


def test_resume_from_torch_sgd_without_momentum_and_errors():
    w = torch.nn.Parameter(torch.randn(4, 2))
    sgd = torch.optim.SGD([w], lr=0.1)
    w.grad = torch.randn(4, 2)
    sgd.step()
    opt = shardkit.SparseRowSGD([w], lr=0.1)
    opt.load_state_dict(sgd.state_dict())
    assert "momentum_buffer" not in opt.state[w] and "seen" not in opt.state[w]
    opt.step()
    with pytest.raises(ValueError, match="param group 0 has maximize=True"):
        opt.load_state_dict(torch.optim.SGD([w], lr=0.1, maximize=True).state_dict())
    with pytest.raises(ValueError, match="argument `state_dict` must be an optimizer state_dict"):
        opt.load_state_dict({"weight": w})


def _reference_step(w, buf, seen, grads, hp):
    """The documented rule, one row at a time in float64: ``grads`` maps row -> gradient."""
    lr, momentum, dampening, wd, nesterov = hp
    for r, g in grads.items():
        g = g + wd * w[r]
        if momentum:
            buf[r] = momentum * buf[r] + (1 - dampening) * g if seen[r] else g.clone()
            seen[r] = True
            g = g + momentum * buf[r] if nesterov else buf[r]
        w[r] = w[r] - lr * g


# Row sets over a random permutation of 17 rows: they overlap (rows 3-5 in steps 0 and 1),
# rows first appear late (6-9 at step 1, 10-12 at step 2, 13-15 at step 3), rows skip a step
# and come back (0-1: steps 0, 2), indices repeat within a step, row 16 is never sampled.
_ROW_SETS = [[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8, 9, 9], [0, 1, 8, 10, 11, 12, 0], [5, 13, 14, 15, 2], [1, 4, 14, 7]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "momentum,dampening,wd,nesterov",
    [(0.9, 0.0, 0.0, False), (0.9, 0.3, 1e-2, False), (0.7, 0.0, 5e-2, True), (0.0, 0.0, 1e-2, False)],
)
@pytest.mark.parametrize("dense_step", [None, 3])
def test_sparse_row_sgd_partial_rows_equal_a_per_row_float64_loop(momentum, dampening, wd, nesterov, dtype, dense_step):
    # A row first sampled at a later step must start its buffer with its raw gradient, a row
    # that skips steps must keep its weight and buffer, and a dense step (every row present,
    # row 16 included) starts every row's buffer.
    hp = (0.2, momentum, dampening, wd, nesterov)
    rows, dim = 17, 3
    perm = torch.randperm(rows)
    start = torch.randn(rows, dim, dtype=torch.float64)
    weight = torch.nn.Parameter(start.to(dtype))
    opt = shardkit.SparseRowSGD(
        [weight], lr=hp[0], momentum=momentum, dampening=dampening, weight_decay=wd, nesterov=nesterov
    )
    w_ref = [start[r].clone() for r in range(rows)]
    buf_ref = [torch.zeros(dim, dtype=torch.float64) for _ in range(rows)]
    seen_ref = [False] * rows
    tol = dict(rtol=1e-12, atol=1e-13) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for step, row_set in enumerate(_ROW_SETS):
        dense = step == dense_step
        index = torch.arange(rows) if dense else perm[row_set]
        coeff = torch.randn(len(index), dim, dtype=torch.float64)
        weight.grad = None
        picked = weight if dense else F.embedding(index, weight, sparse=True)
        (coeff.to(dtype) * picked.sin()).sum().backward()
        assert weight.grad.is_sparse != dense
        grads = {}
        for k, r in enumerate(index.tolist()):  # d/dw sum(c * sin(w)) = c * cos(w), summed over repeats
            grads[r] = grads.get(r, 0) + coeff[k] * w_ref[r].cos()
        before = weight.detach().clone()
        opt.step()
        _reference_step(w_ref, buf_ref, seen_ref, grads, hp)
        torch.testing.assert_close(
            weight.detach().double(), torch.stack(w_ref), **tol, msg=f"weights after step {step}"
        )
        untouched = torch.tensor([r not in grads for r in range(rows)])
        assert torch.equal(weight.detach()[untouched], before[untouched])  # bit-exact
        if momentum:
            state = opt.state[weight]
            assert state["seen"].tolist() == seen_ref, f"rows marked seen after step {step}"
            torch.testing.assert_close(state["momentum_buffer"].double(), torch.stack(buf_ref), **tol)
    if dense_step is None:
        assert torch.equal(weight.detach()[perm[16]], start[perm[16]].to(dtype))


@pytest.mark.parametrize(
    "momentum,dampening,wd,nesterov",
    [(0.9, 0.0, 5e-4, False), (0.9, 0.3, 0.0, False), (0.8, 0.0, 1e-2, True), (0.0, 0.0, 1e-2, False)],
)
def test_dense_steps_equal_torch_sgd_with_sparse_rows_beside(momentum, dampening, wd, nesterov):
    # A backbone's dense parameters (several dtypes, a scalar, a channels-last kernel) in the
    # same group as a row-sparse head: each dense step equals torch.optim.SGD's bit for bit,
    # through a state_dict round trip and a pickled optimizer, and the sparse rows follow the
    # per-row rule (a row first sampled late starts its buffer with its raw gradient).
    torch.manual_seed(1)
    shapes = [((7, 5), torch.float32), ((3,), torch.float64), ((), torch.float32), ((4, 3, 3, 3), torch.float32)]
    starts = [torch.randn(s, dtype=d) for s, d in shapes]
    starts[3] = starts[3].to(memory_format=torch.channels_last)
    ours = [torch.nn.Parameter(t.clone()) for t in starts]
    ref = [torch.nn.Parameter(t.clone()) for t in starts]
    head = torch.nn.Parameter(torch.randn(9, 4, dtype=torch.float64))
    kw = dict(lr=0.05, momentum=momentum, dampening=dampening, weight_decay=wd, nesterov=nesterov)
    opt = shardkit.SparseRowSGD([*ours, head], **kw)
    sgd = torch.optim.SGD(ref, foreach=True, **kw)
    hp = (kw["lr"], momentum, dampening, wd, nesterov)
    w_ref = [r.clone() for r in head.detach()]
    buf_ref = [torch.zeros(4, dtype=torch.float64) for _ in range(9)]
    seen_ref = [False] * 9
    for step, rows in enumerate([[0, 2], [2, 5, 7], [1, 2], [8, 0]]):
        for a, b in zip(ours, ref):
            g = torch.randn(a.shape, dtype=a.dtype)
            a.grad, b.grad = g.clone(), g.clone()
        head.grad = None
        index = torch.tensor(rows)
        F.embedding(index, head, sparse=True).sum().backward()
        opt.step()
        sgd.step()
        _reference_step(w_ref, buf_ref, seen_ref, {r: torch.ones(4, dtype=torch.float64) for r in rows}, hp)
        for i, (a, b) in enumerate(zip(ours, ref)):
            assert torch.equal(a.detach(), b.detach()), f"dense parameter {i} after step {step}"
        torch.testing.assert_close(head.detach(), torch.stack(w_ref), rtol=1e-12, atol=1e-13)
        if step == 1:  # resume mid-run: from a state_dict, then as a pickled optimizer
            state = copy.deepcopy(opt.state_dict())
            opt = shardkit.SparseRowSGD([*ours, head], **kw)
            opt.load_state_dict(state)
        if step == 2:
            opt = copy.deepcopy(opt)
            ours, head = list(opt.param_groups[0]["params"][:-1]), opt.param_groups[0]["params"][-1]
    if momentum:
        for a, b in zip(ours, ref):
            assert torch.equal(opt.state[a]["momentum_buffer"], sgd.state[b]["momentum_buffer"])
            assert opt.state[a]["seen"].all()
        assert opt.state[head]["seen"].tolist() == seen_ref


@pytest.mark.parametrize(
    "kind",
    ["1d_lr", "2d_lr", "fraction"],
)
def test_hyperparameters_of_any_accepted_form_step_as_floats(kind):
    # A one-element tensor lr that is not 0-d, and Fractions (both accepted by the checks),
    # used to fail in the step (torch's `alpha` takes numbers and 0-d tensors only).
    from fractions import Fraction

    floats = dict(lr=0.1, momentum=0.5, weight_decay=0.25, dampening=0.5)
    if kind == "fraction":
        given = {k: Fraction(v) for k, v in floats.items()}
    else:
        lr = torch.tensor([0.1], dtype=torch.float64)  # (float32 0.1 is another number)
        given = dict(floats, lr=lr if kind == "1d_lr" else lr.view(1, 1))
    torch.manual_seed(2)
    start = torch.randn(9, 4, dtype=torch.float64)
    results = []
    for kw in (floats, given):
        head, dense = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start[:3].clone())
        opt = shardkit.SparseRowSGD([head, dense], **kw)
        for rows in ([0, 3], [3, 8], [1]):
            opt.zero_grad(set_to_none=True)
            loss = F.embedding(torch.tensor(rows), head, sparse=True).pow(2).sum() + dense.pow(3).sum()
            loss.backward()
            opt.step()
        results.append((head.detach(), dense.detach()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-15, atol=0)
