"""What the PyTorch and Keras segmentation demos share: flags, shapes, IoU, files, logging.

Framework-free (argparse, numpy, matplotlib): each demo passes in what differs, such as
its rank function or its checkpoint writer, the way Horovod's Keras front ends pass in
their backend.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

CLASSES = ("background", "circle", "square", "triangle")
EVAL_BATCH = 16


# ------------------------------------------------------------------------- flags


def arg_parser(description: str, *, threads_help: str, plot: Path) -> argparse.ArgumentParser:
    """The demos' flags; ``threads_help`` and the ``--plot`` default are each demo's own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bn", choices=["sync", "local"], default="sync",
                        help="sync: BN statistics over all ranks; local: over this rank's batch")
    add_training_flags(parser, epochs=3, image_size=64)
    parser.add_argument("--batch-size", type=int, default=2, help="images per rank per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help=threads_help)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint of this --bn")
    parser.add_argument("--compare", action="store_true",
                        help="then train the other --bn from the same initial weights and plot both")
    parser.add_argument("--plot", type=Path, default=plot)
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar on rank 0 that redraws in place (default: on when run "
                             "alone in a terminal; launch/demo.sh turns it on when its output is one); "
                             "without it the line per epoch is the progress")
    return parser


def add_training_flags(parser: argparse.ArgumentParser, *, epochs: int, image_size: int) -> None:
    """The data, net and optimizer flags every segmentation script here shares."""
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--train-size", type=int, default=320, help="training images, split over ranks")
    parser.add_argument("--val-size", type=int, default=96)
    parser.add_argument("--image-size", type=int, default=image_size, help="a multiple of 4 (two 2x poolings)")
    parser.add_argument("--width", type=int, default=16, help="channels of the first conv")
    parser.add_argument("--lr", type=float, default=2e-3)


def parse_checked(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse ``sys.argv`` with ``parser`` and reject the flag combinations neither demo can run."""
    args = parser.parse_args()
    if args.compare and args.resume:
        parser.error("--compare trains both runs from the same initial weights; drop --resume")
    if args.image_size % 4:
        parser.error(f"--image-size must be a multiple of 4 (two 2x poolings), got {args.image_size}")
    if args.progress is None:  # under mpirun stdout is a pty even into a file, stderr a pipe
        args.progress = sys.stdout.isatty() and sys.stderr.isatty()
    return args


def check_global_batch(args: argparse.Namespace, ranks: int, log: Callable[[str], None]) -> None:
    """Exit unless each of ``ranks`` ranks gets at least one full batch; log the global batch."""
    n, b = ranks, args.batch_size
    if args.train_size // n < b:
        sys.exit(f"--train-size {args.train_size} gives each of {n} ranks fewer than --batch-size {b} images")
    log(f"global batch = {n} ranks x {b} images; BN statistics over {n * b} images (sync) / {b} images (local)")


# -------------------------------------------------------------------------- data


def shape_mask(cls: int, dx, dy, r: float):
    """Pixels inside a circle, square or upward triangle of radius ``r``; ``dx, dy`` are
    offsets from its centre, ``(H, W)`` each, numpy arrays or torch tensors alike."""
    if cls == 1:
        return dx**2 + dy**2 <= r**2
    if cls == 2:
        return (abs(dx) <= r) & (abs(dy) <= r)
    return (dy <= r) & (abs(dx) <= (dy + r) / 2)  # apex at (0, -r), base at dy = r


# ----------------------------------------------------------------- scores, files


def iou_from_confusion(confusion: np.ndarray) -> np.ndarray:
    """Per-class IoU ``(classes,)`` in float64 from a ``(true, predicted)`` confusion matrix
    ``(classes, classes)``: hits over (predicted + true - hits); NaN for a class in neither."""
    confusion = np.asarray(confusion, np.float64)
    hits = np.diag(confusion)
    with np.errstate(invalid="ignore"):
        return hits / (confusion.sum(0) + confusion.sum(1) - hits)


class DiskFullError(OSError):
    """A file did not fit on its disk; the previous version of it is left as it was."""


def atomic_write(path: Path, write: Callable[[str], object], size: int | None = None) -> None:
    """``write(tmp)`` a temporary file beside ``path``, then rename: a crash never leaves a torn file.

    The temporary name keeps ``path``'s suffix, for writers (Keras) that check it. If the
    disk is full, raises :class:`DiskFullError` naming ``path``, the space needed
    (``size`` bytes where the caller knows it, else more than was written) and free, and
    whether a previous ``path`` is left; the temporary file is removed.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        written = os.path.getsize(tmp) if os.path.exists(tmp) else 0
        full = isinstance(e, Exception) and _out_of_space(e, path.parent)
        if os.path.exists(tmp):
            os.unlink(tmp)
        if not full:
            raise
        free = shutil.disk_usage(path.parent).free
        needed = f"{_size(size)} needed" if size else f"more than the {_size(written)} written needed"
        kept = f"the previous {path.name} is left as it was" if path.exists() else f"there is no earlier {path.name}"
        raise DiskFullError(errno.ENOSPC, f"cannot write {path}: no space left on its disk ({needed}, "
                                          f"{_size(free)} free); {kept}. Free some space or pass another "
                                          f"--checkpoint-dir") from e


def _out_of_space(error: BaseException, folder: Path) -> bool:
    """Whether ``error`` (or one it came from) says the disk is full, or, for writers whose
    errors do not say (torch's ``basic_ios::clear``), the disk has under 1 MiB left."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return shutil.disk_usage(folder).free < 2**20


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} bytes"


# The INFO lines of TensorFlow's C++ start-up (absl-formatted), their continuation, and
# absl's notice that it logs them all: TF 2.21 writes them before it reads TF_CPP_MIN_LOG_LEVEL.
STARTUP_NOISE = re.compile(r"(I\d{4} [\d:. ]+\S+\.cc:\d+\] |To enable the following "
                           r"instructions: |WARNING: All log messages before absl::InitializeLog\(\) is called)")


@contextlib.contextmanager
def quiet_startup() -> Iterator[None]:
    """Import the frameworks inside this: it drops their C++ start-up INFO lines
    (:data:`STARTUP_NOISE`) from stderr and writes every other line back at the end."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not STARTUP_NOISE.match(line)))
            sys.stderr.flush()


def console_logging() -> None:
    """The ``hvd_syncbn`` log (its one line says, on rank 0, which transport carries the
    statistics) on stdout, in order with the demo's lines, above a progress bar."""

    class Console(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            from tqdm import tqdm

            with tqdm.external_write_mode(file=sys.stdout):  # clears a bar, then redraws it
                sys.stdout.write(self.format(record) + "\n")  # one write: one mpirun tag
                sys.stdout.flush()

    logger = logging.getLogger("hvd_syncbn")
    logger.addHandler(Console())
    logger.propagate = False


def rank0_log(rank: Callable[[], int]) -> Callable[[str], None]:
    """``log(msg)``: print on the rank where ``rank()`` is 0, in one write. Under mpirun
    stdout is a pty, and ``print``'s separate writes of text and newline each get their
    own ``[1,0]<stdout>:`` tag."""

    def log(msg: str) -> None:
        if rank() == 0:
            sys.stdout.write(msg + "\n")
            sys.stdout.flush()

    return log


def plot(histories: dict, path: Path, title: str, eval_mode: str) -> None:
    """Per-epoch training loss and validation mIoU of each run, side by side, as a PNG;
    ``eval_mode`` says how the validation set was scored (``"eval mode"``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_iou) = plt.subplots(1, 2, figsize=(10, 4))
    for label, h in histories.items():
        epochs = range(1, len(h["loss"]) + 1)
        ax_loss.plot(epochs, h["loss"], marker="o", label=label)
        ax_iou.plot(epochs, h["miou"], marker="o", label=label)
    ax_loss.set(xlabel="epoch", ylabel="mean training loss", title="training loss")
    ax_iou.set(xlabel="epoch", ylabel="mIoU", title=f"validation mIoU ({eval_mode})")
    for ax in (ax_loss, ax_iou):
        ax.grid(alpha=0.3)
        ax.legend()
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report_compare(histories: dict, args: argparse.Namespace, ranks: int, rank0: bool, log: Callable[[str], None],
                   *, title_prefix: str, eval_mode: str) -> None:
    """``--compare``'s end: log each run's final mIoU; rank 0 plots both runs to ``args.plot``."""
    log("final val mIoU: " + ", ".join(f"{k} BN {h['miou'][-1]:.4f}" for k, h in histories.items()))
    if rank0:
        n, b = ranks, args.batch_size
        images = {"sync": n * b, "local": b}
        title = f"{title_prefix}{n} ranks x {b} images per rank: BN statistics over {n * b} (sync) vs {b} (local) images"
        plot({f"{k} BN ({images[k]} images)": h for k, h in histories.items()}, args.plot, title, eval_mode)
        log(f"wrote {args.plot}")


def train_and_compare(args: argparse.Namespace, train_bn: Callable[[str, bool], dict], ranks: int, rank0: bool,
                      log: Callable[[str], None], *, title_prefix: str, eval_mode: str) -> None:
    """Train ``--bn`` (``train_bn(bn, resume)`` returns its history); with ``--compare``,
    then the other BN from the same initial weights, and report both."""
    histories = {args.bn: train_bn(args.bn, args.resume)}
    if args.compare:
        other = "local" if args.bn == "sync" else "sync"
        log(f"--compare: training --bn {other} from the same initial weights")
        histories[other] = train_bn(other, False)
        report_compare(histories, args, ranks, rank0, log, title_prefix=title_prefix, eval_mode=eval_mode)
