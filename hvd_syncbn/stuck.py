"""What a collective that got stuck leaves behind: its handle, kept alive while the
transport may still write into it, and the transport's abort when the process exits
(after mpirun could notice a lost node), bounded so that the process does not hang."""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import os
import sys
import threading
import time
from typing import Any, List, Tuple

from hvd_syncbn.communicator import Communicator
from hvd_syncbn.settings import grace

log = logging.getLogger("hvd_syncbn")

_orphans: list = []
"""Handles of collectives that timed out: their transports may still write into them."""


def wait_or_keep(comm: Communicator, handle: Any, deadline: float, waiting: Any = None) -> bool:
    """``comm.wait``, checking ``waiting`` (:class:`~hvd_syncbn.waiting.Waiting`) where the
    communicator's ``wait`` takes it (a user's may predate it), keeping a handle that timed
    out alive (its transport may still write)."""
    if comm.wait(handle, deadline, waiting) if waiting is not None and _warns(type(comm)) else \
            comm.wait(handle, deadline):
        return True
    _orphans.append(handle)
    return False


@functools.lru_cache(maxsize=None)
def _warns(cls: type) -> bool:
    """Whether ``cls.wait`` takes a ``waiting`` to check."""
    return "waiting" in inspect.signature(cls.wait).parameters


_aborted: List[Tuple[Communicator, float]] = []
"""The communicator whose collective got stuck, and the ``time.monotonic()`` until which
its abort waits (:func:`_abort_at_exit`)."""

KEEPALIVE_ENV = "OMPI_MCA_oob_tcp_keepalive_"
LOST_NODE_MARGIN = 2.0
"""Seconds an abort waits beyond :func:`lost_node_wait`, for the launcher to act."""


def schedule_abort(comm: Communicator, since: float, silent: bool) -> None:
    """Stop ``comm``'s transport at exit (:func:`_abort_at_exit`; the first stuck
    communicator only), its collective stuck since ``since``; where some ranks were
    ``silent`` (stopped, dead, or cut off), not before mpirun could notice a lost node."""
    if _aborted:
        return
    lost_after = lost_node_wait()
    _aborted.append((comm, since + lost_after + LOST_NODE_MARGIN if silent and lost_after else 0.0))
    atexit.register(_abort_at_exit)


def lost_node_wait() -> float:
    """Seconds Open MPI's mpirun takes at most to notice a node lost since a collective
    began: its out-of-band TCP keepalive, ``time + intvl × probes`` from the
    ``OMPI_MCA_oob_tcp_keepalive_*`` variables of this process (``launch/mpirun.sh`` and
    the image set them; Open MPI's defaults for ``intvl`` and ``probes``, 20 and 9); 0
    where ``time`` is not set (Open MPI's default: none of ours) or mpirun did not start
    this process (no ``OMPI_MCA_orte_hnp_uri``: e.g. ``srun``, which has no such daemons)."""
    if "OMPI_MCA_orte_hnp_uri" not in os.environ:
        return 0.0
    raw = {k: os.environ.get(KEEPALIVE_ENV + k) for k in ("time", "intvl", "probes")}
    try:
        idle = float(raw["time"] or 0)
        return idle + float(raw["intvl"] or 20) * float(raw["probes"] or 9) if idle > 0 else 0.0
    except ValueError:
        return 0.0


def _abort_at_exit() -> None:
    """A failed collective may still be pending: stop the transport rather than let the
    process hang in its shutdown; exit hard (status 1) if that takes more than
    :func:`~hvd_syncbn.settings.grace` (Horovod's shutdown over Gloo waits out Gloo's
    receive timeout, 30 s by default, for a stopped peer). A rank raises within the
    timeout and a grace of the stuck collective's start, so it is gone within the
    timeout and two (after :func:`lost_node_wait`, where that applies).

    Where ranks did not answer, wait first until mpirun could notice a lost node
    (:func:`lost_node_wait`, from the collective's start): an abort makes mpirun send to
    every node's daemon, and a message pending to a lost node turns its TCP keepalive off,
    so mpirun would wait for that node until TCP gives up retransmitting (Linux's default,
    ~15 min; measured: still waiting 120 s after the cut). If a node is lost, mpirun ends
    the job meanwhile; if a rank is only stopped, this rank aborts the job after the wait.
    """
    for comm, until in _aborted:
        wait = until - time.monotonic()
        if wait > 0:
            log.error("hvd_syncbn: aborting in %.0f s, once mpirun's keepalive (OMPI_MCA_oob_tcp_keepalive_*) "
                      "could have noticed a lost node", wait)
            time.sleep(wait)
        seconds = grace()
        timer = threading.Timer(seconds, _exit_hard, (comm.kind, seconds))
        timer.daemon = True
        timer.start()
        try:
            comm.abort()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
        timer.cancel()


def _exit_hard(kind: str, grace: float) -> None:
    """Ends the process with status 1 at once, after flushing its output."""
    print(f"hvd_syncbn: the {kind} transport did not stop within {grace:g} s of the exit; exiting hard",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)
