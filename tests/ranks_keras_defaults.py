"""Keras's defaults on a GPU machine, at any world size: ``model.compile()`` with its
default ``jit_compile`` while ``tf.config`` lists a GPU, where Keras 3 compiles the train
step with XLA, which our host-side statistics and Horovod's allreduce cannot run in.

A model with our layers (they say ``supports_jit = False``), and a model with plain Keras
BN and our ``DistributedOptimizer`` (our callbacks turn XLA off), train and equal one
process. Launched with ``ranks_tf.py``, whose helpers it uses, by ``test_launch.py``.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_syncbn.tensorflow import BroadcastGlobalVariablesCallback, DistributedOptimizer, MetricAverageCallback
from keras_models import small_model
from oracle import assert_close, eval_batch, global_batch
from ranks_tf import OPTIMIZERS, RANK, WORLD, fit_like_one_process, gpu_listed, hvd


def test_sync_bn_model_with_default_compile_on_a_gpu_machine_fits_like_one_process():
    """The README's quick start as it is (default compile, the default per-rank average,
    both callbacks): Keras trains without XLA, and equals plain BN on the whole batch."""
    hist = fit_like_one_process(small_model, OPTIMIZERS["adam"], (8, 8, 3), 4, on_gpu_host=True)
    loss = hvd.allgather(tf.constant([hist.history["loss"][-1]]), name="test.defaults.loss").numpy()
    assert np.allclose(loss, loss[0]), f"MetricAverageCallback left per-rank losses {loss}"


def test_plain_bn_and_distributed_optimizer_with_default_compile_on_a_gpu_machine_fit_like_one_process():
    """Plain Keras BN (local statistics) with our optimizer: Keras picks XLA, our
    callbacks turn it off before ``fit`` builds the train step, and the ranks equal one
    process running every rank's model on its shard, with the averaged gradients (the
    float64 oracle): the loss, the weights after the steps (each rank's own moving
    statistics), and the inference output."""
    per_rank, steps, classes, tail = 2, 3, 4, (8, 8, 3)
    keras.utils.set_random_seed(0)
    model = small_model()
    keras.config.set_dtype_policy("float64")
    try:
        replicas = [small_model() for _ in range(WORLD)]  # rank r's model, in one process
    finally:
        keras.config.set_dtype_policy("float32")
    for replica in replicas:
        replica.set_weights(model.get_weights())
    if RANK != 0:  # different start: the broadcast must fix it
        model.set_weights([w + 0.1 for w in model.get_weights()])
    rows = per_rank * WORLD
    x_all, y_all = global_batch(30, rows * steps, tail), global_batch(31, rows * steps, (classes,))

    def shard(r, step):
        return slice(step * rows + r * per_rank, step * rows + (r + 1) * per_rank)

    mine = np.concatenate([np.arange(rows * steps)[shard(RANK, s)] for s in range(steps)])
    with gpu_listed():  # (through fit too: on a GPU machine the XLA allreduce has no target)
        model.compile(optimizer=DistributedOptimizer(OPTIMIZERS["sgd"]()), loss="mse")
        assert model.jit_compile is True, "a listed GPU no longer turns XLA on: this test no longer tests it"
        with pytest.warns(UserWarning, match="DistributedOptimizer: Horovod's allreduce has no XLA kernel"):
            hist = model.fit(x_all[mine], y_all[mine], batch_size=per_rank, shuffle=False, verbose=0,
                             callbacks=[BroadcastGlobalVariablesCallback(0), MetricAverageCallback()])
    assert model.jit_compile is False

    optimizer, mse, losses = OPTIMIZERS["sgd"](), keras.losses.MeanSquaredError(), []
    for step in range(steps):
        grads = []
        for r, replica in enumerate(replicas):
            with tf.GradientTape() as tape:
                loss = mse(y_all[shard(r, step)], replica(x_all[shard(r, step)], training=True))
            grads.append(tape.gradient(loss, replica.trainable_variables))
            losses.append(float(loss))
        optimizer.apply([tf.add_n(g) / WORLD for g in zip(*grads)], replicas[0].trainable_variables)
        for replica in replicas[1:]:
            for a, b in zip(replica.trainable_variables, replicas[0].trainable_variables):
                a.assign(b)
    # Equal shards: the rank-average of each rank's epoch mean is the mean over every shard's loss.
    assert_close(hist.history["loss"][-1], np.mean(losses), f"loss, rank {RANK}")
    for a, b in zip(model.weights, replicas[RANK].weights):
        assert_close(a, b, f"{a.path} after {steps} steps, rank {RANK}")
    for a in model.trainable_weights:
        same = hvd.broadcast(tf.convert_to_tensor(a), 0, name=f"test.defaults.same.{a.path}")
        assert np.array_equal(same.numpy(), a.numpy()), f"{a.path} differs between rank 0 and rank {RANK}"
    x = eval_batch(per_rank, tail)
    assert_close(model(x, training=False), replicas[RANK](x, training=False), f"inference output, rank {RANK}")
