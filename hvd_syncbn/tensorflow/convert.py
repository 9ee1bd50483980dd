"""Conversion of a Keras model's ``BatchNormalization`` layers to SyncBatchNormalization, and
back (:func:`revert_sync_batchnorm`: a model that saves and loads without hvd_syncbn)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional

import keras

from hvd_syncbn import validation
from hvd_syncbn.groups import check_group_size

from . import transports
from .batchnorm import SyncBatchNormalization


class _UnknownSubclass(ValueError):
    """A BatchNormalization subclass the converter has no synchronized class for."""


def convert_sync_batchnorm(model: keras.Model, process_set: Any = None, *,
                           classes: Optional[Mapping[type, type]] = None, comm: Optional[str] = None,
                           check_finite: bool = False, stats: Optional[str] = None,
                           group_size: Any = None) -> keras.Model:
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
        comm, check_finite, stats, group_size: for every new layer, as in
            :class:`~hvd_syncbn.tensorflow.SyncBatchNormalization`.

    Returns:
        A new model; ``model`` itself is left as it was.

    Examples::

        >>> model = hvd_syncbn.tensorflow.convert_sync_batchnorm(keras.applications.ResNet50(weights=None))
        >>> model = hvd_syncbn.tensorflow.convert_sync_batchnorm(model, group_size=8)  # BN groups of 8 ranks
    """
    _check_model("convert_sync_batchnorm", model)
    known = _known_classes(classes)
    validation.stats_choice("convert_sync_batchnorm", stats)  # checked here too: a model may have no BN layer
    transports.REGISTRY.requested(comm, "convert_sync_batchnorm")
    check_group_size("convert_sync_batchnorm", group_size, process_set)
    settings = {"process_set": process_set, "comm": comm, "check_finite": check_finite, "stats": stats,
                "group_size": group_size}
    return _rebuilt(model, _cloner(known, settings), "convert_sync_batchnorm",
                    "build a subclassed model's BN layers as SyncBatchNormalization instead")


def _check_model(what: str, model: Any) -> None:
    if not isinstance(model, keras.Model):
        raise ValueError(f"{what}: expected a Sequential or functional keras.Model, got {type(model).__name__}")


def _rebuilt(model: keras.Model, clone: Callable[[Any], Any], what: str, subclassed: str) -> keras.Model:
    """A copy of ``model`` whose layers are ``clone``'s (nested models too), with its weights;
    ``subclassed``: what to do instead for a subclassed model, which cannot be cloned."""
    try:
        new = keras.models.clone_model(model, clone_function=clone, recursive=True)
    except _UnknownSubclass:
        raise
    except ValueError as e:  # subclassed models cannot be cloned
        raise ValueError(f"{what}: expected a Sequential or functional keras.Model, got {type(model).__name__}; "
                         f"{subclassed} ({e})") from e
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


SYNC_CONFIG = ("process_set", "group_size", "comm", "check_finite", "stats")
"""What SyncBatchNormalization's config adds to BatchNormalization's (and ``synchronized``
set, Keras's own, which plain BN leaves ``False``)."""


def revert_sync_batchnorm(model: keras.Model, *, classes: Optional[Mapping[type, type]] = None) -> keras.Model:
    """A copy of ``model`` with every SyncBatchNormalization as a plain
    ``keras.layers.BatchNormalization``: :func:`convert_sync_batchnorm` undone, as
    ``hvd_syncbn.torch.revert_sync_batchnorm`` does in PyTorch.

    Nested models are reverted too; every weight (the moving statistics, renorm's too) is
    carried over, and the layers keep their names and configs (less what synchronizing
    added). The reverted model saves to ``.keras`` and ``.weights.h5`` files that load
    where hvd_syncbn is not installed, as plain Keras BN: revert, then save or export to
    deploy. A subclass of SyncBatchNormalization raises ``ValueError`` naming the layer,
    unless ``classes`` maps it to its plain class.

    Args:
        model: a Sequential or functional Keras model.
        classes: more reversions, ``{SyncBatchNormalization subclass: BatchNormalization
            subclass}``. Default: none.

    Returns:
        A new model; ``model`` itself is left as it was.

    Examples::

        >>> plain = hvd_syncbn.tensorflow.revert_sync_batchnorm(model)
        >>> plain.save("model.keras")  # loads with keras alone
    """
    _check_model("revert_sync_batchnorm", model)
    plain = {SyncBatchNormalization: keras.layers.BatchNormalization, **(classes or {})}
    for sync, back in plain.items():
        if not (isinstance(sync, type) and issubclass(sync, SyncBatchNormalization) and isinstance(back, type)
                and issubclass(back, keras.layers.BatchNormalization) and not issubclass(back, SyncBatchNormalization)):
            raise TypeError("revert_sync_batchnorm: expected classes to map SyncBatchNormalization subclasses to "
                            f"plain BatchNormalization subclasses, got {sync!r}: {back!r}")

    def clone(layer):
        config = layer.get_config()
        if not isinstance(layer, SyncBatchNormalization):
            return layer.__class__.from_config(config)
        if type(layer) not in plain:
            raise _UnknownSubclass(
                f"revert_sync_batchnorm: layer {layer.name!r} is a {type(layer).__module__}."
                f"{type(layer).__qualname__}, a subclass of SyncBatchNormalization this function does not know; "
                f"pass classes={{{type(layer).__name__}: PlainCls}} with PlainCls the BatchNormalization subclass "
                "it stands for")
        for key in SYNC_CONFIG:
            config.pop(key, None)
        config["synchronized"] = False
        return plain[type(layer)].from_config(config)

    return _rebuilt(model, clone, "revert_sync_batchnorm",
                    "a subclassed model builds its own layers: build them as keras.layers.BatchNormalization")
