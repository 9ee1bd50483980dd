"""Rank-side check of Horovod's view of the hosts: local/cross rank and size, hostnames.

    launch/netns_hosts.sh --hosts 2 --slots 2 -- python tests/topology_check.py --hosts 2 --slots 2

Every rank asserts that it sees ``--hosts`` hosts of ``--slots`` ranks each, placed by
slot (ranks 0..S-1 on the first host), that the ranks of one host share a hostname and
no two hosts do, then prints one line ``topology {json}`` (with its scheduling group)
for the launching test to read.
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import horovod.torch as hvd


def autogroup() -> str | None:
    """This process's CPU scheduling group (Linux autogroup: one per session), or
    ``None`` where the kernel has none. The kernel prints nothing for a process in the
    default group (one whose session began before autogroup applied, as on CI's
    machine): that is ``"default"``, one group shared by all such processes."""
    try:
        with open("/proc/self/autogroup") as f:
            fields = f.read().split()
    except OSError:
        return None
    return fields[0] if fields else "default"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, required=True, help="expected hvd.cross_size()")
    parser.add_argument("--slots", type=int, required=True, help="expected hvd.local_size()")
    args = parser.parse_args()

    hvd.init()
    me = dict(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(), local_size=hvd.local_size(),
              cross_rank=hvd.cross_rank(), cross_size=hvd.cross_size(), hostname=socket.gethostname(),
              cycle_time=os.environ.get("HOROVOD_CYCLE_TIME"), autogroup=autogroup())
    everyone = hvd.allgather_object(me, name="topology_check")

    assert me["size"] == args.hosts * args.slots, f"expected {args.hosts} x {args.slots} ranks, got {me}"
    assert me["local_size"] == args.slots, f"expected local_size {args.slots}, got {me}"
    assert me["cross_size"] == args.hosts, f"expected cross_size {args.hosts}, got {me}"
    assert me["rank"] == me["cross_rank"] * args.slots + me["local_rank"], f"not placed by slot: {me}"
    names = {}
    for other in everyone:
        names.setdefault(other["cross_rank"], set()).add(other["hostname"])
    assert all(len(n) == 1 for n in names.values()), f"ranks of one host disagree on its hostname: {names}"
    assert len({n.pop() for n in names.values()}) == args.hosts, f"hosts share a hostname: {everyone}"
    print("topology " + json.dumps(me, sort_keys=True), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
