"""Keras 3 / TensorFlow SyncBatchNormalization over Horovod, and its functional op.

Same backend as the PyTorch adapter: one packed allreduce forward, one backward.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from hvd_syncbn import backend

try:  # Horovod is optional: without it the layer is plain BN.
    import horovod.tensorflow as hvd
    from horovod.common import process_sets as _process_sets
except ImportError:  # pragma: no cover - exercised only where Horovod is missing
    hvd = None


class _TFOps:
    """The tensor ops :mod:`hvd_syncbn.backend` needs, for TensorFlow."""

    @staticmethod
    def concat(parts: Sequence[tf.Tensor]) -> tf.Tensor:
        return tf.concat(list(parts), axis=0)

    @staticmethod
    def cast(x: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
        return tf.cast(x, like.dtype)

    @staticmethod
    def wide(x: tf.Tensor) -> tf.Tensor:
        return tf.cast(x, tf.float64)

    @staticmethod
    def rsqrt(x: tf.Tensor) -> tf.Tensor:
        return tf.math.rsqrt(x)

    @staticmethod
    def maximum(x: tf.Tensor, floor: float) -> tf.Tensor:
        return tf.maximum(x, tf.cast(floor, x.dtype))


_ops = _TFOps()


def horovod_active(process_set: Any = None) -> bool:
    """Whether Horovod is initialised with more than one rank in ``process_set``."""
    if hvd is None or not hvd.is_initialized():
        return False
    return resolve_process_set(process_set).size() > 1


def resolve_process_set(process_set: Any) -> Any:
    """A registered Horovod process set from ``None`` (all ranks), a set, or its ranks."""
    if process_set is None:
        return hvd.global_process_set
    if isinstance(process_set, _process_sets.ProcessSet):
        return process_set
    ranks = sorted(int(r) for r in process_set)
    for set_id, set_ranks in hvd.mpi_ops._basics._get_process_set_ids_and_ranks().items():
        if sorted(set_ranks) == ranks:
            return _process_sets._temp_process_set_object(set_id)
    raise ValueError(
        f"expected process_set ranks {ranks} to be a registered Horovod process set; "
        f"register it with hvd.add_process_set({ranks}) or hvd.init(process_sets=...) first"
    )


def _allreduce_sum(process_set: Any):
    ps = resolve_process_set(process_set)

    def allreduce_sum(buf: tf.Tensor, name: str) -> tf.Tensor:
        return hvd.allreduce(buf, op=hvd.Sum, name=name, process_set=ps, ignore_name_scope=True)

    return allreduce_sum


def _local_moments(x: tf.Tensor, axes: Sequence[int], weights: Optional[tf.Tensor]):
    """Local count, float64 mean and biased variance per channel, shifted for accuracy.

    The float32 mean is a shift ``m``; the sums of ``d = x − m`` then carry the low bits
    that rounding ``m`` lost, so the mean is exact to float64 and the variance centred.
    ``weights`` (0/1, broadcast to ``x``) leaves out masked positions.
    """
    if weights is None:
        count = tf.cast(tf.size(x), x.dtype) / tf.cast(tf.reduce_prod(_channel_dims(x, axes)), x.dtype)
        count = tf.fill([1], count)
        safe = tf.maximum(count, 1.0)
        shift = tf.reduce_sum(x, axis=axes, keepdims=True) / safe
        d = x - shift
    else:
        count = _sum(weights * tf.ones_like(x), axes)[:1]
        safe = tf.maximum(count, 1.0)
        shift = tf.reduce_sum(x * weights, axis=axes, keepdims=True) / safe
        d = (x - shift) * weights
    mean_d = _sum(d, axes) / safe
    var = tf.maximum(_sum(d * d, axes) / safe - mean_d * mean_d, 0.0)
    mean = tf.cast(tf.reshape(shift, [-1]), tf.float64) + tf.cast(mean_d, tf.float64)
    return count, mean, var


def _channel_dims(x: tf.Tensor, axes: Sequence[int]) -> tf.Tensor:
    shape = tf.shape(x)
    return tf.stack([shape[a] for a in range(len(x.shape)) if a not in axes])


def _keep(v: tf.Tensor, x: tf.Tensor, axes: Sequence[int]) -> tf.Tensor:
    """A flat per-channel ``(C,)`` vector shaped to broadcast against ``x``."""
    return tf.reshape(v, [1 if a in axes else x.shape[a] for a in range(len(x.shape))])


def _sum(t: tf.Tensor, axes: Sequence[int]) -> tf.Tensor:
    """Per-channel sum, flattened to ``(C,)``."""
    return tf.reshape(tf.reduce_sum(t, axis=axes), [-1])


def sync_moments_and_normalize(
    x: tf.Tensor,
    gamma: Optional[tf.Tensor],
    beta: Optional[tf.Tensor],
    axes: Sequence[int],
    epsilon: float,
    name: str,
    process_set: Any = None,
    mask: Optional[tf.Tensor] = None,
) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Normalise ``x`` (float32) with the statistics of every rank's rows.

    Returns ``(y, mean, variance)``, the statistics global and biased. The gradient is
    written by hand with one packed allreduce of ``[Σdy, Σdy·x̂]``.

    Shape:
        - x: any rank; ``axes`` are the reduction axes (all but the channel axes).
        - gamma, beta: the channel dims (any shape of ``C`` elements); returned mean
          and variance: ``(C,)``.
        - mask: broadcastable to ``x``; 0 leaves a position out of the statistics.
    """
    allreduce = _allreduce_sum(process_set) if horovod_active(process_set) else (lambda buf, _: buf)
    weights = None if mask is None else tf.cast(mask, x.dtype)
    inputs = [x] + [tf.reshape(t, [-1]) for t in (gamma, beta) if t is not None]

    @tf.custom_gradient
    def _fn(*inputs):
        x = inputs[0]
        g = inputs[1] if gamma is not None else None
        b = inputs[-1] if beta is not None else None
        count, mean, var = _local_moments(x, axes, weights)
        total, g_mean, g_var = backend.sync_moments(
            _ops, allreduce, backend.collective_name(name, "fwd"), count, mean, var
        )
        total, mean, var = (tf.cast(t, x.dtype) for t in (total, g_mean, g_var))
        invstd = tf.math.rsqrt(var + epsilon)
        xhat = (x - _keep(mean, x, axes)) * _keep(invstd, x, axes)
        y = xhat
        if g is not None:
            y = y * _keep(g, x, axes)
        if b is not None:
            y = y + _keep(b, x, axes)

        def grad(dy, _dmean, _dvar):
            # Masked positions are normalised too: their dy enters every sum, while
            # only unmasked positions moved the statistics (hence ``weights`` below).
            sum_dy = _sum(dy, axes)
            sum_dy_xhat = _sum(dy * xhat, axes)
            g_dy, g_dy_xhat = backend.sync_grad_sums(
                _ops, allreduce, backend.collective_name(name, "bwd"), sum_dy, sum_dy_xhat
            )
            k, s, t = backend.input_grad_coeffs(total, invstd, g, g_dy, g_dy_xhat)
            stat_part = _keep(s, x, axes) * xhat + _keep(t, x, axes)
            if weights is not None:
                stat_part = stat_part * weights
            dx = _keep(k, x, axes) * dy + stat_part
            grads = [dx]
            if g is not None:
                grads.append(sum_dy_xhat)
            if b is not None:
                grads.append(sum_dy)
            return grads

        return (y, mean, var), grad

    return _fn(*inputs)


@keras.saving.register_keras_serializable(package="hvd_syncbn")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Keras ``BatchNormalization`` whose batch statistics cover every Horovod rank.

    In training (``training=True`` and ``trainable``) the mean and variance are taken
    over the rows of every rank in ``process_set``, weighted by each rank's row count
    (zero included), with one allreduce forward and one backward (none with one rank or
    without Horovod). Unlike Keras's ``E[x²] − E[x]²``, the variance is computed from
    shifted values, so it stays accurate when ``|mean| ≫ std``. Inference: exactly
    ``keras.layers.BatchNormalization``. Moving statistics follow Keras:
    ``moving = moving·momentum + batch·(1 − momentum)``, with the biased variance.

    Args:
        axis: the channel axis, or a list of axes (their sizes form the channels).
            Default: -1.
        momentum: weight of the old value in the moving statistics. This is not
            optimizer momentum (PyTorch's BN momentum is ``1 −`` this). Default: 0.99.
        epsilon: added to the variance. Default: 1e-3.
        center, scale, *_initializer, *_regularizer, *_constraint: as in
            ``keras.layers.BatchNormalization``.
        synchronized: accepted for config compatibility; this layer always synchronises.
        process_set: Horovod process set (or its ranks) to synchronise within.
            Default: all ranks.
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

    def __init__(self, axis=-1, momentum=0.99, epsilon=1e-3, *args, synchronized=False,
                 process_set=None, renorm=False, **kwargs):
        if renorm:
            raise ValueError("SyncBatchNormalization: renorm=True is not supported; use renorm=False")
        axes = [axis] if isinstance(axis, int) else [int(a) for a in axis]
        if not axes:
            raise ValueError(f"SyncBatchNormalization: expected an axis or a non-empty list of axes, got {axis!r}")
        if not 0.0 <= float(momentum) <= 1.0:
            raise ValueError(f"SyncBatchNormalization: expected momentum in [0, 1], got {momentum!r}")
        if not float(epsilon) > 0:
            raise ValueError(f"SyncBatchNormalization: expected epsilon > 0, got {epsilon!r}")
        super().__init__(axes[0], momentum, epsilon, *args, **kwargs)
        self.axis = axis if isinstance(axis, int) else axes
        self.process_set = process_set

    def build(self, input_shape):
        ndim = len(input_shape)
        axes = [self.axis] if isinstance(self.axis, int) else self.axis
        for a in axes:
            if not -ndim <= a < ndim:
                raise ValueError(f"{self.name}: axis {a} is out of range for input shape {tuple(input_shape)}")
        channel_axes = sorted({a % ndim for a in axes})
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
            self.input_spec = keras.layers.InputSpec(ndim=ndim, axes={a: input_shape[a] for a in channel_axes})
        self._channel_axes = channel_axes
        self._reduction_axes = [a for a in range(ndim) if a not in channel_axes]

    def call(self, inputs, training=None, mask=None):
        backend.check_input(self.name, inputs.shape, self._channel_axes[0], inputs.shape[self._channel_axes[0]],
                            inputs.dtype.is_floating, inputs.dtype.name)
        sync = bool(training) and self.trainable
        if isinstance(self.axis, int) and not sync:
            return super().call(inputs, training=training, mask=mask)
        x = tf.cast(inputs, tf.float32 if inputs.dtype != tf.float64 else tf.float64)
        axes = self._reduction_axes
        if mask is not None:
            mask = tf.expand_dims(tf.cast(mask, x.dtype), -1)
        if sync:
            y, mean, var = sync_moments_and_normalize(
                x, self.gamma, self.beta, axes, self.epsilon, self.name, self.process_set, mask
            )
            for moving, new in ((self.moving_mean, mean), (self.moving_variance, var)):
                new = tf.cast(tf.reshape(new, moving.shape), moving.dtype)
                moving.assign(backend.ema(moving, new, tf.cast(self.momentum, moving.dtype)))
        else:  # multi-axis inference
            mean, var = (tf.cast(v, x.dtype) for v in (self.moving_mean, self.moving_variance))
            y = (x - _keep(mean, x, axes)) * _keep(tf.math.rsqrt(var + self.epsilon), x, axes)
            if self.scale:
                y = y * _keep(tf.cast(self.gamma, x.dtype), x, axes)
            if self.center:
                y = y + _keep(tf.cast(self.beta, x.dtype), x, axes)
        return tf.cast(y, self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        ps = self.process_set
        config["process_set"] = ps.ranks if hasattr(ps, "ranks") else ps
        return config
