"""shardkit.softmax.partial_fc: the drop-in for arcface_torch's PartialFC_V2, on CPU devices,
against the float64 full-logit reference (tests/softmax_reference.py). These tests need no
arcface_torch checkout; test_arcface_torch_checkout.py compares with its own code."""

import math
import os
import traceback
import warnings
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_teardown import end_rank
from softmax_reference import reference_loss, reference_loss_and_grads

import shardkit
from shardkit.softmax.partial_fc import PartialFC_V2, SparseRowPartialFC_V2, margin_from_loss


def combined(s=64.0, m1=1.0, m2=0.0, m3=0.0, threshold=0.0):
    """An object with arcface_torch CombinedMarginLoss's attributes (not its code)."""
    return SimpleNamespace(s=s, m1=m1, m2=m2, m3=m3, interclass_filtering_threshold=threshold)


MARGINS = {
    "cosface": (combined(64.0, 1.0, 0.0, 0.4), dict(scale=64.0, m3=0.4)),
    "arcface": (combined(64.0, 1.0, 0.5, 0.0), dict(scale=64.0, m2=0.5)),
    "cosine": (combined(30.0), dict(scale=30.0)),
}


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


CASES = [(torch.float64, 7, 13, 5), (torch.float64, 1, 3, 2), (torch.float64, 33, 101, 16)]
# fp32 not at D = 2: two random 2-d vectors are often nearly parallel, where ArcFace's
# derivative sin(theta + m) / sin(theta) is ill-conditioned in any fp32 arithmetic
CASES += [(torch.float32, 7, 13, 5), (torch.float32, 33, 101, 16)]


@pytest.mark.parametrize("margin", sorted(MARGINS))
@pytest.mark.parametrize("dtype,batch,classes,dim", CASES)
def test_loss_and_gradients_match_float64_reference(margin, dtype, batch, classes, dim):
    loss_obj, kwargs = MARGINS[margin]
    head = PartialFC_V2(loss_obj, dim, classes, 1.0, False, dtype=dtype)
    x = torch.randn(batch, dim, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, classes, (batch, 1))  # train_v2's loader gives [B]; [B, 1] works too
    loss = head(x, labels)
    loss.backward()
    ref = reference_loss_and_grads(x, head.weight, labels.view(-1), normalize=True, **kwargs)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    # The loss is lse - target logit: both round at ~eps x the logits' scale, however small
    # their difference (a well-classified row's loss can be 1e-9 at s=30, then known to ~1e-6
    # of itself), and each softmax gradient dz_j = p_j - [j = y] carries that absolute error;
    # the cosine's gradients scale it by s / |x| and s / |w_j| (PartialFC_V2's weights start
    # at norm ~0.01: the weight gradient's floor is ~100x the loss's).
    floor = (1e-13 if dtype == torch.float64 else 1e-6) * kwargs["scale"]
    w_norm = float(head.weight.detach().double().norm(dim=1).min())
    x_norm = float(x.detach().double().norm(dim=1).min())
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    checks = [(loss.detach(), ref.loss, floor), (x.grad, ref.grad_x, floor / x_norm)]
    checks.append((head.weight.grad, ref.grad_w, floor / w_norm))
    for got, want, at in checks:
        assert float((got.double() - want).norm()) <= tol * float(want.norm()) + at
    assert labels.shape == (batch, 1)  # the caller's labels are left as they were


def test_init_draws_partial_fc_v2_numbers():
    # PartialFC_V2 draws torch.normal(0, 0.01, (num_local, D)) from the CPU generator: the same
    # numbers, and the generator left where that draw leaves it.
    seed = int(torch.randint(0, 2**31, ()))
    torch.manual_seed(seed)
    expected = torch.normal(0, 0.01, (29, 6))
    after_draw = torch.rand(3)
    torch.manual_seed(seed)
    head = PartialFC_V2(combined(m3=0.4), 6, 29)
    assert torch.equal(head.weight.detach(), expected)
    assert torch.equal(torch.rand(3), after_draw)
    assert (head.num_local, head.class_start, head.rank, head.world_size) == (29, 0, 0, 1)


def test_sgd_steps_follow_the_reference():
    # train_v2.py's optimizer (SGD, momentum 0.9, weight decay) over a backbone and the head:
    # three steps of the drop-in and of a float64 reference head from the same start.
    classes, dim, batch = 37, 8, 12
    backbone = torch.nn.Linear(10, dim).double()
    head = PartialFC_V2(combined(m2=0.5), dim, classes, dtype=torch.float64)
    ref_backbone = torch.nn.Linear(10, dim).double()
    ref_backbone.load_state_dict(backbone.state_dict())
    ref_weight = torch.nn.Parameter(head.weight.detach().clone())

    def sgd(params):
        groups = [{"params": list(params[0])}, {"params": params[1]}]
        return torch.optim.SGD(groups, lr=0.2, momentum=0.9, weight_decay=5e-4)

    opt = sgd([backbone.parameters(), list(head.parameters())])
    ref_opt = sgd([ref_backbone.parameters(), [ref_weight]])
    for _ in range(3):
        images, labels = torch.randn(batch, 10, dtype=torch.float64), torch.randint(0, classes, (batch,))
        loss = head(backbone(images), labels)
        ref = reference_loss(ref_backbone(images), ref_weight, labels, normalize=True, scale=64.0, m2=0.5)
        assert abs(float(loss.detach()) - float(ref.detach())) <= 1e-10 * abs(float(ref.detach()))
        for o, value in ((opt, loss), (ref_opt, ref)):
            o.zero_grad()
            value.backward()
            o.step()
    assert rel(head.weight.detach(), ref_weight.detach()) <= 1e-10
    assert rel(backbone.weight.detach(), ref_backbone.weight.detach()) <= 1e-10


def _sampled_classes(grad):
    return (grad != 0).any(dim=1).nonzero().flatten()


def test_sampling_gives_partial_fc_v2_dense_gradient():
    # sample_rate < 1: a dense gradient with zero rows for the classes not sampled, which
    # torch.optim.SGD with momentum and weight decay takes without a warning (as with
    # PartialFC_V2); the loss is the loss over the sampled classes.
    classes, dim, batch, rate = 61, 6, 9, 0.25
    head = PartialFC_V2(combined(m3=0.35), dim, classes, rate, dtype=torch.float64)
    opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    for _ in range(2):
        x = torch.randn(batch, dim, dtype=torch.float64)
        labels = torch.randint(0, classes, (batch,))
        loss = head(x, labels)
        opt.zero_grad()
        loss.backward()
        grad = head.weight.grad
        assert not grad.is_sparse and grad.shape == (classes, dim)
        used = _sampled_classes(grad)
        assert used.numel() == max(math.ceil(rate * classes), min(batch, classes))
        assert torch.isin(labels, used).all()
        remap = torch.full((classes,), -1, dtype=torch.int64)
        remap[used] = torch.arange(used.numel())
        ref = reference_loss_and_grads(
            x, head.weight.detach()[used], remap[labels], normalize=True, scale=64.0, m3=0.35
        )
        assert rel(loss.detach(), ref.loss) <= 1e-10
        assert rel(grad[used], ref.grad_w) <= 1e-10
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.step()


def test_sparse_row_variant_with_sparse_row_sgd():
    classes, dim, batch = 50, 4, 5
    head = SparseRowPartialFC_V2(combined(m2=0.5), dim, classes, 0.2, dtype=torch.float64)
    assert head.sparse_grad
    opt = shardkit.SparseRowSGD(head.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    before = head.weight.detach().clone()
    head(torch.randn(batch, dim, dtype=torch.float64), torch.randint(0, classes, (batch,))).backward()
    grad = head.weight.grad
    assert grad.is_sparse
    rows = grad.coalesce().indices()[0]
    opt.step()
    untouched = torch.ones(classes, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(head.weight.detach()[untouched], before[untouched])
    assert not torch.equal(head.weight.detach()[rows], before[rows])


def test_state_dict_has_partial_fc_v2_key():
    head = PartialFC_V2(combined(m3=0.4), 3, 11)
    state = head.state_dict()
    assert list(state) == ["weight"] and state["weight"].shape == (11, 3)
    other = PartialFC_V2(combined(m3=0.4), 3, 11)
    other.load_state_dict({"weight": state["weight"].clone()})
    assert torch.equal(other.weight.detach(), head.weight.detach())


def test_fp16_flag_and_outer_autocast():
    head = PartialFC_V2(combined(m3=0.4), 16, 40)
    x, labels = torch.randn(8, 16), torch.randint(0, 40, (8,))
    fp32 = head(x, labels)
    # fp16=False turns an outer autocast off for the head, as PartialFC_V2's autocast(False) does
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(head(x, labels), fp32)
    head.fp16 = True
    half = head(x, labels).detach()
    ref = reference_loss(x, head.weight.detach(), labels, normalize=True, scale=64.0, m3=0.4)
    assert half.dtype == torch.float32 and not torch.equal(half, fp32.detach())  # the embeddings went fp16
    assert abs(float(half) - float(ref)) <= 1e-2 * abs(float(ref))


def test_margin_mapping():
    assert margin_from_loss(combined(64.0, 1.0, 0.5, 0.0)) == shardkit.ArcFace(64.0, 0.5)
    assert margin_from_loss(combined(32.0, 1.0, 0.0, 0.3)) == shardkit.CosFace(32.0, 0.3)
    assert margin_from_loss(combined(30.0)) == shardkit.CombinedMargin(30.0)
    assert margin_from_loss(SimpleNamespace(s=64.0, margin=0.5)) == shardkit.ArcFace(64.0, 0.5)  # their ArcFace
    assert margin_from_loss(SimpleNamespace(s=64.0, m=0.4)) == shardkit.CosFace(64.0, 0.4)  # their CosFace
    assert margin_from_loss(shardkit.CosFace(8.0, 0.1)) == shardkit.CosFace(8.0, 0.1)


class ArcFace:  # the name arcface_torch's releases give the class; their attribute layouts below
    def __init__(self, **attrs):
        self.__dict__.update(attrs)


@pytest.mark.parametrize(
    "layout",
    [
        dict(s=48.0, margin=0.35),  # 2023 on
        dict(scale=48.0, margin=0.35),  # late 2022
        dict(scale=48.0, cos_m=math.cos(0.35), sin_m=math.sin(0.35), easy_margin=False),  # early 2022
        dict(s=48.0, m=0.35),  # 2021: an ArcFace with CosFace's attribute names
    ],
)
def test_arcface_torch_arcface_of_every_release(layout):
    # Each release's ArcFace maps to shardkit's ArcFace (one of them once was refused, another
    # would have been taken for a CosFace), and the loss is that margin's.
    margin = margin_from_loss(ArcFace(**layout))
    assert isinstance(margin, shardkit.ArcFace)
    assert margin.params() == pytest.approx(shardkit.ArcFace(48.0, 0.35).params(), rel=1e-15, abs=1e-15)
    head = PartialFC_V2(ArcFace(**layout), 8, 30, 1.0, False)
    torch.manual_seed(5)
    x, labels = torch.randn(6, 8, dtype=torch.float64), torch.randint(0, 30, (6,))
    head.double()
    got = head(x, labels).detach()
    ref = reference_loss(x, head.weight.detach(), labels, normalize=True, scale=48.0, m2=0.35)
    assert abs(float(got) - float(ref)) <= 1e-12 * abs(float(ref))


@pytest.mark.parametrize(
    "loss_obj,error,match",
    [
        (combined(m3=0.4, threshold=0.2), ValueError, r"interclass_filtering_threshold=0.2 is not supported"),
        (combined(m1=1.0, m2=0.3, m3=0.2), ValueError, r"applies only m3 \(CosFace\) when m3 > 0"),
        (combined(m1=1.35), ValueError, r"refused by arcface_torch's CombinedMarginLoss too"),
        (object(), TypeError, r"argument `margin_loss` must be a shardkit margin or an arcface_torch margin loss"),
        # attributes float() would take or fail on without naming them
        (combined(s="64", m2=0.5), TypeError, r"argument `margin_loss` \(SimpleNamespace\) has s='64'; it must be a"),
        (combined(s=None, m2=0.5), TypeError, r"has s=None; it must be a real number"),
        (combined(s=True, m2=0.5), TypeError, r"has s=True; it must be a real number"),
        (combined(m2=0.5, threshold=math.nan), ValueError, r"interclass_filtering_threshold is NaN"),
        (combined(m2=0.5, threshold="x"), TypeError, r"has interclass_filtering_threshold='x'"),
        (combined(m1=math.nan, m3=0.3), ValueError, r"argument `margin_loss` has m1=nan; it must be finite"),
        (SimpleNamespace(s=64.0, margin="x"), TypeError, r"has margin='x'; it must be a real number"),
    ],
)
def test_margin_errors(loss_obj, error, match):
    with pytest.raises(error, match=match):
        PartialFC_V2(loss_obj, 4, 10)


def test_argument_errors():
    with pytest.raises(TypeError, match=r"argument `fp16` must be True or False"):
        PartialFC_V2(combined(m3=0.4), 4, 10, 1.0, 1)
    with pytest.raises(TypeError, match=r"argument `sparse_grad` must be True or False"):
        PartialFC_V2(combined(m3=0.4), 4, 10, sparse_grad="yes")
    with pytest.raises(ValueError, match=r"argument `sample_rate` must be in \(0, 1\]"):
        PartialFC_V2(combined(m3=0.4), 4, 10, 1.5)
    with pytest.raises(ValueError, match=r"argument `embeddings` has dim 5"):
        PartialFC_V2(combined(m3=0.4), 4, 10)(torch.randn(2, 5), torch.tensor([1, 2]))
    # autocast raised "unsupported autocast device_type 'meta'" before the argument was checked
    for fp16 in (False, True):
        with pytest.raises(ValueError, match=r"argument `embeddings` is on meta"):
            PartialFC_V2(combined(m3=0.4), 4, 10, 1.0, fp16)(torch.randn(2, 4, device="meta"), torch.tensor([1, 2]))


def test_margin_attributes_may_be_one_element_tensors():
    assert margin_from_loss(combined(torch.tensor(64.0), m2=torch.tensor(0.5))) == shardkit.ArcFace(64.0, 0.5)
    assert margin_from_loss(combined(32, m3=0.3, threshold=None)) == shardkit.CosFace(32.0, 0.3)


def test_load_errors_name_the_checkpoint_key():
    # A wrong-shaped or absent `weight` was also reported as a missing "weight_shards.0", a key
    # the checkpoint never holds; now the error names `weight` only, and nothing is loaded.
    head = PartialFC_V2(combined(m3=0.4), 4, 10)
    before = head.weight.detach().clone()
    for bad in ({"weight": torch.randn(11, 4)}, {"weight": torch.randn(10, 5)}, {"weight": [0.0]}):
        with pytest.raises(RuntimeError, match=r"size mismatch for weight") as err:
            head.load_state_dict(bad)
        assert "weight_shards" not in str(err.value)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "weight"\.') as err:
        head.load_state_dict({"weights": torch.randn(10, 4)})
    assert "weight_shards" not in str(err.value) and '"weights"' in str(err.value)
    result = head.load_state_dict({}, strict=False)
    assert result.missing_keys == ["weight"] and result.unexpected_keys == []
    assert torch.equal(head.weight.detach(), before)
    # the per-shard keys of a same-shard-count state still load as parameters
    head.load_state_dict({"weight_shards.0": torch.ones(10, 4)})
    assert torch.equal(head.weight.detach(), torch.ones(10, 4))
    # inside a model the key carries the model's prefix
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), PartialFC_V2(combined(m3=0.4), 4, 10))
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "1\.weight"\.'):
        net.load_state_dict({k: v for k, v in net.state_dict().items() if k != "1.weight"})


# ---- two gloo ranks: the classes split over the ranks as PartialFC_V2 splits them ----


def _two_rank_worker(rank, init_file, tmp, data):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    out = {}
    try:
        torch.manual_seed(data["seed"])  # every rank seeded alike, as train_v2.py's setup_seed does
        head = PartialFC_V2(combined(m2=0.5), data["x"].shape[1], data["classes"], dtype=torch.float64)
        mine = slice(rank * 4, rank * 4 + 4)
        x = data["x"][mine].clone().requires_grad_()
        loss = head(x, data["labels"][mine])
        loss.backward()
        out = dict(
            loss=loss.detach(),
            grad_x=x.grad,
            weight=head.weight.detach().clone(),
            grad_w=head.weight.grad.clone(),
            split=(head.num_local, head.class_start, head.rank, head.world_size),
            keys=list(head.state_dict()),
        )
        # load errors name `weight` (the checkpoint's key), not the shard's inner name
        for bad in ({"weight": torch.randn(3, data["x"].shape[1], dtype=torch.float64)}, {"weights": head.weight}):
            try:
                head.load_state_dict(bad)
            except RuntimeError as err:
                out.setdefault("load_errors", []).append(str(err))
        before = head.weight
        out["missing"] = head.load_state_dict({}, strict=False, assign=True).missing_keys
        out["kept"] = head.weight is before  # assign=True installed the pre-hook's stand-in
    except Exception:
        out["fatal"] = traceback.format_exc()
    finally:
        torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
        end_rank()


def test_two_gloo_ranks_split_classes_like_partial_fc_v2(tmp_path):
    classes, dim = 23, 5
    data = dict(
        seed=int(torch.randint(0, 2**31, ())),
        classes=classes,
        x=torch.randn(8, dim, dtype=torch.float64),
        labels=torch.randint(0, classes, (8,)),
    )
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "init"), str(tmp_path), data), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in range(2):
        assert "fatal" not in res[r], res[r]["fatal"]
    # PartialFC_V2's split: num_local = C // W + (rank < C % W), class_start in rank order
    assert res[0]["split"] == (12, 0, 0, 2) and res[1]["split"] == (11, 12, 1, 2)
    assert res[0]["keys"] == res[1]["keys"] == ["weight"]
    for r in range(2):
        shape, missing = res[r]["load_errors"], res[r]["missing"]
        assert len(shape) == 2 and all("weight_shards" not in e for e in shape), shape
        assert "size mismatch for weight: the checkpoint has (3, 5)" in shape[0], shape[0]
        assert 'Missing key(s) in state_dict: "weight"' in shape[1] and '"weights"' in shape[1], shape[1]
        assert missing == ["weight"] and res[r]["kept"]
    torch.manual_seed(data["seed"])
    assert torch.equal(res[1]["weight"], torch.normal(0, 0.01, (11, dim), dtype=torch.float64))
    w = torch.cat([res[0]["weight"], res[1]["weight"]])
    ref = reference_loss_and_grads(data["x"], w, data["labels"], normalize=True, scale=64.0, m2=0.5)
    for r in range(2):
        assert rel(res[r]["loss"], ref.loss) <= 1e-10
        # PartialFC_V2's convention: each rank's embedding gradient is world_size * dL/dX_r
        assert rel(res[r]["grad_x"], 2 * ref.grad_x[r * 4 : r * 4 + 4]) <= 1e-10
    assert rel(torch.cat([res[0]["grad_w"], res[1]["grad_w"]]), ref.grad_w) <= 1e-10
