"""A training step of the demo's SegNet, eager against ``torch.compile``, at 2 ranks on the CPU.

    mpirun --allow-run-as-root -np 2 -bind-to none python benchmarks/bench_compile.py [--comm torch|mpi]

Each rank trains on 2 images of 64×64 (width 16: 8 SyncBN layers). Settings, timed
interleaved in the same run (``common.timed``):

- ``eager host``: the default eager path (statistics on the host, numpy);
- ``eager device``: the device path in eager mode (``stats="device"``);
- ``compiled``: ``torch.compile(model, fullgraph=True)`` (inductor), the device path.

``--comm torch`` (default) sums over a Gloo group with functional collectives; ``--comm
mpi`` over mpi4py through the custom op. Prints ms per step and the ratios to eager host.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "benchmarks")]
from common import timed  # noqa: E402
from torch_segmentation import SegNet  # noqa: E402

from hvd_syncbn.torch import SyncBatchNorm, convert_sync_batchnorm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comm", choices=["torch", "mpi"], default="torch")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    os.environ["HVD_SYNCBN_COMM"] = args.comm
    if args.comm == "torch":
        import torch.distributed as dist

        port = world.bcast(29400 + os.getpid() % 500 if rank == 0 else None)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world.Get_size())
    torch.manual_seed(0)
    x, labels = torch.randn(2, 3, 64, 64), torch.randint(0, 4, (2, 64, 64))
    steps, compiled_in = {}, 0.0
    for name in ("eager host", "eager device", "compiled"):
        model = convert_sync_batchnorm(SegNet(16, classes=4))
        for m in model.modules():
            if isinstance(m, SyncBatchNorm):
                m.stats = "host" if name == "eager host" else "device"
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        run = torch.compile(model, fullgraph=True) if name == "compiled" else model

        def step(run=run, opt=opt):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(run(x), labels).backward()
            opt.step()

        start = time.perf_counter()
        step()  # the compile, for "compiled"
        if name == "compiled":
            compiled_in = time.perf_counter() - start
        steps[name] = step
    result = timed(steps, args.iters, world.Barrier)
    if rank == 0:
        base = result["eager host"]["median"]
        layers = sum(isinstance(m, SyncBatchNorm) for m in model.modules())
        print(f"bench_compile: 2 ranks, comm={args.comm}, {layers} SyncBN layers, torch {torch.__version__}, "
              f"first compiled step {compiled_in:.0f} s")
        print("| setting | ms per step (median) | q1–q3 | vs eager host |\n|---|---|---|---|")
        for name, r in result.items():
            print(f"| {name} | {r['median']:.2f} | {r['q1']:.2f}–{r['q3']:.2f} | {r['median'] / base:.2f}x |")


if __name__ == "__main__":
    main()
