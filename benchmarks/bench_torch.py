"""Per-layer forward+backward time of hvd_syncbn's SyncBatchNorm against its baselines.

    launch/mpirun.sh -np 2 -- python benchmarks/bench_torch.py          # prints a table
    python benchmarks/run.py                                             # the full report

Implementations, each timed interleaved with the others in one job (``--impls``):

- ``ours``: :class:`hvd_syncbn.torch.SyncBatchNorm` (its transport: ``HVD_SYNCBN_COMM``);
- ``local``: ``nn.BatchNorm2d`` on this rank's rows only;
- ``floor_hvd`` / ``floor_mpi``: the communication floor, two raw allreduces of the
  buffers our layer sends (``2C+3`` float64 forward, ``2C+2`` backward), through Horovod
  and through mpi4py;
- ``hand``: :class:`HandSyncBN`, the autograd-through-allreduce layer users write;
- ``local_again``: a second ``nn.BatchNorm2d``, the A/A control: its ratio to ``local``
  is what this machine's noise alone makes of two identical layers.

``torch.nn.SyncBatchNorm`` and ``hvd.SyncBatchNorm`` are tried once each on a CPU input;
what they raise is recorded. With ``--out`` every rank-0 number goes to a JSON file,
with each implementation's collectives per step counted (``common.count_collectives``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

import horovod.torch as hvd
from common import SHAPES, count_collectives, make_barrier, timed, write_json
from hvd_syncbn.torch import SyncBatchNorm


class HandSyncBN(nn.Module):
    """Synchronized BN as users write it today: autograd through ``hvd.allreduce``.

    Three collectives forward (row count, per-channel sum, sum of squares) and, through
    Horovod's autograd, one backward per differentiable one; float32, ``E[x²] − E[x]²``.
    """

    def __init__(self, channels: int, name: str, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))
        self.name, self.eps, self.momentum = name, eps, momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, C, H, W)
        dims = [0, 2, 3]
        count = hvd.allreduce(torch.tensor([x.numel() / x.shape[1]]), op=hvd.Sum, name=f"{self.name}.count")
        # Horovod's allreduce backward fails on non-contiguous gradients: keep them dense.
        total = hvd.allreduce(_dense_grad(x.sum(dims)), op=hvd.Sum, name=f"{self.name}.sum")  # (C,)
        total_sq = hvd.allreduce(_dense_grad((x * x).sum(dims)), op=hvd.Sum, name=f"{self.name}.sumsq")
        mean = total / count
        var = total_sq / count - mean * mean
        with torch.no_grad():
            n = float(count)
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / max(n - 1, 1), self.momentum)
        scale = self.weight * torch.rsqrt(var + self.eps)
        return x * scale.view(1, -1, 1, 1) + (self.bias - mean * scale).view(1, -1, 1, 1)


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _dense_grad(t: torch.Tensor) -> torch.Tensor:
    return _DenseGrad.apply(t)


def fwd_bwd(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    def step():
        x.grad = None
        layer(x).backward(dy)

    return step


def floor_hvd(channels: int, name: str):
    fwd = torch.zeros(2 * channels + 3, dtype=torch.float64)
    bwd = torch.zeros(2 * channels + 2, dtype=torch.float64)

    def step():
        hvd.allreduce_(fwd, op=hvd.Sum, name=f"{name}.fwd")
        hvd.allreduce_(bwd, op=hvd.Sum, name=f"{name}.bwd")

    return step


def floor_mpi(channels: int):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    fwd = torch.zeros(2 * channels + 3, dtype=torch.float64).numpy()
    bwd = torch.zeros(2 * channels + 2, dtype=torch.float64).numpy()

    def step():
        comm.Allreduce(MPI.IN_PLACE, fwd, op=MPI.SUM)
        comm.Allreduce(MPI.IN_PLACE, bwd, op=MPI.SUM)

    return step


def refusals() -> dict:
    """What ``torch.nn.SyncBatchNorm`` and ``hvd.SyncBatchNorm`` do with a CPU input."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000 if hvd.size() == 1 else 29411))
        dist.init_process_group("gloo", rank=hvd.rank(), world_size=hvd.size())
    x = torch.randn(2, 8, 4, 4, requires_grad=True)
    out = {}
    for name, make in (("torch_syncbn", lambda: nn.SyncBatchNorm(8)), ("hvd_syncbn_layer", lambda: hvd.SyncBatchNorm(8))):
        try:
            make()(x).sum().backward()
            out[name] = "ran"
        except Exception as e:  # noqa: BLE001 - the message is the result
            out[name] = f"refuses CPU: {type(e).__name__}: {str(e).splitlines()[0]}"
    return out


def build(impl: str, shape: tuple) -> object:
    c, tag = shape[1], "x".join(map(str, shape))
    if impl == "ours":
        return SyncBatchNorm(c, name=f"bench.ours.{tag}")
    if impl in ("local", "local_again"):
        return nn.BatchNorm2d(c)
    if impl == "hand":
        return HandSyncBN(c, name=f"bench.hand.{tag}")
    if impl == "floor_hvd":
        return floor_hvd(c, f"bench.floor.{tag}")
    if impl == "floor_mpi":
        return floor_mpi(c)
    raise ValueError(f"unknown implementation {impl!r}; expected ours, local, local_again, hand, floor_hvd or "
                     "floor_mpi")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20, help="timed calls per implementation (0: count only)")
    parser.add_argument("--impls", default="ours,local,floor_hvd,floor_mpi,hand")
    parser.add_argument("--shapes", default=json.dumps(SHAPES), help="JSON list of per-rank NCHW shapes")
    parser.add_argument("--count-steps", type=int, default=2, help="steps per implementation to count collectives")
    parser.add_argument("--refusals", action="store_true", help="also try torch's and Horovod's SyncBatchNorm")
    parser.add_argument("--out", help="JSON file for the results (rank 0)")
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(hvd.rank())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    impls = args.impls.split(",")
    if "floor_mpi" in impls and not any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")):
        impls.remove("floor_mpi")  # without mpirun every process would be an MPI world of its own
    barrier = make_barrier(hvd)
    result = {"ranks": hvd.size(), "comm": os.environ.get("HVD_SYNCBN_COMM", "(unset)"), "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in map(tuple, json.loads(args.shapes)):
            x = torch.randn(*shape, requires_grad=True)
            dy = torch.randn(*shape)
            objs = {i: build(i, shape) for i in impls}
            fns = {i: o if callable(o) and not isinstance(o, nn.Module) else fwd_bwd(o, x, dy) for i, o in objs.items()}
            times = timed(fns, args.iters, barrier) if args.iters else {}
            counts = {i: count_collectives(fn, args.count_steps, hvd, f"{i}.{shape[1]}", Path(tmp))
                      for i, fn in fns.items()} if args.count_steps else {}
            result["shapes"][json.dumps(shape)] = {"times": times, "counts": counts}
    if args.refusals:
        result["refusals"] = refusals()
    if hvd.rank() != 0:
        return
    if args.out:
        return write_json(args.out, result)
    print(f"ranks={hvd.size()} HVD_SYNCBN_COMM={result['comm']}; per-layer forward+backward, median ms")
    print("| shape (per rank) | " + " | ".join(impls) + " |")
    print("|---" * (len(impls) + 1) + "|")
    for shape, r in result["shapes"].items() if args.iters else ():
        print(f"| {tuple(json.loads(shape))} | " + " | ".join(f"{r['times'][i]['median']:.2f}" for i in impls) + " |")
    for name, what in result.get("refusals", {}).items():
        print(f"{name}: {what}")


if __name__ == "__main__":
    main()
