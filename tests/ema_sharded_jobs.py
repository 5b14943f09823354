"""Rank-side scenarios of the sharded ModelEMA tests (tests/test_ema_sharded.py): each spawned
gloo rank builds FSDP2 / HSDP / tensor-parallel float64 models, trains them or sets their
weights by hand, keeps EMAs of them, and saves what the test process compares: the EMAs
gathered (``full_state_dict``) beside float64 EMAs computed by hand on the unsharded model,
per-rank byte counts, flags checked in the rank, and error messages.

World 4 runs first and saves a torch.distributed.checkpoint of an EMA; world 2 resumes it."""

import gc
import math
import os
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import shardkit

# name -> ModelEMA keyword arguments (every schedule: ramp, warmup with min_decay, constant
# after update_after_step; one with a float32 EMA of the float64 model)
SCHEDULES = {
    "ramp": dict(decay=0.9, tau=3.0),
    "warmup": dict(decay=0.9, warmup_gamma=2.0, warmup_power=0.75, min_decay=0.3),
    "constant": dict(decay=0.8, tau=None, update_after_step=1),
    "fp32": dict(decay=0.7, tau=2.0, dtype=torch.float32),
}
STEPS = 4
RESUME_AT, RESUME_END = 5, 9  # the checkpoint is taken after update 5 of 9


def decay_by_hand(t, decay, tau=2000.0, warmup_gamma=None, warmup_power=None, min_decay=0.0, update_after_step=0, **_):
    """The documented schedule at update t (no step argument), written out again."""
    if warmup_gamma is not None or warmup_power is not None:
        s = t - update_after_step - 1
        return 0.0 if s <= 0 else max(min(1 - (1 + s / warmup_gamma) ** -warmup_power, decay), min_decay)
    if tau is None:
        return 0.0 if t - update_after_step - 1 <= 0 else decay
    s = t - update_after_step
    return 0.0 if s <= 0 else max(decay * (1 - math.exp(-s / tau)), min_decay)


class Counters(nn.Module):
    """A float and an integer buffer, set by hand to the same values on every rank."""

    def __init__(self):
        super().__init__()
        self.register_buffer("stat", torch.zeros(3, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        return x + self.stat.sum()


def mlp():
    """Odd sizes: 7 and 3 rows do not divide by 2 or 4 (a rank of 4 holds no row of the last)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), Counters()).double()


def tp_model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3), nn.LayerNorm(3)).double()


def batch(step, rows):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 5, generator=g, dtype=torch.float64)


def set_buffers(model, step):
    counters = model[3] if isinstance(model[3], Counters) else None
    if counters is not None:
        counters.stat.copy_(torch.arange(3, dtype=torch.float64) * step)
        counters.count.fill_(step)


def ema_by_hand(ref, model_state, d):
    for k, v in model_state.items():
        ref[k] = d * ref[k] + (1 - d) * v if v.is_floating_point() else v.clone()


def full_state(model):
    """A model's state with DTensors gathered (collectives), FSDP2 modules resharded first."""
    from torch.distributed.fsdp import FSDPModule

    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.reshard()
    state = model.state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def train_with_emas(model, rank, world, rows_of_rank):
    """STEPS SGD steps on `model` (sharded), each followed by an update of one EMA per schedule;
    the same steps on an unsharded float64 copy with the EMAs computed by hand. Returns the
    gathered EMAs, the references and the model."""
    ref_model = mlp() if isinstance(model[3], Counters) else tp_model()
    emas = {name: shardkit.ModelEMA(model, **kw) for name, kw in SCHEDULES.items()}
    refs = {name: {k: v.clone() for k, v in ref_model.state_dict().items()} for name in SCHEDULES}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    for step in range(1, STEPS + 1):
        x = batch(step, 8)
        model(x[rows_of_rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref_model(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            set_buffers(model, step)
            set_buffers(ref_model, step)
        for name, ema in emas.items():
            ema.update(model)
            ema_by_hand(refs[name], ref_model.state_dict(), decay_by_hand(step, **SCHEDULES[name]))
    gathered = {name: ema.full_state_dict() for name, ema in emas.items()}
    return emas, gathered, refs, ref_model


def swap_check(model, ema, ema_by_hand_state, make_ref, mode):
    """The sharded model's forward inside ema.swap against an unsharded model holding the EMA
    computed by hand; afterwards the model's local tensors bit-exact, and its next forward
    back on the training weights (FSDP2 leaves a root unsharded after a forward without
    backward: the swap must not leave EMA values there)."""
    trained = full_state(model)
    before = [t.to_local().clone() if hasattr(t, "to_local") else t.clone() for t in model.state_dict().values()]
    x = batch(99, 6)
    with torch.no_grad(), ema.swap(model):
        out = model(x)
    with torch.no_grad():  # first thing after the block (model.state_dict() would reshard FSDP2)
        out_after = model(x)
    after = [t.to_local() if hasattr(t, "to_local") else t for t in model.state_dict().values()]
    ema_model, train_model = make_ref(), make_ref()
    ema_model.load_state_dict(ema_by_hand_state)
    train_model.load_state_dict(trained)
    with torch.no_grad():
        return {
            f"{mode}_swap_out": out.full_tensor() if hasattr(out, "full_tensor") else out,
            f"{mode}_swap_want": ema_model(x),
            f"{mode}_after_out": out_after.full_tensor() if hasattr(out_after, "full_tensor") else out_after,
            f"{mode}_after_want": train_model(x),
            f"{mode}_restored": all(torch.equal(a, b) for a, b in zip(after, before)),
        }


class LargestTensor(TorchDispatchMode):
    """The largest tensor (local shard for a DTensor) any op creates while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, (t._local_tensor if hasattr(t, "_local_tensor") else t).numel())
        return out


def memory_and_copies(model, world):
    """EMA bytes on this rank against the model's, and the largest tensor created while the EMA
    is built, updated and swapped in (a full copy of a weight would show)."""
    with LargestTensor() as seen:
        ema = shardkit.ModelEMA(model, 0.9, tau=None)
        ema.update(model)
        ema.update(model)
        with ema.swap(model):
            pass
    state = ema.state_dict()["module"]
    sharded = [v for v in state.values() if hasattr(v, "to_local")]
    return {
        "largest_created": seen.largest,
        "largest_local": max(v.to_local().numel() for v in sharded),
        "largest_full": max(v.numel() for v in sharded),
        "ema_sharded_bytes": sum(v.to_local().numel() * v.element_size() for v in sharded),
        "full_sharded_bytes": sum(v.numel() * v.element_size() for v in sharded),
        "model_local_bytes": sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
    }


def set_weights_by_hand(model, step):
    """Model weights W_t from a seeded generator, each rank writing its own shard."""
    from torch.distributed.tensor import distribute_tensor

    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in model.parameters():
            full = torch.randn(p.shape, generator=g, dtype=p.dtype)
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
        set_buffers(model, step)


def fsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


RESUME_KW = dict(decay=0.9, warmup_power=1.0, update_after_step=1, update_every=1)


def resume_world4(tmp, mesh, rank):
    model = fsdp(mlp(), mesh)
    ema = shardkit.ModelEMA(model, **RESUME_KW)
    out = {}
    for step in range(1, RESUME_END + 1):
        set_weights_by_hand(model, step)
        ema.update(model)
        if step == RESUME_AT:
            dcp.save(ema.state_dict(), checkpoint_id=os.path.join(tmp, "ema_ckpt"))
            out["at_checkpoint"] = ema.full_state_dict()
    out["uninterrupted"] = ema.full_state_dict()
    return out


def resume_world2(tmp, mesh, rank):
    model = fsdp(mlp(), mesh)
    ema = shardkit.ModelEMA(model, decay=0.5, tau=None)  # the checkpoint brings the schedule
    state = ema.state_dict()
    dcp.load(state, checkpoint_id=os.path.join(tmp, "ema_ckpt"))
    ema.load_state_dict(state)
    out = {"loaded": ema.full_state_dict()}
    for step in range(RESUME_AT + 1, RESUME_END + 1):
        set_weights_by_hand(model, step)
        ema.update(model)
    out["resumed"] = ema.full_state_dict()
    return out


def exports_and_errors(tmp, mesh, rank, world):
    """A gathered export loads into a sharded EMA at another world size and into a plain
    ModelEMA; the sharded EMA's documented errors."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    out = {}
    exported = torch.load(os.path.join(tmp, "export4.pt"), weights_only=True)
    model = fsdp(mlp(), mesh)
    ema = shardkit.ModelEMA(model, **RESUME_KW)
    ema.load_state_dict(exported)  # whole tensors: each rank cuts its shard
    out["reloaded_export"] = ema.full_state_dict()
    plain = shardkit.ModelEMA(mlp(), 0.5)
    plain.load_state_dict(exported)
    out["plain_from_export"] = plain.state_dict()
    ema.load_state_dict(plain.state_dict())  # a plain model's EMA into the sharded one
    out["sharded_from_plain"] = ema.full_state_dict()

    def message(fn):
        try:
            fn()
            return None
        except (RuntimeError, ValueError, TypeError) as err:
            return f"{type(err).__name__}: {err}"

    out["module_error"] = message(lambda: ema.module)
    out["update_attr_error"] = message(lambda: ema.update_attr(model))
    bad = dict(ema.state_dict())
    bad["module"] = dict(bad["module"])
    w = bad["module"]["0.weight"]
    bad["module"]["0.weight"] = distribute_tensor(w.full_tensor(), w.device_mesh, [Replicate()])
    before = ema.full_state_dict()
    out["layout_error"] = message(lambda: ema.load_state_dict(bad))
    after = ema.full_state_dict()
    out["unchanged_after_error"] = all(torch.equal(before["module"][k], after["module"][k]) for k in before["module"])
    fsdp1 = FullyShardedDataParallel(mlp(), device_id=torch.device("cpu"))
    out["fsdp1_error"] = message(lambda: shardkit.ModelEMA(fsdp1))
    out["plain_model_error"] = message(lambda: ema.update(mlp()))  # the unsharded twin
    # FSDP2 without resharding after forward: after a forward without backward the module holds
    # unsharded plain parameters; the update reshards it and averages the shards
    lazy = mlp()
    fully_shard(lazy, mesh=mesh, reshard_after_forward=False)
    lazy_ema = shardkit.ModelEMA(lazy, 0.9, tau=None)  # the first update copies
    set_weights_by_hand(lazy, 1)
    with torch.no_grad():
        lazy(batch(1, 2))
    out["unsharded_types"] = sorted({type(p).__name__ for p in lazy.parameters()})
    lazy_ema.update(lazy)
    got, want = lazy_ema.full_state_dict()["module"], full_state(lazy)
    out["lazy_copied"] = all(torch.equal(got[k], want[k]) for k in want)
    return out


def compiled_update(mesh):
    """torch.compile(fullgraph=True) of the update on an FSDP2 model equals the eager update
    (weights set by hand: no collective, so one rank runs it)."""
    # The earlier scenarios' FSDP2 modules collected first: torch 2.15's compiled guards index the
    # keys of FSDP2's module-state WeakKeyDictionary, and one of those modules collected between
    # two calls shrank it under the guard (StopIteration in dynamo's dict_keys_getitem).
    gc.collect()
    model = fsdp(mlp(), mesh)
    ema = shardkit.ModelEMA(model, 0.8, tau=2.0)
    eager = shardkit.ModelEMA(model, 0.8, tau=2.0)
    update = torch.compile(lambda: ema.update(model), fullgraph=True)
    for step in range(1, 4):
        set_weights_by_hand(model, step)
        update()
        eager.update(model)
    a, b = ema.state_dict()["module"], eager.state_dict()["module"]
    local = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in a.items()}
    equal = all(torch.equal(local[k], b[k].to_local() if hasattr(b[k], "to_local") else b[k]) for k in a)
    return {"compiled_equal": equal, "compiled_updates": ema.updates}


def bf16_shards_round_apart(mesh):
    """A bf16 weight sharded by rows over the ranks, every value 0.5 moving to 0.6 by steps far
    below a bf16 ulp: each shard's stochastic rounding must draw bits of its own (keyed by where
    the shard lies in the whole weight), not the same bits at the same local offsets."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 64, bias=False)).bfloat16()
    fully_shard(model, mesh=mesh)
    with torch.no_grad():
        model[0].weight.to_local().fill_(0.5)
    ema = shardkit.ModelEMA(model, decay=0.999, tau=None)
    with torch.no_grad():
        model[0].weight.to_local().fill_(0.6)
    for step in range(5):
        ema.update(model, step=step + 2)
    return {"bf16_full": ema.full_state_dict()["module"]["0.weight"]}


def run_rank(rank, world, tmp):
    """Every scenario of one world size on this rank; returns the results to save."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    res = {}

    def scenario(name, fn):
        t0 = time.perf_counter()
        try:
            res.update(fn())
        except Exception:
            res[f"error_{name}"] = traceback.format_exc()
        res.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 2)

    mesh = init_device_mesh("cpu", (world,))
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)

    def fsdp_training():
        _, gathered, refs, _ = train_with_emas(fsdp(mlp(), mesh), rank, world, rows)
        out = {"fsdp_gathered": gathered, "fsdp_refs": refs}
        model = fsdp(mlp(), mesh)  # a fresh one for the swap: train again, check through "ramp"
        emas, _, refs2, _ = train_with_emas(model, rank, world, rows)
        out.update(swap_check(model, emas["ramp"], refs2["ramp"], mlp, "fsdp"))
        out.update(memory_and_copies(fsdp(mlp(), mesh), world))
        return out

    def tp_training():
        model = parallelize_module(tp_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        emas, gathered, refs, _ = train_with_emas(model, rank, world, slice(0, 8))
        out = {"tp_gathered": gathered, "tp_refs": refs}
        out.update(swap_check(model, emas["warmup"], refs["warmup"], tp_model, "tp"))
        return out

    scenario("fsdp", fsdp_training)
    scenario("tp", tp_training)
    if world == 4:
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

        def hsdp_training():
            model = mlp()
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=mesh2d)
            emas, gathered, refs, _ = train_with_emas(model, rank, world, rows)
            out = {"hsdp_gathered": gathered, "hsdp_refs": refs}
            out["hsdp_placements"] = str(tuple(model[0].weight.placements))
            out.update(swap_check(model, emas["constant"], refs["constant"], mlp, "hsdp"))
            return out

        scenario("hsdp", hsdp_training)
        scenario("resume", lambda: resume_world4(tmp, mesh, rank))
        if rank == 0 and "uninterrupted" in res:
            torch.save(res["uninterrupted"], os.path.join(tmp, "export4.pt"))
    else:
        scenario("resume", lambda: resume_world2(tmp, mesh, rank))
        scenario("exports", lambda: exports_and_errors(tmp, mesh, rank, world))
        scenario("bf16", lambda: bf16_shards_round_apart(mesh))
        if rank == 0:  # the update has no collective: one rank compiles, the other waits (2 CPUs)
            scenario("compile", lambda: compiled_update(mesh))
    dist.barrier()
    return res
