"""Which transport carries a layer's statistics: a registry per framework.

A layer's ``comm`` argument (else ``$HVD_SYNCBN_COMM``, else ``auto``) names a
:class:`Transport` in its framework's :class:`Registry` (or is a :class:`Communicator`
to use as it is). Under ``auto`` the registry takes the first transport, in registration
order, that can work here: for PyTorch ``torch.distributed`` if a process group exists,
then MPI under mpirun with mpi4py, then Horovod after ``hvd.init()``; with none, the
process is alone. The registry builds one communicator per transport and group of ranks
per process. Adding a transport is one :class:`Transport` subclass and one
:meth:`Registry.register`. MPI's communicator lives in :mod:`hvd_syncbn.mpi`, the
diagnosis through ``horovodrun``'s store in :mod:`hvd_syncbn.store_rows`. This module
imports no framework.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from hvd_syncbn import launchers
from hvd_syncbn.communicator import Communicator
from hvd_syncbn.mpi import MpiCommunicator, mpi_usable
from hvd_syncbn.settings import env_flag

log = logging.getLogger("hvd_syncbn")

COMM_ENV = "HVD_SYNCBN_COMM"
KINDS = ("auto", "horovod", "mpi", "torch")
"""What ``comm`` may name: ``auto`` and every transport any adapter registers."""


def requested_kind(kind: Any) -> Any:
    """The transport asked for: the argument (a name, or a :class:`Communicator` to use
    as it is), else ``$HVD_SYNCBN_COMM``, else ``auto``."""
    if isinstance(kind, Communicator):
        return kind
    if kind is not None and not isinstance(kind, str):
        raise ValueError(f"comm: expected one of {', '.join(KINDS)} or a Communicator, got {kind!r}")
    value = (kind or os.environ.get(COMM_ENV) or "auto").lower()
    if value not in KINDS:
        source = "comm" if kind else COMM_ENV
        raise ValueError(f"{source}: expected one of {', '.join(KINDS)}, got {value!r}")
    return value


@dataclass(frozen=True)
class Request:
    """A layer's request for a communicator, as its adapter sees this process.

    Args:
        layer: the layer's name, for errors.
        horovod: Horovod's ``(size, rank)`` if ``hvd.init()`` has run, else ``None``.
        process_group: whether a ``torch.distributed`` default group exists.
        group: the layer's group of ranks as its framework names it (a Horovod process
            set, a ``torch.distributed`` group), ``None`` for all.
        key: what identifies that group (communicators are built once per transport and key).
        ranks: that group's ranks in ``MPI_COMM_WORLD`` (``None``: all).
    """

    layer: str
    horovod: Optional[Tuple[int, int]] = None
    process_group: bool = False
    group: Any = None
    key: Any = None
    ranks: Optional[List[int]] = None


class Transport:
    """One way statistics travel. Subclasses set :attr:`name` and :attr:`chosen_because`
    and implement :meth:`unavailable` and :meth:`build`; the capability flags live on the
    communicators they build (``device_buffers``, ``traceable``)."""

    name = "?"
    chosen_because = ""
    """Why ``auto`` took it, for the log line."""

    def unavailable(self, request: Request) -> Optional[str]:
        """Why it cannot work here when asked for by name (``None``: it can)."""
        return None

    def auto_unavailable(self, request: Request) -> Optional[str]:
        """Why ``auto`` passes it over (``None``: ``auto`` takes it)."""
        return self.unavailable(request)

    def build(self, request: Request, registry: "Registry") -> Communicator:
        raise NotImplementedError


class MpiTransport(Transport):
    """mpi4py, under an MPI launcher (:class:`MpiCommunicator`)."""

    name, chosen_because = "mpi", "mpi4py under an MPI launcher"

    def unavailable(self, request: Request) -> Optional[str]:
        return mpi_usable(*(request.horovod or (None, None))) or None

    def build(self, request: Request, registry: "Registry") -> Communicator:
        return MpiCommunicator(request.ranks, layer=request.layer)


class HorovodTransport(Transport):
    """Horovod's allreduce; the adapters build their framework's communicator."""

    name, chosen_because = "horovod", "hvd.init() has run"

    def unavailable(self, request: Request) -> Optional[str]:
        return None if request.horovod else "it needs hvd.init() first"


class Registry:
    """A framework's transports, in ``auto``'s order of preference, and the
    communicators built from them: one per transport and group of ranks per process."""

    def __init__(self, framework: str, *transports: Transport) -> None:
        self.framework = framework
        self.transports: Dict[str, Transport] = {}
        self.built: Dict[Any, Communicator] = {}
        for t in transports:
            self.register(t)

    def register(self, transport: Transport) -> None:
        """Add ``transport`` (after those registered before it, for ``auto``)."""
        self.transports[transport.name] = transport

    def requested(self, kind: Any, layer: str) -> Any:
        """:func:`requested_kind`, refusing a transport this framework does not have."""
        want = requested_kind(kind)
        if isinstance(want, str) and want != "auto" and want not in self.transports:
            names = ", ".join(repr(n) for n in ("auto", *self.transports))
            source = "comm" if kind is not None else f"${COMM_ENV}"
            raise ValueError(f"{layer}: {source}={want!r} is not a {self.framework} transport; "
                             f"with {self.framework} use {names}")
        return want

    def choose(self, kind: Any, request: Request) -> Tuple[Any, str]:
        """``(transport, why)`` for a layer's ``comm``: a :class:`Communicator` as it is, a
        named transport, or under ``auto`` the first that works here (``None`` if none)."""
        want = self.requested(kind, request.layer)
        if isinstance(want, Communicator):
            return want, "requested"
        if want != "auto":
            return self.transports[want], "requested"
        passed = []
        for transport in self.transports.values():
            why = transport.auto_unavailable(request)
            if why is None:
                return transport, "; ".join([transport.chosen_because, *passed])
            passed.append(f"not {transport.name}: {why}")
        return None, "; ".join(passed)

    def resolve(self, kind: Any, request: Request) -> Optional[Communicator]:
        """The communicator for a layer's ``comm`` (see :meth:`choose`), or ``None`` when
        this process is alone. Raises ``RuntimeError`` when the requested transport
        cannot work here, saying why."""
        chosen, why = self.choose(kind, request)
        if chosen is None:
            alone_in_a_launch(request.layer, self.framework, why)
        if chosen is None or isinstance(chosen, Communicator):
            return chosen if chosen is not None and chosen.size > 1 else None
        problem = chosen.unavailable(request)
        if problem:
            raise RuntimeError(f"{request.layer}: comm={chosen.name!r} is not usable here: {problem}")
        # Horovod's size and rank in the key: after an elastic reset a new world, new communicators
        comm = self.cached((chosen.name, request.key, request.horovod), lambda: chosen.build(request, self), why)
        return comm if comm.size > 1 else None

    def cached(self, key: Any, build: Callable[[], Communicator], why: str = "") -> Communicator:
        """The communicator built for ``key``, built now if new (the first one logged on rank 0)."""
        if key not in self.built:
            self.built[key] = build()
            if len(self.built) == 1 and self.built[key].rank == 0:
                log.warning("hvd_syncbn: statistics travel over %s (%s; ranks started by %s; set %s to change)",
                            key[0], why, launchers.launcher() or "no launcher", COMM_ENV)
        return self.built[key]


STRICT_ENV = "HVD_SYNCBN_STRICT"
_warned_alone = False


def alone_in_a_launch(layer: str, framework: str, why: str) -> None:
    """A layer found no transport: if a launcher started several processes, this one
    would silently normalise with its own statistics only. Warn once per process, naming
    the launch and what to do; raise ``RuntimeError`` instead under ``$HVD_SYNCBN_STRICT=1``."""
    global _warned_alone
    try:
        size = launchers.world_size()
    except ValueError:  # a malformed launcher variable says nothing reliable about a launch
        return
    if size is None or size < 2:
        return
    strict = env_flag(STRICT_ENV, False, "warn", "raise")
    if _warned_alone and not strict:
        return
    todo = ("call torch.distributed.init_process_group() before training, or hvd.init() (Horovod), or under "
            "mpirun install mpi4py" if framework == "PyTorch"
            else "call hvd.init() (Horovod) first, or under mpirun install mpi4py")
    message = (f"{layer}: this process is one of {size} started by {launchers.launcher()}, but {framework} "
               f"SyncBatchNorm found no transport ({why}), so it normalises with this process's statistics "
               f"only; {todo}")
    if strict:
        raise RuntimeError(f"{message} (an error because {STRICT_ENV}=1)")
    _warned_alone = True
    warnings.warn(f"{message}; set {STRICT_ENV}=1 to make this an error", RuntimeWarning)


DYNAMIC_SETS_ENV = "HOROVOD_DYNAMIC_PROCESS_SETS"


def process_set_of(hvd: Any, ranks: List[int], groups: List[List[int]], layer: str) -> Any:
    """The Horovod process set of ``ranks``, one of the BN groups ``groups`` (the same on
    every rank): registered at ``hvd.init(process_sets=...)``, else added now, every
    group of 2+ ranks in order on every rank (with dynamic process sets), else a
    ``ValueError`` saying how to register them. ``None`` for a group of one."""
    from horovod.common import process_sets

    def registered() -> Dict[tuple, int]:
        return {tuple(sorted(r)): i for i, r in process_sets._basics._get_process_set_ids_and_ranks().items()}

    missing = [g for g in groups if len(g) > 1 and tuple(g) not in registered()]
    if missing and os.environ.get(DYNAMIC_SETS_ENV, "0") in ("", "0"):
        sets = ", ".join(f"hvd.ProcessSet({g})" for g in missing)
        raise ValueError(f"{layer}: group_size needs a Horovod process set per group, expected {missing} to be "
                         f"registered; pass process_sets=[{sets}] to hvd.init(), or set {DYNAMIC_SETS_ENV}=1 "
                         f"(or hvd.init(process_sets='dynamic')) to have them added")
    for group in missing:
        hvd.add_process_set(group)
    if len(ranks) == 1:
        return None
    found = process_sets.ProcessSet(ranks)
    found.process_set_id = registered()[tuple(ranks)]
    return found


def not_a_member(layer: str, rank: int, ranks: Any) -> ValueError:
    """The error for a layer built on a rank outside its process set."""
    return ValueError(f"{layer}: this rank ({rank}) is not in the layer's process set {ranks}; "
                      f"build the layer only on member ranks")
