"""SparseRowSGD resumes exactly from its state_dict (a checkpoint round trip)."""

import copy

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
