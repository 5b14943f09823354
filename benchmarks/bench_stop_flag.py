"""The per-step cost of the trainer's Ctrl-C agreement under torchrun: one gloo all-reduce (MAX)
of a one-element int32 CPU tensor between 2 spawned processes on this machine.

Usage: ``python benchmarks/bench_stop_flag.py [--calls N]``; prints microseconds per call."""

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, init_file: str, calls: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    flag = torch.tensor([0], dtype=torch.int32)
    for _ in range(100):  # warm-up
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    t0 = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if rank == 0:
        us = (time.perf_counter() - t0) / calls * 1e6
        print(f"gloo all_reduce of one int, 2 ranks, this machine: {us:.1f} us per step")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(os.path.join(tmp, "init"), args.calls), nprocs=2)


if __name__ == "__main__":
    main()
