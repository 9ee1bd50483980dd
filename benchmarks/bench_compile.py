"""A training step of the demo's SegNet, eager against ``torch.compile``, at 2 ranks on the CPU;
and the first compile of a converted ResNet-18 against plain BN's, one process.

    mpirun --allow-run-as-root -np 2 -bind-to none python benchmarks/bench_compile.py [--comm torch|mpi]
    python benchmarks/bench_compile.py --first [--backend aot_eager|inductor] [--jobs N]

Each rank trains on 2 images of 64×64 (width 16: 8 SyncBN layers). Settings, timed
interleaved in the same run (``common.timed``):

- ``eager``: the default (``stats="auto"``: on the CPU its checks raise at the step);
- ``eager, deferred checks``: ``stats="device"`` (no host read, as on a GPU);
- ``compiled``: ``torch.compile(model, fullgraph=True)`` (inductor).

``--comm torch`` (default) sums over a Gloo group with functional collectives; ``--comm
mpi`` over mpi4py through the host-side allreduce. Prints ms per step and the ratios to eager.

``--first``: torchvision's ResNet-18, input 2×3×64×64, forward + backward under
``torch.compile(fullgraph=True)``, the device path over a 1-rank Gloo group (each layer
given its communicator: alone it would be plain BN), the first step's seconds, each
setting in a fresh process: plain BN, then ours on each kernel set (the native one
through the CPU stand-ins of ``tests/cuda_kernels.py`` where the device lacks its
kernels), ``--repeats`` rounds in turn. Inductor runs with its caches off
(``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``). Goals: ``aot_eager`` <= 3x plain, inductor <= 1.5x.
``--jobs N`` runs N of those processes at a time (default 1, each alone): quicker, but
they share the cores, so their seconds are no measurement (the tests' plumbing check).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "benchmarks")]
from common import timed  # noqa: E402
from torch_segmentation import SegNet  # noqa: E402

from hvd_syncbn.torch import SyncBatchNorm, convert_sync_batchnorm, reducers  # noqa: E402


GOALS = {"aot_eager": 3.0, "inductor": 1.5}
STAND_INS: list = []  # the native kernels' CPU stand-ins, kept registered


def first_step(backend: str, setting: str) -> float:
    """Seconds of the first compiled step of ResNet-18 in ``setting`` (``plain``,
    ``composite`` or ``native``), in this process."""
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "tests"))
    from vision import import_vision  # torchvision, also beside this project's CPU torch

    from hvd_syncbn.torch.transports import TorchDistComm

    store = tempfile.mkdtemp()  # the group's file store, for the life of the process
    dist.init_process_group("gloo", init_method=f"file://{store}/pg", rank=0, world_size=1)
    comm = TorchDistComm(None)
    reducers.comm_index(comm)  # registered, as a traced layer's own _comm registers its communicator
    SyncBatchNorm._comm = lambda self, nccl=False: comm  # a communicator of 1 rank counts as several
    if setting == "native" and not torch.cuda.is_available():
        import cuda_kernels

        STAND_INS.append(cuda_kernels.registered())  # for the life of this process
        STAND_INS[-1].__enter__()
    os.environ["HVD_SYNCBN_KERNELS"] = setting if setting != "plain" else "auto"
    torch.manual_seed(0)
    model = import_vision()[0].models.resnet18(weights=None)
    model = model if setting == "plain" else convert_sync_batchnorm(model, stats="device")
    step = torch.compile(model, fullgraph=True, backend=backend)
    start = time.perf_counter()
    step(torch.randn(2, 3, 64, 64)).sum().backward()
    took = time.perf_counter() - start
    assert setting == "plain" or comm.__dict__.get("_steps"), "ours ran as plain BN: no collective was made"
    return took


def first_compiles(backend: str, repeats: int, jobs: int = 1) -> None:
    env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    runs = [setting for _ in range(repeats) for setting in ("plain", "composite", "native")]

    def first_of(setting: str) -> float:
        out = subprocess.run([sys.executable, __file__, "--first-of", setting, "--backend", backend], env=env,
                             capture_output=True, text=True, check=True).stdout
        return float(out.split()[-1])

    seconds: dict = {}
    with ThreadPoolExecutor(jobs) as pool:  # 1: one process after another, in this order
        for setting, took in zip(runs, pool.map(first_of, runs)):
            seconds.setdefault(setting, []).append(took)
    plain = statistics.median(seconds["plain"])
    shared = f"; {jobs} processes at a time, sharing the cores: not a measurement" if jobs > 1 else ""
    print(f"bench_compile --first: ResNet-18 2x3x64x64, fwd+bwd, fullgraph, {backend}, torch {torch.__version__}, "
          f"{repeats} round(s), medians; goal <= {GOALS[backend]}x plain{shared}")
    print("| setting | first step, s | vs plain |\n|---|---|---|")
    for setting, s in seconds.items():
        print(f"| {setting} | {statistics.median(s):.1f} ({', '.join(f'{v:.1f}' for v in s)}) | "
              f"{statistics.median(s) / plain:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comm", choices=["torch", "mpi"], default="torch")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--first", action="store_true", help="the first compile of ResNet-18, plain against ours")
    parser.add_argument("--first-of", choices=["plain", "composite", "native"], help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=sorted(GOALS), default="aot_eager")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=1,
                        help="--first: processes at a time (more share the cores: a plumbing check, not a measurement)")
    args = parser.parse_args()
    if args.first_of:
        print(f"{first_step(args.backend, args.first_of):.3f}")
        return
    if args.first:
        first_compiles(args.backend, args.repeats, max(1, args.jobs))
        return
    from mpi4py import MPI

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
    for name in ("eager", "eager, deferred checks", "compiled"):
        model = convert_sync_batchnorm(SegNet(16, classes=4), stats="auto" if name == "eager" else "device")
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
        base = result["eager"]["median"]
        layers = sum(isinstance(m, SyncBatchNorm) for m in model.modules())
        print(f"bench_compile: 2 ranks, comm={args.comm}, {layers} SyncBN layers, torch {torch.__version__}, "
              f"first compiled step {compiled_in:.0f} s")
        print("| setting | ms per step (median) | q1–q3 | vs eager |\n|---|---|---|---|")
        for name, r in result.items():
            print(f"| {name} | {r['median']:.2f} | {r['q1']:.2f}–{r['q3']:.2f} | {r['median'] / base:.2f}x |")


if __name__ == "__main__":
    main()
