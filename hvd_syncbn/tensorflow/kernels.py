"""TensorFlow's kernels for the algorithm of :mod:`hvd_syncbn.backend`: its array ops
(:data:`TF_OPS`), and the local moments, normalisation and gradient sums of a kernel set,
:class:`FusedKernels` (TF's fused batch-norm kernels, one pass each way, for float32
inputs with the channels right after the batch or last) or :class:`CompositeKernels`
(composite ops, for any dtype and layout), chosen by :func:`choose_kernels`."""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence, Tuple

import tensorflow as tf

from hvd_syncbn import backend


class TFOps:
    """:class:`hvd_syncbn.backend.ArrayOps` for TensorFlow."""

    any = staticmethod(tf.reduce_any)

    @staticmethod
    def concat(parts: Sequence[tf.Tensor]) -> tf.Tensor:
        return tf.concat(list(parts), axis=0)

    @staticmethod
    def wide(x: tf.Tensor) -> tf.Tensor:
        return tf.cast(x, tf.float64)

    @staticmethod
    def maximum(x: tf.Tensor, floor: float) -> tf.Tensor:
        return tf.maximum(x, tf.constant(floor, x.dtype))  # a constant, not a Cast op per call

    @staticmethod
    def sum(x: tf.Tensor, axes: Sequence[int]) -> tf.Tensor:
        return tf.reduce_sum(x, axis=list(axes), keepdims=True)

    @staticmethod
    def flat(x: tf.Tensor) -> tf.Tensor:
        return tf.reshape(x, [-1])

    @staticmethod
    def where(cond: tf.Tensor, a: tf.Tensor, b) -> tf.Tensor:
        return tf.where(cond, a, tf.convert_to_tensor(b, a.dtype))

    @staticmethod
    def mul_no_nan(x: tf.Tensor, y: Any) -> tf.Tensor:
        return tf.math.multiply_no_nan(x, tf.cast(y, x.dtype))

    @staticmethod
    def rsqrt(x: tf.Tensor) -> tf.Tensor:
        return tf.math.rsqrt(x)

    @staticmethod
    def all_finite(x: tf.Tensor) -> tf.Tensor:
        return tf.reduce_all(tf.math.is_finite(x))

    @staticmethod
    def rows(x: tf.Tensor, axes: Sequence[int]) -> tf.Tensor:
        shape = tf.shape(x, out_type=tf.int64)
        return tf.reshape(tf.cast(tf.reduce_prod(tf.gather(shape, list(axes))), tf.float64), [1])


TF_OPS = TFOps()


def _fused_moments(x: tf.Tensor, axes: Sequence[int], x4: tf.Tensor, fmt: str):
    """The contract of :func:`hvd_syncbn.backend.local_moments` for ``x``, from one pass
    of the fused kernel over ``x4`` (its 4D view; the normalised output is discarded).
    Where the kernel's float32 mean is too coarse (:func:`hvd_syncbn.backend.needs_float64`),
    the reference runs instead."""
    channel = 3 if fmt == "NHWC" else 1
    channels = x4.shape[channel]  # static where the layer is built: constants, no ops
    ones = tf.ones([channels] if channels is not None else tf.shape(x4)[channel:channel + 1], x4.dtype)
    per_row = channels if channels is not None else tf.cast(tf.size(ones), x4.dtype)
    count = tf.cast(tf.size(x4), x4.dtype) / per_row
    # batch_variance is the unbiased one: n/(n−1), or 1 for n ≤ 1; no rows give NaN.
    # epsilon only touches the normalised output, which this call discards.
    _, mean, var, _, _, _ = tf.raw_ops.FusedBatchNormV3(
        x=x4, scale=ones, offset=tf.zeros_like(ones), mean=tf.zeros([0], x4.dtype), variance=tf.zeros([0], x4.dtype),
        epsilon=1.0, is_training=True, data_format=fmt)
    some = count > 0
    mean = tf.where(some, mean, 0.0)
    var = tf.where(some, var * (tf.maximum(count, 1.0) - 1.0) / tf.maximum(count, 1.0), 0.0)
    reference, fused = _moments_branches(len(x.shape), tuple(axes))
    return tf.raw_ops.StatelessIf(cond=backend.needs_float64(TF_OPS, mean, var), input=[x, count, mean, var],
                                  Tout=[tf.float64] * 3, then_branch=reference, else_branch=fused,
                                  output_shapes=[[1], mean.shape, mean.shape])


@functools.lru_cache(maxsize=None)
def _moments_branches(ndim: int, axes: Tuple[int, ...]) -> tuple:
    """The two branches of :func:`_fused_moments`'s choice, ``(x, count, mean, var) ->
    (count, mean, var)`` in float64, traced once per input rank and axes and shared by
    every layer: ``tf.cond`` traced both anew in each layer (52 layers' moments, traced
    and run once: 5.9 s with it, 3.4 s with these, 2.3 s with no choice at all)."""
    specs = (tf.TensorSpec([None] * ndim, tf.float32), tf.TensorSpec([], tf.float32),
             tf.TensorSpec([None], tf.float32), tf.TensorSpec([None], tf.float32))

    def reference(x, count, mean, var):
        return backend.local_moments(TF_OPS, x, list(axes))

    def fused(x, count, mean, var):
        return tf.fill([1], tf.cast(count, tf.float64)), tf.cast(mean, tf.float64), tf.cast(var, tf.float64)

    return tuple(tf.function(f).get_concrete_function(*specs) for f in (reference, fused))


def per_channel(v: tf.Tensor, x: tf.Tensor, axes: Sequence[int]) -> tf.Tensor:
    """A flat per-channel ``(C,)`` vector shaped to broadcast against ``x``."""
    return tf.reshape(v, [1 if a in axes else x.shape[a] for a in range(len(x.shape))])


def scale_shift(xhat: tf.Tensor, gamma: Optional[tf.Tensor], beta: Optional[tf.Tensor],
                 axes: Sequence[int]) -> tf.Tensor:
    """``γ·x̂ + β`` for flat ``(C,)`` ``γ``, ``β`` (either may be ``None``)."""
    y = xhat if gamma is None else xhat * per_channel(tf.cast(gamma, xhat.dtype), xhat, axes)
    return y if beta is None else y + per_channel(tf.cast(beta, xhat.dtype), xhat, axes)


def _sum(t: tf.Tensor, axes: Sequence[int]) -> tf.Tensor:
    """Per-channel sum, flattened to ``(C,)``."""
    return tf.reshape(tf.reduce_sum(t, axis=axes), [-1])


def _fused_layout(x: tf.Tensor, axes: Sequence[int]) -> Optional[Tuple[Any, str]]:
    """How a float32 input with one channel axis, first or last after the batch, feeds
    the fused kernels (``FusedBatchNormV3`` and its gradient, one pass each): a function
    that reshapes it to 4D (other ranks as ``(N, 1, rest, C)`` or ``(N, C, 1, rest)``),
    and the data format. ``None`` when it cannot."""
    ndim = len(x.shape)
    channel = [a for a in range(ndim) if a not in axes]
    if x.dtype != tf.float32 or len(channel) != 1 or channel[0] not in (1, ndim - 1) or ndim < 2:
        return None
    last = channel[0] == ndim - 1
    fmt = "NHWC" if last else "NCHW"
    if ndim == 4:
        return (lambda t: t), fmt

    def to_fused(t: tf.Tensor) -> tf.Tensor:
        shape = tf.shape(t)
        rest = tf.reduce_prod(shape[1:-1] if last else shape[2:], keepdims=True)
        n, c = shape[:1], shape[ndim - 1:] if last else shape[1:2]
        return tf.reshape(t, tf.concat([n, [1], rest, c] if last else [n, c, [1], rest], 0))

    return to_fused, fmt


def _like(t: tf.Tensor, x: tf.Tensor) -> tf.Tensor:
    """``t`` (a fused kernel's 4D result) in the shape of ``x``."""
    return t if len(x.shape) == 4 else tf.reshape(t, tf.shape(x))


def _fused_affine(x: tf.Tensor, mean: tf.Tensor, var: tf.Tensor, epsilon: float, scale: tf.Tensor,
                  offset: tf.Tensor, fmt: str) -> tf.Tensor:
    """``scale·(x − mean)/√(var + ε) + offset`` per channel, in one pass of the fused kernel."""
    return tf.raw_ops.FusedBatchNormV3(x=x, scale=scale, offset=offset, mean=mean, variance=var, epsilon=epsilon,
                                       is_training=False, data_format=fmt)[0]


class CompositeKernels:
    """:class:`hvd_syncbn.backend.Kernels` from composite TF ops, for any dtype and layout.
    ``weight`` (broadcastable to the input, 0 or 1) leaves positions out of the statistics;
    they are normalised too, so their ``dy`` enters every gradient sum."""

    def __init__(self, axes: Sequence[int], eps: float, weight: Optional[tf.Tensor] = None) -> None:
        self.axes, self.eps, self.weight = list(axes), eps, weight

    def moments(self, x: tf.Tensor):
        weights = None if self.weight is None else self.weight * tf.ones_like(x)
        return backend.local_moments(TF_OPS, x, self.axes, weights)

    def prepare(self, mean: tf.Tensor, var: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        return mean, TF_OPS.rsqrt(var + self.eps)

    def _xhat(self, x: tf.Tensor, stats) -> tf.Tensor:
        mean, invstd = (tf.cast(v, x.dtype) for v in stats)
        return (x - per_channel(mean, x, self.axes)) * per_channel(invstd, x, self.axes)

    def normalize(self, x, stats, scale, offset):
        return scale_shift(self._xhat(x, stats), scale, offset, self.axes)

    def grad_sums(self, dy, x, stats, scale):
        xhat = self._xhat(x, stats)
        return TF_OPS.wide(_sum(dy, self.axes)), TF_OPS.wide(_sum(dy * xhat, self.axes)), xhat

    def input_grad(self, dy, x, stats, coeffs, xhat):
        k, s, t = (per_channel(tf.cast(c, x.dtype), x, self.axes) for c in coeffs)
        stat = s * xhat + t
        return k * dy + (stat if self.weight is None else stat * self.weight)


class FusedKernels(CompositeKernels):
    """:class:`hvd_syncbn.backend.Kernels` by TF's fused kernels, one pass each way (plus
    one for the global terms backward), for float32 inputs that :func:`_fused_layout` takes."""

    def __init__(self, axes: Sequence[int], eps: float, layout: Tuple[Any, str]) -> None:
        super().__init__(axes, eps)
        self.to_fused, self.fmt = layout

    def moments(self, x):
        return _fused_moments(x, self.axes, self.to_fused(x), self.fmt)

    def prepare(self, mean, var):
        return tf.cast(mean, tf.float32), tf.cast(var, tf.float32)

    def _affine(self, x, stats, scale, offset):
        mean = stats[0]
        scale = tf.ones_like(mean) if scale is None else tf.cast(scale, tf.float32)
        offset = tf.zeros_like(mean) if offset is None else tf.cast(offset, tf.float32)
        return _like(_fused_affine(self.to_fused(x), *stats, self.eps, scale, offset, self.fmt), x)

    def normalize(self, x, stats, scale, offset):
        return self._affine(x, stats, scale, offset)

    def grad_sums(self, dy, x, stats, scale):
        # With the statistics as constants the kernel gives k·dy (kept), Σdy·x̂ and Σdy.
        mean, var = stats
        k_dy, sum_dy_xhat, sum_dy = tf.raw_ops.FusedBatchNormGradV3(
            y_backprop=self.to_fused(dy), x=self.to_fused(x),
            scale=tf.ones_like(mean) if scale is None else tf.cast(scale, tf.float32), reserve_space_1=mean,
            reserve_space_2=var, reserve_space_3=tf.zeros([0], tf.float32), epsilon=self.eps, is_training=False,
            data_format=self.fmt)[:3]
        return TF_OPS.wide(sum_dy), TF_OPS.wide(sum_dy_xhat), k_dy

    def input_grad(self, dy, x, stats, coeffs, k_dy):
        _, s, t = coeffs  # dx = k·dy + (s·x̂ + t), the bracket one more kernel pass
        return _like(k_dy, x) + self._affine(x, stats, s, t)


def choose_kernels(xs: Sequence[tf.Tensor], axes: Sequence[int], eps: float, weight: Optional[tf.Tensor]):
    """:class:`FusedKernels` where :func:`_fused_layout` takes ``xs`` (and no ``weight``), else
    :class:`CompositeKernels`."""
    layout = _fused_layout(xs[0], axes) if weight is None else None
    return FusedKernels(axes, eps, layout) if layout else CompositeKernels(axes, eps, weight)
