"""ModelEMA of an FSDP2-sharded model against the EMA of the same model unsharded, per rank.

Spawns --world gloo ranks on this machine (CPU; FSDP2 on CPUs needs torch 2.11+). Each rank
builds the model twice: unsharded (a plain ModelEMA of all of it, what every rank of a
data-parallel job runs today) and sharded with ``fully_shard`` over the world (a ModelEMA of
its local shards). The two updates alternate, --reps samples each after warm-up, medians per
rank. Expected: the sharded update moves 1/world of the bytes, so it takes about 1/world of
the time, plus the per-tensor host work, which sharding does not divide.

Models (benchmarks/bench_ema.py): "resnet50" (ResNet-50's 320 state_dict tensors, 25.6M
parameters) and "100m" (GPT shapes, 105M parameters). Dtypes: "fp32" (fp32 model and EMA),
"bf16" (bf16 model, fp32 EMA).

    python benchmarks/bench_ema_sharded.py --world 2
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing, bench_ema, whatever the cwd
from _timing import cpu_description, out_dir, prefer_in_place_build  # noqa: E402

prefer_in_place_build()
import shardkit  # noqa: E402


def _rank(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from bench_ema import build_model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        rows = []
        for which in args.models.split(","):
            for dt in args.dtypes.split(","):
                model_dtype = torch.float32 if dt == "fp32" else torch.bfloat16
                torch.manual_seed(0)
                plain, desc = build_model(which, model_dtype, "cpu")
                torch.manual_seed(0)
                sharded, _ = build_model(which, model_dtype, "cpu")
                fully_shard(sharded, mesh=mesh)
                emas = {
                    "unsharded": (shardkit.ModelEMA(plain, 0.999, tau=None, dtype=torch.float32), plain),
                    "sharded": (shardkit.ModelEMA(sharded, 0.999, tau=None, dtype=torch.float32), sharded),
                }
                times = {k: [] for k in emas}
                for i in range(args.reps + 2):
                    for name, (ema, model) in emas.items():
                        t0 = time.perf_counter()
                        ema.update(model)
                        if i >= 2:  # warm-up: the first update copies, the second builds the lists
                            times[name].append(time.perf_counter() - t0)
                state = emas["sharded"][0].state_dict()["module"]
                local = sum((v.to_local() if hasattr(v, "to_local") else v).nbytes for v in state.values())
                full = sum(v.nbytes for v in emas["unsharded"][0].state_dict()["module"].values())
                rows.append(
                    {
                        "model": which,
                        "desc": desc,
                        "dtype": dt,
                        "rank": rank,
                        "unsharded_ms": 1e3 * statistics.median(times["unsharded"]),
                        "sharded_ms": 1e3 * statistics.median(times["sharded"]),
                        "ema_bytes_sharded": local,
                        "ema_bytes_unsharded": full,
                        "tensors": len(state),
                    }
                )
                del plain, sharded, emas
        queue.put((rank, rows, None))
    except Exception as err:  # noqa: BLE001 (reported by the parent)
        queue.put((rank, [], repr(err)))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--models", default="resnet50,100m")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    if args.world < 1 or args.reps < 1:
        ap.error("--world and --reps take a count >= 1")
    threads = max(1, (os.cpu_count() or 1) // args.world)
    print(f"torch {torch.__version__}, world {args.world} gloo ranks on the CPU, {threads} torch thread(s) per rank")
    print(cpu_description())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join(timeout=120)
    errors = [f"rank {r}: {e}" for r, _, e in results if e]
    if errors:
        sys.exit("\n".join(errors))
    rows = sorted((row for _, rs, _ in results for row in rs), key=lambda r: (r["model"], r["dtype"], r["rank"]))
    print(f"\n{'model':9} {'dtype':5} {'rank':>4} {'unsharded ms':>13} {'sharded ms':>11} {'ratio':>6} {'EMA MB':>15}")
    for r in rows:
        mb = f"{r['ema_bytes_sharded'] / 2**20:.1f} / {r['ema_bytes_unsharded'] / 2**20:.1f}"
        ratio = r["unsharded_ms"] / r["sharded_ms"]
        print(
            f"{r['model']:9} {r['dtype']:5} {r['rank']:>4} {r['unsharded_ms']:13.2f} {r['sharded_ms']:11.2f} "
            f"{ratio:6.2f} {mb:>15}"
        )
    path = os.path.join(out_dir(), f"bench_ema_sharded_w{args.world}.json")
    with open(path, "w") as f:
        json.dump({"torch": torch.__version__, "world": args.world, "rows": rows}, f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
