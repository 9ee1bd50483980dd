"""Keras 3 / TensorFlow SyncBatchNormalization over Horovod, and its functional op.

Same backend as the PyTorch adapter: one packed allreduce forward, one backward.
float32 inputs with the channels right after the batch or last (the common layouts)
normalise, and take their gradient sums, through TF's fused batch-norm kernels given the
global statistics; other inputs use composite ops.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from hvd_syncbn import backend
from hvd_syncbn import comm as transport
from hvd_syncbn.tensorflow import comm as tf_comm


class _TFOps:
    """The tensor ops :mod:`hvd_syncbn.backend` needs, for TensorFlow."""

    @staticmethod
    def concat(parts: Sequence[tf.Tensor]) -> tf.Tensor:
        return tf.concat(list(parts), axis=0)

    @staticmethod
    def wide(x: tf.Tensor) -> tf.Tensor:
        return tf.cast(x, tf.float64)

    @staticmethod
    def maximum(x: tf.Tensor, floor: float) -> tf.Tensor:
        return tf.maximum(x, tf.cast(floor, x.dtype))


_ops = _TFOps()


def _allreduce_sum(comm: Optional[transport.Communicator], layer: str, x: tf.Tensor, channels: int):
    """Sum over the ranks of ``comm`` (nothing to do if ``None``) and, inside a
    ``tf.distribute`` replica context, over the in-process replicas first (one
    cross-rank collective per process). ``x`` and ``channels`` identify the call."""
    ndim, dtype = len(x.shape), x.dtype.name

    def over_ranks(buf: tf.Tensor, name: str) -> tf.Tensor:
        if comm is None:
            return buf
        direction = name.rsplit(".", 1)[-1]

        def run(b: np.ndarray) -> np.ndarray:
            call = transport.Call(layer, direction, transport.next_step(layer, direction), channels, ndim, dtype)
            return transport.allreduce(comm, b, call, name)

        out = tf.numpy_function(run, [tf.cast(buf, tf.float64)], tf.float64, stateful=True, name="hvd_syncbn_allreduce")
        return tf.cast(tf.reshape(out, buf.shape), buf.dtype)

    def allreduce_sum(buf: tf.Tensor, name: str) -> tf.Tensor:
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return over_ranks(buf, name)
        buf = ctx.all_reduce(tf.distribute.ReduceOp.SUM, buf)  # every replica: the process sum

        def merge(strategy, summed):
            return over_ranks(strategy.experimental_local_results(summed)[0], name)

        return ctx.merge_call(merge, args=(buf,))

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


def _fused_moments(x: tf.Tensor, axes: Sequence[int], x4: tf.Tensor, fmt: str):
    """:func:`_local_moments` of ``x`` from one call of the fused kernel on ``x4`` (its 4D
    view), which also writes a normalised output that this discards: 1.0 ms against the
    composite ops' 2.7 ms on (2, 64, 64, 256), measured.

    The kernel's float32 mean is exact enough unless ``|mean| > 100·std`` on some channel
    (:func:`hvd_syncbn.backend.mean_needs_float64`); then the shifted sums run instead.
    """
    channel = 3 if fmt == "NHWC" else 1
    ones = tf.ones(tf.shape(x4)[channel:channel + 1], x4.dtype)
    count = tf.cast(tf.size(x4), x4.dtype) / tf.cast(tf.size(ones), x4.dtype)
    # batch_variance is the unbiased one: n/(n−1), or 1 for n ≤ 1; no rows give NaN.
    # epsilon only touches the normalised output, which this call discards.
    _, mean, var, _, _, _ = tf.raw_ops.FusedBatchNormV3(
        x=x4, scale=ones, offset=tf.zeros_like(ones), mean=tf.zeros([0], x4.dtype), variance=tf.zeros([0], x4.dtype),
        epsilon=1.0, is_training=True, data_format=fmt)
    some = count > 0
    mean = tf.where(some, mean, 0.0)
    var = tf.where(some, var * (tf.maximum(count, 1.0) - 1.0) / tf.maximum(count, 1.0), 0.0)
    ratio = backend.MEAN_RATIO_FOR_FLOAT64
    return tf.cond(tf.reduce_any(mean * mean > ratio * ratio * var),
                   lambda: _local_moments(x, axes, None),
                   lambda: (tf.fill([1], count), tf.cast(mean, tf.float64), var))


def _split_axes(ndim: int, axis: Any, layer: str) -> Tuple[list, list]:
    """``(channel axes, reduction axes)``, sorted and non-negative, of an ``ndim`` input
    whose channels are ``axis`` (an int or a list of ints)."""
    axes = [axis] if isinstance(axis, int) else list(axis)
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"{layer}: axis {a} is out of range for a {ndim}D input")
    channel = sorted({a % ndim for a in axes})
    return channel, [a for a in range(ndim) if a not in channel]


def _channel_dims(x: tf.Tensor, axes: Sequence[int]) -> tf.Tensor:
    shape = tf.shape(x)
    return tf.stack([shape[a] for a in range(len(x.shape)) if a not in axes])


def _keep(v: tf.Tensor, x: tf.Tensor, axes: Sequence[int]) -> tf.Tensor:
    """A flat per-channel ``(C,)`` vector shaped to broadcast against ``x``."""
    return tf.reshape(v, [1 if a in axes else x.shape[a] for a in range(len(x.shape))])


def _scale_shift(xhat: tf.Tensor, gamma: Optional[tf.Tensor], beta: Optional[tf.Tensor],
                 axes: Sequence[int]) -> tf.Tensor:
    """``γ·x̂ + β`` for flat ``(C,)`` ``γ``, ``β`` (either may be ``None``)."""
    y = xhat if gamma is None else xhat * _keep(gamma, xhat, axes)
    return y if beta is None else y + _keep(beta, xhat, axes)


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


def _sync_normalize(
    xs: Sequence[tf.Tensor],
    gamma: Optional[tf.Tensor],
    beta: Optional[tf.Tensor],
    axes: Sequence[int],
    epsilon: float,
    name: str,
    process_set: Any = None,
    masks: Optional[Sequence[Optional[tf.Tensor]]] = None,
    comm: Optional[str] = None,
    check_finite: bool = False,
    renorm: Optional[Callable[[tf.Tensor, tf.Tensor], Tuple[tf.Tensor, tf.Tensor]]] = None,
) -> Tuple[list, tf.Tensor, tf.Tensor, tf.Tensor]:
    """Normalise every part ``xs[i]`` (towers of one process) with the statistics of all
    parts on every rank. The parts' buffers are summed in-process, then one allreduce
    per direction crosses the ranks; the gradient is written by hand.

    ``renorm(mean, variance) -> (r, d)``, given the global statistics, turns this into
    batch renormalization: ``y = (x̂·r + d)·γ + β`` with ``r`` and ``d`` constants of
    the gradient, as in Keras.

    Returns ``([y_i], mean, variance, count)``, the statistics global and biased,
    ``count`` the global number of rows as ``(1,)``.

    Shape:
        - xs[i]: any rank, same channel dims; ``axes`` are the reduction axes.
        - gamma, beta: ``C`` elements in any shape; returned mean, variance: ``(C,)``.
        - masks[i]: broadcastable to ``xs[i]``; 0 leaves a position out of the statistics.

    Raises (as ``InvalidArgumentError`` in graphs) on a global batch of one row and, with
    ``check_finite``, on non-finite statistics, before anything downstream runs.
    """
    channels = int(np.prod([d or -1 for a, d in enumerate(xs[0].shape) if a not in axes]))
    allreduce = _allreduce_sum(tf_comm.resolve(comm, process_set, name), name, xs[0], channels)
    parts = len(xs)
    weights = [None if m is None else tf.cast(m, x.dtype) for x, m in zip(xs, masks or [None] * parts)]
    params = [tf.reshape(t, [-1]) for t in (gamma, beta) if t is not None]
    fused = _fused_layout(xs[0], axes) if all(w is None for w in weights) else None

    @tf.custom_gradient
    def _fn(*inputs):
        xs, params = inputs[:parts], inputs[parts:]
        g = params[0] if gamma is not None else None
        b = params[-1] if beta is not None else None
        if fused:
            to_fused, fmt = fused
            x4s = [to_fused(x) for x in xs]
            moments = [_fused_moments(x, axes, x4, fmt) for x, x4 in zip(xs, x4s)]
        else:
            moments = [_local_moments(x, axes, w) for x, w in zip(xs, weights)]
        local = [backend.pack_moments(_ops, *m) for m in moments]
        total, mean, var = backend.unpack_moments(
            _ops, allreduce(tf.add_n(local), backend.collective_name(name, "fwd"))
        )
        # A string-only Assert is a plain op; assert_none_equal would add a cond per layer.
        checks = [tf.debugging.Assert(tf.reduce_all(tf.not_equal(total, 1.0)), [backend.single_row_message(name)])]
        if check_finite:
            checks.append(tf.debugging.assert_all_finite(mean + var, backend.non_finite_message(name)))
        with tf.control_dependencies(checks):  # nothing downstream (updates included) runs first
            total, mean, var = (tf.identity(t) for t in (total, mean, var))
        dtype = xs[0].dtype
        total, mean, var = (tf.cast(t, dtype) for t in (total, mean, var))
        invstd = tf.math.rsqrt(var + epsilon)
        scale, offset = g, b  # of x̂: γ and β, or with renorm r·γ and d·γ + β
        if renorm is not None:
            r, d = (tf.stop_gradient(tf.reshape(t, [-1])) for t in renorm(mean, var))
            scale, offset = (r, d) if g is None else (r * g, d * g)
            offset = offset if b is None else offset + b
        if fused:  # one kernel pass forward, one (plus one for the global terms) backward
            ones = tf.ones_like(mean) if scale is None else scale
            zeros = tf.zeros_like(mean) if offset is None else offset
            ys = [_like(_fused_affine(x4, mean, var, epsilon, ones, zeros, fmt), x) for x, x4 in zip(xs, x4s)]
        else:
            xhats = [(x - _keep(mean, x, axes)) * _keep(invstd, x, axes) for x in xs]
            ys = [_scale_shift(xhat, scale, offset, axes) for xhat in xhats]

        def grad(*upstream):
            dys = upstream[:parts]  # the rest are d(mean), d(variance), d(count): not differentiated
            if fused:
                # With the statistics as constants the kernel gives k·dy, Σdy·x̂ and Σdy.
                kernel = [tf.raw_ops.FusedBatchNormGradV3(
                    y_backprop=to_fused(dy), x=x4, scale=ones, reserve_space_1=mean, reserve_space_2=var,
                    reserve_space_3=tf.zeros([0], dtype), epsilon=epsilon, is_training=False, data_format=fmt)[:3]
                    for dy, x4 in zip(dys, x4s)]
                sums = [(db, dg) for _, dg, db in kernel]
            else:
                # Masked positions are normalised too: their dy enters every sum, while
                # only unmasked positions moved the statistics (hence ``w`` below).
                sums = [(_sum(dy, axes), _sum(dy * xhat, axes)) for dy, xhat in zip(dys, xhats)]
            g_dy, g_dy_xhat = backend.unpack_grad_sums(allreduce(
                tf.add_n([backend.pack_grad_sums(_ops, *s) for s in sums]), backend.collective_name(name, "bwd")
            ))
            k, s, t = backend.input_grad_coeffs(total, invstd, scale, g_dy, g_dy_xhat)
            if fused:  # dx = k·dy + (s·x̂ + t), the bracket one more kernel pass
                dxs = [_like(k_dy + _fused_affine(x4, mean, var, epsilon, s, t, fmt), x)
                       for x, x4, (k_dy, _, _) in zip(xs, x4s, kernel)]
            else:
                dxs = []
                for x, xhat, dy, w in zip(xs, xhats, dys, weights):
                    stat = _keep(s, x, axes) * xhat + _keep(t, x, axes)
                    dxs.append(_keep(k, x, axes) * dy + (stat if w is None else stat * w))
            dparams = []
            sum_dy, sum_dy_xhat = (tf.add_n([s[i] for s in sums]) for i in (0, 1))
            if g is not None:  # under renorm y = x̂·r·γ + d·γ + β
                dparams.append(sum_dy_xhat if renorm is None else r * sum_dy_xhat + d * sum_dy)
            if b is not None:
                dparams.append(sum_dy)
            return _first_order(name, *dxs, *dparams)

        return (*ys, mean, var, total), grad

    out = _fn(*xs, *params)
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
    ys, mean, var, _ = _sync_normalize([tf.convert_to_tensor(p) for p in parts], scale, offset, axes,
                                    variance_epsilon, name, process_set, comm=comm)
    return (ys if isinstance(x, (list, tuple)) else ys[0]), mean, var


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
        synchronized: accepted for config compatibility; this layer always synchronises.
        process_set: Horovod process set (or its ranks) to synchronise within.
            Default: all ranks.
        comm: how statistics travel: ``"horovod"``, ``"mpi"`` (mpi4py, under mpirun) or
            ``"auto"`` (MPI under mpirun with mpi4py, else Horovod). Default:
            ``$HVD_SYNCBN_COMM``, else ``"auto"``. When ranks disagree, every rank
            raises :class:`~hvd_syncbn.comm.SyncBatchNormError` within the timeout.
        check_finite: raise (before any update) when the global statistics are not
            finite, i.e. NaN/Inf in some rank's input. Default: ``False``: NaN/Inf
            propagate as in ``keras.layers.BatchNormalization``.
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
                 process_set=None, comm=None, check_finite=False, **kwargs):
        axes = [axis] if isinstance(axis, int) else [int(a) for a in axis]
        if not axes:
            raise ValueError(f"SyncBatchNormalization: expected an axis or a non-empty list of axes, got {axis!r}")
        backend.check_args("SyncBatchNormalization", float(epsilon), momentum, eps_name="epsilon")
        super().__init__(axes[0], momentum, epsilon, *args, **kwargs)
        self.axis = axis if isinstance(axis, int) else axes
        self.process_set = process_set
        self.comm = comm
        self.check_finite = bool(check_finite)
        transport.requested_kind(comm)

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
                backend.check_input(self.name, shape, a, size, inputs.dtype.is_floating, inputs.dtype.name,
                                    "tf.cast(x, tf.float32)")
        except ValueError as e:
            return str(e)
        return ""

    def _fail_everywhere(self, inputs, problem: str) -> None:
        """Raise ``problem``; in training with peers, after joining the forward collective
        with a poisoned header, so that every rank raises it instead of waiting."""
        comm = tf_comm.resolve(self.comm, self.process_set, self.name)
        if comm is not None:
            channels = int(np.prod(list(self._channels.values())))
            call = transport.Call(self.name, "fwd", transport.next_step(self.name, "fwd"), channels,
                                  len(inputs.shape), inputs.dtype.name)
            transport.poison(comm, call, backend.collective_name(self.name, "fwd"), problem)
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
            (y,), mean, var, total = _sync_normalize(
                [x], gamma, beta, axes, self.epsilon, self.name, self.process_set, [mask], self.comm,
                self.check_finite, self._renorm_correction if self.renorm else None,
            )
            # Renorm's updates wait for the output: in a tf.function, its reads of renorm_mean
            # and renorm_stddev (inside the custom gradient) are not otherwise ordered first.
            with tf.control_dependencies([y] if self.renorm else []):
                self._update_moving(mean, var, total[0] > 0)
        else:  # multi-axis inference
            mean, var = (tf.cast(v, x.dtype) for v in (self.moving_mean, self.moving_variance))
            xhat = (x - _keep(mean, x, axes)) * _keep(tf.math.rsqrt(var + self.epsilon), x, axes)
            y = _scale_shift(xhat, gamma, beta, axes)
        return tf.cast(y, self.compute_dtype)

    def _renorm_correction(self, mean: tf.Tensor, var: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        """Batch renormalization's ``(r, d)`` from the global statistics, by Keras's own
        code (which reads ``renorm_mean``, ``renorm_stddev`` and ``renorm_clipping``)."""
        shape = self.renorm_mean.shape
        r, d, _, _ = self._renorm_correction_and_moments(tf.reshape(mean, shape), tf.reshape(var, shape))
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
        for moving, new, keep in updates:
            new = tf.cast(tf.reshape(new, moving.shape), moving.dtype)
            moving.assign(tf.where(some, backend.ema(moving, new, tf.cast(keep, moving.dtype)), moving))
        if self.renorm:  # Keras derives the variance from the standard deviation
            self.moving_variance.assign(tf.where(
                some, tf.nn.relu(tf.square(self.moving_stddev) - self.epsilon), self.moving_variance))

    def get_config(self):
        config = super().get_config()
        ps = self.process_set
        config["process_set"] = ps.ranks if hasattr(ps, "ranks") else ps
        config["comm"] = None if isinstance(self.comm, transport.Communicator) else self.comm
        config["check_finite"] = self.check_finite
        return config
