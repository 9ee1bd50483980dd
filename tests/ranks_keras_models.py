"""Keras models against one process, the slow part of the Keras suite: a converted
``keras.applications`` model, and ``model.fit`` with each optimizer.

They test the layers and the optimizer wrapper in real training, not the transport, so
``test_launch.py`` runs them under mpirun only: the optimizers at 2 ranks, MobileNetV2 at
the world size its path states below (``ranks_models.py``, for PyTorch, at 1 and 3);
``ranks_tf.py`` keeps a small model's fit in every launch.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_models import small_model
from oracle import UNEQUAL
from ranks_tf import OPTIMIZERS, WORLD, fit_like_one_process, hvd


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_model_fit_matches_one_process(opt):
    hist = fit_like_one_process(small_model, OPTIMIZERS[opt], (8, 8, 3), 4)
    loss = hvd.allgather(tf.constant([hist.history["loss"][-1]]), name="test.loss").numpy()
    assert np.allclose(loss, loss[0]), f"MetricAverageCallback left per-rank losses {loss}"


def mobilenet_v2(last=None):
    """``keras.applications.MobileNetV2`` at 32x32, alpha 0.35 (52 BN layers); with
    ``last``, its layers up to that one under a new pooling and dense head."""
    full = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=3)
    if last is None:
        return full
    x = keras.layers.GlobalAveragePooling2D()(full.get_layer(last).output)  # (N, C)
    return keras.Model(full.input, keras.layers.Dense(3)(x), name="mobilenetv2_head")


# The three ways a converted model's statistics travel: over the host (numpy_function), on
# the device (a graph op: Horovod's, or the XLA allreduce over MPI under mpirun), inside
# XLA (jit_compile=True, where the default stats, "auto", take the device path, summed by
# the XLA allreduce). The device path and XLA train MobileNetV2's first two blocks (6 BN
# layers, maps of 16x16 and 8x8): on the whole model, at 2 ranks on the 2 shared cores
# (load ~9), XLA took 410 s to compile and fit, the device path 250 s, the host path 160
# s; on the first four blocks 56 s and 33 s (load ~4), on the first two 43 s and 16 s,
# mostly XLA's compile. Each path runs at one world size (what the world size changes, the
# collective, ranks_tf.py checks at 2 and 3 ranks on every path): the whole model on the
# host path at 3 ranks (unequal shards in an odd world; 87 s at 2 ranks, load ~4), the
# device path and XLA at 2.
PATHS = {"host": dict(stats="host"), "device": dict(stats="device", last="block_1_project_BN"),
         "xla": dict(jit_compile=True, last="block_1_project_BN")}
PATHS = {path: kwargs for path, kwargs in PATHS.items() if (path == "host") == (WORLD == 3)}


@pytest.mark.parametrize("path", PATHS)
def test_converted_keras_application_fits_like_one_process(path):
    """Unequal shards (3, 5, 2 rows at 3 ranks), on each path of the statistics."""
    kwargs = dict(PATHS[path])
    last = kwargs.pop("last", None)
    # At 32x32 MobileNetV2's last BN layers see 1x1 maps of a few rows: gradients of
    # ~1e2 whose float32 rounding (~3e-4 relative, plain Keras alike) rtol 1e-5 cannot hold.
    fit_like_one_process(lambda: mobilenet_v2(last), lambda: keras.optimizers.SGD(1e-3), (32, 32, 3), 3, steps=2,
                         pattern=UNEQUAL, as_accurate_as_float32=True, **kwargs)
