"""The diagnosis of a failed collective: the ranks that can still talk exchange what
they were doing (their :class:`~hvd_syncbn.identity.Call`) over a side channel, and every
one raises :class:`~hvd_syncbn.errors.SyncBatchNormError` naming the layers on each
side, the waiting and the missing ranks, and the step."""

from __future__ import annotations

import json
import logging
import time
import zlib
from dataclasses import asdict
from typing import Dict, List, Optional, Tuple

import numpy as np

from hvd_syncbn.communicator import Communicator
from hvd_syncbn.errors import SyncBatchNormError
from hvd_syncbn.identity import Call
from hvd_syncbn.settings import get_timeout, grace
from hvd_syncbn.stuck import schedule_abort, wait_or_keep

log = logging.getLogger("hvd_syncbn")

RECORD_BYTES = 1024
"""Bytes of one rank's record in the diagnosis (its :class:`Call` as JSON)."""


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
        complete = wait_or_keep(comm, handle, deadline)
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
             kind: str = "this transport", broken: str = "", ranks: Optional[List[int]] = None) -> str:
    """The message every rank raises: who waits where, who is missing, and why.

    ``calls``: the answering ranks' calls by rank (:func:`_exchange`); ``partial``:
    whether those came row by row, so that the others are surely not in a collective
    (else the side channel, over ``kind``, is one collective that an absent rank holds
    back for all); ``broken``: the side channel's own error, if it failed; ``ranks``: the
    launch's ranks of a group (its rank ``r`` is ``ranks[r]``), which the message names.
    """
    ranks = None if ranks is None or list(ranks) == list(range(size)) else list(ranks)
    name = (lambda r: r) if ranks is None else ranks.__getitem__
    group = "" if ranks is None else f" (SyncBN's group of ranks {ranks})"
    lines = [f"SyncBatchNorm: ranks disagree or stopped ({reason}); this is rank {name(me.rank)}{group}, "
             f"in {me.where()}."]
    groups: dict = {}
    for c in calls.values():
        groups.setdefault(c.where(), []).append(c)
    everyone = list(range(size))
    for where, members in groups.items():
        waiting = [c.rank for c in members]
        missing = [name(r) for r in everyone if r not in waiting]
        lines.append(f"  ranks {[name(r) for r in waiting]} are waiting in {where}; missing there: ranks {missing}")
        for c in members:
            if c.problem:
                lines.append(f"    rank {name(c.rank)}: {c.problem}")
    silent = [name(r) for r in everyone if r not in calls]
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


def fail(comm: Communicator, call: Call, reason: str, error: type = SyncBatchNormError,
         since: Optional[float] = None, stuck: bool = False, cause: Optional[BaseException] = None) -> None:
    """Diagnose over the side channel, raise ``error`` (chained to ``cause``) on this
    rank; if a collective is ``stuck`` (timed out, or its transport failed), stop the
    transport at exit (:func:`hvd_syncbn.stuck.schedule_abort`).

    The diagnosis waits until the timeout and :func:`~hvd_syncbn.settings.grace` after
    ``since`` (the collective's start), so a rank that failed at once still meets the
    peers that fail by timing out.
    """
    since = time.monotonic() if since is None else since
    side = comm.side()
    calls, broken = _exchange(side, call, since + get_timeout() + grace())
    message = describe(calls, call, comm.size, reason, side.partial_gather, side.kind, broken, comm.ranks)
    log.error("%s", message)
    if stuck:
        schedule_abort(comm, since, silent=len(calls) < comm.size)  # silent: stopped, dead, or cut off
    raise error(message) from cause
