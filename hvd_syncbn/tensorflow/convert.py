"""Conversion of a Keras model's ``BatchNormalization`` layers to SyncBatchNormalization."""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional

import keras

from hvd_syncbn import validation

from . import transports
from .batchnorm import SyncBatchNormalization


class _UnknownSubclass(ValueError):
    """A BatchNormalization subclass the converter has no synchronized class for."""


def convert_sync_batchnorm(model: keras.Model, process_set: Any = None, *,
                           classes: Optional[Mapping[type, type]] = None, comm: Optional[str] = None,
                           check_finite: bool = False, stats: Optional[str] = None) -> keras.Model:
    """A copy of ``model`` with every ``keras.layers.BatchNormalization`` synchronised.

    Nested models are converted too; every weight (BN moving statistics, and renorm's,
    included) is carried over, and layers keep their names and configs, which also name
    the collectives. A subclass of ``BatchNormalization`` raises ``ValueError`` naming
    the layer, unless ``classes`` maps it to a synchronized class; SyncBatchNormalization
    layers stay as they are.

    Args:
        model: a Sequential or functional Keras model (e.g.
            ``keras.applications.ResNet50(weights=None)``).
        process_set: Horovod process set (or its ranks) for the new layers.
            Default: all ranks.
        classes: more conversions, ``{BatchNormalization subclass: SyncBatchNormalization
            subclass}``; the new layer is made ``from_config`` of the old one's config.
            Default: none.
        comm, check_finite, stats: for every new layer, as in
            :class:`~hvd_syncbn.tensorflow.SyncBatchNormalization`.

    Returns:
        A new model; ``model`` itself is left as it was.

    Examples::

        >>> model = hvd_syncbn.tensorflow.convert_sync_batchnorm(keras.applications.ResNet50(weights=None))
    """
    expected = ("convert_sync_batchnorm: expected a Sequential or functional keras.Model, got "
                f"{type(model).__name__}")
    if not isinstance(model, keras.Model):
        raise ValueError(expected)
    known = _known_classes(classes)
    validation.stats_choice("convert_sync_batchnorm", stats)  # checked here too: a model may have no BN layer
    transports.REGISTRY.requested(comm, "convert_sync_batchnorm")
    settings = {"process_set": process_set, "comm": comm, "check_finite": check_finite, "stats": stats}
    try:
        new = keras.models.clone_model(model, clone_function=_cloner(known, settings), recursive=True)
    except _UnknownSubclass:
        raise
    except ValueError as e:  # subclassed models cannot be cloned
        raise ValueError(f"{expected}; build a subclassed model's BN layers as "
                         f"SyncBatchNormalization instead ({e})") from e
    new.set_weights(model.get_weights())
    return new


def _known_classes(classes: Optional[Mapping[type, type]]) -> Dict[type, type]:
    """``{BatchNormalization class: its synchronized class}``: Keras's own, and ``classes``
    (checked: ``TypeError`` unless each maps a BatchNormalization subclass to a
    SyncBatchNormalization subclass)."""
    known = {keras.layers.BatchNormalization: SyncBatchNormalization, **(classes or {})}
    for plain, sync in known.items():
        if not (isinstance(plain, type) and issubclass(plain, keras.layers.BatchNormalization)
                and isinstance(sync, type) and issubclass(sync, SyncBatchNormalization)):
            raise TypeError("convert_sync_batchnorm: expected classes to map BatchNormalization subclasses to "
                            f"SyncBatchNormalization subclasses, got {plain!r}: {sync!r}")
    return known


def _cloner(known: Dict[type, type], settings: Dict[str, Any]) -> Callable[[Any], Any]:
    """``clone_model``'s ``clone_function``: a BatchNormalization layer as its class in
    ``known``, made ``from_config`` of its config with ``settings`` (``_UnknownSubclass``
    for a subclass not in ``known``); any other layer (SyncBatchNormalization's too) as
    a fresh copy of itself."""

    def clone(layer):
        config = layer.get_config()
        bn = isinstance(layer, keras.layers.BatchNormalization) and not isinstance(layer, SyncBatchNormalization)
        if bn and type(layer) not in known:
            raise _UnknownSubclass(
                f"convert_sync_batchnorm: layer {layer.name!r} is a {type(layer).__module__}."
                f"{type(layer).__qualname__}, a subclass of BatchNormalization this converter does not know; "
                f"replacing it could change what the model computes. Pass classes={{{type(layer).__name__}: "
                "SyncCls}} with SyncCls a SyncBatchNormalization subclass that computes what it does")
        if bn:
            config.pop("synchronized", None)
            return known[type(layer)].from_config({**config, **settings})
        return layer.__class__.from_config(config)

    return clone
