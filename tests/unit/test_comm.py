"""hvd_syncbn.comm without any framework: ranks as threads over an order-matched transport
(the way MPI matches collectives), so mismatches, timeouts and diagnoses run in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from conftest import collective_timeout, run, world
from hvd_syncbn import comm, communicator, diagnosis, identity, mpi, settings, store_rows, stuck, transports


def call(layer: str, step: int = 0, channels: int = 2, dtype: str = "float32", rank: int = 0) -> identity.Call:
    return identity.Call(layer, "fwd", step, channels, 4, dtype, rank)


def reduce(c, layer, payload, **kw):
    return comm.allreduce(c, np.asarray(payload, dtype=np.float64), call(layer, rank=c.rank, **kw))


@pytest.fixture(autouse=True)
def short_timeout():
    with collective_timeout(0.5):
        yield


def test_matching_calls_sum_and_strip_the_header():
    out = run(3, lambda r, c: reduce(c, "bn", [r, 1.0]))
    for got in out:
        np.testing.assert_array_equal(got, [3.0, 3.0])


def test_different_layers_of_equal_size_raise_on_every_rank_naming_both():
    out = run(3, lambda r, c: reduce(c, "head.extra" if r == 0 else "body.bn1", [1.0, 2.0]))
    for r, e in enumerate(out):
        assert isinstance(e, comm.SyncBatchNormError) and not isinstance(e, comm.SyncBatchNormInputError), repr(e)
        text, mine = str(e), "'head.extra'" if r == 0 else "'body.bn1'"
        assert text.startswith(f"SyncBatchNorm: ranks disagree or stopped (ranks summed different collectives); "
                               f"this is rank {r}, in layer {mine} forward, step 0 (2 channels, 4D float32)."), text
        assert ("ranks [0] are waiting in layer 'head.extra' forward, step 0 (2 channels, 4D float32); "
                "missing there: ranks [1, 2]") in text, text
        assert ("ranks [1, 2] are waiting in layer 'body.bn1' forward, step 0 (2 channels, 4D float32); "
                "missing there: ranks [0]") in text, text


@pytest.mark.parametrize("field, theirs", [
    (dict(step=1), "step 1 (2 channels, 4D float32)"),
    (dict(channels=3), "step 0 (3 channels, 4D float32)"),
    (dict(dtype="float64"), "step 0 (2 channels, 4D float64)"),
], ids=["step", "channels", "dtype"])
def test_same_layer_differing_in_step_channels_or_dtype_raises_on_every_rank(field, theirs):
    out = run(2, lambda r, c: reduce(c, "bn", [1.0, 2.0], **(field if r == 1 else {})))
    for r, e in enumerate(out):
        assert isinstance(e, comm.SyncBatchNormError) and not isinstance(e, comm.SyncBatchNormInputError), repr(e)
        text = str(e)
        assert f"ranks disagree or stopped (ranks summed different collectives); this is rank {r}" in text, text
        assert ("ranks [0] are waiting in layer 'bn' forward, step 0 (2 channels, 4D float32); "
                "missing there: ranks [1]") in text, text
        assert f"ranks [1] are waiting in layer 'bn' forward, {theirs}; missing there: ranks [0]" in text, text


def test_a_silent_rank_times_out_and_the_others_name_it():
    """Rank 2 never joins; ranks 0 and 1 say where both wait and that rank 2 did not
    answer: the diagnosis gathers each rank's row on its own (as MPI's does)."""
    start = time.monotonic()
    out = run(3, lambda r, c: reduce(c, "bn", [1.0]) if r < 2 else None)
    assert out[2] is None, repr(out[2])
    for r in (0, 1):
        text = str(out[r])
        assert isinstance(out[r], comm.SyncBatchNormError), repr(out[r])
        assert f"ranks disagree or stopped (no match within 0.5 s (HVD_SYNCBN_TIMEOUT)); this is rank {r}" in text, text
        assert ("ranks [0, 1] are waiting in layer 'bn' forward, step 0 (2 channels, 4D float32); "
                "missing there: ranks [2]") in text, text
        assert ("rank 2 did not answer within the diagnosis time: not in a SyncBN collective (stuck in other code "
                "or another collective, stopped, finished, or dead).") in text, text
    assert time.monotonic() - start <= 2 * 0.5 + 0.5


def test_where_the_diagnosis_is_one_collective_a_silent_rank_is_named_among_the_silent():
    """A transport whose gather is one collective (Horovod, torch.distributed) cannot
    tell the waiting peers from the absent one, and says so."""
    out = run(3, lambda r, c: reduce(c, "bn", [1.0]) if r < 2 else None, comms=world(3, partial_gather=False))
    for r in (0, 1):
        text = str(out[r])
        assert isinstance(out[r], comm.SyncBatchNormError), repr(out[r])
        assert (f"ranks [{r}] are waiting in layer 'bn' forward, step 0 (2 channels, 4D float32); missing there: "
                f"ranks {[p for p in range(3) if p != r]}") in text, text
        assert (f"ranks {[p for p in range(3) if p != r]} did not answer within the diagnosis time. At least one "
                "is not in a SyncBN collective (stuck in other code or another collective, stopped, finished, or "
                "dead); over threads the diagnosis is one collective, so it cannot tell which one, nor where the "
                "others wait.") in text, text


def forward_payload(channels: int = 2) -> list:
    """What a layer's forward collective sums: ``2C+1`` values."""
    return [1.0] * (2 * channels + 1)


def test_poisoned_rank_names_its_problem_on_every_rank():
    def fn(r, c):
        if r == 1:
            comm.poison(c, call("bn", rank=c.rank), "bn: expected 4 channels on axis 1, got 3")
        return reduce(c, "bn", forward_payload())

    out = run(3, fn)
    assert isinstance(out[1], comm.SyncBatchNormInputError) and isinstance(out[1], ValueError)
    for r, e in enumerate(out):
        assert isinstance(e, comm.SyncBatchNormError), e
        assert f"this is rank {r}, in layer 'bn' forward, step 0 (2 channels, 4D float32)" in str(e), e
        assert "rank 1: bn: expected 4 channels on axis 1, got 3" in str(e), e
        assert (r == 1) == isinstance(e, comm.SyncBatchNormInputError), f"rank {r}: {type(e).__name__}"


def test_a_problem_of_1000_characters_reaches_every_rank():
    """The record's problem is cut to fit the diagnosis record; the JSON never is."""
    problem = "bn: CUDA out of memory. " + "Tried to allocate 2.00 GiB; " * 35  # 1000 characters
    problem = problem[:1000]

    def fn(r, c):
        if r == 0:
            comm.poison(c, call("bn", rank=c.rank), problem)
        return reduce(c, "bn", forward_payload())

    out = run(3, fn)
    for r, e in enumerate(out):
        assert isinstance(e, comm.SyncBatchNormError), e
        assert "did not answer" not in str(e), str(e)
        assert f"rank 0: {problem[:200]}" in str(e), f"rank {r}: {e}"
    assert problem in str(out[0]), "the rank with the problem states it whole"


def test_a_long_layer_path_is_shortened_in_the_middle_and_the_cause_kept():
    """A 700-character layer path (deeply nested modules): the record shortens the path
    in the middle (keeping a hash of it), in the problem too, and keeps the cause at the
    problem's end."""
    layer = "encoder." + ".".join(f"block{i}" for i in range(100))[:680] + ".bn1"
    assert len(layer) >= 690
    cause = "expected 4 channels on axis 1, got 3 (input shape (3, 3, 5))"

    def fn(r, c):
        if r == 1:
            comm.poison(c, call(layer, rank=c.rank), f"{layer}: {cause}")
        return reduce(c, layer, forward_payload())

    out = run(3, fn)
    short = diagnosis.short_layer(layer)
    assert len(short) == diagnosis.LAYER_KEEP and short.startswith("encoder.block0.") and short.endswith(".bn1"), short
    other = layer.replace("block50", "block05")
    assert diagnosis.short_layer(other) != short and diagnosis.short_layer(other)[:40] == short[:40]
    for r, e in enumerate(out):
        assert isinstance(e, comm.SyncBatchNormError), e
        assert f"rank 1: {short}: {cause}" in str(e), f"rank {r}: {e}"
        assert f"ranks [0, 1, 2] are waiting in layer '{short}' forward, step 0" in str(e), f"rank {r}: {e}"
        assert f"this is rank {r}, in layer '{layer}' forward" in str(e), "each rank names its own layer whole"


@pytest.mark.parametrize("layer_chars, problem_chars", [(0, 2000), (2000, 0), (900, 900), (5, 1019)])
def test_a_record_always_fits_and_keeps_both_ends_of_the_problem(layer_chars, problem_chars):
    layer = ("L" * layer_chars) or "bn"
    problem = "START " + "x" * problem_chars + " CAUSE"
    record = diagnosis._record(identity.Call(layer, "fwd", 0, 4, 4, "float32", 1, problem))
    assert len(record) <= diagnosis.RECORD_BYTES
    back = identity.Call(**json.loads(record.decode()))
    assert back.problem.startswith("START ") and back.problem.endswith(" CAUSE"), back.problem[-80:]
    assert len(back.layer) <= max(len(layer), diagnosis.LAYER_KEEP)


def test_a_failure_that_is_not_bad_input_chains_the_real_exception():
    def fn(r, c):
        if r == 1:
            err = MemoryError("out of memory allocating 2 GiB")
            comm.poison(c, call("bn", rank=c.rank), f"bn: MemoryError: {err}", comm.SyncBatchNormError,
                        cause=err)
        return reduce(c, "bn", forward_payload())

    out = run(2, fn)
    assert type(out[1]) is comm.SyncBatchNormError and isinstance(out[1].__cause__, MemoryError)
    for r, e in enumerate(out):
        assert isinstance(e, comm.SyncBatchNormError) and not isinstance(e, comm.SyncBatchNormInputError), repr(e)
        assert f"this is rank {r}, in layer 'bn' forward, step 0" in str(e), e
        assert "rank 1: bn: MemoryError: out of memory allocating 2 GiB" in str(e), e


def header_sums(heads: np.ndarray) -> np.ndarray:
    """``(Σh, Σh²)`` of each row of ``(P, W, 2)`` ranks' headers in float64, summed one by
    one (as a ring allreduce does) and pairwise (as numpy and tree allreduces do); the two
    orders must agree exactly."""
    one_by_one = np.cumsum(heads, axis=1)[:, -1]  # (P, 2)
    pairwise = np.sum(heads, axis=1)
    assert np.array_equal(one_by_one, pairwise), "summation order changed a header sum"
    return pairwise


def passes(sums: np.ndarray, calls, size: int) -> np.ndarray:
    """The check each rank makes after the sum: exactly ``size`` times its own header."""
    own = np.array([identity.header(c, size) for c in calls])  # (P, 2)
    return np.all(sums == size * own, axis=1)


CALLS = [identity.Call(f"layer{i}.{j}.bn{k}", d, s, 64, 4, "float32")
         for i in range(3) for j in range(2) for k in (1, 2) for d in ("fwd", "bwd") for s in (0, 1, 7)]
# Each call against 10 others (another layer, direction or step) and itself one step on.
PAIRS = [(a, CALLS[(i + k) % len(CALLS)]) for i, a in enumerate(CALLS) for k in range(1, 11)]
PAIRS += [(a, identity.Call(a.layer, a.direction, a.step + 1, a.channels, a.ndim, a.dtype)) for a in CALLS]


@pytest.mark.parametrize("size", [2, 64, 512, 4096])
def test_header_check_passes_one_collective_and_fails_any_mix(size):
    """``size`` identical headers sum exactly to ``(W·h, W·h²)``; ``W − 1`` copies of one
    call's header with one of another call never pass the check, on either side."""
    same = np.array([[identity.header(a, size)] * size for a in CALLS])  # (P, W, 2)
    assert passes(header_sums(same), CALLS, size).all(), f"a collective failed its own check at {size} ranks"
    mixed = np.array([[identity.header(a, size)] * (size - 1) + [identity.header(b, size)] for a, b in PAIRS])
    sums = header_sums(mixed)
    wrong = passes(sums, [a for a, _ in PAIRS], size) | passes(sums, [b for _, b in PAIRS], size)
    assert not wrong.any(), f"mixed collectives passed at {size} ranks: {[PAIRS[i] for i in np.flatnonzero(wrong)]}"


def test_local_communicator_is_world_times_this_rank():
    out = comm.allreduce(comm.LocalCommunicator(4), np.array([1.0, 2.0]), call("x"))
    np.testing.assert_array_equal(out, [4.0, 8.0])


def test_timeout_and_transport_settings_are_validated(monkeypatch):
    with pytest.raises(ValueError, match="expected a positive number of seconds, got 0"):
        comm.set_timeout(0)
    settings._timeout = None
    monkeypatch.setenv("HVD_SYNCBN_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="HVD_SYNCBN_TIMEOUT: expected a positive number of seconds, got 'soon'"):
        comm.get_timeout()
    monkeypatch.setenv("HVD_SYNCBN_TIMEOUT", "7.5")
    assert comm.get_timeout() == 7.5
    monkeypatch.setenv("HVD_SYNCBN_COMM", "nccl")
    with pytest.raises(ValueError, match="HVD_SYNCBN_COMM: expected one of auto, horovod, mpi, torch, got 'nccl'"):
        transports.requested_kind(None)
    assert transports.requested_kind("MPI") == "mpi"
    monkeypatch.delenv("HVD_SYNCBN_COMM")
    with pytest.raises(ValueError, match="comm: expected one of auto, horovod, mpi, torch, got 'nccl'"):
        transports.requested_kind("nccl")
    with pytest.raises(ValueError, match="comm: expected one of auto, horovod, mpi, torch or a Communicator, got 3"):
        transports.requested_kind(3)


def test_the_mpi_cuda_setting_overrides_the_library_and_is_validated(monkeypatch):
    """What the library reports is tested under mpirun (ranks_compile.py)."""
    for raw, aware in (("1", True), ("0", False)):
        monkeypatch.setenv("HVD_SYNCBN_MPI_CUDA", raw)
        assert mpi.mpi_reads_cuda() is aware
    monkeypatch.setenv("HVD_SYNCBN_MPI_CUDA", "yes")
    with pytest.raises(ValueError, match=r"HVD_SYNCBN_MPI_CUDA: expected 0 \(MPI reads host memory only: .*\) "
                                         r"or 1 \(MPI is CUDA-aware: .*\), got 'yes'"):
        mpi.mpi_reads_cuda()


def test_make_call_counts_steps_per_communicator_and_direction():
    """Each rank's ``make_call`` numbers a layer's calls per direction on its own
    communicator, starting at 0, and carries that communicator's rank."""
    a, b = world(2)
    steps = [identity.make_call(a, "bn", "fwd", 4, 4, "float32").step for _ in range(3)]
    assert steps == [0, 1, 2]
    first_bwd = identity.make_call(a, "bn", "bwd", 4, 4, "float32")
    other_layer = identity.make_call(a, "bn2", "fwd", 4, 4, "float32")
    other_comm = identity.make_call(b, "bn", "fwd", 4, 4, "float32")
    assert (first_bwd.step, other_layer.step, other_comm.step) == (0, 0, 0)
    assert (first_bwd.rank, other_comm.rank) == (0, 1)
    assert other_comm.name == "hvd_syncbn.bn.fwd" and first_bwd.name == "hvd_syncbn.bn.bwd"


def test_transport_rule(monkeypatch):
    """The documented rule (docs/design.md): a Communicator as it is;
    under ``auto`` the first registered transport that works here (for PyTorch:
    torch.distributed if a group exists, else MPI under mpirun, else Horovod if
    initialised), else none; a named one that cannot work raises, saying why."""
    for key in ("HVD_SYNCBN_COMM", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(key, raising=False)

    class TorchLike(transports.Transport):
        name, chosen_because = "torch", "a process group exists"

        def auto_unavailable(self, request):
            return None if request.process_group else "no process group"

    registry = transports.Registry("Test", TorchLike(), transports.MpiTransport(), transports.HorovodTransport())
    alone, hvd_on = transports.Request("bn"), transports.Request("bn", horovod=(2, 0))
    mine = world(2)[0]
    assert registry.choose(mine, alone) == (mine, "requested")
    assert registry.choose(None, alone) == (None, "not torch: no process group; not mpi: not launched by mpirun; "
                                                  "not horovod: it needs hvd.init() first")
    chosen, why = registry.choose("auto", hvd_on)
    assert chosen.name == "horovod" and why.startswith("hvd.init() has run; not torch: no process group; not mpi:")
    assert registry.choose(None, transports.Request("bn", (2, 0), process_group=True))[0].name == "torch"
    monkeypatch.setenv("HVD_SYNCBN_COMM", "horovod")
    assert registry.choose(None, alone)[0].name == "horovod"
    assert registry.resolve(mine, alone) is mine
    assert registry.resolve(comm.LocalCommunicator(1), alone) is None
    with pytest.raises(RuntimeError, match=r"bn: comm='horovod' is not usable here: it needs hvd\.init\(\) first"):
        registry.resolve(None, alone)
    with pytest.raises(RuntimeError, match="bn: comm='mpi' is not usable here: not launched by mpirun"):
        registry.resolve("mpi", alone)
    with pytest.raises(ValueError, match="bn: comm='torch' is not a TensorFlow transport; with TensorFlow use "
                                         "'auto', 'mpi', 'horovod'"):
        transports.Registry("TensorFlow", transports.MpiTransport(), transports.HorovodTransport()).resolve("torch", alone)


def test_the_transport_line_names_the_launcher_that_started_the_ranks(monkeypatch, caplog):
    """Rank 0 logs which transport carries the statistics, why, and what started the
    ranks, read from the launcher's environment (here srun's, as recorded on a cluster)."""
    for key in [k for k in os.environ if k.startswith(("OMPI_", "PMI", "SLURM_", "HOROVOD_", "TORCHELASTIC"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_MPI_TYPE", "pmix")

    class Threads(transports.Transport):
        name, chosen_because = "torch", "the test's world"

        def build(self, request, registry):
            return world(2)[0]

    with caplog.at_level("WARNING", logger="hvd_syncbn"):
        transports.Registry("Test", Threads()).resolve("auto", transports.Request("bn"))
    assert "statistics travel over torch (the test's world; ranks started by srun --mpi=pmix; set HVD_SYNCBN_COMM" \
        in caplog.text, caplog.text


def test_a_registered_transport_is_built_once_per_group_and_chosen_by_name():
    """Adding a transport is one class and one registration; the registry builds its
    communicator once per group key and hands the same one to every layer."""
    built = []

    class Threads(transports.Transport):
        name = "torch"  # a name ``comm`` accepts

        def build(self, request, registry):
            built.append(request.key)
            return world(2)[0]

    registry = transports.Registry("Test")
    registry.register(Threads())
    first = registry.resolve("torch", transports.Request("a", key="g"))
    assert registry.resolve("torch", transports.Request("b", key="g")) is first and built == ["g"]
    assert registry.resolve("torch", transports.Request("c", key="h")) is not first and built == ["g", "h"]


@pytest.mark.parametrize("available", [True, False])
def test_a_launch_of_several_processes_where_no_transport_works_warns_naming_it(monkeypatch, available):
    """Any framework's registry (here one transport that works, or not): started by
    mpirun as one of 3 with no transport, a layer would be silently local, so it warns
    once, saying why each transport was passed over; with one that works, nothing."""
    for key in [k for k in os.environ if k.startswith(("OMPI_", "PMI", "SLURM_", "HOROVOD_", "TORCHELASTIC"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    monkeypatch.delenv(transports.STRICT_ENV, raising=False)
    monkeypatch.setattr(transports, "_warned_alone", False)

    class Threads(transports.Transport):
        name = "horovod"

        def auto_unavailable(self, request):
            return None if available else "the test says no"

        def build(self, request, registry):
            return world(3)[0]

    registry = transports.Registry("Test", Threads())
    if available:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert registry.resolve("auto", transports.Request("bn")) is not None
        return
    with pytest.warns(RuntimeWarning, match=r"bn: this process is one of 3 started by mpirun \(Open MPI\), but Test "
                                            r"SyncBatchNorm found no transport \(not horovod: the test says no\)"):
        assert registry.resolve("auto", transports.Request("bn")) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert registry.resolve("auto", transports.Request("bn2")) is None


def test_a_long_wait_backs_off_and_yields_the_cpu(monkeypatch):
    """For the first 100 ms the polls sleep 50 µs; then 2% of the time waited, up to
    20 ms: a 10 s wait for a peer that never comes polls ~2,600 times, not 200,000
    (on a clock that advances by the sleeps asked for), and never sleeps past its deadline."""
    assert communicator.pause(0.0) == communicator.pause(0.099) == communicator.SHORT_PAUSE
    assert communicator.pause(0.5) == pytest.approx(0.01) and communicator.pause(60.0) == communicator.LONG_PAUSE
    clock = [1000.0]
    monkeypatch.setattr(communicator.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(communicator.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))

    class Never(comm.Communicator):
        polls = 0

        def done(self, handle):
            self.polls += 1
            return False

    never = Never()
    assert not never.wait(None, 1010.0)
    assert 2000 < never.polls < 3000, f"{never.polls} polls in 10 s"
    assert 1010.0 < clock[0] < 1010.0 + 1e-3, f"woke {clock[0] - 1010:.4f} s after the deadline"


class FakeMpi:
    """What :class:`~hvd_syncbn.mpi.MpiCommunicator` asks of mpi4py, with a switch
    for ``MPI_Finalize`` (as Horovod's thread calls it when a peer shuts Horovod down);
    any request polled after it fails the test, as Open MPI aborts the job."""

    IN_PLACE, SUM = object(), object()

    def __init__(self) -> None:
        self.finalized, self.after, self.COMM_WORLD = False, [], self

    def Abort(self, code):
        self.after += ["MPI_Abort"] if self.finalized else []

    def Is_finalized(self):
        return self.finalized

    def request(self):
        mpi = self

        class Request:
            def Test(self):
                if mpi.finalized:
                    mpi.after.append("MPI_Test")
                return False

            def Cancel(self):
                mpi.after += ["MPI_Cancel"] if mpi.finalized else []

            Wait = Cancel

        return Request()

    def Iallreduce(self, *args, **kw):
        return self.request()

    Isend = Irecv = Iallreduce


def test_a_wait_whose_mpi_is_finalized_under_it_raises_without_calling_mpi(monkeypatch):
    """A SyncBN wait over MPI while Horovod finalizes MPI (a peer exited): the wait, the
    diagnosis and the abort at exit stop calling MPI, and the rank raises, saying so."""
    monkeypatch.setattr(stuck, "_aborted", [])
    monkeypatch.setattr(stuck.atexit, "register", lambda fn: None)
    fake = FakeMpi()
    c = mpi.MpiCommunicator.__new__(mpi.MpiCommunicator)
    c._mpi, c.comm, c.rank, c.size, c._rounds, c._side = fake, fake, 0, 2, 0, c
    threading.Timer(0.2, lambda: setattr(fake, "finalized", True)).start()
    with pytest.raises(comm.SyncBatchNormError, match="RuntimeError: MPI was finalized while this rank waited"):
        reduce(c, "bn", [1.0])
    assert stuck._aborted == [(c, 0.0)]
    stuck._abort_at_exit()
    assert fake.after == [], f"called after MPI_Finalize: {fake.after}"


def test_under_mpirun_with_a_keepalive_a_silent_rank_delays_the_abort_until_a_lost_node_is_noticed(monkeypatch):
    """mpirun's keepalive in the environment (launch/mpirun.sh's at a 5 s timeout: 5 + 2 x 6
    s): a rank that timed out on a silent peer aborts at exit only once mpirun could have
    noticed a lost node, 17 s (+2) after the collective began; without it, at once."""
    monkeypatch.setattr(stuck, "_aborted", [])
    monkeypatch.setattr(stuck.atexit, "register", lambda fn: None)
    assert stuck.lost_node_wait() == 0
    for name, value in {"time": "5", "intvl": "2", "probes": "6"}.items():
        monkeypatch.setenv(stuck.KEEPALIVE_ENV + name, value)
    assert stuck.lost_node_wait() == 0  # not started by mpirun (srun passes the image's variables on too)
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1.0;tcp://10.0.0.1:1")
    assert stuck.lost_node_wait() == 17
    start = time.monotonic()
    run(3, lambda r, c: reduce(c, "bn", [1.0]) if r < 2 else None)
    [(_, until)] = stuck._aborted
    assert start + 17 + stuck.LOST_NODE_MARGIN <= until <= start + 17 + stuck.LOST_NODE_MARGIN + 0.5, until - start
    monkeypatch.setenv(stuck.KEEPALIVE_ENV + "time", "0")  # Open MPI's way to turn it off
    assert stuck.lost_node_wait() == 0


def test_an_abort_that_hangs_ends_the_process_within_half_the_timeout():
    """Horovod's shutdown over Gloo waits out Gloo's receive timeout for a stopped peer:
    the process exits hard, status 1, once its abort took half the SyncBN timeout."""
    script = ("import time\nfrom hvd_syncbn import comm, stuck\ncomm.set_timeout(1.0)\n"
              "class Hangs(comm.Communicator):\n    kind = 'hanging'\n    def abort(self): time.sleep(60)\n"
              "stuck._aborted.append((Hangs(), 0.0))\nstuck._abort_at_exit()\nprint('returned')\n")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(comm.__file__).parents[1])})
    took = time.monotonic() - start
    assert out.returncode == 1 and "returned" not in out.stdout, (out.returncode, out.stdout, out.stderr)
    assert "the hanging transport did not stop within 0.5 s of the exit; exiting hard" in out.stderr, out.stderr
    assert took < 10, f"took {took:.1f} s"


def over_the_store(comms: list, group: int = 0) -> list:
    for c in comms:
        c.side_comm = store_rows.rendezvous_rows(c.rank, c.size, group)
    return comms


def test_under_horovodrun_the_diagnosis_names_a_silent_rank_through_the_rendezvous_store(rendezvous):
    """Horovod's collectives need every rank; under horovodrun (Gloo) the diagnosis goes
    through the launcher's store instead, row by row, and names the silent rank."""
    out = run(3, lambda r, c: reduce(c, "bn", [1.0]) if r < 2 else None, comms=over_the_store(world(3)))
    for r in (0, 1):
        text = str(out[r])
        assert ("ranks [0, 1] are waiting in layer 'bn' forward, step 0 (2 channels, 4D float32); "
                "missing there: ranks [2]") in text, text
        assert "rank 2 did not answer within the diagnosis time: not in a SyncBN collective" in text, text
    # A second world, all ranks present, under its own group: the first world's rows stay
    # in the store (its rank 2 never wrote), and fresh communicators start again at round 0.
    out = run(3, lambda r, c: reduce(c, "bn" if r else "head", [1.0]), comms=over_the_store(world(3), group=1))
    for r in range(3):
        assert "ranks [1, 2] are waiting in layer 'bn' forward" in str(out[r]) and "did not answer" not in str(out[r])


def test_an_unreachable_store_says_the_diagnosis_failed(rendezvous, monkeypatch):
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_PORT", "1")  # nothing listens there
    out = run(2, lambda r, c: reduce(c, "bn", [1.0]) if r < 1 else None, comms=over_the_store(world(2)))
    text = str(out[0])
    assert "ranks [0] are waiting in layer 'bn' forward" in text, text
    assert ("rank 1: no answer, as the diagnosis over horovodrun's rendezvous store failed (URLError: "
            "<urlopen error [Errno 111] Connection refused>).") in text, text
