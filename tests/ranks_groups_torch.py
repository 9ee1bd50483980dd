"""BN groups launched at 4 ranks under mpirun (``test_launch.py``), over each PyTorch
transport in one launch: MPI, Horovod (dynamic process sets) and ``torch.distributed``
(Gloo). Groups of 2, and ``"node"`` groups of 3 and 1 (each rank's host faked: every
rank runs on this machine), each equal plain BN on the group's concatenated batch, with
unequal and empty shards; ``nn.DataParallel``'s replicas in each process of a group; a
bad input inside a group named by the launch's ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from data_parallel import net, parallel_apply, replicate
from hvd_syncbn import comm, groups
from hvd_syncbn.torch import SyncBatchNorm, convert_sync_batchnorm
from oracle import (
    TorchTrainer, as_accurate, assert_close, eval_batch, global_batch, launched_group, shard_slice,
    train_like_one_process, training_batches,
)

hvd = pytest.importorskip("horovod.torch")
hvd.init()
RANK, WORLD = hvd.rank(), hvd.size()
assert WORLD == 4, f"expected a launch of 4 ranks, got {WORLD}"
comm.set_timeout(float(os.environ.get("HVD_SYNCBN_TIMEOUT", "30")))
dist.init_process_group("gloo", init_method=os.environ["HVD_SYNCBN_TEST_INIT"], rank=RANK, world_size=WORLD)
SIZES = [3, 0, 2, 4]  # rows per rank: unequal, one empty
HOSTS = ["a", "a", "a", "b"]  # for "node": groups [0, 1, 2] and [3]


@pytest.fixture(autouse=True)
def hosts(monkeypatch):
    monkeypatch.setattr(groups, "hostname", lambda: HOSTS[RANK])


def world_sum(table, name):
    summed = torch.from_numpy(table)
    dist.all_reduce(summed)
    return summed.numpy()


def in_group(parts):
    """This rank's group of ``parts`` and its :class:`~oracle.Ranks`."""
    return launched_group(RANK, WORLD, parts, world_sum)


@pytest.mark.parametrize("group_size, parts", [(2, [[0, 1], [2, 3]]), ("node", [[0, 1, 2], [3]])], ids=["2", "node"])
@pytest.mark.parametrize("transport", ["mpi", "horovod", "torch"])
def test_each_group_matches_plain_bn_on_its_batch(transport, group_size, parts):
    mine, ranks = in_group(parts)
    g = parts.index(mine)
    tail, own = (3, 4, 4), [SIZES[r] for r in mine]
    plain = nn.BatchNorm2d(3, dtype=torch.float64)
    layer = SyncBatchNorm(3, comm=transport, group_size=group_size, name=f"bn_{transport}_{group_size}")
    got = train_like_one_process(
        ranks, own, training_batches(sum(own), tail, 2, seed=10 * g), eval_batch(sum(own), tail, seed=10 * g),
        lambda i: TorchTrainer(layer), [TorchTrainer(plain.float()), TorchTrainer(nn.BatchNorm2d(3).double())],
        as_accurate(alone=len(mine) == 1))
    assert got
    used = layer._comm()
    assert (used is None) == (len(mine) == 1), used
    if used is not None:
        assert (used.kind, used.size, used.launch_ranks(list(range(used.size)))) == (transport, len(mine), mine)


def test_replicas_of_each_process_and_the_processes_of_a_group_match_plain_bn():
    """2 DataParallel replicas per process, BN groups of 2 processes over MPI: each group
    equals plain float64 BN on its 4 replicas' rows."""
    parts = [[0, 1], [2, 3]]
    mine, _ = in_group(parts)
    own = [SIZES[r] for r in mine]
    ours = convert_sync_batchnorm(net(False).float(), stats="device", comm="mpi", group_size=2)
    plain = net(False)
    x = torch.from_numpy(global_batch(parts.index(mine), sum(own), (3, 6, 6), offset=2.0))
    rows = shard_slice(own, mine.index(RANK))
    half = (own[mine.index(RANK)] + 1) // 2
    xs = [part.clone().requires_grad_() for part in (x[rows][:half], x[rows][half:])]
    ys = parallel_apply(replicate(ours, 2), xs)
    for y in ys:
        if isinstance(y, BaseException):
            raise y
    sum(y.sum() for y in ys).backward()
    xd = x.double().requires_grad_()
    plain(xd).sum().backward()
    assert_close(torch.cat([x.grad for x in xs]), xd.grad[rows], "x.grad", rtol=1e-4, atol=1e-4)
    for name, b in plain.named_buffers():
        assert_close(dict(ours.named_buffers())[name], b, name, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transport", ["mpi", "torch"])
def test_a_bad_input_in_a_group_is_named_by_the_launch_ranks(transport):
    """Rank 3 feeds 2 channels to a 3-channel layer: ranks 2 and 3 raise, naming rank 3
    and their group; ranks 0 and 1 train on."""
    layer = SyncBatchNorm(3, comm=transport, group_size=2, name=f"bad_{transport}")
    x = torch.ones(2, 2 if RANK == 3 else 3, 2, 2)
    if RANK < 2:
        layer(x)
        return
    with pytest.raises(comm.SyncBatchNormError) as raised:  # rank 3's a SyncBatchNormInputError too
        layer(x)
    assert "(SyncBN's group of ranks [2, 3])" in str(raised.value) and "rank 3: bad_" in str(raised.value), \
        str(raised.value)
