"""The head under torch's module utilities that act through state dicts and attributes:
torch.func.functional_call, torch.distributed.checkpoint's state-dict API, torch.nn.utils.prune;
and label dtypes that cannot be class ids."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardkit

D, C = 8, 21


class Net(nn.Module):
    def __init__(self, head):
        super().__init__()
        self.body, self.head = nn.Linear(5, D, dtype=torch.float64), head

    def forward(self, x, y):
        return self.head(self.body(x), y)


def _net(devices, seed=0):
    torch.manual_seed(seed)
    return Net(shardkit.ShardedSoftmaxLoss(D, C, devices=devices, dtype=torch.float64))


@pytest.mark.parametrize("devices", [None, ["cpu"] * 3])
def test_functional_call_with_a_state_dict_uses_its_head_weight(devices):
    # The head's `weight` entry (class-ordered) was ignored: the loss mixed the given backbone
    # with the live head.
    net = _net(devices)
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randint(0, C, (16,))
    given = {k: v * 2 + 0.1 for k, v in net.state_dict().items()}
    loaded = copy.deepcopy(net)
    loaded.load_state_dict(given)
    got = torch.func.functional_call(net, given, (x, y))
    torch.testing.assert_close(got, loaded(x, y), rtol=1e-12, atol=1e-12)
    full = given["head.weight"]
    ref = F.cross_entropy(F.linear(F.linear(x, given["body.weight"], given["body.bias"]), full), y)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert net.head.weight is None  # restored after the call
    torch.testing.assert_close(net(x, y), _net(devices)(x, y), rtol=0, atol=0)  # the live head again

    # differentiable with respect to the weight given (what the functional APIs are for)
    w = full.clone().requires_grad_(True)
    loss = torch.func.functional_call(net, {**given, "head.weight": w}, (x, y))
    (gw,) = torch.autograd.grad(loss, w)
    wr = full.clone().requires_grad_(True)
    ref = F.cross_entropy(F.linear(F.linear(x, given["body.weight"], given["body.bias"]), wr), y)
    torch.testing.assert_close(gw, torch.autograd.grad(ref, wr)[0], rtol=1e-10, atol=1e-12)
    assert all(p.grad is None for p in net.head.parameters())


def test_a_stand_in_weight_of_another_shape_is_refused():
    net = _net(["cpu"] * 2)
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randint(0, C, (4,))
    with pytest.raises(ValueError, match=r"attribute `weight` must be a floating \[num_classes, embedding_dim\]"):
        torch.func.functional_call(net, {"head.weight": torch.zeros(C - 1, D, dtype=torch.float64)}, (x, y))
    net.head.weight = "w"
    with pytest.raises(TypeError, match="attribute `weight` must be None or a"):
        net(x, y)


@pytest.mark.parametrize("devices", [None, ["cpu"] * 3])
def test_torch_distributed_checkpoint_state_dict_api(devices):
    # get_model_state_dict walks the keys with getattr: `head.weight` was an AttributeError.
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

    net = _net(devices)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, C, (8,))
    net(x, y).backward()
    opt.step()
    model_sd = get_model_state_dict(net)
    assert torch.equal(model_sd["head.weight"], net.head.full_weight())
    # (deep copies, as a save and a load give: torch's optimizer load keeps the tensors it is given)
    model_sd, optim_sd = copy.deepcopy(get_state_dict(net, opt))
    other = _net(devices, seed=1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    other(x, y).backward()
    other_opt.step()
    set_state_dict(other, other_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert torch.equal(other.head.full_weight(), net.head.full_weight())
    for o in (opt, other_opt):
        o.zero_grad()
    net(x, y).backward()
    other(x, y).backward()
    opt.step()
    other_opt.step()
    assert torch.equal(other.head.full_weight(), net.head.full_weight())  # the momentum came along


@pytest.mark.parametrize("devices", [None, ["cpu"] * 2])
def test_a_pruned_shard_round_trips_and_is_recomputed_at_each_forward(devices):
    from torch.nn.utils import prune

    torch.manual_seed(0)
    head = shardkit.ShardedSoftmaxLoss(6, 20, devices=devices, dtype=torch.float64)
    prune.l1_unstructured(head.weight_shards, "0", amount=0.5)
    sd = head.state_dict()
    assert "weight" not in sd and {"weight_shards.0_orig", "weight_shards.0_mask"} <= set(sd)
    torch.manual_seed(1)
    other = shardkit.ShardedSoftmaxLoss(6, 20, devices=devices, dtype=torch.float64)
    prune.l1_unstructured(other.weight_shards, "0", amount=0.5)
    other.load_state_dict(sd)  # was: "holds both `weight` ... and weight_shards.0_mask"
    x, y = torch.randn(7, 6, dtype=torch.float64), torch.randint(0, 20, (7,))
    assert torch.equal(other(x, y), head(x, y))

    # training: the pruned shard follows its original (a ParameterList is never called, so its
    # pruning hook ran once, and a second backward went through a freed graph)
    opt = torch.optim.SGD(head.parameters(), lr=0.5)
    orig, mask = head.weight_shards.get_parameter("0_orig"), head.weight_shards.get_buffer("0_mask")
    for _ in range(3):
        opt.zero_grad()
        loss = head(x, y)
        loss.backward()
        rest = [p.detach() for p in list(head.weight_shards)[1:]]
        ref = F.cross_entropy(F.linear(x, torch.cat([(orig * mask).detach(), *rest])), y)
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        opt.step()
    with pytest.raises(TypeError, match="parametrized weight shards"):
        shardkit.export_full_weight(head)  # copies plain rows: refused, as for a parametrization


def test_uint64_labels_are_refused_not_wrapped():
    head = shardkit.ShardedSoftmaxLoss(4, 10)
    x = torch.randn(3, 4)
    for ids in ([1, 2, 2**64 - 100], [1, 2, 3]):  # 2**64 - 100 became -100, ignored silently
        with pytest.raises(TypeError, match="argument `labels` is uint64"):
            head(x, torch.tensor(ids, dtype=torch.uint64))
    head(x, torch.tensor([1, 2, 3], dtype=torch.uint32)).backward()  # the other unsigned dtypes convert


def test_the_vmap_check_message_says_what_torch_func_can_do():
    head = shardkit.ShardedSoftmaxLoss(4, 10)
    x, y = torch.randn(2, 3, 4), torch.randint(0, 10, (2, 3))
    with pytest.raises(ValueError, match="torch.func.grad, vjp, jacrev and jvp cannot differentiate this loss"):
        torch.vmap(head)(x, y)


def test_the_process_group_mode_takes_its_own_shard_under_functional_call(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        head = shardkit.ShardedSoftmaxLoss(D, C, process_group=dist.group.WORLD, dtype=torch.float64)
        x, y = torch.randn(6, D, dtype=torch.float64), torch.randint(0, C, (6,))
        given = {k: v * 3 for k, v in head.state_dict().items()}
        assert list(given) == ["weight_shards.0"]
        got = torch.func.functional_call(head, given, (x, y))
        torch.testing.assert_close(got, F.cross_entropy(F.linear(x, given["weight_shards.0"]), y), rtol=1e-12, atol=0)
        with pytest.raises(ValueError, match="attribute `weight` .* is the one-process form"):
            torch.func.functional_call(head, {"weight": given["weight_shards.0"]}, (x, y))
        assert head.weight is None
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("devices", [None, ["cpu"] * 2])
def test_assign_loads_never_replace_a_shard_the_state_dict_does_not_give(devices):
    # The load pre-hook put the shards' own values in for the keys it answered: with
    # assign=True torch installed them as new Parameters, which the optimizer did not hold.
    net = _net(devices)
    shards = list(net.head.weight_shards)
    body = {k: v for k, v in net.state_dict().items() if k.startswith("body.")}
    result = net.load_state_dict(body, strict=False, assign=True)
    assert result.missing_keys == ["head.weight"] and result.unexpected_keys == []
    assert all(a is b for a, b in zip(net.head.weight_shards, shards))
    bad = dict(body, **{"head.weight": torch.zeros(C + 1, D, dtype=torch.float64)})
    with pytest.raises(RuntimeError, match=r"size mismatch for head\.weight") as err:
        net.load_state_dict(bad, assign=True)
    assert "weight_shards" not in str(err.value)
    assert all(a is b for a, b in zip(net.head.weight_shards, shards))


def test_a_stand_in_weight_takes_the_gradient_of_a_sampled_head():
    # A sampled shard's gradient is row-sparse: the stand-in's slicing refused it in the backward.
    torch.manual_seed(0)
    head = shardkit.ShardedSoftmaxLoss(D, C, devices=["cpu"] * 3, sample_rate=0.5, dtype=torch.float64)
    x, y = torch.randn(6, D, dtype=torch.float64), torch.randint(0, C, (6,))
    w = head.full_weight().clone().requires_grad_(True)
    head.sample_generator = [torch.Generator().manual_seed(k) for k in range(3)]
    loss = torch.func.functional_call(head, {"weight": w}, (x, y))
    (gw,) = torch.autograd.grad(loss, w)
    head.sample_generator = [torch.Generator().manual_seed(k) for k in range(3)]  # the same sample
    with torch.no_grad():
        for p, part in zip(head.weight_shards, w.detach().split(list(head.shard_sizes))):
            p.copy_(part)
    head(x, y).backward()
    expected = torch.cat([p.grad.to_dense() for p in head.weight_shards])
    assert gw.layout == torch.strided and torch.allclose(gw, expected, rtol=1e-12, atol=1e-14)
