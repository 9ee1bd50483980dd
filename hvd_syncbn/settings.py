"""What a user sets: the collective timeout (:func:`set_timeout` or the environment),
and how settings are read from the environment (seconds, switches), naming the variable
when a value is wrong."""

from __future__ import annotations

import math
import os
from typing import Optional

TIMEOUT_ENV = "HVD_SYNCBN_TIMEOUT"
COMPILE_TIMEOUT_ENV = "HVD_SYNCBN_COMPILE_TIMEOUT"
_timeout: Optional[float] = None


def set_timeout(seconds: float) -> None:
    """How long a rank waits for a SyncBN collective before it diagnoses and raises.

    Overrides the ``HVD_SYNCBN_TIMEOUT`` environment variable (default 60 s).
    """
    global _timeout
    if not (isinstance(seconds, (int, float)) and seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"set_timeout: expected a positive number of seconds, got {seconds!r}")
    _timeout = float(seconds)


def get_timeout() -> float:
    """The collective timeout in seconds: :func:`set_timeout`, else ``$HVD_SYNCBN_TIMEOUT``, else 60."""
    return _timeout if _timeout is not None else env_seconds(TIMEOUT_ENV, 60.0)


def compile_timeout() -> float:
    """Seconds a first collective (or a group's set-up) waits beyond the timeout, as a
    peer may still be compiling: ``$HVD_SYNCBN_COMPILE_TIMEOUT``, else 600."""
    return env_seconds(COMPILE_TIMEOUT_ENV, 600.0, zero=True)


def collective_timeout(first: bool) -> float:
    """How long a collective waits: :func:`get_timeout`, with :func:`compile_timeout` more
    for a layer's ``first`` collective in a direction (a peer may still be compiling)."""
    return get_timeout() + (compile_timeout() if first else 0.0)


def env_seconds(name: str, default: float, zero: bool = False) -> float:
    """Seconds from the environment variable ``name`` (``default`` if unset): a positive
    number, or 0 too where ``zero``; else ``ValueError`` naming the variable."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 if zero else value > 0) or not math.isfinite(value):
        raise ValueError(f"{name}: expected a {'non-negative' if zero else 'positive'} number of seconds, got {raw!r}")
    return value


def env_flag(name: str, default: bool, off: str, on: str) -> bool:
    """A switch from the environment variable ``name`` (``default`` if unset): ``0`` or
    ``1``, else ``ValueError`` naming the variable and what each value means (``off``, ``on``)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name}: expected 0 ({off}) or 1 ({on}), got {raw!r}")
    return raw == "1"
