"""Both adapters' layers over a world of threads, on both paths of the PyTorch layer:
each rank is a thread with its own layer and its own Communicator of one
``conftest.world(W)``, the layers' real synchronized path, against plain BN on the
concatenated batch. No launcher: the same checks as the rank-side suites, in one
process."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from conftest import collective_timeout, results, run, tensorflow, world
from hvd_syncbn import comm
from oracle import (
    EMPTY, UNEQUAL, KerasTrainer, Ranks, TorchTrainer, as_accurate, conditioned, eval_batch, global_batch, shard_sizes,
    train_like_one_process, training_batches,
)

STEPS = 3


def collectives(size: int) -> int:
    """Collectives each rank makes in ``STEPS`` training steps: one per direction per
    step; none alone, where the layer is plain BN."""
    return 2 * STEPS if size > 1 else 0


@pytest.fixture(autouse=True)
def bounded_collectives():
    """A rank that waits for a peer raises within seconds rather than the default minute."""
    with collective_timeout(10.0):
        yield


def torch_pair(size: int, tail, stats=None, **kwargs):
    """``size`` SyncBatchNorm layers over one thread world, and a float64 plain BN, all
    with the same non-trivial affine parameters."""
    torch = pytest.importorskip("torch")
    from torch import nn

    from hvd_syncbn.torch import SyncBatchNorm

    channels = tail[0]
    plain_cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(tail) + 1]
    plain = plain_cls(channels, dtype=torch.float64, **kwargs)
    comms = world(size)
    layers = [SyncBatchNorm(channels, name="bn", comm=c, stats=stats, **kwargs) for c in comms]
    if plain.affine:
        with torch.no_grad():
            for layer in (plain, *layers):
                layer.weight.copy_(torch.linspace(0.5, 1.5, channels))
                layer.bias.copy_(torch.linspace(-0.3, 0.3, channels))
    return comms, layers, plain


TORCH_WORLD_CASES = {
    "2d-unequal": dict(tail=(4, 5, 5), pattern=UNEQUAL),
    "2d-empty-rank": dict(tail=(4, 5, 5), pattern=EMPTY),
    "1d-NC": dict(tail=(6,), pattern=UNEQUAL),
    "3d": dict(tail=(3, 2, 3, 4), pattern=EMPTY),
    "channels-last": dict(tail=(4, 5, 5), pattern=UNEQUAL, channels_last=True),
    "affine-false": dict(tail=(4, 5, 5), pattern=UNEQUAL, kwargs=dict(affine=False)),
    # mean/std 1000: the local moments take the float64 reference; x̂ in float32 is off by
    # up to ulp(100)/std ≈ 1e-4, in plain float32 BN as in ours.
    "large-offset": dict(tail=(4, 5, 5), pattern=UNEQUAL, offset=100.0, scale=0.1),
}


def threads(comms) -> Ranks:
    """The ranks of a world of threads, one per communicator, all held here."""
    return Ranks(len(comms), lambda fn: dict(enumerate(results(run(len(comms), lambda r, c: fn(r), comms)))),
                 lambda values, name: sum(values.values()))


@pytest.mark.parametrize("stats, kernels", [("host", "composite"), ("device", "composite"), ("device", "native")],
                         indirect=["kernels"], ids=["host", "device", "device-native"])
@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("case", TORCH_WORLD_CASES)
def test_torch_layer_in_a_thread_world_matches_plain_bn(case, size, stats, kernels):
    """``STEPS`` training steps, then eval: outputs, input grads, weight/bias grads summed
    over the ranks, running statistics and ``num_batches_tracked``, as close to
    ``nn.BatchNorm`` in float64 on the concatenated batch as ``nn.BatchNorm`` in float32
    is (``assert_as_accurate``); one collective per direction per step. On both paths of
    the statistics (the device path over the custom op), the device path on both of its
    kernel sets."""
    c = TORCH_WORLD_CASES[case]
    tail, offset, scale = c["tail"], c.get("offset", 0.0), c.get("scale", 1.0)
    comms, layers, plain = torch_pair(size, tail, stats=stats, **c.get("kwargs", {}))
    sizes = shard_sizes(c["pattern"], size)
    channels_last = c.get("channels_last", False)

    def ours(rank):
        assert layers[rank].comm is comms[rank]
        return TorchTrainer(layers[rank], channels_last)

    train_like_one_process(
        threads(comms), sizes, training_batches(sum(sizes), tail, STEPS, offset=offset, drift=scale, scale=scale),
        eval_batch(sum(sizes), tail, offset=offset, scale=scale), ours,
        [TorchTrainer(copy.deepcopy(plain).float(), channels_last), TorchTrainer(plain, channels_last)],
        as_accurate())
    assert [c.calls for c in comms] == [collectives(size)] * size, "expected one collective per direction per step"


def test_torch_bad_input_on_one_rank_fails_every_rank_naming_it():
    """Rank 1's input has 3 channels for a 4-channel layer: rank 1 raises
    SyncBatchNormInputError (a ValueError), its peers SyncBatchNormError, every message
    naming rank 1 and the problem; no rank's running statistics move."""
    torch = pytest.importorskip("torch")
    comms, layers, _ = torch_pair(3, (4, 5))
    before = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers]

    def rank(r, comm):
        x = torch.from_numpy(global_batch(r, 3, (3 if r == 1 else 4, 5))).requires_grad_(True)
        layers[r](x).sum().backward()

    with collective_timeout(5.0):
        out = run(3, rank, comms)
    assert_everyone_names_the_bad_rank(out, "rank 1: bn: expected 4 channels on axis 1, got 3 (input shape (3, 3, 5))")
    for layer, state in zip(layers, before):
        for k, v in layer.state_dict().items():
            assert torch.equal(v, state[k]), f"{k} changed in a failed step"


def assert_everyone_names_the_bad_rank(out: list, problem: str, bad: int = 1) -> None:
    """The row of docs/failures.md: SyncBatchNormInputError on the bad rank, SyncBatchNormError on its
    peers, every one with the bad rank's problem."""
    for r, e in enumerate(out):
        assert isinstance(e, comm.SyncBatchNormError), f"rank {r}: {e!r}"
        assert (r == bad) == isinstance(e, comm.SyncBatchNormInputError), f"rank {r}: {type(e).__name__}"
        assert (r == bad) <= isinstance(e, ValueError), f"rank {r}: {type(e).__name__}"
        text = str(e)
        assert f"this is rank {r}, in layer 'bn' forward, step 0" in text, f"rank {r}: {text}"
        assert problem in text, f"rank {r}'s message lacks {problem!r}:\n{text}"


def keras_pair(size: int, tail, axis: int):
    """``size`` SyncBatchNormalization layers over one thread world, and a float64 plain
    Keras BN, built in this thread with the same non-trivial gamma and beta."""
    tensorflow()
    keras = pytest.importorskip("keras")
    from hvd_syncbn.tensorflow import SyncBatchNormalization

    comms = world(size)
    plain = keras.layers.BatchNormalization(axis=axis, dtype="float64")
    layers = [SyncBatchNormalization(axis=axis, comm=c, name="bn") for c in comms]
    for layer in (plain, *layers):
        layer.build((None, *tail))
        for name, lo, hi in (("gamma", 0.5, 1.5), ("beta", -0.3, 0.3)):
            w = getattr(layer, name)
            w.assign(np.linspace(lo, hi, int(np.prod(w.shape))).reshape(w.shape))
    return comms, layers, plain


KERAS_WORLD_CASES = {
    "channels-last": dict(tail=(5, 5, 4), axis=-1, pattern=UNEQUAL),
    "channels-first": dict(tail=(4, 5, 5), axis=1, pattern=EMPTY),
    "3d-channels-last-mask": dict(tail=(6, 4), axis=-1, pattern=UNEQUAL, mask=True),
}
# Keras in tf.function runs at 2 ranks only: with 3 threads of one process, TF's shared
# inter-op pool runs the stateful numpy_function hops of the ranks' graphs in an order
# that does not match across ranks (the identity header then raises); one process per
# rank, as under a launcher, has no such pool to share.
KERAS_WORLDS = [(case, size, False) for case in KERAS_WORLD_CASES for size in (1, 2, 3)]
KERAS_WORLDS += [("channels-last", 2, True), ("3d-channels-last-mask", 2, True)]


@pytest.mark.parametrize("case, size, compiled", KERAS_WORLDS,
                         ids=[f"{c}-{s}-{'tf.function' if f else 'eager'}" for c, s, f in KERAS_WORLDS])
def test_keras_layer_in_a_thread_world_matches_keras_bn(case, size, compiled):
    """``STEPS`` training steps, then inference: outputs, input grads, gamma/beta grads
    summed over the ranks and moving statistics, against ``keras.layers.BatchNormalization``
    in float64 on the concatenated batch; one collective per direction per step."""
    c = KERAS_WORLD_CASES[case]
    tail = c["tail"]
    comms, layers, plain = keras_pair(size, tail, c["axis"])
    sizes = shard_sizes(c["pattern"], size)

    def ours(rank):
        assert layers[rank].comm is comms[rank]
        return KerasTrainer(layers[rank], compiled)

    train_like_one_process(threads(comms), sizes, training_batches(sum(sizes), tail, STEPS, mask=c.get("mask", False)),
                           eval_batch(sum(sizes), tail), ours, [KerasTrainer(plain)],
                           conditioned([c["axis"] % (len(tail) + 1)]))
    assert [c.calls for c in comms] == [collectives(size)] * size, "expected one collective per direction per step"


def test_keras_bad_input_on_one_rank_fails_every_rank_naming_it():
    """As for PyTorch: rank 1's input has 3 channels for a 4-channel layer (axis 1)."""
    tf = tensorflow()
    comms, layers, _ = keras_pair(3, (4, 5), axis=1)
    before = [[w.numpy().copy() for w in layer.weights] for layer in layers]

    def rank(r, comm):
        x = tf.constant(global_batch(r, 3, (3 if r == 1 else 4, 5)))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layers[r](x, training=True)
        tape.gradient(y, x)

    with collective_timeout(5.0):
        out = run(3, rank, comms)
    assert_everyone_names_the_bad_rank(out, "rank 1: bn: expected 4 channels on axis 1, got 3 (input shape (3, 3, 5))")
    for layer, state in zip(layers, before):
        for w, b in zip(layer.weights, state):
            assert np.array_equal(w.numpy(), b), f"{w.name} changed in a failed step"
