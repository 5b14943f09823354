"""A small run of every CUDA kernel family, for compute-sanitizer (memcheck, racecheck).

One sharded-loss forward+backward per mode (plain bf16 and ArcFace-normalized fp32, each
over several chunks, a batch that is no multiple of a warp or a vector width, a target in
the last, partial chunk; plain bf16 in one chunk of 4103 classes, which the second kernel
set, the default, splits into column ranges per row; ArcFace bf16 with D = 64 over two row
tiles, and plain bf16 and ArcFace bf16 with D = 64 over full tiles, with the targets anywhere
and in the first tile only, the fused kernels' cases under SHARDKIT_FUSED=1), one ModelEMA
update per model dtype (fp32 and bf16 models, fp32 EMA) and one normalize call per output
dtype (fp32, bf16; the vectorized path and the generic one).
Sizes are tiny: under racecheck every shared-memory access is tracked, which slows kernels
by orders of magnitude. Each result is compared with a float64 reference (the loss: the CPU
kernels; EMA and normalize: plain torch), so the run also fails (exit code 1) on a wrong
answer, not only on a sanitizer report.

    compute-sanitizer --tool memcheck --error-exitcode 2 python benchmarks/sanitize_smoke.py
    compute-sanitizer --tool racecheck --error-exitcode 2 python benchmarks/sanitize_smoke.py
    python benchmarks/sanitize_smoke.py --device cpu     # the same calls on the CPU kernels
"""

import argparse
import os
import sys

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # _timing, whatever the cwd (also under python -m)
import _timing  # noqa: E402

_timing.prefer_in_place_build()  # before the first import of shardkit
import shardkit  # noqa: E402
from shardkit.softmax.margins import ArcFace  # noqa: E402


def check(name, got, ref, tol):
    got, ref = got.detach().double(), ref.detach().double()
    err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    ok = err <= tol and bool(torch.isfinite(got).all())  # NaN never passes
    print(f"{'ok  ' if ok else 'FAIL'} {name}: relative error {err:.2e} (tolerance {tol:.0e})", flush=True)
    return ok


def sharded_loss(device, dtype, margin, batch=37, classes=1000, chunk_memory=1 << 16, dim=40, labels_below=None):
    # Default: an odd batch, D not a multiple of 8, and a 64 KiB working set: chunks of ~100-300
    # classes, so several chunks and a partial last one. With the default working set, one
    # chunk of a few thousand classes: rows split into column ranges by the second kernels.
    # dim=64 with 16-bit inputs: the fused sm90 kernels where they run (SHARDKIT_FUSED=1);
    # labels_below: the labels below it (the fused forward epilogue's short form in the other tiles).
    x = torch.randn(batch, dim, device=device, dtype=dtype, requires_grad=True)
    y = torch.randint(0, labels_below or classes, (batch,), device=device)
    y[0] = classes - 1  # a target in the last (partial) chunk
    head = shardkit.ShardedSoftmaxLoss(
        dim, classes, devices=[device], dtype=dtype, margin=margin, chunk_memory=chunk_memory
    )
    loss = head(x, y)
    loss.backward()
    # Reference: the same loss on the CPU kernels in float64 (tested against plain torch in
    # the test suite), from the same weights.
    ref_head = shardkit.ShardedSoftmaxLoss(dim, classes, devices=["cpu"], dtype=torch.float64, margin=margin)
    with torch.no_grad():
        ref_head.weight_shards[0].copy_(head.full_weight().detach().cpu().double())
    xr = x.detach().cpu().double().requires_grad_(True)
    ref = ref_head(xr, y.cpu())
    ref.backward()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    tag = f"sharded loss {dtype} {'plain' if margin is None else 'ArcFace'} B={batch} C={classes}"
    ok = check(f"{tag} loss", loss.detach().cpu(), ref.detach(), tol)
    ok &= check(f"{tag} dX", x.grad.cpu(), xr.grad, tol)
    grads = torch.cat([s.grad.cpu() for s in head.weight_shards])
    return ok & check(f"{tag} dW", grads, ref_head.weight_shards[0].grad, tol)


def ema(device, model_dtype):
    model = nn.Sequential(nn.Linear(33, 65), nn.BatchNorm1d(65), nn.Linear(65, 7)).to(device, model_dtype)
    ema = shardkit.ModelEMA(model, decay=0.9, tau=None, dtype=torch.float32)
    ema.update(model)  # the schedule's first update copies (decay 0): the second one averages
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    before = [p.detach().clone() for p in ema.module.parameters()]
    d = ema.get_decay(ema.updates + 1)
    assert 0 < d < 1, d
    ema.update(model)
    ok = True
    for e, b, p in zip(ema.module.parameters(), before, model.parameters()):
        ref = b.double() + (1 - d) * (p.detach().double() - b.double())
        ok &= check(f"EMA update, {model_dtype} model, tensor {tuple(p.shape)}", e.detach(), ref, 1e-6)
    return ok


def normalize(device, dtype):
    ok = True
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    for shape in ((3, 17, 19, 3), (2, 32, 32, 3)):  # odd sizes (generic path), aligned (vectorized)
        img = torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
        out = shardkit.ops.normalize_images(img, mean, std, dtype=dtype)
        m = torch.tensor(mean, dtype=torch.float64, device=device)[:, None, None]
        s = torch.tensor(std, dtype=torch.float64, device=device)[:, None, None]
        ref = (img.permute(0, 3, 1, 2).double() / 255 - m) / s
        ok &= check(f"normalize {tuple(shape)} -> {dtype}", out, ref, 1e-2 if dtype == torch.bfloat16 else 1e-6)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    (device,) = _timing.checked_devices(ap, "--device", [args.device])
    if device.type == "cuda" and not shardkit.cuda_built():
        ap.error("--device cuda: this build of shardkit has no CUDA kernels (python -m shardkit.info says why)")
    torch.manual_seed(0)
    ok = sharded_loss(device, torch.bfloat16, None)
    ok &= sharded_loss(device, torch.float32, ArcFace(s=64.0, m=0.5))
    ok &= sharded_loss(device, torch.bfloat16, None, batch=9, classes=4103, chunk_memory=None)
    ok &= sharded_loss(device, torch.bfloat16, ArcFace(s=30.0, m=0.5), batch=130, classes=700, dim=64)
    # Fused: full tiles whose dlogits are stored 8 columns at a time (rows of 1096 = 8 x 137).
    ok &= sharded_loss(device, torch.bfloat16, None, batch=256, classes=1096, chunk_memory=None, dim=64)
    for margin in (None, ArcFace(s=64.0, m=0.5)):
        ok &= sharded_loss(
            device, torch.bfloat16, margin, batch=256, classes=1096, chunk_memory=None, dim=64, labels_below=200
        )
    ok &= ema(device, torch.float32)
    ok &= ema(device, torch.bfloat16)
    ok &= normalize(device, torch.float32)
    ok &= normalize(device, torch.bfloat16)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print("sanitize_smoke:", "all results match" if ok else "SOME RESULTS ARE WRONG")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
