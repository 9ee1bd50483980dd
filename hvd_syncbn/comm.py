"""How SyncBN's statistics buffers travel between ranks, with a deadline and an identity check.

:func:`allreduce` sums a float64 buffer over a :class:`Communicator`'s ranks behind the
identity header of :mod:`hvd_syncbn.identity`, waiting at most :func:`get_timeout` (and
warning from :func:`~hvd_syncbn.settings.warn_after` on, :mod:`hvd_syncbn.waiting`);
:func:`poison` joins the collective a rank owes when its own input is bad. On any
failure every rank raises :class:`SyncBatchNormError` after the diagnosis of
:mod:`hvd_syncbn.diagnosis`. The transports (Horovod, MPI and, for PyTorch,
``torch.distributed``) and the rule that picks one live in :mod:`hvd_syncbn.transports`
and the adapters; this module is framework-free.

The pieces live in their own modules, lowest first: :mod:`~hvd_syncbn.errors`,
:mod:`~hvd_syncbn.settings` (the timeout), :mod:`~hvd_syncbn.communicator` (the
interface a transport implements), :mod:`~hvd_syncbn.identity` (the header),
:mod:`~hvd_syncbn.stuck` (a stuck collective's handle and abort) and
:mod:`~hvd_syncbn.diagnosis`. The public names are importable from here too.
"""

from __future__ import annotations

import time
from typing import Any, Callable, List, Optional

import numpy as np

from hvd_syncbn import layout
from hvd_syncbn.communicator import Communicator
from hvd_syncbn.diagnosis import fail
from hvd_syncbn.errors import SyncBatchNormError, SyncBatchNormInputError
from hvd_syncbn.identity import HEADER, Call, header
from hvd_syncbn.settings import TIMEOUT_ENV, get_timeout
from hvd_syncbn.stuck import wait_or_keep
from hvd_syncbn.waiting import Waiting

# Importable from here as before: the public names that users import from this module.
from hvd_syncbn.communicator import LocalCommunicator  # noqa: F401,E402
from hvd_syncbn.settings import set_timeout  # noqa: F401,E402


def prepend(head: List[float], payload: np.ndarray) -> np.ndarray:
    """``head`` followed by ``payload``, one float64 buffer."""
    return np.concatenate([np.asarray(head, dtype=np.float64), payload])


Join = Callable[[List[float], Any], Any]
"""``join(head, payload) -> buffer``: ``head`` followed by ``payload`` in one float64
buffer for the communicator (:func:`prepend`: numpy; an adapter's: its CUDA tensors)."""


def allreduce(comm: Communicator, payload: Any, call: Call, timeout: Optional[float] = None,
              join: Join = prepend) -> Any:
    """Sum the float64 ``payload`` over ``comm``'s ranks behind the identity header, in
    the buffer ``join`` builds; returns the sum without the header. Raises
    :class:`SyncBatchNormError` on every rank it can reach if the ranks are not in the
    same collective or one does not answer within ``timeout`` seconds (default:
    :func:`get_timeout`)."""
    head = header(call, comm.size)
    timeout, since = timeout or get_timeout(), time.monotonic()
    waiting = Waiting(comm, call, since, timeout)
    try:
        handle = comm.start(join(head, payload), call.name)
        if not wait_or_keep(comm, handle, since + timeout, waiting):
            fail(comm, call, f"no match within {timeout:g} s ({TIMEOUT_ENV})", since=since, stuck=True)
        out = comm.result(handle)
    except SyncBatchNormError:
        raise
    except Exception as e:  # the transport's own error (e.g. Horovod's shape mismatch)
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        reset = comm.reset_error(e)
        if reset is not None:  # an elastic engine resets the job: at once, recoverable
            raise reset(f"SyncBatchNorm: {comm.kind} failed while rank {comm.rank} was in {call.where()}, "
                        f"a collective its elastic mode recovers from (a worker left or failed): {reason}") from e
        fail(comm, call, reason, since=since, stuck=True, cause=e)
    finally:
        waiting.end()
    got = tuple(out[:HEADER].tolist())  # numpy and tensors alike
    if got != (comm.size * head[0], comm.size * head[1]):
        fail(comm, call, "ranks summed different collectives", since=since)
    return out[HEADER:]


def poison(comm: Communicator, call: Call, problem: str, error: type = SyncBatchNormInputError,
           cause: Optional[BaseException] = None, join: Join = prepend) -> None:
    """Join the forward collective this rank owes (:func:`hvd_syncbn.layout.forward_size`
    values) with a header no peer can match, so
    that every rank fails together and learns ``problem`` instead of waiting for it.

    Raises ``error`` here (:class:`SyncBatchNormInputError` for this rank's bad input),
    chained to ``cause``; the peers raise :class:`SyncBatchNormError` naming this rank
    and ``problem``. ``join``: as the peers' :func:`allreduce` builds its buffer.
    """
    call.problem = problem
    head, since = [-1.0, 1.0], time.monotonic()
    stuck = True
    try:
        handle = comm.start(join(head, np.zeros(layout.forward_size(call.channels))), call.name)
        stuck = not wait_or_keep(comm, handle, since + get_timeout())
        comm.result(handle)
    except Exception:  # noqa: BLE001 - the diagnosis below says what happened
        pass
    fail(comm, call, problem, error, since=since, stuck=stuck, cause=cause)
