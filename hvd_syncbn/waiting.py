"""A rank that waits long in a SyncBN collective warns before it raises.

A peer that is only slow (a rank-0-only validation, a checkpoint to slow storage) holds
the others back; one that is stuck or gone makes them raise at the timeout. In between, a
waiting rank logs a warning after :func:`~hvd_syncbn.settings.warn_after` seconds, then at
growing intervals (the wait doubled, never twice within a minute), naming the layer,
direction and step it waits in, the ranks that have not come, how long it will still wait
and how to change that. The ranks that have come say so over the side channel once they
have waited a few seconds (:meth:`~hvd_syncbn.communicator.Communicator.mark_waiting`);
the others are the missing ones. A collective that ends in time pays one comparison per
poll.

Two ways in: a wait that polls (:meth:`Communicator.wait`: MPI, Horovod, the host path of
both frameworks; the XLA allreduce calls back) calls :meth:`Waiting.check` between polls;
a wait that blocks inside a library (``torch.distributed``'s functional collectives)
registers itself with :func:`blocking`, and a watchdog thread checks it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

import numpy as np

from hvd_syncbn.identity import Call
from hvd_syncbn.settings import TIMEOUT_ENV, WARN_ENV, get_timeout, warn_after

log = logging.getLogger("hvd_syncbn")

MARK_S = 5.0
"""Seconds of waiting after which a rank says it waits (at most half the warning time)."""
MIN_GAP_S = 60.0
"""The least time between two warnings of one wait."""
FIRST_CHECK_S = 0.1
"""Seconds of waiting before the first check reads the settings (most collectives end before)."""


class Waiting:
    """One collective's wait, from ``since`` (``time.monotonic()``) until ``timeout`` more
    seconds: :meth:`check` says this rank waits (once), then warns when due."""

    __slots__ = ("comm", "call", "since", "timeout", "next", "due", "marked")
    # due: the next warning; next: the next check that does something (a mark, a warning)

    def __init__(self, comm: Any, call: Call, since: float, timeout: Optional[float] = None) -> None:
        self.comm, self.call, self.since, self.timeout = comm, call, since, timeout
        self.next = since + FIRST_CHECK_S  # then the times are set (a collective that ends in time sets none)
        self.marked: Any = None
        self.due = 0.0

    def check(self, now: float) -> None:
        """Between polls: nothing before :attr:`next`, the time of the next thing to do.
        No warning once the timeout has passed (the diagnosis runs); a side channel that
        fails only leaves the missing ranks unnamed."""
        if now < self.next:
            return
        if not self.due:
            first = warn_after()
            self.timeout = get_timeout() if self.timeout is None else self.timeout
            self.due, self.next = self.since + first, self.since + min(MARK_S, first / 2)
            if now < self.next:
                return
        if now - self.since >= self.timeout:
            self.next = float("inf")
            return
        try:
            if self.marked is None:
                self.marked = False
                self.marked = self.comm.side().mark_waiting(_row(self.call), self.call.key) or False
            if now >= self.due:
                waited = now - self.since
                self.due = self.since + max(2 * waited, waited + MIN_GAP_S)
                self.warn(now)
        except Exception:  # noqa: BLE001 - a warning never breaks the wait
            log.debug("hvd_syncbn: the side channel failed while warning", exc_info=True)
        self.next = self.due

    def warn(self, now: float) -> None:
        side, waited = self.comm.side(), now - self.since
        rows = side.waiting(self.marked) if self.marked else None
        if rows is None:
            missing = f"which ranks have not come {side.kind} cannot tell without a collective"
        else:
            absent = self.comm.launch_ranks([r for r in range(self.comm.size) if r not in rows])
            missing = f"{_ranks(absent)} {'has' if len(absent) == 1 else 'have'} not come"
        left, me = max(0.0, self.timeout - waited), self.comm.launch_ranks([self.comm.rank])[0]
        log.warning("hvd_syncbn: rank %d has waited %.0f s in %s: %s. A rank working alone (a rank-0-only validation "
                    "or checkpoint) only costs time: this rank waits %.0f s more (%s=%g s), then raises naming "
                    "the missing ranks. Set %s to wait longer, %s to warn later.", me, waited,
                    self.call.where(), missing, left, TIMEOUT_ENV, self.timeout, TIMEOUT_ENV, WARN_ENV)

    def end(self) -> None:
        """The wait is over: stop listening for the peers' marks."""
        if self.marked:
            self.comm.side().end_waiting(self.marked)


def _row(call: Call) -> np.ndarray:
    from hvd_syncbn.diagnosis import RECORD_BYTES, _record

    row = np.zeros(RECORD_BYTES, dtype=np.uint8)
    record = _record(call)
    row[: len(record)] = np.frombuffer(record, dtype=np.uint8)
    return row


def _ranks(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


_current: Optional[Waiting] = None
"""The blocking wait in progress on this process (at most one: the step's thread waits in it)."""
_watchdog: Optional[threading.Thread] = None
_lock = threading.Lock()


def blocking(comm: Any, call: Call, since: float, timeout: Optional[float] = None) -> Waiting:
    """This process is about to wait in ``call``'s collective in a call that does not return
    before it ends (a library's blocking wait): a watchdog thread checks the wait until
    :func:`unblocked` (a ``try``/``finally`` around the wait; no context manager, which
    costs a step's host more)."""
    global _current
    if _watchdog is None:
        _start_watchdog()
    _current = waiting = Waiting(comm, call, since, timeout)
    return waiting


def unblocked(waiting: Waiting) -> None:
    """:func:`blocking`'s wait is over."""
    global _current
    _current = None
    if waiting.marked:
        with _lock:  # not while the watchdog still uses it
            waiting.end()


def _start_watchdog() -> None:
    global _watchdog
    with _lock:
        if _watchdog is None:
            _watchdog = threading.Thread(target=_watch, name="hvd_syncbn-waiting", daemon=True)
            _watchdog.start()


def _watch() -> None:
    """Checks the blocking wait in progress, every second (a quarter of a short warning time)."""
    while True:
        time.sleep(min(1.0, warn_after() / 4))
        waiting = _current
        if waiting is not None:
            with _lock:
                if waiting is _current:
                    waiting.check(time.monotonic())
