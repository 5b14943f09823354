"""ShardedSoftmaxLoss as a module: nn.Linear-compatible init, shard-agnostic checkpoints,
label dtypes, argument errors (each asserts its message), margin objects. The numerics
against the float64 reference are in test_softmax_loss.py."""

import copy
import io
import math
import pickle
import warnings

import pytest
import torch
from softmax_checks import LOSS_MARGINS as MARGINS
from softmax_checks import make_labels, rel
from softmax_reference import margin_kwargs, reference_unowned_targets

import shardkit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [3, 32, 37, 512])
def test_init_matches_nn_linear(dtype, dim):
    # bit for bit in every dtype (float64 used to differ by one rounding of the bound)
    torch.manual_seed(1234)
    linear = torch.nn.Linear(dim, 101, bias=False, dtype=dtype)
    torch.manual_seed(1234)
    loss_fn = shardkit.ShardedSoftmaxLoss(dim, 101, devices=["cpu"] * 4, dtype=dtype)
    assert torch.equal(loss_fn.full_weight(), linear.weight.detach())


@pytest.mark.parametrize("new_shards", [1, 3])
def test_state_dict_is_shard_agnostic(new_shards):
    saved = shardkit.ShardedSoftmaxLoss(6, 23, margin=MARGINS["arcface"], devices=["cpu"] * 4)
    state = saved.state_dict()
    assert list(state) == ["weight"] and state["weight"].shape == (23, 6)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded_state = torch.load(buffer, weights_only=True)
    loaded = shardkit.ShardedSoftmaxLoss(6, 23, margin=MARGINS["arcface"], devices=["cpu"] * new_shards)
    loaded.load_state_dict(loaded_state)
    assert torch.equal(loaded.full_weight(), saved.full_weight())
    x, y = torch.randn(5, 6), make_labels(5, 23)
    assert rel(loaded(x, y), saved(x, y)) <= 1e-6
    # Nested inside a model: the prefix is respected.
    model = torch.nn.ModuleDict({"head": loaded})
    assert list(model.state_dict()) == ["head.weight"]
    model.load_state_dict({"head.weight": state["weight"] * 2})
    assert torch.equal(loaded.full_weight(), saved.full_weight() * 2)
    with pytest.raises(RuntimeError, match=r"size mismatch for weight.*\[num_classes, embedding_dim\]"):
        loaded.load_state_dict({"weight": torch.randn(22, 6)})


def test_int32_labels_accepted():
    loss_fn = shardkit.ShardedSoftmaxLoss(4, 10, devices=["cpu"] * 2)
    x, y = torch.randn(5, 4), make_labels(5, 10)
    assert rel(loss_fn(x, y.int()), loss_fn(x, y)) == 0


def _bad(loss_fn, x, y, exc, match):
    with pytest.raises(exc, match=match):
        loss_fn(x, y)


def test_bad_inputs_name_the_argument():
    loss_fn = shardkit.ShardedSoftmaxLoss(4, 10, devices=["cpu"] * 2)
    x, y = torch.randn(5, 4), make_labels(5, 10)
    _bad(loss_fn, x, torch.tensor([0, 1, 10, 2, 3]), ValueError, r"`labels` has class ids >= num_classes=10")
    _bad(
        loss_fn,
        x,
        torch.tensor([0, 1, -3, 2, 3]),
        ValueError,
        r"`labels` has negative class ids other than ignore_index",
    )
    _bad(loss_fn, x, y.float(), TypeError, r"`labels` must be an integer tensor")
    _bad(loss_fn, x, y.bool(), TypeError, r"`labels` must be an integer tensor")
    _bad(loss_fn, x, y[:4], ValueError, r"`labels` must be 1-D with 5 entries")
    _bad(loss_fn, x, y[:, None], ValueError, r"`labels` must be 1-D with 5 entries")
    _bad(loss_fn, x[0], y, ValueError, r"`embeddings` must be 2-D")
    _bad(loss_fn, torch.randn(5, 3), y, ValueError, r"`embeddings` has dim 3, but this loss has embedding_dim=4")
    _bad(loss_fn, x.long(), y, TypeError, r"`embeddings` must be floating point")
    _bad(loss_fn, x[:0], y[:0], ValueError, r"`embeddings` is an empty batch")
    _bad(loss_fn, x, y.to("meta"), ValueError, r"`labels` is on meta but `embeddings` is on cpu")
    for value in (math.nan, math.inf, -math.inf):
        bad = x.clone()
        bad[2, 1] = value
        _bad(loss_fn, bad, y, ValueError, r"`embeddings` contains NaN or infinite values")
    # ignore_index itself passes, and may be any value.
    y2 = y.clone()
    y2[0] = -100
    loss_fn(x, y2)
    with pytest.raises(ValueError, match=r"`embeddings` has dim 3, but the weights have embedding dim 4"):
        shardkit.sharded_cross_entropy(torch.randn(5, 3), list(loss_fn.weight_shards), y)
    with pytest.raises(ValueError, match=r"`weight_shards\[1\]` has embedding dim 3"):
        shardkit.sharded_cross_entropy(x, [torch.randn(3, 4), torch.randn(2, 3)], y)
    with pytest.raises(TypeError, match=r"`margin` must be None or a shardkit margin"):
        shardkit.sharded_cross_entropy(x, [torch.randn(10, 4)], y, margin=0.5)


def test_check_inputs_modes():
    x, y = torch.randn(5, 4), make_labels(5, 10)
    x[0, 0] = math.nan
    quiet = shardkit.ShardedSoftmaxLoss(4, 10, check_inputs=False)
    assert torch.isnan(quiet(x, y))  # no check: NaN propagates
    eager = shardkit.ShardedSoftmaxLoss(4, 10, check_inputs="async")
    with pytest.raises(RuntimeError, match="non-finite `embeddings`"):
        eager(x, y)  # on the CPU, _assert_async raises at once


@pytest.mark.parametrize("margin", [None, "arcface"])
def test_unchecked_labels_outside_the_classes_are_targets_in_no_shard(margin):
    # check_inputs=False: a label >= C or negative (other than ignore_index) is owned by no
    # shard: its row's loss is the plain log-sum-exp and it counts in the mean; gradients too.
    m = None if margin is None else MARGINS[margin]
    head = shardkit.ShardedSoftmaxLoss(
        5, 11, margin=m, devices=["cpu"] * 3, shard_sizes=[4, 0, 7], dtype=torch.float64, check_inputs=False
    )
    x = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 11, (9,))
    y[1], y[4], y[6], y[7] = 11, 16, -7, -100
    loss = head(x, y)
    loss.backward()
    ref = reference_unowned_targets(x, head.full_weight(), y, **margin_kwargs(m))
    assert rel(loss.detach(), ref.loss) < 1e-10
    assert rel(x.grad, ref.grad_x) < 1e-10
    assert rel(torch.cat([p.grad for p in head.weight_shards]), ref.grad_w) < 1e-10
    with pytest.raises(ValueError, match="argument `labels` has negative class ids"):
        shardkit.ShardedSoftmaxLoss(5, 11, margin=m)(x, y)


def test_constructor_errors():
    with pytest.raises(ValueError, match=r"`shard_sizes` \[5, 4\] sums to 9, not num_classes=10"):
        shardkit.ShardedSoftmaxLoss(4, 10, devices=["cpu", "cpu"], shard_sizes=[5, 4])
    with pytest.raises(ValueError, match=r"`shard_sizes` has 3 entries for 2 devices"):
        shardkit.ShardedSoftmaxLoss(4, 10, devices=["cpu", "cpu"], shard_sizes=[5, 4, 1])
    with pytest.raises(ValueError, match=r"`num_classes` must be a positive int"):
        shardkit.ShardedSoftmaxLoss(4, 0)
    with pytest.raises(ValueError, match=r"`reduction` must be one of"):
        shardkit.ShardedSoftmaxLoss(4, 10, reduction="avg")
    with pytest.raises(ValueError, match=r"`label_smoothing` must be in \[0, 1\]"):
        shardkit.ShardedSoftmaxLoss(4, 10, label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"`chunk_memory` must look like"):
        shardkit.ShardedSoftmaxLoss(4, 10, chunk_memory="lots")
    with pytest.raises(ValueError, match=r"`check_inputs` must be True, False or 'async'"):
        shardkit.ShardedSoftmaxLoss(4, 10, check_inputs="sometimes")
    assert shardkit.ShardedSoftmaxLoss(4, 10, chunk_memory="1.5KiB").chunk_memory == 1536


def test_margin_objects():
    arc = shardkit.ArcFace(64, 0.5)
    assert arc.params() == (64.0, 1.0, 0.5, 0.0) and repr(arc) == "ArcFace(s=64.0, m=0.5)"
    assert shardkit.CosFace().params() == (64.0, 1.0, 0.0, 0.4)
    assert arc == shardkit.CombinedMargin(64, 1.0, 0.5, 0.0)
    assert hash(arc) == hash(shardkit.CombinedMargin(64, 1, 0.5, 0))
    assert pickle.loads(pickle.dumps(arc)) == arc and copy.deepcopy(arc) == arc
    assert abs(arc.c_max - math.cos(math.pi - 0.5)) < 1e-15 and shardkit.CosFace().c_max == -1.0
    with pytest.raises(AttributeError, match="immutable"):
        arc.scale = 3.0
    with pytest.raises(ValueError, match=r"ArcFace: argument `m` \(radians\) must be in \[0, pi\)"):
        shardkit.ArcFace(64, 4.0)
    with pytest.raises(ValueError, match=r"CosFace: argument `s` \(the scale\) must be > 0"):
        shardkit.CosFace(0.0, 0.4)
    with pytest.raises(ValueError, match=r"CosFace: argument `m` must be >= 0"):
        shardkit.CosFace(64, -0.1)
    with pytest.raises(ValueError, match=r"CombinedMargin: argument `m1` must be > 0"):
        shardkit.CombinedMargin(64, 0.0, 0.3, 0.2)
    with pytest.raises(ValueError, match=r"CombinedMargin: argument `m3` must be finite"):
        shardkit.CombinedMargin(64, 1.0, 0.3, math.inf)
    with pytest.raises(TypeError, match=r"ArcFace: argument `m` must be a real number"):
        shardkit.ArcFace(64, "0.5")


def test_unknown_device_names_the_argument():
    with pytest.raises(ValueError, match="argument `devices` must list devices"):
        shardkit.ShardedSoftmaxLoss(8, 11, devices=["gpu"])


def test_public_names_reachable_from_import_shardkit():
    # the README's `shardkit.plan.plan_memory(...)` after a plain `import shardkit`
    assert shardkit.plan.plan_memory(10, 4, 1, 2).devices[0].weights == 10 * 4 * 4
    with pytest.raises(shardkit.NonFiniteEmbeddingsError, match="argument `embeddings`"):
        shardkit.ShardedSoftmaxLoss(4, 10)(torch.full((2, 4), float("nan")), torch.tensor([1, 2]))
    assert isinstance(shardkit.ArcFace(), shardkit.Margin)
    for name in shardkit.__all__:
        assert getattr(shardkit, name) is not None, name


def test_public_forwards_have_their_own_docstrings():
    # help(X.forward) must not show nn.Module's generic "Define the computation ..." text
    classes = [
        shardkit.ShardedSoftmaxLoss,
        shardkit.Normalize,
        shardkit.parallel.DataParallelModel,
        shardkit.parallel.DataParallelCriterion,
        shardkit.parallel.PipelineModel,
    ]
    for cls in classes:
        assert cls.forward is not torch.nn.Module.forward, cls
        doc = cls.forward.__doc__ or ""
        assert doc.strip() and doc != torch.nn.Module.forward.__doc__, cls


def test_built_under_a_default_device_context_draws_the_documented_init():
    # The shards live where `devices` says (the CPU by default) and the init is drawn from the
    # CPU generator whatever the ambient default device: under `with torch.device("meta")` the
    # draw once came from a meta tensor (NotImplementedError: cannot copy out of meta tensor).
    torch.manual_seed(4)
    ref = shardkit.ShardedSoftmaxLoss(6, 13, devices=["cpu", "cpu"])
    torch.manual_seed(4)
    with torch.device("meta"):
        head = shardkit.ShardedSoftmaxLoss(6, 13, devices=["cpu", "cpu"])
    assert all(p.device.type == "cpu" for p in head.parameters())
    assert torch.equal(head.full_weight(), ref.full_weight())


def test_num_classes_and_embedding_dim_are_fixed():
    head = shardkit.ShardedSoftmaxLoss(6, 13)
    for name in ("num_classes", "embedding_dim"):
        with pytest.raises(AttributeError, match=f"`{name}` is fixed at construction"):
            setattr(head, name, 12)
    assert (head.num_classes, head.embedding_dim) == (13, 6)
    head.load_state_dict(head.state_dict())  # its own checkpoint still loads


@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
def test_vmap_over_the_loss():
    # torch.vmap runs the loss per sample (its fallback loops over the ops): equal to a loop; the
    # default check, which reads values on the host, is refused there with a clear error.
    torch.manual_seed(2)
    head = shardkit.ShardedSoftmaxLoss(4, 9, devices=["cpu", "cpu"], check_inputs=False)
    x, y = torch.randn(3, 5, 4, dtype=torch.float32), torch.randint(0, 9, (3, 5))
    torch.testing.assert_close(torch.vmap(head)(x, y), torch.stack([head(x[i], y[i]) for i in range(3)]))
    head.check_inputs = True
    with pytest.raises(ValueError, match="argument `check_inputs`=True reads the check's result on the host"):
        torch.vmap(head)(x, y)


def test_extra_repr_shows_the_options_off_their_defaults():
    plain = repr(shardkit.ShardedSoftmaxLoss(8, 100))
    for name in ("memory_budget", "sample_rate", "chunk_memory", "check_inputs", "topk"):
        assert f"{name}=" not in plain
    head = shardkit.ShardedSoftmaxLoss(
        8, 100, sample_rate=0.1, topk=3, check_inputs=False, chunk_memory="1MiB", memory_budget="1KiB"
    )
    text = repr(head)
    for part in ("memory_budget=1024", "sample_rate=0.1", "chunk_memory=1048576", "check_inputs=False", "topk=(3,)"):
        assert part in text, (part, text)
    assert "topk=" not in repr(shardkit.ShardedSoftmaxLoss(8, 3))  # the default (1, 5) trimmed to (1,)


def test_built_before_init_process_group_under_a_launcher_warns(monkeypatch):
    # `process_group=dist.group.WORLD` is None before init_process_group: under torchrun the
    # head silently became a whole head on every rank, each with its own loss.
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.warns(UserWarning, match="before torch.distributed.init_process_group"):
        shardkit.ShardedSoftmaxLoss(8, 10)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shardkit.ShardedSoftmaxLoss(8, 10)


def test_sample_rate_reaches_attribute_copiers_and_old_pickles():
    # The rate is a property (a constant to torch.compile); ModelEMA.update_attr (and
    # ultralytics' copy_attr), which copy __dict__'s public entries, still carry it over, and a
    # head pickled while it was a plain attribute keeps its rate.
    head = shardkit.ShardedSoftmaxLoss(4, 30, sample_rate=0.5)
    ema = shardkit.ModelEMA(head)
    head.sample_rate = 0.25
    ema.update_attr(head)
    assert ema.module.sample_rate == 0.25
    old = shardkit.ShardedSoftmaxLoss(4, 30, sample_rate=0.5)
    for key in ("_sample_rate_text", "_sample_rate_value"):
        del old.__dict__[key]
    old.__dict__["sample_rate"] = 0.125
    revived = pickle.loads(pickle.dumps(old))
    assert revived.sample_rate == 0.125
    revived.sample_rate = 0.75
    assert revived.sample_rate == 0.75 and revived.__dict__["sample_rate"] == 0.75
