"""How SyncBN's statistics buffers travel between ranks, with a deadline and an identity check.

A :class:`Communicator` sums a float64 numpy buffer over the ranks asynchronously
(``start``, ``done``, ``result``). The transports (Horovod, MPI and, for PyTorch,
``torch.distributed``) and the rule that picks one live in :mod:`hvd_syncbn.transports`
and the adapters; this module is framework-free.

Every buffer starts with a two-value identity header ``[h, h²]``, ``h`` a hash of the
layer, direction, step, channel count, input rank and dtype. After the sum every rank
checks ``Σh = W·h`` and ``Σh² = W·h²``; both hold on one rank only if all ``h`` are
equal, so a mismatch fails on every rank at once (MPI matches collectives by order,
not name, and would otherwise mix two layers' statistics). Waiting is bounded by
:func:`get_timeout`. On any failure the ranks that can still talk exchange what they
were doing over a side channel, and every one raises :class:`SyncBatchNormError`
naming the layers on each side, the waiting and the missing ranks, and the step.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import sys
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from hvd_syncbn import layout

log = logging.getLogger("hvd_syncbn")

TIMEOUT_ENV = "HVD_SYNCBN_TIMEOUT"
HEADER = 2
RECORD_BYTES = 1024
_timeout: Optional[float] = None


class SyncBatchNormError(RuntimeError):
    """Ranks disagree (different layers, order, shapes or dtypes), a rank stopped
    answering, or the global batch is unusable. Raised on every rank that can tell."""


class SyncBatchNormInputError(SyncBatchNormError, ValueError):
    """Some rank's input to a SyncBN layer is invalid; raised on every rank of the collective."""


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


COMPILE_TIMEOUT_ENV = "HVD_SYNCBN_COMPILE_TIMEOUT"


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

    def wait(self, handle: Any, deadline: float) -> bool:
        """Until ``done`` (spinning ``spins`` polls first, then polling with sleeps, see
        :func:`pause`); ``False`` at the ``time.monotonic()`` deadline."""
        for _ in range(self.spins):
            if self.done(handle):
                return True
        begin = time.monotonic()
        while not self.done(handle):
            now = time.monotonic()
            if now > deadline:
                return False
            time.sleep(min(pause(now - begin), max(0.0, deadline - now) + 1e-4))
        return True

    def side(self) -> "Communicator":
        """A channel for diagnostics that a stuck collective on this one cannot block."""
        return self

    def abort(self) -> None:
        """After a failure: stop this process's transport so that peers stop too."""


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


@dataclass
class Call:
    """What one rank is doing in one collective: the identity its header hashes."""

    layer: str
    direction: str
    step: int
    channels: int
    ndim: int
    dtype: str
    rank: int = 0
    problem: str = ""

    @property
    def name(self) -> str:
        """The collective's name: deterministic, unique per layer and direction, readable."""
        return f"hvd_syncbn.{self.layer}.{self.direction}"

    def where(self) -> str:
        """Its layer, direction and step (a traced collective has neither: ``""``, ``-1``) and shape."""
        way = {"fwd": " forward", "bwd": " backward"}.get(self.direction, f" {self.direction}" if self.direction else "")
        step = f", step {self.step}" if self.step >= 0 else ""
        return f"layer {self.layer!r}{way}{step} ({self.channels} channels, {self.ndim}D {self.dtype})"


def header(call: Call, world: int) -> List[float]:
    """``[h, h²]`` with ``h`` small enough that ``W·h²`` is exact in float64."""
    bits = max(8, min(26, (53 - max(1, math.ceil(math.log2(max(world, 2))))) // 2))
    key = f"{call.layer}|{call.direction}|{call.step}|{call.channels}|{call.ndim}|{call.dtype}"
    h = float(zlib.crc32(key.encode()) % (1 << bits) + 1)
    return [h, h * h]


def static_header(layer: str, direction: str, channels: int, ndim: int, dtype: str, world: int) -> List[float]:
    """The static ``[h, h²]`` of a collective traced once (a graph op: no step count)."""
    return header(Call(layer, direction, 0, channels, ndim, dtype), world)


def make_call(comm: Communicator, layer: str, direction: str, channels: int, ndim: int, dtype: str,
              count: bool = True) -> Call:
    """This rank's identity of ``layer``'s next collective in ``direction`` over ``comm``;
    its ``step`` counts this process's earlier calls of that collective on ``comm``.
    ``count=False``: the latest one's instead, counting nothing."""
    steps = comm.__dict__.setdefault("_steps", {})
    latest = steps.get((layer, direction), -1)
    step = latest + 1 if count else max(latest, 0)
    if count:
        steps[layer, direction] = step
    return Call(layer, direction, step, channels, ndim, dtype, comm.rank)


_orphans: list = []


def _wait(comm: Communicator, handle: Any, deadline: float) -> bool:
    """``comm.wait``, keeping a handle that timed out alive (its transport may still write)."""
    if comm.wait(handle, deadline):
        return True
    _orphans.append(handle)
    return False


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
    try:
        handle = comm.start(join(head, payload), call.name)
        if not _wait(comm, handle, since + timeout):
            fail(comm, call, f"no match within {timeout:g} s ({TIMEOUT_ENV})", since=since, stuck=True)
        out = comm.result(handle)
    except SyncBatchNormError:
        raise
    except Exception as e:  # the transport's own error (e.g. Horovod's shape mismatch)
        fail(comm, call, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", since=since,
             stuck=True)
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
        stuck = not _wait(comm, handle, since + get_timeout())
        comm.result(handle)
    except Exception:  # noqa: BLE001 - the diagnosis below says what happened
        pass
    fail(comm, call, problem, error, since=since, stuck=stuck, cause=cause)


def _exchange(comm: Communicator, call: Call, deadline: float) -> Tuple[Dict[int, Call], str]:
    """The :class:`Call` of every rank that answered over the side channel before
    ``deadline``, by rank, this rank's included (a rank that is gone leaves out only
    itself where the transport gathers row by row, :attr:`Communicator.partial_gather`),
    and the side channel's own error ('' if none)."""
    row = np.zeros(RECORD_BYTES, dtype=np.uint8)
    record = _record(call)
    row[: len(record)] = np.frombuffer(record, dtype=np.uint8)
    rows: Dict[int, np.ndarray] = {}
    broken = ""
    try:
        handle = comm.start_gather(row)
        complete = _wait(comm, handle, deadline)
        rows = comm.gathered(handle)
        if not complete:
            comm.end_gather(handle)
    except Exception as e:  # noqa: BLE001 - said in the message
        broken = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    rows[comm.rank] = row
    calls = {}
    for rank, got in sorted(rows.items()):
        raw = bytes(np.asarray(got).astype(np.uint8)).rstrip(b"\0")
        try:
            calls[rank] = Call(**json.loads(raw.decode()))
        except (ValueError, TypeError):  # garbled: as if it had not answered
            pass
    return calls, broken


LAYER_KEEP = 120
"""Characters of a long layer path that a diagnosis record keeps (its start and end)."""


def shorten(text: str, keep: int, mark: str = "...") -> str:
    """``text`` with its middle replaced by ``mark`` if it is longer than ``keep``."""
    if len(text) <= keep:
        return text
    tail = max(0, keep - len(mark)) // 2
    return f"{text[: max(0, keep - len(mark) - tail)]}{mark}{text[len(text) - tail:]}"


def short_layer(layer: str) -> str:
    """A layer path longer than :data:`LAYER_KEEP`, shortened in the middle to that
    length; the middle's mark holds a hash of the whole path, so that two long paths
    differing only in the middle (``...layers.12...`` and ``...layers.13...``) still differ."""
    return shorten(layer, LAYER_KEEP, f"...{zlib.crc32(layer.encode()):08x}...")


def _record(call: Call) -> bytes:
    """``call`` as JSON of at most :data:`RECORD_BYTES`: a long layer path shortened in
    the middle (:func:`short_layer`; in its ``problem`` too, which names it), then, if
    still too long, the ``problem`` cut in the middle, so that its cause (at the end)
    survives."""
    fields = asdict(call)

    def encoded() -> bytes:
        return json.dumps(fields).encode()

    fields["layer"] = short_layer(call.layer)
    fields["problem"] = call.problem.replace(call.layer, fields["layer"])
    while len(encoded()) > RECORD_BYTES and fields["problem"]:
        keep = len(fields["problem"]) - (len(encoded()) - RECORD_BYTES) - 3
        fields["problem"] = shorten(fields["problem"], keep) if keep > 40 else ""
    return encoded()[:RECORD_BYTES]


def _ranks(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def describe(calls: Dict[int, Call], me: Call, size: int, reason: str, partial: bool = True,
             kind: str = "this transport", broken: str = "") -> str:
    """The message every rank raises: who waits where, who is missing, and why.

    ``calls``: the answering ranks' calls by rank (:func:`_exchange`); ``partial``:
    whether those came row by row, so that the others are surely not in a collective
    (else the side channel, over ``kind``, is one collective that an absent rank holds
    back for all); ``broken``: the side channel's own error, if it failed.
    """
    lines = [f"SyncBatchNorm: ranks disagree or stopped ({reason}); this is rank {me.rank}, in {me.where()}."]
    groups: dict = {}
    for c in calls.values():
        groups.setdefault(c.where(), []).append(c)
    everyone = list(range(size))
    for where, members in groups.items():
        waiting = [c.rank for c in members]
        missing = [r for r in everyone if r not in waiting]
        lines.append(f"  ranks {waiting} are waiting in {where}; missing there: ranks {missing}")
        for c in members:
            if c.problem:
                lines.append(f"    rank {c.rank}: {c.problem}")
    silent = [r for r in everyone if r not in calls]
    if silent and broken:
        lines.append(f"  {_ranks(silent)}: no answer, as the diagnosis over {kind} failed ({broken}).")
    elif silent and not partial and list(calls) == [me.rank]:
        lines.append(f"  {_ranks(silent)} did not answer within the diagnosis time. At least one is not in a "
                     f"SyncBN collective (stuck in other code or another collective, stopped, finished, or dead); "
                     f"over {kind} the diagnosis is one collective, so it cannot tell which one, nor where the "
                     f"others wait.")
    elif silent:
        lines.append(f"  {_ranks(silent)} did not answer within the diagnosis time: not in a SyncBN collective "
                     f"(stuck in other code or another collective, stopped, finished, or dead).")
    lines.append("  Every rank must call the same SyncBN layers in the same order with the same channel "
                 "count, input rank and dtype (the batch and spatial sizes may differ).")
    return "\n".join(lines)


_aborted: List[Tuple[Communicator, float]] = []
"""The communicator whose collective got stuck, and the ``time.monotonic()`` until which
its abort waits (:func:`_abort_at_exit`)."""


def fail(comm: Communicator, call: Call, reason: str, error: type = SyncBatchNormError,
         since: Optional[float] = None, stuck: bool = False, cause: Optional[BaseException] = None) -> None:
    """Diagnose over the side channel, raise ``error`` (chained to ``cause``) on this
    rank; if a collective is ``stuck`` (timed out, or its transport failed), stop the
    transport at exit.

    The diagnosis waits until 1.5 timeouts after ``since`` (the collective's start), so a
    rank that failed at once still meets the peers that fail by timing out.
    """
    since = time.monotonic() if since is None else since
    side = comm.side()
    calls, broken = _exchange(side, call, since + 1.5 * get_timeout())
    message = describe(calls, call, comm.size, reason, side.partial_gather, side.kind, broken)
    log.error("%s", message)
    if stuck and not _aborted:
        silent, lost_after = len(calls) < comm.size, lost_node_wait()  # silent: stopped, dead, or cut off
        _aborted.append((comm, since + lost_after + LOST_NODE_MARGIN if silent and lost_after else 0.0))
        atexit.register(_abort_at_exit)
    raise error(message) from cause


KEEPALIVE_ENV = "OMPI_MCA_oob_tcp_keepalive_"
LOST_NODE_MARGIN = 2.0
"""Seconds an abort waits beyond :func:`lost_node_wait`, for the launcher to act."""


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


EXIT_GRACE = 0.5
"""Share of the timeout an abort may take before the process exits hard: a rank raises
within 1.5 timeouts of the stuck collective's start, so it is gone within 2 (after
:func:`lost_node_wait`, where that applies)."""


def _abort_at_exit() -> None:
    """A failed collective may still be pending: stop the transport rather than let the
    process hang in its shutdown; exit hard (status 1) if that takes more than
    :data:`EXIT_GRACE` of the timeout (Horovod's shutdown over Gloo waits out Gloo's
    receive timeout, 30 s by default, for a stopped peer).

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
        grace = EXIT_GRACE * get_timeout()
        timer = threading.Timer(grace, _exit_hard, (comm.kind, grace))
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
