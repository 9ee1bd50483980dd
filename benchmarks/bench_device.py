"""Host time per layer step of the PyTorch device path on the CPU, per kernel set, against
``nn.BatchNorm2d``.

    python benchmarks/bench_device.py [--iters 30] [--steps 50]

What a step costs the host (Python, dispatch, autograd) decides whether a GPU step is
host-bound: on a GPU each dispatched op is also a kernel launch (``gpu_check.py`` times
both there). One layer step here is forward + backward into ``x``, ``γ`` and ``β`` of a
tiny input (2, 64, 4, 4), so that the host time is what is timed, over a 1-rank Gloo group
(each layer given its communicator: alone it would be plain BN, no collective). Settings,
timed interleaved (``common.timed``), µs per step as the median over ``--iters`` runs of
``--steps`` steps:

- ``BN`` and ``BN again``: ``nn.BatchNorm2d``, twice: the A/A control;
- ``composite``: ours on the composite kernel set;
- ``native (kernels stubbed)``: ours on the native set, its four CUDA-only kernels
  replaced by stubs that return empty results of the right shapes (this CPU has none):
  the plan's own host cost, to which a GPU adds four kernels' launches.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]
import cuda_kernels  # noqa: E402  (its registration, here of stubs)
from common import timed  # noqa: E402

from hvd_syncbn.torch import SyncBatchNorm  # noqa: E402
from hvd_syncbn.torch.transports import TorchDistComm  # noqa: E402

STUBS = {  # the native set's kernels as empty results of the shapes and dtypes CUDA returns
    "batch_norm_update_stats": lambda x, rm, rv, m: (x.new_empty(x.shape[1], dtype=torch.float32),) * 2,
    "batch_norm_elemt": lambda x, w, b, mean, invstd, eps: torch.empty_like(x),
    "batch_norm_backward_reduce": lambda dy, x, mean, invstd, w, ig, wg, bg: (
        mean.new_empty(x.shape[1]), mean.new_empty(x.shape[1]), *((w.new_empty(x.shape[1]),) * 2 if wg else (None,) * 2)),
    "batch_norm_backward_elemt": lambda dy, x, mean, invstd, w, sum_dy, sum_dy_xmu, count: torch.empty_like(x),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    store = tempfile.mkdtemp()  # the group's file store, for the life of the process
    dist.init_process_group("gloo", init_method=f"file://{store}/pg", rank=0, world_size=1)
    comm = TorchDistComm(None)
    SyncBatchNorm._comm = lambda self, nccl=False: comm
    x = torch.randn(2, 64, 4, 4, requires_grad=True)
    dy = torch.randn_like(x)

    def steps(layer: nn.Module, kernels: str = ""):
        args_ = (x, layer.weight, layer.bias)

        def run():
            if kernels:
                os.environ["HVD_SYNCBN_KERNELS"] = kernels
            for _ in range(args.steps):
                torch.autograd.grad(layer(x), args_, dy)
        return run

    stubs = cuda_kernels.registered(STUBS)  # on for every setting: only the native set calls these ops
    stubs.__enter__()
    settings = {"BN": steps(nn.BatchNorm2d(64)), "BN again": steps(nn.BatchNorm2d(64)),
                "composite": steps(SyncBatchNorm(64, stats="device"), "composite"),
                "native (kernels stubbed)": steps(SyncBatchNorm(64, stats="device"), "native")}
    result = timed(settings, args.iters, lambda: None)
    stubs.__exit__(None, None, None)
    base = result["BN"]["median"]
    print(f"bench_device: host time per layer step, (2, 64, 4, 4) float32, fwd+bwd, 1-rank Gloo, "
          f"torch {torch.__version__}, {args.iters} runs of {args.steps} steps, {time.strftime('%Y-%m-%d')}")
    print("| setting | µs per step (median) | q1–q3 | vs BN |\n|---|---|---|---|")
    for name, r in result.items():
        us = 1e3 / args.steps
        print(f"| {name} | {r['median'] * us:.0f} | {r['q1'] * us:.0f}–{r['q3'] * us:.0f} | {r['median'] / base:.2f}x |")


if __name__ == "__main__":
    main()
