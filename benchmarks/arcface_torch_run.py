"""Runs InsightFace arcface_torch's own ``train_v2.py``, unchanged, on its synthetic-data path,
with its PartialFC_V2 head or with shardkit's drop-in, and records images/s, peak GPU memory
and the largest class count that fits. Needs a CUDA GPU (train_v2.py uses NCCL and .cuda()).

The user's checkout is read, never modified: ``--arcface-torch PATH`` (the arcface_torch
folder or an insightface checkout; default $SHARDKIT_ARCFACE_TORCH), checked against the
pinned insightface commit (see _arcface_torch_setup.py). Each run is a child process with
the environment ``torchrun --nproc_per_node=1`` gives (RANK=0, WORLD_SIZE=1, a free
MASTER_PORT; start this script with plain python) that registers the config (arcface_torch's
configs/3millions.py speed config with the options below, ``configs/shardkit_run``) and
executes train_v2.py with runpy. The heads (``--head``, comma-separated for several):

  pfc              arcface_torch's PartialFC_V2, as the script has it
  shardkit         shardkit.softmax.partial_fc.PartialFC_V2 put in place of the module
                   ``partial_fc_v2`` (what the one-line import change does); same optimizer
  shardkit-sparse  SparseRowPartialFC_V2 and torch.optim.SGD replaced by shardkit.SparseRowSGD
                   (the three-line change: row-sparse gradients, unsampled rows untouched)

Options taking comma-separated lists run every combination (``--classes``, ``--sample-rate``,
``--batch``, ``--seeds``). Packages train_v2.py imports but the synthetic path never uses
(easydict, mxnet, torchvision, tensorboard, eval.verification's sklearn/scipy) get
stand-ins where missing, and the LR scheduler's removed ``verbose=`` a shim; both are
recorded in the output.

    python benchmarks/arcface_torch_run.py --arcface-torch ~/insightface --check        # no GPU needed
    python benchmarks/arcface_torch_run.py --head pfc,shardkit --classes 1000000 --sample-rate 1.0,0.1 \\
        --batch 128,512                                                     # images/s and peak memory
    python benchmarks/arcface_torch_run.py --head pfc,shardkit --classes 1000000 --steps 200 --warmup 0 \\
        --seeds 1,2,3                                                       # loss curves
    python benchmarks/arcface_torch_run.py --head pfc --sample-rate 0.1 --max-classes    # largest C that fits

Writes benchmarks/out/arcface_torch_run.json (or ``--out``; $SHARDKIT_BENCH_OUT moves the folder).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # _timing, _arcface_torch_setup, whatever the cwd
import _timing  # noqa: E402

_timing.prefer_in_place_build()  # before the first import of shardkit
import _arcface_torch_setup as setup  # noqa: E402
from _arcface_torch_search import loss_curve_summary, search_max_classes  # noqa: E402

HEADS = ("pfc", "shardkit", "shardkit-sparse")
MARGINS = {"cosface": (1.0, 0.0, 0.4), "arcface": (1.0, 0.5, 0.0)}  # arcface_torch's margin_list


def _int_list(text):
    try:
        numbers = [float(v) for v in text.split(",") if v.strip()]  # float: 1e6 is a count too
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if any(not math.isfinite(v) or v != int(v) for v in numbers):  # 1.7 is not truncated to 1
        raise argparse.ArgumentTypeError(f"must be whole numbers, got {text!r}")
    values = [int(v) for v in numbers]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be integers >= 1, got {text!r}")
    return values


def _rate_list(text):
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not values or any(not 0.0 < v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"sample rates must be in (0, 1], got {text!r}")
    return values


def _head_list(text):
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in HEADS]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"heads must be among {', '.join(HEADS)}, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="arcface_torch_run.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--arcface-torch", default=os.environ.get(setup.CHECKOUT_ENV), help="the checkout (see above)")
    p.add_argument("--allow-unpinned", action="store_true", help="run a checkout that differs from the pinned files")
    p.add_argument("--head", type=_head_list, default=["pfc", "shardkit"], help="heads (default: pfc,shardkit)")
    p.add_argument("--classes", type=_int_list, default=[1_000_000], help="class counts (default: 1000000)")
    p.add_argument("--sample-rate", type=_rate_list, default=[1.0], help="PartialFC sample rates (default: 1.0)")
    p.add_argument("--batch", type=_int_list, default=[128], help="per-GPU batch sizes (default: 128)")
    p.add_argument("--seeds", type=_int_list, default=[2048], help="config seeds (default: 2048, arcface_torch's)")
    p.add_argument("--margin", choices=sorted(MARGINS), default="cosface", help="(default: the speed config's)")
    p.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=True, help="config.fp16 (default: on)")
    p.add_argument("--network", default="r50", help="arcface_torch backbone name (default: r50, iresnet50)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default: 2, arcface_torch's)")
    p.add_argument("--steps", type=int, default=50, help="timed steps (default: 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (default: 10)")
    p.add_argument("--max-classes", action="store_true", help="search the largest class count that fits instead")
    p.add_argument("--max-probes", type=int, default=6, help="runs per search after its two fitting runs (default: 6)")
    p.add_argument("--resolution", type=float, default=0.03, help="search stops at this relative gap (default: 0.03)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is killed (default: 900)")
    p.add_argument("--check", action="store_true", help="load the checkout with the stand-ins and shims, no GPU")
    p.add_argument("--out", help="JSON path (default: <out dir>/arcface_torch_run.json)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: one run's settings, as JSON
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Parses and checks the arguments; errors name the flag (argparse's exit 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("steps", "warmup", "workers", "max_probes"):
        low = 1 if name in ("steps", "max_probes") else 0
        if getattr(args, name) < low:
            parser.error(f"argument --{name.replace('_', '-')}: must be >= {low}, got {getattr(args, name)}")
    if not 0.0 < args.resolution < 1.0:
        parser.error(f"argument --resolution: must be in (0, 1), got {args.resolution}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        parser.error(f"argument --timeout: must be a finite number of seconds > 0, got {args.timeout}")
    # checked now, not when the JSON is written after every run has been made
    if args.out is not None and os.path.isdir(args.out):
        parser.error(f"argument --out: {args.out!r} is a folder; give the JSON file's path")
    if args.out is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        parser.error(f"argument --out: the folder of {args.out!r} does not exist")
    if args.child is None:
        try:
            args.arcface_torch = setup.find_checkout(args.arcface_torch)
        except setup.CheckoutError as err:
            parser.error(str(err))
    return args


def settings(args) -> list:
    """One dict per run: every combination of the listed options, the heads innermost, so the
    runs of one setting are adjacent and a run cut short keeps whole comparisons."""
    out = []
    for classes in args.classes:
        for rate in args.sample_rate:
            for batch in args.batch:
                for seed in args.seeds:
                    for head in args.head:
                        out.append(dict(head=head, classes=classes, sample_rate=rate, batch=batch, seed=seed))
    return out


def config_overrides(setting: dict, args, workdir: str) -> dict:
    """The speed config's entries this run changes (the rest is configs/3millions.py + base.py)."""
    return dict(
        network=args.network,
        num_classes=setting["classes"],
        sample_rate=setting["sample_rate"],
        batch_size=setting["batch"],
        seed=setting["seed"],
        fp16=args.fp16,
        margin_list=MARGINS[args.margin],
        embedding_size=512,
        rec="synthetic",
        val_targets=[],
        num_workers=args.workers,
        output=workdir,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(setting: dict, args) -> dict:
    """One run of train_v2.py in a child process; its JSON result (status ok / oom / error / killed)."""
    with tempfile.TemporaryDirectory(prefix="arcface_torch_run_") as workdir:
        result_path = os.path.join(workdir, "result.json")
        child = dict(setting, workdir=workdir, result=result_path)
        child.setdefault("steps", args.steps)  # the search runs fewer
        child.setdefault("warmup", args.warmup)
        argv = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(child)]
        argv += ["--arcface-torch", args.arcface_torch, "--network", args.network, "--workers", str(args.workers)]
        argv += ["--margin", args.margin, "--fp16" if args.fp16 else "--no-fp16"]
        argv += ["--allow-unpinned"] if args.allow_unpinned else []
        # what `torchrun --nproc_per_node=1 train_v2.py` gives the script, with a fresh port per
        # run (an outer torchrun's rendezvous store is not reused: its keys are per job)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return dict(setting, status="error", error=f"killed after --timeout {args.timeout:g} s")
        if os.path.exists(result_path):
            with open(result_path) as f:
                return json.load(f)
        tail = (proc.stderr or proc.stdout or "")[-3000:]
        status = "killed" if proc.returncode < 0 else "error"
        return dict(setting, status=status, returncode=proc.returncode, error=tail)


def check(args) -> dict:
    """--check: the checkout's pin, then its modules loaded here with the stand-ins and shims,
    its config built, its LR scheduler and margin loss made, and the drop-in run one CPU step
    with that margin loss. No GPU and no process group needed."""
    import importlib

    import torch

    from shardkit.softmax.partial_fc import PartialFC_V2

    info = setup.check_pinned(args.arcface_torch, args.allow_unpinned)
    stubs, shims = prepare(args.arcface_torch)
    for name in ("backbones", "dataset", "losses", "lr_scheduler", "partial_fc_v2", "utils.utils_callbacks"):
        importlib.import_module(name)
    cfg = importlib.import_module("utils.utils_config").get_config(
        setup.register_config(config_overrides(settings(args)[0], args, tempfile.gettempdir()))
    )
    margin_loss = importlib.import_module("losses").CombinedMarginLoss(64, *cfg.margin_list[:3])
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=cfg.lr)
    importlib.import_module("lr_scheduler").PolynomialLRWarmup(opt, warmup_iters=-1, total_iters=100)
    head = PartialFC_V2(margin_loss, 8, 50, cfg.sample_rate, False)
    loss = head(torch.randn(4, 8), torch.randint(0, 50, (4,)))
    loss.backward()
    return dict(checkout=info, stubs=stubs, shims=shims, config={k: cfg[k] for k in sorted(cfg) if k != "wandb_key"})


def prepare(root: str):
    """The checkout first on sys.path, stand-ins for missing packages, the torch shim."""
    sys.path.insert(0, root)
    stubs = setup.install_stubs()
    stubs += setup.stub_verification_if_unloadable()
    return stubs, setup.install_torch_compat()


def child_main(args) -> None:
    """One run: swap the head in, execute train_v2.py until the probe stops it, write JSON."""
    import runpy

    import torch

    setting = json.loads(args.child)
    result = dict({k: setting[k] for k in ("head", "classes", "sample_rate", "batch", "seed")}, status="error")
    try:
        result["checkout"] = setup.check_pinned(args.arcface_torch, args.allow_unpinned)
        result["stubs"], result["shims"] = prepare(args.arcface_torch)
        probe = setup.StepProbe(
            setting["warmup"],
            setting["steps"],
            setting["batch"],
            min_optimizer_steps=setting.get("min_optimizer_steps", 0),
            max_calls=setting.get("max_calls", 0),
        )
        _install_head(setting["head"], probe)
        config = setup.register_config(config_overrides(setting, args, setting["workdir"]))
        os.chdir(setting["workdir"])  # train_v2.py writes its log and tensorboard folder there
        sys.argv = [os.path.join(args.arcface_torch, "train_v2.py"), config]
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
            result["error"] = "train_v2.py ended before the timed steps were done"
        except setup.StopRun:
            result.update(**probe.result(), **_memory(probe))
            # a probe whose optimizer never stepped enough has no optimizer state in its peak
            result["status"] = "ok" if result["enough_optimizer_steps"] else "error"
            if not result["enough_optimizer_steps"]:
                result["error"] = f"only {probe.optimizer_steps} optimizer steps in {probe.calls - 1} training steps"
            result["optimizer"] = type(probe.optimizer).__name__ if probe.optimizer is not None else None
            base = type(probe.head).__mro__[1]  # the class the probe wraps
            result["head_class"] = f"{base.__module__}.{base.__name__}"
        except (torch.OutOfMemoryError, RuntimeError) as err:
            text = str(err)
            oom = isinstance(err, torch.OutOfMemoryError) or "out of memory" in text or "ALLOC_FAILED" in text
            result.update(status="oom" if oom else "error", error=text[:2000], **_memory(probe))
    except Exception as err:  # recorded, so the parent can go on with the other runs
        import traceback

        result["error"] = f"{type(err).__name__}: {err}\n{traceback.format_exc()[-2000:]}"
    result.update(_environment())
    with open(setting["result"], "w") as f:
        json.dump(result, f, indent=1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # DataLoader workers and the loader's thread need no orderly teardown


def _install_head(head: str, probe) -> None:
    """The head class train_v2.py will import as ``partial_fc_v2.PartialFC_V2``."""
    import torch

    import shardkit
    from shardkit.softmax.partial_fc import PartialFC_V2, SparseRowPartialFC_V2

    if head == "pfc":
        module = __import__("partial_fc_v2")
        module.PartialFC_V2 = setup.probed(module.PartialFC_V2, probe)
    else:
        cls = PartialFC_V2 if head == "shardkit" else SparseRowPartialFC_V2
        sys.modules["partial_fc_v2"] = setup.make_module("partial_fc_v2", PartialFC_V2=setup.probed(cls, probe))
    if head == "shardkit-sparse":
        # the docs' second changed line, `opt = shardkit.SparseRowSGD(...)`: train_v2.py looks
        # torch.optim.SGD up when it builds its optimizer
        class SGDToSparseRowSGD(torch.optim.SGD):
            def __new__(cls, *args, **kwargs):
                return shardkit.SparseRowSGD(*args, **kwargs)

        torch.optim.SGD = SGDToSparseRowSGD
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(lambda opt, args, kwargs: probe.after_optimizer_step(opt))


def _memory(probe) -> dict:
    """Peak and persistent GPU memory, and what the head and the optimizer hold of it."""
    import torch

    if not torch.cuda.is_available():
        return {}
    out = dict(
        peak_allocated=torch.cuda.max_memory_allocated(),
        peak_reserved=torch.cuda.max_memory_reserved(),
        # at the head's call of the step after the last timed one: weights, optimizer state and
        # that step's backbone activations (the gradients were freed by zero_grad)
        allocated_at_next_head_call=torch.cuda.memory_allocated(),
        device_total=torch.cuda.get_device_properties(0).total_memory,
    )
    opt = probe.optimizer
    if opt is not None and probe.head is not None:
        head_ids = {id(p) for p in probe.head.parameters()}

        def nbytes(tensors):
            return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

        params = [p for g in opt.param_groups for p in g["params"]]
        head = [p for p in params if id(p) in head_ids]
        rest = [p for p in params if id(p) not in head_ids]
        out.update(
            head_weight=nbytes(head),
            head_optimizer_state=nbytes(t for p in head for t in opt.state.get(p, {}).values()),
            backbone_weight_and_state=nbytes(rest) + nbytes(t for p in rest for t in opt.state.get(p, {}).values()),
        )
    return out


def _environment() -> dict:
    import torch

    import shardkit

    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return dict(
        device=dev, torch=torch.__version__, shardkit=shardkit.__version__, date=datetime.date.today().isoformat()
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        child_main(args)
    if args.check:
        report = check(args)
        print(json.dumps(report, indent=1, default=str))
        return 0
    setup.check_pinned(args.arcface_torch, args.allow_unpinned)  # fail here, not in every child
    results = []
    if args.max_classes:
        for head in args.head:
            for rate in args.sample_rate:
                for batch in args.batch:
                    base = dict(head=head, sample_rate=rate, batch=batch, seed=args.seeds[0])
                    results.append(search_max_classes(base, lambda s: run_one(s, args), args))
    else:
        for setting in settings(args):
            res = run_one(setting, args)
            results.append(res)
            speed = res.get("images_per_s")
            peak = res.get("peak_allocated")
            print(
                f"{res['head']:<16} C={res['classes']:<10} rate={res['sample_rate']:<5} B={res['batch']:<5} "
                f"seed={res['seed']:<6} {res['status']:<6} "
                + (f"{speed:9.1f} img/s  " if speed else " " * 17)
                + (f"peak {peak / 2**30:6.2f} GiB" if peak else ""),
                flush=True,
            )
    report = dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv), runs=results)
    curves = loss_curve_summary(results)
    if curves:
        report["loss_curves"] = curves
    path = args.out or os.path.join(_timing.out_dir(), "arcface_torch_run.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
