"""The XLA allreduce (``hvd_syncbn.tensorflow.xla``) inside ``tf.function(jit_compile=True)``.

Runs at any world size, launched by ``test_launch.py`` with the Keras suite (1 rank
plainly, 2 and 3 ranks under mpirun). Every rank builds the whole ``(W, n)`` table of
buffers, sends its own row, and checks the sum against numpy's. Values are multiples of
1/1024 below 2^20: every partial sum is exact in float64, in any order, so the sums must be
equal; random normals must be within the bound of any summation order,
``(W-1)·eps·Σ|x|``.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hvd_syncbn.tensorflow import xla  # noqa: E402
from oracle import UNEQUAL, shard_sizes  # noqa: E402

RANK, WORLD = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
CALL = 'custom_call_target="hvd_syncbn_allreduce"'


def table(seed: int, n: int, exact: bool) -> np.ndarray:
    """Every rank's buffer, a row each, ``(W, n)``: rank-dependent and unequal."""
    rng = np.random.default_rng(seed)
    if exact:
        return rng.integers(-2**30, 2**30, size=(WORLD, n)) / 1024.0
    return rng.standard_normal((WORLD, n)) * (1.0 + np.arange(WORLD))[:, None] + 1e4


def assert_summed(got, rows: np.ndarray, what: str) -> None:
    got, want = np.asarray(got), rows.sum(axis=0)
    bound = (WORLD - 1) * np.finfo(np.float64).eps * np.abs(rows).sum(axis=0)
    worst = np.abs(got - want).max(initial=0.0)
    assert np.all(np.abs(got - want) <= bound), f"{what}: largest difference {worst:.3g} (bound {bound.max():.3g})"


def test_available_here():
    assert xla.available() is None, xla.available()


@pytest.mark.parametrize("exact", [True, False], ids=["dyadic", "normal"])
def test_sum_inside_xla(exact):
    rows = table(seed=10 + exact, n=7, exact=exact)

    @tf.function(jit_compile=True)
    def step(x):
        assert xla.in_xla(), "traced outside an XLA context"
        return xla.allreduce(x * 1.0, "test.xla.sum")

    got = step(tf.constant(rows[RANK]))
    if exact:
        np.testing.assert_array_equal(got.numpy(), rows.sum(axis=0))
    assert_summed(got, rows, "jit_compile=True")
    assert not xla.in_xla()


def test_hlo_holds_two_custom_calls_in_order():
    """Two collectives of different lengths in one compiled function: both in the HLO as
    typed-FFI custom calls, the second fed the first's result (so XLA keeps their order),
    and both sums right."""
    a, b = table(seed=20, n=3, exact=True), table(seed=21, n=5, exact=True)

    @tf.function(jit_compile=True)
    def step(x, y):
        return xla.allreduce(x, "test.xla.first"), xla.allreduce(y, "test.xla.second")

    args = tf.constant(a[RANK]), tf.constant(b[RANK])
    hlo = step.experimental_get_compiler_ir(*args)(stage="hlo")
    calls = [line for line in hlo.splitlines() if CALL in line]
    assert len(calls) == 2 and all("api_version=API_VERSION_TYPED_FFI" in c for c in calls), hlo
    first, second = (next(c for c in calls if f'name = "test.xla.{n}"' in c) for n in ("first", "second"))
    assert "f64[3]" in first and "f64[], " not in first and "f64[])" not in first, first
    assert "custom-call(f64[5]{0} %" in second and "f64[] %" in second, second  # the order operand
    got_a, got_b = step(*args)
    np.testing.assert_array_equal(got_a.numpy(), a.sum(axis=0))
    np.testing.assert_array_equal(got_b.numpy(), b.sum(axis=0))


def test_outside_xla_too():
    """Eagerly and in a plain tf.function the library's TensorFlow kernel sums (no XLA
    call), two calls of one graph in the order traced (the second fed the first's result)."""
    rows, more = table(seed=30, n=4, exact=True), table(seed=31, n=6, exact=True)
    x, y = tf.constant(rows[RANK]), tf.constant(more[RANK])
    np.testing.assert_array_equal(xla.allreduce(x, "test.xla.eager").numpy(), rows.sum(axis=0))
    plain = tf.function(lambda s, t: (xla.allreduce(s, "test.xla.graph"), xla.allreduce(t, "test.xla.then")))
    graph = plain.get_concrete_function(x, y).graph
    ops = [op for op in graph.get_operations() if op.type in ("HvdSyncbnAllreduce", "XlaCallModule")]
    assert [op.type for op in ops] == ["HvdSyncbnAllreduce"] * 2, ops
    order = ops[1].inputs[1].op  # the second's extra operand: a scalar of the first's result
    assert len(ops[1].inputs) == 2 and order.inputs[0].name == ops[0].outputs[0].name, order
    got_x, got_y = plain(x, y)
    np.testing.assert_array_equal(got_x.numpy(), rows.sum(axis=0))
    np.testing.assert_array_equal(got_y.numpy(), more.sum(axis=0))


def test_over_a_sub_communicator():
    """A communicator of some ranks (as a process set's): even and odd ranks sum apart."""
    comm = MPI.COMM_WORLD.Split(color=RANK % 2, key=RANK)
    try:
        rows = table(seed=40, n=sum(shard_sizes(UNEQUAL, WORLD)) + 1, exact=True)

        @tf.function(jit_compile=True)
        def step(x):
            return xla.allreduce(x, "test.xla.split", comm=comm, timeout=30.0)

        mine = rows[[r for r in range(WORLD) if r % 2 == RANK % 2]]
        np.testing.assert_array_equal(step(tf.constant(rows[RANK])).numpy(), mine.sum(axis=0))
    finally:
        comm.Free()


def test_rejects_what_it_cannot_sum():
    with pytest.raises(ValueError, match=r"expected a 1-D float64 tensor of a static length, got float32"):
        xla.allreduce(tf.zeros([3], tf.float32), "test.xla.bad")
    with pytest.raises(ValueError, match=r"got float64 of shape \(2, 2\)"):
        xla.allreduce(tf.zeros([2, 2], tf.float64), "test.xla.bad")


@pytest.mark.parametrize("jit", [True, False], ids=["xla", "graph"])
def test_checked_sum_with_the_header_the_ranks_agree_on(jit):
    """``checked_allreduce`` sums the header in the same collective: the same header on
    every rank gives the sum and no mismatch; rank 0 with another (at 2+ ranks) gives NaN
    and the mismatch on every rank."""
    rows = table(seed=50, n=5, exact=True)
    step = tf.function(lambda x, header: xla.checked_allreduce(x, "test.xla.checked", header), jit_compile=jit)
    got, mismatch = step(tf.constant(rows[RANK]), header=(3, 9))
    np.testing.assert_array_equal(got.numpy(), rows.sum(axis=0))
    assert not mismatch.numpy()
    if WORLD > 1:
        got, mismatch = step(tf.constant(rows[RANK]), header=(4, 16) if RANK == 0 else (3, 9))
        assert mismatch.numpy() and np.isnan(got.numpy()).all(), got
