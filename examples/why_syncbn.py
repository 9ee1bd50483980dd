"""Why SyncBN matters: local BN and SyncBN at 1 and 2 images per rank, against one process.

    bash launch/why_syncbn.sh                       # set up, then the line below (results/why_syncbn.*)
    launch/mpirun.sh -np 4 --oversubscribe -x OMP_NUM_THREADS -- python examples/why_syncbn.py
    NP=8 bash launch/why_syncbn.sh --out results/why_syncbn_8ranks       # 8 ranks
    bash launch/why_syncbn.sh --seeds 1 --epochs 1                      # a quick look

For each seed the demo's U-Net (examples/torch_segmentation.py) is trained from the same
initial weights on the same images in the same order, for ``--epochs`` epochs of Adam,
in three settings per per-rank batch b (``--batches``, default 1 and 2), W the ranks:

- local BN, W x b: plain ``nn.BatchNorm2d``, statistics over each rank's b images;
  gradients averaged over the ranks by ``hvd.DistributedOptimizer``;
- SyncBN, W x b: the same net through ``convert_sync_batchnorm``, statistics over W*b;
- one process, W*b images: plain BN and plain Adam, no Horovod at all. These runs are
  independent, so the ranks share them out and run them side by side.

The images are the demo's scenes seen through a camera whose exposure, contrast and
white balance change from image to image (:func:`make_photos`). Each run is scored in
eval mode (running statistics) on the validation set: mIoU, and per BN layer the gap
between the statistics it trained with and those it evaluates with
(:func:`train_eval_gap`). For local BN rank 0's running statistics are scored (the
checkpoint a rank-0 save keeps), and also their mean over ranks. Rank 0 writes
``--out`` .json (every number), .md (the tables) and .png (the plot).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import horovod.torch as hvd

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by path (the tests do)
from demo_common import CLASSES, EVAL_BATCH, add_training_flags, iou_from_confusion, rank0_log  # noqa: E402
from torch_segmentation import SegNet, bn_buffers, build_model, make_shapes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
log = rank0_log(hvd.rank)

# The camera (make_photos): log-normal contrast and per-channel gain, normal brightness
# offset, on a 0-1 scale. Fixed before the first run of this experiment, not tuned.
CONTRAST_LOG_SD = 0.3   # x/÷ 1.35 per standard deviation
COLOUR_LOG_SD = 0.1     # white balance, per channel
BRIGHTNESS_SD = 0.1


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_flags(parser, epochs=4, image_size=48)
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 2],
                        help="images per rank, comma-separated")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    parser.add_argument("--out", type=Path, default=Path("results/why_syncbn"),
                        help="writes OUT.json, OUT.md and OUT.png")
    args = parser.parse_args()
    if args.image_size % 4:
        parser.error(f"--image-size must be a multiple of 4 (two 2x poolings), got {args.image_size}")
    if min(args.batches) < 1:
        parser.error(f"--batches: expected positive images per rank, got {args.batches}")
    return args


# ---------------------------------------------------------------------------- data


def make_photos(n: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The demo's ``n`` scenes (:func:`make_shapes`) as a camera sees them: per image a
    contrast ``c`` and per-channel white balance ``w`` (log-normal) and a brightness
    offset ``o`` (normal), ``x' = clip(0.5 + c * w * (x - 0.5) + o, 0, 1)``; images
    ``(n, 3, size, size)`` and labels ``(n, size, size)``."""
    images, labels = make_shapes(n, size, seed)
    g = torch.Generator().manual_seed(seed + (1 << 32))
    contrast = torch.exp(CONTRAST_LOG_SD * torch.randn(n, 1, 1, 1, generator=g))
    white = torch.exp(COLOUR_LOG_SD * torch.randn(n, 3, 1, 1, generator=g))
    offset = BRIGHTNESS_SD * torch.randn(n, 1, 1, 1, generator=g)
    return (0.5 + contrast * white * (images - 0.5) + offset).clamp(0, 1), labels


def describe(images: torch.Tensor) -> str:
    """How much the images differ: the spread of their mean intensity and of their contrast."""
    grey = images.mean(1).flatten(1)  # (n, H*W)
    mean, sd = grey.mean(1), grey.std(1)
    q = lambda t: " to ".join(f"{v:.2f}" for v in t.quantile(torch.tensor([0.1, 0.9])).tolist())  # noqa: E731
    return (f"per-image mean intensity {mean.mean():.2f} (10-90%: {q(mean)}), "
            f"per-image contrast (pixel std) {sd.mean():.2f} (10-90%: {q(sd)})")


# ------------------------------------------------------------------- measurements


def train_eval_gap(x: torch.Tensor, bn: nn.modules.batchnorm._BatchNorm, n: int) -> float:
    """How far ``bn``'s train-mode output on ``x`` ``(N, C, *)`` is from its eval-mode one,
    taking batch statistics over groups of ``n`` images: the RMS over groups, channels and
    positions of ``x̂_train - x̂_eval``, in units of the normalised output.

    With a group's mean and std ``μ, σ`` and the running ones ``μ_r, σ_r`` (eps added to
    both variances) that is the root of the mean of ``(σ/σ_r - 1)² + ((μ - μ_r)/σ_r)²``.
    """
    groups = x.double().reshape(-1, n, *x.shape[1:]).transpose(1, 2).flatten(2)  # (N/n, C, n*H*W)
    sd = (groups.var(2, unbiased=False) + bn.eps).sqrt()  # (N/n, C)
    sd_run = (bn.running_var.double() + bn.eps).sqrt()  # (C,)
    shift = (groups.mean(2) - bn.running_mean.double()) / sd_run
    return float(((sd / sd_run - 1) ** 2 + shift**2).mean().sqrt())


@torch.no_grad()
def score(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, n: int) -> dict:
    """Validation mIoU of ``model`` in eval mode, in one process, and each BN layer's
    :func:`train_eval_gap` for groups of ``n`` images (its batch in training)."""
    k = len(CLASSES)
    bns = {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    seen = {name: [] for name in bns}
    hooks = [m.register_forward_pre_hook(lambda m, inp, name=name: seen[name].append(inp[0]))
             for name, m in bns.items()]
    model.eval()
    confusion = torch.zeros(k * k, dtype=torch.long)
    for i in range(0, len(images), EVAL_BATCH):
        pred = model(images[i : i + EVAL_BATCH]).argmax(1)  # (N, H, W)
        confusion += torch.bincount((labels[i : i + EVAL_BATCH] * k + pred).flatten(), minlength=k * k)
    model.train()
    for h in hooks:
        h.remove()
    iou = iou_from_confusion(confusion.view(k, k).numpy())
    return {"miou": float(np.nanmean(iou)),
            "gap": {name: train_eval_gap(torch.cat(seen[name]), bns[name], n) for name in bns}}


# -------------------------------------------------------------------------- training


def train(model: nn.Module, opt: torch.optim.Optimizer, data: tuple, args: argparse.Namespace, seed: int,
          batch: int, part: slice, bar: tqdm) -> list:
    """Train for ``args.epochs`` epochs on global batches of ``batch`` training images in
    the seed's order, this process taking the images ``part`` of each; its loss per step."""
    images, labels = data
    losses = []
    model.train()
    for epoch in range(args.epochs):
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(1000 * seed + epoch))
        for step in range(len(images) // batch):
            idx = order[step * batch : (step + 1) * batch][part]
            opt.zero_grad()
            loss = F.cross_entropy(model(images[idx]), labels[idx])  # (n, classes, H, W) against (n, H, W)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            bar.update(len(idx))
    return losses


def run_ranks(bn: str, b: int, seed: int, data: dict, args: argparse.Namespace, bar: tqdm) -> dict:
    """Every rank trains ``bn`` BN with ``b`` images per step; rank 0 returns the scores."""
    size, rank = hvd.size(), hvd.rank()
    torch.manual_seed(seed)
    model = build_model(args.width, bn)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    bar.set_description(f"seed {seed} {bn} BN {size}x{b}")
    losses = train(model, opt, data["train"], args, seed, size * b, slice(rank * b, (rank + 1) * b), bar)
    losses = hvd.allreduce(torch.tensor(losses, dtype=torch.float64), op=hvd.Average, name=f"why.{bn}{b}.{seed}")
    out = {"losses": losses.tolist()}
    if rank == 0:
        out.update(score(model, *data["val"], b if bn == "local" else size * b))
    if bn == "local":  # and with the running statistics averaged over the ranks
        stats = {k: v for k, v in bn_buffers(model).items() if k.endswith(("running_mean", "running_var"))}
        mean = {k: hvd.allreduce(v, op=hvd.Average, name=f"why.avg.{k}") for k, v in stats.items()}
        if rank == 0:
            averaged = copy.deepcopy(model)
            averaged.load_state_dict(mean, strict=False)
            out["averaged"] = score(averaged, *data["val"], b)
    return out


def run_alone(batch: int, seed: int, data: dict, args: argparse.Namespace, bar: tqdm) -> dict:
    """This process alone trains plain BN on the whole global batch of ``batch`` images."""
    torch.manual_seed(seed)
    model = SegNet(args.width)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = train(model, opt, data["train"], args, seed, batch, slice(None), bar)
    return {"losses": losses, **score(model, *data["val"], batch)}


def experiment(args: argparse.Namespace) -> tuple[dict, list]:
    """Every run of every seed: on rank 0 ``{(bn, b, seed): result}`` (``bn`` one of local,
    sync, alone) and the 1-minute load average after each of its runs; elsewhere ``{}, []``."""
    size, rank = hvd.size(), hvd.rank()
    datasets = {s: {"train": make_photos(args.train_size, args.image_size, 2 * s),
                    "val": make_photos(args.val_size, args.image_size, 2 * s + 1)} for s in range(args.seeds)}
    log(f"data: {args.train_size} train / {args.val_size} val images 3x{args.image_size}x{args.image_size}; "
        f"seed 0's training images: {describe(datasets[0]['train'][0])}")
    alone = [(b, s) for b in args.batches for s in range(args.seeds)][rank::size]  # this rank's share
    steps = {b: args.train_size // (size * b) for b in args.batches}  # per epoch
    total = args.epochs * (sum(2 * args.seeds * steps[b] * b for b in args.batches)
                           + sum(steps[b] * size * b for b, _ in alone))
    mine, loads = {}, []
    with tqdm(total=total, unit="img", disable=rank != 0, ncols=90, mininterval=1.0) as bar:
        for s in range(args.seeds):
            for b in args.batches:
                for bn in ("local", "sync"):
                    mine[(bn, b, s)] = run_ranks(bn, b, s, datasets[s], args, bar)
                    loads.append(os.getloadavg()[0])
        for b, s in alone:
            bar.set_description(f"seed {s} one process {size * b}")
            mine[("alone", b, s)] = run_alone(size * b, s, datasets[s], args, bar)
            loads.append(os.getloadavg()[0])
    ours = [(k, v) for k, v in mine.items() if rank == 0 or k[0] == "alone"]
    everyone = hvd.allgather_object(ours, name="why.results")  # one list per rank
    return ({k: v for part in everyone for k, v in part}, loads) if rank == 0 else ({}, [])


# ----------------------------------------------------------------------- reporting


def rows(results: dict, args: argparse.Namespace, size: int) -> list:
    """One row per setting and per-rank batch: its label, how many images each BN statistic
    covers, and the per-seed results (``score``'s dicts, in seed order)."""
    out = []
    for b in args.batches:
        per_seed = lambda bn, key=None: [results[(bn, b, s)][key] if key else results[(bn, b, s)]  # noqa: E731
                                         for s in range(args.seeds)]
        out += [(f"local BN, {size} ranks x {b}", b, per_seed("local")),
                (f"local BN, {size} ranks x {b}, running stats averaged over ranks", b, per_seed("local", "averaged")),
                (f"SyncBN, {size} ranks x {b}", size * b, per_seed("sync")),
                (f"one process, {size * b} images", size * b, per_seed("alone"))]
    return out


def commit() -> str:
    """This checkout's commit, ``+ uncommitted changes`` when it has some."""
    git = lambda *a: subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def report(results: dict, args: argparse.Namespace, size: int, header: str) -> str:
    """The markdown tables: mIoU and mean train/eval gap per setting, SyncBN against one
    process per seed, and the gap per BN layer."""
    table = rows(results, args, size)
    lines = [header, "",
             f"| setting | BN statistics over | val mIoU, mean ± std over {args.seeds} seeds | per seed "
             "| train/eval gap, mean over BN layers |", "|---|---|---|---|---|"]
    for label, n, runs in table:
        miou = np.array([r["miou"] for r in runs])
        gap = np.mean([np.mean(list(r["gap"].values())) for r in runs])
        sd = f"{miou.std(ddof=1):.3f}" if len(miou) > 1 else "-"
        lines.append(f"| {label} | {n} image{'s' * (n > 1)} | {miou.mean():.3f} ± {sd} | "
                     f"{', '.join(f'{v:.3f}' for v in miou)} | {gap:.3f} |")
    lines += ["", f"SyncBN at {size} ranks x b against one process at {size}*b images, same seed (the same "
              "mathematics up to float summation order): training-loss difference at the first step (the same "
              "weights, so float summation order only), the largest over the first 10 steps and over all steps "
              "(Adam and training amplify it), and the final val mIoU difference:", "",
              "| b | seed | loss, step 1 | loss, first 10 steps | loss, all steps | val mIoU |",
              "|---|---|---|---|---|---|"]
    for b in args.batches:
        for s in range(args.seeds):
            sync, alone = results[("sync", b, s)], results[("alone", b, s)]
            diff = np.abs(np.subtract(sync["losses"], alone["losses"]))
            lines.append(f"| {b} | {s} | {diff[0]:.1e} | {diff[:10].max():.1e} | {diff.max():.1e} | "
                         f"{sync['miou'] - alone['miou']:+.3f} |")
    layers = list(table[0][2][0]["gap"])
    lines += ["", "Train/eval gap per BN layer (mean over seeds): the RMS difference between the layer's "
              "train-mode and eval-mode outputs, in units of its normalised output:", "",
              "| setting | " + " | ".join(short(n) for n in layers) + " |", "|---" * (len(layers) + 1) + "|"]
    for label, _, runs in table:
        lines.append(f"| {label} | " + " | ".join(f"{np.mean([r['gap'][n] for r in runs]):.3f}" for n in layers)
                     + " |")
    return "\n".join(lines) + "\n"


def short(layer: str) -> str:
    """``enc1.0.1`` (the BN inside a conv-BN-ReLU block) -> ``enc1.0``."""
    return layer.rsplit(".", 1)[0]


KINDS = ("local BN (rank 0's running stats)", "local BN (running stats averaged over ranks)", "SyncBN",
         "one process, the whole global batch")


def plot(results: dict, args: argparse.Namespace, size: int, path: Path) -> None:
    """Left: val mIoU per setting (mean ± std, a dot per seed); right: the train/eval gap
    per BN layer (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = rows(results, args, size)
    colours = ["tab:red", "salmon", "tab:blue", "black"]
    fig, (ax_iou, ax_gap) = plt.subplots(1, 2, figsize=(13, 5.6), gridspec_kw={"width_ratios": [1, 1.3]})
    for i, (label, _, runs) in enumerate(table):
        miou = np.array([r["miou"] for r in runs])
        x = i + i // 4  # a space between the per-rank batches
        colour = colours[i % 4]
        ax_iou.bar(x, miou.mean(), yerr=miou.std(ddof=1) if len(miou) > 1 else 0, color=colour, alpha=0.35,
                   capsize=4, label=KINDS[i] if i < 4 else None)
        ax_iou.plot([x] * len(miou), miou, "o", color=colour, ms=4)
        layers = list(runs[0]["gap"])
        gap = [np.mean([r["gap"][n] for r in runs]) for n in layers]
        ax_gap.plot(range(len(layers)), gap, marker="os"[(i // 4) % 2], color=colour,
                    ls="-" if i // 4 == 0 else "--", label=label)
    ax_iou.set_xticks([1.5 + 5 * j for j in range(len(args.batches))],
                      [f"{b} image{'s' * (b > 1)} per rank\n({size} ranks; one process: {size * b})"
                       for b in args.batches])
    ax_iou.set(ylabel="val mIoU (eval mode)", title=f"validation mIoU, mean ± std over {args.seeds} seeds")
    lo = min(r["miou"] for _, _, runs in table for r in runs)
    ax_iou.set_ylim(max(0.0, lo - 0.1), 1.0)
    ax_iou.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    ax_gap.set_xticks(range(len(layers)), [short(n) for n in layers])
    ax_gap.set_yscale("log")
    ax_gap.set(xlabel="BN layer", ylabel="RMS(train-mode - eval-mode output)",
               title="train/eval gap per BN layer, on validation images")
    ax_gap.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    for ax in (ax_iou, ax_gap):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    size = hvd.size()
    if size < 2:
        sys.exit("why_syncbn.py compares local BN and SyncBN across ranks: launch it on 2 or more, e.g. "
                 "launch/mpirun.sh -np 4 --oversubscribe -- python examples/why_syncbn.py")
    start, started, code = time.perf_counter(), datetime.datetime.now().astimezone(), commit()  # before the run
    log(f"{size} ranks x {args.batches} images per rank, {args.seeds} seed(s), {args.epochs} epochs; "
        f"{len(bn_buffers(SegNet(args.width))) // 3} BN layers; 1 thread per rank on {os.cpu_count()} cores")
    results, loads = experiment(args)
    if hvd.rank() != 0:
        return
    minutes = (time.perf_counter() - start) / 60
    script = os.path.relpath(Path(sys.argv[0]).resolve(), ROOT)
    header = (f"`{' '.join(['python', script, *sys.argv[1:]])}` on {size} ranks, {os.cpu_count()} CPU cores, at commit "
              f"{code}, {started:%Y-%m-%d %H:%M %Z}: {minutes:.1f} min; 1-minute load average during the run "
              f"{np.mean(loads):.1f} (max {max(loads):.1f}). {args.epochs} epochs of {args.train_size} training "
              f"images {args.image_size}x{args.image_size}, Adam lr {args.lr}, U-Net width {args.width}; "
              f"{args.val_size} validation images; seed 0's training images: "
              f"{describe(make_photos(args.train_size, args.image_size, 0)[0])}.")
    text = report(results, args, size, header)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "ranks": size,
         "minutes": minutes, "loads": loads, "header": header,
         "runs": [{"bn": bn, "b": b, "seed": s, **r} for (bn, b, s), r in sorted(results.items())]}))
    plot(results, args, size, args.out.with_suffix(".png"))
    log(text)
    log(f"wrote {args.out}.md, .json, .png in {minutes:.1f} min")


if __name__ == "__main__":
    main()
