#!/usr/bin/env python3
"""A lossy, slow network between the namespace hosts of ``netns_hosts.sh --relay``:
one process forwards IP packets between TUN devices, dropping and delaying them.

    netns_relay.py --loss 0.05 --delay-ms 20 NAME=IP [NAME=IP ...]

Makes one TUN device per ``NAME=IP`` here (in the namespace it starts in), prints
``ready`` on stdout, then forwards each IPv4 packet that one device's side sends to the
device whose ``IP`` is the packet's destination (any other destination: the first
device), after dropping it with probability ``--loss`` and holding it ``--delay-ms``.
The devices can be moved to other namespaces once ``ready`` is printed (``ip link set
NAME netns NS name eth0``): the relay keeps their file descriptors, and the devices go
away with it. SIGUSR1 cuts every link (a partition: from then on every packet is
dropped), SIGUSR2 mends them. It dies with its parent (``PR_SET_PDEATHSIG``), and on
SIGTERM or SIGINT prints how many packets it forwarded and dropped. Run it at real-time priority
(``chrt -f 50``): ranks that busy-wait on every core otherwise delay it by far more than
``--delay-ms``, and a test then measures the relay instead of the network. Standard
library only; Linux, root (or CAP_NET_ADMIN).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import heapq
import os
import random
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
PR_SET_PDEATHSIG = 1


def open_tun(name: str) -> int:
    """A new TUN device ``name`` (IP packets, no packet-info header); its file descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


def die_with_parent() -> None:
    """SIGTERM when the process that started us ends (it may already have ended)."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:
        sys.exit(1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loss", type=float, default=0.0, help="probability to drop each packet (default 0)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added to each packet's way (default 0)")
    parser.add_argument("--seed", type=int, default=None, help="for the drops (default: from the clock)")
    parser.add_argument("devices", nargs="+", metavar="NAME=IP", help="a TUN device to make, and its side's IPv4")
    args = parser.parse_args()
    if not 0 <= args.loss < 1:
        parser.error(f"--loss: expected a probability in [0, 1), got {args.loss}")
    if args.delay_ms < 0:
        parser.error(f"--delay-ms: expected 0 or more, got {args.delay_ms}")
    for device in args.devices:
        name, _, ip = device.partition("=")
        if not (name and 0 < len(name) <= 15 and ip.count(".") == 3):
            parser.error(f"expected NAME=IP (a name of at most 15 characters, an IPv4 address), got {device!r}")
    return args


def relay(fds: dict, default_fd: int, loss: float, delay: float, rng: random.Random, counts: dict,
          cut: dict) -> None:
    """Forwards forever: reads every ready device, queues what survives the loss (and
    ``cut["now"]``, a partition) for its due time, writes what is due. ``fds`` maps a
    destination (4 bytes) to its device."""
    queue: list = []  # (due, sequence, fd, packet): equal delays keep each device's order
    sequence = 0
    poller = select.poll()
    for fd in set(fds.values()):
        poller.register(fd, select.POLLIN)
    while True:
        wait_ms = max(0.0, (queue[0][0] - time.monotonic()) * 1000) if queue else None
        for fd, _ in poller.poll(wait_ms):
            while True:
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:  # EBADFD: the device went away (its namespace was deleted)
                    poller.unregister(fd)
                    break
                if len(packet) < 20 or packet[0] >> 4 != 4:  # not IPv4 (IPv6 router solicitations)
                    counts["other"] += 1
                    continue
                if cut["now"]:
                    counts["cut"] += 1
                    continue
                if loss and rng.random() < loss:
                    counts["dropped"] += 1
                    continue
                sequence += 1
                heapq.heappush(queue, (time.monotonic() + delay, sequence, fds.get(packet[16:20], default_fd), packet))
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, fd, packet = heapq.heappop(queue)
            try:
                os.write(fd, packet)
                counts["forwarded"] += 1
            except OSError:  # the device is down (a host cut off): as a lost packet
                counts["dropped"] += 1


def main() -> None:
    args = parse_args()
    die_with_parent()
    fds, first = {}, None
    for device in args.devices:
        name, _, ip = device.partition("=")
        fd = open_tun(name)
        fds[bytes(map(int, ip.split(".")))] = fd
        first = fd if first is None else first
    counts = {"forwarded": 0, "dropped": 0, "cut": 0, "other": 0}
    cut = {"now": False}

    def report(signum: int, _frame) -> None:
        sent = counts["forwarded"] + counts["dropped"]
        print(f"[netns_relay] {counts['forwarded']} packets forwarded, {counts['dropped']} dropped "
              f"({100 * counts['dropped'] / max(sent, 1):.1f}% of {sent}; --loss {args.loss:g}), each delayed "
              f"{args.delay_ms:g} ms; {counts['cut']} dropped by a cut (SIGUSR1); {counts['other']} not IPv4, ignored",
              file=sys.stderr, flush=True)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, report)
    signal.signal(signal.SIGINT, report)
    signal.signal(signal.SIGUSR1, lambda *_: cut.update(now=True))
    signal.signal(signal.SIGUSR2, lambda *_: cut.update(now=False))
    print("ready", flush=True)
    relay(fds, first, args.loss, args.delay_ms / 1000, random.Random(args.seed), counts, cut)


if __name__ == "__main__":
    main()
