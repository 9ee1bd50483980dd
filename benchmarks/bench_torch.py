"""Per-layer forward+backward time of hvd_syncbn's SyncBatchNorm against its baselines.

    python benchmarks/bench_torch.py                      # 1 rank: ours vs nn.BatchNorm2d
    horovodrun -np 2 python benchmarks/bench_torch.py     # 2 ranks: ours vs local BN + floor

At 1 rank the baseline is ``nn.BatchNorm2d``. At N ranks it is local ``nn.BatchNorm2d``
plus the communication floor: the time of the same two raw Horovod allreduces
(``2C+1`` float64 forward, ``2C`` float32 backward) that our layer makes. Every number
is measured in this run; rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

import horovod.torch as hvd
from hvd_syncbn.torch import SyncBatchNorm

SHAPES = [(8, 64, 56, 56), (2, 256, 64, 64), (8, 512, 28, 28), (4, 2048, 7, 7), (2, 64, 128, 128)]


def timed(fns, iters: int, warmup: int = 3) -> list:
    """Median milliseconds of each ``fn()``, interleaved in rotating order so drift and
    position hit all alike; every call starts together on every rank."""
    samples = [[] for _ in fns]
    for i in range(warmup + iters):
        order = list(zip(fns, samples))
        for fn, out in order[i % len(order):] + order[: i % len(order)]:
            hvd.allreduce(torch.zeros(1), name="bench.barrier")
            start = time.perf_counter()
            fn()
            if i >= warmup:
                out.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(s) for s in samples]


def fwd_bwd(layer, x, dy):
    def step():
        x.grad = None
        layer(x).backward(dy)

    return step


def allreduce_pair(channels: int):
    fwd = torch.zeros(2 * channels + 1, dtype=torch.float64)
    bwd = torch.zeros(2 * channels)

    def step():
        hvd.allreduce_(fwd, op=hvd.Sum, name="bench.floor.fwd")
        hvd.allreduce_(bwd, op=hvd.Sum, name="bench.floor.bwd")

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(hvd.rank())
    rows = []
    for shape in SHAPES:
        x = torch.randn(*shape, requires_grad=True)
        dy = torch.randn(*shape)
        fns = [fwd_bwd(SyncBatchNorm(shape[1], name=f"bench.{shape[1]}"), x, dy),
               fwd_bwd(nn.BatchNorm2d(shape[1]), x, dy)]
        if hvd.size() > 1:
            fns.append(allreduce_pair(shape[1]))
        ours, local, floor = (timed(fns, args.iters) + [0.0])[:3]
        rows.append((shape, ours, local, floor))
    if hvd.rank() != 0:
        return
    cycle = os.environ.get("HOROVOD_CYCLE_TIME", "1 (default)")
    print(f"ranks={hvd.size()} threads/rank={torch.get_num_threads()} HOROVOD_CYCLE_TIME={cycle} ms")
    print("| shape (per rank) | ours ms | local BN ms | allreduce floor ms | ours / (local + floor) |")
    print("|---|---|---|---|---|")
    for shape, ours, local, floor in rows:
        print(f"| {tuple(shape)} | {ours:.2f} | {local:.2f} | {floor:.2f} | {ours / (local + floor):.2f}x |")


if __name__ == "__main__":
    main()
