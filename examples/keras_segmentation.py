"""Keras segmentation on generated shapes with 2 images per rank: synchronized vs local BN.

    horovodrun -np 2 python examples/keras_segmentation.py                   # sync BN, 3 epochs
    horovodrun -np 2 python examples/keras_segmentation.py --bn local        # plain per-rank BN
    horovodrun -np 2 python examples/keras_segmentation.py --resume --epochs 5
    horovodrun -np 2 python examples/keras_segmentation.py --compare         # both, then a plot
    bash launch/demo.sh keras [args]                                         # set up, then line 1

The Keras 3 twin of examples/torch_segmentation.py: same data recipe, network, flags and
printed lines. Noisy images with circles, squares and triangles are generated, labelled
per pixel (background + 3 classes), the same on every rank for a given ``--seed`` (numpy
draws them, so they are not the torch demo's images). Each rank runs ``model.fit`` on
its own equal shard with ``--batch-size`` images per step (default 2), so plain
``BatchNormalization`` normalises over 2 images, SyncBatchNormalization over all
ranks' images. After each epoch rank 0 prints the mean training loss (averaged over the
ranks) and the validation mIoU in inference mode (every rank scores a slice; the
confusion matrices are summed), checks that every BN moving statistic is the same on all
ranks (with ``--bn local`` they differ, and rank 0's are kept), and saves a checkpoint:
a ``.keras`` model with its optimizer state, which loads without Horovod once
``hvd_syncbn.tensorflow`` is imported, and a JSON file naming it, written last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by path
from demo_common import (CLASSES, EVAL_BATCH, arg_parser, atomic_write, check_global_batch,  # noqa: E402
                         console_logging, iou_from_confusion, parse_checked, quiet_startup, rank0_log,
                         shape_mask, train_and_compare)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported
with quiet_startup():
    import keras
    import tensorflow as tf

    import horovod.tensorflow as hvd
    from hvd_syncbn.tensorflow import (BroadcastGlobalVariablesCallback, DistributedOptimizer,
                                       MetricAverageCallback, convert_sync_batchnorm)

log = rank0_log(hvd.rank)


def parse_args() -> argparse.Namespace:
    parser = arg_parser(__doc__, threads_help="TensorFlow threads per rank",
                        plot=Path("results/demo_compare_keras.png"))
    args = parse_checked(parser)
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    return args


# ---------------------------------------------------------------------------- data


def make_shapes(n: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images ``(n, size, size, 3)`` of 2-4 bright shapes on a dark noisy background,
    and their labels ``(n, size, size)``: index into :data:`CLASSES`. Deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)  # (H, W) each
    images = np.empty((n, size, size, 3), np.float32)
    labels = np.zeros((n, size, size), np.int32)
    for i in range(n):
        img = np.broadcast_to(0.4 * rng.random(3, np.float32), (size, size, 3)).copy()  # (H, W, 3)
        for _ in range(int(rng.integers(2, 5))):
            cls = int(rng.integers(1, len(CLASSES)))
            r = size * (0.08 + 0.1 * rng.random())
            cy, cx = r + (size - 2 * r) * rng.random(2)
            mask = shape_mask(cls, xx - cx, yy - cy, r)  # (H, W); later shapes cover earlier
            img[mask] = 0.5 + 0.5 * rng.random(3, np.float32)
            labels[i][mask] = cls
        images[i] = img + 0.15 * rng.standard_normal((size, size, 3), np.float32)
    return images, labels


def epoch_order(n: int, epoch: int, seed: int, steps: int, batch: int) -> np.ndarray:
    """This rank's image indices for ``epoch``, ``(steps * batch,)``: like PyTorch's
    ``DistributedSampler(shuffle=True, drop_last=True)``, one permutation per epoch shared
    by all ranks, dealt out round-robin, so every rank gets the same number of steps."""
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    mine = perm[: n - n % hvd.size()][hvd.rank() :: hvd.size()]
    return mine[: steps * batch]


def train_dataset(images: np.ndarray, labels: np.ndarray, first: int, last: int, args: argparse.Namespace,
                  steps: int) -> tf.data.Dataset:
    """Batches for epochs ``first..last`` in a row; ``fit(steps_per_epoch=steps)`` keeps one
    iterator over them, so epoch ``e``'s order does not depend on where training started."""
    order = np.concatenate([epoch_order(len(images), e, args.seed, steps, args.batch_size)
                            for e in range(first, last + 1)])
    x, y = tf.constant(images), tf.constant(labels)
    options = tf.data.Options()
    options.threading.private_threadpool_size = args.threads
    return (tf.data.Dataset.from_tensor_slices(order).batch(args.batch_size)
            .map(lambda i: (tf.gather(x, i), tf.gather(y, i)))  # (b, H, W, 3), (b, H, W)
            .prefetch(1).with_options(options))


# --------------------------------------------------------------------------- model


def conv_bn_relu(x, filters: int, name: str):
    # Keras momentum is the weight of the old value: 0.9 is PyTorch's default momentum=0.1.
    x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{name}_conv")(x)
    x = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5, name=f"{name}_bn")(x)
    return keras.layers.ReLU(name=f"{name}_relu")(x)


def seg_net(width: int, size: int, classes: int = len(CLASSES)) -> keras.Model:
    """A small U-Net: three scales, skip connections, BatchNormalization after every 3x3
    conv. Layers are named, so the SyncBN collectives are the same in every build."""
    w = width
    inputs = keras.Input((size, size, 3), name="image")  # (N, H, W, 3)
    e1 = conv_bn_relu(conv_bn_relu(inputs, w, "enc1a"), w, "enc1b")  # (N, H, W, w)
    p1 = keras.layers.MaxPooling2D(name="pool1")(e1)
    e2 = conv_bn_relu(conv_bn_relu(p1, 2 * w, "enc2a"), 2 * w, "enc2b")  # (N, H/2, W/2, 2w)
    p2 = keras.layers.MaxPooling2D(name="pool2")(e2)
    e3 = conv_bn_relu(conv_bn_relu(p2, 4 * w, "enc3a"), 4 * w, "enc3b")  # (N, H/4, W/4, 4w)
    u2 = keras.layers.Concatenate(name="skip2")([keras.layers.UpSampling2D(name="up2")(e3), e2])
    d2 = conv_bn_relu(u2, 2 * w, "dec2")  # (N, H/2, W/2, 2w)
    u1 = keras.layers.Concatenate(name="skip1")([keras.layers.UpSampling2D(name="up1")(d2), e1])
    d1 = conv_bn_relu(u1, w, "dec1")  # (N, H, W, w)
    logits = keras.layers.Conv2D(classes, 1, name="head")(d1)  # (N, H, W, classes)
    return keras.Model(inputs, logits, name="seg_net")


def build_model(args: argparse.Namespace, bn: str, weights: list | None = None) -> keras.Model:
    """The U-Net with ``weights`` (if given), converted to SyncBN for ``bn == "sync"``, compiled."""
    model = seg_net(args.width, args.image_size)
    if weights is not None:
        model.set_weights(weights)
    if bn == "sync":
        model = convert_sync_batchnorm(model)
    # No XLA: Horovod's collectives have no XLA kernels (and XLA is off on CPU anyway).
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.Adam(args.lr)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    return model


def bn_moving_stats(model: keras.Model) -> list:
    """Every BN layer's moving_mean and moving_variance variables."""
    return [v for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)
            for v in (layer.moving_mean, layer.moving_variance)]


# ---------------------------------------------------------------------- checks, IO


def packed(variables: list) -> tf.Tensor:
    """The variables' values, flattened into one float64 vector."""
    return tf.concat([tf.reshape(tf.cast(v, tf.float64), [-1]) for v in variables], 0)  # (total,)


def bn_spread(model: keras.Model) -> tuple[float, str]:
    """Largest max-minus-min over ranks of any BN moving statistic, and where it is.

    Two packed allreduces (max and min); every rank gets the same answer.
    """
    stats = bn_moving_stats(model)
    flat = packed(stats)
    hi = hvd.allreduce(flat, op=hvd.Max, name="bn_check.max")
    lo = hvd.allreduce(flat, op=hvd.Min, name="bn_check.min")
    per_var = [float(tf.reduce_max(d)) for d in tf.split(hi - lo, [int(np.prod(v.shape)) for v in stats])]
    worst = int(np.argmax(per_var))
    return per_var[worst], stats[worst].path


def broadcast_bn_stats(model: keras.Model) -> None:
    """Every rank takes rank 0's BN moving statistics, in one packed broadcast."""
    stats = bn_moving_stats(model)
    flat = hvd.broadcast(packed(stats), root_rank=0, name="bn_check.rank0")
    for v, part in zip(stats, tf.split(flat, [int(np.prod(v.shape)) for v in stats])):
        v.assign(tf.cast(tf.reshape(part, v.shape), v.dtype))


def evaluate(model: keras.Model, images: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per-class IoU ``(classes,)`` on the whole set, in inference mode (moving statistics):
    each rank scores every ``size``-th image and the confusion matrices are summed over ranks."""
    k = len(CLASSES)
    mine = slice(hvd.rank(), None, hvd.size())
    x_all, y_all = images[mine], labels[mine]
    confusion = np.zeros(k * k, np.int64)
    for i in range(0, len(x_all), EVAL_BATCH):
        pred = np.argmax(model(x_all[i : i + EVAL_BATCH], training=False), -1)  # (n, H, W)
        confusion += np.bincount((y_all[i : i + EVAL_BATCH] * k + pred).ravel(), minlength=k * k)
    confusion = hvd.allreduce(tf.constant(confusion), op=hvd.Sum, name="val.confusion")
    return iou_from_confusion(confusion.numpy().reshape(k, k))  # (true, predicted)


def save_checkpoint(meta_path: Path, model: keras.Model, meta: dict) -> None:
    """Rank 0: the model for this epoch, then the JSON that names it. The JSON is the commit
    point: whenever a run stops, it names a complete model of the epoch it states."""
    name = f"{meta_path.stem}.epoch{meta['epoch']}.keras"
    atomic_write(meta_path.parent / name, lambda tmp: model.save(tmp))  # weights + optimizer state
    atomic_write(meta_path, lambda tmp: Path(tmp).write_text(json.dumps({**meta, "model": name}, indent=1)))
    for old in meta_path.parent.glob(f"{meta_path.stem}.epoch*.keras"):
        if old.name != name:
            old.unlink()


def load_checkpoint(meta_path: Path, model: keras.Model) -> tuple[int, dict]:
    """Rank 0 loads the model and optimizer state named by ``meta_path``; every rank gets
    its epoch and history. ``BroadcastGlobalVariablesCallback`` then copies rank 0's state."""
    meta = None
    if hvd.rank() == 0 and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        model.optimizer.build(model.trainable_variables)  # its variables must exist to be loaded
        model.load_weights(meta_path.parent / meta["model"])
        meta = (meta["epoch"], meta["history"])
    meta = hvd.broadcast_object(meta, root_rank=0, name="resume.meta")
    if meta is None:
        if hvd.rank() == 0:
            print(f"--resume: no checkpoint at {meta_path}; run once without --resume", file=sys.stderr)
        sys.exit(2)
    return meta


# -------------------------------------------------------------------------- train


class EpochEnd(keras.callbacks.Callback):
    """After each epoch: record the (rank-averaged) loss, check the BN moving statistics,
    score the validation set, print, checkpoint. Every rank runs the collectives."""

    def __init__(self, bn: str, args: argparse.Namespace, val_set: tuple, meta_path: Path, history: dict):
        super().__init__()
        self.bn, self.args, self.val_set, self.meta_path, self.history = bn, args, val_set, meta_path, history

    def on_epoch_end(self, epoch, logs=None):
        epoch += 1  # Keras counts from 0
        self.history["loss"].append(float(logs["loss"]))  # already averaged by MetricAverageCallback

        spread, where = bn_spread(self.model)
        if spread == 0:
            log(f"BN moving statistics identical on all {hvd.size()} ranks: yes")
        elif self.bn == "local":  # expected: each rank's BN saw only its own images
            log(f"BN moving statistics identical on all {hvd.size()} ranks: no (local BN; largest "
                f"difference {spread:.3g} in {where}); evaluating and saving rank 0's")
            broadcast_bn_stats(self.model)
        else:
            log(f"BN moving statistics identical on all {hvd.size()} ranks: NO (largest difference "
                f"{spread:.3g} in {where}): SyncBatchNormalization is not synchronising")
            sys.exit(1)

        iou = evaluate(self.model, *self.val_set)
        self.history["miou"].append(float(np.nanmean(iou)))
        logs["val_miou"] = self.history["miou"][-1]
        per_class = " ".join(f"{c}={v:.3f}" for c, v in zip(CLASSES, iou))
        log(f"{self.bn} BN epoch {epoch}/{self.args.epochs}: train loss {self.history['loss'][-1]:.4f}  "
            f"val mIoU {self.history['miou'][-1]:.4f}  ({per_class})")
        if hvd.rank() == 0:
            save_checkpoint(self.meta_path, self.model, {"epoch": epoch, "bn": self.bn, "history": self.history})


def train(model: keras.Model, bn: str, args: argparse.Namespace, train_set: tuple, val_set: tuple,
          resume: bool = False) -> dict:
    """Train ``model`` for ``args.epochs`` epochs with ``model.fit``; returns the per-epoch history."""
    meta_path = args.checkpoint_dir / f"keras_segmentation_{bn}.json"
    start, history = 0, {"loss": [], "miou": []}
    if resume:
        start, history = load_checkpoint(meta_path, model)
        todo = f"epochs {start + 1}..{args.epochs} to go" if start < args.epochs else "raise --epochs"
        log(f"resumed from epoch {start} ({meta_path}); {todo}")
    if start >= args.epochs:
        return history

    steps = len(train_set[0]) // hvd.size() // args.batch_size
    callbacks = [BroadcastGlobalVariablesCallback(0), MetricAverageCallback()]
    # One progress bar, on rank 0, where it can redraw in place (--progress); elsewhere
    # EpochEnd's line per epoch is the progress.
    bar = hvd.rank() == 0 and args.progress
    if bar:  # before EpochEnd, so the bar ends before our lines
        callbacks.append(keras.callbacks.ProgbarLogger())
    callbacks.append(EpochEnd(bn, args, val_set, meta_path, history))
    model.fit(train_dataset(*train_set, start + 1, args.epochs, args, steps), epochs=args.epochs,
              initial_epoch=start, steps_per_epoch=steps, shuffle=False, callbacks=callbacks,
              verbose=1 if bar else 0)
    return history


def main() -> None:
    args = parse_args()
    console_logging()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)  # before any TF op
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    hvd.init()
    check_global_batch(args, hvd.size(), log)

    train_set = make_shapes(args.train_size, args.image_size, 2 * args.seed)
    val_set = make_shapes(args.val_size, args.image_size, 2 * args.seed + 1)
    keras.utils.set_random_seed(args.seed)
    init = seg_net(args.width, args.image_size).get_weights()  # for --compare: both runs start from these
    model = build_model(args, args.bn, init)
    log(f"data: {args.train_size} train / {args.val_size} val images {args.image_size}x{args.image_size}x3, "
        f"{len(CLASSES)} classes; {len(bn_moving_stats(model)) // 2} BN layers, --bn {args.bn}; "
        f"{sum(int(np.prod(v.shape)) for v in model.trainable_weights)} parameters; {args.threads} thread(s)/rank")

    def train_bn(bn: str, resume: bool) -> dict:
        return train(model if bn == args.bn else build_model(args, bn, init), bn, args, train_set, val_set,
                     resume=resume)

    train_and_compare(args, train_bn, hvd.size(), hvd.rank() == 0, log, title_prefix="Keras, ",
                      eval_mode="inference mode")


if __name__ == "__main__":
    main()
