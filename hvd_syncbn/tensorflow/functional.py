"""Synchronized batch normalization as a TensorFlow op: the algorithm of
:mod:`hvd_syncbn.backend` with a hand-written gradient, for the Keras layer and for
``tf.nn``-style code.

float32 inputs with the channels right after the batch or last (the common layouts)
normalise, and take their gradient sums, through TF's fused batch-norm kernels given the
global statistics; other inputs use composite ops.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from hvd_syncbn import backend
from hvd_syncbn.comm import allreduce
from hvd_syncbn.communicator import Communicator
from hvd_syncbn.identity import make_call
from hvd_syncbn.tensorflow import transports


class _TFOps:
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


_ops = _TFOps()


def _allreduce_sum(comm: Optional[Communicator], layer: str, x: tf.Tensor, channels: int):
    """Sum over the ranks of ``comm`` (nothing to do if ``None``) and, inside a
    ``tf.distribute`` replica context, over the in-process replicas first (one
    cross-rank collective per process). ``x`` and ``channels`` identify the call."""
    ndim, dtype = len(x.shape), x.dtype.name

    def over_ranks(buf: tf.Tensor, direction: str) -> tf.Tensor:
        if comm is None:
            return buf

        def run(b: np.ndarray) -> np.ndarray:
            return allreduce(comm, b, make_call(comm, layer, direction, channels, ndim, dtype))

        out = tf.numpy_function(run, [tf.cast(buf, tf.float64)], tf.float64, stateful=True, name="hvd_syncbn_allreduce")
        return tf.cast(tf.reshape(out, buf.shape), buf.dtype)

    def allreduce_sum(buf: tf.Tensor, direction: str) -> tf.Tensor:
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return over_ranks(buf, direction)
        buf = ctx.all_reduce(tf.distribute.ReduceOp.SUM, buf)  # every replica: the process sum

        def merge(strategy, summed):
            return over_ranks(strategy.experimental_local_results(summed)[0], direction)

        return ctx.merge_call(merge, args=(buf,))

    return allreduce_sum


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
    return tf.raw_ops.StatelessIf(cond=backend.needs_float64(_ops, mean, var), input=[x, count, mean, var],
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
        return backend.local_moments(_ops, x, list(axes))

    def fused(x, count, mean, var):
        return tf.fill([1], tf.cast(count, tf.float64)), tf.cast(mean, tf.float64), tf.cast(var, tf.float64)

    return tuple(tf.function(f).get_concrete_function(*specs) for f in (reference, fused))


def _split_axes(ndim: int, axis: Any, layer: str) -> Tuple[list, list]:
    """``(channel axes, reduction axes)``, sorted and non-negative, of an ``ndim`` input
    whose channels are ``axis`` (an int or a list of ints)."""
    axes = [axis] if isinstance(axis, int) else list(axis)
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"{layer}: axis {a} is out of range for a {ndim}D input")
    channel = sorted({a % ndim for a in axes})
    return channel, [a for a in range(ndim) if a not in channel]


def _per_channel(v: tf.Tensor, x: tf.Tensor, axes: Sequence[int]) -> tf.Tensor:
    """A flat per-channel ``(C,)`` vector shaped to broadcast against ``x``."""
    return tf.reshape(v, [1 if a in axes else x.shape[a] for a in range(len(x.shape))])


def _scale_shift(xhat: tf.Tensor, gamma: Optional[tf.Tensor], beta: Optional[tf.Tensor],
                 axes: Sequence[int]) -> tf.Tensor:
    """``γ·x̂ + β`` for flat ``(C,)`` ``γ``, ``β`` (either may be ``None``)."""
    y = xhat if gamma is None else xhat * _per_channel(tf.cast(gamma, xhat.dtype), xhat, axes)
    return y if beta is None else y + _per_channel(tf.cast(beta, xhat.dtype), xhat, axes)


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


def _first_order(layer: str, *grads: tf.Tensor) -> list:
    """``grads`` as they are, except that asking for their own gradient (a second
    derivative of the layer) raises: the hand-written gradient treats the statistics as
    constants and sums across ranks outside the tape, so one would be silently wrong."""

    @tf.custom_gradient
    def identity(*ts):
        def refuse(*upstream):
            raise NotImplementedError(f"{layer}: SyncBatchNormalization has no second derivative (its gradient "
                                      "is written by hand, with statistics summed across ranks outside the tape)")

        return list(ts), refuse

    return list(identity(*grads))


class CompositeKernels:
    """:class:`hvd_syncbn.backend.Kernels` from composite TF ops, for any dtype and layout.
    ``weight`` (broadcastable to the input, 0 or 1) leaves positions out of the statistics;
    they are normalised too, so their ``dy`` enters every gradient sum."""

    def __init__(self, axes: Sequence[int], eps: float, weight: Optional[tf.Tensor] = None) -> None:
        self.axes, self.eps, self.weight = list(axes), eps, weight

    def moments(self, x: tf.Tensor):
        weights = None if self.weight is None else self.weight * tf.ones_like(x)
        return backend.local_moments(_ops, x, self.axes, weights)

    def prepare(self, mean: tf.Tensor, var: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        return mean, _ops.rsqrt(var + self.eps)

    def _xhat(self, x: tf.Tensor, stats) -> tf.Tensor:
        mean, invstd = (tf.cast(v, x.dtype) for v in stats)
        return (x - _per_channel(mean, x, self.axes)) * _per_channel(invstd, x, self.axes)

    def normalize(self, x, stats, scale, offset):
        return _scale_shift(self._xhat(x, stats), scale, offset, self.axes)

    def grad_sums(self, dy, x, stats, scale):
        xhat = self._xhat(x, stats)
        return _ops.wide(_sum(dy, self.axes)), _ops.wide(_sum(dy * xhat, self.axes)), xhat

    def input_grad(self, dy, x, stats, coeffs, xhat):
        k, s, t = (_per_channel(tf.cast(c, x.dtype), x, self.axes) for c in coeffs)
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
        return _ops.wide(sum_dy), _ops.wide(sum_dy_xhat), k_dy

    def input_grad(self, dy, x, stats, coeffs, k_dy):
        _, s, t = coeffs  # dx = k·dy + (s·x̂ + t), the bracket one more kernel pass
        return _like(k_dy, x) + self._affine(x, stats, s, t)


class GraphChecks:
    """:class:`hvd_syncbn.backend.Checks` as graph assertions that run before anything
    downstream of the statistics (the moving-statistics updates included)."""

    def __init__(self) -> None:
        self.asserts: list = []

    def require(self, ok, check: str, message: str) -> None:
        # A string-only Assert is a plain op; assert_none_equal would add a cond per layer.
        self.asserts.append(tf.debugging.Assert(ok, [message]))

    def after(self, values):
        with tf.control_dependencies(self.asserts):
            return [tf.identity(v) for v in values]


def channel_count(x: tf.Tensor, axes: Sequence[int]) -> int:
    """The number of channels of ``x`` (the product of its sizes off the reduction ``axes``)."""
    return int(np.prod([d or -1 for a, d in enumerate(x.shape) if a not in axes]))


def host_reduce(name: str, x: tf.Tensor, axes: Sequence[int], process_set: Any, comm: Any) -> backend.AllreduceSum:
    """The host path's summing allreduce for the statistics of ``x`` (``tf.numpy_function``
    over the transport ``comm`` resolves to, with the deadline, header and diagnosis of
    :mod:`hvd_syncbn.comm`); refused inside XLA."""
    transports.refuse_xla(f"SyncBatchNormalization {name!r}")
    return _allreduce_sum(transports.resolve(comm, process_set, name), name, x, channel_count(x, axes))


def _kernels(xs: Sequence[tf.Tensor], axes: Sequence[int], eps: float, weight: Optional[tf.Tensor]):
    layout = _fused_layout(xs[0], axes) if weight is None else None
    return FusedKernels(axes, eps, layout) if layout else CompositeKernels(axes, eps, weight)


def _renorm_affine(renorm: Callable, gamma: Optional[tf.Tensor], beta: Optional[tf.Tensor], applied: dict):
    """Batch renormalization's ``affine(mean, var) -> (scale, offset)`` for the driver:
    ``y = (x̂·r + d)·γ + β`` with ``r`` and ``d`` constants of the gradient, as in Keras;
    ``applied`` receives ``r``, ``d`` and the scale, for the gradient."""

    def affine(mean: tf.Tensor, var: tf.Tensor):
        r, d = (tf.stop_gradient(tf.reshape(t, [-1])) for t in renorm(mean, var))
        scale, offset = (r, d) if gamma is None else (r * gamma, d * gamma)
        applied.update(r=r, d=d, scale=scale)
        return scale, offset if beta is None else offset + beta

    return affine


def _sync_normalize(
    xs: Sequence[tf.Tensor],
    gamma: Optional[tf.Tensor],
    beta: Optional[tf.Tensor],
    axes: Sequence[int],
    epsilon: float,
    name: str,
    reduce: backend.AllreduceSum,
    checks: backend.Checks,
    mask: Optional[tf.Tensor] = None,
    check_finite: bool = False,
    renorm: Optional[Callable[[tf.Tensor, tf.Tensor], Tuple[tf.Tensor, tf.Tensor]]] = None,
) -> Tuple[list, tf.Tensor, tf.Tensor, tf.Tensor]:
    """Normalise every part ``xs[i]`` (towers of one process) with the statistics of all
    parts on every rank (:func:`hvd_syncbn.backend.forward`), with a hand-written
    gradient (:func:`hvd_syncbn.backend.backward`). The parts' buffers are summed
    in-process, then one allreduce per direction crosses the ranks.

    ``reduce`` and ``checks``: the path's summing allreduce and check policy, the host's
    (:func:`host_reduce`, :class:`GraphChecks`) or the device's
    (:class:`~hvd_syncbn.tensorflow.device.GraphReducer`, deferred checks).
    ``renorm(mean, variance) -> (r, d)``, given the global statistics, turns this into
    batch renormalization (:func:`_renorm_affine`).

    Returns ``([y_i], mean, variance, count)``, the statistics global, biased and float64,
    ``count`` the global number of rows as ``(1,)``.

    Shape:
        - xs[i]: any rank, same channel dims; ``axes`` are the reduction axes.
        - gamma, beta: ``C`` elements in any shape; returned mean, variance: ``(C,)``.
        - mask: broadcastable to ``xs[0]`` (one part only); 0 leaves a position out of the statistics.

    With :class:`GraphChecks`, raises (as ``InvalidArgumentError`` in graphs) on a global
    batch of one row and, with ``check_finite``, on non-finite statistics, before
    anything downstream runs.
    """
    weight = None if mask is None else tf.cast(mask, xs[0].dtype)
    step = backend.Step(_ops, _kernels(xs, axes, epsilon, weight), reduce, checks, epsilon, name)
    parts = len(xs)
    params = [t if t.shape.rank == 1 else tf.reshape(t, [-1]) for t in (gamma, beta) if t is not None]

    @tf.custom_gradient
    def op(*inputs):
        xs, params = inputs[:parts], inputs[parts:]
        g = params[0] if gamma is not None else None
        b = params[-1] if beta is not None else None
        applied: dict = {}
        affine = None if renorm is None else _renorm_affine(renorm, g, b, applied)
        ys, (count, mean, var), stats = backend.forward(step, xs, g, b, check_finite, affine)

        def grad(*upstream):  # d(mean), d(variance), d(count) are not differentiated
            scale = applied.get("scale", g)
            dxs, sum_dy, sum_dy_xhat = backend.backward(step, upstream[:parts], xs, count, var, stats,
                                                        None if scale is None else _ops.wide(scale))
            dparams = []
            if g is not None:  # under renorm y = x̂·r·γ + d·γ + β
                r, d = (_ops.wide(applied[k]) for k in "rd") if renorm is not None else (None, None)
                dparams.append(sum_dy_xhat if renorm is None else r * sum_dy_xhat + d * sum_dy)
            if b is not None:
                dparams.append(sum_dy)
            return _first_order(name, *dxs, *(tf.cast(d, p.dtype) for d, p in zip(dparams, params)))

        return (*ys, mean, var, count), grad

    out = op(*xs, *params)
    return list(out[:parts]), out[parts], out[parts + 1], out[parts + 2]


def sync_batch_normalization(x, offset, scale, variance_epsilon, axis=-1, name="sync_batch_normalization",
                             process_set=None, comm=None):
    """``tf.nn.batch_normalization`` with the batch statistics computed for you, globally.

    The mean and variance are those of every row of ``x`` on every Horovod rank (and of
    every tower, when ``x`` is a list of per-tower tensors built in one graph, as in
    TF 1 multi-GPU code), so no tower or rank has to gather anything. Works in eager
    mode, ``tf.function`` and ``tf.compat.v1`` graphs.

    Args:
        x: a tensor, or a list of tower tensors with the same channel dims.
        offset: ``β`` (``C`` elements) or ``None``.
        scale: ``γ`` (``C`` elements) or ``None``.
        variance_epsilon: added to the variance.
        axis: the channel axis, or a list of them. Default: -1.
        name: the collective's name, the same on every rank, unique per call site.
        process_set: Horovod process set (or its ranks). Default: all ranks.
        comm: ``"horovod"``, ``"mpi"`` or ``"auto"``, as for :class:`SyncBatchNormalization`.

    Returns:
        ``(y, mean, variance)``: ``y`` like ``x`` (a list for a list); the global batch
        mean and biased variance, ``(C,)``, e.g. for moving averages.
    """
    parts = list(x) if isinstance(x, (list, tuple)) else [x]
    _, axes = _split_axes(len(parts[0].shape), axis, name)
    xs = [tf.convert_to_tensor(p) for p in parts]
    ys, mean, var, _ = _sync_normalize(xs, scale, offset, axes, variance_epsilon, name,
                                       host_reduce(name, xs[0], axes, process_set, comm), GraphChecks())
    mean, var = (tf.cast(v, ys[0].dtype) for v in (mean, var))
    return (ys if isinstance(x, (list, tuple)) else ys[0]), mean, var
