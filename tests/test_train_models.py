"""shardkit.train.models: shapes, presets, checkpointing equivalence, errors, a learning smoke test."""

import pytest
import torch
import torch.nn.functional as F

import shardkit
from shardkit.train.data import SyntheticIdentities
from shardkit.train.models import Backbone, build_backbone


@pytest.mark.parametrize("name", ["tiny", "small"])
@pytest.mark.parametrize("size", [16, 32, 37])
def test_presets_shapes(name, size):
    m = build_backbone(name, embedding_dim=24)
    out = m(torch.randn(3, 3, size, size))
    assert out.shape == (3, 24) and out.dtype == torch.float32


def test_r18_and_flatten_head():
    m = build_backbone("r18", 64, head="flatten", image_size=32).eval()
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 64)
    with pytest.raises(ValueError, match=r"built for 2x2 final feature maps"):
        m(torch.randn(2, 3, 64, 64))


def test_grayscale_relu_bf16():
    m = Backbone((8, 16), (1, 2), 10, in_channels=1, act="relu").to(torch.bfloat16)
    assert m(torch.randn(4, 1, 20, 20, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_checkpointing_matches_plain():
    torch.manual_seed(0)
    a = Backbone((8, 16), (1, 2), 16)
    b = Backbone((8, 16), (1, 2), 16, checkpointing=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(6, 3, 16, 16)
    ya, yb = a(x), b(x)
    assert torch.allclose(ya, yb, rtol=1e-5, atol=1e-6)
    ya.square().sum().backward()
    yb.square().sum().backward()
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.allclose(pa.grad, pb.grad, rtol=1e-4, atol=1e-6), n


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(act="gelu"), r"argument `act` must be 'prelu' or 'relu'"),
        (dict(head="gdc"), r"argument `head` must be 'pool' or 'flatten'"),
        (dict(widths=(8, 16), depths=(1,)), r"`widths` and `depths` must be non-empty and of equal length"),
        (dict(head="flatten"), r"head='flatten' needs `image_size`"),
    ],
)
def test_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Backbone(**kwargs)
    with pytest.raises(ValueError, match=r"unknown backbone 'r999'"):
        build_backbone("r999")


def test_learns_synthetic_identities():
    # uint8 NHWC -> Normalize -> tiny backbone -> linear softmax: the loss must fall.
    torch.manual_seed(0)
    ds = SyntheticIdentities(6, 16, 16, seed=int(torch.randint(0, 1000, ()).item()))
    images, labels = ds.get_batch(range(len(ds)))
    norm = shardkit.Normalize([0.5] * 3, [0.5] * 3)
    model = Backbone((16, 32), (1, 1), 32, stem_stride=2)
    head = torch.nn.Linear(32, 6)
    opt = torch.optim.SGD(list(model.parameters()) + list(head.parameters()), lr=0.1, momentum=0.9)
    losses = []
    for step in range(25):
        idx = torch.randperm(len(ds))[:32]
        loss = F.cross_entropy(head(model(norm(images[idx]))), labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


def test_checkpointing_updates_batchnorm_statistics_once():
    # The recomputation in the backward must not update running stats a second time.
    torch.manual_seed(0)
    a = Backbone((8, 16), (1, 2), 16)
    b = Backbone((8, 16), (1, 2), 16, checkpointing=True)
    b.load_state_dict(a.state_dict())
    for _ in range(3):
        x = torch.randn(6, 3, 16, 16)
        a(x).square().sum().backward()
        b(x).square().sum().backward()
    bufs_a, bufs_b = dict(a.named_buffers()), dict(b.named_buffers())
    assert bufs_a.keys() == bufs_b.keys()
    for name, buf in bufs_a.items():
        if name.endswith("num_batches_tracked"):
            assert int(buf) == 3 and int(bufs_b[name]) == 3, name
        else:
            assert torch.allclose(buf, bufs_b[name], rtol=1e-5, atol=1e-6), name
    assert all(m.track_running_stats for m in b.modules() if isinstance(m, torch.nn.BatchNorm2d))


@pytest.mark.gpu
@pytest.mark.parametrize("name,checkpointing", [("small", False), ("r18", True), ("iresnet50", False)])
def test_a_backbone_split_inside_a_stage_runs_its_own_forward(name, checkpointing):
    # PipelineModel splits at block boundaries, so one stage's blocks can sit on two devices;
    # the backbone's own forward (evaluation, the pre-save check) must follow them block by block.
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (a stage split over devices)")
    size = 112 if name == "iresnet50" else 32
    ref = build_backbone(name, 32, checkpointing=checkpointing).double().eval()
    m = build_backbone(name, 32, checkpointing=checkpointing).double()
    m.load_state_dict(ref.state_dict())
    layers = m.as_layers()
    # the layers are [stem, every block in order, neck]: cut inside the first stage of 2+ blocks
    before = 1
    for stage in m.stages:
        if len(stage) >= 2:
            break
        before += len(stage)
    assert len(stage) >= 2, "the preset has no stage of two blocks to split"
    cut = before + len(stage) // 2
    shardkit.parallel.PipelineModel(layers, ["cuda:0", "cuda:1"], balance=[cut, len(layers) - cut])
    m.eval()
    x = torch.randn(2, 3, size, size, dtype=torch.float64)
    out = m(x.to("cuda:0"))
    torch.testing.assert_close(out.cpu(), ref(x), rtol=1e-9, atol=1e-9)
    m.train()  # and the training forward, checkpointed or not, with its gradients
    ref.train()
    m(x.to("cuda:0")).square().sum().backward()
    ref(x).square().sum().backward()
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-7, atol=1e-9, msg=n)
