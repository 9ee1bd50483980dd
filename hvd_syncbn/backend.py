"""Framework-free core of synchronized batch normalization.

Every rank packs per-channel ``[count, Σx, Σx²]`` into one buffer and sums it with one
allreduce in the forward pass; the backward pass does the same with ``[Σdy, Σdy·x̂]``.
The adapters (:mod:`hvd_syncbn.torch`, :mod:`hvd_syncbn.tensorflow`) hand in their
tensor ops as ``xp`` and their ``allreduce_sum``; all shared math lives here.

Numerics: each rank computes its local mean and biased variance with its framework's
stable kernel; the buffer holds ``n·mean`` and ``n·(var + mean²)`` in float64, so the
global variance ``Σx²/N − mean²`` loses about ``1e-16·(|mean|/std)²`` relative accuracy
(``1e-6`` at mean 1e4, std 0.1), far below what float32 data can resolve. One more
error source is the local mean's own float32 rounding (``6e-8·|mean|``), which enters
the spread *between* ranks' means; where ``|mean| > MEAN_RATIO_FOR_FLOAT64 · std`` the
adapters recompute the local mean in float64 (one more pass over that layer's input).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, Tuple

import numpy as np

Tensor = Any
AllreduceSum = Callable[[Tensor, str], Tensor]
"""``allreduce_sum(buffer, name) -> buffer summed over the ranks``, supplied by an adapter."""


class ArrayOps(Protocol):
    """The few framework ops the backend needs; arithmetic uses the tensors' operators."""

    def concat(self, parts: Sequence[Tensor]) -> Tensor: ...

    def wide(self, x: Tensor) -> Tensor: ...

    def maximum(self, x: Tensor, floor: float) -> Tensor: ...


class NumpyOps:
    """:class:`ArrayOps` for numpy arrays on the host."""

    @staticmethod
    def concat(parts: Sequence[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts)

    @staticmethod
    def wide(x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float64)

    @staticmethod
    def maximum(x: np.ndarray, floor: float) -> np.ndarray:
        return np.maximum(x, floor)


NUMPY_OPS = NumpyOps()

MEAN_RATIO_FOR_FLOAT64 = 100.0


def mean_needs_float64(mean: Tensor, var: Tensor) -> bool:
    """Whether a float32 local mean is too coarse for the global variance.

    Its rounding error ``ε·|mean|`` (ε = 6e-8) shifts the global variance by about
    ``ε·|mean|/std`` relative; above a ratio of 100 that passes 1e-5.
    """
    return bool(((mean * mean) > (MEAN_RATIO_FOR_FLOAT64**2) * var).any())


def collective_name(layer: str, direction: str) -> str:
    """Horovod name of a layer's collective: deterministic, unique, and readable.

    Args:
        layer: the layer's name, identical on every rank (e.g. ``layer1.0.bn1``).
        direction: ``"fwd"`` or ``"bwd"``.
    """
    return f"hvd_syncbn.{layer}.{direction}"


def pack_moments(xp: ArrayOps, count: Tensor, mean: Tensor, var: Tensor) -> Tensor:
    """One float64 buffer ``[n, n·mean, n·(var + mean²)]`` of local moments.

    Buffers of several parts (towers, replicas, ranks) combine by summing.

    Shape:
        - count: ``(1,)``; mean, var: ``(C,)``; returns ``(2C+1,)``.
    """
    n, m, v = xp.wide(count), xp.wide(mean), xp.wide(var)
    return xp.concat([n, n * m, n * (v + m * m)])


def unpack_moments(xp: ArrayOps, buf: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Count, mean and biased variance (clamped at 0) of a summed :func:`pack_moments` buffer."""
    channels = (buf.shape[0] - 1) // 2
    total = buf[0:1]
    safe = xp.maximum(total, 1.0)
    mean = buf[1 : channels + 1] / safe
    var = xp.maximum(buf[channels + 1 :] / safe - mean * mean, 0.0)
    return total, mean, var


def sync_moments(
    xp: ArrayOps,
    allreduce_sum: AllreduceSum,
    name: str,
    count: Tensor,
    mean: Tensor,
    var: Tensor,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Global count, mean and biased variance from every rank's local moments.

    One allreduce of one float64 buffer ``[n, n·mean, n·(var + mean²)]``. A rank with
    no rows passes ``count = 0`` and zeros for ``mean`` and ``var``; it still joins.

    Args:
        xp: the adapter's :class:`ArrayOps`.
        allreduce_sum: the adapter's summing allreduce.
        name: the collective's name (see :func:`collective_name`).
        count: local row count per channel, as a 1-element tensor.
        mean: local per-channel mean.
        var: local per-channel biased variance.

    Shape:
        - count: ``(1,)``; mean, var: ``(C,)``.
        - Returns ``(1,)``, ``(C,)``, ``(C,)``, float64.
    """
    return unpack_moments(xp, allreduce_sum(pack_moments(xp, count, mean, var), name))


def pack_grad_sums(xp: ArrayOps, sum_dy: Tensor, sum_dy_xhat: Tensor) -> Tensor:
    """One buffer ``[Σdy, Σdy·x̂]``, ``(2C,)``; buffers of several parts combine by summing."""
    return xp.concat([sum_dy, sum_dy_xhat])


def unpack_grad_sums(buf: Tensor) -> Tuple[Tensor, Tensor]:
    """``(Σdy, Σdy·x̂)`` of a summed :func:`pack_grad_sums` buffer."""
    channels = buf.shape[0] // 2
    return buf[:channels], buf[channels:]


def sync_grad_sums(
    xp: ArrayOps, allreduce_sum: AllreduceSum, name: str, sum_dy: Tensor, sum_dy_xhat: Tensor
) -> Tuple[Tensor, Tensor]:
    """Global ``Σdy`` and ``Σdy·x̂`` per channel, with one allreduce of ``(2C,)``."""
    return unpack_grad_sums(allreduce_sum(pack_grad_sums(xp, sum_dy, sum_dy_xhat), name))


def input_grad_coeffs(
    count: Tensor, invstd: Tensor, weight: Tensor | None, sum_dy: Tensor, sum_dy_xhat: Tensor
) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-channel ``(k, s, t)`` with ``dx = k·dy + s·x̂ + t``.

    From ``y = w·x̂ + b`` with global statistics:
    ``dx = w·invstd·(dy − Σdy/N − x̂·Σ(dy·x̂)/N)``, the sums taken over all ranks.

    Shape:
        - count: ``(1,)``; every other argument and result: ``(C,)``.
    """
    k = invstd if weight is None else weight * invstd
    return k, -k * sum_dy_xhat / count, -k * sum_dy / count


def unbiased(var: Tensor, count: Tensor) -> Tensor:
    """Unbiased variance ``var·N/(N−1)`` from the biased one and the global count (N > 1)."""
    return var * (count / (count - 1))


def ema(old: Tensor, new: Tensor, keep: float) -> Tensor:
    """Moving average with ``keep`` the weight on the old value (Keras's ``momentum``;
    PyTorch's ``momentum`` is ``1 − keep``)."""
    return old * keep + new * (1.0 - keep)


def check_input(
    layer: str,
    shape: Sequence[int | None],
    channel_axis: int,
    num_features: int,
    is_floating: bool,
    dtype: object,
    cast: str,
) -> None:
    """Static input checks shared by the adapters; raises ``ValueError`` naming the layer.

    Args:
        layer: the layer's name, for the message.
        shape: the input's static shape (``None`` for unknown sizes).
        channel_axis: the axis that holds the features (negative counts from the end).
        num_features: the channel count the layer was built for.
        is_floating: whether the input dtype is a real floating type.
        dtype: the input dtype, for the message.
        cast: how to cast in the caller's framework, for the message (``x.float()``).
    """
    if len(shape) < 2:
        raise ValueError(
            f"{layer}: expected an input with at least 2 dims (N, C, ...), "
            f"got {len(shape)}D input of shape {tuple(shape)}"
        )
    if not is_floating:
        raise ValueError(
            f"{layer}: expected a floating-point input (float16, bfloat16, float32 or "
            f"float64), got {dtype}; cast it first, e.g. {cast}"
        )
    got = shape[channel_axis]
    if got is not None and got != num_features:
        raise ValueError(
            f"{layer}: expected {num_features} channels on axis {channel_axis}, got {got} "
            f"(input shape {tuple(shape)})"
        )


def check_args(layer: str, eps: Any, momentum: Any, eps_name: str = "eps", momentum_none: bool = False) -> None:
    """Constructor checks shared by the adapters; raises ``ValueError`` naming the layer.

    Args:
        layer: the layer (class) name, for the message.
        eps: the variance epsilon; must be > 0.
        momentum: must lie in [0, 1] (or be ``None`` where ``momentum_none``).
        eps_name: the framework's name for ``eps``.
        momentum_none: whether ``None`` (PyTorch's cumulative average) is allowed.
    """
    if not eps > 0:
        raise ValueError(f"{layer}: expected {eps_name} > 0, got {eps!r}")
    if momentum is None and momentum_none:
        return
    if momentum is None or not 0.0 <= float(momentum) <= 1.0:
        allowed = "[0, 1] or None" if momentum_none else "[0, 1]"
        raise ValueError(f"{layer}: expected momentum in {allowed}, got {momentum!r}")


def single_row_message(layer: str) -> str:
    return (f"{layer}: expected more than 1 value per channel when training across all ranks, got a "
            f"global batch of 1 row")


def check_global_count(layer: str, count: float, training: bool) -> None:
    """Raise, on every rank alike, when training sees fewer than 2 rows in total."""
    if training and count == 1:
        raise ValueError(single_row_message(layer))


def non_finite_message(layer: str) -> str:
    return (f"{layer}: expected finite inputs (check_finite=True), got NaN or Inf in the input of at "
            f"least one rank; running statistics are left unchanged")


def check_finite(layer: str, finite: bool) -> None:
    """With ``check_finite=True``: raise, on every rank alike, when the global statistics
    are not finite (NaN or Inf in some rank's input)."""
    if not finite:
        raise ValueError(non_finite_message(layer))
