"""Allreduce time against message size, through Horovod and through mpi4py, for the
latency/bandwidth fit in ``scaling.py``.

    launch/mpirun.sh -np 2 -- python benchmarks/alphabeta.py        # prints a table

Every size is a float64 buffer summed in place; ``--iters`` rounds each time every size
through both transports, each call right after the barrier the layer benchmarks use
(``common.make_barrier``, a 1-element Horovod allreduce), so that the fit sees the
calls as they do: a Horovod call then starts just after a background cycle and waits
for the next one, and an mpi4py call meets its peers as they leave the barrier. (After
an ``MPI_Barrier`` instead, a Horovod call lands anywhere in the cycle and costs about
half as much: the fit then missed the layers' floors by 60-80%.) Rank 0 keeps each
point's median, lower quartile (``*_q1``, what the fit uses) and lower decile
(``*_p10``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

import horovod.torch as hvd
from common import make_barrier, write_json

SIZES = [1, 8, 64, 512, 4096, 32768, 262144]  # float64 elements: 8 B .. 2 MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--sizes", default=json.dumps(SIZES), help="JSON list of float64 element counts")
    parser.add_argument("--label", default="loopback")
    parser.add_argument("--out")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    sizes = json.loads(args.sizes)
    bufs = {n: (torch.zeros(n, dtype=torch.float64), np.zeros(n)) for n in sizes}
    fns = {n: {"horovod": lambda t=t, n=n: hvd.allreduce_(t, op=hvd.Sum, name=f"ab.{n}"),
               "mpi4py": lambda a=a: comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)}
           for n, (t, a) in bufs.items()}
    samples = {(n, k): [] for n in sizes for k in ("horovod", "mpi4py")}
    barrier = make_barrier(hvd)
    # Rounds over every size and transport, so that a burst of other load hits all alike.
    for i in range(3 + args.iters):
        for n in sizes:
            for k in ("horovod", "mpi4py") if i % 2 else ("mpi4py", "horovod"):
                barrier()
                start = time.perf_counter()
                fns[n][k]()
                if i >= 3:
                    samples[(n, k)].append((time.perf_counter() - start) * 1e3)
    rows = []
    for n in sizes:
        row = {"elems": n, "bytes": 8 * n}
        for k in ("horovod", "mpi4py"):
            s = sorted(samples[(n, k)])
            row[k] = statistics.median(s)
            row[f"{k}_q1"] = s[len(s) // 4]
            row[f"{k}_p10"] = s[len(s) // 10]
        rows.append(row)
    if hvd.rank() != 0:
        return
    host = os.uname().nodename
    result = {"ranks": hvd.size(), "label": args.label, "host0": host, "rows": rows,
              "cross_size": hvd.cross_size(), "local_size": hvd.local_size()}
    if args.out:
        return write_json(args.out, result)
    print(f"{args.label}: {hvd.size()} ranks ({hvd.cross_size()} hosts); allreduce median ms")
    print("| bytes | horovod | mpi4py |\n|---|---|---|")
    for r in rows:
        print(f"| {r['bytes']} | {r['horovod']:.3f} | {r['mpi4py']:.3f} |")


if __name__ == "__main__":
    main()
