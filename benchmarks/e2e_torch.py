"""End-to-end training step (forward, loss, backward, optimizer step) with SyncBN and
with local BN, interleaved in one job.

    launch/mpirun.sh -np 2 -- python benchmarks/e2e_torch.py          # prints the ratios

Two nets: a ResNet-18-like classifier (4 x 3 x 64 x 64 per rank, 20 BN layers) and the
demo's U-Net (``examples/torch_segmentation.py``'s ``SegNet``, width 16, 2 x 3 x 64 x 64
per rank, 8 BN layers). Both variants use ``hvd.DistributedOptimizer`` (SGD), so the
only difference is the BN layers, converted with ``convert_sync_batchnorm``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import horovod.torch as hvd
from common import count_collectives, make_barrier, timed, write_json
from hvd_syncbn.torch import convert_sync_batchnorm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from torch_segmentation import SegNet  # noqa: E402


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet18ish(nn.Module):
    """ResNet-18's stages (2 basic blocks each, 64-512 channels) behind a 3x3 stride-2
    stem without max-pooling, for small inputs: 64x64 -> 32, 16, 8, 4."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 2, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True))
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 3, H, W)
        y = self.blocks(self.stem(x))  # (N, 512, H/16, W/16)
        return self.fc(y.mean((2, 3)))  # (N, classes)


NETS = {
    "resnet18ish": (ResNet18ish, (4, 3, 64, 64), 10, lambda n: (n,)),
    "unet_demo": (lambda: SegNet(16), (2, 3, 64, 64), 4, lambda n: (n, 64, 64)),
}


def train_step(model: nn.Module, tag: str, x: torch.Tensor, target: torch.Tensor):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=[(f"{tag}.{n}", p) for n, p in model.named_parameters()])

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), target).backward()
        opt.step()

    return step


def bn_channels(model: nn.Module) -> list:
    """C of every BN layer, in module order."""
    return [m.num_features for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=15, help="timed steps per variant (0: count only)")
    parser.add_argument("--nets", default=",".join(NETS))
    parser.add_argument("--count-steps", type=int, default=2)
    parser.add_argument("--out", help="JSON file for the results (rank 0)")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    barrier = make_barrier(hvd)
    result = {"ranks": hvd.size(), "comm": os.environ.get("HVD_SYNCBN_COMM", "(unset)"), "nets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for net in args.nets.split(","):
            make, shape, classes, target_shape = NETS[net]
            torch.manual_seed(0)
            local = make()
            sync = convert_sync_batchnorm(copy.deepcopy(local))
            torch.manual_seed(1 + hvd.rank())
            x = torch.randn(*shape)
            target = torch.randint(0, classes, target_shape(shape[0]))
            fns = {"sync": train_step(sync, f"{net}.sync", x, target), "local": train_step(local, f"{net}.local", x, target)}
            times = timed(fns, args.iters, barrier) if args.iters else {}
            counts = {k: count_collectives(fn, args.count_steps, hvd, f"{net}.{k}", Path(tmp))
                      for k, fn in fns.items()} if args.count_steps else {}
            result["nets"][net] = {"times": times, "counts": counts, "bn_channels": bn_channels(local),
                                   "input": list(shape)}
    if hvd.rank() != 0:
        return
    if args.out:
        return write_json(args.out, result)
    for net, r in result["nets"].items() if args.iters else ():
        s, l_ = r["times"]["sync"]["median"], r["times"]["local"]["median"]
        print(f"{net}: sync {s:.1f} ms, local {l_:.1f} ms, sync/local {s / l_:.2f}x ({hvd.size()} ranks)")
    if not args.iters:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
