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
    EMPTY, UNEQUAL, assert_as_accurate, assert_close, eval_batch, global_batch, shard_sizes, shard_slice, training_batches,
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


@pytest.mark.parametrize("stats", ["host", "device"])
@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("case", TORCH_WORLD_CASES)
def test_torch_layer_in_a_thread_world_matches_plain_bn(case, size, stats):
    """``STEPS`` training steps, then eval: outputs, input grads, weight/bias grads summed
    over the ranks, running statistics and ``num_batches_tracked``, as close to
    ``nn.BatchNorm`` in float64 on the concatenated batch as ``nn.BatchNorm`` in float32
    is (``assert_as_accurate``); one collective per direction per step. On both paths of
    the statistics (the device path over the custom op)."""
    torch = pytest.importorskip("torch")
    c = TORCH_WORLD_CASES[case]
    tail, channels_last = c["tail"], c.get("channels_last", False)
    offset, scale = c.get("offset", 0.0), c.get("scale", 1.0)
    comms, layers, plain = torch_pair(size, tail, stats=stats, **c.get("kwargs", {}))
    plain32 = copy.deepcopy(plain).float()
    sizes = shard_sizes(c["pattern"], size)
    batches = [(torch.from_numpy(x), torch.from_numpy(r))
               for x, r, _ in training_batches(sum(sizes), tail, STEPS, offset=offset, drift=scale, scale=scale)]
    state = ("running_mean", "running_var", "num_batches_tracked")

    def train(layer, x, r):
        x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
        x = x.clone().requires_grad_(True)
        y = layer(x)
        (y * r).sum().backward()
        params = {f"{n} grad": getattr(layer, n).grad.clone() for n in ("weight", "bias")
                  if getattr(layer, n) is not None}
        layer.zero_grad(set_to_none=True)
        return dict(output=y.detach(), **{"input grad": x.grad}, **params,
                    **{n: getattr(layer, n).clone() for n in state})

    want = [train(plain, x.double(), r.double()) for x, r in batches]
    want32 = [train(plain32, x, r) for x, r in batches]

    def rank(r, comm):
        assert layers[r].comm is comm
        mine = shard_slice(sizes, r)
        return [train(layers[r], x[mine], t[mine]) for x, t in batches]

    got = results(run(size, rank, comms))
    for step, expected in enumerate(want):
        what = f"{case}, step {step}, {sizes} rows"
        for r in range(size):
            mine, ours = shard_slice(sizes, r), dict(got[r][step])
            if channels_last and sizes[r]:
                assert ours["output"].is_contiguous(memory_format=torch.channels_last), "channels_last output lost"
            for name in ("weight grad", "bias grad"):  # summed over the ranks, as an optimizer would
                if name in ours:
                    ours[name] = sum(got[q][step][name] for q in range(size))
            ref, ref32 = ({n: t[mine] if n in ("output", "input grad") else t for n, t in e.items()}
                          for e in (expected, want32[step]))
            assert_as_accurate(ours, ref32, ref, f"rank {r} ({what})")
    assert [c.calls for c in comms] == [collectives(size)] * size, "expected one collective per direction per step"
    x = torch.from_numpy(eval_batch(sum(sizes), tail, offset=offset, scale=scale))
    with torch.no_grad():
        ref, ref32 = (model.eval()(x.to(dtype)) for model, dtype in ((plain, torch.float64), (plain32, torch.float32)))
        for r, layer in enumerate(layers):
            mine = shard_slice(sizes, r)
            assert_as_accurate({"eval output": layer.eval()(x[mine])}, {"eval output": ref32[mine]},
                               {"eval output": ref[mine]}, f"rank {r}")
    assert [c.calls for c in comms] == [collectives(size)] * size, "eval communicated"


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
    tf = tensorflow()
    c = KERAS_WORLD_CASES[case]
    tail, mask = c["tail"], c.get("mask", False)
    comms, layers, plain = keras_pair(size, tail, c["axis"])
    sizes = shard_sizes(c["pattern"], size)
    batches = training_batches(sum(sizes), tail, STEPS, mask=mask)

    def train(layer, x, r, m):
        x, r = tf.cast(x, layer.variable_dtype), tf.cast(r, layer.variable_dtype)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True, mask=m)
            loss = tf.reduce_sum(y * r)
        dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma, layer.beta])
        return y, dx, dgamma, dbeta

    def tensors(x, r, m, rows=slice(None)):
        return tf.constant(x[rows]), tf.constant(r[rows]), None if m is None else tf.constant(m[rows])

    def moving(layer):
        return [layer.moving_mean.numpy(), layer.moving_variance.numpy()]

    want = []
    for x, r, m in batches:
        want.append([t.numpy() for t in train(plain, *tensors(x, r, m))] + moving(plain))

    def rank(k, comm):
        assert layers[k].comm is comm
        step = tf.function(train) if compiled else train
        mine, out = shard_slice(sizes, k), []
        for x, r, m in batches:
            grads = step(layers[k], *tensors(x, r, m, mine))
            assert all(g is not None for g in grads), f"rank {k}: a gradient is None"
            out.append([t.numpy() for t in grads] + moving(layers[k]))
        return out

    got = results(run(size, rank, comms))
    names = ("output", "input grad", "gamma grad", "beta grad", "moving_mean", "moving_variance")
    for step, expected in enumerate(want):
        what = f"{case}, step {step}, {sizes} rows"
        for k in range(size):
            mine = shard_slice(sizes, k)
            for i, name in enumerate(names):
                if name in ("gamma grad", "beta grad"):
                    continue
                exp = expected[i][mine] if i < 2 else expected[i]
                assert_close(got[k][step][i], exp, f"{name}, rank {k} ({what})")
        for i in (2, 3):  # float32 sums of ~10² O(1) terms that nearly cancel
            summed = sum(got[k][step][i] for k in range(size))
            assert_close(summed, expected[i], f"{names[i]} summed over ranks ({what})", atol=1e-5)
    assert [c.calls for c in comms] == [collectives(size)] * size, "expected one collective per direction per step"
    x = eval_batch(sum(sizes), tail)
    want_eval = plain(x, training=False).numpy()
    for k, layer in enumerate(layers):
        mine = shard_slice(sizes, k)
        assert_close(layer(x[mine], training=False), want_eval[mine], f"inference output, rank {k}")
    assert [c.calls for c in comms] == [collectives(size)] * size, "inference communicated"


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
