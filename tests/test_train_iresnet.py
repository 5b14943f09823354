"""shardkit.train.models.IResNet (the ``iresnet50`` backbone preset): size, shapes, the
112x112 forward/backward on the CPU, checkpointing, pipeline layers, and the trainer flag.
(test_arcface_torch_checkout.py also compares it with arcface_torch's iresnet50.)"""

import pytest
import torch

from shardkit.train.cli import build_parser
from shardkit.train.models import PRESETS, IResNet, build_backbone


def test_iresnet50_size_and_layout():
    m = build_backbone("iresnet50", 512)
    assert isinstance(m, IResNet)
    # arcface_torch's iresnet50 with 512-d embeddings has 43,590,848 parameters, 512 of them the
    # fixed scale of the embedding BatchNorm
    assert sum(p.numel() for p in m.parameters()) == 43_590_848
    assert sum(p.numel() for p in m.parameters() if p.requires_grad) == 43_590_848 - 512
    assert [len(s) for s in m.stages] == [3, 4, 14, 3]
    assert m.fc.in_features == 512 * 7 * 7


@pytest.mark.slow
def test_iresnet50_forward_backward_at_112():
    m = build_backbone("iresnet50", 512)
    x = torch.randn(2, 3, 112, 112)
    y = m(x)
    assert y.shape == (2, 512) and y.dtype == torch.float32
    y.square().sum().backward()
    grads = [p.grad for p in m.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert m.bn_embedding.weight.grad is None and torch.equal(m.bn_embedding.weight, torch.ones(512))
    assert float(m.stem[0].weight.grad.norm()) > 0


@pytest.mark.parametrize("size", [32, 37, 7])
def test_other_input_sizes_pool_to_the_fc(size):
    m = IResNet((1, 1, 2, 1), 24, widths=(8, 16, 16, 32))
    out = m(torch.randn(3, 3, size, size))
    assert out.shape == (3, 24)


def test_no_pooling_at_the_native_side():
    # at the side the Linear is built for (here 16 -> 1 with four halvings), the neck flattens
    # the final map as it is: the same as calling the neck on it directly
    m = IResNet((1, 1, 1, 1), 6, widths=(4, 4, 8, 8), feature_side=1).eval()
    x = torch.randn(2, 3, 16, 16)
    feat = m.stem(x)
    for stage in m.stages:
        feat = stage(feat)
    assert feat.shape[-1] == 1
    expected = m.bn_embedding(m.fc(torch.flatten(m.bn_features(feat), 1)))
    assert torch.allclose(m(x), expected, rtol=1e-6, atol=1e-7)


def test_checkpointing_and_pipeline_layers_match_plain():
    torch.manual_seed(0)
    a = IResNet((1, 2, 1, 1), 16, widths=(8, 16, 16, 32))
    b = IResNet((1, 2, 1, 1), 16, widths=(8, 16, 16, 32), checkpointing=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 3, 24, 24)
    ya, yb = a(x), b(x)
    assert torch.allclose(ya, yb, rtol=1e-5, atol=1e-6)
    ya.square().sum().backward()
    yb.square().sum().backward()
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        if pa.requires_grad:
            assert torch.allclose(pa.grad, pb.grad, rtol=1e-4, atol=1e-6), n
    for name, buf in a.named_buffers():  # BN statistics updated once, as without checkpointing
        assert torch.allclose(buf.float(), dict(b.named_buffers())[name].float()), name
    a.eval()
    h = x
    for layer in a.as_layers():
        h = layer(h)
    assert torch.allclose(h, a(x), rtol=1e-6, atol=1e-7)
    assert {id(p) for layer in a.as_layers() for p in layer.parameters()} == {id(p) for p in a.parameters()}


def test_errors():
    with pytest.raises(ValueError, match=r"`widths` and `depths` must be non-empty, of equal length"):
        IResNet((3, 4), 8)
    with pytest.raises(ValueError, match=r"depths >= 1"):
        IResNet((1, 0, 1, 1), 8)


def test_trainer_flag():
    assert "iresnet50" in PRESETS
    args = build_parser().parse_args(["--backbone", "iresnet50", "--image-size", "112", "--dim", "512"])
    assert args.backbone == "iresnet50"
    with torch.device("meta"):  # what the trainer's memory check builds
        m = build_backbone(args.backbone, args.dim, checkpointing=True)
    assert m.checkpointing and m(torch.empty(2, 3, 112, 112, device="meta")).shape == (2, 512)
