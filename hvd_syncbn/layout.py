"""The two buffers a SyncBN step sums across ranks, specified once for every driver: the
host and graph drivers of :mod:`hvd_syncbn.backend` (numpy, TensorFlow) and PyTorch's
(:mod:`hvd_syncbn.torch.device`, which packs the same lanes with in-place ops).

Forward, float64, ``H + 2C + 1`` values, summed over the ranks::

    [header (H) | −n | −n·mean | −n·(var + mean²)]

Backward, float64, ``H + 2C`` values::

    [header (H) | Σdy | Σdy·(x − mean)·s]

- ``header``: ``H = 2`` lanes ``[h, h²]`` (:func:`hvd_syncbn.identity.header`) where the
  driver's own step checks them (PyTorch over ``torch.distributed``): their sum must be
  ``W·[h, h²]``. ``H = 0`` where the transport's call puts the header in front and checks
  it (:func:`hvd_syncbn.comm.allreduce`, the XLA op, TensorFlow's graph reducer).
- ``n``: this rank's rows per channel (0 for an empty shard, which still joins). The count
  is negative, so that the summed sums divided by the summed count are the global
  moments with no negation (:func:`unpack_moments`).
- ``s``: ``invstd``, so that the lane is ``Σdy·x̂``, on every driver but PyTorch's native
  kernel set (torch's fused CUDA kernels), whose lane is ``Σdy·(x − mean)`` (``s = 1``);
  its collective's identity says so (:func:`grad_lane`), so that ranks with different
  lanes fail as a mismatch instead of summing different quantities.

The checks read lanes of the forward's sum: a header lane that is not ``W·h`` (the ranks
summed different collectives), the count lane at ``−1`` (a global batch of one row), and,
with ``check_finite``, the moments.
"""

from __future__ import annotations

from typing import Any, Tuple

Tensor = Any


def forward_size(channels: int, heads: int = 0) -> int:
    """The forward buffer's length: ``H + 2C + 1``."""
    return heads + 2 * channels + 1


def backward_size(channels: int, heads: int = 0) -> int:
    """The backward buffer's length: ``H + 2C``."""
    return heads + 2 * channels


def channels_of(size: int, heads: int, direction: str) -> int:
    """``C`` of a ``direction`` (``"fwd"`` or ``"bwd"``) buffer of ``size`` values."""
    return (size - heads - (direction == "fwd")) // 2


def grad_lane(kernels: str) -> str:
    """What the backward's second lane holds under a kernel set: the name its collective's
    identity carries (``""`` for ``Σdy·x̂``, the default)."""
    return "dy*(x-mean)" if kernels == "native" else ""


def pack_moments(xp: Any, count: Tensor, mean: Tensor, var: Tensor) -> Tensor:
    """The forward buffer without a header, ``[−n, −n·mean, −n·(var + mean²)]``, from local
    moments (``xp``: the adapter's :class:`~hvd_syncbn.backend.ArrayOps`).

    Shape:
        - count: ``(1,)``; mean, var: ``(C,)``; returns ``(2C+1,)``, float64.
    """
    n, m, v = -xp.wide(count), xp.wide(mean), xp.wide(var)
    return xp.concat([n, n * m, n * (v + m * m)])


def unpack_moments(xp: Any, buf: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """The global count ``N`` (``(1,)``, positive), mean and biased variance (clamped at 0)
    of a summed :func:`pack_moments` buffer; an empty global batch gives zeros."""
    channels = channels_of(buf.shape[0], 0, "fwd")
    negative = buf[0:1]
    safe = -xp.maximum(-negative, 1.0)  # −max(N, 1)
    mean = buf[1:channels + 1] / safe
    var = xp.maximum(buf[channels + 1:] / safe - mean * mean, 0.0)
    return -negative, mean, var


def pack_grad_sums(xp: Any, sum_dy: Tensor, sum_dy_xhat: Tensor) -> Tensor:
    """The backward buffer without a header, ``[Σdy, Σdy·x̂]``, ``(2C,)``."""
    return xp.concat([sum_dy, sum_dy_xhat])


def unpack_grad_sums(buf: Tensor) -> Tuple[Tensor, Tensor]:
    """``(Σdy, Σdy·x̂)`` of a summed :func:`pack_grad_sums` buffer."""
    channels = channels_of(buf.shape[0], 0, "bwd")
    return buf[:channels], buf[channels:]
