"""The interface a transport implements: :class:`Communicator`, a summing allreduce of
float64 buffers polled against a deadline (and a gather for the diagnosis), with
:class:`LocalCommunicator`, the transport-free one for benchmarks and tests."""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import numpy as np


class Communicator:
    """A summing allreduce of 1-D float64 numpy buffers over a fixed group of ranks; some
    also take an adapter's tensors (:attr:`device_buffers`)."""

    kind = "?"
    rank = 0
    size = 1
    spins = 0
    """Polls before the caller starts sleeping between polls: MPI progresses only inside
    its calls, so it spins; transports with their own threads should not steal a core."""
    device_buffers = False
    """Whether ``start`` also takes an adapter's CUDA buffers as they are (the transport
    reads device memory); else the adapter copies them to the host."""
    traceable = False
    """Whether a compiler can trace its collectives (``torch.distributed``'s functional
    collectives); else an adapter wraps :func:`allreduce` in an opaque op."""
    ranks: Optional[List[int]] = None
    """The launch's ranks of this group, by rank in it (``None``: ranks ``0 … size−1``), as
    the diagnosis and warnings name them."""

    def prepare(self, call: Any) -> None:
        """Make what ``call``, this communicator's first collective, needs (a
        ``torch.distributed`` group of SyncBN's own), bounded as a collective is."""

    def subgroup(self, ranks: List[int], groups: List[List[int]], layer: str) -> "Communicator":
        """A communicator of ``ranks``, this rank's group of ``groups`` (a partition of this
        one's ranks, the same on every rank; both as the launch numbers its ranks), made
        when every rank is here (BN groups: :mod:`hvd_syncbn.groups`)."""
        raise ValueError(f"{layer}: group_size needs a transport that makes groups of ranks (torch.distributed, MPI "
                         f"or Horovod), got a {type(self).__name__} ({self.kind}), which does not")

    def launch_ranks(self, ranks: List[int]) -> List[int]:
        """The launch's ranks of this group's ``ranks``."""
        return ranks if self.ranks is None else [self.ranks[r] for r in ranks]

    def start(self, buf: Any, name: str) -> Any:
        """Begin summing ``buf``, a float64 numpy buffer (or a CUDA one, see
        :attr:`device_buffers`), which may be reused as the output; return a handle."""
        raise NotImplementedError

    partial_gather = False
    """Whether :meth:`gathered` hands out each rank's row as it arrives; else the gather
    is one collective, and one absent rank holds back every row."""

    def start_gather(self, row: np.ndarray) -> Any:
        """Begin gathering every rank's ``row`` (equal sizes) into a ``(size, len)``
        table; here, as the sum of a zero table holding this rank's row."""
        table = np.zeros((self.size, row.size), dtype=np.float64)
        table[self.rank] = row
        return self.start(table.reshape(-1), "hvd_syncbn.diagnose")

    def gathered(self, handle: Any) -> Dict[int, np.ndarray]:
        """The rows of :meth:`start_gather` that have arrived, by rank: here all once
        ``done``, none before (see :attr:`partial_gather`)."""
        if not self.done(handle):
            return {}
        return dict(enumerate(np.asarray(self.result(handle)).reshape(self.size, -1)))

    def end_gather(self, handle: Any) -> None:
        """Stop waiting for the rows of :meth:`start_gather` that did not arrive."""

    def done(self, handle: Any) -> bool:
        raise NotImplementedError

    def result(self, handle: Any) -> Any:
        """The summed buffer, of ``start``'s kind; raises if the transport failed."""
        raise NotImplementedError

    def wait(self, handle: Any, deadline: float, waiting: Any = None) -> bool:
        """Until ``done`` (spinning ``spins`` polls first, then polling with sleeps, see
        :func:`pause`); ``False`` at the ``time.monotonic()`` deadline. ``waiting``: a
        :class:`~hvd_syncbn.waiting.Waiting` to check between the polls (it warns)."""
        for _ in range(self.spins):
            if self.done(handle):
                return True
        begin = time.monotonic()
        while not self.done(handle):
            now = time.monotonic()
            if now > deadline:
                return False
            if waiting is not None:
                waiting.check(now)
            time.sleep(min(pause(now - begin), max(0.0, deadline - now) + 1e-4))
        return True

    def side(self) -> "Communicator":
        """A channel for diagnostics that a stuck collective on this one cannot block."""
        return self

    def mark_waiting(self, row: np.ndarray, key: str) -> Any:
        """Say over this channel (a side channel) that this rank waits in the collective
        ``key`` (:attr:`hvd_syncbn.identity.Call.key`; ``row``: its record, as the
        diagnosis's), with no collective: a handle for :meth:`waiting`, or ``None`` where
        the channel cannot (a collective would block on the ranks that have not come)."""
        return None

    def waiting(self, handle: Any) -> Dict[int, np.ndarray]:
        """The records of the ranks that have said they wait in the collective of
        :meth:`mark_waiting`'s ``handle`` so far, by rank, this rank's included."""
        raise NotImplementedError

    def end_waiting(self, handle: Any) -> None:
        """Stop listening for the marks of :meth:`mark_waiting`'s ``handle``."""

    def abort(self) -> None:
        """After a failure: stop this process's transport so that peers stop too."""

    def reset_error(self, error: BaseException) -> Any:
        """Where the transport's own ``error`` (raised in a collective) is one its elastic
        engine recovers from, the :class:`~hvd_syncbn.errors.SyncBatchNormError` subclass to
        raise at once, chained to it, instead of the diagnosis (Horovod elastic's
        ``HorovodInternalError``: :mod:`hvd_syncbn.elastic`); else ``None``."""
        return None


SHORT_PAUSE, LONG_PAUSE, BACKOFF_AFTER, BACKOFF_SHARE = 5e-5, 0.02, 0.1, 0.02


def pause(waited: float) -> float:
    """Seconds to sleep between polls of a wait that has lasted ``waited`` seconds:
    :data:`SHORT_PAUSE` while it is within a collective's latency plus a slow peer's
    usual lateness (:data:`BACKOFF_AFTER`, 100 ms), then :data:`BACKOFF_SHARE` of the
    time waited, up to :data:`LONG_PAUSE`: a stopped peer costs a waiting rank ~50
    wake-ups a second, not 15,000, and an answer after a long wait is read at most 2%
    (and 20 ms) late."""
    return SHORT_PAUSE if waited < BACKOFF_AFTER else min(LONG_PAUSE, waited * BACKOFF_SHARE)


class LocalCommunicator(Communicator):
    """No transport: ``size`` ranks that all hold this rank's buffer (the sum is
    ``size·buf``). For compute-only benchmarks and tests."""

    kind = "local"

    def __init__(self, size: int = 2, rank: int = 0) -> None:
        self.size, self.rank = size, rank

    def start(self, buf, name):
        return buf * self.size

    def done(self, handle):
        return True

    def result(self, handle):
        return handle
