"""Synchronized batch normalization as a TensorFlow op: the algorithm of
:mod:`hvd_syncbn.backend` with a hand-written gradient, for the Keras layer and for
``tf.nn``-style code.

float32 inputs with the channels right after the batch or last (the common layouts)
normalise, and take their gradient sums, through TF's fused batch-norm kernels given the
global statistics; other inputs use composite ops (both in :mod:`hvd_syncbn.tensorflow.kernels`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from hvd_syncbn import backend
from hvd_syncbn.comm import allreduce
from hvd_syncbn.communicator import Communicator
from hvd_syncbn.identity import make_call
from hvd_syncbn.tensorflow import transports
from hvd_syncbn.tensorflow.kernels import TF_OPS, choose_kernels


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


def _split_axes(ndim: int, axis: Any, layer: str) -> Tuple[list, list]:
    """``(channel axes, reduction axes)``, sorted and non-negative, of an ``ndim`` input
    whose channels are ``axis`` (an int or a list of ints)."""
    axes = [axis] if isinstance(axis, int) else list(axis)
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"{layer}: axis {a} is out of range for a {ndim}D input")
    channel = sorted({a % ndim for a in axes})
    return channel, [a for a in range(ndim) if a not in channel]


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


def host_reduce(name: str, x: tf.Tensor, axes: Sequence[int], process_set: Any, comm: Any,
                group_size: Any = None) -> backend.AllreduceSum:
    """The host path's summing allreduce for the statistics of ``x`` (``tf.numpy_function``
    over the transport ``comm`` resolves to, with the deadline, header and diagnosis of
    :mod:`hvd_syncbn.comm`); refused inside XLA."""
    transports.refuse_xla(f"SyncBatchNormalization {name!r}")
    return _allreduce_sum(transports.resolve(comm, process_set, name, group_size), name, x, channel_count(x, axes))


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
    setup = backend.Setup(TF_OPS, choose_kernels(xs, axes, epsilon, weight), reduce, checks, epsilon, name)
    parts = len(xs)
    params = [t if t.shape.rank == 1 else tf.reshape(t, [-1]) for t in (gamma, beta) if t is not None]
    op = _normalize_op(setup, parts, gamma is not None, beta is not None, check_finite, renorm, name)
    out = op(*xs, *params)
    return list(out[:parts]), out[parts], out[parts + 1], out[parts + 2]


def _normalize_op(setup: backend.Setup, parts: int, has_gamma: bool, has_beta: bool, check_finite: bool,
                  renorm: Optional[Callable], name: str) -> Callable:
    """:func:`_sync_normalize`'s op, ``op(*xs, *params) -> (*ys, mean, variance, count)``
    (``params``: ``γ`` and ``β`` as flat vectors, those given), with its hand-written gradient."""

    @tf.custom_gradient
    def op(*inputs):
        xs, params = inputs[:parts], inputs[parts:]
        g = params[0] if has_gamma else None
        b = params[-1] if has_beta else None
        applied: dict = {}
        affine = None if renorm is None else _renorm_affine(renorm, g, b, applied)
        ys, (count, mean, var), stats = backend.forward(setup, xs, g, b, check_finite, affine)

        def grad(*upstream):  # d(mean), d(variance), d(count) are not differentiated
            scale = applied.get("scale", g)
            dxs, sum_dy, sum_dy_xhat = backend.backward(setup, upstream[:parts], xs, count, var, stats,
                                                        None if scale is None else TF_OPS.wide(scale))
            dparams = _param_grads(g, b, applied if renorm is not None else None, sum_dy, sum_dy_xhat)
            return _first_order(name, *dxs, *(tf.cast(d, p.dtype) for d, p in zip(dparams, params)))

        return (*ys, mean, var, count), grad

    return op


def _param_grads(gamma: Optional[tf.Tensor], beta: Optional[tf.Tensor], renormed: Optional[dict],
                 sum_dy: tf.Tensor, sum_dy_xhat: tf.Tensor) -> list:
    """The gradients of ``γ`` and ``β`` (those given, in that order), float64, from the
    global sums ``Σdy`` and ``Σdy·x̂``; under batch renormalization ``renormed`` holds
    its ``r`` and ``d``, and ``y = x̂·r·γ + d·γ + β``."""
    grads = []
    if gamma is not None:
        if renormed is None:
            grads.append(sum_dy_xhat)
        else:
            r, d = (TF_OPS.wide(renormed[k]) for k in "rd")
            grads.append(r * sum_dy_xhat + d * sum_dy)
    if beta is not None:
        grads.append(sum_dy)
    return grads


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
