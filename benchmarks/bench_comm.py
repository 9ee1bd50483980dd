"""Per-layer forward+backward of SyncBN over each transport against compute only.

    mpirun -np 2 --mca mpi_yield_when_idle 1 python benchmarks/bench_comm.py --framework torch
    mpirun -np 2 --mca mpi_yield_when_idle 1 python benchmarks/bench_comm.py --framework tf

One framework per run: two Horovod instances in one process (torch's and TF's, each
with a background thread) would compete for the cores and distort both.

"compute only" is the same layer with :class:`hvd_syncbn.comm.LocalCommunicator`: every
step of the layer (packing, header, checks) except the transport. Medians of
interleaved runs, measured in this run; rank 0 prints ms and the excess over compute.

"last arrival's wait": over the MPI path, each rank times every collective from start
to completion; the rank that arrives last waits only for the transport, not for a
slower peer. Its wait, summed over the layer's two collectives (median over calls), is
what the MPI transport itself costs per layer; the rest of the excess is ranks waiting
for each other's compute, which any SyncBN pays.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

SHAPES = [(8, 64, 56, 56), (2, 256, 64, 64), (8, 512, 28, 28), (4, 2048, 7, 7), (2, 64, 128, 128)]
# The 53 BN layers of ResNet-50: stem, then per stage (blocks x 3 layers) + the projection's.
RESNET50 = [64] + [c for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3))
                   for c in [width, width, 4 * width] * blocks + [4 * width]]
PATHS = ["local", "mpi", "horovod"]


def timed(fns, iters, barrier):
    """Per round, every fn once (rotating order), each started together on all ranks.
    Returns ``[(median ms, median of the per-round difference to fns[0])]``: pairing
    within a round cancels the drift of a shared 2-core machine."""
    samples = [[] for _ in fns]
    for i in range(iters + 3):
        for j in [(i + k) % len(fns) for k in range(len(fns))]:
            barrier()
            start = time.perf_counter()
            fns[j]()
            if i >= 3:
                samples[j].append((time.perf_counter() - start) * 1e3)
    return [(statistics.median(s), statistics.median(a - b for a, b in zip(s, samples[0]))) for s in samples]


class Waits:
    """Per-collective start-to-completion times of a communicator class's instances."""

    def __init__(self):
        self.seconds, self.on = [], False

    def timed(self, cls):
        waits = self

        class Timed(cls):
            def start(self, buf, name):
                self._began = time.perf_counter()
                return super().start(buf, name)

            def done(self, handle):
                finished = super().done(handle)
                if finished and waits.on and self._began is not None:
                    waits.seconds.append(time.perf_counter() - self._began)
                    self._began = None
                return finished

        return Timed

    def measure(self, fns, iters, barrier, comm, per_call=2):
        """``timed`` of the paths' ``fns``, then the MPI path's last-arrival wait."""
        return timed(fns, iters, barrier), self.last_arrival_ms(fns[PATHS.index("mpi")], iters, barrier, comm,
                                                                 per_call)

    def last_arrival_ms(self, fn, iters, barrier, comm, per_call=2):
        """Median over ``iters`` calls of ``fn`` (``per_call`` collectives each) of the
        summed per-collective minimum over ranks of the wait, in ms."""
        self.seconds, self.on = [], True
        for _ in range(iters):
            barrier()
            fn()
        self.on = False
        mine = np.array(self.seconds)
        assert len(mine) == per_call * iters, f"expected {per_call * iters} collectives, timed {len(mine)}"
        least = np.min(comm.allgather(mine), axis=0)
        return float(np.median(least.reshape(iters, per_call).sum(axis=1)) * 1e3)


def comms(comm_module, world, rank, waits):
    from hvd_syncbn.mpi import MpiCommunicator

    return {"local": comm_module.LocalCommunicator(world, rank), "mpi": waits.timed(MpiCommunicator)(),
            "horovod": "horovod"}


def bench_torch(iters, world, rank, barrier, mpi):
    import torch
    from hvd_syncbn import comm
    from hvd_syncbn.torch import SyncBatchNorm

    torch.set_num_threads(1)
    rows = []
    for n, c, h, w in SHAPES:
        x = torch.randn(n, c, h, w, requires_grad=True)
        dy = torch.randn(n, c, h, w)
        fns, waits = [], Waits()
        for path, kind in comms(comm, world, rank, waits).items():
            layer = SyncBatchNorm(c, comm=kind, name=f"bench.{path}.{c}.{h}")

            def step(layer=layer):
                x.grad = None
                layer(x).backward(dy)

            fns.append(step)
        rows.append(((n, c, h, w), *waits.measure(fns, iters, barrier, mpi)))
    return rows


def bench_tf(iters, world, rank, barrier, mpi):
    import tensorflow as tf
    from hvd_syncbn import comm
    from hvd_syncbn.tensorflow import SyncBatchNormalization

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rows = []
    for n, c, h, w in SHAPES:
        x = tf.random.normal([n, h, w, c])
        dy = tf.random.normal([n, h, w, c])
        fns, waits = [], Waits()
        for path, kind in comms(comm, world, rank, waits).items():
            layer = SyncBatchNormalization(comm=kind, name=f"bench_{path}_{c}_{h}")
            layer.build(x.shape)

            @tf.function
            def step(layer=layer):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = layer(x, training=True)
                return tape.gradient(y, x, output_gradients=dy)

            step()
            fns.append(lambda step=step: step().numpy())
        rows.append(((n, h, w, c), *waits.measure(fns, iters, barrier, mpi)))
    return rows


def bench_torch_stack(iters, world, rank, barrier, mpi):
    """Forward then backward through ResNet-50's 53 BN layers on (2, C, 4, 4) maps: the
    per-step cost of the statistics collectives, which run one after another."""
    import torch
    from hvd_syncbn import comm
    from hvd_syncbn.torch import SyncBatchNorm

    torch.set_num_threads(1)
    xs = [torch.randn(2, c, 4, 4, requires_grad=True) for c in RESNET50]
    fns, waits = [], Waits()
    for path, kind in comms(comm, world, rank, waits).items():
        layers = [SyncBatchNorm(c, comm=kind, name=f"stack.{path}.{i}") for i, c in enumerate(RESNET50)]

        def step(layers=layers):
            sum(layer(x).sum() for layer, x in zip(layers, xs)).backward()

        fns.append(step)
    return waits.measure(fns, iters, barrier, mpi, per_call=2 * len(RESNET50))


def report(title, rows):
    print(f"\n{title} (ms per layer, fwd+bwd; medians; excess: median over rounds of path - compute only)")
    print("| shape | compute only | " + " | ".join(f"{p} | {p} excess" for p in PATHS[1:])
          + " | mpi: last arrival's wait |")
    print("|---|---|" + "---|---|" * (len(PATHS) - 1) + "---|")
    for shape, ((local, _), *others), last in rows:
        cells = " | ".join(f"{t:.2f} | {d:+.2f}" for t, d in others)
        print(f"| {shape} | {local:.2f} | {cells} | {last:.3f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--framework", choices=["torch", "tf"], default="torch")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from mpi4py import MPI

    world, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    barrier = MPI.COMM_WORLD.Barrier
    if args.framework == "torch":
        import horovod.torch as hvd

        hvd.init()
        rows = bench_torch(args.iters, world, rank, barrier, MPI.COMM_WORLD)
        ((local, _), *others), last = bench_torch_stack(args.iters, world, rank, barrier, MPI.COMM_WORLD)
        if rank == 0:
            report(f"PyTorch, {world} ranks under mpirun", rows)
            print(f"\nResNet-50's {len(RESNET50)} BN layers, fwd+bwd per step (ms): compute only {local:.2f}; "
                  + "; ".join(f"{p} {t:.2f} ({d:+.2f})" for p, (t, d) in zip(PATHS[1:], others))
                  + f"; mpi saves {others[1][1] - others[0][1]:.2f} ms per step over horovod"
                  + f"; over mpi the last arrival waits {last:.2f} ms per step in all")
    else:
        import horovod.tensorflow as hvd_tf

        hvd_tf.init()
        rows = bench_tf(args.iters, world, rank, barrier, MPI.COMM_WORLD)
        if rank == 0:
            report(f"Keras, {world} ranks under mpirun", rows)


if __name__ == "__main__":
    main()
