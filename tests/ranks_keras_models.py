"""Keras models against one process, the slow part of the Keras suite: a converted
``keras.applications`` model, and ``model.fit`` with each optimizer.

They test the layers and the optimizer wrapper in real training, not the transport, so
``test_launch.py`` runs them at 2 and 3 ranks under mpirun only (``ranks_models.py``, for
PyTorch, at 1 and 3); ``ranks_tf.py`` keeps a small model's fit in every launch.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_models import small_model
from ranks_tf import OPTIMIZERS, fit_like_one_process, hvd


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_model_fit_matches_one_process(opt):
    hist = fit_like_one_process(small_model, OPTIMIZERS[opt], (8, 8, 3), 4)
    loss = hvd.allgather(tf.constant([hist.history["loss"][-1]]), name="test.loss").numpy()
    assert np.allclose(loss, loss[0]), f"MetricAverageCallback left per-rank losses {loss}"


def test_converted_keras_application_fits_like_one_process():
    def make():
        return keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=3)

    # At 32x32 MobileNetV2's last BN layers see 1x1 maps of a few rows: gradients of
    # ~1e2 whose float32 rounding (~3e-4 relative, plain Keras alike) rtol 1e-5 cannot hold.
    fit_like_one_process(make, lambda: keras.optimizers.SGD(1e-3), (32, 32, 3), 3, per_rank=4, steps=2,
                         as_accurate_as_float32=True)
