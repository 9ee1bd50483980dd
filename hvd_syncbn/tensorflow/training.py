"""Keras 3 training under Horovod: gradient averaging, initial broadcast, global metrics.

Horovod 0.28's ``horovod.tensorflow.keras`` fails under Keras 3 (Horovod issue 4290);
these pieces use only ``horovod.tensorflow`` ops, which work::

    hvd.init()
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(x, y, callbacks=[BroadcastGlobalVariablesCallback(0), MetricAverageCallback()],
              verbose=1 if hvd.rank() == 0 else 0)
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from . import xla
from .transports import horovod, refuse_xla, resolve_process_set


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, op: Any = None,
                         process_set: Any = None) -> keras.optimizers.Optimizer:
    """A copy of ``optimizer`` that averages gradients over the ranks before applying them.

    All gradients of a step travel in one grouped allreduce, which Horovod fuses into
    few buffers, not one collective per variable.

    The default averages per rank (Horovod's convention): exact for the global mean
    loss when every rank's batch has the same number of rows. With unequal batches,
    averaging per rank over-weights the small ones; use ``op=hvd.Sum`` with a loss that
    is this rank's share of the global mean (its rows' summed loss divided by the
    *global* row count), and the sum is exactly the one-process gradient.

    Inside XLA on the CPU (``jit_compile=True``, all ranks) the gradients travel packed
    in one float64 buffer through hvd_syncbn's XLA allreduce over MPI
    (:mod:`hvd_syncbn.tensorflow.xla`). Elsewhere XLA cannot run them (Horovod's allreduce
    has no XLA kernel, ours no CUDA target), and Keras 3 compiles the train step with XLA
    by default where a GPU is listed (``jit_compile="auto"`` reads only the layers'
    ``supports_jit``; an optimizer has no say): :class:`BroadcastGlobalVariablesCallback`
    and :class:`MetricAverageCallback` then set ``model.jit_compile = False``, with a
    warning, before ``fit`` builds its train step. Without either callback (a custom loop,
    ``train_on_batch``) such a step raises ``ValueError``; pass ``jit_compile=False`` to
    ``model.compile()``.

    For ``mixed_float16``, wrap the loss-scale optimizer, not the other way round:
    ``DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt))`` reduces the scaled
    gradients, so every rank sees the same overflow and skips the same steps.

    Args:
        optimizer: any Keras 3 optimizer (SGD, Adam, AdamW, LossScaleOptimizer, ...).
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        process_set: Horovod process set (or its ranks) to average over. Default: all.

    Returns:
        An optimizer of a subclass of ``type(optimizer)`` with the same configuration.
        It saves as the plain class, so checkpoints load without Horovod.
    """
    hvd = horovod("DistributedOptimizer")
    op = hvd.Average if op is None else op
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"DistributedOptimizer: expected op hvd.Average or hvd.Sum, got {op!r}")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"DistributedOptimizer: expected a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
    base = type(optimizer)

    class _Distributed(base):
        _hvd_syncbn_allreduce = True  # read by _train_without_xla

        def apply(self, grads, trainable_variables=None):
            variables = trainable_variables if trainable_variables is not None else getattr(
                self, "_trainable_variables", None)  # Keras's own, as its apply falls back to them
            return super().apply(_allreduce_grads(grads, variables, op, process_set), trainable_variables)

    # Save as the plain class: a checkpoint then loads in a process without Horovod.
    _Distributed.__name__, _Distributed.__qualname__ = base.__name__, base.__qualname__
    _Distributed.__module__ = base.__module__
    return _Distributed.from_config(optimizer.get_config())


def _allreduce_grads(grads, variables, op, process_set):
    """``grads`` of ``variables`` averaged (or summed, ``op``) over the ranks of
    ``process_set``; a sparse gradient (``IndexedSlices``, an ``Embedding``'s) densified
    to its variable's shape."""
    hvd, ps = horovod("DistributedOptimizer"), resolve_process_set(process_set)
    if xla.in_xla() and (xla.available() is not None or ps.size() != hvd.size()):
        refuse_xla(f"DistributedOptimizer ({xla.available() or 'a process set: only all ranks inside XLA'})")
    if ps.size() == 1:
        return grads
    grads, variables = list(grads), list(variables or ())
    present = [i for i, g in enumerate(grads) if g is not None]
    dense = [tf.convert_to_tensor(grads[i]) for i in present]  # IndexedSlices -> dense
    if xla.in_xla():
        shapes = [tuple((variables[i] if variables else dense[k]).shape) for k, i in enumerate(present)]
        reduced = _xla_sum(dense, shapes, 1.0 / ps.size() if op == hvd.Average else 1.0)
    else:
        reduced = hvd.grouped_allreduce(dense, op=op, process_set=ps, name="hvd_syncbn.gradients")
    for i, g in zip(present, reduced):
        grads[i] = g
    return grads


def _xla_sum(grads: list, shapes: list, scale: float) -> list:
    """``grads`` summed over all ranks (times ``scale``) inside XLA: packed into one float64
    buffer for hvd_syncbn's XLA allreduce over MPI, unpacked in their dtypes and ``shapes``
    (their variables': static, where XLA may have traced a gradient's as ``(None, k)``, a
    batch dimension of a ``.batch()``-ed dataset carried through a Dense on 3-D input)."""
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
    flat = tf.concat([tf.reshape(tf.cast(g, tf.float64), [n]) for g, n in zip(grads, sizes)], 0)
    summed = xla.allreduce(flat, "hvd_syncbn.gradients") * scale
    parts = tf.split(summed, sizes)
    return [tf.cast(tf.reshape(p, shape), g.dtype) for p, g, shape in zip(parts, grads, shapes)]


def _train_without_xla(model: keras.Model) -> None:
    """Turn XLA off for ``model``'s train step when its optimizer is a
    :func:`DistributedOptimizer` (whose allreduce XLA cannot compile). Keras resolves
    ``jit_compile="auto"`` in ``compile()`` from the layers alone, so the optimizer
    cannot opt out there, as ``SyncBatchNormalization`` does with ``supports_jit``; a
    callback's ``set_model`` runs in ``fit`` before the train step is built, and sets
    Keras's public ``model.jit_compile`` instead."""
    optimizer = getattr(model, "optimizer", None)
    inner = getattr(optimizer, "inner_optimizer", None)  # Keras's own LossScaleOptimizer wrapping ours
    if not any(getattr(o, "_hvd_syncbn_allreduce", False) for o in (optimizer, inner)) or not model.jit_compile:
        return
    if xla.available() is None:  # the gradients go through hvd_syncbn's XLA allreduce (CPU)
        return
    warnings.warn("DistributedOptimizer: Horovod's allreduce has no XLA kernel, so this model trains without "
                  "XLA (jit_compile=False); Keras chose XLA because a GPU is listed or jit_compile=True was "
                  "passed to compile()", stacklevel=2)
    model.jit_compile = False
    if getattr(model, "train_function", None) is not None:  # built with XLA by an earlier call
        model.make_train_function(force=True)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, copy every model and optimizer variable from ``root_rank``.

    The optimizer's slots are built first, so its state (e.g. a restored Adam) is
    broadcast too, and every rank starts the first step from the same point. With a
    :func:`DistributedOptimizer`, it also turns XLA off for the train step (see there).

    Args:
        root_rank: the rank whose values everyone takes. Default: 0.
        process_set: Horovod process set (or its ranks). Default: all ranks.
    """

    def __init__(self, root_rank: int = 0, process_set: Any = None):
        super().__init__()
        self.root_rank, self.process_set = root_rank, process_set

    def set_model(self, model):
        super().set_model(model)
        _train_without_xla(model)

    def on_train_begin(self, logs=None):
        broadcast_variables(self.model, self.root_rank, self.process_set)


def broadcast_variables(model: keras.Model, root_rank: int = 0, process_set: Any = None) -> None:
    """Copy ``model``'s variables and its optimizer's (built if needed) from ``root_rank``."""
    hvd, ps = horovod("broadcast_variables"), resolve_process_set(process_set)
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        variables += list(optimizer.variables)
    for i, v in enumerate(variables):
        v.assign(hvd.broadcast(tf.convert_to_tensor(v), root_rank, name=f"hvd_syncbn.broadcast.{i}",
                               process_set=ps))


class MetricAverageCallback(keras.callbacks.Callback):
    """At each epoch's end, replace the logged metrics by their average over the ranks,
    in one allreduce. Place it before callbacks that read the logs (checkpoints, CSV).
    With a :func:`DistributedOptimizer`, it also turns XLA off for the train step (see there)."""

    def __init__(self, process_set: Any = None):
        super().__init__()
        self.process_set = process_set

    def set_model(self, model):
        super().set_model(model)
        _train_without_xla(model)

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float)) or hasattr(v, "dtype"))
        values = tf.stack([tf.cast(logs[k], tf.float64) for k in keys])
        hvd = horovod("MetricAverageCallback")
        averaged = hvd.allreduce(values, op=hvd.Average, name="hvd_syncbn.metrics",
                                 process_set=resolve_process_set(self.process_set)).numpy()
        logs.update({k: float(v) for k, v in zip(keys, averaged)})
