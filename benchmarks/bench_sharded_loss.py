"""Benchmark: ShardedSoftmaxLoss fwd+bwd time and extra memory against its peers.

Peers, in the same run and on the same inputs:
  (a) nn.Linear(D, C, bias=False) + F.cross_entropy (full logits; the cross-entropy in fp32,
      `.float()` on 16-bit logits, as torch.autocast runs F.cross_entropy: that fp32 copy is in
      its memory),
  (b) torch's F.linear_cross_entropy, where the installed torch has it,
  (c) Apple's cut-cross-entropy, twice: "cce_filtered" with its default ``filter_eps`` (its
      backward skips the gradient tiles whose softmax values all fall below eps: an
      approximate gradient, and at random init most tiles are skipped) and "cce_exact" with
      ``filter_eps=None`` (every tile: the exact gradient, the fair comparison),
      (both GPU only), and its impl="torch_compile" mode, "cce_torch_compile" (the full
      logits and a torch.compile'd fp32 cross-entropy over them; it also runs on the CPU),
  (d) Liger's fused linear cross-entropy (GPU only; each peer when importable: see
      benchmarks/requirements.txt),
  (e) QuACK's chunked_linear_cross_entropy (GPU only, sm90+; `pip install quack-kernels`),
and shardkit at memory budgets ("shardkit@<budget>", --budgets: kept logits, see the README).
The baseline: the layer's three GEMMs of the same shapes (logits = X W^T, dX = G W, dW = G^T X;
dX written in fp32 on CUDA, as shardkit accumulates it), timed interleaved with each method:
its repetitions alternate with the method's in the same process, and each row's "x GEMMs" is
the ratio of the two medians, with the 25th-75th percentiles of the per-repetition ratios.

"Extra memory" is the peak memory of one fwd+bwd step beyond what is live before it
(embeddings, weights) and the gradients it produces (every step starts with .grad = None,
as after optimizer.zero_grad()):
  GPU: torch.cuda.max_memory_allocated() minus memory_allocated() before the step (exact).
  CPU: each method's memory is measured in a fresh subprocess with MALLOC_MMAP_THRESHOLD_=65536
       (glibc then maps every large buffer on its own and unmaps it when freed, so freed memory
       does not hide in the heap); after a warm-up step the peak-RSS counter is reset
       (/proc/self/clear_refs = 5) and extra = VmHWM after the step - VmRSS before it. Its times
       come from a second fresh subprocess with glibc's default allocation (mapping every large
       buffer afresh would slow the methods that allocate per step, the peers above all).

Usage:
  python benchmarks/bench_sharded_loss.py --cpu-target          # CPU, fp32, B=256: D=128 C=200k and D=512 C=100k
      # (with shardkit at budgets 25%, 50% and the full logits: --budgets)
  python benchmarks/bench_sharded_loss.py --cpu-target --shape 256 100000 512 --methods shardkit \
      shardkit@25% shardkit@50% shardkit@full cce_torch_compile --rounds 2 --repeat 5
      # the memory-budget CPU targets only (on a shared machine add --clock user --threads 1)
  python benchmarks/bench_sharded_loss.py --device cuda         # D=512, B {256,1024}, C {100k,1M} bf16
  SHARDKIT_CUDA_KEEP=1 python benchmarks/bench_sharded_loss.py --device cuda --llm-shapes --budgets full
      # also tokens {4096,8192} x vocabulary {128256,256000} x hidden 4096, with shardkit keeping
      # the logits (the experimental CUDA kept path; without the switch CUDA budgets recompute)
  python benchmarks/bench_sharded_loss.py --device cuda --max-classes-only   # largest trainable C per method
  python benchmarks/bench_sharded_loss.py --device cuda --max-classes-only --master-weights
      # the same with fp32 master weights and momentum beside the 16-bit ones, and an SGD step
Writes bench_sharded_loss[_maxc][_master].json and .png to benchmarks/out/ (or $SHARDKIT_BENCH_OUT),
rewritten as each shape (and each method's largest-C search) finishes, with that shape's
TARGET lines printed then: a run stopped part-way keeps everything that finished.

GPU run time: each method's timed steps are capped at --method-budget seconds (slow peers
get fewer steps; at least 3); the largest-C search runs each method in its own subprocess
(an illegal address or a kernel's int32 overflow at huge C kills that process, not the
run) with --search-budget seconds each (or, with --search-total S, S seconds shared out: twice
as much for shardkit as for each other method), reporting the largest C that trained so far.
Targets (issues 3, 10, 16 and 40) are printed as TARGET lines; a second PNG plots each
shape's time against extra memory for every method and budget.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # _timing, whatever the cwd (also under python -m)
import _timing  # noqa: E402

_timing.prefer_in_place_build()  # before the first import of shardkit

from _sharded_loss_methods import (  # noqa: E402
    CCE,
    PEERS,
    budget_bytes,
    budget_of,
    build_gemms,
    check_budget_spec,
    method_notes,
    peer_forward,
    unavailable,
)
from _sharded_loss_report import check_largest_target, check_shape_targets, save  # noqa: E402
from _timing import cpu_description, time_once  # noqa: E402

import shardkit  # noqa: E402

METHODS = ["shardkit", "shardkit+checks", *PEERS]
# The largest-C search: shardkit's own search gets SHARDKIT_SHARE shares of the time, each
# other method one (its C is the one the issues ask for; ~35M classes on an 80 GB GPU, ~15 probes).
MAXC_METHODS = ("shardkit", "linear+cross_entropy", *CCE, "liger_flce", "quack_lce")
SHARDKIT_SHARE = 2
# The large-vocabulary LLM shapes (tokens, vocabulary, hidden) beside the face-recognition ones.
LLM_SHAPES = [(b, c, 4096) for c in (128_256, 256_000) for b in (4096, 8192)]
# --budgets on the CPU; none on GPUs (the CUDA kept path is experimental: SHARDKIT_CUDA_KEEP=1)
DEFAULT_CPU_BUDGETS = ("25%", "50%", "full")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


CPU_CLOCK = None  # --clock cpu / user: CPU timings in process CPU (or user) seconds
THREADS = None  # --threads: torch threads on the CPU (None: torch's default)
SHARDS = 1  # shards of the shardkit head, all on the benchmark device (--shards)
OWN_FAILURES = []  # shardkit's own failures: the run still reports the peers, then exits 1


def _head_without_default_init(dim, classes, devices, dtype, check_inputs, memory_budget=0):
    """The head with its shards allocated (uninitialized) on ``devices``: the default init draws
    nn.Linear's numbers on the CPU, seconds per million classes, so it is skipped here and the
    caller draws the weights on the device (the module refuses "meta" shards, so the usual
    meta-then-to_empty route is closed)."""
    cls = shardkit.ShardedSoftmaxLoss
    default_init = cls.reset_parameters
    cls.reset_parameters = lambda self: None
    try:
        return cls(dim, classes, devices=devices, dtype=dtype, check_inputs=check_inputs, memory_budget=memory_budget)
    finally:
        cls.reset_parameters = default_init


MASTER_LR, MASTER_MOMENTUM = 1e-3, 0.9  # the --master-weights update (its values do not matter)


def build_step(method, batch, classes, dim, dtype, device, master=False):
    """Allocates inputs + parameters; returns (fwd+bwd closure, tensors that get a .grad).

    Each step starts with the gradients set to None, as after optimizer.zero_grad() (torch's
    default), so every method allocates its gradients afresh and none needs an extra
    gradient-sized buffer to accumulate into an old one.

    ``master``: every method's weights also get an fp32 master copy (the weights themselves
    when they are fp32) and an fp32 momentum buffer, and each step ends with an SGD update
    (momentum, then the master, then the weights copied from it): the mixed-precision
    training setting, 8 more bytes per 16-bit weight, alike for every method."""
    x = torch.randn(batch, dim, device=device, dtype=dtype, requires_grad=True)
    y = torch.randint(0, classes, (batch,), device=device)
    if method.startswith("shardkit"):
        spec = budget_of(method)
        budget = 0 if spec is None else budget_bytes(spec, batch, classes, dtype, SHARDS, device)
        head = _head_without_default_init(
            dim, classes, [device] * SHARDS, dtype, method == "shardkit+checks", memory_budget=budget
        )
        with torch.no_grad():
            for shard in head.weight_shards:
                shard.uniform_(-(dim**-0.5), dim**-0.5)
        params = [x, *head.weight_shards]
        fwd = lambda: head(x, y)  # noqa: E731
    else:
        weight = torch.empty(classes, dim, device=device, dtype=dtype).uniform_(-(dim**-0.5), dim**-0.5)
        weight.requires_grad_(True)
        params = [x, weight]
        fwd = peer_forward(method, x, weight, y)

    update = _master_update(params[1:], dtype) if master else None

    def step():
        for p in params:
            p.grad = None
        loss = fwd()
        loss.backward()
        if update is not None:
            update()
        return loss

    return step, params


def _master_update(weights, dtype):
    """The SGD-with-momentum update of ``weights`` through fp32 master copies; all in place,
    so the update itself needs no temporary of a weight's size."""
    separate = dtype != torch.float32  # fp32 weights are their own master
    masters = [w.detach().float() if separate else w.detach() for w in weights]
    moments = [torch.zeros_like(m) for m in masters]

    @torch.no_grad()
    def update():
        for w, m, v in zip(weights, masters, moments):
            v.mul_(MASTER_MOMENTUM).add_(w.grad)  # fp32 += the gradient in its own dtype
            m.add_(v, alpha=-MASTER_LR)
            if separate:
                w.copy_(m)

    return update


METHOD_BUDGET_S = 20.0  # GPU: seconds of timed steps per method and shape (--method-budget)


def time_interleaved(step, gemms, device, repeat):
    """(method seconds, baseline seconds): ``repeat`` timed steps of each, alternating a step of
    the method with one of the three-GEMM baseline (2 warm-up pairs; CUDA: events, device
    sync), so that a change of the machine's load or clocks hits both alike. On the GPU, a
    method whose step is slow gets fewer pairs (at least 3) so that they take about
    METHOD_BUDGET_S: one slow peer must not use up the run's time."""
    if device.type == "cuda":
        step()
        gemms()
        first = timed(step, device) + timed(gemms, device)
        repeat = max(3, min(repeat, int(METHOD_BUDGET_S / max(first, 1e-6))))
    else:
        for _ in range(2):
            step()
            gemms()
    times, floor = [], []
    for _ in range(repeat):
        times.append(timed(step, device))
        floor.append(timed(gemms, device))
    return times, floor


def timed(fn, device):
    """Seconds of one call: time_once's (CUDA events, or wall clock), or on the CPU with
    ``--clock cpu`` the process's CPU seconds (user + system, all its threads) and with
    ``--clock user`` its user seconds alone. On a machine shared with busy processes these count
    the work done rather than the waits for a core (with --threads 1 nothing else is left out);
    "user" also leaves out the kernel's time, page faults of fresh buffers included, which
    there varies with the other processes' memory (huge-page compaction)."""
    if CPU_CLOCK and device.type == "cpu":
        t0 = _cpu_seconds()
        fn()
        return _cpu_seconds() - t0
    return time_once(fn, device, sync="device")


def _cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + (usage.ru_stime if CPU_CLOCK == "cpu" else 0.0)


def _rss_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(method, batch, classes, dim, dtype, device, repeat, part="both"):
    """{'times_s', 'floor_times_s', 'extra_mib'} for one method in this process: its step
    times and those of the three-GEMM baseline timed interleaved with them, and extra = peak
    of one step beyond the memory live before it and the gradients it leaves (``part``:
    "memory" or "times" for one of the two)."""
    step, params = build_step(method, batch, classes, dim, dtype, device)
    step()  # warm-up (allocator pools, kernels' first-use costs)
    for p in params:
        p.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = _rss_kib("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        step()
        peak = _rss_kib("VmHWM") * 1024 - base
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    res = {"extra_mib": (peak - grads) / 2**20}
    if part == "memory":
        return res
    gemms = build_gemms(batch, classes, dim, dtype, device)  # after the memory figure: not in it
    res["times_s"], res["floor_times_s"] = time_interleaved(step, gemms, device, repeat)
    if part == "times":
        del res["extra_mib"]
    return res


def measure_isolated(method, batch, classes, dim, dtype_name, device, repeat):
    """CPU: two fresh subprocesses per method, its memory and its times (see the module docstring)."""
    res = _child_run(method, batch, classes, dim, dtype_name, device, repeat, "memory")
    res.update(_child_run(method, batch, classes, dim, dtype_name, device, repeat, "times"))
    return res


def _child_run(method, batch, classes, dim, dtype_name, device, repeat, part):
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if part == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--_child",
        method,
        "--_part",
        part,
        "--batch",
        str(batch),
        "--classes",
        str(classes),
        "--dim",
        str(dim),
        "--dtype",
        dtype_name,
        "--device",
        str(device),
        "--repeat",
        str(repeat),
        "--shards",
        str(SHARDS),
        "--clock",
        CPU_CLOCK or "wall",
        *(["--threads", str(THREADS)] if THREADS else []),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fits(method, batch, classes, dim, dtype, device, master=False):
    """(ok, error) of two fwd+bwd steps at C=classes with a finite loss; frees everything."""
    step = params = None  # noqa: F841  (drops the references before the sync)
    try:
        step, params = build_step(method, batch, classes, dim, dtype, device, master)
        step()
        loss = step()
        ok = bool(torch.isfinite(loss.detach().float()).item())  # a wrong result is no success
        return ok, None if ok else "non-finite loss"
    except torch.OutOfMemoryError:
        return False, "out of memory"
    except Exception as err:  # e.g. a grid or index limit of a peer's kernel at this C: does not fit
        # (a sticky CUDA error fails every later probe too: the search then ends at the last
        # C that trained, and the probes' errors say why)
        return False, f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
    finally:
        step = params = None  # noqa: F841  (drop the references before the sync)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def max_classes_child(method, batch, dim, dtype, device, lo=100_000, hi=1 << 27, master=False):
    """Doubling then bisection (to ~3%) for the largest C that trains; prints one JSON line
    per probe (flushed), so the parent keeps every probe even if this process dies."""

    def probe(classes):
        t0 = time.perf_counter()
        ok, err = _fits(method, batch, classes, dim, dtype, device, master)
        print(json.dumps({"classes": classes, "ok": ok, "error": err, "s": time.perf_counter() - t0}), flush=True)
        return ok

    if not probe(lo):
        return
    good = lo
    while good * 2 <= hi and probe(good * 2):
        good *= 2
    bad = good * 2 if good * 2 <= hi else hi + 1  # the smallest C known (or assumed) not to fit
    while bad - good > good // 32:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if probe(mid) else (good, mid)


def max_classes(method, batch, dim, dtype_name, device, budget_s, lo, hi, master=False):
    """Largest C that trains for ``method``, searched in a subprocess bounded by budget_s
    seconds. Returns a dict: largest (0 if even the smallest failed), complete (the search
    finished), probes, and the reason it stopped early if it did."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--_maxc_child",
        method,
        "--batch",
        str(batch),
        "--dim",
        str(dim),
        "--dtype",
        dtype_name,
        "--device",
        str(device),
        "--shards",
        str(SHARDS),
        "--max-classes-range",
        str(lo),
        str(hi),
        *(["--master-weights"] if master else []),
    ]
    stopped = None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err, rc, stopped = "", None, f"search stopped at its {budget_s:.0f} s budget"
    probes = []
    for line in out.splitlines():
        if line.startswith("{"):
            probes.append(json.loads(line))
    if rc not in (0, None):
        tail = err.strip().splitlines()[-1] if err.strip() else f"exit code {rc}"
        stopped = f"search process died: {tail[:160]}"
    largest = max((p["classes"] for p in probes if p["ok"]), default=0)
    return {"largest": largest, "complete": stopped is None, "stopped": stopped, "probes": probes}


def summarize(res):
    """A method's medians: its step time, its interleaved baseline's (gemm_floor_s), their ratio
    and the 25th-75th percentiles of the per-repetition ratios (the spread)."""
    times, floor = res["times_s"], res["floor_times_s"]
    pairs = sorted(t / f for t, f in zip(times, floor))
    quart = statistics.quantiles(pairs, n=4, method="inclusive") if len(pairs) > 1 else [pairs[0]] * 3
    time_s, floor_s = statistics.median(times), statistics.median(floor)
    return dict(
        res,
        time_s=time_s,
        gemm_floor_s=floor_s,
        gemm_ratio=time_s / floor_s,
        gemm_ratio_p25=quart[0],
        gemm_ratio_p75=quart[2],
    )


def run(args):
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    shapes = args.shapes if args.shapes is not None else [(b, c, args.dim) for b in args.batch for c in args.classes]
    rows, largest, targets = [], {}, []
    notes = method_notes()

    def emit():  # after each shape and each largest-C search: a run stopped later keeps these
        save(rows, largest, targets, args, notes, complete=False)

    print(
        f"# torch {torch.__version__}, shardkit head with {SHARDS} shard(s), device {device}"
        f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, dtype {args.dtype}"
    )
    if device.type == "cpu":
        print(f"# {cpu_description()}; timed by {CPU_CLOCK + ' time of the process' if CPU_CLOCK else 'wall clock'}")
    if device.type == "cuda":
        for method in CCE:
            print(f"# {method}: {notes[method]}")
    for batch, classes, dim in shapes:
        print(f"\nB={batch} C={classes} D={dim}:")
        # Rounds run the methods interleaved (and re-measure the floor), so a change in the
        # machine's load between methods does not masquerade as a speed difference.
        results = {}
        for _ in range(args.rounds):
            for method in args.methods or METHODS + [f"shardkit@{b}" for b in args.budgets]:
                if method == "shardkit+checks" and device.type != "cuda":
                    if method not in results:
                        results[method] = None
                        print(f"  {method:28s} skipped: on the CPU the default check costs no sync (the shardkit row)")
                    continue
                reason = unavailable(method, device)
                if reason:
                    if method not in results:
                        print(f"  {method:28s} skipped: {reason}")
                        results[method] = None
                    continue
                try:
                    if device.type == "cpu":
                        res = measure_isolated(method, batch, classes, dim, args.dtype, device, args.repeat)
                    else:
                        res = measure(method, batch, classes, dim, dtype, device, args.repeat)
                        torch.cuda.empty_cache()
                except Exception as err:  # a peer's failure (OOM, Triton error) must not end the run
                    detail = (
                        err.stderr.strip().splitlines()[-1]
                        if isinstance(err, subprocess.CalledProcessError) and err.stderr.strip()
                        else str(err).splitlines()[0]
                        if str(err)
                        else ""
                    )
                    print(f"  {method:28s} failed: {type(err).__name__}: {detail[:120]}")
                    if method.startswith("shardkit") and not isinstance(err, torch.OutOfMemoryError):
                        OWN_FAILURES.append(f"{method} at B={batch} C={classes} D={dim}: {detail[:200]}")
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    results[method] = None
                    continue
                if results.get(method) is None:
                    results[method] = {"times_s": [], "floor_times_s": [], "extra_mib": 0.0}
                results[method]["times_s"] += res["times_s"]
                results[method]["floor_times_s"] += res["floor_times_s"]
                results[method]["extra_mib"] = max(results[method]["extra_mib"], res["extra_mib"])
        results = {m: summarize(r) for m, r in results.items() if r}
        if not results:
            continue
        floor_t = statistics.median(t for r in results.values() for t in r["floor_times_s"])
        rate = 6.0 * batch * classes * dim / floor_t / 1e9
        print(
            f"  baseline: the 3 GEMMs take {floor_t * 1e3:.2f} ms ({rate:.1f} GFLOP/s; median over every "
            "method's interleaved repetitions; each row's ratio uses its own)"
        )
        base = results.get("linear+cross_entropy")
        print(
            f"  {'method':28s} {'time ms':>9s} {'x (a)':>7s} {'x GEMMs [p25-p75]':>20s} {'% floor':>8s} "
            f"{'extra MiB':>10s} {'x (a)':>7s}"
        )
        shape_rows = []
        for method, res in results.items():
            t_ratio = res["time_s"] / base["time_s"] if base else float("nan")
            m_ratio = res["extra_mib"] / base["extra_mib"] if base and base["extra_mib"] > 0 else float("nan")
            spread = f"{res['gemm_ratio']:.2f} [{res['gemm_ratio_p25']:.2f}-{res['gemm_ratio_p75']:.2f}]"
            print(
                f"  {method:28s} {res['time_s'] * 1e3:9.2f} {t_ratio:7.2f} {spread:>20s} "
                f"{100 / res['gemm_ratio']:7.1f}% {res['extra_mib']:10.1f} {m_ratio:7.3f}"
            )
            shape_rows.append(
                dict(
                    method=method,
                    batch=batch,
                    classes=classes,
                    dim=dim,
                    dtype=args.dtype,
                    device=str(device),
                    gemm_gflops=6.0 * batch * classes * dim / res["gemm_floor_s"] / 1e9,
                    time_ratio_vs_a=t_ratio,
                    extra_ratio_vs_a=m_ratio,
                    **res,
                )
            )
        rows.extend(shape_rows)
        targets.extend(check_shape_targets(shape_rows, device, args.dtype))
        emit()
    if args.max_classes or args.max_classes_only:
        if device.type != "cuda" and args.max_classes_range is None:
            print("\n--max-classes needs --device cuda (on the CPU only with an explicit --max-classes-range)")
        else:
            lo, hi = args.max_classes_range or (100_000, 1 << 27)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the search runs in subprocesses: leave them the memory
            methods = [m for m in MAXC_METHODS if not unavailable(m, device)]
            for m in MAXC_METHODS:
                if m not in methods:
                    print(f"  {m:28s} skipped: {unavailable(m, device)}")
            shares = {m: SHARDKIT_SHARE if m == "shardkit" else 1 for m in methods}
            # --search-total S: the search ends within S s of here; each method gets its share
            # of what is left when it starts (time a quick search leaves goes to the next).
            deadline = time.monotonic() + args.search_total if args.search_total else None
            per = (
                f"{args.search_total:.0f} s in all, shared {SHARDKIT_SHARE}:1 between shardkit and each other method"
                if deadline
                else f"<= {args.search_budget:.0f} s per method, {SHARDKIT_SHARE}x that for shardkit"
            )
            print(
                f"\nlargest C one GPU trains (B={args.batch[-1]}, D={args.dim}, {args.dtype}"
                f"{', with fp32 master weights and momentum' if args.master_weights else ''}; {per}):",
                flush=True,
            )
            for i, method in enumerate(methods):
                if deadline is None:
                    budget = args.search_budget * shares[method]
                else:
                    left = deadline - time.monotonic()
                    budget = left * shares[method] / sum(shares[m] for m in methods[i:])
                if budget < 10:
                    print(f"  {method:28s} not searched: {max(budget, 0):.0f} s left for it", flush=True)
                    continue
                res = max_classes(
                    method, args.batch[-1], args.dim, args.dtype, device, budget, lo, hi, args.master_weights
                )
                largest[method] = res
                note = "" if res["complete"] else f"  (at least; {res['stopped']})"
                fails = sorted({p["error"] for p in res["probes"] if not p["ok"] and p["error"]})
                print(
                    f"  {method:28s} {res['largest']:>12,d}{note}"
                    + (f"  [failed probes: {'; '.join(fails)[:100]}]" if fails else ""),
                    flush=True,
                )
                if method in ("shardkit", "linear+cross_entropy"):
                    targets.extend(check_largest_target(largest))
                emit()
    return rows, largest, targets


def method_arg(name):
    """A --methods entry: a known method or shardkit@<budget>."""
    if name in METHODS:
        return name
    if name.startswith("shardkit@"):
        try:
            check_budget_spec(name[len("shardkit@") :])
            return name
        except (ValueError, TypeError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    raise argparse.ArgumentTypeError(f"unknown method {name!r}: one of {', '.join(METHODS)} or shardkit@<budget>")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--batch", type=int, nargs="+", default=None)
    p.add_argument("--classes", type=int, nargs="+", default=None)
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--repeat", type=int, default=None, help="timed steps per method per round")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 2 on CPU, 1 on GPU)")
    p.add_argument("--cpu-target", action="store_true", help="the CPU target case: D=128, B=256, C=200k fp32")
    p.add_argument("--max-classes", action="store_true", help="GPU: also the largest C each method trains")
    p.add_argument("--max-classes-only", action="store_true", help="GPU: only the largest-C search")
    p.add_argument("--search-budget", type=float, default=120.0, help="seconds per method for the largest-C search")
    p.add_argument(
        "--search-total",
        type=float,
        default=None,
        help="seconds for the whole largest-C search, shared out between the methods (overrides --search-budget)",
    )
    p.add_argument("--method-budget", type=float, default=20.0, help="GPU: seconds of timed steps per method/shape")
    p.add_argument(
        "--max-classes-range",
        type=int,
        nargs=2,
        default=None,
        metavar=("LO", "HI"),
        help="search range of the largest-C search (default 100000 134217728)",
    )
    p.add_argument(
        "--master-weights",
        action="store_true",
        help="largest-C search: each method also keeps fp32 master weights and momentum and takes an SGD step",
    )
    p.add_argument("--_maxc_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shards", type=int, default=1, help="shards of the shardkit head (all on --device)")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu", "user"),
        default="wall",
        help="CPU timing: wall clock (default), the process's CPU time (cpu: user + system) or its user time "
        "(for a machine shared with busy processes; best with --threads 1)",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU: torch threads of every method (default: torch's)")
    p.add_argument(
        "--methods",
        nargs="+",
        type=method_arg,
        default=None,
        help=f"time only these methods (default: all): {', '.join(METHODS)} or shardkit@<budget>",
    )
    p.add_argument(
        "--budgets",
        nargs="*",
        type=check_budget_spec,
        default=None,
        help="shardkit memory budgets to time beside budget 0: sizes (256MiB), N%% of the full logits, or "
        f"full (default: {' '.join(DEFAULT_CPU_BUDGETS).replace('%', '%%')} on the CPU, none on GPUs, where "
        "shards recompute unless SHARDKIT_CUDA_KEEP=1)",
    )
    p.add_argument(
        "--shape",
        type=int,
        nargs=3,
        action="append",
        default=None,
        metavar=("B", "C", "D"),
        help="a shape to time (repeatable; replaces --batch/--classes/--dim and --cpu-target's shapes)",
    )
    p.add_argument(
        "--llm-shapes",
        action="store_true",
        help="also the large-vocabulary shapes: tokens 4096 and 8192 x vocabulary 128256 and 256000 x hidden 4096",
    )
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_part", default="both", help=argparse.SUPPRESS)
    args = p.parse_args()
    for flag, value in (("--repeat", args.repeat), ("--rounds", args.rounds), ("--threads", args.threads)):
        if value is not None and value < 1:
            p.error(f"{flag} takes a count >= 1, got {value} (leave it out for the default)")
    if args.shards < 1:
        p.error(f"--shards takes a count >= 1, got {args.shards}")
    for flag, values in (("--batch", args.batch), ("--classes", args.classes), ("--dim", [args.dim])):
        if any(v is not None and v < 1 for v in values or []):
            p.error(f"{flag} takes sizes >= 1, got {values}")
    for shape in args.shape or []:
        if min(shape) < 1:
            p.error(f"--shape takes B C D >= 1, got {' '.join(map(str, shape))}")
    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        p.error(f"--device {args.device!r}: {err}")
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        p.error(f"--device {args.device!r}: needs 'cpu' or a visible CUDA device")
    if args.cpu_target and device.type != "cpu":
        p.error("--cpu-target runs on the CPU: leave out --device (or give --device cpu)")
    if args.master_weights and not (args.max_classes or args.max_classes_only or args._maxc_child):
        p.error("--master-weights applies to the largest-C search: add --max-classes or --max-classes-only")
    global SHARDS, METHOD_BUDGET_S, CPU_CLOCK, THREADS
    SHARDS, METHOD_BUDGET_S = args.shards, args.method_budget
    CPU_CLOCK, THREADS = (None if args.clock == "wall" else args.clock), args.threads
    if THREADS:
        torch.set_num_threads(THREADS)
    args.shapes = None
    if args.cpu_target:  # issue 16's two CPU shapes (unless --batch/--classes/--dim narrow them)
        args.device, args.dtype = "cpu", args.dtype or "fp32"
        if not (args.batch or args.classes or args.dim):
            args.shapes = [(256, 200_000, 128), (256, 100_000, 512)]
        args.batch, args.classes, args.dim = args.batch or [256], args.classes or [200_000], args.dim or 128
    gpu = torch.device(args.device).type == "cuda"
    args.dtype = args.dtype or ("bf16" if gpu else "fp32")
    args.batch = args.batch or ([256, 1024] if gpu else [256])
    args.classes = args.classes or ([100_000, 1_000_000] if gpu else [200_000])
    args.dim = args.dim or (512 if gpu else 128)
    args.repeat = args.repeat or (20 if gpu else 3)
    args.rounds = args.rounds or (1 if gpu else 2)
    if args._child:
        res = measure(
            args._child,
            args.batch[0],
            args.classes[0],
            args.dim,
            DTYPES[args.dtype],
            torch.device(args.device),
            args.repeat,
            args._part,
        )
        print(json.dumps(res))
        return
    if args._maxc_child:
        lo, hi = args.max_classes_range or (100_000, 1 << 27)
        max_classes_child(
            args._maxc_child,
            args.batch[-1],
            args.dim,
            DTYPES[args.dtype],
            torch.device(args.device),
            lo,
            hi,
            args.master_weights,
        )
        return
    if args.budgets is None:
        args.budgets = [] if gpu else list(DEFAULT_CPU_BUDGETS)
    budgeted = args.budgets or any(budget_of(m) for m in args.methods or [])
    if gpu and budgeted and os.environ.get("SHARDKIT_CUDA_KEEP") != "1":
        print("note: SHARDKIT_CUDA_KEEP is not 1: the shardkit@<budget> rows recompute like budget 0", flush=True)
    if args.shape:
        args.shapes = [tuple(shape) for shape in args.shape]
    if args.llm_shapes:
        args.shapes = (args.shapes or [(b, c, args.dim) for b in args.batch for c in args.classes]) + LLM_SHAPES
    if args.max_classes_only:
        args.classes, args.shapes = [], []  # no timed shapes
    rows, largest, targets = run(args)
    print()
    save(rows, largest, targets, args, method_notes(), complete=True)
    if OWN_FAILURES:
        sys.exit(
            "bench_sharded_loss: shardkit itself failed (a benchmark bug or a regression):\n  "
            + "\n  ".join(OWN_FAILURES)
        )


if __name__ == "__main__":
    main()
