"""Bad inputs to the public ops of ``shardkit.ops`` that reached the kernels (or torch) and came
back as results or errors naming no argument: margin numbers whose float32 logits overflow,
sparse tensors, complex / bool / huge loss weights, mappings and sets as per-channel values."""

import pytest
import torch

from shardkit import ops
from shardkit.softmax.margins import CombinedMargin


def _ce_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 4, generator=g), torch.randn(6, 4, generator=g), torch.tensor([0, 5, 2])


# ---- 1. scale * (1 + |m3|) beyond the margins' 1e30 ----


@pytest.mark.parametrize(
    "scale, m3",
    [(10.0, 1e38), (64.0, 1e37), (1e30, 0.5), (3.4e38, 0.0), (10.0, -1e38), (10, 10**37)],
)
def test_ce_shard_stats_refuses_logits_the_margins_refuse(scale, m3):
    # CombinedMargin refuses the same numbers; the op returned -inf target logits and sums
    with pytest.raises(ValueError, match=r"arguments `s` and `m3` give logits up to"):
        CombinedMargin(scale, 1.0, 0.0, m3)
    x, w, y = _ce_inputs()
    with pytest.raises(ValueError, match=r"arguments `scale` and `m3` give logits up to scale \* \(1 \+ \|m3\|\)"):
        ops.ce_shard_stats(x, w, y, scale=scale, m3=m3, normalize=True)


def test_ce_shard_stats_logit_bound_keeps_what_the_margins_take():
    x, w, y = _ce_inputs()
    for scale, m3 in [(1e29, 0.35), (64.0, 0.35), (5e29, 1.0)]:
        CombinedMargin(scale, 1.0, 0.0, m3)  # taken there: taken here
        stats = ops.ce_shard_stats(x, w, y, scale=scale, m3=m3, normalize=True)
        assert all(torch.isfinite(t).all() for t in stats[:3])
    # float64 logits do not overflow at 1e39: the bound is float32's (as the kernels' scale bound)
    stats = ops.ce_shard_stats(x.double(), w.double(), y, scale=10.0, m3=1e38, normalize=True)
    assert all(torch.isfinite(t).all() for t in stats[:3])
    # non-finite m3 stays the kernels' error; an int scale past float64 is named
    with pytest.raises(RuntimeError, match="`m3` must be finite"):
        ops.ce_shard_stats(x, w, y, scale=10.0, m3=float("inf"), normalize=True)
    with pytest.raises(ValueError, match="`scale` must be finite"):
        ops.ce_shard_stats(x, w, y, scale=10**400)


# ---- 2. sparse tensors ----


def _sparse(t):
    return t.to_sparse()


_E, _M = torch.zeros(3), torch.ones(3)
_D64 = torch.tensor(0.5, dtype=torch.float64)
_IMG = torch.zeros(1, 2, 2, 3, dtype=torch.uint8)
_X, _W, _Y = _ce_inputs()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ops.ce_shard_stats(_sparse(_X), _W, _Y), r"argument `x` must be a dense \(strided\) tensor"),
        (lambda: ops.ce_shard_stats(_X.to_sparse_csr(), _W, _Y), r"`x` must be a dense .* torch.sparse_csr"),
        (lambda: ops.ce_shard_stats(_X, _sparse(_W), _Y), r"argument `w` must be a dense \(strided\) tensor"),
        (lambda: ops.ce_shard_stats(_X, _W, _sparse(_Y)), r"argument `labels` must be a dense"),
        (lambda: ops.ce_shard_stats(_X, _W, _Y, target_ref=_sparse(torch.zeros(3))), r"`target_ref` must be a dense"),
        (lambda: ops.ema_update_([_E.clone()], [_sparse(_M)], 0.5), r"ema_update_: `model\[0\]` must be a dense"),
        (
            lambda: ops.ema_update_device_decay_([_E.clone()], [_sparse(_M)], _D64),
            r"ema_update_device_decay_: `model\[0\]` must be a dense",
        ),
        (
            lambda: ops.ema_update_device_decay_([_E.clone()], [_M], _sparse(_D64)),
            r"argument `decay` must be a dense",
        ),
        (
            lambda: ops.split_to_devices([_X, _sparse(_X)], [1, 2], ["cpu", "cpu"]),
            r"argument `tensors` \(index 1\) must be a dense \(strided\) tensor, got layout torch.sparse_coo",
        ),
        (
            lambda: ops.split_to_devices([_X], _sparse(torch.tensor([1, 2])), ["cpu", "cpu"]),
            r"argument `split_sizes` must be a dense",
        ),
        (
            lambda: ops.weighted_loss_reduce([_sparse(torch.tensor(1.0))], [1.0], "cpu"),
            r"argument `losses` \(index 0\) must be a dense",
        ),
        (
            lambda: ops.weighted_loss_reduce([torch.tensor(1.0)], [_sparse(torch.tensor([1.0]))], "cpu"),
            r"argument `weights` \(index 0\) must be a dense",
        ),
        (
            lambda: ops.partial_fc_sample(_sparse(_Y), class_offset=0, num_local=6, num_sample=3),
            r"argument `labels` must be a dense",
        ),
        (
            lambda: ops.normalize_images(_IMG, _sparse(torch.full((3,), 0.5)), [0.5] * 3),
            r"argument `mean` must be a dense real tensor",
        ),
    ],
)
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_tensors_are_refused_naming_the_argument(call, match):
    with pytest.raises(TypeError, match=match):
        call()


def test_dense_tensors_still_taken():
    x, w, y = _ce_inputs()
    ops.ce_shard_stats(x, w, y, target_ref=torch.zeros(3))
    e = torch.zeros(3)
    ops.ema_update_([e], [torch.ones(3)], 0.5)
    ops.ema_update_device_decay_([e], [torch.ones(3)], _D64)
    assert torch.allclose(e, torch.full((3,), 0.75))
    pieces = ops.split_to_devices([x], torch.tensor([1, 2]), ["cpu", "cpu"])
    assert [p[0].shape[0] for p in pieces] == [1, 2]
    assert ops.partial_fc_sample(y, class_offset=0, num_local=6, num_sample=3)[0].numel() == 3


# ---- 3. loss weights ----


@pytest.mark.parametrize(
    "weight, error, match",
    [
        (torch.tensor(1 + 1j), TypeError, r"`weights` \(index 0\) must be a real \(not torch.complex64\)"),
        (torch.tensor(True), TypeError, r"`weights` \(index 0\) must be a real \(not torch.bool\)"),
        (10**400, ValueError, r"`weights` \(index 0\) must be finite, got an int too large for a float"),
        (-(10**400), ValueError, r"`weights` \(index 0\) must be finite"),
    ],
    ids=["complex", "bool", "10**400", "-10**400"],
)
def test_weighted_loss_reduce_weights_named(weight, error, match):
    with pytest.raises(error, match=match):
        ops.weighted_loss_reduce([torch.tensor(1.0)], [weight], "cpu")


def test_weighted_loss_reduce_real_weights_unchanged():
    losses = [torch.tensor(1.0), torch.tensor(3.0)]
    assert ops.weighted_loss_reduce(losses, [torch.tensor(1), 3], "cpu").item() == pytest.approx(2.5)
    assert ops.weighted_loss_reduce(losses, [torch.tensor([1.0]), 10**300], "cpu").item() == pytest.approx(3.0)


# ---- 4. per-channel mean / std ----


@pytest.mark.parametrize(
    "mean, std, name, kind",
    [
        ({0.5: 1, 0.25: 2, 0.125: 3}, [0.5] * 3, "mean", "dict"),  # was taken for its keys
        ({"r": 0.5, "g": 0.5, "b": 0.5}, [0.5] * 3, "mean", "dict"),  # was "got str 'r'"
        ([0.5] * 3, {0.5, 0.25, 0.125}, "std", "set"),  # no order
        ([0.5] * 3, frozenset({0.5}), "std", "frozenset"),
        ([0.5] * 3, b"abc", "std", "bytes"),
    ],
)
def test_normalize_images_mean_std_must_be_sequences(mean, std, name, kind):
    with pytest.raises(TypeError, match=rf"argument `{name}` must be a sequence of numbers, got {kind} "):
        ops.normalize_images(_IMG, mean, std)


@pytest.mark.parametrize("bad", [torch.tensor([0.5 + 1j] * 3), torch.tensor([True] * 3)])
def test_normalize_images_complex_or_bool_tensor_refused(bad):
    with pytest.raises(TypeError, match=r"argument `mean` must be a dense real tensor"):
        ops.normalize_images(_IMG, bad, [0.5] * 3)


def test_normalize_images_sequences_and_tensors_still_taken():
    ref = ops.normalize_images(_IMG, [0.5] * 3, [0.5] * 3)
    for mean, std in [((0.5,) * 3, torch.full((3,), 0.5)), (torch.full((3,), 0.5), (0.5 for _ in range(3)))]:
        assert torch.equal(ops.normalize_images(_IMG, mean, std), ref)
