"""First-step loss and gradients of arcface_torch's PartialFC_V2 and of shardkit's drop-in
(shardkit.softmax.partial_fc.PartialFC_V2) on the same embeddings, labels and weights,
each against a float64 reference of its own math:

  exact           the margin's derivative taken exactly (shardkit's math)
  straight-through  the target logit's derivative d s*psi(cos) / d cos taken as s, as
                  PartialFC_V2 gets it (its ArcFace margin is applied under no_grad)

CosFace and plain cosine logits have psi'(cos) = 1, so both references coincide there and
the two heads must agree to rounding. For ArcFace the script reports how far apart the
gradients are, in two regimes: "init" (random embeddings: cos theta near 0, psi' near
cos m) and "trained" (each embedding near its class's weight: cos theta near 0.9, psi'
near 2 for m = 0.5).

PartialFC_V2 needs a process group (one gloo rank on the CPU, NCCL on a GPU is made here
when none exists) and calls .cuda() on its buffers: on the CPU that call is made to return
the tensor itself for the duration of its forward. Nothing of arcface_torch's is modified.

    python benchmarks/arcface_torch_compare.py --arcface-torch ~/insightface             # CPU, float64
    python benchmarks/arcface_torch_compare.py --device cuda --dtype float32               # GPU, fp32
    python benchmarks/arcface_torch_compare.py --device cuda --dtype float32 --fp16        # fp16 autocast

Writes benchmarks/out/arcface_torch_compare_<device>_<dtype>[_fp16].json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _timing  # noqa: E402

_timing.prefer_in_place_build()  # before the first import of shardkit
import _arcface_torch_setup as setup  # noqa: E402

from shardkit.softmax.partial_fc import PartialFC_V2  # noqa: E402

MARGINS = {"cosface": (1.0, 0.0, 0.4), "arcface": (1.0, 0.5, 0.0)}  # arcface_torch's margin_list
SCALE = 64.0  # train_v2.py's CombinedMarginLoss(64, ...)


def their_classes(root: str):
    """(PartialFC_V2, CombinedMarginLoss) from the checkout's partial_fc_v2.py and losses.py."""
    return (
        setup.load_file_module(root, "partial_fc_v2.py").PartialFC_V2,
        setup.load_file_module(root, "losses.py").CombinedMarginLoss,
    )


@contextlib.contextmanager
def single_process_group(device: torch.device):
    """A one-rank process group (gloo for the CPU, NCCL for a GPU) unless one exists."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{tmp}/init", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def their_forward_context(device: torch.device, dtype: torch.dtype):
    """PartialFC_V2's forward on ``device`` in ``dtype``: its buffers are made with the default
    dtype (so it is set to ``dtype``) and moved with .cuda() (a no-op on the CPU here)."""
    saved_dtype, saved_cuda = torch.get_default_dtype(), torch.Tensor.cuda
    torch.set_default_dtype(dtype)
    if device.type == "cpu":
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.set_default_dtype(saved_dtype)
        torch.Tensor.cuda = saved_cuda


def psi(c: torch.Tensor, m2: float, m3: float) -> torch.Tensor:
    """cos(acos(c) + m2) - m3, continued linearly past acos(c) + m2 = pi (shardkit's ArcFace)."""
    theta = torch.acos(c.clamp(-1 + 1e-7, 1 - 1e-7))
    if m2 == 0.0:
        return c - m3
    c_max = math.cos(math.pi - m2)
    return torch.where(theta + m2 > math.pi, -1.0 - m3 + (c - c_max), torch.cos(theta + m2) - m3)


def reference(x, w, labels, m2: float, m3: float, straight_through: bool):
    """Float64 loss and gradients (x, w) of the margin softmax; ``straight_through``: the
    target logit's derivative with respect to its cosine taken as 1 (PartialFC_V2's rule)."""
    x = x.detach().double().requires_grad_()
    w = w.detach().double().requires_grad_()
    cos = F.normalize(x) @ F.normalize(w).t()
    target = cos.gather(1, labels[:, None])
    shifted = psi(target, m2, m3)
    if straight_through:
        shifted = target + (shifted - target).detach()
    logits = SCALE * cos.scatter(1, labels[:, None], shifted)
    loss = F.cross_entropy(logits, labels)
    gx, gw = torch.autograd.grad(loss, (x, w))
    return dict(loss=loss.detach(), grad_x=gx, grad_w=gw, target_cos=target.detach().flatten())


def inputs(weight, batch, regime, gen):
    """Embeddings and labels: "init" random; "trained" each row near its class's weight."""
    classes, dim = weight.shape
    labels = torch.randint(0, classes, (batch,), generator=gen)
    noise = torch.randn(batch, dim, generator=gen, dtype=torch.float64)
    if regime == "init":
        return noise, labels
    centre = F.normalize(weight.double()[labels])
    return 3.0 * (centre + 0.5 * F.normalize(noise)), labels  # cos theta_y about 0.9


def first_step(head, x, labels):
    """Loss and gradients of one forward + backward of ``head`` (the labels are cloned: PartialFC_V2
    edits its argument in place). Each head's ``fp16`` flag makes its own autocast."""
    x = x.clone().requires_grad_()
    head.zero_grad(set_to_none=True)
    loss = head(x, labels.clone())
    loss.backward()
    return dict(loss=loss.detach(), grad_x=x.grad, grad_w=head.weight.grad)


def rel(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def compare(root, margin, regime, *, classes, dim, batch, device="cpu", dtype=torch.float64, fp16=False, seed=0):
    """Both heads from the same seed (the same N(0, 0.01) weights) on the same inputs: their
    first-step results against both references and against each other."""
    device = torch.device(device)
    theirs_cls, margin_cls = their_classes(root)
    m1, m2, m3 = MARGINS[margin]
    with single_process_group(device), their_forward_context(device, dtype):
        torch.manual_seed(seed)
        theirs = theirs_cls(margin_cls(SCALE, m1, m2, m3), dim, classes, 1.0, fp16).to(device)
        torch.manual_seed(seed)
        ours = PartialFC_V2(margin_cls(SCALE, m1, m2, m3), dim, classes, 1.0, fp16, dtype=dtype).to(device)
        same_init = torch.equal(theirs.weight.detach(), ours.weight.detach())
        gen = torch.Generator().manual_seed(seed + 1)
        x, labels = inputs(ours.weight.detach().cpu(), batch, regime, gen)
        x, labels = x.to(device, dtype), labels.to(device)
        got = {"theirs": first_step(theirs, x, labels)}
    got["shardkit"] = first_step(ours, x, labels)
    w = ours.weight.detach()
    refs = {name: reference(x, w, labels, m2, m3, name == "straight-through") for name in ("exact", "straight-through")}
    out = dict(margin=margin, regime=regime, classes=classes, dim=dim, batch=batch, same_init=same_init)
    out["dtype"], out["device"], out["fp16"] = str(dtype), str(device), fp16
    cos_y = refs["exact"]["target_cos"].clone().requires_grad_()
    (slope,) = torch.autograd.grad(psi(cos_y, m2, m3).sum(), cos_y)  # psi'(cos theta_y) per row
    out["target_cos_mean"] = float(cos_y.detach().mean())
    out["psi_prime_mean"] = float(slope.mean())
    for key in ("loss", "grad_x", "grad_w"):
        out[f"{key}:norm"] = float(refs["exact"][key].norm())  # rel x norm: the absolute difference
        for head in ("theirs", "shardkit"):
            for ref in refs:
                out[f"{key}:{head}_vs_{ref}"] = rel(got[head][key], refs[ref][key])
        out[f"{key}:theirs_vs_shardkit"] = rel(got["theirs"][key], got["shardkit"][key])
        out[f"{key}:straight-through_vs_exact"] = rel(refs["straight-through"][key], refs["exact"][key])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arcface-torch", default=os.environ.get(setup.CHECKOUT_ENV))
    p.add_argument("--allow-unpinned", action="store_true")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    p.add_argument("--fp16", action="store_true", help="both heads' fp16 flag (an fp16 autocast for the logits)")
    p.add_argument("--classes", type=int, default=2000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(3), "little"))
    args = p.parse_args(argv)
    try:
        root = setup.find_checkout(args.arcface_torch)
        pin = setup.check_pinned(root, args.allow_unpinned)
    except setup.CheckoutError as err:
        p.error(str(err))
    dtype = getattr(torch, args.dtype)
    rows = []
    for margin in MARGINS:
        for regime in ("init", "trained"):
            rows.append(
                compare(
                    root,
                    margin,
                    regime,
                    classes=args.classes,
                    dim=args.dim,
                    batch=args.batch,
                    device=args.device,
                    dtype=dtype,
                    fp16=args.fp16,
                    seed=args.seed,
                )
            )
    print(
        f"seed {args.seed}; relative differences (||a - b|| / ||b||), {args.device} {args.dtype}" + " fp16" * args.fp16
    )
    head = f"{'margin':<8} {'regime':<8} {'cos_y':>6} {'psi_prime':>9}  {'quantity':<7} {'theirs~ST':>10} "
    print(head + f"{'shardkit~exact':>14} {'theirs~shardkit':>15} {'ST~exact':>10}")
    for r in rows:
        for key in ("loss", "grad_x", "grad_w"):
            print(
                f"{r['margin']:<8} {r['regime']:<8} {r['target_cos_mean']:6.3f} {r['psi_prime_mean']:9.3f}  {key:<7} "
                f"{r[f'{key}:theirs_vs_straight-through']:10.2e} {r[f'{key}:shardkit_vs_exact']:14.2e} "
                f"{r[f'{key}:theirs_vs_shardkit']:15.2e} {r[f'{key}:straight-through_vs_exact']:10.2e}"
            )
    name = f"arcface_torch_compare_{args.device}_{args.dtype}{'_fp16' if args.fp16 else ''}.json"
    path = os.path.join(_timing.out_dir(), name)
    with open(path, "w") as f:
        json.dump(dict(command=" ".join(sys.argv), checkout=pin, seed=args.seed, rows=rows), f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
