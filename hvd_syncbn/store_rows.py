"""A diagnosis gathered row by row through a key-value store that outlives the ranks'
collectives (:class:`KeyValueRows`), and the one ``horovodrun`` (Gloo) runs
(:class:`RendezvousRows`, :func:`rendezvous_rows`): a stopped or lost rank leaves out
only its own row."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from hvd_syncbn import launchers
from hvd_syncbn.communicator import Communicator


RENDEZVOUS_ENV = ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT")


class KeyValueRows(Communicator):
    """A diagnosis gathered row by row through a key-value store that outlives the ranks'
    collectives: each rank puts its row under its own key and reads the peers' rows as
    they appear, so a stopped or lost rank leaves out only its own. It gathers only (the
    sums stay with the transport). ``group``: what tells this group's rows from another's.
    A store says how to :meth:`_put` and :meth:`_get` a key."""

    partial_gather = True
    SCOPE = "hvd_syncbn_diagnosis"

    def __init__(self, rank: int, size: int, group: Any) -> None:
        self.rank, self.size, self.group, self._rounds = rank, size, group, 0
        run = launchers.attempt().replace("/", "_")  # a restarted job's store holds the last attempt's rows
        self.scope = f"{self.SCOPE}.{run}" if run else self.SCOPE

    def _key(self, handle: "_StoreRows", rank: int) -> str:
        return f"{self.scope}/{self.group}.{handle.round}.{rank}"

    def _put(self, key: str, raw: bytes) -> None:
        raise NotImplementedError

    def _get(self, key: str) -> Optional[bytes]:
        """The value under ``key``, ``None`` if there is none yet (or the store does not answer now)."""
        raise NotImplementedError

    def start_gather(self, row):
        handle = _StoreRows(self._rounds, np.ascontiguousarray(row), {})
        self._rounds += 1
        handle.rows[self.rank] = handle.row
        self._put(self._key(handle, self.rank), handle.row.tobytes())
        return handle

    def gathered(self, handle):
        for rank in range(self.size):
            if rank in handle.rows:
                continue
            raw = self._get(self._key(handle, rank))
            if raw is not None and len(raw) == handle.row.nbytes:
                handle.rows[rank] = np.frombuffer(raw, dtype=handle.row.dtype)
        return dict(handle.rows)

    def done(self, handle):
        return len(self.gathered(handle)) == self.size

    def mark_waiting(self, row, key):
        """A row under a key of the collective's own (a hash of ``key``): the rounds of the
        diagnosis stay as they are on every rank."""
        handle = _StoreRows(f"wait.{zlib.crc32(key.encode()):08x}", np.ascontiguousarray(row), {})
        handle.rows[self.rank] = handle.row
        self._put(self._key(handle, self.rank), handle.row.tobytes())
        return handle

    def waiting(self, handle):
        return self.gathered(handle)


class RendezvousRows(KeyValueRows):
    """:class:`KeyValueRows` through ``horovodrun``'s (Gloo) rendezvous store: an HTTP
    server in the ``horovodrun`` process, which lives as long as the job."""

    kind = "horovodrun's rendezvous store"
    REQUEST_S = 1.0

    def __init__(self, rank: int, size: int, group: Any, address: str) -> None:
        super().__init__(rank, size, group)
        self.address = address

    def _put(self, key, raw):
        put = urllib.request.Request(f"{self.address}/{key}", data=raw, method="PUT")
        _NO_PROXY.open(put, timeout=self.REQUEST_S).close()

    def _get(self, key):
        try:
            with _NO_PROXY.open(f"{self.address}/{key}", timeout=self.REQUEST_S) as answer:
                return answer.read()
        except (urllib.error.URLError, OSError):  # 404: not yet; else unreachable: not now
            return None


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""The store is the launcher's, reached directly (as Horovod's Gloo reaches it), never through ``$http_proxy``."""


@dataclass
class _StoreRows:
    """A gather in flight over a store: its round (or the collective whose waiting ranks
    it gathers), this rank's row, the rows read."""

    round: Any
    row: np.ndarray
    rows: dict


def rendezvous_rows(rank: int, size: int, group: Any) -> Optional[RendezvousRows]:
    """:class:`RendezvousRows` where ``horovodrun`` (Gloo) started this process, else ``None``."""
    addr, port = (os.environ.get(k) for k in RENDEZVOUS_ENV)
    if not addr or not port:
        return None
    host = f"[{addr}]" if ":" in addr else addr
    return RendezvousRows(rank, size, group, f"http://{host}:{port}")
