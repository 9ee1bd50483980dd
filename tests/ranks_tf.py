"""Keras SyncBatchNormalization against plain Keras BN on the concatenated global batch.

Runs at any world size, launched by ``test_launch.py`` (1 rank plainly, 2 and 3 ranks
under horovodrun and mpirun). Expected values come from one process running
``keras.layers.BatchNormalization`` on the whole batch, which every rank builds itself,
in float64 (Keras's float32 variance, ``E[x²] − E[x]²``, is itself off by ~1e-5).
"""

from __future__ import annotations

import contextlib
import json
import os
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from hvd_syncbn import launchers  # noqa: E402
from hvd_syncbn.comm import SyncBatchNormError  # noqa: E402
from hvd_syncbn.mpi import MpiCommunicator  # noqa: E402
from hvd_syncbn.tensorflow import (  # noqa: E402
    BroadcastGlobalVariablesCallback, CheckSyncBatchNorm, DistributedOptimizer, MetricAverageCallback,
    SyncBatchNormalization, check, convert_sync_batchnorm, sync_batch_normalization, xla,
)
from keras_models import small_model  # noqa: E402
from oracle import (  # noqa: E402
    EMPTY, UNEQUAL, KerasTrainer, assert_as_accurate, assert_close, conditioned, eval_batch, global_batch, launched,
    shard_sizes, shard_slice, train_like_one_process, training_batches,
)

# The test that counts collectives in Horovod's timeline exists where test_launch.py turns
# the timeline on (TIMELINE there says why in one launch only).
TIMELINE = os.environ.get("HOROVOD_TIMELINE") == "DYNAMIC"
# Two logical CPUs: the towers and tf.distribute replicas of the in-process tests.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
)
hvd = pytest.importorskip("horovod.tensorflow")
hvd.init()
RANK, WORLD = hvd.rank(), hvd.size()


def allreduce_sum(t, name):
    t = tf.convert_to_tensor(t)
    if t.dtype in (tf.float16, tf.bfloat16):  # Horovod sums no bfloat16
        t = tf.cast(t, tf.float32)
    return hvd.allreduce(t, op=hvd.Sum, name=f"test.{name}")


class MultiAxisBN(keras.layers.Layer):
    """Plain-TF reference for a list of channel axes (Keras 3 BN takes one axis)."""

    def __init__(self, axes, momentum, epsilon, dtype):
        super().__init__(dtype=dtype)
        self.axes, self.momentum, self.epsilon = axes, momentum, epsilon

    def build(self, shape):
        cshape = [shape[a] for a in self.axes]
        self.gamma = self.add_weight(shape=cshape, initializer="ones", name="gamma")
        self.beta = self.add_weight(shape=cshape, initializer="zeros", name="beta")
        self.moving_mean = self.add_weight(shape=cshape, initializer="zeros", trainable=False, name="moving_mean")
        self.moving_variance = self.add_weight(shape=cshape, initializer="ones", trainable=False,
                                               name="moving_variance")

    def call(self, x, training=False):
        red = [a for a in range(len(x.shape)) if a not in self.axes]
        bshape = [1 if a in red else x.shape[a] for a in range(len(x.shape))]
        if training:
            mean, var = tf.nn.moments(x, red)
            self.moving_mean.assign(self.moving_mean * self.momentum + mean * (1 - self.momentum))
            self.moving_variance.assign(self.moving_variance * self.momentum + var * (1 - self.momentum))
        else:
            mean, var = self.moving_mean, self.moving_variance
        y = (x - tf.reshape(mean, bshape)) * tf.math.rsqrt(tf.reshape(var, bshape) + self.epsilon)
        return y * tf.reshape(self.gamma, bshape) + tf.reshape(self.beta, bshape)


def make_pair(tail, axis=-1, oracle_dtype="float64", stats=None, **kwargs):
    if isinstance(axis, list):
        plain = MultiAxisBN([a % (len(tail) + 1) for a in axis], kwargs.get("momentum", 0.99),
                            kwargs.get("epsilon", 1e-3), oracle_dtype)
    else:
        plain = keras.layers.BatchNormalization(axis=axis, **{"dtype": oracle_dtype, **kwargs})
    sync = SyncBatchNormalization(axis=axis, stats=stats, **kwargs)
    for layer in (plain, sync):
        layer.build((None, *tail))
        for name, lo, hi in (("gamma", 0.5, 1.5), ("beta", -0.3, 0.3)):
            w = getattr(layer, name, None)
            if w is not None:
                w.assign(tf.reshape(tf.linspace(lo, hi, int(np.prod(w.shape))), w.shape))
    return sync, plain


def run_steps(sync, plain, tail, pattern, steps=3, compiled=False, mask=False, scale=1.0, grad_atol=None, **tol):
    """Train ``sync`` on this rank's shard and ``plain`` on the whole batch (its data
    ``scale`` times unit normal, shifted by ``scale·step``); compare, by default within
    a tolerance from each batch's conditioning (:func:`oracle.conditioned`)."""
    sizes = shard_sizes(pattern, WORLD)
    axes = [a % (len(tail) + 1) for a in ([sync.axis] if isinstance(sync.axis, int) else sync.axis)]
    train_like_one_process(launched(RANK, WORLD, allreduce_sum), sizes,
                           training_batches(sum(sizes), tail, steps, drift=scale, scale=scale, mask=mask),
                           eval_batch(sum(sizes), tail), lambda rank: KerasTrainer(sync, compiled),
                           [KerasTrainer(plain)], conditioned(axes, grad_atol, **tol))


CASES = {
    "channels-last-4d": dict(tail=(5, 5, 4), pattern=UNEQUAL),
    "channels-first-4d": dict(tail=(4, 5, 5), axis=1, pattern=EMPTY),
    "2d": dict(tail=(6,), pattern=UNEQUAL),
    "3d-empty-rank": dict(tail=(7, 3), pattern=EMPTY),
    "5d": dict(tail=(2, 3, 4, 3), pattern=UNEQUAL),
    "no-center-no-scale": dict(tail=(5, 5, 4), pattern=UNEQUAL, kwargs=dict(center=False, scale=False)),
    "momentum-epsilon": dict(tail=(5, 5, 4), pattern=EMPTY, kwargs=dict(momentum=0.5, epsilon=1e-5)),
    "3d-channels-first": dict(tail=(3, 7), axis=1, pattern=UNEQUAL),
    "5d-channels-first": dict(tail=(3, 2, 3, 4), axis=1, pattern=EMPTY),
    # Variance 1e-4 against epsilon 1e-7: a kernel that raised epsilon to its usual floor
    # (1.001e-5, as tf.nn.fused_batch_norm does) would be 5% off. Input gradients scale
    # as 1/std (here 100), and so does atol.
    "tiny-epsilon": dict(tail=(5, 5, 4), pattern=UNEQUAL, kwargs=dict(epsilon=1e-7), scale=1e-2, grad_atol=1e-4),
    "axis-list": dict(tail=(3, 5, 4), axis=[1, 3], pattern=UNEQUAL),
    "tf-function": dict(tail=(5, 5, 4), pattern=EMPTY, compiled=True),
    "mask": dict(tail=(6, 4), pattern=UNEQUAL, mask=True),
    # Batch renormalization: r and d from the global statistics; data of scale 2 drifting
    # by 2 a step moves them off 1 and 0, and the clipping below binds.
    "renorm": dict(tail=(5, 5, 4), pattern=UNEQUAL, scale=2.0,
                   kwargs=dict(renorm=True, renorm_momentum=0.5, momentum=0.9)),
    "renorm-clipping-channels-first": dict(tail=(4, 5, 5), axis=1, pattern=EMPTY, scale=2.0, kwargs=dict(
        renorm=True, renorm_clipping=dict(rmax=1.5, rmin=0.8, dmax=0.5), renorm_momentum=0.5)),
    "renorm-mask-tf-function": dict(tail=(6, 4), pattern=UNEQUAL, mask=True, compiled=True, scale=2.0,
                                    kwargs=dict(renorm=True, renorm_clipping=dict(rmax=1.2, dmax=0.3))),
}


@pytest.mark.parametrize("stats", ["host", "device"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_matches_keras_bn_on_global_batch(case, stats):
    """On both paths of the statistics; the device path's deferred checks stay clear."""
    c = CASES[case]
    sync, plain = make_pair(c["tail"], c.get("axis", -1), stats=stats, **c.get("kwargs", {}))
    run_steps(sync, plain, c["tail"], c["pattern"], compiled=c.get("compiled", False), mask=c.get("mask", False),
              scale=c.get("scale", 1.0), grad_atol=c.get("grad_atol"))
    assert sync._on_device() == (stats == "device")
    check(sync)


def test_mixed_float16_keeps_float32_statistics():
    sync, plain = make_pair((4, 4, 3), oracle_dtype="mixed_float16", dtype="mixed_float16")
    assert sync.moving_mean.dtype == "float32"
    run_steps(sync, plain, (4, 4, 3), UNEQUAL, steps=2, rtol=1e-2, atol=2e-3)


@pytest.mark.parametrize("dtype, tol", [("float16", 3e-3), ("bfloat16", 3e-2)])
def test_low_precision_variables_compute_in_float32(dtype, tol):
    """``dtype="float16"``/``"bfloat16"`` (the variables too, not a mixed policy): the
    statistics are computed in float32 and stored back, as Keras's own layer does."""
    sync, plain = make_pair((4, 4, 3), oracle_dtype=dtype, dtype=dtype)
    assert sync.moving_mean.dtype == dtype
    run_steps(sync, plain, (4, 4, 3), UNEQUAL, steps=2, rtol=tol, atol=tol)


def test_second_derivative_raises():
    """The gradient is written by hand with the statistics as constants (and summed
    across ranks outside the tape): a second derivative raises instead of being wrong."""
    sync, _ = make_pair((4, 4, 3))
    x = tf.constant(global_batch(13, 3, (4, 4, 3)))
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            loss = tf.reduce_sum(sync(x, training=True) ** 3)
        grad = inner.gradient(loss, x)
        total = tf.reduce_sum(grad * grad)
    with pytest.raises(NotImplementedError, match="no second derivative"):
        outer.gradient(total, x)


def test_variance_survives_large_offset():
    sizes = shard_sizes(UNEQUAL, WORLD)
    x_all = global_batch(3, sum(sizes), (4, 4, 8), offset=1e4, scale=0.1)
    sync = SyncBatchNormalization(momentum=0.0)  # moving_variance = batch variance
    sync(x_all[shard_slice(sizes, RANK)], training=True)
    want = x_all.astype(np.float64).reshape(-1, 8).var(axis=0)
    assert_close(sync.moving_variance, want, "variance, mean 1e4 and std 0.1", rtol=1e-4, atol=0.0)


def test_renorm_with_an_axis_list_matches_keras_on_the_flattened_channels():
    """Channels over axes 1 and 3 of (N, 3, 5, 4) are Keras's last axis of the
    transposed (N, 5, 12); renorm's variables are shaped (3, 4) and (12,)."""
    sizes = shard_sizes(UNEQUAL, WORLD)
    mine = shard_slice(sizes, RANK)
    kwargs = dict(renorm=True, renorm_clipping=dict(rmax=1.3, dmax=0.4), renorm_momentum=0.5, momentum=0.8)
    sync = SyncBatchNormalization(axis=[1, 3], **kwargs)
    plain = keras.layers.BatchNormalization(dtype="float64", **kwargs)
    for step in range(3):
        x_all = global_batch(step, sum(sizes), (3, 5, 4), offset=2.0 * step, scale=2.0)
        flat = np.transpose(x_all, (0, 2, 1, 3)).reshape(-1, 5, 12)
        want = np.transpose(plain(flat, training=True).numpy().reshape(-1, 5, 3, 4), (0, 2, 1, 3))
        assert_close(sync(x_all[mine], training=True), want[mine], f"axis-list renorm output, step {step}")
    for name in ("moving_mean", "moving_variance", "moving_stddev", "renorm_mean", "renorm_stddev"):
        got = getattr(sync, name)
        assert tuple(got.shape) == (3, 4), f"{name} shape {got.shape}"
        assert_close(np.reshape(got, -1), getattr(plain, name), f"axis-list {name}")


# Adam's epsilon is raised from 1e-7: with it, elements whose gradient is float32 noise
# take full-size random steps, and plain Keras itself then differs from float64 by 1e-3.
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(1e-2, epsilon=1e-3),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.01, epsilon=1e-3),
}


def gpu_listed():
    """While in effect ``tf.config`` lists a GPU besides the CPUs, as on a GPU machine,
    where Keras 3's default ``jit_compile="auto"`` compiles the train step with XLA (for
    every model whose layers all support it, when no ``tf.distribute`` strategy is in use)."""
    real = tf.config.list_physical_devices
    gpu = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")

    def listed(device_type=None):
        return real(device_type) + ([gpu] if device_type in (None, "GPU") else [])

    return mock.patch.object(tf.config, "list_physical_devices", listed)


def receive_weights(model, root: int, name: str) -> None:
    """Sets ``model``'s weights to rank ``root``'s, in one broadcast."""
    weights = model.get_weights()
    flat = hvd.broadcast(tf.constant(np.concatenate([w.ravel() for w in weights])), root, name=name).numpy()
    ends = np.cumsum([w.size for w in weights])
    model.set_weights([part.reshape(w.shape) for part, w in zip(np.split(flat, ends[:-1]), weights)])


def fit_like_one_process(make_model, make_opt, tail, classes, per_rank=2, steps=3, as_accurate_as_float32=False,
                         pattern=None, on_gpu_host=False, jit_compile="auto", stats=None, dataset=False, vocab=0):
    """``model.fit`` on this rank's slices == one process fitting the whole batches
    (plain Keras BN, in float64: Keras's float32 variance is itself off by ~1e-5).

    ``as_accurate_as_float32``: for ill-conditioned nets, where float32 rounding alone
    moves the weights by more than rtol 1e-5, require instead that each weight is as
    close to float64 as plain float32 Keras is (``assert_as_accurate``), with k=8: on
    top of plain's rounding, ours averages float32 gradients over the ranks. Measured on
    MobileNetV2 with the default k=4: 0.30 of the bound used at 1-3 ranks, 0.80 at 4 (16
    rows, where plain float32 is more accurate); local BN on the shards, 28x over it.
    With k=8, unequal shards (3, 5, 2 rows) at 2 and 3 ranks: at most 0.08 on the host
    path, 0.11 on the device path and inside XLA (``ranks_keras_models.py``).
    With ``jit_compile=True`` plain float32 is compiled by XLA too: XLA's float32 kernels
    round differently (plain float32 under XLA is up to 5x further from float64 on some
    moving means and biases of MobileNetV2's first blocks than without it).

    Each reference is fitted by one rank (float64 by rank 0, float32 by rank 1 where
    there is one) and broadcast: the same one process, computed once.

    ``on_gpu_host``: ``compile()`` with its defaults while a GPU is listed.
    ``jit_compile``: ``compile()``'s, asserted to stand. ``stats``: the converted layers'.
    ``dataset``: each rank fits a ``tf.data`` pipeline ``.batch()``-ed the usual way (its
    batch dimension ``None``), not numpy arrays. ``vocab``: integer inputs below it (an
    ``Embedding``'s), not floats.
    """
    keras.utils.set_random_seed(0)
    sync = convert_sync_batchnorm(make_model(), stats=stats)
    references = {}
    for dtype in ("float64", "float32") if as_accurate_as_float32 else ("float64",):
        keras.config.set_dtype_policy(dtype)
        try:
            references[dtype] = make_model()
        finally:
            keras.config.set_dtype_policy("float32")
        references[dtype].set_weights(sync.get_weights())
    if RANK != 0:  # different start: the broadcast must fix it
        sync.set_weights([w + 0.1 for w in sync.get_weights()])
    sizes = shard_sizes(pattern or [per_rank], WORLD)  # rows per rank in every step
    rows, part = sum(sizes), shard_slice(sizes, RANK)
    x_all = global_batch(30, rows * steps, tail)
    if vocab:
        x_all = (np.abs(x_all) * vocab / 3).astype(np.int32) % vocab
    y_all = global_batch(31, rows * steps, (classes,))
    mine = np.concatenate([np.arange(s * rows + part.start, s * rows + part.stop) for s in range(steps)])
    with gpu_listed() if on_gpu_host else contextlib.nullcontext():
        if pattern is None:  # equal shards: the default per-rank average is exact
            sync.compile(optimizer=DistributedOptimizer(make_opt()), loss="mse", jit_compile=jit_compile)
        else:  # unequal shards: sum the gradients of each rank's share of the global mean loss
            def share_of_global_mse(y, p):
                return tf.reduce_sum(tf.square(y - p)) / (rows * classes)

            sync.compile(optimizer=DistributedOptimizer(make_opt(), op=hvd.Sum), loss=share_of_global_mse,
                         jit_compile=jit_compile)
    if on_gpu_host:
        assert sync.jit_compile is False, "Keras chose XLA for a model with SyncBatchNormalization"
    if jit_compile is True:
        assert sync.jit_compile is True, "Keras turned XLA off"
    batch, callbacks = max(sizes[RANK], 1), [BroadcastGlobalVariablesCallback(0), MetricAverageCallback(),
                                                 CheckSyncBatchNorm()]
    if dataset:
        data = tf.data.Dataset.from_tensor_slices((x_all[mine], y_all[mine])).batch(batch)
        assert data.element_spec[0].shape[0] is None
        hist = sync.fit(data, shuffle=False, verbose=0, callbacks=callbacks)
    else:
        hist = sync.fit(x_all[mine], y_all[mine], batch_size=batch, shuffle=False, verbose=0, callbacks=callbacks)
    for i, (dtype, model) in enumerate(references.items()):  # float32 compiled as ours: XLA's rounds differently
        owner = i % WORLD  # one rank fits each reference (the same one process on every rank) and sends it
        if RANK == owner:
            model.compile(optimizer=make_opt(), loss="mse", jit_compile=jit_compile is True and dtype == "float32")
            model.fit(x_all, y_all, batch_size=rows, shuffle=False, verbose=0)
        receive_weights(model, owner, f"test.reference.{dtype}")
    if as_accurate_as_float32:
        ref, ref32 = ({a.path: b for a, b in zip(sync.weights, references[d].weights)} for d in ("float64", "float32"))
        assert_as_accurate({a.path: a for a in sync.weights}, ref32, ref, f"after {steps} steps, rank {RANK}", k=8)
    for a, b in zip(sync.weights, references["float64"].weights):
        if not as_accurate_as_float32:
            assert_close(a, b, f"{a.path} after {steps} steps, rank {RANK}")
        same = hvd.broadcast(tf.convert_to_tensor(a), 0, name=f"test.same.{a.path}")
        assert np.array_equal(same.numpy(), a.numpy()), f"{a.path} differs between rank 0 and rank {RANK}"
    return hist


def test_model_fit_with_unequal_shards_and_op_sum_matches_one_process():
    fit_like_one_process(small_model, OPTIMIZERS["sgd"], (8, 8, 3), 4, pattern=UNEQUAL)


def test_default_compile_on_a_gpu_machine_fits_like_one_process():
    """Where a GPU is listed Keras picks XLA by default, which cannot run our host-side
    statistics: the layer says it does not support XLA, so Keras trains without it."""
    fit_like_one_process(small_model, OPTIMIZERS["sgd"], (8, 8, 3), 4, pattern=UNEQUAL, on_gpu_host=True)


def test_distributed_optimizer_under_xla_on_a_gpu_machine_says_to_turn_it_off():
    """Plain Keras layers on a GPU machine: Keras picks XLA, where Horovod's allreduce has
    no kernel and ours no CUDA target; without the callbacks (which would turn XLA off)
    every rank raises (while tracing, before any collective) what to do."""
    model = small_model()
    with gpu_listed():
        model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
        assert model.jit_compile is True, "a listed GPU no longer turns XLA on: this test no longer tests it"
        x, y = global_batch(40, 4, (8, 8, 3)), global_batch(41, 4, (4,))
        match = (r"DistributedOptimizer \(a GPU is visible.*\) cannot run inside XLA yet \(expected "
                 r"jit_compile=False.*pass jit_compile=False to model\.compile\(\)")
        with pytest.raises(ValueError, match=match):
            model.fit(x, y, verbose=0)


def test_fit_inside_xla_matches_one_process():
    """``jit_compile=True`` on the CPU, unequal shards: our layers' statistics and
    DistributedOptimizer's gradients (packed in one buffer) through the XLA allreduce;
    equals one process. Under horovodrun --gloo (no MPI) the layer says to use mpirun."""
    args = (small_model, OPTIMIZERS["sgd"], (8, 8, 3), 4)
    if GLOO:
        with pytest.raises(Exception, match="launch with mpirun"):
            fit_like_one_process(*args, pattern=UNEQUAL, jit_compile=True)
        return
    fit_like_one_process(*args, pattern=UNEQUAL, jit_compile=True)


def dense_3d_model(bn=None):
    """A transformer MLP block's Dense layers on 3-D input: the kernels' gradients traced
    with the batch dimension of a ``.batch()``-ed dataset, ``None``."""
    inputs = keras.Input((5, 6))
    x = keras.layers.Dense(8, activation="relu", name="mlp_in")(inputs)
    x = keras.layers.Dense(6, name="mlp_out")(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(keras.layers.Flatten()(x)), name="mlp")


def embedding_model(bn=None):
    """An ``Embedding`` (a sparse gradient, ``IndexedSlices``) before a Dense head."""
    inputs = keras.Input((5,), dtype="int32")
    x = keras.layers.Embedding(11, 3, name="embed")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(keras.layers.Flatten()(x)), name="embedding")


XLA_OPTIMIZER_CASES = {"conv_syncbn": (small_model, (8, 8, 3), 0), "dense_3d": (dense_3d_model, (5, 6), 0),
                       "embedding": (embedding_model, (5,), 11)}


@pytest.mark.parametrize("case", XLA_OPTIMIZER_CASES)
def test_xla_optimizer_from_a_batched_dataset_matches_one_process(case):
    """``jit_compile=True`` and a ``.batch()``-ed ``tf.data`` pipeline (unequal shards):
    DistributedOptimizer sums the gradients inside XLA, sized by the variables whatever
    the traced shapes, a sparse one too; equals one process."""
    make, tail, vocab = XLA_OPTIMIZER_CASES[case]
    if GLOO:
        with pytest.raises(Exception, match="launch with mpirun"):
            fit_like_one_process(make, OPTIMIZERS["sgd"], tail, 4, pattern=UNEQUAL, jit_compile=True, dataset=True,
                                 vocab=vocab)
        return
    fit_like_one_process(make, OPTIMIZERS["sgd"], tail, 4, pattern=UNEQUAL, jit_compile=True, dataset=True,
                         vocab=vocab)


def test_converted_renorm_model_fits_like_one_process():
    """Unequal shards, op=Sum: renorm's statistics (and so r, d) follow the global batch."""
    def make():
        return small_model(lambda name: keras.layers.BatchNormalization(
            renorm=True, renorm_clipping=dict(rmax=1.5, rmin=0.7, dmax=0.5), renorm_momentum=0.8, name=name))

    fit_like_one_process(make, OPTIMIZERS["sgd"], (8, 8, 3), 4, pattern=UNEQUAL)


def tower_shards(towers):
    """Rows of each (rank, tower) part, rank-major, and this rank's towers' slices."""
    sizes = shard_sizes(EMPTY, WORLD * towers)
    return sizes, [shard_slice(sizes, RANK * towers + t) for t in range(towers)]


def plain_reference(x_all, r_all, gamma, beta, eps):
    """Plain Keras BN (float64) on the concatenated batch: y, dx, dγ, dβ, mean, var."""
    bn = keras.layers.BatchNormalization(epsilon=eps, momentum=0.0, dtype="float64")
    bn.build(x_all.shape)
    bn.gamma.assign(gamma), bn.beta.assign(beta)
    x = tf.constant(x_all, tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = bn(x, training=True)
        loss = tf.reduce_sum(y * r_all)
    dx, dg, db = tape.gradient(loss, [x, bn.gamma, bn.beta])
    return y.numpy(), dx.numpy(), dg.numpy(), db.numpy(), bn.moving_mean.numpy(), bn.moving_variance.numpy()


def test_tf1_graph_towers_get_global_statistics():
    """TF 1 style: a Graph and a Session, towers on two devices, one call with all towers."""
    towers, eps = 2, 1e-3
    sizes, mine = tower_shards(towers)
    x_all, r_all = global_batch(60, sum(sizes), (5,), offset=1.0), global_batch(61, sum(sizes), (5,))
    gamma, beta = np.linspace(0.5, 1.5, 5), np.linspace(-0.3, 0.3, 5)
    y_ref, dx_ref, dg_ref, db_ref, mean_ref, var_ref = plain_reference(x_all, r_all, gamma, beta, eps)
    graph = tf.Graph()
    with graph.as_default():
        xs, losses = [], []
        for t in range(towers):
            with tf.device(f"/cpu:{t}"):
                xs.append(tf.compat.v1.placeholder(tf.float32, [None, 5]))
        g = tf.constant(gamma, tf.float32)
        b = tf.constant(beta, tf.float32)
        ys, mean, var = sync_batch_normalization(xs, b, g, eps, name="towers_bn")
        for t in range(towers):
            with tf.device(f"/cpu:{t}"):
                losses.append(tf.reduce_sum(ys[t] * r_all[mine[t]]))
        grads = tf.compat.v1.gradients(tf.add_n(losses), xs + [g, b])
        with tf.compat.v1.Session(graph=graph) as sess:
            out = sess.run([ys, mean, var, grads], {xs[t]: x_all[mine[t]] for t in range(towers)})
    (ys_v, mean_v, var_v, grads_v) = out
    for t in range(towers):
        assert_close(ys_v[t], y_ref[mine[t]], f"tower {t} output, rank {RANK}")
        assert_close(grads_v[t], dx_ref[mine[t]], f"tower {t} input grad, rank {RANK}")
    assert_close(mean_v, mean_ref, "global mean")
    assert_close(var_v, var_ref, "global variance")
    assert_close(allreduce_sum(grads_v[towers], "towers.dg"), dg_ref, "dgamma summed", atol=1e-5)
    assert_close(allreduce_sum(grads_v[towers + 1], "towers.db"), db_ref, "dbeta summed", atol=1e-5)


def test_mirrored_strategy_replicas_and_ranks_sync_together():
    """2 replicas per rank (MirroredStrategy on two logical CPUs) x WORLD ranks."""
    towers, eps = 2, 1e-3
    sizes, mine = tower_shards(towers)
    x_all, r_all = global_batch(70, sum(sizes), (3, 4), offset=-2.0), global_batch(71, sum(sizes), (3, 4))
    gamma, beta = np.linspace(0.5, 1.5, 4), np.linspace(-0.3, 0.3, 4)
    y_ref, dx_ref, dg_ref, db_ref, mean_ref, var_ref = plain_reference(x_all, r_all, gamma, beta, eps)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        bn = SyncBatchNormalization(epsilon=eps, momentum=0.0, name="mirrored_bn")
        bn.build((None, 3, 4))
        bn.gamma.assign(gamma), bn.beta.assign(beta)

    @tf.function
    def step(x, r):
        def replica(x, r):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(bn(x, training=True) * r)
            y = bn(x, training=False)  # moving statistics = this batch's (momentum 0)
            return (y, *tape.gradient(loss, [x, bn.gamma, bn.beta]))

        return strategy.run(replica, args=(x, r))

    def per_replica(a):
        parts = [tf.constant(a[mine[t]]) for t in range(towers)]
        return strategy.experimental_distribute_values_from_function(lambda ctx: parts[ctx.replica_id_in_sync_group])

    y, dx, dg, db = step(per_replica(x_all), per_replica(r_all))
    for name, v in (("output", y), ("input grad", dx), ("dgamma", dg), ("dbeta", db)):
        parts = strategy.experimental_local_results(v)
        assert len(parts) == towers and all(p is not None for p in parts), f"{name}: {parts}"
    for t in range(towers):
        # After the step the moving statistics are the global batch's (momentum 0), so
        # inference gives what the training step did on the concatenated batch.
        assert_close(strategy.experimental_local_results(y)[t], y_ref[mine[t]], f"replica {t} inference output")
        assert_close(strategy.experimental_local_results(dx)[t], dx_ref[mine[t]], f"replica {t} input grad")
    local = [sum(strategy.experimental_local_results(v)) for v in (dg, db)]
    assert_close(allreduce_sum(local[0], "mirrored.dg"), dg_ref, "dgamma summed", atol=1e-5)
    assert_close(allreduce_sum(local[1], "mirrored.db"), db_ref, "dbeta summed", atol=1e-5)
    assert_close(bn.moving_mean, mean_ref, "moving mean = global batch mean")
    assert_close(bn.moving_variance, var_ref, "moving variance = global batch variance")


def gradients_travel_in_few_collectives_not_one_per_variable(rank_tmp):
    """Counted in Horovod's timeline: distinct collective executions for the gradients."""
    keras.utils.set_random_seed(0)
    model = convert_sync_batchnorm(small_model())
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = global_batch(80, 4, (8, 8, 3)), global_batch(81, 4, (4,))
    model.fit(x, y, batch_size=2, verbose=0)  # trace and warm up
    path = str(rank_tmp / "timeline.json")
    hvd.start_timeline(path, mark_cycles=False)
    model.fit(x, y, batch_size=2, verbose=0)  # 2 steps
    hvd.allreduce(tf.ones(1), name="test.flush")
    hvd.stop_timeline()
    if RANK != 0:
        return
    text = open(path).read().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    names = {e["pid"]: e["args"].get("name", "") for e in events if e.get("name") == "process_name"}
    grads = {pid for pid, n in names.items() if "hvd_syncbn.gradients" in n}
    starts = sorted(e["ts"] for e in events if e.get("pid") in grads and e.get("ph") == "B"
                    and e.get("name", "").endswith("_ALLREDUCE") and e["name"] != "NEGOTIATE_ALLREDUCE")
    # Tensors fused into one collective start within microseconds of each other.
    runs = [t for i, t in enumerate(starts) if i == 0 or t - starts[i - 1] > 100]
    variables = len(model.trainable_variables)
    if WORLD == 1:
        assert not grads, "one rank needs no gradient collective"
    else:
        assert len(grads) >= variables, f"expected every gradient in the timeline, saw {len(grads)}"
        assert 1 <= len(runs) <= 2 * 2, f"{len(runs)} gradient collectives in 2 steps for {variables} variables"


if TIMELINE:
    test_gradients_travel_in_few_collectives_not_one_per_variable = gradients_travel_in_few_collectives_not_one_per_variable


def test_mixed_float16_fit_with_loss_scaling():
    keras.utils.set_random_seed(0)
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = convert_sync_batchnorm(small_model())
    finally:
        keras.config.set_dtype_policy("float32")
    opt = DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)))
    model.compile(optimizer=opt, loss="mse")
    rows = 2 * WORLD
    x, y = global_batch(90, rows * 2, (8, 8, 3)), global_batch(91, rows * 2, (4,))
    mine = np.concatenate([np.arange(s * rows + RANK * 2, s * rows + RANK * 2 + 2) for s in range(2)])
    model.fit(x[mine], y[mine], batch_size=2, verbose=0, callbacks=[BroadcastGlobalVariablesCallback(0)])
    assert model.get_layer("stem_bn").compute_dtype == "float16"
    for w in model.weights:
        assert np.all(np.isfinite(w.numpy())), w.path
        same = hvd.broadcast(tf.convert_to_tensor(w), 0, name=f"test.mixed.{w.path}")
        assert np.array_equal(same.numpy(), w.numpy()), f"{w.path} differs between rank 0 and rank {RANK}"


def test_distributed_optimizer_takes_a_process_set_by_ranks():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=list(range(WORLD))),
                  loss="mse")
    x = global_batch(95 + RANK, 4, (3,))  # different data per rank, averaged gradients
    model.fit(x, x[:, :2], batch_size=4, verbose=0, callbacks=[BroadcastGlobalVariablesCallback(0)])
    for w in model.weights:
        same = hvd.broadcast(tf.convert_to_tensor(w), 0, name=f"test.ps.{w.path}")
        assert np.array_equal(same.numpy(), w.numpy()), f"{w.path} differs between rank 0 and rank {RANK}"


def _weights(layer):
    return [w.numpy().copy() for w in layer.weights]


def assert_weights_unchanged(layer, before, what):
    for w, b in zip(layer.weights, before):
        assert np.array_equal(w.numpy(), b), f"{what}: {w.name} changed"


def test_wrong_channel_count_names_layer():
    bn = SyncBatchNormalization(name="bn_ch")
    bn.build((None, 3, 4))
    before = _weights(bn)
    with pytest.raises(ValueError, match=r"bn_ch: expected 4 channels on axis 2, got 3"):
        bn(np.ones((2, 3, 3), np.float32), training=True)
    assert_weights_unchanged(bn, before, "wrong channels")


def test_empty_global_batch_leaves_moving_statistics():
    """Every rank 0 rows: an empty output; gradients that exist and are those of an empty
    sum (dx empty, dγ = dβ = 0; plain Keras BN gives a NaN dγ here); moving statistics
    untouched."""
    bn = SyncBatchNormalization(name="bn_empty")
    bn.build((None, 3, 4))
    before = _weights(bn)
    x = tf.zeros((0, 3, 4))
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = bn(x, training=True)
        loss = tf.reduce_sum(y)  # inside the tape, or every gradient is None
    dx, dgamma, dbeta = tape.gradient(loss, [x, bn.gamma, bn.beta])
    assert y.shape == (0, 3, 4)
    assert dx is not None and dx.shape == (0, 3, 4), dx
    for name, g in (("dgamma", dgamma), ("dbeta", dbeta)):
        assert g is not None, f"{name} is None"
        np.testing.assert_array_equal(g.numpy(), np.zeros(4, np.float32), err_msg=name)
    assert_weights_unchanged(bn, before, "empty global batch")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf-function"])
def test_single_global_row_raises_on_every_rank(compiled):
    bn = SyncBatchNormalization(name=f"bn_one_{int(compiled)}")
    bn.build((None, 4))
    before = _weights(bn)
    call = tf.function(lambda x: bn(x, training=True)) if compiled else (lambda x: bn(x, training=True))
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="expected more than 1 value per channel"):
        call(tf.ones((1 if RANK == 0 else 0, 4)))
    assert_weights_unchanged(bn, before, "single global row")


XLA_CASES = {name: CASES[name] for name in ("channels-last-4d", "channels-first-4d", "mask", "renorm")}
# Inside XLA the statistics travel over MPI (hvd_syncbn's XLA allreduce), which a
# horovodrun --gloo job does not have: there the layer says so.
GLOO = (launchers.launcher() or "").startswith("horovodrun --gloo")


@pytest.mark.parametrize("case", XLA_CASES)
def test_inside_xla_matches_keras_bn_on_global_batch(case):
    """``tf.function(jit_compile=True)`` of forward and backward, the default ``stats``
    (the device path inside XLA): as close to Keras BN on the global batch as on the
    other paths; the compiled function holds our custom calls, no host hop."""
    c = XLA_CASES[case]
    sync, plain = make_pair(c["tail"], c.get("axis", -1), **c.get("kwargs", {}))
    assert sync.supports_jit, xla.available()
    if GLOO:
        with pytest.raises(Exception, match="the XLA allreduce sums over MPI; launch with mpirun"):
            run_steps(sync, plain, c["tail"], c["pattern"], compiled="xla", mask=c.get("mask", False))
        return
    run_steps(sync, plain, c["tail"], c["pattern"], compiled="xla", mask=c.get("mask", False),
              scale=c.get("scale", 1.0))
    check(sync)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf-function"])
def test_device_path_flags_a_single_global_row_and_keeps_moving_statistics(compiled):
    bn = SyncBatchNormalization(name=f"bn_one_device_{int(compiled)}", stats="device")
    bn.build((None, 4))
    before = _weights(bn)
    call = tf.function(lambda x: bn(x, training=True)) if compiled else (lambda x: bn(x, training=True))
    call(tf.ones((1 if RANK == 0 else 0, 4)))  # no error yet: the device path defers it
    assert_weights_unchanged(bn, before, "single global row")
    with pytest.raises(ValueError, match=f"bn_one_device_{int(compiled)}: expected more than 1 value per channel"):
        check(bn)
    check(bn)  # raised once, then cleared


def test_device_path_mismatch_is_nan_then_an_error_naming_each_ranks_layer():
    """Rank 0 feeds the layer 2D input, the others 3D (3 channels on every rank, so the
    buffers are alike): the summed header does not add up, so every rank's output is
    NaN, its moving statistics stay, and :func:`check` raises SyncBatchNormError on
    every rank, naming the layer as each rank called it. Alone, nothing mismatches."""
    tail = (3,) if RANK == 0 else (2, 3)
    bn = SyncBatchNormalization(name="bn_mixed", stats="device")
    bn.build((None, *tail))
    before = _weights(bn)
    y = tf.function(lambda t: bn(t, training=True))(tf.constant(global_batch(60 + RANK, 4, tail)))
    if WORLD == 1:
        assert np.isfinite(y.numpy()).all()
        check(bn)
        return
    assert np.isnan(y.numpy()).all(), y
    assert_weights_unchanged(bn, before, "mismatched collective")
    with pytest.raises(SyncBatchNormError, match="bn_mixed: ranks summed different collectives") as raised:
        check(bn)
    text = str(raised.value)
    assert f"this is rank {RANK}, in layer 'bn_mixed' (3 channels, {len(tail) + 1}D float32)" in text, text
    assert "ranks [0] are waiting in layer 'bn_mixed' (3 channels, 2D float32)" in text, text
    assert f"ranks {list(range(1, WORLD))} are waiting in layer 'bn_mixed' (3 channels, 3D float32)" in text, text


def test_device_path_has_no_host_hop_in_a_traced_step():
    """A traced training step of a converted model: no PyFunc on the device path, one per
    layer and direction on the host path (which the count must see, or it counts nothing).
    The device path's collectives are graph ops: outside XLA, the XLA allreduce library's
    TensorFlow kernel where the layers' transport is MPI (it needs no Horovod cycle),
    Horovod's allreduce otherwise."""
    def op_counts(stats):
        model = convert_sync_batchnorm(small_model(), stats=stats)
        x = tf.constant(global_batch(61, 2, (8, 8, 3)))

        @tf.function
        def step(t):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(t, training=True))
            return tape.gradient(loss, model.trainable_weights)

        graph = step.get_concrete_function(x).graph.as_graph_def()  # the step and the functions it calls
        kinds = [node.op for node in graph.node] + [node.op for f in graph.library.function for node in f.node_def]
        kept = ("PyFunc", "EagerPyFunc", "HvdSyncbnAllreduce", "HorovodAllreduce")
        counts = {kind: kinds.count(kind) for kind in kept}
        return counts, model.layers

    collectives = 4 if WORLD > 1 else 0  # 2 layers, forward and backward; none alone
    counts, layers = op_counts("device")
    mpi = collectives and isinstance(next(l for l in layers if hasattr(l, "_sync_reducer"))._sync_reducer.comm,
                                     MpiCommunicator)
    assert counts == {"PyFunc": 0, "EagerPyFunc": 0, "HvdSyncbnAllreduce": collectives if mpi else 0,
                      "HorovodAllreduce": 0 if mpi else collectives}, counts
    counts, _ = op_counts("host")
    assert counts["PyFunc"] + counts["EagerPyFunc"] == collectives, counts


def test_check_callback_raises_during_fit():
    """NaN in rank 0's batch with check_finite: every rank's CheckSyncBatchNorm raises
    after the batch, naming the first layer."""
    model = convert_sync_batchnorm(small_model(), stats="device", check_finite=True)
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = global_batch(62, 2, (8, 8, 3)), global_batch(63, 2, (4,))
    if RANK == 0:
        x[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match=r"stem_bn: expected finite inputs \(check_finite=True\)"):
        model.fit(x, y, batch_size=2, verbose=0, callbacks=[CheckSyncBatchNorm()])


def test_nan_input_follows_keras_or_raises_with_check_finite():
    sizes = shard_sizes(UNEQUAL, WORLD)
    mine = shard_slice(sizes, RANK)
    x_all = global_batch(7, sum(sizes), (3, 4))
    x_all[0, 0, 1] = np.nan  # rank 0's rows, channel 1
    sync, plain = make_pair((3, 4))
    y, y_all = sync(x_all[mine], training=True), plain(x_all.astype(np.float64), training=True)
    assert_close(np.nan_to_num(y.numpy(), nan=7.0), np.nan_to_num(y_all.numpy()[mine], nan=7.0), "NaN: output")
    for name in ("moving_mean", "moving_variance"):
        assert_close(np.nan_to_num(getattr(sync, name).numpy(), nan=7.0),
                     np.nan_to_num(getattr(plain, name).numpy(), nan=7.0), f"NaN: {name}")

    strict = SyncBatchNormalization(name="bn_strict", check_finite=True)
    strict.build((None, 3, 4))
    before = _weights(strict)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match=r"bn_strict: expected finite inputs"):
        strict(x_all[mine], training=True)
    assert_weights_unchanged(strict, before, "check_finite")


def test_transport_follows_the_documented_rule():
    """$HVD_SYNCBN_COMM if set, else MPI under mpirun, else Horovod; none when alone."""
    from hvd_syncbn import mpi
    from hvd_syncbn.tensorflow import transports as tf_transports

    want = os.environ.get("HVD_SYNCBN_COMM") or ("mpi" if mpi.launched_by_mpirun() else "horovod")
    chosen = tf_transports.resolve(None, None, "rule_bn")
    assert (chosen is None) == (WORLD == 1) and (chosen is None or chosen.kind == want), (chosen, want)
