"""BN groups (``group_size``) in one process: worlds of 4 threads split into groups that
each equal plain BN on their own concatenated batch, in both frameworks; ``"node"``
groups of unequal size; a group of one is plain BN with no collective; the refusals.
The transports' own groups (MPI, Horovod, torch.distributed) run launched, in
tests/ranks_groups.py."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest

from conftest import collective_timeout, results, run, tensorflow, world
from hvd_syncbn import groups
from oracle import (
    EMPTY, UNEQUAL, KerasTrainer, Ranks, TorchTrainer, as_accurate, conditioned, eval_batch, shard_sizes,
    train_like_one_process, training_batches,
)

STEPS = 2
_host = threading.local()


@pytest.fixture(autouse=True)
def hosts(monkeypatch):
    """Each rank's host, as the rank's thread sets it (``_host.name``)."""
    monkeypatch.setattr(groups, "hostname", lambda: _host.name)
    with collective_timeout(10.0):
        yield


def in_groups(comms, layers, parts, sizes, tail, make_trainer, references, compare, seed_of=lambda g: 10 * g):
    """Each group of ``parts`` (ranks of ``comms``) trains on batches of its own, all
    groups at once, each checked against ``references(g)`` on its concatenated batch."""
    def group(g, _):
        ranks = parts[g]
        sub = [comms[r] for r in ranks]
        held = Ranks(len(ranks), lambda fn: dict(enumerate(results(run(len(ranks), lambda i, c: fn(i), sub)))),
                     lambda values, name: sum(values.values()))
        own = [sizes[r] for r in ranks]
        rows = sum(own)
        return train_like_one_process(
            held, own, training_batches(rows, tail, STEPS, seed=seed_of(g)), eval_batch(rows, tail, seed=seed_of(g)),
            lambda i: make_trainer(layers[ranks[i]]), references(g), compare)

    return results(run(len(parts), group))


def torch_layers(size, channels, **sync):
    import torch
    from torch import nn

    from hvd_syncbn.torch import SyncBatchNorm

    comms = world(size)
    layers = [SyncBatchNorm(channels, name="bn", comm=c, **sync) for c in comms]
    plain = nn.BatchNorm2d(channels, dtype=torch.float64)
    with torch.no_grad():
        for layer in (plain, *layers):
            layer.weight.copy_(torch.linspace(0.5, 1.5, channels))
            layer.bias.copy_(torch.linspace(-0.3, 0.3, channels))
    return comms, layers, plain


def on_host(trainer_of, hosts_by_layer):
    def make(layer):
        _host.name = hosts_by_layer[id(layer)]
        return trainer_of(layer)
    return make


@pytest.mark.parametrize("pattern", [UNEQUAL, EMPTY], ids=["unequal", "empty"])
def test_torch_groups_of_two_each_match_plain_bn_on_their_batch(pattern):
    """4 ranks, ``group_size=2``: ranks 0-1 and 2-3 each equal plain BN (float64) on
    their own concatenated batch (outputs, every gradient, running statistics), as close
    as plain float32 BN is; the two groups' running statistics differ; each step is one
    collective per direction on the group's communicator, and the world made one (the
    hosts) before the first."""
    tail, sizes = (3, 4, 4), shard_sizes(pattern, 4)
    comms, layers, plain = torch_layers(4, 3, group_size=2)
    make = on_host(TorchTrainer, {id(m): "h" for m in layers})
    in_groups(comms, layers, [[0, 1], [2, 3]], sizes, tail, make,
              lambda g: [TorchTrainer(copy.deepcopy(plain).float()), TorchTrainer(copy.deepcopy(plain))],
              as_accurate())
    assert not np.allclose(layers[0].running_mean.numpy(), layers[2].running_mean.numpy())
    assert [c.calls for c in comms] == [1] * 4, "expected one collective of the world: the hosts"
    subs = [layers[r]._comm() for r in range(4)]
    assert [(s.rank, s.size, s.ranks, s.calls) for s in subs] == [
        (r % 2, 2, [2 * (r // 2), 2 * (r // 2) + 1], 2 * STEPS) for r in range(4)]


def test_torch_node_groups_of_unequal_size_and_a_lone_rank():
    """``group_size="node"`` with ranks 0-2 on one host and rank 3 on another: ranks 0-2
    equal plain BN on their batch; rank 3, a group of one, is plain BN on its own and
    makes no collective after the hosts' exchange."""
    tail, sizes = (3, 4, 4), [3, 2, 4, 5]
    comms, layers, plain = torch_layers(4, 3, group_size="node")
    make = on_host(TorchTrainer, {id(m): "a" if r < 3 else "b" for r, m in enumerate(layers)})
    in_groups(comms, layers, [[0, 1, 2], [3]], sizes, tail, make,
              lambda g: [TorchTrainer(copy.deepcopy(plain).float()), TorchTrainer(copy.deepcopy(plain))],
              as_accurate(alone=False))
    assert layers[3]._comm() is None
    assert [c.calls for c in comms] == [1] * 4


def test_group_size_one_is_plain_bn_without_a_collective():
    comms, layers, plain = torch_layers(2, 3, group_size=1)
    make = on_host(TorchTrainer, {id(m): "h" for m in layers})
    in_groups(comms, layers, [[0], [1]], [3, 4], (3, 4, 4), make,
              lambda g: [TorchTrainer(copy.deepcopy(plain).float()), TorchTrainer(copy.deepcopy(plain))],
              as_accurate(alone=True))
    assert [c.calls for c in comms] == [0, 0]


def test_keras_groups_of_two_each_match_plain_bn_on_their_batch():
    """As the torch test, for SyncBatchNormalization (eager, the host path), shards
    unequal with an empty one."""
    tensorflow()
    keras = pytest.importorskip("keras")
    from hvd_syncbn.tensorflow import SyncBatchNormalization

    tail, sizes = (5, 5, 3), [3, 0, 2, 4]
    comms = world(4)
    plain = keras.layers.BatchNormalization(dtype="float64")
    layers = [SyncBatchNormalization(comm=c, name="bn", group_size=2) for c in comms]
    for layer in (plain, *layers):
        layer.build((None, *tail))
        for name, lo, hi in (("gamma", 0.5, 1.5), ("beta", -0.3, 0.3)):
            getattr(layer, name).assign(np.linspace(lo, hi, 3))
    make = on_host(KerasTrainer, {id(m): "h" for m in layers})
    weights = plain.get_weights()

    def reference(g):
        ref = keras.layers.BatchNormalization(dtype="float64")
        ref.build((None, *tail))
        ref.set_weights(weights)
        return [KerasTrainer(ref)]

    in_groups(comms, layers, [[0, 1], [2, 3]], sizes, tail, make, reference, conditioned([-1]))
    assert not np.allclose(layers[0].moving_mean.numpy(), layers[2].moving_mean.numpy())


@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "nodes"])
def test_a_bad_group_size_is_refused_saying_what_is_expected(bad):
    from hvd_syncbn.torch import SyncBatchNorm

    with pytest.raises(ValueError, match=rf"SyncBatchNorm: expected group_size to be a positive int or 'node', "
                                         rf"got {bad!r}"):
        SyncBatchNorm(4, group_size=bad)


def test_group_size_with_an_explicit_group_is_refused_everywhere():
    """(The Lightning plugin's: tests/unit/test_lightning_plugin.py.)"""
    torch_nn = pytest.importorskip("torch.nn")
    from hvd_syncbn.torch import SyncBatchNorm, convert_sync_batchnorm

    for make in (lambda: SyncBatchNorm(4, process_set=[0, 1], group_size=2),
                 lambda: convert_sync_batchnorm(torch_nn.BatchNorm2d(4), process_group=[0, 1], group_size=2)):
        with pytest.raises(ValueError, match="expected group_size or an explicit group of ranks"):
            make()
    tensorflow()
    from hvd_syncbn.tensorflow import SyncBatchNormalization

    with pytest.raises(ValueError, match="SyncBatchNormalization: expected group_size or an explicit group"):
        SyncBatchNormalization(process_set=[0, 1], group_size=2)


def test_a_group_size_that_does_not_divide_the_world_fails_on_every_rank():
    """3 ranks, ``group_size=2``: every rank raises at its first step, naming the
    divisors, and none waits for a collective."""
    import torch

    comms, layers, _ = torch_layers(3, 3, group_size=2)
    out = run(3, lambda r, c: layers[r](torch.ones(2, 3, 2, 2)))
    for e in out:
        assert isinstance(e, ValueError) and "group_size=2 does not divide the 3 ranks; expected one of [1, 3] or " \
                                              "'node'" in str(e), repr(e)
    assert [c.calls for c in comms] == [0] * 3


def test_ranks_that_ask_for_different_groups_are_named():
    """Rank 3 asks for groups of 4 where the others ask for 2: the hosts' exchange fails
    on every rank, naming each rank's group_size."""
    import torch

    from hvd_syncbn.comm import SyncBatchNormError
    from hvd_syncbn.torch import SyncBatchNorm

    comms = world(4)
    layers = [SyncBatchNorm(3, name="bn", comm=c, group_size=2 if r < 3 else 4) for r, c in enumerate(comms)]

    def step(r, c):
        _host.name = "h"
        layers[r](torch.ones(2, 3, 2, 2))

    with collective_timeout(3.0):
        out = run(4, step)
    for r, e in enumerate(out[:3]):
        assert isinstance(e, SyncBatchNormError) and "layer 'bn' group_size=2" in str(e), f"rank {r}: {e!r}"


def test_a_group_names_its_ranks_of_the_launch_in_a_diagnosis():
    """A bad input on rank 3 (of group 2-3): its peer's message names ranks 2 and 3 as
    the launch numbers them."""
    import torch

    comms, layers, _ = torch_layers(4, 3, group_size=2)

    def step(r, c):
        _host.name = "h"
        layers[r](torch.ones(2, 3 if r != 3 else 2, 2, 2))

    with collective_timeout(3.0):
        out = run(4, step)
    assert "this is rank 2 (SyncBN's group of ranks [2, 3])" in str(out[2]), out[2]
    assert "rank 3: bn: expected 3 channels" in str(out[2]), out[2]
    assert all(e is None or isinstance(e, torch.Tensor) for e in out[:2]), out[:2]


def test_keras_group_size_is_in_the_config_converted_and_dropped_by_revert():
    tensorflow()
    keras = pytest.importorskip("keras")
    import hvd_syncbn.tensorflow as h

    model = keras.Sequential([keras.Input((4, 4, 3)), keras.layers.Conv2D(3, 1), keras.layers.BatchNormalization()])
    converted = h.convert_sync_batchnorm(model, group_size="node")
    assert converted.layers[1].get_config()["group_size"] == "node"
    assert keras.models.clone_model(converted).layers[1].group_size == "node"
    assert "group_size" not in h.revert_sync_batchnorm(converted).layers[1].get_config()
    with pytest.raises(ValueError, match="convert_sync_batchnorm: expected group_size or an explicit group"):
        h.convert_sync_batchnorm(model, process_set=[0], group_size=2)
