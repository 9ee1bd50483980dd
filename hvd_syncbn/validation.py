"""What a layer refuses, and the messages every driver raises: the constructor's arguments,
the input's shape and dtype, a global batch of one row, non-finite statistics; and the
``stats`` choice (``$HVD_SYNCBN_STATS``)."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence


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


STATS_ENV = "HVD_SYNCBN_STATS"


def stats_choice(what: str, stats: Optional[str]) -> str:
    """A layer's ``stats`` (where its statistics live between the passes: ``"host"``,
    ``"device"`` or ``"auto"``), else ``$HVD_SYNCBN_STATS``, else ``"auto"``, checked."""
    value = stats if stats is not None else os.environ.get(STATS_ENV, "auto")
    if value not in ("auto", "host", "device"):
        where = "stats" if stats is not None else f"${STATS_ENV}"
        raise ValueError(f"{what}: expected {where} to be 'auto', 'host' or 'device', got {value!r}")
    return value


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
