"""A private ``torch.distributed`` process group over an MPI or Horovod communicator.

Rank 0 opens a ``TCPStore`` on a port the OS picks; its address crosses once over the
communicator (a summing allreduce, with the identity header and the deadline); the
ranks then build a ``ProcessGroup`` with Gloo for CPU tensors and NCCL for CUDA tensors.
The group is nobody's default: ``torch.distributed.is_initialized()`` stays ``False``.

It stays out of torch's ``_world`` tables (``_new_process_group_helper`` would put it
there, and wants a default group for a group of some ranks), so three private torch
APIs build it, as that helper does: ``ProcessGroup._register_backend`` (a backend per
device type), ``ProcessGroup._set_group_name`` and ``_register_process_group`` (the name
and the C++ registry by which functional collectives find the group).
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import os
import socket
import struct
from pathlib import Path
from typing import Any, Tuple

import numpy as np
import torch
import torch.distributed as dist
# Private: funcol resolves a group by its name in this C++ registry (torch's own
# _new_process_group_helper fills it); a group outside torch's _world tables must be put there.
from torch._C._distributed_c10d import _register_process_group

from hvd_syncbn.comm import allreduce
from hvd_syncbn.communicator import Communicator
from hvd_syncbn.diagnosis import RECORD_BYTES
from hvd_syncbn.identity import make_call
from hvd_syncbn.settings import collective_timeout, env_flag, get_timeout

log = logging.getLogger("hvd_syncbn")

ENV = "HVD_SYNCBN_PRIVATE_GROUP"
STORE_ADDR_ENV = "HVD_SYNCBN_STORE_ADDR"
_names = itertools.count()


def enabled() -> bool:
    """Whether a private group may be built: ``$HVD_SYNCBN_PRIVATE_GROUP`` (``1``, the default, or ``0``)."""
    return env_flag(ENV, True, "no private group", "the default")


def host_id() -> str:
    """This host and network namespace (where ``127.0.0.1`` leads): host name, boot id
    and network namespace, the last two where Linux has them."""
    parts = [socket.gethostname()]
    for read in (lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                 lambda: os.readlink("/proc/self/ns/net")):
        try:
            parts.append(read())
        except OSError:
            pass
    return "|".join(parts)


def interface_address(name: str) -> str:
    """The IPv4 address of this host's network interface ``name`` (Linux)."""
    import fcntl  # Linux/Unix only, as is the ioctl below

    names = [n for _, n in socket.if_nameindex()]
    if name not in names:
        raise ValueError(f"{STORE_ADDR_ENV}: expected iface:NAME with NAME one of rank 0's interfaces "
                         f"({', '.join(names)}), got iface:{name}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # SIOCGIFADDR
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            raise ValueError(f"{STORE_ADDR_ENV}: interface {name!r} of rank 0 has no IPv4 address ({e}); "
                             f"name another interface or give an address") from e
    return socket.inet_ntoa(packed[20:24])


def store_address(raw: Any) -> str:
    """What ranks connect to, decided on rank 0: ``$HVD_SYNCBN_STORE_ADDR`` (an address or
    host name, or ``iface:NAME`` for that interface's IPv4 address), else ``""`` (the
    default: see :func:`connect_to`)."""
    if raw is None:
        return ""
    value = raw.strip()
    if value.startswith("iface:"):
        return interface_address(value[len("iface:"):])
    if not value or any(c.isspace() for c in value):
        raise ValueError(f"{STORE_ADDR_ENV}: expected an address of rank 0's host that every rank can reach "
                         f"(e.g. 10.0.0.1 or node0) or iface:NAME (e.g. iface:eth0), got {raw!r}")
    try:
        socket.getaddrinfo(value, None)
    except OSError as e:
        raise ValueError(f"{STORE_ADDR_ENV}: expected an address of rank 0's host, got {raw!r}, which does "
                         f"not resolve on rank 0 ({e})") from e
    return value


def own_address() -> str:
    """Rank 0's address for ranks on other hosts: the first non-loopback IPv4 address its
    host name resolves to, else the first of its interfaces' (in the kernel's order),
    else the host name (for the other ranks to resolve)."""
    name = socket.gethostname()
    try:
        found = [info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)]
    except OSError:
        found = []
    for _, iface in socket.if_nameindex():
        try:
            found.append(interface_address(iface))
        except ValueError:  # no IPv4 address
            pass
    return next((a for a in found if not a.startswith("127.")), name)


def connect_to(offer: dict) -> str:
    """Where this rank finds rank 0's store: the address set on rank 0, else loopback on
    rank 0's host (and network namespace), else rank 0's own address."""
    if offer["addr"]:
        return offer["addr"]
    return "127.0.0.1" if offer["host"] == host_id() else offer["default"]


def _broadcast(over: Communicator, offer: dict, timeout: float, layer: str) -> dict:
    """Rank 0's ``offer`` on every rank: one summing allreduce of its JSON bytes (zeros
    elsewhere), at ``layer``'s first collective (the name a diagnosis gives it)."""
    buf = np.zeros(RECORD_BYTES)
    if over.rank == 0:
        raw = json.dumps(offer).encode()
        if len(raw) > RECORD_BYTES:
            raw = json.dumps({"error": f"the store's address is too long: {offer}"[:900]}).encode()
        buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    call = make_call(over, layer, "bootstrap", RECORD_BYTES, 1, "uint8")
    out = allreduce(over, buf, call, timeout)
    return json.loads(bytes(np.rint(out).astype(np.uint8)).rstrip(b"\0").decode())


def build(over: Communicator, layer: str = "private_group",
          compiling: bool = False) -> Tuple[dist.ProcessGroup, dist.Store]:
    """A process group of ``over``'s ranks (same rank numbers), and the store it needs
    alive (NCCL exchanges its ids over it at the first collective), made at ``layer``'s
    first collective.

    The store waits by :func:`hvd_syncbn.settings.get_timeout`; where ``compiling``
    (``torch.compile`` traces), the broadcast and the group also wait
    :func:`hvd_syncbn.settings.compile_timeout` more, as a peer may still be compiling (a
    functional collective waits by the group's timeout).
    """
    rank, size = over.rank, over.size
    timeout = get_timeout()
    grace = datetime.timedelta(seconds=collective_timeout(compiling))
    wait = datetime.timedelta(seconds=timeout)
    store, offer = None, {}
    if rank == 0:
        try:
            addr = store_address(os.environ.get(STORE_ADDR_ENV))
            store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=wait, wait_for_workers=False)
            offer = dict(addr=addr, host=host_id(), default=own_address(), port=store.port)
        except (ValueError, RuntimeError) as e:  # every rank raises it, rather than waiting for rank 0
            offer = {"error": str(e)}
    offer = _broadcast(over, offer, grace.total_seconds(), layer)
    if "error" in offer:
        raise RuntimeError(f"hvd_syncbn: rank 0 could not open the private group's store: {offer['error']}")
    addr = connect_to(offer)
    try:
        if store is None:
            store = dist.TCPStore(addr, offer["port"], size, False, timeout=wait)
        pg = dist.ProcessGroup(store, rank, size)
        backends = [("cpu", dist.ProcessGroupGloo, dist.ProcessGroup.BackendType.GLOO)]
        if torch.cuda.is_available() and dist.is_nccl_available():  # NCCL only where it can work
            backends.append(("cuda", dist.ProcessGroupNCCL, dist.ProcessGroup.BackendType.NCCL))
        for kind, backend, backend_type in backends:
            # Private, as in torch's _new_process_group_helper: one backend per device type.
            pg._register_backend(torch.device(kind), backend_type,
                                 backend(dist.PrefixStore(f"{kind}/", store), rank, size, wait))
    except RuntimeError as e:  # torch's DistStoreError and Gloo's connect errors are RuntimeErrors
        raise RuntimeError(
            f"hvd_syncbn: rank {rank} could not join the private group at rank 0's store {addr}:{offer['port']} "
            f"within {timeout:g} s ({str(e).splitlines()[0] if str(e) else type(e).__name__}); set "
            f"{STORE_ADDR_ENV} to an address of rank 0's host that every rank can reach, or iface:NAME") from e
    pg.set_timeout(grace)  # connecting took our timeout; a collective may wait on a compiling peer
    name = f"hvd_syncbn.private.{next(_names)}"  # unique in this process (the store is the group's own)
    pg._set_group_name(name)  # private: the name funcol passes to its ops
    _register_process_group(name, pg)
    if rank == 0:
        log.warning("hvd_syncbn: a private torch.distributed group (%s) over %s, its store on port %d",
                    " and ".join(t.name.lower() for _, _, t in backends), over.kind, offer["port"])
    return pg, store


def release(pg: dist.ProcessGroup) -> None:
    """Take :func:`build`'s group out of torch's registry, so that once its holder drops it
    the group is destroyed, which joins Gloo's worker threads (``shutdown()`` does not)."""
    unregister = getattr(torch._C._distributed_c10d, "_unregister_process_group", None)  # private, as above
    if unregister is not None:
        unregister(pg.group_name)
