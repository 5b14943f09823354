"""SparseRowSGD resumes exactly from its state_dict (a checkpoint round trip)."""

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


@pytest.mark.parametrize("dampening", [0.0, 0.3])
def test_resume_from_torch_sgd_state_continues_like_sgd(dampening):
    # The docs say the layouts match: a torch.optim.SGD state_dict loads, and the steps that
    # follow equal torch.optim.SGD's (dense gradients: every row was seen).
    torch.manual_seed(0)
    w_ref = torch.nn.Parameter(torch.randn(6, 3, dtype=torch.float64))
    w = torch.nn.Parameter(w_ref.detach().clone())
    kw = dict(lr=0.1, momentum=0.9, dampening=dampening, weight_decay=0.01)
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
