"""What a user sets: the collective timeout (:func:`set_timeout` or the environment) and
the time after which a waiting rank warns, and how settings are read from the
environment (seconds, switches), naming the variable when a value is wrong.

A slow rank is not a dead one: a rank-0-only validation or checkpoint holds the others
back for minutes. So a rank waiting in a SyncBN collective warns after
:func:`warn_after` (``$HVD_SYNCBN_WARN``, 60 s, Horovod's stall warning's), naming the
ranks that have not come, and raises only at :func:`get_timeout` (``$HVD_SYNCBN_TIMEOUT``,
10 min, the wait of torch's default NCCL group); the diagnosis that names a stuck rank
adds :func:`grace` (at most 30 s).
"""

from __future__ import annotations

import math
import os
from typing import Optional

TIMEOUT_ENV = "HVD_SYNCBN_TIMEOUT"
WARN_ENV = "HVD_SYNCBN_WARN"
COMPILE_TIMEOUT_ENV = "HVD_SYNCBN_COMPILE_TIMEOUT"
DEFAULT_TIMEOUT = 600.0
"""Seconds a collective waits by default: 10 min, as torch's default NCCL group (its Gloo
group waits 30; Horovod warns at 60 s and stops only when asked; MPI waits forever)."""
DEFAULT_WARN = 60.0
GRACE_S = 30.0
_timeout: Optional[float] = None


def set_timeout(seconds: float) -> None:
    """How long a rank waits for a SyncBN collective before it diagnoses and raises.

    Overrides the ``HVD_SYNCBN_TIMEOUT`` environment variable (default 600 s).
    """
    global _timeout
    if not (isinstance(seconds, (int, float)) and seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"set_timeout: expected a positive number of seconds, got {seconds!r}")
    _timeout = float(seconds)


def get_timeout() -> float:
    """The collective timeout in seconds: :func:`set_timeout`, else ``$HVD_SYNCBN_TIMEOUT``, else
    600. Read at every collective's start, it checks :func:`warn_after`'s setting too, so
    that a bad one is refused there, not inside the wait that reads it."""
    warn_after()
    return _timeout if _timeout is not None else env_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT)


def warn_after() -> float:
    """Seconds a rank waits in a collective before it warns: ``$HVD_SYNCBN_WARN``, else 60."""
    return env_seconds(WARN_ENV, DEFAULT_WARN)


def grace() -> float:
    """Seconds beyond the timeout that the diagnosis waits for the ranks that time out too,
    and that a transport's abort at exit may take: half the timeout, at most 30 s."""
    return min(0.5 * get_timeout(), GRACE_S)


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
