"""Distributed ShardedSoftmaxLoss: world-size-1 step time against the one-process mode, and
collectives / bytes per step against InsightFace's PartialFC_V2 for the same shapes.

    python benchmarks/bench_distributed.py --device cpu                    # spawns 1 gloo rank
    python benchmarks/bench_distributed.py --device cuda                   # spawns 1 NCCL rank
    torchrun --standalone --nproc_per_node=1 benchmarks/bench_distributed.py --device cuda

Without torchrun the rank is a spawned process that rendezvous over TCP on a free local
port (asked of the OS; --port to pin one); if it dies or outlasts --timeout seconds the
script says so and exits non-zero instead of waiting forever.

The step is forward + backward of the head alone (embeddings are a leaf tensor), so the
distributed mode's extra work (size exchange, byte-packed all_gather, stats all_gather,
reduce-scatter; all trivial at world size 1 but still real collectives) is measured
against the identical kernels in the one-process mode. The two modes alternate step by
step (--iters samples each, after --warmup); medians; CUDA events on the GPU. One sample
times --steps consecutive steps (default 10 on the GPU) between one pair of events and
divides: in training, a step's host work (the size exchange, Python) overlaps the GPU work
queued before it, and a step timed alone from an idle GPU would charge it in full. The floor is the
layer's three GEMMs (logits, dX, dW) timed unfused with torch.mm at the same shapes
(on the GPU; on the CPU those stream a [B, C] matrix through memory and are no floor).

The communication table is computed from the shapes, not measured: ours from our code
path; PartialFC_V2 from its published code (all_gather of fp32 embeddings, all_gather of
int64 labels, all-reduces of the row max, the exp-sum and the target probability, a
reduce per rank of the fp32 embedding gradient, a .item() in backward, and the kept
[B_global, C/N] fp32 logits).
"""

import argparse
import json
import os
import queue as queue_mod
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # _timing, whatever the cwd (also under python -m)
import _timing  # noqa: E402

_timing.prefer_in_place_build()  # before the first import of shardkit
from _timing import checked_devices, out_dir, target_line, time_once  # noqa: E402

import shardkit  # noqa: E402
from shardkit.distributed import split_classes  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--classes", type=int, default=None, help="default: 200k on cpu, 1M on cuda")
    p.add_argument("--dim", type=int, default=None, help="default: 128 on cpu, 512 on cuda")
    p.add_argument("--batch", type=int, default=256, help="per-rank batch")
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: fp32 on cpu, bf16 on cuda")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--steps", type=int, default=None, help="consecutive steps per timed sample (default: 1 on cpu, 10 on cuda)"
    )
    p.add_argument("--table-worlds", default="1,8", help="world sizes of the communication table")
    p.add_argument("--port", type=int, default=0, help="rendezvous port of the spawned rank (0: a free one)")
    p.add_argument("--timeout", type=float, default=480.0, help="seconds to wait for the spawned rank")
    a = p.parse_args()
    checked_devices(p, "--device", [a.device])
    cpu = a.device == "cpu"
    a.classes = a.classes or (200_000 if cpu else 1_000_000)
    a.dim = a.dim or (128 if cpu else 512)
    a.dtype = a.dtype or ("fp32" if cpu else "bf16")
    a.iters = a.iters or (8 if cpu else 30)
    a.steps = a.steps or (1 if cpu else 10)
    if a.steps < 1:
        p.error("--steps must be >= 1")
    return a


def _step_fn(head, x, labels, steps=1):
    def step():
        for _ in range(steps):
            head.zero_grad(set_to_none=True)
            x.grad = None
            head(x, labels).backward()

    return step


def measure(args, device):
    """Median step seconds of (one-process, distributed) heads of the same shapes, and the
    GEMM time. Runs inside an initialized process group of world size 1."""
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.dim, device=device, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, args.classes, (args.batch,), device=device)
    margin = shardkit.ArcFace(s=64.0, m=0.5)
    common = dict(margin=margin, dtype=dtype, check_inputs=False)
    one = shardkit.ShardedSoftmaxLoss(args.dim, args.classes, devices=[device], **common)
    ours = shardkit.ShardedSoftmaxLoss(
        args.dim, args.classes, devices=[device], process_group=dist.group.WORLD, **common
    )
    shardkit.import_full_weight(ours, one.full_weight())
    k = args.steps
    steps = {"one_process_s": _step_fn(one, x, labels, k), "distributed_ws1_s": _step_fn(ours, x, labels, k)}
    for fn in steps.values():
        for _ in range(args.warmup):
            fn()
    # Alternate single steps so machine noise hits both modes alike; medians.
    times = {k: [] for k in steps}
    order = list(steps)
    for _ in range(args.iters):
        for key in order:
            times[key].append(time_once(steps[key], device) / k)
        order.reverse()  # neither mode always runs right after the other
    results = {k: statistics.median(v) for k, v in times.items()}
    w = one.weight_shards[0].detach()
    xd = x.detach()
    if args.classes * args.batch <= 2**28:  # the layer's three GEMMs unfused: logits, dX, dW
        g = torch.randn(args.batch, args.classes, device=device, dtype=dtype)

        def gemms():
            torch.mm(xd, w.t())
            torch.mm(g, w)
            torch.mm(g.t(), xd)

        gemms()
        results["gemm_s"] = statistics.median(time_once(gemms, device) for _ in range(max(3, args.iters // 2)))
    return results


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(args):
    """Runs _worker in one spawned process; its result, or SystemExit with the reason."""
    args.port = args.port or _free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(0, args, q))
    proc.start()
    deadline = time.monotonic() + args.timeout
    try:
        while True:
            try:
                res = q.get(timeout=1.0)
                break
            except queue_mod.Empty:
                if not proc.is_alive():
                    raise SystemExit(
                        f"bench_distributed: the rank process died (exit code {proc.exitcode}) "
                        "before reporting; its error is printed above"
                    )
                if time.monotonic() > deadline:
                    raise SystemExit(
                        f"bench_distributed: the rank process gave no result within {args.timeout:.0f} s (--timeout)"
                    )
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    return res


def _worker(rank, args, queue):
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{args.port}",
            rank=rank,
            world_size=1,
        )
    res = measure(args, device)
    dist.destroy_process_group()
    if queue is not None:
        queue.put(res)
    return res


def _wire(kind, nbytes, world):
    """Bytes a rank receives for one collective under ring algorithms (what NCCL uses for
    these sizes): all_gather (N-1) n, reduce_scatter / reduce (N-1)/N n, all_reduce 2(N-1)/N n."""
    factor = {
        "all_gather": world - 1,
        "reduce_scatter": (world - 1) / world,
        "reduce": (world - 1) / world,
        "all_reduce": 2 * (world - 1) / world,
    }[kind]
    return nbytes * factor


def comm_table(batch, dim, classes, dtype, world):
    """Collectives per training step, with each rank's input payload and the bytes it
    receives (ring estimate), from the shapes. Rows: (what, count, kind, payload bytes)."""
    elem = torch.empty((), dtype=DTYPES[dtype]).element_size()
    bg = batch * world
    c_local = split_classes(classes, world)[0]
    row = 8 + (dim * elem + 7) // 8 * 8
    ours = [
        ("CPU all_gather: batch sizes + error flag", 1, "all_gather", 4 * 8),
        ("all_gather labels+embeddings (bytes)", 1, "all_gather", batch * row),
        ("all_gather packed stats [3, B_g] fp32", 1, "all_gather", 3 * bg * 4),
        ("reduce_scatter dX [B_g, D]", 1, "reduce_scatter", bg * dim * elem),
    ]
    pfc = [
        ("all_gather embeddings fp32", 1, "all_gather", batch * dim * 4),
        ("all_gather labels int64", 1, "all_gather", batch * 8),
        ("all_reduce max [B_g] fp32", 1, "all_reduce", bg * 4),
        ("all_reduce exp-sum [B_g] fp32", 1, "all_reduce", bg * 4),
        ("all_reduce target prob [B_g] fp32", 1, "all_reduce", bg * 4),
        ("reduce dX [B, D] fp32 (one per rank)", world, "reduce", batch * dim * 4),
    ]
    ours = [(d, n, k, b, n * _wire(k, b, world)) for d, n, k, b in ours]
    pfc = [(d, n, k, b, n * _wire(k, b, world)) for d, n, k, b in pfc]
    mem = {"pfc_logits_bytes": bg * c_local * 4 * (2 if dtype != "fp32" else 1)}
    return ours, pfc, mem


def main():
    args = parse()
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        res = _worker(int(os.environ.get("LOCAL_RANK", 0)), args, None)
    else:
        res = _spawned(args)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"\nShardedSoftmaxLoss fwd+bwd, ArcFace, B={args.batch} D={args.dim} C={args.classes} {args.dtype} "
        f"on {device_name}, torch {torch.__version__}"
    )
    print(f"{'mode':32s} {'median ms':>10s} {'vs one-process':>15s}")
    base = res["one_process_s"]
    for key, label in (
        ("one_process_s", "one-process (devices=[dev])"),
        ("distributed_ws1_s", "process_group, world size 1"),
    ):
        print(f"{label:32s} {res[key] * 1e3:10.2f} {res[key] / base:14.3f}x")
    overhead = res["distributed_ws1_s"] / base - 1
    print(f"distributed overhead: {overhead * 100:+.1f}% (target <= +5% on the GPU)")
    targets = [
        target_line(
            f"distributed world size 1 ({args.device}) <= 5% over one-process",
            overhead <= 0.05 if args.device == "cuda" else None,
            f"{overhead * 100:+.1f}%" + ("" if args.device == "cuda" else " (target is for the GPU)"),
        )
    ]
    if "gemm_s" in res:
        # On the GPU this is the floor (the GEMMs at cuBLAS rate); on the CPU the unfused GEMMs
        # stream a [B, C] fp32 matrix through memory and can be slower than the fused step.
        print(
            f"the layer's 3 GEMMs unfused (logits, dX, dW; torch.mm): {res['gemm_s'] * 1e3:.2f} ms; "
            f"distributed step = {res['gemm_s'] / res['distributed_ws1_s'] * 100:.0f}% of that rate"
        )
    tables = {}
    for world in (int(w) for w in args.table_worlds.split(",")):
        ours, pfc, mem = comm_table(args.batch, args.dim, args.classes, args.dtype, world)
        tables[world] = {"ours": ours, "pfc_v2": pfc, **mem}
        print(
            f"\nPer-step communication per rank, world size {world} (computed from shapes; "
            f"b={args.batch}/rank, D={args.dim}, C={args.classes})"
        )
        for name, rows in (("ours", ours), ("PartialFC_V2", pfc)):
            count = sum(r[1] for r in rows)
            print(
                f"  {name}: {count} collectives, {sum(r[1] * r[3] for r in rows) / 2**20:.3f} MiB payload in, "
                f"{sum(r[4] for r in rows) / 2**20:.3f} MiB received (ring estimate)"
                + ("; plus a .item() host sync in backward" if name == "PartialFC_V2" else "")
            )
            for desc, n, _, nbytes, wire in rows:
                print(f"     {n} x {desc:42s} in {nbytes / 2**10:10.1f} KiB   received {wire / 2**10:10.1f} KiB")
        print(
            f"  logits held: ours one chunk [B_g, chunk] (the op's default budget; 192 MiB on GPUs); "
            f"PartialFC_V2 the whole [B_g, C/N] = {mem['pfc_logits_bytes'] / 2**20:.1f} MiB (fp32"
            f"{' + the autocast copy' if args.dtype != 'fp32' else ''})"
        )
    folder = out_dir()
    blob = {
        "args": vars(args),
        "device": device_name,
        "torch": torch.__version__,
        "times": res,
        "tables": {str(k): v for k, v in tables.items()},
        "targets": targets,
    }
    with open(os.path.join(folder, f"bench_distributed_{args.device}.json"), "w") as f:
        json.dump(blob, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(["one-process", "world size 1"], [base * 1e3, res["distributed_ws1_s"] * 1e3])
        ax.set_ylabel("ms per fwd+bwd")
        ax.set_title(f"{args.device}: B={args.batch} D={args.dim} C={args.classes}")
        fig.tight_layout()
        fig.savefig(os.path.join(folder, f"bench_distributed_{args.device}.png"))
    except ImportError:
        pass


if __name__ == "__main__":
    main()
