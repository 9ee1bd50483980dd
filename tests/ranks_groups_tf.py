"""Keras BN groups launched at 4 ranks under mpirun (``test_launch.py``): groups of 2 and
``"node"`` groups of 3 and 1 (each rank's host faked) over MPI and Horovod (dynamic
process sets) on the host path, and over MPI inside XLA, each equal plain BN on the
group's concatenated batch, with unequal and empty shards."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hvd_syncbn import comm, groups
from oracle import KerasTrainer, conditioned, eval_batch, launched_group, train_like_one_process, training_batches

hvd = pytest.importorskip("horovod.tensorflow")
hvd.init()
import keras  # noqa: E402

from hvd_syncbn.tensorflow import SyncBatchNormalization  # noqa: E402

RANK, WORLD = hvd.rank(), hvd.size()
assert WORLD == 4, f"expected a launch of 4 ranks, got {WORLD}"
comm.set_timeout(float(os.environ.get("HVD_SYNCBN_TIMEOUT", "30")))
SIZES = [3, 0, 2, 4]
HOSTS = ["a", "a", "a", "b"]


@pytest.fixture(autouse=True)
def hosts(monkeypatch):
    monkeypatch.setattr(groups, "hostname", lambda: HOSTS[RANK])


def built(layer, tail=(5, 3)):
    layer.build((None, *tail))
    for name, lo, hi in (("gamma", 0.5, 1.5), ("beta", -0.3, 0.3)):
        getattr(layer, name).assign(np.linspace(lo, hi, 3))
    return layer


@pytest.mark.parametrize("transport, group_size, parts, compiled", [
    ("mpi", 2, [[0, 1], [2, 3]], False),
    ("horovod", 2, [[0, 1], [2, 3]], False),
    ("mpi", "node", [[0, 1, 2], [3]], "xla"),
    ("horovod", "node", [[0, 1, 2], [3]], False),
])
def test_each_group_matches_plain_bn_on_its_batch(transport, group_size, parts, compiled):
    mine, ranks = launched_group(RANK, WORLD, parts, lambda table, name: hvd.allreduce(
        table, op=hvd.Sum, name=f"oracle.{transport}.{group_size}.{name}").numpy())
    g, own, tail = parts.index(mine), [SIZES[r] for r in mine], (5, 3)
    layer = built(SyncBatchNormalization(comm=transport, group_size=group_size, name=f"bn_{transport}_{group_size}"))
    plain = built(keras.layers.BatchNormalization(dtype="float64"))
    train_like_one_process(ranks, own, training_batches(sum(own), tail, 2, seed=10 * g),
                           eval_batch(sum(own), tail, seed=10 * g), lambda i: KerasTrainer(layer, compiled),
                           [KerasTrainer(plain)], conditioned([-1]))
