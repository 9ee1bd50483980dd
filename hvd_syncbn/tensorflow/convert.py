"""Conversion of a Keras model's ``BatchNormalization`` layers to SyncBatchNormalization."""

from __future__ import annotations

from typing import Any

import keras

from .batchnorm import SyncBatchNormalization


def convert_sync_batchnorm(model: keras.Model, process_set: Any = None) -> keras.Model:
    """A copy of ``model`` with every ``keras.layers.BatchNormalization`` synchronised.

    Nested models are converted too; every weight (BN moving statistics included) is
    carried over, and layers keep their names, which also name the collectives.

    Args:
        model: a Sequential or functional Keras model (e.g.
            ``keras.applications.ResNet50(weights=None)``).
        process_set: Horovod process set (or its ranks) for the new layers.
            Default: all ranks.

    Returns:
        A new model; ``model`` itself is left as it was.

    Examples::

        >>> model = hvd_syncbn.tensorflow.convert_sync_batchnorm(keras.applications.ResNet50(weights=None))
    """
    expected = ("convert_sync_batchnorm: expected a Sequential or functional keras.Model, got "
                f"{type(model).__name__}")
    if not isinstance(model, keras.Model):
        raise ValueError(expected)

    def clone(layer):
        config = layer.get_config()
        if type(layer) is keras.layers.BatchNormalization:
            config.pop("synchronized", None)
            return SyncBatchNormalization.from_config({**config, "process_set": process_set})
        return layer.__class__.from_config(config)

    try:
        new = keras.models.clone_model(model, clone_function=clone, recursive=True)
    except ValueError as e:  # subclassed models cannot be cloned
        raise ValueError(f"{expected}; build a subclassed model's BN layers as "
                         f"SyncBatchNormalization instead ({e})") from e
    new.set_weights(model.get_weights())
    return new
