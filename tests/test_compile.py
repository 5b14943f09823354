"""torch.compile(fullgraph=True) with default settings: the sharded head (inductor on the CPU,
forward and backward, with the default check_inputs=True), ModelEMA.update and Normalize
trace into one graph each and give what eager mode gives."""

import copy

import pytest
import torch
from conftest import TORCH_VERSION

import shardkit

# torch 2.6's dynamo cannot trace these whole (float() of a margin attribute, bool() of a
# list); 2.11 and 2.15 can. Versions between were not tried.
pytestmark = pytest.mark.skipif(
    TORCH_VERSION < (2, 11), reason=f"fullgraph tracing of shardkit needs torch >= 2.11, this is {torch.__version__}"
)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_sharded_head_compiles_whole_with_default_checks():
    head = shardkit.ShardedSoftmaxLoss(16, 37, margin=shardkit.ArcFace(s=16.0, m=0.3), devices=["cpu", "cpu"])
    assert head.check_inputs is True  # the default, which syncs in eager mode
    ref_head = copy.deepcopy(head)
    x = torch.randn(8, 16)
    y = torch.randint(0, 37, (8,))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    step = torch.compile(lambda e, t: head(e, t), fullgraph=True)  # inductor
    loss = step(x1, y)
    loss.backward()
    ref = ref_head(x2, y)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-6)
    for p, q in zip(head.parameters(), ref_head.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    # the compiled check still refuses bad labels (as an assert raised when the graph runs)
    with pytest.raises(RuntimeError, match="out of \\[0, num_classes\\)"):
        step(x1, torch.full((8,), 99))


def test_sampled_head_compiles_whole_and_draws_what_eager_draws():
    # PartialFC sampling with the default generators: one graph, the same classes as eager
    head = shardkit.ShardedSoftmaxLoss(8, 50, devices=["cpu", "cpu"], sample_rate=0.3)
    x = torch.randn(8, 8)
    y = torch.randint(0, 50, (8,))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    step = torch.compile(lambda e, t: head(e, t), fullgraph=True)
    seed = int(torch.randint(0, 2**31, ()).item())
    torch.manual_seed(seed)
    loss = step(x1, y)
    loss.backward()
    torch.manual_seed(seed)
    ref = head(x2, y)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-6)
    # the shards are tagged at construction (the traced forward cannot set attributes)
    assert all(getattr(p, "_shardkit_sampled", False) for p in head.weight_shards)


def test_a_sampling_rate_schedule_compiles_whole_at_each_rate():
    # A rate changed on the head (a schedule), or another head's rate, used to become a symbolic
    # float in dynamo, and the sampled counts need a concrete one: fullgraph failed. Now each
    # distinct rate compiles its own graph (dynamo's recompile limit bounds how many).
    head = shardkit.ShardedSoftmaxLoss(8, 50, devices=["cpu", "cpu"], sample_rate=0.5)
    step = torch.compile(lambda e, t: head(e, t, return_details=True), fullgraph=True)
    x, y = torch.randn(8, 8), torch.randint(0, 50, (8,))
    for rate in (0.5, 0.3, 0.2, 1.0, 0.3):
        head.sample_rate = rate
        seed = int(torch.randint(0, 2**31, ()).item())
        torch.manual_seed(seed)
        out = step(x, y)
        torch.manual_seed(seed)
        ref = head(x, y, return_details=True)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.lse, ref.lse, rtol=1e-5, atol=1e-6)
    other = shardkit.ShardedSoftmaxLoss(8, 50, devices=["cpu", "cpu"], sample_rate=0.7)  # another head's rate
    seed = int(torch.randint(0, 2**31, ()).item())
    torch.manual_seed(seed)
    out = torch.compile(other, fullgraph=True)(x, y)
    torch.manual_seed(seed)
    torch.testing.assert_close(out, other(x, y), rtol=1e-5, atol=1e-6)
    assert head.sample_rate == 0.3 and isinstance(head.sample_rate, float)


def test_model_ema_update_compiles_whole():
    torch.manual_seed(int(torch.randint(0, 2**31, ()).item()))
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    ema, ref = shardkit.ModelEMA(model, decay=0.9, tau=None), shardkit.ModelEMA(model, decay=0.9, tau=None)
    update = torch.compile(lambda: ema.update(model), fullgraph=True)
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model(torch.randn(5, 4))
        update()
        ref.update(model)
    assert ema.updates == ref.updates == 3
    for a, b in zip(ema.module.state_dict().values(), ref.module.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dynamic", [None, True])
def test_normalize_compiles_whole(dynamic):
    # dynamic=True makes the module's float lists symbolic (its checks used to break the graph)
    torch._dynamo.reset()
    norm = shardkit.Normalize((0.5, 0.4, 0.3), (0.25, 0.2, 0.3), memory_format=torch.channels_last)
    compiled = torch.compile(norm, fullgraph=True, dynamic=dynamic)
    for batch in (3, 5):
        images = torch.randint(0, 256, (batch, 7, 5, 3), dtype=torch.uint8)
        torch.testing.assert_close(compiled(images), norm(images), rtol=0, atol=0)
