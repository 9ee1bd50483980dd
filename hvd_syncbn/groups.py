"""BN groups: a layer's ``group_size`` splits its ranks into groups that each synchronize
among themselves (apex's ``group_size``, MLPerf ResNet's ``bn_group``): ``k`` consecutive
ranks, or ``"node"``, the ranks of one host.

At a layer's first synchronized call every rank of the world says which host it is on in
one collective (named, bounded and diagnosed as a layer's), which also shows that every
rank asked for the same ``group_size``; each transport's communicator then makes the
group's own (:meth:`~hvd_syncbn.communicator.Communicator.subgroup`). A group of one rank
is plain BN and makes no collective. This module imports no framework.
"""

from __future__ import annotations

import hashlib
import socket
from typing import Any, List, Optional

import numpy as np

from hvd_syncbn.communicator import Communicator
from hvd_syncbn.identity import Call

NODE = "node"


def check_group_size(where: str, group_size: Any, explicit: Any = None) -> Any:
    """``group_size`` checked: ``None`` (all ranks), a positive int, or ``"node"``; never
    together with an explicit group (``explicit``: a process set, group or communicator)."""
    if group_size is None:
        return None
    if isinstance(group_size, bool) or not (isinstance(group_size, int) and group_size >= 1 or group_size == NODE):
        raise ValueError(f"{where}: expected group_size to be a positive int or 'node', got {group_size!r}")
    if explicit is not None:
        raise ValueError(f"{where}: expected group_size or an explicit group of ranks ({explicit!r}), got both; "
                         f"group_size makes the groups itself, so drop one of them")
    return group_size


def partition(group_size: Any, size: int, hosts: Optional[List[int]] = None, where: str = "SyncBatchNorm") -> List[List[int]]:
    """The groups of a world of ``size`` ranks: ``k`` consecutive ranks each, or with
    ``"node"`` the ranks of each host (``hosts``: each rank's host, in rank order; groups
    in order of their first rank, and of any sizes)."""
    if group_size == NODE:
        groups: dict = {}
        for rank, host in enumerate(hosts):
            groups.setdefault(host, []).append(rank)
        return list(groups.values())
    if size % group_size:
        fits = [k for k in range(1, size + 1) if size % k == 0]
        raise ValueError(f"{where}: group_size={group_size} does not divide the {size} ranks; expected one of {fits} "
                         f"or 'node'")
    return [list(range(start, start + group_size)) for start in range(0, size, group_size)]


def hostname() -> str:
    """This process's host, as ``"node"`` groups see it."""
    return socket.gethostname()


def _host_id(name: str) -> float:
    """``name`` as a float64 that sums exactly (48 bits, never 0)."""
    return float(int.from_bytes(hashlib.sha1(name.encode()).digest()[:6], "big") + 1)


def grouped(world: Optional[Communicator], group_size: Any, layer: str) -> Optional[Communicator]:
    """The communicator of this rank's group of ``world`` (``None``: alone, or a group of
    one: plain BN), made at the first call for each ``group_size`` and kept."""
    if world is None or group_size is None:
        return world
    made = world.__dict__.setdefault("_groups", {})
    if group_size not in made:
        made[group_size] = _split(world, group_size, layer)
    return made[group_size]


def _split(world: Communicator, group_size: Any, layer: str) -> Optional[Communicator]:
    if group_size != NODE:
        partition(group_size, world.size, where=layer)  # a k that does not divide raises on every rank alike
    if group_size in (1, world.size):
        return None if group_size == 1 else world
    from hvd_syncbn.comm import allreduce  # comm builds on the modules this one does

    call = Call(layer, f"group_size={group_size}", -1, 0, 0, "", world.rank)
    world.prepare(call)
    row = np.zeros(world.size)
    row[world.rank] = _host_id(hostname())
    hosts = allreduce(world, row, call).tolist()
    groups = partition(group_size, world.size, hosts, layer)
    if len(groups) == 1 or len(groups) == world.size:
        return world if len(groups) == 1 else None
    mine = next(g for g in groups if world.rank in g)
    # on every rank, a group of one's too: Horovod adds its sets on all ranks together
    sub = world.subgroup(world.launch_ranks(mine), [world.launch_ranks(g) for g in groups], layer)
    return sub if sub.size > 1 else None
