"""Benchmark of shardkit.ModelEMA.update against the usual EMA implementations.

Compared, in the same run, on the same model and EMA dtype:
  shardkit     shardkit.ModelEMA (one fused ema_update_ for all floating tensors)
  shardkit_v1  the same with SHARDKIT_EMA_V1=1 (CUDA: the first, chunked launcher instead of
               the device table; the CPU runs one kernel for both)
  shardkit_graph  ModelEMA(cuda_graph=True): CUDA updates replayed from a captured graph
               (the CPU runs the eager update)
  loop         the per-tensor Python loop of yolov3/ultralytics' ModelEMA
               (v *= d; v += (1 - d) * model_v for every state_dict entry)
  foreach      timm ModelEmaV3's foreach path: torch._foreach_lerp_ over the floating
               state_dict entries, copy_ for the others (timm itself if importable)
  swa          torch.optim.swa_utils.AveragedModel(multi_avg_fn=get_ema_multi_avg_fn)
  ema_pytorch  ema-pytorch's EMA(use_foreach=True, coerce_dtype=True, update_every=1),
               when importable
  torch_ema    torch-ema's ExponentialMovingAverage over the parameters (its shadow copies
               keep the parameters' dtype: a bf16 EMA for a bf16 model), when importable
(the peers: pip install -r benchmarks/requirements.txt).

Models: "resnet50" (the 320 state_dict tensors of torchvision's ResNet-50, 25.6M
parameters; torchvision's model when installed, else the same shapes), "100m" (a
GPT-shaped list: 12 layers, d=768, 25000-token vocabulary, 105M parameters) and "350m"
(GPT-2-medium shapes: 24 layers, d=1024, 50257-token vocabulary, 355M parameters).
Dtypes: "fp32" (fp32 model and EMA), "bf16" (bf16 model, fp32 EMA) and "bf16ema" (bf16 model
and bf16 EMA: shardkit and timm >= 1.0.31 both round it stochastically by default; the others
round to nearest, so their EMA stops moving at decay 0.9999).

Figures: median ms per update; GB/s counting read ema + read model + write ema of the
floating tensors; the floor = those bytes at the measured device copy bandwidth
(a clone of a tensor of the same total size, read + write), and the % of it reached.

    python benchmarks/bench_ema.py --device cpu --models resnet50,100m
    python benchmarks/bench_ema.py --device cuda
"""

import argparse
import copy
import json
import os
import random
import statistics
import sys

import torch
from torch import nn

import shardkit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing, whatever the cwd
from _timing import burst_of, checked_devices, cpu_description, out_dir, target_line, time_once  # noqa: E402


# ---- models ---------------------------------------------------------------------------
def resnet50_shapes():
    """(name, shape, is_param) of torchvision's ResNet-50 state_dict, in order."""
    out = []

    def conv(name, cout, cin, k):
        out.append((f"{name}.weight", (cout, cin, k, k), True))

    def bn(name, c):
        out.extend(
            [
                (f"{name}.weight", (c,), True),
                (f"{name}.bias", (c,), True),
                (f"{name}.running_mean", (c,), False),
                (f"{name}.running_var", (c,), False),
                (f"{name}.num_batches_tracked", (), False),
            ]
        )

    conv("conv1", 64, 3, 7)
    bn("bn1", 64)
    cin = 64
    for li, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512)), start=1):
        for b in range(blocks):
            p = f"layer{li}.{b}"
            conv(f"{p}.conv1", width, cin, 1)
            bn(f"{p}.bn1", width)
            conv(f"{p}.conv2", width, width, 3)
            bn(f"{p}.bn2", width)
            conv(f"{p}.conv3", width * 4, width, 1)
            bn(f"{p}.bn3", width * 4)
            if b == 0:
                conv(f"{p}.downsample.0", width * 4, cin, 1)
                bn(f"{p}.downsample.1", width * 4)
            cin = width * 4
    out.extend([("fc.weight", (1000, 2048), True), ("fc.bias", (1000,), True)])
    return out


def gpt_shapes(layers, d, vocab, ctx=1024):
    out = [("wte", (vocab, d), True), ("wpe", (ctx, d), True)]
    for i in range(layers):
        p = f"h{i}"
        out += [
            (f"{p}.ln1.w", (d,), True),
            (f"{p}.ln1.b", (d,), True),
            (f"{p}.attn.w", (d, 3 * d), True),
            (f"{p}.attn.b", (3 * d,), True),
            (f"{p}.proj.w", (d, d), True),
            (f"{p}.proj.b", (d,), True),
            (f"{p}.ln2.w", (d,), True),
            (f"{p}.ln2.b", (d,), True),
            (f"{p}.fc.w", (d, 4 * d), True),
            (f"{p}.fc.b", (4 * d,), True),
            (f"{p}.out.w", (4 * d, d), True),
            (f"{p}.out.b", (d,), True),
        ]
    return out + [("lnf.w", (d,), True), ("lnf.b", (d,), True)]


class ShapeModel(nn.Module):
    """A module holding parameters/buffers of the given shapes (names with '_' for '.')."""

    def __init__(self, shapes, dtype, device):
        super().__init__()
        for name, shape, is_param in shapes:
            name = name.replace(".", "_")
            if name.endswith("num_batches_tracked"):
                self.register_buffer(name, torch.zeros(shape, dtype=torch.long, device=device))
            elif is_param:
                self.register_parameter(name, nn.Parameter(torch.randn(shape, dtype=dtype, device=device)))
            else:
                self.register_buffer(name, torch.rand(shape, dtype=dtype, device=device))


def build_model(which, dtype, device):
    if which == "resnet50":
        try:
            import torchvision

            return torchvision.models.resnet50().to(device=device, dtype=dtype), "torchvision resnet50"
        except ImportError:
            return ShapeModel(resnet50_shapes(), dtype, device), "resnet50 shapes (no torchvision)"
    if which == "100m":
        return ShapeModel(gpt_shapes(12, 768, 25000), dtype, device), "GPT shapes, 12 x 768"
    return ShapeModel(gpt_shapes(24, 1024, 50257), dtype, device), "GPT-2-medium shapes"


# ---- the implementations compared ---------------------------------------------------
class LoopEMA:
    """yolov3/ultralytics ModelEMA.update's per-tensor loop (constant decay here)."""

    def __init__(self, model, dtype):
        self.ema = copy.deepcopy(model).to(dtype=dtype).eval()

    @torch.no_grad()
    def update(self, model, d=0.9999):
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v *= d
                v += (1 - d) * msd[k].detach()


class ForeachEMA:
    """timm ModelEmaV3.apply_update_ (foreach path): timm's own class when importable and it
    can keep this EMA dtype (the model's, or any with timm >= 1.0.31's ``dtype=``, whose update
    then promotes in ``_foreach_add_`` without casting the model); otherwise the same
    ``torch._foreach_lerp_`` calls with the model tensors cast to the EMA dtype first (timm
    before 1.0.31 fails on a bf16 model with an fp32 EMA). ``self.impl`` says which ran."""

    def __init__(self, model, dtype):
        self.ema = copy.deepcopy(model).to(dtype=dtype).eval()
        self.timm = None
        self.dtype = dtype
        model_dtype = next(model.parameters()).dtype
        self.impl = (
            "foreach_lerp_ (timm's calls; model cast to the EMA dtype)"
            if model_dtype != dtype
            else "foreach_lerp_ (timm's calls; timm not importable)"
        )
        try:
            import inspect

            from timm.utils.model_ema import ModelEmaV3

            if "dtype" in inspect.signature(ModelEmaV3).parameters:
                self.timm = ModelEmaV3(model, decay=0.9999, dtype=dtype)
            elif model_dtype == dtype:
                self.timm = ModelEmaV3(model, decay=0.9999)
            if self.timm is not None:
                self.ema = None
                self.impl = "timm ModelEmaV3"
        except ImportError:
            pass

    @torch.no_grad()
    def update(self, model, d=0.9999):
        if self.timm is not None:
            try:
                return self.timm.update(model)
            except Exception as exc:  # an API change in timm must not cost the foreach row
                self.timm = None
                self.ema = copy.deepcopy(model).to(dtype=self.dtype).eval()
                self.impl = f"foreach_lerp_ (timm's calls; timm's class failed: {type(exc).__name__})"
        ema_v, model_v = [], []
        for e, m in zip(self.ema.state_dict().values(), model.state_dict().values()):
            if e.is_floating_point():
                ema_v.append(e)
                model_v.append(m if m.dtype == e.dtype else m.to(e.dtype))  # foreach needs one dtype
            else:
                e.copy_(m)
        torch._foreach_lerp_(ema_v, model_v, weight=1.0 - d)


class BareForeachEMA:
    """One bare ``torch._foreach_lerp_`` call over tensor lists built once (the floating
    state of an EMA copy and of the model): no wrapper, no per-update walk of the state
    dicts. It needs one dtype per pair, so it runs only where the model has the EMA's dtype."""

    def __init__(self, model, dtype):
        if any(t.is_floating_point() and t.dtype != dtype for t in model.state_dict().values()):
            raise TypeError(f"torch._foreach_lerp_ needs the model in the EMA's dtype ({dtype})")
        ema = copy.deepcopy(model).to(dtype=dtype)
        pairs = [(e, m) for e, m in zip(ema.state_dict().values(), model.state_dict().values())]
        self.ema_v = [e for e, _ in pairs if e.is_floating_point()]
        self.model_v = [m for e, m in pairs if e.is_floating_point()]
        self.impl = "torch._foreach_lerp_ on lists built once"

    @torch.no_grad()
    def update(self, model, d=0.9999):
        torch._foreach_lerp_(self.ema_v, self.model_v, weight=1.0 - d)


class SwaEMA:
    def __init__(self, model, dtype):
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        self.avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9999), use_buffers=True)
        self.avg.module.to(dtype=dtype)
        self.avg.update_parameters(model)  # the first call only copies

    def update(self, model):
        self.avg.update_parameters(model)


class EmaPytorchEMA:
    """ema-pytorch's EMA with its foreach path; the EMA copy in the EMA dtype (coerce_dtype
    casts the model's tensors to it), updated every call from the first step on."""

    def __init__(self, model, dtype):
        from ema_pytorch import EMA

        ema_model = copy.deepcopy(model).to(dtype=dtype)
        self.ema = EMA(
            model,
            ema_model=ema_model,
            beta=0.9999,
            update_after_step=0,
            update_every=1,
            use_foreach=True,
            coerce_dtype=True,
        )
        self.impl = "ema-pytorch EMA (foreach)"

    def update(self, model):
        self.ema.update()


class TorchEmaEMA:
    """torch-ema's ExponentialMovingAverage: parameters only, shadows in the parameters'
    dtype (it has no separate EMA dtype)."""

    def __init__(self, model, dtype):
        from torch_ema import ExponentialMovingAverage

        self.params = list(model.parameters())
        self.ema = ExponentialMovingAverage(self.params, decay=0.9999)
        model_dtype = self.params[0].dtype
        self.impl = "torch-ema" + ("" if model_dtype == dtype else f" (its shadows stay {model_dtype})")

    def update(self, model):
        self.ema.update(self.params)


class OursEMA:
    def __init__(self, model, dtype):
        self.ema = shardkit.ModelEMA(model, 0.9999, tau=None, dtype=dtype)

    def update(self, model):
        self.ema.update(model)


class OursFirstLauncherEMA(OursEMA):
    """shardkit.ModelEMA with SHARDKIT_EMA_V1=1: the CUDA update through the first, chunked
    launcher (a launch per 96 tensors) instead of the device table (the before/after of that
    change in one run). On the CPU it is the same kernel as ``shardkit``."""

    def update(self, model):
        os.environ["SHARDKIT_EMA_V1"] = "1"
        try:
            self.ema.update(model)
        finally:
            os.environ.pop("SHARDKIT_EMA_V1", None)


class OursGraphEMA(OursEMA):
    """shardkit.ModelEMA(cuda_graph=True): on CUDA each update replays a captured graph (the
    decay in a device scalar), for host-bound updates; on the CPU the same as ``shardkit``."""

    def __init__(self, model, dtype):
        self.ema = shardkit.ModelEMA(model, 0.9999, tau=None, dtype=dtype, cuda_graph=True)


METHODS = {
    "shardkit": OursEMA,
    "shardkit_v1": OursFirstLauncherEMA,
    "shardkit_graph": OursGraphEMA,
    "loop": LoopEMA,
    "foreach": ForeachEMA,
    "foreach_bare": BareForeachEMA,
    "swa": SwaEMA,
    "ema_pytorch": EmaPytorchEMA,
    "torch_ema": TorchEmaEMA,
}
PEERS = ("foreach", "swa", "ema_pytorch", "torch_ema")  # issue 16: shardkit >= 1.0x each on the CPU


def run_case(which, dtype_name, device, methods, reps, loop_max_params, burst=1):
    model_dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
    ema_dtype = torch.bfloat16 if dtype_name == "bf16ema" else torch.float32
    model, source = build_model(which, model_dtype, device)
    n_params = sum(p.numel() for p in model.parameters())
    floats = [t for t in model.state_dict().values() if t.is_floating_point()]
    n_tensors = len(model.state_dict())
    ema_size = torch.empty(0, dtype=ema_dtype).element_size()
    nbytes = sum(t.numel() * (2 * ema_size + t.element_size()) for t in floats)  # EMA read + written
    # All implementations live at once and are timed round-robin, one update each per
    # round (in a rotating order), so load changes on a shared machine hit them alike.
    impls, errors = {}, {}
    for name in methods:
        if name == "loop" and device.type == "cpu" and n_params > loop_max_params:
            errors[name] = f"skipped on CPU above {loop_max_params / 1e6:.0f}M params (--loop-max-params)"
            continue
        try:
            impls[name] = METHODS[name](model, ema_dtype)
            for _ in range(1 if which != "resnet50" else 2):
                impls[name].update(model)
        except Exception as exc:  # report, do not hide
            errors[name] = f"{type(exc).__name__}: {exc}"[:110]
            impls.pop(name, None)
    # The floor: a device copy (clone-like, read + write) of the EMA's size, timed in the
    # same rounds.
    copy_src = torch.empty(sum(t.numel() for t in floats), dtype=ema_dtype, device=device).uniform_()
    copy_dst = torch.empty_like(copy_src)
    for _ in range(2):
        copy_dst.copy_(copy_src)
    copies = {"torch": lambda: copy_dst.copy_(copy_src)}
    if device.type == "cpu":  # torch's CPU copy_ is not always memcpy-fast: take the better
        import numpy as np

        raw_dst, raw_src = copy_dst.view(torch.int16), copy_src.view(torch.int16)  # (numpy has no bf16)
        copies["memcpy"] = lambda: np.copyto(
            (raw_dst if ema_dtype == torch.bfloat16 else copy_dst).numpy(),
            (raw_src if ema_dtype == torch.bfloat16 else copy_src).numpy(),
        )
    copy_times = {k: [] for k in copies}
    times = {name: [] for name in impls}
    names = list(impls)

    def timed(fn):  # seconds per call, over `burst` back-to-back calls between two events
        return time_once(burst_of(fn, burst), device) / burst

    for r in range(reps):
        for k, fn in copies.items():
            copy_times[k].append(timed(fn))
        # The order is shuffled every round (seeded: the same run to run): a method that runs
        # right after another one has read the model finds the last-read part of it in cache (a
        # few % on the CPU's 32 MB L3), so no method may always come first or always follow a
        # given one (a rotation kept every method behind the same predecessor).
        order = list(names)
        random.Random(r).shuffle(order)
        for name in order:
            times[name].append(timed(lambda impl=impls[name]: impl.update(model)))  # noqa: F821
    bw = 2 * copy_src.numel() * 4 / min(statistics.median(v) for v in copy_times.values())
    floor = nbytes / bw
    copy_src = copy_dst = None
    rows = []
    for name in methods:
        if name in errors:
            rows.append({"method": name, "error": errors[name]})
            continue
        t = statistics.median(times[name])
        rows.append(
            {
                "method": name,
                "ms": t * 1e3,
                "GBps": nbytes / t / 1e9,
                "pct_floor": 100 * floor / t,
                "impl": getattr(impls[name], "impl", name),
            }
        )
    impls = None
    del model
    return {
        "model": which,
        "source": source,
        "dtype": dtype_name,
        "params": n_params,
        "tensors": n_tensors,
        "bytes": nbytes,
        "burst": burst,
        "copy_GBps": bw / 1e9,
        "floor_ms": floor * 1e3,
        "rows": rows,
    }


def print_case(c):
    print(
        f"\n{c['model']} ({c['source']}): {c['params'] / 1e6:.1f}M params, {c['tensors']} tensors, "
        f"{'bf16 model / bf16 EMA' if c['dtype'] == 'bf16ema' else c['dtype'] + ' model / fp32 EMA'}, "
        f"{c['bytes'] / 1e9:.3f} GB per update, "
        f"{c['burst']} update(s) timed back to back"
    )
    print(f"  copy bandwidth {c['copy_GBps']:.1f} GB/s -> floor {c['floor_ms']:.2f} ms")
    ours = next((r["ms"] for r in c["rows"] if r["method"] == "shardkit" and "ms" in r), None)
    print(f"  {'method':<12}{'ms/update':>11}{'GB/s':>8}{'% floor':>9}{'shardkit speed-up':>19}")
    for r in c["rows"]:
        if "error" in r:
            print(f"  {r['method']:<12} error: {r['error']}")
            continue
        ratio = f"{r['ms'] / ours:.2f}x" if ours else "-"
        impl = f"  ({r['impl']})" if r.get("impl", r["method"]) != r["method"] and r["method"] != "shardkit" else ""
        print(f"  {r['method']:<12}{r['ms']:>11.2f}{r['GBps']:>8.1f}{r['pct_floor']:>8.0f}%{ratio:>19}{impl}")


def check_targets(cases, device):
    """The targets on the cases measured: on CUDA, on the large model >= 90% of the
    copy-bandwidth floor and >= 1.0x foreach, on ResNet-50 >= 2x foreach, everywhere >= 10x
    the per-tensor loop; on the CPU >= 1.0x every peer (issue 16). Prints one TARGET line each."""

    def ms(c, m):
        return next((r["ms"] for r in c["rows"] if r["method"] == m and "ms" in r), None)

    out = []
    for c in cases:
        ours, tag = ms(c, "shardkit"), f"{c['model']} {c['dtype']}"
        if ours is None:
            out.append(target_line(f"ema {tag}", None, "shardkit did not run"))
            continue
        foreach, loop = ms(c, "foreach"), ms(c, "loop")
        if c["dtype"] == "bf16ema":  # like with like only: timm's class, which also rounds at random
            timm = next((r for r in c["rows"] if r["method"] == "foreach" and r.get("impl") == "timm ModelEmaV3"), None)
            t = None if timm is None else timm.get("ms")
            out.append(
                target_line(
                    f"ema {tag} (both stochastic rounding) >= 1.0x timm ModelEmaV3",
                    None if t is None else t / ours >= 1.0,
                    "timm >= 1.0.31 did not run" if t is None else f"{t / ours:.2f}x",
                )
            )
            continue
        if device.type == "cuda":
            if c["model"] == "350m":
                pct = 100 * c["floor_ms"] / ours
                out.append(target_line(f"ema {tag} >= 90% of copy bandwidth", pct >= 90, f"{pct:.0f}%"))
            need = 2.0 if c["model"] == "resnet50" else 1.0
        else:  # issue 16: at least as fast as every peer on the CPU
            for peer in PEERS:
                t = ms(c, peer)
                out.append(
                    target_line(
                        f"ema {tag} >= 1.0x {peer}",
                        None if t is None else t / ours >= 1.0,
                        f"{peer} did not run" if t is None else f"{t / ours:.2f}x",
                    )
                )
            continue
        out.append(
            target_line(
                f"ema {tag} >= {need:.1f}x foreach",
                None if foreach is None else foreach / ours >= need,
                "foreach did not run" if foreach is None else f"{foreach / ours:.2f}x",
            )
        )
        if device.type == "cuda" and c["model"] == "resnet50" and c["dtype"] == "fp32":
            bare = ms(c, "foreach_bare")
            out.append(
                target_line(
                    f"ema {tag} >= 2.0x a bare torch._foreach_lerp_",
                    None if bare is None else bare / ours >= 2.0,
                    "foreach_bare did not run" if bare is None else f"{bare / ours:.2f}x",
                )
            )
        if device.type == "cuda":
            out.append(
                target_line(
                    f"ema {tag} >= 10x per-tensor loop",
                    None if loop is None else loop / ours >= 10,
                    "loop did not run" if loop is None else f"{loop / ours:.1f}x",
                )
            )
    return out


def plot(cases, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{c['model']}\n{c['dtype']}" for c in cases]
    methods = list(METHODS)
    for i, m in enumerate(methods):
        vals = [next((r.get("GBps", 0) for r in c["rows"] if r["method"] == m), 0) for c in cases]
        width = 0.8 / len(methods)
        ax.bar([x + i * width for x in range(len(cases))], vals, width, label=m)
    ax.plot(
        [x + 0.4 for x in range(len(cases))],
        [c["bytes"] / c["floor_ms"] / 1e6 for c in cases],
        "k_",
        markersize=40,
        label="copy-bandwidth floor",
    )
    ax.set_xticks([x + 0.4 for x in range(len(cases))], labels)
    ax.set_ylabel("GB/s (read ema + model, write ema)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default=None, help="default: resnet50,100m on CPU, resnet50,350m on CUDA")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions (default: 15 on CPU, 50 on CUDA)")
    ap.add_argument(
        "--burst",
        type=int,
        default=0,
        help="updates timed back to back between two events, the figure per update (default: 1 on CPU, "
        "5 on CUDA, where one update's host time would otherwise be timed as well)",
    )
    ap.add_argument(
        "--loop-max-params",
        type=float,
        default=1e8,
        help="on CPU, skip the (very slow) per-tensor loop for larger models",
    )
    args = ap.parse_args()
    for flag, given, known in (
        ("--models", args.models, ("resnet50", "100m", "350m")),
        ("--dtypes", args.dtypes, ("fp32", "bf16", "bf16ema")),
        ("--methods", args.methods, tuple(METHODS)),
    ):
        bad = [v for v in (given or "").split(",") if v and v not in known]
        if bad:
            ap.error(f"{flag}: unknown {bad}; choose from {', '.join(known)}")
    (device,) = checked_devices(ap, "--device", [args.device])
    reps = args.reps or (15 if device.type == "cpu" else 50)
    if args.burst < 0 or args.reps < 0:
        ap.error("--burst and --reps take a count >= 0 (0: the default)")
    burst = args.burst or (1 if device.type == "cpu" else 5)
    args.models = args.models or ("resnet50,100m" if device.type == "cpu" else "resnet50,350m")
    print(
        f"torch {torch.__version__}, device {device}"
        f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
        f"threads {torch.get_num_threads()}, shardkit CUDA kernels: {shardkit.cuda_built()}"
    )
    if device.type == "cpu":
        print(cpu_description())
    cases = []
    for which in args.models.split(","):
        for dt in args.dtypes.split(","):
            cases.append(run_case(which, dt, device, args.methods.split(","), reps, args.loop_max_params, burst))
            print_case(cases[-1])
    print()
    targets = check_targets(cases, device)
    stem = os.path.join(out_dir(), f"bench_ema_{device.type}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    with open(stem + ".json", "w") as f:
        json.dump(
            {
                "torch": torch.__version__,
                "device": str(device),
                "device_name": name,
                "cases": cases,
                "targets": targets,
            },
            f,
            indent=1,
        )
    plot(cases, stem + ".png")
    print(f"\nwrote {stem}.json and {stem}.png")


if __name__ == "__main__":
    main()
