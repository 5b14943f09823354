"""ShardedSoftmaxLoss(process_group=...) on gloo with 1 to 4 spawned CPU processes.

Spawning is slow, so one job per world size runs every scenario (softmax_dist_scenarios.SCENARIOS)
and each rank saves its results; the tests below compare them with the single-process
float64 full-logit reference (see softmax_dist_scenarios.py), and check input errors, constructor
errors, re-sharded checkpoints and the failing-rank path. NCCL on GPUs:
test_softmax_distributed_nccl.py."""

import copy
import math
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_teardown import end_rank
from softmax_dist_scenarios import (
    IGNORE,
    KEPT,
    SCENARIOS,
    UNCHECKED_CLASSES,
    WORLDS,
    D,
    check_against_reference,
    make_data,
    margins,
    rel,
    run_scenario,
    unchecked_inputs,
)
from softmax_reference import margin_kwargs, reference_unowned_targets

import shardkit
from shardkit.distributed import CollectiveError, DistributedInputError, class_offsets, split_classes

TIMEOUT_S = 4.0


def _checkpoints(rank, data, tmp, groups):
    """Every world size saves; every other loads that (N -> M) and saves again; N loads the
    re-saved one (N -> M -> N). Members of each subgroup act, all ranks meet at barriers."""
    out = {}

    def head(world):
        return shardkit.ShardedSoftmaxLoss(D, 13, process_group=groups[world])

    for world in WORLDS:
        if rank < world:
            h = head(world)
            shardkit.import_full_weight(h, data["ckpt"])
            out[f"full_weight_{world}"] = torch.equal(h.full_weight(), data["ckpt"])
            shardkit.save_sharded(h, os.path.join(tmp, f"ckpt_{world}"))
    dist.barrier()
    for world in WORLDS:
        for n in WORLDS:
            if n != world and rank < world:
                h = head(world)
                shardkit.load_sharded(h, os.path.join(tmp, f"ckpt_{n}"))
                out[f"load_{n}_{world}"] = torch.equal(h.full_weight(), data["ckpt"])
                shardkit.save_sharded(h, os.path.join(tmp, f"ckpt_{n}_{world}"))
    dist.barrier()
    for n in WORLDS:
        for m in WORLDS:
            if m != n and rank < n:
                h = head(n)
                shardkit.load_sharded(h, os.path.join(tmp, f"ckpt_{n}_{m}"))
                out[f"load_{n}_{m}_{n}"] = torch.equal(h.full_weight(), data["ckpt"])
    return out


def _bad_input(rank, world, group):
    head = shardkit.ShardedSoftmaxLoss(D, 11, process_group=group)
    labels = torch.randint(0, 11, (3,))
    if rank == world - 1:
        labels[1] = 11  # out of range on the last rank only
    t0 = time.time()
    out = {}
    try:
        head(torch.randn(3, D), labels)
        out["raised"] = None
    except DistributedInputError as err:
        out.update(raised=str(err), seconds=time.time() - t0)
    # Integer embeddings on the last rank, float ones that need a gradient on the others: the
    # others name that rank's invalid input, not the mode (gradient) mismatch it also makes.
    x = torch.randn(3, D, requires_grad=True) if rank != world - 1 else torch.randint(0, 5, (3, D))
    try:
        head(x, labels.clamp(max=10))
        out["raised_int"] = None
    except DistributedInputError as err:
        out["raised_int"] = str(err)
    # An empty batch on the last rank with labels of another length: checked against a one-row
    # stand-in, it passed there and failed later on that rank alone (the others waited).
    x, y = (torch.randn(0, D), torch.zeros(3, dtype=torch.long)) if rank == world - 1 else (torch.randn(3, D), labels)
    t0 = time.time()
    try:
        head(x, y.clamp(max=10))
        out["raised_empty"] = None
    except DistributedInputError as err:
        out.update(raised_empty=str(err), seconds_empty=time.time() - t0)
    # NaN embeddings on the last rank: every rank's error is also a NonFiniteEmbeddingsError
    # (what a training loop catches as divergence in the one-process mode).
    x = torch.randn(3, D)
    if rank == world - 1:
        x[1, 0] = float("nan")
    try:
        head(x, labels.clamp(max=10))
        out["raised_nan"] = None
    except shardkit.NonFiniteEmbeddingsError as err:
        out["raised_nan"] = f"{type(err).__name__}: {err}"
    # One rank under torch.autocast: the same embeddings, another compute dtype there
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=rank == world - 1):
            head(torch.randn(3, D), labels.clamp(max=10))
        out["raised_autocast"] = None
    except DistributedInputError as err:
        out["raised_autocast"] = str(err)
    return out


def _async_bad_label(rank, group):
    """check_inputs="async" on the CPU, a label out of range on rank 1 only: with no device to
    sync with, the check runs at once and every rank raises (rank 0 once waited in the size
    exchange until the group's timeout, as "async" ranks on CUDA still do)."""
    head = shardkit.ShardedSoftmaxLoss(D, 11, process_group=group, check_inputs="async")
    labels = torch.randint(0, 11, (3,))
    if rank == 1:
        labels[2] = 11
    t0 = time.time()
    try:
        head(torch.randn(3, D), labels)
        return {"error": None}
    except (RuntimeError, ValueError) as err:
        return {"error": err, "seconds": time.time() - t0}


def _constructor_errors(rank, groups):
    """Messages of the constructor errors that need an initialized process group."""
    out = {}
    for key, kwargs in (
        ("layout", dict(process_group=groups[4], input_layout="bogus")),
        ("member", dict(process_group=groups[1])),
        ("sizes", dict(process_group=groups[4], shard_sizes=[5, 6])),
        ("devices", dict(process_group=groups[4], devices=["cpu", "cpu"])),
    ):
        if key == "member" and rank == 0:
            continue
        try:
            shardkit.ShardedSoftmaxLoss(D, 11, **kwargs)
            out[key] = None
        except ValueError as err:
            out[key] = str(err)
    # One shard per rank: a list of generators (the one-process mode's form) is refused when
    # set, on this rank alone (no collective waits on it).
    head = shardkit.ShardedSoftmaxLoss(D, 11, process_group=groups[4], sample_rate=0.5)
    try:
        head.sample_generator = [torch.Generator()]
        out["generators"] = None
    except TypeError as err:
        out["generators"] = str(err)
    head.sample_generator = torch.Generator()  # one generator is what this mode takes
    return out


# Head arguments that ranks 0 and 1 disagree on: (field, kwargs of rank 0, kwargs of rank 1).
_MISMATCHES = (
    ("num_classes", dict(num_classes=11), dict(num_classes=12)),
    ("embedding_dim", dict(embedding_dim=D), dict(embedding_dim=D + 1)),
    ("margin", dict(margin=shardkit.ArcFace(16.0, 0.3)), dict(margin=shardkit.CosFace(16.0, 0.3))),
    ("dtype", dict(dtype=torch.float32), dict(dtype=torch.float64)),
    ("sample_rate", dict(sample_rate=1.0), dict(sample_rate=0.5)),
    ("ignore_index", dict(), dict(ignore_index=-1)),
    ("label_smoothing", dict(), dict(label_smoothing=0.1)),
    ("reduction", dict(), dict(reduction="sum")),
)


def _mismatched_heads(rank, group):
    """Ranks 0 and 1 build heads that differ in one argument: both must raise at construction."""
    out = {}
    for field, kw0, kw1 in _MISMATCHES:
        kwargs = dict(embedding_dim=D, num_classes=11)
        kwargs.update(kw0 if rank == 0 else kw1)
        try:
            shardkit.ShardedSoftmaxLoss(
                kwargs.pop("embedding_dim"), kwargs.pop("num_classes"), process_group=group, **kwargs
            )
            out[field] = None
        except DistributedInputError as err:
            out[field] = str(err)
    return out


def _mismatched_modes(rank, group):
    """Per-step modes that differ between ranks 0 and 1: every rank raises at once."""
    out = {}
    head = shardkit.ShardedSoftmaxLoss(D, 11, process_group=group, sample_rate=0.5)
    x, y = torch.randn(3, D), torch.randint(0, 11, (3,))
    for case in ("details", "train_eval", "grad"):
        head.train(not (case == "train_eval" and rank == 1))
        t0 = time.time()
        try:
            xc = x.clone().requires_grad_(case == "grad" and rank == 0)  # rank 1 would skip a reduce-scatter
            out_c = head(xc, y, return_details=case == "details" and rank == 0)
            if case == "grad":
                (out_c if isinstance(out_c, torch.Tensor) else out_c[0]).backward()
            out[case] = None
        except DistributedInputError as err:
            out[case] = str(err)
        out[case + "_seconds"] = time.time() - t0
    head.train()
    out.update(_one_rank_differs(rank, head, x, y))
    out["after"] = float(head(x, y, return_details=True)[0].detach())  # the head still works
    xr = x.clone().requires_grad_()
    try:  # a gradient penalty through the distributed head: refused on every rank, no stall
        torch.autograd.grad(head(xr, y), xr, create_graph=True)
        out["double"] = None
    except RuntimeError as err:
        out["double"] = str(err)
    return out


def _one_rank_differs(rank, head, x, y):
    """Rank 1 alone passes a bad forward argument, sets a bad or another option after
    construction, or calls the heads in another order: every rank raises at once."""
    other = shardkit.ShardedSoftmaxLoss(D, 11, process_group=head._mode.ctx.group)
    saved = {k: getattr(head, k) for k in ("label_smoothing", "margin", "reduction", "ignore_index")}
    cases = {
        "topk": lambda: head(x, y, return_details=True, topk=50 if rank == 1 else 2),
        "details_arg": lambda: head(x, y, return_details="yes" if rank == 1 else False),
        "bad_reduction": lambda: setattr(head, "reduction", "avg" if rank == 1 else "mean"),
        "smoothing": lambda: setattr(head, "label_smoothing", 0.25 if rank == 1 else 0.0),
        "margin": lambda: setattr(head, "margin", shardkit.CosFace() if rank == 1 else None),
        "ignore": lambda: setattr(head, "ignore_index", 3 if rank == 1 else -100),
        "order": lambda: (other if rank == 1 else head)(x, y),
    }
    out = {}
    for case, step in cases.items():
        t0 = time.time()
        try:
            result = step()
            if result is None:  # an option was set: the next step meets it
                head(x, y)
            out[case] = None
        except DistributedInputError as err:
            out[case] = str(err)
        out[case + "_seconds"] = time.time() - t0
        for k, v in saved.items():
            setattr(head, k, v)
    # the same option changed alike on every rank is fine, as is the other head in the same order
    head.label_smoothing = 0.25
    out["alike"] = float(head(x, y).detach()) + float(other(x, y).detach())
    head.label_smoothing = saved["label_smoothing"]
    return out


def _copies(rank, group):
    """A deep copy (ModelEMA's EMA of the head) shares the head's group; a pickled head loads
    and holds its shard, and says why it cannot run when called."""
    out = {}
    head = shardkit.ShardedSoftmaxLoss(D, 11, process_group=group)
    x, y = torch.randn(3, D), torch.randint(0, 11, (3,))
    ema = shardkit.ModelEMA(head, decay=0.5, tau=None)
    with torch.no_grad():
        head.weight_shards[0].mul_(3.0)
    ema.update(head, step=10)  # decay 0.5 (timm's first steps copy)
    expected = head.weight_shards[0].detach() * (0.5 + 0.5 / 3.0)
    out["ema_weight"] = bool(torch.allclose(ema.module.weight_shards[0], expected, rtol=1e-6, atol=1e-7))
    out["ema_loss"] = float(ema.module(x, y).detach())  # runs in the head's group, on every rank
    copied = copy.deepcopy(head)
    out["copy_equal"] = float(copied(x, y).detach()) == float(head(x, y).detach())
    loaded = pickle.loads(pickle.dumps(head))
    out["pickled_shard"] = all(
        torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), head.state_dict().values())
    )
    # save_sharded with an optimizer state refused on rank 1 only: every rank raises at once,
    # none writes (rank 0 used to write and return, rank 1 raised; ids then came apart)
    opt = shardkit.SparseRowSGD(head.parameters(), lr=0.1, momentum=0.9)
    if rank == 1:
        opt.state[head.weight_shards[0]]["momentum_buffer"] = torch.zeros(1, 1)
    directory = os.path.join(tempfile.gettempdir(), f"shardkit_dist_save_{os.getppid()}")
    t0 = time.time()
    try:
        shardkit.save_sharded(head, directory, opt)
        out["bad_save"] = None
    except (TypeError, ValueError) as err:
        out["bad_save"] = f"{type(err).__name__}: {err}"
    out["bad_save_seconds"] = time.time() - t0
    out["bad_save_wrote"] = os.path.isdir(directory) and len(os.listdir(directory)) > 0
    if rank == 0:  # a tagged save runs no collective (one rank alone, e.g. a background thread)
        t0 = time.time()
        shardkit.save_sharded(head, directory + "_tagged", tag=5)
        out["tagged_alone_seconds"] = time.time() - t0
    with torch.device("meta"):  # an ambient device context: the host-side exchanges stay on the CPU
        ambient = shardkit.ShardedSoftmaxLoss(D, 11, process_group=group)
    out["ambient"] = (str(ambient.weight_shards[0].device), math.isfinite(float(ambient(x, y).detach())))
    try:
        loaded(x, y)
        out["pickled_call"] = None
    except RuntimeError as err:
        out["pickled_call"] = str(err)
    return out


def _failing_rank(rank, group):
    """Rank 1 of a 3-rank group "raises" in user code and never reaches the loss."""
    out = {}
    head = shardkit.ShardedSoftmaxLoss(D, 11, process_group=group)
    if rank == 1:
        out["raised"] = "user error"
        time.sleep(TIMEOUT_S + 3)
        return out
    t0 = time.time()
    try:
        head(torch.randn(2, D), torch.randint(0, 11, (2,)))
        out["error"] = None
    except CollectiveError as err:
        out["error"] = str(err)
    out["seconds"] = time.time() - t0
    return out


_SUBGROUP = (1, 2)


def _subgroup_batch():
    gen = torch.Generator().manual_seed(7)
    return torch.randn(5, D, generator=gen), torch.randint(0, 13, (5,), generator=gen)


def _subgroup_head(rank, data):
    """A head on a subgroup made with a backend string ("cpu:gloo", as "cpu:gloo,cuda:nccl"
    on GPUs) that only its members construct (rank 1 brings 2 rows of the batch, rank 2 the
    other 3); then a new group of the whole job still forms (no group-count drift)."""
    group = dist.new_group(list(_SUBGROUP), backend="cpu:gloo", timeout=timedelta(seconds=30))
    loss = None
    if rank in _SUBGROUP:
        head = shardkit.ShardedSoftmaxLoss(D, 13, process_group=group)
        shardkit.import_full_weight(head, data["ckpt"])
        x, y = _subgroup_batch()
        rows = slice(0, 2) if rank == _SUBGROUP[0] else slice(2, 5)
        loss = head(x[rows], y[rows]).detach()
    everyone = dist.new_group(list(range(max(WORLDS))), timeout=timedelta(seconds=30))
    count = torch.ones(1)
    dist.all_reduce(count, group=everyone)
    return {"loss": loss, "everyone": int(count)}


def _worker(rank, init_file, tmp):
    # One spawned job of 4 processes covers world sizes 1..4 through subgroups {0..W-1}
    # (spawning is the slow part); the failure scenario breaks its group, so it runs last.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=max(WORLDS), timeout=timedelta(seconds=300)
    )
    groups = {w: dist.new_group(list(range(w))) for w in WORLDS}
    fail_group = dist.new_group([0, 1, 2], timeout=timedelta(seconds=TIMEOUT_S))
    async_group = dist.new_group([0, 1], timeout=timedelta(seconds=TIMEOUT_S))
    data = torch.load(os.path.join(tmp, "data.pt"), weights_only=False)
    results = {}
    try:
        for world in WORLDS:
            if rank >= world:
                continue
            res = results[world] = {}
            for name in SCENARIOS:
                try:
                    res[name] = run_scenario(rank, world, name, data[(world, name)], groups[world])
                except Exception:
                    res[name] = traceback.format_exc()
            res["bad_input"] = _bad_input(rank, world, groups[world])
            try:
                res["unchecked"] = unchecked_inputs(rank, world, data[(world, "unchecked")], groups[world])
            except Exception:
                res["unchecked"] = traceback.format_exc()
        results["ctor_errors"] = _constructor_errors(rank, groups)
        if rank < 2:
            results["mismatch"] = _mismatched_heads(rank, groups[2])
            results["modes"] = _mismatched_modes(rank, groups[2])
            results["copies"] = _copies(rank, groups[2])
            results["async_bad"] = _async_bad_label(rank, async_group)
        dist.barrier()
        results["ckpt"] = _checkpoints(rank, data, tmp, groups)
        dist.barrier()
        results["subgroup"] = _subgroup_head(rank, data)
        if rank < 3:
            results["fail"] = _failing_rank(rank, fail_group)
    except Exception:
        results["fatal"] = traceback.format_exc()
    finally:
        torch.save(results, os.path.join(tmp, f"rank{rank}.pt"))
        # Tear down together, destroy every group and leave without running torch's
        # destructors: a process that exits with live gloo groups (one of them broken by the
        # failure scenario) could abort in them (see dist_teardown.py).
        end_rank()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dist"))
    # fresh data every run; SHARDKIT_TEST_DATA_SEED replays the seed a failure printed
    seed = int(os.environ.get("SHARDKIT_TEST_DATA_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"data seed {seed} (replay: SHARDKIT_TEST_DATA_SEED={seed})")
    data = make_data(seed)
    torch.save(data, os.path.join(tmp, "data.pt"))
    mp.spawn(_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=max(WORLDS), join=True)
    per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(max(WORLDS))]
    for r, res in enumerate(per_rank):
        assert "fatal" not in res, f"rank {r}: {res['fatal']}"
    results = {w: [per_rank[r][w] for r in range(w)] for w in WORLDS}
    return data, results, tmp, per_rank


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [n for n in SCENARIOS if SCENARIOS[n][5] == 1.0])
def test_loss_and_gradients_match_reference(runs, world, name):
    data, results, _, _ = runs
    per_rank, ref, labels, w, kwargs = check_against_reference(data, results, world, name)
    counted = labels != IGNORE.get(name, -100)
    for res in per_rank:
        assert res[name]["num_valid"] == int(counted.sum())
        if "one_process_correct" in res[name]:  # top-k counts: the same as the one-process mode's
            assert res[name]["correct"] == res[name]["one_process_correct"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["sampled_all64", "sampled64", "sampled64_ignore_class", "sampled64_kept"])
def test_sampling(runs, world, name):
    data, results, _, _ = runs
    per_rank, *_ = check_against_reference(data, results, world, name)
    _, _, _, _, _, rate, classes, _ = SCENARIOS[name]
    d = data[(world, name)]
    sizes = split_classes(classes, world)
    batch = sum(d["sizes"])
    for r, res in enumerate(per_rank):
        out = res[name]
        expected = min(sizes[r], max(math.ceil(rate * sizes[r]), min(batch, sizes[r])))
        assert out["rows0"].numel() == out["rows1"].numel() == expected  # the rate, per rank
        assert out["untouched_ok0"] and out["untouched_ok1"]  # bit-exact after momentum + wd steps
        if name == "sampled_all64":
            assert out["rows0"].numel() == sizes[r]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(KEPT))
def test_budgets_keep_logits_on_every_rank(runs, world, name):
    # the scenarios' results match the reference above; here: each rank ran the kept path
    _, results, _, _ = runs
    for r in range(world):
        assert "ce_shard_stats_keep" in results[world][r][name]["ops"], (r, results[world][r][name]["ops"])


@pytest.mark.parametrize("world", WORLDS)
def test_bad_input_raises_on_every_rank(runs, world):
    _, results, _, _ = runs
    for r in range(world):
        msg = results[world][r]["bad_input"]["raised"]
        assert msg is not None
        msg_int = results[world][r]["bad_input"]["raised_int"]
        assert msg_int is not None
        assert "DistributedNonFiniteError" in (results[world][r]["bad_input"]["raised_nan"] or ""), r
        msg_empty = results[world][r]["bad_input"]["raised_empty"]
        msg_autocast = results[world][r]["bad_input"]["raised_autocast"]
        if world == 1:  # one rank alone under autocast: nothing differs
            assert msg_autocast is None
        else:
            dtypes = ", ".join(["'float32'"] * (world - 1) + ["'bfloat16'"])
            assert f"dtypes [{dtypes}]" in msg_autocast and "same autocast" in msg_autocast
        assert msg_empty is not None and results[world][r]["bad_input"]["seconds_empty"] < 10
        if r == world - 1:
            assert "argument `labels` has class ids >= num_classes=11" in msg
            assert "argument `embeddings` must be floating point" in msg_int
            assert "argument `labels` has shape [3] but `embeddings` has 0 rows" in msg_empty
        else:
            assert f"rank(s) [{world - 1}] got invalid input" in msg
            assert f"rank(s) [{world - 1}] got invalid input" in msg_int and "different modes" not in msg_int
            assert f"rank(s) [{world - 1}] got invalid input" in msg_empty


@pytest.mark.parametrize("world", WORLDS)
def test_unchecked_and_async_inputs_match_the_reference(runs, world):
    # check_inputs=False: labels no shard owns are targets in no shard on every rank's loss
    # and gradients; "async" (valid labels) leaves the results those of the reference.
    # export_full_weight gathers the class-ordered weight on every rank.
    data, results, _, _ = runs
    d = data[(world, "unchecked")]
    labels, sizes = d["labels"], d["sizes"]
    unowned = ((labels < 0) & (labels != -100)) | (labels >= UNCHECKED_CLASSES)
    assert unowned.any()
    shards = split_classes(UNCHECKED_CLASSES, world)
    offsets = class_offsets(shards)
    for mode, mode_labels in ((False, labels), ("async", labels.masked_fill(unowned, -100))):
        ref = reference_unowned_targets(d["x"], d["w"], mode_labels, **margin_kwargs(margins()["arc"]))
        for r in range(world):
            out = results[world][r]["unchecked"]
            assert isinstance(out, dict), f"rank {r}: {out}"
            start = sum(sizes[:r])
            assert rel(out[mode]["loss"], ref.loss) <= 1e-9, (mode, r)
            assert rel(out[mode]["grad_x"], world * ref.grad_x[start : start + sizes[r]]) <= 1e-9, (mode, r)
            assert rel(out[mode]["grad_w"], ref.grad_w[offsets[r] : offsets[r] + shards[r]]) <= 1e-9, (mode, r)
            assert torch.equal(out["exported"], d["w"])


def test_async_check_on_the_cpu_raises_on_every_rank_at_once(runs):
    per_rank = runs[3]
    bad, good = per_rank[1]["async_bad"], per_rank[0]["async_bad"]
    assert isinstance(bad["error"], DistributedInputError), bad["error"]
    assert "argument `labels` has class ids >= num_classes=11" in str(bad["error"])
    assert isinstance(good["error"], DistributedInputError), good["error"]
    assert "rank(s) [1] got invalid input" in str(good["error"])
    assert bad["seconds"] < TIMEOUT_S / 2 and good["seconds"] < TIMEOUT_S / 2


def test_checkpoints_reshard_across_world_sizes(runs):
    data, _, tmp, per_rank = runs
    for r, res in enumerate(per_rank):
        ck = res["ckpt"]
        assert ck and all(ck.values()), (r, ck)
    expected = {f"load_{n}_{m}_{n}" for n in WORLDS for m in WORLDS if m != n}
    assert expected <= set(per_rank[0]["ckpt"])  # rank 0 is in every group: every N -> M -> N
    # every world size's save, and every re-save, into the one-process mode (3 devices)
    for src in os.listdir(tmp):
        if src.startswith("ckpt_"):
            one = shardkit.ShardedSoftmaxLoss(D, 13, devices=["cpu"] * 3)
            shardkit.load_sharded(one, os.path.join(tmp, src))
            assert torch.equal(one.full_weight(), data["ckpt"]), src


def test_constructor_errors_with_a_process_group(runs):
    per_rank = runs[3]
    for rank, res in enumerate(per_rank):
        errs = res["ctor_errors"]
        assert "argument `input_layout` must be one of" in errs["layout"]
        assert "argument `shard_sizes` is not used with `process_group`" in errs["sizes"]
        assert "argument `devices` must name ONE device per rank" in errs["devices"]
        assert "`sample_generator` with a `process_group` must be None or one torch.Generator" in errs["generators"]
        if rank > 0:
            assert "argument `process_group` does not contain this process" in errs["member"]


@pytest.mark.parametrize("field", [m[0] for m in _MISMATCHES])
def test_heads_that_disagree_raise_on_every_rank(runs, field):
    per_rank = runs[3]
    for rank in (0, 1):
        msg = per_rank[rank]["mismatch"][field]
        assert msg is not None, (rank, field)
        assert f"ShardedSoftmaxLoss rank {rank}: the ranks of the process group built different heads" in msg
        assert f"`{field}` differs (rank 0: " in msg
    msg = per_rank[0]["mismatch"][field]
    expected = {
        "num_classes": "(rank 0: 11, rank 1: 12)",
        "embedding_dim": f"(rank 0: {D}, rank 1: {D + 1})",
        "dtype": "(rank 0: 'torch.float32', rank 1: 'torch.float64')",
        "sample_rate": "(rank 0: 1, rank 1: 0.5)",
        "ignore_index": "(rank 0: -100, rank 1: -1)",
        "label_smoothing": "(rank 0: 0, rank 1: 0.1)",
        "reduction": "(rank 0: 'mean', rank 1: 'sum')",
        "margin": "rank 0: (16.0, 1.0, 0.3, 0.0), rank 1: (16.0, 1.0, 0.0, 0.3)",
    }[field]
    assert expected in msg, msg


def test_ranks_in_different_modes_raise_at_once(runs):
    per_rank = runs[3]
    for rank in (0, 1):
        res = per_rank[rank]["modes"]
        assert "the ranks called the loss in different modes this step" in res["details"]
        assert "return_details [True, False]" in res["details"]
        assert "with_rank (topk details) [True, False]" in res["details"]
        assert "sample_rate (train vs eval) [0.5, 1.0]" in res["train_eval"]
        assert "embeddings need a gradient (grad mode and requires_grad) [True, False]" in res["grad"]
        assert max(res[f"{c}_seconds"] for c in ("details", "train_eval", "grad")) < TIMEOUT_S
        assert math.isfinite(res["after"])
        assert "shardkit.ce_shard_stats does not support double backward" in res["double"]


@pytest.mark.parametrize(
    "case, rank1_says",
    [
        ("topk", "argument `topk` (50,) holds a k larger than num_classes=11"),
        ("details_arg", "argument `return_details` must be a Python bool, got str 'yes'"),
        ("bad_reduction", "argument `reduction` must be one of"),
        ("smoothing", "`label_smoothing` differs (rank 0: 0, rank 1: 0.25)"),
        ("margin", "`margin` differs (rank 0: None, rank 1: (64.0, 1.0, 0.0, 0.4))"),
        ("ignore", "`ignore_index` differs (rank 0: -100, rank 1: 3)"),
        ("order", "the ranks called different heads this step"),
    ],
)
def test_one_rank_with_another_argument_option_or_head_raises_everywhere(runs, case, rank1_says):
    # Each used to leave rank 0 waiting until the timeout or give the ranks different losses.
    per_rank = runs[3]
    for rank in (0, 1):
        res = per_rank[rank]["modes"]
        msg = res[case]
        assert msg is not None, (rank, case)
        assert res[case + "_seconds"] < TIMEOUT_S, (rank, case)
        if rank == 1 or case in ("smoothing", "margin", "ignore", "order"):
            assert rank1_says in msg, (rank, msg)
        else:
            assert "rank(s) [1] got invalid input" in msg, msg
        assert math.isfinite(res["alike"])


def test_a_copy_shares_the_group_and_a_pickled_head_explains_itself(runs):
    # deepcopy / ModelEMA / pickle of the distributed head used to raise "cannot pickle
    # ProcessGroup"; a pickled head has its shard but no group to run in.
    per_rank = runs[3]
    losses = set()
    for rank in (0, 1):
        res = per_rank[rank]["copies"]
        assert res["ema_weight"] and res["copy_equal"] and res["pickled_shard"], res
        assert math.isfinite(res["ema_loss"])
        losses.add(res["ema_loss"])
        assert "was unpickled: its process group does not travel with it" in res["pickled_call"]
        assert res["ambient"] == ("cpu", True)  # was "Cannot copy out of meta tensor" at construction
        assert res["bad_save_seconds"] < TIMEOUT_S and not res["bad_save_wrote"], res
        assert rank == 1 or res["tagged_alone_seconds"] < TIMEOUT_S
        if rank == 1:
            assert "argument `optimizer`: the state of shard 0" in res["bad_save"], res["bad_save"]
        else:
            assert "DistributedInputError: save_sharded rank 0: rank(s) [1] refused" in res["bad_save"]
    assert len(losses) == 1  # the EMA's loss is the global batch's, the same on both ranks


def test_head_on_a_subgroup_built_by_its_members_alone(runs):
    data, per_rank = runs[0], runs[3]
    ref = shardkit.ShardedSoftmaxLoss(D, 13)
    shardkit.import_full_weight(ref, data["ckpt"])
    expected = ref(*_subgroup_batch()).detach()
    for r, res in enumerate(per_rank):
        assert res["subgroup"]["everyone"] == max(WORLDS)
        if r in _SUBGROUP:
            assert rel(res["subgroup"]["loss"], expected) <= 1e-6


def test_failing_rank_gives_clear_error_everywhere(runs):
    per_rank = runs[3]
    assert per_rank[1]["fail"]["raised"] == "user error"
    for r in (0, 2):
        res = per_rank[r]["fail"]
        assert res["error"] is not None
        assert f"ShardedSoftmaxLoss rank {r}/3: collective 'batch-size exchange' failed" in res["error"]
        assert "another rank may have raised" in res["error"]
        assert res["seconds"] < TIMEOUT_S + 10


def test_constructor_errors():
    with pytest.raises(ValueError, match="argument `sample_rate` must be in"):
        shardkit.ShardedSoftmaxLoss(4, 10, sample_rate=0.0)
    with pytest.raises(ValueError, match="argument `input_layout` needs `process_group`"):
        shardkit.ShardedSoftmaxLoss(4, 10, input_layout="replicated")
    with pytest.raises(RuntimeError, match="needs torch.distributed to be initialized"):
        shardkit.ShardedSoftmaxLoss(4, 10, process_group=object())


def test_default_shard_device_follows_the_group_backend(monkeypatch):
    """Without `devices`: the GPU for any group that runs CUDA tensors on NCCL, including
    init_process_group() without a backend ("undefined") and "cpu:gloo,cuda:nccl"; the
    group's bound device first; the CPU for gloo or without CUDA (checked without a GPU)."""
    from shardkit.softmax.distributed import default_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    group = SimpleNamespace(bound_device_id=None)
    for backend, expected in (
        ("nccl", "cuda:3"),
        ("undefined", "cuda:3"),
        ("cpu:gloo,cuda:nccl", "cuda:3"),
        ("gloo", "cpu"),
    ):
        monkeypatch.setattr(dist, "get_backend", lambda g, b=backend: dist.Backend(b))
        assert default_device(group) == torch.device(expected), backend
    monkeypatch.setattr(dist, "get_backend", lambda g: dist.Backend("nccl"))
    group.bound_device_id = torch.device("cuda", 1)
    assert default_device(group) == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device(group) == torch.device("cpu")


def test_embeddings_must_be_on_the_shard_device():
    # Checked before the size exchange, so every rank raises instead of one failing in the
    # first collective (NCCL takes no CPU tensor) while the others wait there.
    from shardkit.softmax.distributed import check_local_input

    x, y = torch.randn(3, D, device="meta"), torch.zeros(3, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="argument `embeddings` is on meta but this rank's weight shard is on cpu"):
        check_local_input(x, y, D, 11, -100, False, torch.device("cpu"))
