"""Segmentation on generated shapes with 2 images per rank: synchronized vs local BN.

    horovodrun -np 2 python examples/torch_segmentation.py                   # sync BN, 3 epochs
    horovodrun -np 2 python examples/torch_segmentation.py --bn local        # plain per-rank BN
    horovodrun -np 2 python examples/torch_segmentation.py --resume --epochs 5
    horovodrun -np 2 python examples/torch_segmentation.py --compare         # both, then a plot
    bash launch/demo.sh [args]                                               # set up, then line 1

The data is generated, nothing is downloaded: noisy images with circles, squares and
triangles, labelled per pixel (background + 3 classes), the same on every rank for a
given ``--seed``. Each rank trains on its own shard with ``--batch-size`` images per
step (default 2), so plain BN normalises over 2 images, SyncBatchNorm over all ranks'
images. After each epoch rank 0 prints the mean training loss and the validation mIoU
(every rank scores a slice; the confusion matrices are summed), checks that every BN
running statistic is the same on all ranks (with ``--bn local`` they differ, and rank
0's are kept), and saves a checkpoint that loads into the plain (unconverted) model too.
"""

from __future__ import annotations

import argparse
import copy
import io
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tqdm import tqdm

import horovod.torch as hvd
from hvd_syncbn.torch import convert_sync_batchnorm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by path (the tests do)
from demo_common import (CLASSES, EVAL_BATCH, arg_parser, atomic_write, check_global_batch,  # noqa: E402
                         console_logging, iou_from_confusion, parse_checked, rank0_log, shape_mask,
                         train_and_compare)

log = rank0_log(hvd.rank)


def parse_args() -> argparse.Namespace:
    return parse_checked(arg_parser(__doc__, threads_help="torch threads per rank",
                                    plot=Path("results/demo_compare.png")))


# ---------------------------------------------------------------------------- data


def make_shapes(n: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images ``(n, 3, size, size)`` of 2-4 bright shapes on a dark noisy background,
    and their labels ``(n, size, size)``: index into :data:`CLASSES`. Deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.arange(size, dtype=torch.float32)
    yy, xx = torch.meshgrid(grid, grid, indexing="ij")  # (H, W)
    images = torch.empty(n, 3, size, size)
    labels = torch.zeros(n, size, size, dtype=torch.long)
    for i in range(n):
        img = (0.4 * torch.rand(3, 1, 1, generator=g)).expand(3, size, size).clone()  # (3, H, W)
        for _ in range(int(torch.randint(2, 5, (1,), generator=g))):
            cls = int(torch.randint(1, len(CLASSES), (1,), generator=g))
            r = size * (0.08 + 0.1 * float(torch.rand(1, generator=g)))
            cy, cx = (r + (size - 2 * r) * torch.rand(2, generator=g)).tolist()
            mask = shape_mask(cls, xx - cx, yy - cy, r)  # (H, W); later shapes cover earlier
            img[:, mask] = 0.5 + 0.5 * torch.rand(3, 1, generator=g)
            labels[i][mask] = cls
        images[i] = img + 0.15 * torch.randn(3, size, size, generator=g)
    return images, labels


# --------------------------------------------------------------------------- model


def conv_bn_relu(cin: int, cout: int) -> nn.Sequential:
    conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class SegNet(nn.Module):
    """A small U-Net: three scales, skip connections, BatchNorm2d after every 3x3 conv."""

    def __init__(self, width: int, classes: int = len(CLASSES)) -> None:
        super().__init__()
        w = width
        self.enc1 = nn.Sequential(conv_bn_relu(3, w), conv_bn_relu(w, w))
        self.enc2 = nn.Sequential(conv_bn_relu(w, 2 * w), conv_bn_relu(2 * w, 2 * w))
        self.enc3 = nn.Sequential(conv_bn_relu(2 * w, 4 * w), conv_bn_relu(4 * w, 4 * w))
        self.dec2 = conv_bn_relu(4 * w + 2 * w, 2 * w)
        self.dec1 = conv_bn_relu(2 * w + w, w)
        self.head = nn.Conv2d(w, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 3, H, W)
        e1 = self.enc1(x)  # (N, w, H, W)
        e2 = self.enc2(F.max_pool2d(e1, 2))  # (N, 2w, H/2, W/2)
        e3 = self.enc3(F.max_pool2d(e2, 2))  # (N, 4w, H/4, W/4)
        d2 = self.dec2(torch.cat([F.interpolate(e3, scale_factor=2.0), e2], 1))  # (N, 2w, H/2, W/2)
        d1 = self.dec1(torch.cat([F.interpolate(d2, scale_factor=2.0), e1], 1))  # (N, w, H, W)
        return self.head(d1)  # (N, classes, H, W)


def build_model(width: int, bn: str) -> nn.Module:
    model = SegNet(width)
    return convert_sync_batchnorm(model) if bn == "sync" else model


def bn_layers(model: nn.Module) -> dict:
    """Every BN layer (plain or synchronized), by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def bn_buffers(model: nn.Module) -> dict:
    """Every BN layer's running_mean, running_var and num_batches_tracked, by name."""
    return {f"{name}.{b}": getattr(m, b) for name, m in bn_layers(model).items()
            for b in ("running_mean", "running_var", "num_batches_tracked")}


# ---------------------------------------------------------------------- checks, IO


def bn_spread(model: nn.Module) -> tuple[float, str]:
    """Largest max-minus-min over ranks of any BN running statistic, and where it is.

    Two packed allreduces (max and min); every rank gets the same answer.
    """
    names, bufs = zip(*bn_buffers(model).items())
    flat = torch.cat([b.detach().double().flatten() for b in bufs])  # (total,)
    hi = hvd.allreduce(flat, op=hvd.Max, name="bn_check.max")
    lo = hvd.allreduce(flat, op=hvd.Min, name="bn_check.min")
    per_buffer = [d.max().item() for d in (hi - lo).split([b.numel() for b in bufs])]
    worst = max(range(len(names)), key=per_buffer.__getitem__)
    return per_buffer[worst], names[worst]


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-class IoU ``(classes,)`` on the whole set, in eval mode: each rank scores every
    ``size``-th image and the confusion matrices are summed over ranks."""
    k = len(CLASSES)
    model.eval()
    mine = slice(hvd.rank(), None, hvd.size())
    x_all, y_all = images[mine], labels[mine]
    confusion = torch.zeros(k * k, dtype=torch.long)
    for i in range(0, len(x_all), EVAL_BATCH):
        pred = model(x_all[i : i + EVAL_BATCH]).argmax(1)  # (n, H, W)
        confusion += torch.bincount((y_all[i : i + EVAL_BATCH] * k + pred).flatten(), minlength=k * k)
    model.train()
    confusion = hvd.allreduce(confusion, op=hvd.Sum, name="val.confusion").view(k, k)  # (true, predicted)
    return torch.from_numpy(iou_from_confusion(confusion.numpy()))


def save_checkpoint(path: Path, state: dict) -> None:
    """Serialized in memory first, so that a full disk is told with the size it needed."""
    data = io.BytesIO()
    torch.save(state, data)
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data.getbuffer()), size=data.getbuffer().nbytes)


def load_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, dict]:
    """Rank 0 loads ``path`` into ``model`` and ``opt``; every rank gets its epoch and
    history. The caller broadcasts the weights and optimizer state."""
    meta = None
    if hvd.rank() == 0 and path.exists():
        state = torch.load(path, map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        meta = (state["epoch"], state["history"])
    meta = hvd.broadcast_object(meta, root_rank=0, name="resume.meta")
    if meta is None:
        if hvd.rank() == 0:
            print(f"--resume: no checkpoint at {path}; run once without --resume", file=sys.stderr)
        sys.exit(2)
    return meta


# -------------------------------------------------------------------------- train


def train(model: nn.Module, bn: str, args: argparse.Namespace, train_set: TensorDataset,
          val_set: tuple, resume: bool = False) -> dict:
    """Train ``model`` for ``args.epochs`` epochs; returns the per-epoch history."""
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    path = args.checkpoint_dir / f"segmentation_{bn}.pt"
    start, history = 0, {"loss": [], "miou": []}
    if resume:
        start, history = load_checkpoint(path, model, opt)
        todo = f"epochs {start + 1}..{args.epochs} to go" if start < args.epochs else "raise --epochs"
        log(f"resumed from epoch {start} ({path}); {todo}")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                 shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model.train()
    for epoch in range(start + 1, args.epochs + 1):
        sampler.set_epoch(epoch)
        sums = torch.zeros(2, dtype=torch.float64)  # (loss x images, images) on this rank
        # On stdout, in order with the lines; nrows: mpirun's pty says it has 0 rows, which hides a bar.
        for x, y in tqdm(loader, desc=f"{bn} BN epoch {epoch}/{args.epochs}", file=sys.stdout, nrows=20,
                         disable=not (args.progress and hvd.rank() == 0), ncols=80, mininterval=1.0):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)  # (N, classes, H, W) against (N, H, W)
            loss.backward()
            opt.step()
            sums += torch.tensor([loss.item() * len(x), len(x)], dtype=torch.float64)
        sums = hvd.allreduce(sums, op=hvd.Sum, name="train.loss_sums")
        history["loss"].append((sums[0] / sums[1]).item())

        spread, where = bn_spread(model)
        if spread == 0:
            log(f"BN running statistics identical on all {hvd.size()} ranks: yes")
        elif bn == "local":  # expected: each rank's BN saw only its own images
            log(f"BN running statistics identical on all {hvd.size()} ranks: no (local BN; largest "
                f"difference {spread:.3g} in {where}); evaluating and saving rank 0's")
            hvd.broadcast_parameters(bn_buffers(model), root_rank=0)
        else:
            log(f"BN running statistics identical on all {hvd.size()} ranks: NO (largest difference "
                f"{spread:.3g} in {where}): SyncBatchNorm is not synchronising")
            sys.exit(1)

        iou = evaluate(model, *val_set)
        history["miou"].append(iou.nanmean().item())
        per_class = " ".join(f"{c}={v:.3f}" for c, v in zip(CLASSES, iou.tolist()))
        log(f"{bn} BN epoch {epoch}/{args.epochs}: train loss {history['loss'][-1]:.4f}  "
            f"val mIoU {history['miou'][-1]:.4f}  ({per_class})")
        if hvd.rank() == 0:
            save_checkpoint(path, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                   "epoch": epoch, "bn": bn, "history": history})
    return history


def main() -> None:
    args = parse_args()
    console_logging()
    hvd.init()
    torch.set_num_threads(args.threads)
    check_global_batch(args, hvd.size(), log)

    train_set = TensorDataset(*make_shapes(args.train_size, args.image_size, 2 * args.seed))
    val_set = make_shapes(args.val_size, args.image_size, 2 * args.seed + 1)
    torch.manual_seed(args.seed)
    model = build_model(args.width, args.bn)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    init = copy.deepcopy(model.state_dict())  # for --compare: both runs start from these weights
    log(f"data: {args.train_size} train / {args.val_size} val images 3x{args.image_size}x{args.image_size}, "
        f"{len(CLASSES)} classes; {len(bn_layers(model))} BN layers, --bn {args.bn}; "
        f"{sum(p.numel() for p in model.parameters())} parameters; {args.threads} thread(s)/rank")

    def train_bn(bn: str, resume: bool) -> dict:
        net = model
        if bn != args.bn:
            net = build_model(args.width, bn)
            net.load_state_dict(init)
        return train(net, bn, args, train_set, val_set, resume=resume)

    train_and_compare(args, train_bn, hvd.size(), hvd.rank() == 0, log, title_prefix="", eval_mode="eval mode")


if __name__ == "__main__":
    main()
