"""ShardedSoftmaxLoss(process_group=...) on gloo with 1 to 4 spawned CPU processes.

Spawning is slow, so one job per world size runs every scenario (see _SCENARIOS) and each
rank saves its results; the tests below compare them with the single-process float64
full-logit reference (tests/sce_reference.py) under the documented semantics: every rank
returns the global batch's loss, head gradients are exact, rank r's embedding gradient is
world_size * dL/dX_r (data-parallel layout) or dL/dX (replicated layout)."""

import math
import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sce_reference import margin_kwargs, reference_loss_and_grads, reference_lse

import shardkit
from shardkit.distributed import CollectiveError, DistributedInputError, class_offsets, split_classes

WORLDS = (1, 2, 3, 4)
D = 7
TIMEOUT_S = 4.0


def _margins():
    return {"plain": None, "arc": shardkit.ArcFace(s=16.0, m=0.5), "cos": shardkit.CosFace(s=16.0, m=0.3),
            "combined": shardkit.CombinedMargin(s=12.0, m1=1.0, m2=0.3, m3=0.1)}


# name: (margin, dtype, reduction, smoothing, layout, sample_rate, num_classes, sizes(world))
_SCENARIOS = {
    "plain64_mean": ("plain", torch.float64, "mean", 0.0, "data_parallel", 1.0, 23, lambda w: [5, 2, 7, 3][:w]),
    "arc64_smooth_sum": ("arc", torch.float64, "sum", 0.1, "data_parallel", 1.0, 29, lambda w: [4, 6, 1, 5][:w]),
    "cos32_none": ("cos", torch.float32, "none", 0.0, "data_parallel", 1.0, 31, lambda w: [3, 8, 2, 4][:w]),
    "combined64_empty_rank": ("combined", torch.float64, "mean", 0.05, "data_parallel", 1.0, 19,
                              lambda w: [0, 5, 3, 6][:w] if w > 1 else [4]),
    "replicated64": ("arc", torch.float64, "mean", 0.1, "replicated", 1.0, 17, lambda w: [9] * w),
    "sampled_all64": ("cos", torch.float64, "mean", 0.1, "data_parallel", 0.9999, 21, lambda w: [3, 2, 4, 1][:w]),
    "sampled64": ("arc", torch.float64, "mean", 0.1, "data_parallel", 0.3, 97, lambda w: [3, 2, 4, 1][:w]),
    "ignore_class64": ("arc", torch.float64, "mean", 0.1, "data_parallel", 1.0, 15, lambda w: [4, 3, 5, 2][:w]),
    "sampled64_ignore_class": ("cos", torch.float64, "sum", 0.1, "data_parallel", 0.5, 40,
                               lambda w: [4, 3, 5, 2][:w]),
}
# ignore_index per scenario (default -100); 3 is also a class id: such rows get no target
_IGNORE = {"ignore_class64": 3, "sampled64_ignore_class": 3}


def _make_data(seed):
    gen = torch.Generator().manual_seed(seed)
    data = {}
    for world in WORLDS:
        for name, (_, _, _, _, layout, _, classes, sizes_fn) in _SCENARIOS.items():
            sizes = sizes_fn(world)
            batch = sizes[0] if layout == "replicated" else sum(sizes)
            labels = torch.randint(0, classes, (batch,), generator=gen)
            labels[torch.rand(batch, generator=gen) < 0.15] = _IGNORE.get(name, -100)
            labels[0] = max(int(labels[0]), 0)  # at least one counted row
            data[(world, name)] = dict(
                x=torch.randn(batch, D, generator=gen, dtype=torch.float64),
                w=torch.randn(classes, D, generator=gen, dtype=torch.float64) * 0.5,
                labels=labels, sizes=sizes, grad_out=torch.rand(batch, generator=gen, dtype=torch.float64))
    data["ckpt"] = torch.randn(13, D, generator=gen)
    return data


def _run_scenario(rank, world, name, d, group, device=torch.device("cpu"), sample_rate=None):
    margin_name, dtype, reduction, eps, layout, rate, classes, _ = _SCENARIOS[name]
    rate = rate if sample_rate is None else sample_rate
    head = shardkit.ShardedSoftmaxLoss(D, classes, margin=_margins()[margin_name], label_smoothing=eps,
                                       ignore_index=_IGNORE.get(name, -100),
                                       reduction=reduction, dtype=dtype, process_group=group,
                                       input_layout=layout, sample_rate=rate, devices=[device])
    shardkit.import_full_weight(head, d["w"].to(dtype))
    sizes = d["sizes"]
    start = sum(sizes[:rank]) if layout == "data_parallel" else 0
    size = sizes[rank]
    x = d["x"][start:start + size].to(device=device, dtype=dtype)
    if dtype == torch.float32:
        x = x.t().contiguous().t()  # non-contiguous embeddings
    x.requires_grad_(True)
    opt = shardkit.SparseRowSGD(head.parameters(), lr=0.5, momentum=0.9, weight_decay=0.01)
    out = {}
    for step in range(2 if rate < 1.0 else 1):  # two steps: the momentum buffer exists on step 2
        head.zero_grad(set_to_none=True)
        x.grad = None
        details = head(x, d["labels"][start:start + size].to(device), return_details=True, topk=(1, 3))
        details.loss.backward(d["grad_out"].to(device, details.loss.dtype) if reduction == "none" else None)
        grad_w = head.weight_shards[0].grad
        before = head.weight_shards[0].detach().clone()
        buf = opt.state[head.weight_shards[0]].get("momentum_buffer")
        buf = None if buf is None else buf.clone()
        opt.step()
        if grad_w.is_sparse:
            rows = grad_w.coalesce().indices()[0].cpu()
            out[f"rows{step}"] = rows + head.class_offsets[0]
            untouched = torch.ones(before.shape[0], dtype=torch.bool)
            untouched[rows] = False
            after = head.weight_shards[0].detach().cpu()
            out[f"untouched_ok{step}"] = torch.equal(after[untouched], before.cpu()[untouched]) and (
                buf is None or torch.equal(opt.state[head.weight_shards[0]]["momentum_buffer"].cpu()[untouched],
                                           buf.cpu()[untouched]))
            grad_w = grad_w.to_dense()
        if step == 0:
            out.update(loss=details.loss.detach().cpu(), grad_x=x.grad.cpu(), grad_w=grad_w.cpu(),
                       correct={k: int(v) for k, v in details.correct.items()}, num_valid=int(details.num_valid),
                       lse=details.lse.detach().cpu())
            if rate == 1.0 and layout == "data_parallel":
                # the one-process head on the global batch: the top-k counts must be the same
                one = shardkit.ShardedSoftmaxLoss(D, classes, margin=_margins()[margin_name], dtype=dtype,
                                                  ignore_index=_IGNORE.get(name, -100),
                                                  devices=["cpu"] * 2)
                shardkit.import_full_weight(one, d["w"].to(dtype))
                ref = one(d["x"].to(dtype), d["labels"], return_details=True, topk=(1, 3))
                out["one_process_correct"] = {k: int(v) for k, v in ref.correct.items()}
    return out


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
    try:
        head(torch.randn(3, D), labels)
        return {"raised": None}
    except DistributedInputError as err:
        return {"raised": str(err), "seconds": time.time() - t0}


def _constructor_errors(rank, groups):
    """Messages of the constructor errors that need an initialized process group."""
    out = {}
    for key, kwargs in (("layout", dict(process_group=groups[4], input_layout="bogus")),
                        ("member", dict(process_group=groups[1])),
                        ("sizes", dict(process_group=groups[4], shard_sizes=[5, 6])),
                        ("devices", dict(process_group=groups[4], devices=["cpu", "cpu"]))):
        if key == "member" and rank == 0:
            continue
        try:
            shardkit.ShardedSoftmaxLoss(D, 11, **kwargs)
            out[key] = None
        except ValueError as err:
            out[key] = str(err)
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


def _worker(rank, init_file, tmp):
    # One spawned job of 4 processes covers world sizes 1..4 through subgroups {0..W-1}
    # (spawning is the slow part); the failure scenario breaks its group, so it runs last.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=max(WORLDS),
                            timeout=timedelta(seconds=300))
    groups = {w: dist.new_group(list(range(w))) for w in WORLDS}
    fail_group = dist.new_group([0, 1, 2], timeout=timedelta(seconds=TIMEOUT_S))
    data = torch.load(os.path.join(tmp, "data.pt"), weights_only=False)
    results = {}
    try:
        for world in WORLDS:
            if rank >= world:
                continue
            res = results[world] = {}
            for name in _SCENARIOS:
                try:
                    res[name] = _run_scenario(rank, world, name, data[(world, name)], groups[world])
                except Exception:
                    res[name] = traceback.format_exc()
            res["bad_input"] = _bad_input(rank, world, groups[world])
        results["ctor_errors"] = _constructor_errors(rank, groups)
        dist.barrier()
        results["ckpt"] = _checkpoints(rank, data, tmp, groups)
        dist.barrier()
        if rank < 3:
            results["fail"] = _failing_rank(rank, fail_group)
    except Exception:
        results["fatal"] = traceback.format_exc()
    finally:
        torch.save(results, os.path.join(tmp, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dist"))
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"data seed {seed}")
    data = _make_data(seed)
    torch.save(data, os.path.join(tmp, "data.pt"))
    mp.spawn(_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=max(WORLDS), join=True)
    per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(max(WORLDS))]
    for r, res in enumerate(per_rank):
        assert "fatal" not in res, f"rank {r}: {res['fatal']}"
    results = {w: [per_rank[r][w] for r in range(w)] for w in WORLDS}
    return data, results, tmp, per_rank


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _check_against_reference(data, results, world, name, sample_rate=None):
    margin_name, dtype, reduction, eps, layout, rate, classes, _ = _SCENARIOS[name]
    rate = rate if sample_rate is None else sample_rate
    d = data[(world, name)]
    tol = 1e-6 if dtype == torch.float64 else 2e-5
    per_rank = results[world]
    for r, res in enumerate(per_rank):
        assert isinstance(res[name], dict), f"rank {r}: {res[name]}"
    kwargs = margin_kwargs(_margins()[margin_name])
    x, w, labels = d["x"], d["w"], d["labels"]
    ignore = _IGNORE.get(name, -100)
    if rate < 1.0:  # reference over the sampled classes: every rank's rows, in class order
        used = torch.cat([res[name]["rows0"] for res in per_rank])
        assert torch.all(used[1:] > used[:-1])
        remap = torch.full((classes,), -1, dtype=torch.int64)
        remap[used] = torch.arange(used.numel())
        counted = labels != ignore
        assert torch.all(remap[labels[counted]] >= 0), "a positive class was not sampled"
        # ignored rows: -100 in the sampled class space (3 may be a sampled position there)
        labels, ignore = torch.where(counted, remap[labels.clamp_min(0)], -100), -100
        w = w[used]
    g = d["grad_out"] if reduction == "none" else None
    ref = reference_loss_and_grads(x, w, labels, grad_out=g, label_smoothing=eps, reduction=reduction,
                                   ignore_index=ignore, **kwargs)
    # per-row lse of the global batch (ignored rows too, without a margin)
    lse_ref = reference_lse(x, w, torch.where(labels == ignore, -1, labels), **kwargs)
    sizes, offs = d["sizes"], class_offsets(split_classes(classes, world))
    start = 0
    for r, res in enumerate(per_rank):
        out = res[name]
        assert _rel(out["loss"], ref.loss) <= tol, (r, out["loss"], ref.loss)
        assert _rel(out["lse"], lse_ref) <= tol, (r, "lse")
        if layout == "replicated":
            gx_ref = ref.grad_x
        else:
            gx_ref = world * ref.grad_x[start:start + sizes[r]]
            start += sizes[r]
        if gx_ref.numel():
            assert _rel(out["grad_x"], gx_ref) <= tol, (r, "grad_x")
        shard = split_classes(classes, world)[r]
        if rate < 1.0:
            gw_ref = torch.zeros(shard, D, dtype=torch.float64)
            mine = (used >= offs[r]) & (used < offs[r] + shard)
            gw_ref[used[mine] - offs[r]] = ref.grad_w[mine]
        else:
            gw_ref = ref.grad_w[offs[r]:offs[r] + shard]
        if gw_ref.numel():
            assert _rel(out["grad_w"], gw_ref) <= tol, (r, "grad_w")
    return per_rank, ref, labels, w, kwargs


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [n for n in _SCENARIOS if _SCENARIOS[n][5] == 1.0])
def test_loss_and_gradients_match_reference(runs, world, name):
    data, results, _, _ = runs
    per_rank, ref, labels, w, kwargs = _check_against_reference(data, results, world, name)
    counted = labels != _IGNORE.get(name, -100)
    for res in per_rank:
        assert res[name]["num_valid"] == int(counted.sum())
        if "one_process_correct" in res[name]:  # top-k counts: the same as the one-process mode's
            assert res[name]["correct"] == res[name]["one_process_correct"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["sampled_all64", "sampled64", "sampled64_ignore_class"])
def test_sampling(runs, world, name):
    data, results, _, _ = runs
    per_rank, *_ = _check_against_reference(data, results, world, name)
    _, _, _, _, _, rate, classes, _ = _SCENARIOS[name]
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
def test_bad_input_raises_on_every_rank(runs, world):
    _, results, _, _ = runs
    for r in range(world):
        msg = results[world][r]["bad_input"]["raised"]
        assert msg is not None
        if r == world - 1:
            assert "argument `labels` has class ids >= num_classes=11" in msg
        else:
            assert f"rank(s) [{world - 1}] got invalid input" in msg


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
        if rank > 0:
            assert "argument `process_group` does not contain this process" in errs["member"]


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
    with pytest.raises(ValueError, match="argument `sample_rate` < 1 \\(PartialFC\\) needs `process_group`"):
        shardkit.ShardedSoftmaxLoss(4, 10, sample_rate=0.5)
    with pytest.raises(ValueError, match="argument `sample_rate` must be in"):
        shardkit.ShardedSoftmaxLoss(4, 10, sample_rate=0.0)
    with pytest.raises(ValueError, match="argument `input_layout` needs `process_group`"):
        shardkit.ShardedSoftmaxLoss(4, 10, input_layout="replicated")
    with pytest.raises(RuntimeError, match="needs torch.distributed to be initialized"):
        shardkit.ShardedSoftmaxLoss(4, 10, process_group=object())


def _nccl_worker(rank, world, init_file, tmp, data):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    out = {}
    try:
        for rate in (1.0, 0.5):
            out[rate] = _run_scenario(rank, world, "cos32_none", data, dist.group.WORLD,
                                      device=torch.device("cuda", rank), sample_rate=rate)
    except Exception:
        out["fatal"] = traceback.format_exc()
    finally:
        torch.save(out, os.path.join(tmp, f"nccl{rank}.pt"))
        dist.destroy_process_group()


@pytest.mark.gpu
def test_nccl_on_gpus_matches_reference(tmp_path):
    """NCCL on every visible GPU (up to 4; one is enough): the fp32 CosFace scenario, full
    and sampled, against the float64 reference."""
    world = min(torch.cuda.device_count(), 4)
    data = _make_data(int.from_bytes(os.urandom(4), "little"))[(world, "cos32_none")]
    mp.spawn(_nccl_worker, args=(world, str(tmp_path / "init"), str(tmp_path), data), nprocs=world, join=True)
    per_rank = [torch.load(tmp_path / f"nccl{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(per_rank):
        assert "fatal" not in res, f"rank {r}: {res['fatal']}"
    for rate in (1.0, 0.5):
        fake = {world: [{"cos32_none": res[rate]} for res in per_rank]}
        _check_against_reference({(world, "cos32_none"): data}, fake, world, "cos32_none", sample_rate=rate)
