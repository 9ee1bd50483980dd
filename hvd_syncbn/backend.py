"""Framework-free core of synchronized batch normalization: the whole algorithm.

Forward, per layer and step, on every rank (with zero rows too):

1. local moments: ``count``, ``mean`` and biased ``var`` per channel
   (:func:`local_moments`, or an adapter's faster kernel for the same contract);
2. pack them into one float64 buffer (:mod:`hvd_syncbn.layout`: ``[−n, −n·mean, −n·(var + mean²)]``);
3. one summing allreduce of it (the adapter's, behind :mod:`hvd_syncbn.comm`'s header);
4. global moments ``N``, ``mean``, ``var`` (:func:`~hvd_syncbn.layout.unpack_moments`);
5. normalise ``y = γ·(x − mean)/√(var + ε) + β``, and update the running statistics
   from ``mean`` and :func:`unbiased` ``var`` by :func:`ema`, unless ``N = 0``.

Backward, with the statistics as constants:

1. local sums ``Σdy`` and ``Σdy·x̂`` per channel;
2. pack ``[Σdy, Σdy·x̂]`` (:mod:`hvd_syncbn.layout`); one summing allreduce;
3. ``dx = k·dy + s·x̂ + t`` with ``(k, s, t)`` from :func:`input_grad_coeffs`;
   ``dγ = Σdy·x̂`` and ``dβ = Σdy`` stay local (the optimizer's allreduce sums them).

The adapters (:mod:`hvd_syncbn.torch`, :mod:`hvd_syncbn.tensorflow`) hand in their tensor
ops as ``xp`` (:class:`ArrayOps`) and their ``allreduce_sum``.

Accuracy: the buffer's variance term ``Σx²/N − mean²`` in float64 loses about
``1e-16·(|mean|/std)²`` relative, far below what float32 data resolves. A local mean
rounded to float32 (``6e-8·|mean|``) enters the spread between ranks' means, so where
``|mean| > MEAN_RATIO_FOR_FLOAT64 · std`` (:func:`needs_float64`) a kernel's local
moments must be those of :func:`local_moments`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence, Tuple

import numpy as np

from hvd_syncbn.layout import pack_grad_sums, pack_moments, unpack_grad_sums, unpack_moments
from hvd_syncbn.validation import non_finite_message, single_row_message

Tensor = Any
AllreduceSum = Callable[[Tensor, str], Tensor]
"""``allreduce_sum(buffer, direction) -> buffer summed over the ranks``, supplied by an
adapter; ``direction`` is ``"fwd"`` or ``"bwd"``."""


class ArrayOps(Protocol):
    """The few framework ops the backend needs; arithmetic uses the tensors' operators."""

    def concat(self, parts: Sequence[Tensor]) -> Tensor: ...

    def wide(self, x: Tensor) -> Tensor:
        """``x`` as float64."""

    def maximum(self, x: Tensor, floor: float) -> Tensor: ...

    def sum(self, x: Tensor, axes: Sequence[int]) -> Tensor:
        """Sum over ``axes``, keeping them as size 1."""

    def flat(self, x: Tensor) -> Tensor:
        """``x`` as a 1-D tensor."""

    def rows(self, x: Tensor, axes: Sequence[int]) -> Tensor:
        """The product of ``x``'s sizes on ``axes``, as a float64 ``(1,)`` tensor."""

    def any(self, x: Tensor) -> Any:
        """Whether any element of the boolean ``x`` is true (a scalar of the framework)."""

    def where(self, cond: Tensor, a: Tensor, b: Any) -> Tensor:
        """``a`` where the boolean ``cond`` holds, else ``b`` (NaN in ``a`` included)."""

    def mul_no_nan(self, x: Tensor, y: Any) -> Tensor:
        """``x·y``, but 0 where ``y`` is 0, even where ``x`` is NaN or infinite."""

    def rsqrt(self, x: Tensor) -> Tensor:
        """``1/√x`` element-wise."""

    def all_finite(self, x: Tensor) -> Any:
        """Whether every element of ``x`` is finite (a boolean scalar of the framework)."""


class NumpyOps:
    """:class:`ArrayOps` for numpy arrays on the host."""

    concat = staticmethod(np.concatenate)
    maximum = staticmethod(np.maximum)
    any = staticmethod(np.any)
    flat = staticmethod(np.ravel)
    where = staticmethod(np.where)

    @staticmethod
    def mul_no_nan(x: np.ndarray, y: Any) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            return np.where(y == 0, 0.0, x * y)

    @staticmethod
    def rsqrt(x: np.ndarray) -> np.ndarray:
        return 1.0 / np.sqrt(x)

    @staticmethod
    def all_finite(x: np.ndarray) -> np.bool_:
        return np.isfinite(x).all()

    @staticmethod
    def wide(x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float64)

    @staticmethod
    def sum(x: np.ndarray, axes: Sequence[int]) -> np.ndarray:
        return np.sum(x, axis=tuple(axes), keepdims=True)

    @staticmethod
    def rows(x: np.ndarray, axes: Sequence[int]) -> np.ndarray:
        return np.array([np.prod([x.shape[a] for a in axes])], dtype=np.float64)


NUMPY_OPS = NumpyOps()

MEAN_RATIO_FOR_FLOAT64 = 100.0


def local_moments(xp: ArrayOps, x: Tensor, axes: Sequence[int],
                  weights: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """The reference local moments: count, mean and biased variance per channel.

    Two passes in float64: the mean, then the variance of the centred values, so both
    are float64-accurate whatever the offset. No rows give count 0 and zeros; one row a
    variance of 0; NaN or Inf propagate to their channels.

    Args:
        xp: the adapter's :class:`ArrayOps`.
        x: the input, any rank; ``axes`` are the reduced (non-channel) axes.
        weights: 0/1 per position, the shape of ``x``; 0 leaves it out. Default: all 1.

    Shape:
        - Returns ``(1,)``, ``(C,)``, ``(C,)``, float64, with ``C`` the product of the
          sizes of the axes not in ``axes``.
    """
    x = xp.wide(x)
    count = xp.rows(x, axes) if weights is None else xp.flat(xp.sum(xp.wide(weights), axes))[:1]
    safe = xp.maximum(count, 1.0)
    kept = None if weights is None else weights > 0
    mean = xp.sum(x if kept is None else xp.where(kept, x, 0.0), axes) / safe
    centred = x - mean if kept is None else xp.where(kept, x - mean, 0.0)  # a masked NaN stays out
    return count, xp.flat(mean), xp.flat(xp.sum(centred * centred, axes) / safe)


def needs_float64(xp: ArrayOps, mean: Tensor, var: Tensor) -> Any:
    """Whether a float32 local mean is too coarse for the global variance on some
    channel: ``|mean| > MEAN_RATIO_FOR_FLOAT64 · std``, where its rounding error
    ``6e-8·|mean|`` shifts the global variance by more than 1e-5 relative. A framework
    boolean scalar (``xp.any``)."""
    return xp.any(mean * mean > (MEAN_RATIO_FOR_FLOAT64**2) * var)


def sync_moments(
    xp: ArrayOps,
    allreduce_sum: AllreduceSum,
    count: Tensor,
    mean: Tensor,
    var: Tensor,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Global count, mean and biased variance from every rank's local moments.

    One allreduce of one float64 buffer (:func:`~hvd_syncbn.layout.pack_moments`). A rank with
    no rows passes ``count = 0`` and zeros for ``mean`` and ``var``; it still joins.

    Args:
        xp: the adapter's :class:`ArrayOps`.
        allreduce_sum: the adapter's summing allreduce.
        count: local row count per channel, as a 1-element tensor.
        mean: local per-channel mean.
        var: local per-channel biased variance.

    Shape:
        - count: ``(1,)``; mean, var: ``(C,)``.
        - Returns ``(1,)``, ``(C,)``, ``(C,)``, float64.
    """
    return unpack_moments(xp, allreduce_sum(pack_moments(xp, count, mean, var), "fwd"))


def sync_grad_sums(xp: ArrayOps, allreduce_sum: AllreduceSum, sum_dy: Tensor,
                   sum_dy_xhat: Tensor) -> Tuple[Tensor, Tensor]:
    """Global ``Σdy`` and ``Σdy·x̂`` per channel, with one allreduce of ``(2C,)``."""
    return unpack_grad_sums(allreduce_sum(pack_grad_sums(xp, sum_dy, sum_dy_xhat), "bwd"))


def input_grad_coeffs(
    xp: ArrayOps, count: Tensor, invstd: Tensor, weight: Tensor | None, sum_dy: Tensor, sum_dy_xhat: Tensor
) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-channel ``(k, s, t)`` with ``dx = k·dy + s·x̂ + t``.

    From ``y = w·x̂ + b`` with global statistics:
    ``dx = w·invstd·(dy − Σdy/N − x̂·Σ(dy·x̂)/N)``, the sums taken over all ranks
    (``s = t = 0`` for an empty global batch, which has no ``dx``).

    Shape:
        - count: ``(1,)``; every other argument and result: ``(C,)``.
    """
    k = invstd if weight is None else weight * invstd
    safe = xp.maximum(count, 1.0)
    return k, -k * sum_dy_xhat / safe, -k * sum_dy / safe


def unbiased(var: Tensor, count: Tensor) -> Tensor:
    """Unbiased variance ``var·N/(N−1)`` from the biased one and the global count (N > 1)."""
    return var * (count / (count - 1))


def ema(old: Tensor, new: Tensor, old_weight: Any) -> Tensor:
    """Moving average with ``old_weight`` the weight on the old value (Keras's ``momentum``;
    PyTorch's ``momentum`` is ``1 − old_weight``)."""
    return old * old_weight + new * (1.0 - old_weight)


class Kernels(Protocol):
    """One framework path's passes over the data, the statistics bound to a layout and
    ``eps``. ``stats`` is what :meth:`prepare` makes of the global mean and variance
    (e.g. tensors in the data's accumulation dtype); per-channel vectors are ``(C,)``."""

    def moments(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Local ``(count, mean, var)`` of ``x``, as :func:`local_moments`."""

    def prepare(self, mean: Tensor, var: Tensor) -> Any:
        """The global statistics in the form the other passes take."""

    def normalize(self, x: Tensor, stats: Any, scale: Optional[Tensor], offset: Optional[Tensor]) -> Tensor:
        """``scale·x̂ + offset`` with ``x̂ = (x − mean)/√(var + ε)`` (``None``: 1 and 0)."""

    def grad_sums(self, dy: Tensor, x: Tensor, stats: Any, scale: Optional[Tensor]) -> Tuple[Tensor, Tensor, Any]:
        """Local ``(Σdy, Σdy·x̂)`` per channel, float64 in ``xp``, and whatever of this pass
        :meth:`input_grad` can reuse (``scale``, as :func:`backward` has it, lets a fused
        kernel compute ``k·dy`` here)."""

    def input_grad(self, dy: Tensor, x: Tensor, stats: Any, coeffs: Tuple[Tensor, Tensor, Tensor],
                   kept: Any) -> Tensor:
        """``k·dy + s·x̂ + t`` for ``coeffs = (k, s, t)``; ``kept``: from :meth:`grad_sums`."""


class Checks(Protocol):
    """How a failed check of the global batch fails: at once (raise) or deferred (a flag
    for the caller, or a graph assertion)."""

    def require(self, ok: Any, check: str, message: str) -> None:
        """Fail ``check`` (``"single_row"`` or ``"non_finite"``) with ``message`` unless ``ok``."""

    def after(self, values: Sequence[Tensor]) -> Sequence[Tensor]:
        """``values``, ordered after the checks (graph frameworks) or as they are."""


class Setup(NamedTuple):
    """What a framework path hands the driver: its ops, kernels, summing allreduce,
    check policy, and the layer's ``eps`` and name."""

    xp: ArrayOps
    kernels: Kernels
    reduce: AllreduceSum
    checks: Checks
    eps: float
    name: str


def forward(setup: Setup, parts: Sequence[Tensor], scale: Optional[Tensor], offset: Optional[Tensor],
            check_finite: bool = False, affine: Optional[Callable] = None) -> Tuple[list, Tuple, Any]:
    """Normalise every part (rows of this process) with the statistics of all parts on
    every rank: local moments, one allreduce, the checks, normalise.

    ``affine(mean, var) -> (scale, offset)`` replaces the given ones from the global
    statistics (batch renormalization).

    Returns ``(ys, (count, mean, var), stats)``: the outputs, the global statistics (the
    variance biased; ``count`` ``(1,)``) and the kernels' prepared statistics, for
    :func:`backward`.
    """
    xp, kernels = setup.xp, setup.kernels
    local = [pack_moments(xp, *kernels.moments(x)) for x in parts]
    total, mean, var = unpack_moments(xp, setup.reduce(_add(local), "fwd"))
    setup.checks.require(total[0] != 1, "single_row", single_row_message(setup.name))
    if check_finite:
        setup.checks.require(xp.all_finite(mean) & xp.all_finite(var), "non_finite", non_finite_message(setup.name))
    total, mean, var = setup.checks.after([total, mean, var])
    if affine is not None:
        scale, offset = affine(mean, var)
    stats = kernels.prepare(mean, var)
    return [kernels.normalize(x, stats, scale, offset) for x in parts], (total, mean, var), stats


def backward(setup: Setup, dys: Sequence[Tensor], parts: Sequence[Tensor], count: Tensor, var: Tensor, stats: Any,
             scale: Optional[Tensor], input_grad: bool = True) -> Tuple[Optional[list], Tensor, Tensor]:
    """The input gradients with the statistics as constants: local sums, one allreduce,
    ``dx = k·dy + s·x̂ + t`` (:func:`input_grad_coeffs`). ``scale``: the ``γ`` applied to
    ``x̂``, float64 in ``xp`` (``None``: 1).

    Returns ``(dxs or None, Σdy, Σdy·x̂)``, the sums over this process's parts (``dβ``
    and ``dγ``: they stay local).
    """
    xp, kernels = setup.xp, setup.kernels
    sums = [kernels.grad_sums(dy, x, stats, scale) for dy, x in zip(dys, parts)]
    sum_dy, sum_dy_xhat = _add([s[0] for s in sums]), _add([s[1] for s in sums])
    if not input_grad:
        return None, sum_dy, sum_dy_xhat
    g_dy, g_dy_xhat = sync_grad_sums(xp, setup.reduce, sum_dy, sum_dy_xhat)
    coeffs = input_grad_coeffs(xp, count, xp.rsqrt(var + setup.eps), scale, g_dy, g_dy_xhat)
    dxs = [kernels.input_grad(dy, x, stats, coeffs, kept) for dy, x, (_, _, kept) in zip(dys, parts, sums)]
    return dxs, sum_dy, sum_dy_xhat


def running_update(xp: ArrayOps, olds: Sequence[Tensor], news: Sequence[Tensor], old_weight: Any,
                   updated: Any) -> list:
    """The running-statistics rule: each ``old`` becomes :func:`ema` of it and ``new``
    where ``updated`` (the global batch had rows and passed its checks), else stays
    (whatever ``new`` holds: a flagged step's may be NaN). ``updated`` is a framework
    boolean scalar, or a Python or numpy one where the host knows it (then no select is
    made); ``old_weight`` a scalar in the buffers' dtype, or a number where ``xp.where``
    takes one."""
    if isinstance(updated, (bool, np.bool_)):
        return [ema(old, new, old_weight) if updated else old for old, new in zip(olds, news)]
    # One scalar select, not one per buffer: weight 1 keeps the old value (a graph pays per op).
    weight = xp.where(updated, old_weight, 1.0)
    return [old * weight + xp.mul_no_nan(new, 1.0 - weight) for old, new in zip(olds, news)]


def _add(terms: Sequence[Tensor]) -> Tensor:
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total
