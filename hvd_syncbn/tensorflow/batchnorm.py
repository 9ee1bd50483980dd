"""Keras 3 SyncBatchNormalization: ``keras.layers.BatchNormalization`` with statistics over
every rank, by :func:`hvd_syncbn.tensorflow.functional._sync_normalize`."""

from __future__ import annotations

from typing import Tuple

import keras
import numpy as np
import tensorflow as tf

from hvd_syncbn import backend, validation
from hvd_syncbn.comm import poison
from hvd_syncbn.communicator import Communicator
from hvd_syncbn.groups import check_group_size
from hvd_syncbn.identity import make_call
from hvd_syncbn.tensorflow import transports, xla
from hvd_syncbn.tensorflow.device import DeferredChecks, GraphReducer
from hvd_syncbn.tensorflow.functional import GraphChecks, _split_axes, _sync_normalize, channel_count, host_reduce
from hvd_syncbn.tensorflow.kernels import TF_OPS, per_channel, scale_shift


@keras.saving.register_keras_serializable(package="hvd_syncbn")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Keras ``BatchNormalization`` whose batch statistics cover every Horovod rank.

    In training (``training=True`` and ``trainable``) the mean and variance are taken
    over the rows of every rank in ``process_set``, weighted by each rank's row count
    (zero included), with one allreduce forward and one backward (none with one rank or
    without Horovod). Unlike Keras's ``E[x²] − E[x]²``, the variance is computed from
    shifted values, so it stays accurate when ``|mean| ≫ std``. Inference: exactly
    ``keras.layers.BatchNormalization``. A global batch of one row raises, as PyTorch
    does; an empty one leaves the moving statistics alone. Moving statistics follow Keras:
    ``moving = moving·momentum + batch·(1 − momentum)``, with the biased variance.

    The statistics take one of two paths (``stats``). On the host path they cross ranks
    through ``tf.numpy_function`` with the transport's deadline and diagnosis. On the
    device path they stay TF tensors on the input's device, summed by Horovod's graph op
    (NCCL where Horovod has GPU support) or, inside XLA on the CPU, by hvd_syncbn's XLA
    allreduce over MPI (:mod:`hvd_syncbn.tensorflow.xla`): no host hop in the step. Its
    checks are deferred flags that :func:`~hvd_syncbn.tensorflow.check` or the
    :class:`~hvd_syncbn.tensorflow.CheckSyncBatchNorm` callback raises, naming the
    layers, and a flagged step leaves the moving statistics alone.

    ``supports_jit`` is true only where the XLA allreduce is built and no GPU is listed
    (it has no CUDA target): on a GPU machine Keras's default ``jit_compile="auto"`` then
    trains without XLA, on the device path.

    Args:
        axis: the channel axis, or a list of axes (their sizes form the channels).
            Default: -1.
        momentum: weight of the old value in the moving statistics. This is not
            optimizer momentum (PyTorch's BN momentum is ``1 −`` this). Default: 0.99.
        epsilon: added to the variance. Default: 1e-3.
        center, scale, *_initializer, *_regularizer, *_constraint: as in
            ``keras.layers.BatchNormalization``.
        renorm, renorm_clipping, renorm_momentum: Batch Renormalization (Ioffe 2017), as
            in ``keras.layers.BatchNormalization``: the correction ``(r, d)`` comes from
            the global batch statistics, and ``moving_stddev``, ``renorm_mean`` and
            ``renorm_stddev`` update alike on every rank. Default: ``False``.
        synchronized: accepted for config compatibility (Keras's own argument); this
            layer always synchronises, and its config says ``True``.
        fused: accepted for the signature of Horovod's and Keras 2's layer, and ignored:
            the layer picks TF's fused kernels itself (float32 input with the channels
            right after the batch or last), composite ops otherwise.
        process_set: Horovod process set (or its ranks) to synchronise within.
            Default: all ranks.
        group_size: synchronise within groups of ranks instead (BN groups): ``k``
            consecutive ranks (``k`` must divide the number of ranks), or ``"node"``, the
            ranks on one host (groups may then differ in size). A group of one rank is
            plain BN and makes no collective. Horovod needs a process set per group:
            registered at ``hvd.init(process_sets=...)``, or added by the layer with
            dynamic process sets (``HOROVOD_DYNAMIC_PROCESS_SETS=1``). Not with
            ``process_set``. Default: ``None`` (all ranks).
        comm: how statistics travel: ``"horovod"``, ``"mpi"`` (mpi4py, under mpirun) or
            ``"auto"`` (MPI under mpirun with mpi4py, else Horovod). Default:
            ``$HVD_SYNCBN_COMM``, else ``"auto"``; ``"torch"`` (PyTorch's) is refused
            here. When ranks disagree, every rank raises
            :class:`~hvd_syncbn.comm.SyncBatchNormError` within the timeout.
        check_finite: raise (before any update) when the global statistics are not
            finite, i.e. NaN/Inf in some rank's input. Default: ``False``: NaN/Inf
            propagate as in ``keras.layers.BatchNormalization``.
        stats: ``"host"``, ``"device"`` (needs ``hvd.init()`` outside XLA) or ``"auto"``:
            the device inside XLA and on a machine with a GPU (outside ``tf.distribute``
            replicas), else the host.
            Default: ``$HVD_SYNCBN_STATS``, else ``"auto"``.
        **kwargs: base layer arguments (``name``, ``dtype``, ...). ``name`` also names
            the layer's collectives and must be the same on every rank.

    Shape:
        - Input: any rank ≥ 2; the batch size may differ per rank, even 0.
        - Output: same shape as the input.

    Examples::

        >>> hvd.init()
        >>> bn = hvd_syncbn.tensorflow.SyncBatchNormalization()
        >>> y = bn(tf.random.normal([2, 32, 32, 64]), training=True)
    """

    def __init__(self, axis=-1, momentum=0.99, epsilon=1e-3, *args, synchronized=True,
                 process_set=None, comm=None, check_finite=False, fused=None, stats=None, group_size=None,
                 **kwargs):
        axes = [axis] if isinstance(axis, int) else [int(a) for a in axis]
        if not axes:
            raise ValueError(f"SyncBatchNormalization: expected an axis or a non-empty list of axes, got {axis!r}")
        validation.check_args("SyncBatchNormalization", float(epsilon), momentum, eps_name="epsilon")
        super().__init__(axes[0], momentum, epsilon, *args, **kwargs)
        self.axis = axis if isinstance(axis, int) else axes
        self.process_set = process_set
        self.group_size = check_group_size("SyncBatchNormalization", group_size, process_set)
        self.comm = comm
        self.check_finite = bool(check_finite)
        self.stats = validation.stats_choice("SyncBatchNormalization", stats)
        transports.REGISTRY.requested(comm, "SyncBatchNormalization")

    @property
    def supports_jit(self) -> bool:
        """Whether this layer runs inside XLA: on the device path where the XLA allreduce is
        built and no GPU is listed (it has no CUDA target). Keras's default
        ``jit_compile="auto"`` (XLA where a GPU is listed) thus resolves to False."""
        return self._jit_allowed and self.stats != "host" and xla.available() is None

    @supports_jit.setter
    def supports_jit(self, value) -> None:  # Keras's Layer.__init__ sets True; False opts out
        self._jit_allowed = bool(value)

    def build(self, input_shape):
        ndim = len(input_shape)
        channel_axes, self._reduction_axes = _split_axes(ndim, self.axis, self.name)
        if isinstance(self.axis, int):
            super().build(input_shape)
        else:
            shape = tuple(input_shape[a] for a in channel_axes)
            for name, init, reg, con, on in (
                ("gamma", self.gamma_initializer, self.gamma_regularizer, self.gamma_constraint, self.scale),
                ("beta", self.beta_initializer, self.beta_regularizer, self.beta_constraint, self.center),
            ):
                if on:
                    setattr(self, name, self.add_weight(shape=shape, name=name, initializer=init, regularizer=reg,
                                                        constraint=con, trainable=True, autocast=False))
            self.moving_mean = self.add_weight(shape=shape, name="moving_mean", trainable=False,
                                               initializer=self.moving_mean_initializer, autocast=False)
            self.moving_variance = self.add_weight(shape=shape, name="moving_variance", trainable=False,
                                                   initializer=self.moving_variance_initializer, autocast=False)
            if self.renorm:  # as Keras builds them: standard deviations start at √(variance initializer)
                def stddev(shape, dtype=None):
                    return tf.sqrt(keras.initializers.get(self.moving_variance_initializer)(shape, dtype=dtype))

                for name, init in (("moving_stddev", stddev), ("renorm_mean", self.moving_mean_initializer),
                                   ("renorm_stddev", stddev)):
                    setattr(self, name, self.add_weight(shape=shape, name=name, initializer=init, trainable=False,
                                                        autocast=False))
        # Checked in call() instead, so that a bad input on one rank fails every rank.
        self.input_spec = None
        with tf.init_scope():  # the device path's deferred flags (hvd_syncbn.deferred.FLAGS); not a weight
            self._sync_errors = tf.Variable(tf.zeros([3]), trainable=False, name="sync_errors")  # counts
        self._ndim, self._channels = ndim, {a: input_shape[a] for a in channel_axes}
        self._channel_axes = channel_axes

    def _input_problem(self, inputs) -> str:
        """What is wrong with ``inputs`` for this built layer ('' if nothing)."""
        shape = tuple(inputs.shape)
        try:
            if len(shape) != self._ndim:
                raise ValueError(f"{self.name}: expected a {self._ndim}D input (as built), got {len(shape)}D input "
                                 f"of shape {shape}")
            for a, size in self._channels.items():
                validation.check_input(self.name, shape, a, size, inputs.dtype.is_floating, inputs.dtype.name,
                                       "tf.cast(x, tf.float32)")
        except ValueError as e:
            return str(e)
        return ""

    def _fail_everywhere(self, inputs, problem: str) -> None:
        """Raise ``problem``; in training with peers, after joining the forward collective
        with a poisoned header, so that every rank raises it instead of waiting."""
        comm = transports.resolve(self.comm, self.process_set, self.name, self.group_size)
        if comm is not None:
            identity = (self.name, int(np.prod(list(self._channels.values()))), len(inputs.shape), inputs.dtype.name)
            call = (GraphReducer(comm, self.process_set, *identity, self._sync_errors).next_call("fwd")
                    if self._on_device() else make_call(comm, identity[0], "fwd", *identity[1:]))
            poison(comm, call, problem)
        raise ValueError(problem)

    def call(self, inputs, training=None, mask=None):
        sync = bool(training) and self.trainable
        problem = self._input_problem(inputs)
        if problem and sync:
            self._fail_everywhere(inputs, problem)
        if problem:
            raise ValueError(problem)
        if isinstance(self.axis, int) and not sync:
            return super().call(inputs, training=training, mask=mask)
        x = tf.cast(inputs, tf.float32 if inputs.dtype != tf.float64 else tf.float64)
        axes = self._reduction_axes
        if mask is not None:
            mask = tf.expand_dims(tf.cast(mask, x.dtype), -1)
        # float16/bfloat16 variables (dtype="float16", not a mixed policy) compute in float32,
        # as Keras's own layer does: the fused kernels take no half statistics.
        gamma, beta = (None if w is None else tf.cast(w, x.dtype) for w in (self.gamma, self.beta))
        if sync:
            reduce, checks = self._reduce_and_checks(x)
            (y,), mean, var, total = _sync_normalize(
                [x], gamma, beta, axes, self.epsilon, self.name, reduce, checks, mask, self.check_finite,
                self._renorm_correction if self.renorm else None,
            )
            # More than one row: neither an empty nor a single-row (flagged) global batch, nor
            # the NaN count of a mismatch (flagged); no update on a flagged step.
            updated = total[0] > 1
            if isinstance(checks, DeferredChecks):
                checks.record(self._sync_errors)
                if self.check_finite:
                    updated = tf.logical_and(updated, tf.logical_not(checks.flags["non_finite"]))
            # Renorm's updates wait for the output: in a tf.function, its reads of renorm_mean
            # and renorm_stddev (inside the custom gradient) are not otherwise ordered first.
            with tf.control_dependencies([y] if self.renorm else []):
                self._update_moving(mean, var, updated)
        else:  # multi-axis inference
            mean, var = (tf.cast(v, x.dtype) for v in (self.moving_mean, self.moving_variance))
            xhat = (x - per_channel(mean, x, axes)) * per_channel(tf.math.rsqrt(var + self.epsilon), x, axes)
            y = scale_shift(xhat, gamma, beta, axes)
        return tf.cast(y, self.compute_dtype)

    def _reduce_and_checks(self, x: tf.Tensor):
        """``(reduce, checks)`` of this call: the device path's graph op and deferred
        flags, or the host path's (see ``stats``)."""
        axes = self._reduction_axes
        if not self._on_device():
            return host_reduce(self.name, x, axes, self.process_set, self.comm, self.group_size), GraphChecks()
        comm = transports.resolve(self.comm, self.process_set, self.name, self.group_size)
        if comm is None:  # alone
            return (lambda buf, direction: buf), DeferredChecks()
        self._sync_reducer = GraphReducer(comm, self.process_set, self.name, channel_count(x, axes), len(x.shape),
                                          x.dtype.name, self._sync_errors)  # what check() names on a mismatch
        return self._sync_reducer, DeferredChecks()

    def _on_device(self) -> bool:
        """Whether this call takes the device path: ``stats="device"``, or ``"auto"`` inside
        XLA or on a machine with a GPU (outside ``tf.distribute`` replicas, which the host
        path merges)."""
        ctx = tf.distribute.get_replica_context()
        replicas = ctx is not None and ctx.num_replicas_in_sync > 1
        if self.stats == "device" and replicas:
            raise ValueError(f"{self.name}: stats='device' does not run inside tf.distribute replicas (got "
                             f"{ctx.num_replicas_in_sync}); use stats='host' or 'auto' there")
        return self.stats == "device" or (self.stats == "auto" and not replicas and (
            xla.in_xla() or bool(tf.config.list_logical_devices("GPU"))))

    def _renorm_correction(self, mean: tf.Tensor, var: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        """Batch renormalization's ``(r, d)`` from the global statistics, by Keras's own
        code (which reads ``renorm_mean``, ``renorm_stddev`` and ``renorm_clipping``)."""
        shape, dtype = self.renorm_mean.shape, self.renorm_mean.dtype
        r, d, _, _ = self._renorm_correction_and_moments(*(tf.cast(tf.reshape(v, shape), dtype) for v in (mean, var)))
        return r, d

    def _update_moving(self, mean: tf.Tensor, var: tf.Tensor, some: tf.Tensor) -> None:
        """Keras's moving-statistics updates from the global batch statistics (renorm's
        too), unless the global batch was empty (``some`` false)."""
        updates = [(self.moving_mean, mean, self.momentum)]
        if self.renorm:
            stddev = tf.sqrt(var + self.epsilon)
            updates += [(self.moving_stddev, stddev, self.momentum), (self.renorm_mean, mean, self.renorm_momentum),
                        (self.renorm_stddev, stddev, self.renorm_momentum)]
        else:
            updates.append((self.moving_variance, var, self.momentum))
        for momentum in dict.fromkeys(m for _, _, m in updates):  # one running_update per momentum
            olds = [moving for moving, _, m in updates if m == momentum]
            news = [tf.cast(new if new.shape == moving.shape else tf.reshape(new, moving.shape), moving.dtype)
                    for moving, new, m in updates if m == momentum]
            weight = tf.constant(momentum, olds[0].dtype)
            for moving, value in zip(olds, backend.running_update(TF_OPS, olds, news, weight, some)):
                moving.assign(value)
        if self.renorm:  # Keras derives the variance from the standard deviation
            derived = tf.nn.relu(tf.square(self.moving_stddev) - self.epsilon)
            self.moving_variance.assign(backend.running_update(TF_OPS, [self.moving_variance], [derived],
                                                                   tf.constant(0.0, derived.dtype), some)[0])

    def get_config(self):
        config = super().get_config()
        ps = self.process_set
        config["process_set"] = ps.ranks if hasattr(ps, "ranks") else ps
        config["group_size"] = self.group_size
        config["comm"] = None if isinstance(self.comm, Communicator) else self.comm
        config["check_finite"] = self.check_finite
        config["stats"] = self.stats
        config["synchronized"] = True  # whatever was passed: this layer always synchronizes
        return config

