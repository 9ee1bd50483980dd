"""Host time per layer step of the PyTorch SyncBN on the CPU, per kernel set, against
``nn.BatchNorm2d`` and torch's own ``SyncBatchNorm`` Function.

    python benchmarks/bench_device.py [--iters 30] [--steps 50]

What a step costs the host (Python, dispatch, autograd) decides whether a GPU step is
host-bound: on a GPU each dispatched op is also a kernel launch (``gpu_check.py`` times
both there). One layer step here is forward + backward into ``x``, ``γ`` and ``β`` of a
tiny input (2, 64, 4, 4), so that the host time is what is timed. The CUDA-only kernels
(torch's SyncBN kernels, which our native set uses too) are replaced by stubs that return
empty results of the right shapes, the same stubs for torch's Function and ours: what is
timed is each side's own host cost, to which a GPU adds the kernels' launches.

Two tables, each timed interleaved (``common.timed``), µs per step as the median over
``--iters`` runs of ``--steps`` steps:

- collectives as identities: the layer's arithmetic and bookkeeping alone;
- a real 1-rank Gloo group (each layer given its communicator: alone it would be plain
  BN, no collective).

Settings: ``BN`` and ``BN again`` (``nn.BatchNorm2d``, twice: the A/A control); torch's
``SyncBatchNorm`` Function (``torch.nn.modules._functions``, as ``nn.SyncBatchNorm``
calls it on CUDA, with its running statistics); ours through the module on the native
set (kernels stubbed) and on the composite set.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBNFunction

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]
import cuda_kernels  # noqa: E402  (its registration, here of stubs)
from common import timed  # noqa: E402

from hvd_syncbn.torch import SyncBatchNorm, reducers  # noqa: E402
from hvd_syncbn.torch.transports import TorchDistComm  # noqa: E402


def _channels(x):
    return x.new_empty(x.shape[1], dtype=torch.float32)


STUBS = {  # the CUDA-only kernels as empty results of the shapes and dtypes CUDA returns
    "batch_norm_stats": lambda x, eps: (_channels(x),) * 2,
    "batch_norm_gather_stats_with_counts": lambda x, mean, invstd, rm, rv, m, eps, counts: (_channels(x),) * 2,
    "batch_norm_update_stats": lambda x, rm, rv, m: (_channels(x),) * 2,
    "batch_norm_elemt": lambda x, w, b, mean, invstd, eps: torch.empty_like(x),
    "batch_norm_backward_reduce": lambda dy, x, mean, invstd, w, ig, wg, bg: (
        mean.new_empty(x.shape[1]), mean.new_empty(x.shape[1]), *((w.new_empty(x.shape[1]),) * 2 if wg else (None,) * 2)),
    "batch_norm_backward_elemt": lambda dy, x, mean, invstd, w, sum_dy, sum_dy_xmu, count: torch.empty_like(x),
}


@contextlib.contextmanager
def identities():
    """Every collective of both sides returns its input (1 rank: the sum is the input)."""
    saved = reducers.summed, dist.all_gather, dist.all_reduce
    reducers.summed = lambda comm, identity, buf, direction: buf
    dist.all_gather = lambda out, t, group=None, async_op=False: out[0].copy_(t)
    dist.all_reduce = lambda t, op=None, group=None, async_op=False: None
    try:
        yield
    finally:
        reducers.summed, dist.all_gather, dist.all_reduce = saved


class TorchFunctionLayer(nn.BatchNorm2d):
    """``nn.SyncBatchNorm``'s training step on CUDA: its Function, over the world group."""

    def forward(self, x):
        return TorchSyncBNFunction.apply(x, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                                         self.momentum, dist.group.WORLD, 1)


def table(title: str, iters: int, steps: int) -> None:
    x = torch.randn(2, 64, 4, 4, requires_grad=True)
    dy = torch.randn_like(x)

    layers = []

    def run(layer: nn.Module, kernels: str = ""):
        args = (x, layer.weight, layer.bias)
        layers.append(layer)

        def go():
            if kernels:
                os.environ["HVD_SYNCBN_KERNELS"] = kernels
            for _ in range(steps):
                torch.autograd.grad(layer(x), args, dy)
        return go

    settings = {"BN": run(nn.BatchNorm2d(64)), "BN again": run(nn.BatchNorm2d(64)),
                "torch's SyncBatchNorm Function": run(TorchFunctionLayer(64)),
                "ours, native (kernels stubbed)": run(SyncBatchNorm(64, stats="device"), "native"),
                "ours, composite": run(SyncBatchNorm(64, stats="device"), "composite")}
    result = timed(settings, iters, lambda: None)
    ours = [layer for layer in layers if isinstance(layer, SyncBatchNorm)]
    assert all(layer._plans for layer in ours), "ours ran as plain BN: no synchronized step was planned"
    base, torch_fn = result["BN"]["median"], result["torch's SyncBatchNorm Function"]["median"]
    print(f"\n{title}\n\n| setting | µs per step (median) | q1–q3 | vs BN | vs torch's Function |\n|---|---|---|---|---|")
    for name, r in result.items():
        us = 1e3 / steps
        print(f"| {name} | {r['median'] * us:.0f} | {r['q1'] * us:.0f}–{r['q3'] * us:.0f} | "
              f"{r['median'] / base:.2f}x | {r['median'] / torch_fn:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    store = tempfile.mkdtemp()  # the group's file store, for the life of the process
    dist.init_process_group("gloo", init_method=f"file://{store}/pg", rank=0, world_size=1)
    comm = TorchDistComm(None)
    SyncBatchNorm._comm = lambda self, nccl=False: comm  # a communicator of 1 rank counts as several
    print(f"bench_device: host time per layer step, (2, 64, 4, 4) float32, fwd+bwd, torch {torch.__version__}, "
          f"{args.iters} runs of {args.steps} steps, {time.strftime('%Y-%m-%d')}")
    with cuda_kernels.registered(STUBS):  # for every setting: only the native set and torch's call these ops
        with identities():
            table("Collectives as identities", args.iters, args.steps)
        table("A 1-rank Gloo group", args.iters, args.steps)


if __name__ == "__main__":
    main()
