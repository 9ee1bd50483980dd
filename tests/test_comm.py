"""hvd_syncbn.comm without any framework: ranks as threads over an order-matched transport
(the way MPI matches collectives), so mismatches, timeouts and diagnoses run in-process."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hvd_syncbn import comm


class ThreadComm(comm.Communicator):
    """Rank ``rank`` of a world of threads; the k-th ``start`` of every rank is summed
    together (matched by order, not name); mismatched sizes fail like MPI truncation."""

    kind = "threads"

    def __init__(self, shared: dict, rank: int, size: int) -> None:
        self.shared, self.rank, self.size, self.calls = shared, rank, size, 0
        self.side_comm = None

    def start(self, buf, name):
        with self.shared["lock"]:
            slots = self.shared.setdefault(self.calls, {})
            slots[self.rank] = np.array(buf, dtype=np.float64)
        self.calls += 1
        return self.calls - 1

    def done(self, handle):
        return len(self.shared.get(handle, {})) == self.size

    def result(self, handle):
        bufs = list(self.shared[handle].values())
        if len({b.shape for b in bufs}) > 1:
            raise RuntimeError("truncated: ranks sent different sizes")
        return np.sum(bufs, axis=0)

    def side(self):
        return self.side_comm


def world(size: int):
    main, side = {"lock": threading.Lock()}, {"lock": threading.Lock()}
    comms = [ThreadComm(main, r, size) for r in range(size)]
    for r, c in enumerate(comms):
        c.side_comm = ThreadComm(side, r, size)
    return comms


def run(size: int, fn) -> list:
    """``fn(rank, comm)`` on every rank in threads; each rank's result or exception."""
    comms, out = world(size), [None] * size

    def target(r):
        try:
            out[r] = fn(r, comms[r])
        except Exception as e:  # noqa: BLE001 - returned for the test to inspect
            out[r] = e

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def call(layer: str, step: int = 0, channels: int = 2, dtype: str = "float32") -> comm.Call:
    return comm.Call(layer, "fwd", step, channels, 4, dtype)


def reduce(c, layer, payload, **kw):
    return comm.allreduce(c, np.asarray(payload, dtype=np.float64), call(layer, **kw), f"n.{layer}")


@pytest.fixture(autouse=True)
def short_timeout():
    comm.set_timeout(0.5)
    yield
    comm._timeout = None


def test_matching_calls_sum_and_strip_the_header():
    out = run(3, lambda r, c: reduce(c, "bn", [r, 1.0]))
    for got in out:
        np.testing.assert_array_equal(got, [3.0, 3.0])


def test_different_layers_of_equal_size_raise_on_every_rank_naming_both():
    out = run(3, lambda r, c: reduce(c, "head.extra" if r == 0 else "body.bn1", [1.0, 2.0]))
    for r, e in enumerate(out):
        assert isinstance(e, comm.SyncBatchNormError), e
        text = str(e)
        assert f"this is rank {r}" in text and "ranks summed different collectives" in text
        assert "ranks [0] are waiting in layer 'head.extra' forward, step 0" in text
        assert "ranks [1, 2] are waiting in layer 'body.bn1' forward, step 0" in text
        assert "missing there: ranks [1, 2]" in text and "missing there: ranks [0]" in text


@pytest.mark.parametrize("field", [dict(step=1), dict(channels=3), dict(dtype="float64")])
def test_same_layer_differing_in_step_channels_or_dtype_raises_on_every_rank(field):
    out = run(2, lambda r, c: reduce(c, "bn", [1.0, 2.0], **(field if r == 1 else {})))
    assert all(isinstance(e, comm.SyncBatchNormError) for e in out), out


def test_a_silent_rank_times_out_and_the_others_say_so():
    start = time.monotonic()
    out = run(2, lambda r, c: reduce(c, "bn", [1.0]) if r == 0 else None)
    assert isinstance(out[0], comm.SyncBatchNormError)
    assert "no match within 0.5 s (HVD_SYNCBN_TIMEOUT)" in str(out[0])
    assert "did not answer" in str(out[0])
    assert time.monotonic() - start <= 2 * 0.5 + 0.5


def forward_payload(channels: int = 2) -> list:
    """What a layer's forward collective sums: ``2C+1`` values."""
    return [1.0] * (2 * channels + 1)


def test_poisoned_rank_names_its_problem_on_every_rank():
    def fn(r, c):
        if r == 1:
            comm.poison(c, call("bn"), "n.bn", "bn: expected 4 channels on axis 1, got 3")
        return reduce(c, "bn", forward_payload())

    out = run(3, fn)
    assert isinstance(out[1], comm.SyncBatchNormInputError) and isinstance(out[1], ValueError)
    for r, e in enumerate(out):
        assert isinstance(e, comm.SyncBatchNormError), e
        assert "rank 1: bn: expected 4 channels on axis 1, got 3" in str(e), e
        assert (r == 1) == isinstance(e, comm.SyncBatchNormInputError), f"rank {r}: {type(e).__name__}"


def test_a_problem_of_1000_characters_reaches_every_rank():
    """The record's problem is cut to fit the diagnosis record; the JSON never is."""
    problem = "bn: CUDA out of memory. " + "Tried to allocate 2.00 GiB; " * 35  # 1000 characters
    problem = problem[:1000]

    def fn(r, c):
        if r == 0:
            comm.poison(c, call("bn"), "n.bn", problem)
        return reduce(c, "bn", forward_payload())

    out = run(3, fn)
    for r, e in enumerate(out):
        assert isinstance(e, comm.SyncBatchNormError), e
        assert "did not answer" not in str(e), str(e)
        assert f"rank 0: {problem[:200]}" in str(e), f"rank {r}: {e}"
    assert problem in str(out[0]), "the rank with the problem states it whole"


def test_a_failure_that_is_not_bad_input_chains_the_real_exception():
    def fn(r, c):
        if r == 1:
            err = MemoryError("out of memory allocating 2 GiB")
            comm.poison(c, call("bn"), "n.bn", f"bn: MemoryError: {err}", comm.SyncBatchNormError, cause=err)
        return reduce(c, "bn", forward_payload())

    out = run(2, fn)
    assert type(out[1]) is comm.SyncBatchNormError and isinstance(out[1].__cause__, MemoryError)
    for e in out:
        assert "rank 1: bn: MemoryError: out of memory allocating 2 GiB" in str(e), e


@pytest.mark.parametrize("size", [2, 64, 512, 4096])
def test_header_sums_are_exact_in_float64(size):
    h, h2 = comm.header(call("a.very.long.layer.name" * 3, step=123456), size)
    assert h2 == h * h and 1 <= h
    assert size * h2 < 2**53  # Σh² over the world is exact, so equality checks are exact


def test_local_communicator_is_world_times_this_rank():
    out = comm.allreduce(comm.LocalCommunicator(4), np.array([1.0, 2.0]), call("x"), "n")
    np.testing.assert_array_equal(out, [4.0, 8.0])


def test_timeout_and_transport_settings_are_validated(monkeypatch):
    with pytest.raises(ValueError, match="expected a positive number of seconds, got 0"):
        comm.set_timeout(0)
    comm._timeout = None
    monkeypatch.setenv("HVD_SYNCBN_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="HVD_SYNCBN_TIMEOUT: expected a positive number of seconds, got 'soon'"):
        comm.get_timeout()
    monkeypatch.setenv("HVD_SYNCBN_TIMEOUT", "7.5")
    assert comm.get_timeout() == 7.5
    monkeypatch.setenv("HVD_SYNCBN_COMM", "nccl")
    with pytest.raises(ValueError, match="HVD_SYNCBN_COMM: expected one of auto, horovod, mpi, torch, got 'nccl'"):
        comm.requested_kind(None)
    assert comm.requested_kind("MPI") == "mpi"
