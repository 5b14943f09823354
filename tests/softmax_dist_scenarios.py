"""Shared scenarios of the distributed ShardedSoftmaxLoss tests (tests only): the data,
one rank's run of a scenario, and the comparison of every rank's results with the
single-process float64 full-logit reference (tests/softmax_reference.py) under the documented
semantics: every rank returns the global batch's loss, head gradients are exact, rank r's
embedding gradient is world_size * dL/dX_r (data-parallel layout) or dL/dX (replicated).

Used by test_softmax_distributed.py (gloo, spawned CPU processes) and test_softmax_distributed_nccl.py
(NCCL on GPUs)."""

import torch
from softmax_checks import OpLog
from softmax_reference import margin_kwargs, reference_loss_and_grads, reference_lse

import shardkit
from shardkit.distributed import class_offsets, split_classes

WORLDS = (1, 2, 3, 4)
D = 7


def margins():
    return {
        "plain": None,
        "arc": shardkit.ArcFace(s=16.0, m=0.5),
        "cos": shardkit.CosFace(s=16.0, m=0.3),
        "combined": shardkit.CombinedMargin(s=12.0, m1=1.0, m2=0.3, m3=0.1),
    }


# name: (margin, dtype, reduction, smoothing, layout, sample_rate, num_classes, sizes(world))
SCENARIOS = {
    "plain64_mean": ("plain", torch.float64, "mean", 0.0, "data_parallel", 1.0, 23, lambda w: [5, 2, 7, 3][:w]),
    "arc64_smooth_sum": ("arc", torch.float64, "sum", 0.1, "data_parallel", 1.0, 29, lambda w: [4, 6, 1, 5][:w]),
    "cos32_none": ("cos", torch.float32, "none", 0.0, "data_parallel", 1.0, 31, lambda w: [3, 8, 2, 4][:w]),
    "combined64_empty_rank": (
        "combined",
        torch.float64,
        "mean",
        0.05,
        "data_parallel",
        1.0,
        19,
        lambda w: [0, 5, 3, 6][:w] if w > 1 else [4],
    ),
    "replicated64": ("arc", torch.float64, "mean", 0.1, "replicated", 1.0, 17, lambda w: [9] * w),
    "sampled_all64": ("cos", torch.float64, "mean", 0.1, "data_parallel", 0.9999, 21, lambda w: [3, 2, 4, 1][:w]),
    "sampled64": ("arc", torch.float64, "mean", 0.1, "data_parallel", 0.3, 97, lambda w: [3, 2, 4, 1][:w]),
    "ignore_class64": ("arc", torch.float64, "mean", 0.1, "data_parallel", 1.0, 15, lambda w: [4, 3, 5, 2][:w]),
    "sampled64_ignore_class": ("cos", torch.float64, "sum", 0.1, "data_parallel", 0.5, 40, lambda w: [4, 3, 5, 2][:w]),
}
# ignore_index per scenario (default -100); 3 is also a class id: such rows get no target
IGNORE = {"ignore_class64": 3, "sampled64_ignore_class": 3}
# (memory_budget, chunk_memory) per scenario (default (0, None)): kept logits, all of them or
# a few chunks of 4 classes, the rest recomputed (the test data keep B <= 15, D = 7)
SCENARIOS["arc64_kept"] = SCENARIOS["arc64_smooth_sum"]
SCENARIOS["sampled64_kept"] = SCENARIOS["sampled64"]
KEPT = {"arc64_kept": (1 << 30, 512), "sampled64_kept": (1500, 512)}


def make_data(seed):
    gen = torch.Generator().manual_seed(seed)
    data = {}
    for world in WORLDS:
        for name, (_, _, _, _, layout, _, classes, sizes_fn) in SCENARIOS.items():
            sizes = sizes_fn(world)
            batch = sizes[0] if layout == "replicated" else sum(sizes)
            ignore = IGNORE.get(name, -100)
            labels = torch.randint(0, classes, (batch,), generator=gen)
            labels[torch.rand(batch, generator=gen) < 0.15] = ignore
            if int(labels[0]) == ignore:  # at least one counted row
                labels[0] = (ignore + 1) % classes if ignore >= 0 else 0
            data[(world, name)] = dict(
                x=torch.randn(batch, D, generator=gen, dtype=torch.float64),
                w=torch.randn(classes, D, generator=gen, dtype=torch.float64) * 0.5,
                labels=labels,
                sizes=sizes,
                grad_out=torch.rand(batch, generator=gen, dtype=torch.float64),
            )
    for world in WORLDS:  # unchecked_inputs: labels no shard owns on ranks 0 and 2, an ignored last row
        sizes = [3, 2, 4, 1][:world]
        labels = torch.randint(0, UNCHECKED_CLASSES, (sum(sizes),), generator=gen)
        labels[-1], labels[1] = -100, UNCHECKED_CLASSES + 4
        if world > 2:
            labels[5], labels[6] = UNCHECKED_CLASSES, -7
        data[(world, "unchecked")] = dict(
            x=torch.randn(sum(sizes), D, generator=gen, dtype=torch.float64),
            w=torch.randn(UNCHECKED_CLASSES, D, generator=gen, dtype=torch.float64) * 0.5,
            labels=labels,
            sizes=sizes,
        )
    data["ckpt"] = torch.randn(13, D, generator=gen)
    return data


UNCHECKED_CLASSES = 17


def unchecked_inputs(rank, world, d, group):
    """check_inputs=False on labels no shard owns (>= C, negative but not ignore_index) and
    "async" on the same batch with those labels ignored instead: per mode, this rank's loss,
    embedding gradient and shard gradient (one step of the ArcFace head, float64), and the
    class-ordered weight that export_full_weight gathers from every rank."""
    start, size = sum(d["sizes"][:rank]), d["sizes"][rank]
    labels = d["labels"][start : start + size]
    out = {}
    for mode in (False, "async"):
        head = shardkit.ShardedSoftmaxLoss(
            D, UNCHECKED_CLASSES, margin=margins()["arc"], dtype=torch.float64, process_group=group, check_inputs=mode
        )
        shardkit.import_full_weight(head, d["w"])
        x = d["x"][start : start + size].clone().requires_grad_(True)
        unowned = (labels < 0) | (labels >= UNCHECKED_CLASSES)
        loss = head(x, labels if mode is False else labels.masked_fill(unowned, -100))
        loss.backward()
        out[mode] = dict(loss=loss.detach(), grad_x=x.grad, grad_w=head.weight_shards[0].grad.clone())
    out["exported"] = shardkit.export_full_weight(head)
    return out


def run_scenario(rank, world, name, d, group, device=torch.device("cpu"), sample_rate=None):
    """Rank ``rank``'s run of scenario ``name`` on data ``d`` (one or two SparseRowSGD steps):
    its loss, lse, gradients, top-k counts and, when sampling, the sampled rows."""
    margin_name, dtype, reduction, eps, layout, rate, classes, _ = SCENARIOS[name]
    rate = rate if sample_rate is None else sample_rate
    memory_budget, chunk_memory = KEPT.get(name, (0, None))
    head = shardkit.ShardedSoftmaxLoss(
        D,
        classes,
        margin=margins()[margin_name],
        label_smoothing=eps,
        ignore_index=IGNORE.get(name, -100),
        reduction=reduction,
        dtype=dtype,
        process_group=group,
        input_layout=layout,
        sample_rate=rate,
        devices=[device],
        memory_budget=memory_budget,
        chunk_memory=chunk_memory,
    )
    shardkit.import_full_weight(head, d["w"].to(dtype))
    sizes = d["sizes"]
    start = sum(sizes[:rank]) if layout == "data_parallel" else 0
    size = sizes[rank]
    x = d["x"][start : start + size].to(device=device, dtype=dtype)
    if dtype == torch.float32:
        x = x.t().contiguous().t()  # non-contiguous embeddings
    x.requires_grad_(True)
    opt = shardkit.SparseRowSGD(head.parameters(), lr=0.5, momentum=0.9, weight_decay=0.01)
    out = {}
    for step in range(2 if rate < 1.0 else 1):  # two steps: the momentum buffer exists on step 2
        head.zero_grad(set_to_none=True)
        x.grad = None
        with OpLog() as log:
            details = head(x, d["labels"][start : start + size].to(device), return_details=True, topk=(1, 3))
        out.setdefault("ops", log.names)
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
                buf is None
                or torch.equal(
                    opt.state[head.weight_shards[0]]["momentum_buffer"].cpu()[untouched], buf.cpu()[untouched]
                )
            )
            grad_w = grad_w.to_dense()
        if step == 0:
            out.update(
                loss=details.loss.detach().cpu(),
                grad_x=x.grad.cpu(),
                grad_w=grad_w.cpu(),
                correct={k: int(v) for k, v in details.correct.items()},
                num_valid=int(details.num_valid),
                lse=details.lse.detach().cpu(),
            )
            if rate == 1.0 and layout == "data_parallel":
                # the one-process head on the global batch: the top-k counts must be the same
                one = shardkit.ShardedSoftmaxLoss(
                    D,
                    classes,
                    margin=margins()[margin_name],
                    dtype=dtype,
                    ignore_index=IGNORE.get(name, -100),
                    devices=["cpu"] * 2,
                )
                shardkit.import_full_weight(one, d["w"].to(dtype))
                ref = one(d["x"].to(dtype), d["labels"], return_details=True, topk=(1, 3))
                out["one_process_correct"] = {k: int(v) for k, v in ref.correct.items()}
    return out


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check_against_reference(data, results, world, name, sample_rate=None):
    """Asserts every rank's results of ``name`` against the float64 reference; returns
    ``(per_rank, ref, labels, w, margin kwargs)`` for further checks."""
    margin_name, dtype, reduction, eps, layout, rate, classes, _ = SCENARIOS[name]
    rate = rate if sample_rate is None else sample_rate
    d = data[(world, name)]
    tol = 1e-6 if dtype == torch.float64 else 2e-5
    per_rank = results[world]
    for r, res in enumerate(per_rank):
        assert isinstance(res[name], dict), f"rank {r}: {res[name]}"
    kwargs = margin_kwargs(margins()[margin_name])
    x, w, labels = d["x"], d["w"], d["labels"]
    ignore = IGNORE.get(name, -100)
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
    ref = reference_loss_and_grads(
        x, w, labels, grad_out=g, label_smoothing=eps, reduction=reduction, ignore_index=ignore, **kwargs
    )
    # per-row lse of the global batch (ignored rows too, without a margin)
    lse_ref = reference_lse(x, w, torch.where(labels == ignore, -1, labels), **kwargs)
    sizes, offs = d["sizes"], class_offsets(split_classes(classes, world))
    start = 0
    for r, res in enumerate(per_rank):
        out = res[name]
        assert rel(out["loss"], ref.loss) <= tol, (r, out["loss"], ref.loss)
        assert rel(out["lse"], lse_ref) <= tol, (r, "lse")
        if layout == "replicated":
            gx_ref = ref.grad_x
        else:
            gx_ref = world * ref.grad_x[start : start + sizes[r]]
            start += sizes[r]
        if gx_ref.numel():
            assert rel(out["grad_x"], gx_ref) <= tol, (r, "grad_x")
        shard = split_classes(classes, world)[r]
        if rate < 1.0:
            gw_ref = torch.zeros(shard, D, dtype=torch.float64)
            mine = (used >= offs[r]) & (used < offs[r] + shard)
            gw_ref[used[mine] - offs[r]] = ref.grad_w[mine]
        else:
            gw_ref = ref.grad_w[offs[r] : offs[r] + shard]
        if gw_ref.numel():
            assert rel(out["grad_w"], gw_ref) <= tol, (r, "grad_w")
    return per_rank, ref, labels, w, kwargs
