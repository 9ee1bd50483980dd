"""End-to-end Keras training step (``train_on_batch``: forward, loss, backward, SGD step)
with our SyncBatchNormalization on each path of its statistics and with local Keras BN,
with and without XLA, interleaved in one job.

    launch/mpirun.sh -np 2 -- python benchmarks/e2e_tf.py      # prints the ratios
    python benchmarks/run.py                                    # the full report (calls jobs())

Variants, each its own copy of one net, compiled by ``model.compile`` with
``DistributedOptimizer(SGD)`` (so only the BN layers differ):

- ``local``, ``local_xla``: ``keras.layers.BatchNormalization`` on the rank's rows,
  ``jit_compile=False`` and ``True``;
- ``host``, ``device``: ours, ``stats="host"`` and ``"device"``, ``jit_compile=False``;
- ``xla``: ours with the default ``stats`` and ``jit_compile=True`` (the device path,
  summed by hvd_syncbn's XLA allreduce over MPI: mpirun only).

Two nets: a ResNet-18-like classifier (as ``e2e_torch.py``'s, 4 x 64 x 64 x 3 per rank,
20 BN layers) and ``keras.applications.MobileNetV2`` (alpha 0.35, 8 x 32 x 32 x 3 per
rank, 52 BN layers on small maps: BN-bound, where a SyncBN's fixed cost shows most).
"""

from __future__ import annotations

import argparse
import json
import os

NETS = {"resnet18ish": ((4, 64, 64, 3), 10), "mobilenetv2": ((8, 32, 32, 3), 10)}
VARIANTS = ("local", "local_xla", "host", "device", "xla")


def resnet18ish(keras, shape: tuple, classes: int):
    """ResNet-18's stages (2 basic blocks each, 64-512 channels) behind a 3x3 stride-2
    stem without max-pooling: 64x64 -> 32, 16, 8, 4 (``e2e_torch.ResNet18ish``)."""
    layers = keras.layers

    def conv_bn(x, c, k, stride):
        return layers.BatchNormalization()(layers.Conv2D(c, k, stride, padding="same", use_bias=False)(x))

    inputs = keras.Input(shape[1:])  # (N, H, W, 3)
    x = layers.ReLU()(conv_bn(inputs, 64, 3, 2))  # (N, H/2, W/2, 64)
    cin = 64
    for cout, stride in ((64, 1), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1)):
        y = conv_bn(layers.ReLU()(conv_bn(x, cout, 3, stride)), cout, 3, 1)
        short = x if stride == 1 and cin == cout else conv_bn(x, cout, 1, stride)
        x, cin = layers.ReLU()(layers.Add()([y, short])), cout
    x = layers.GlobalAveragePooling2D()(x)  # (N, 512)
    return keras.Model(inputs, layers.Dense(classes)(x), name="resnet18ish")


def mobilenetv2(keras, shape: tuple, classes: int):
    return keras.applications.MobileNetV2(input_shape=shape[1:], alpha=0.35, weights=None, classes=classes,
                                          classifier_activation=None)


def variants(keras, net: str, hvd_syncbn_tf) -> dict:
    """``{variant: compiled model}``, every one with the same initial weights."""
    shape, classes = NETS[net]
    keras.utils.set_random_seed(0)
    local = globals()[net](keras, shape, classes)
    models = {"local": local, "local_xla": keras.models.clone_model(local),
              "host": hvd_syncbn_tf.convert_sync_batchnorm(local, stats="host"),
              "device": hvd_syncbn_tf.convert_sync_batchnorm(local, stats="device"),
              "xla": hvd_syncbn_tf.convert_sync_batchnorm(local)}
    for name, model in models.items():
        model.set_weights(local.get_weights())
        model.compile(optimizer=hvd_syncbn_tf.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=name.endswith("xla"))
    return models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--nets", default=",".join(NETS))
    parser.add_argument("--out", help="JSON file for the results (rank 0)")
    args = parser.parse_args()
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    # 1 inter-op thread: a rank per core, as a rank per GPU. With 2 per rank (2 ranks on 2
    # cores, BENCH_TF_INTER_OP=2) the OS time-slices 4 threads and each rank runs its
    # ready ops in another order, so every per-layer collective waits on the slower rank:
    # MobileNetV2's device path 2.1x local BN, against 1.4-1.6x with 1 (docs/performance.md).
    # Under mpirun the host path sums over MPI (bench_tf.py's Horovod transport needs 2:
    # its numpy_function runs Horovod's own op).
    tf.config.threading.set_inter_op_parallelism_threads(int(os.environ.get("BENCH_TF_INTER_OP", "1")))
    import horovod.tensorflow as hvd
    import keras

    import hvd_syncbn.tensorflow as hvd_syncbn_tf
    from common import make_barrier, timed, write_json

    hvd.init()
    barrier = make_barrier(hvd)
    result = {"ranks": hvd.size(), "comm": os.environ.get("HVD_SYNCBN_COMM", "(unset)"), "nets": {}}
    for net in args.nets.split(","):
        shape, classes = NETS[net]
        models = variants(keras, net, hvd_syncbn_tf)
        rng = np.random.default_rng(1 + hvd.rank())
        x = tf.constant(rng.standard_normal(shape), tf.float32)
        y = tf.constant(rng.integers(0, classes, shape[0]))
        for model in models.values():  # trace and compile outside the timing
            model.train_on_batch(x, y)
        times = timed({name: (lambda m=m: m.train_on_batch(x, y)) for name, m in models.items()}, args.iters,
                      barrier)
        bn = sum(isinstance(layer, keras.layers.BatchNormalization) for layer in models["local"].layers)
        result["nets"][net] = {"times": times, "bn_layers": bn, "input": list(shape),
                               "jit": {name: bool(m.jit_compile) for name, m in models.items()}}
    if hvd.rank() != 0:
        return
    if args.out:
        return write_json(args.out, result)
    for net, r in result["nets"].items():
        t = {k: v["median"] for k, v in r["times"].items()}
        print(f"{net} ({r['bn_layers']} BN, {hvd.size()} ranks), median ms: "
              + ", ".join(f"{k} {v:.1f}" for k, v in t.items()))
        print(f"  / local: host {t['host'] / t['local']:.2f}x, device {t['device'] / t['local']:.2f}x, "
              f"xla {t['xla'] / t['local']:.2f}x; xla / local_xla {t['xla'] / t['local_xla']:.2f}x")


def jobs(runner, iters: int, nets: str = ",".join(NETS)) -> dict:
    """``{"2 ranks": worker result}``: one job under mpirun (the XLA allreduce needs MPI).
    ``runner`` is a :class:`jobs.Runner`."""
    return {"2 ranks": runner.mpirun(2, "e2e_tf.py", ["--iters", str(iters), "--nets", nets])}


if __name__ == "__main__":
    main()
