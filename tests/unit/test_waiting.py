"""A job's whole life, in one process: a slow rank makes its peers warn, not raise
(:mod:`hvd_syncbn.waiting`); the settings behind it; Horovod elastic's failure stays
recoverable (:mod:`hvd_syncbn.elastic`); a restarted job's diagnosis keys are its own
attempt's. The launched jobs are ``test_life.py``'s."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from conftest import collective_timeout, results, run, world
from hvd_syncbn import comm, settings, store_rows, transports, waiting
from hvd_syncbn.identity import Call


def call(layer: str = "body.bn1", rank: int = 0, step: int = 3) -> Call:
    return Call(layer, "fwd", step, 4, 4, "float32", rank)


@pytest.fixture
def warn_soon(monkeypatch):
    """Warnings after 0.3 s, marks after 0.15 s."""
    monkeypatch.setenv(settings.WARN_ENV, "0.3")


def late(rank_late: int, seconds: float):
    """A rank function: ``rank_late`` arrives ``seconds`` late in a collective of layer
    ``body.bn1`` that the others wait in; the sum is checked."""

    def fn(r, c):
        if r == rank_late:
            time.sleep(seconds)
        out = comm.allreduce(c, np.array([float(r + 1)]), call(rank=r))
        return float(out[0])

    return fn


def test_a_late_rank_makes_the_others_warn_naming_it_and_all_finish(warn_soon, caplog):
    """Rank 2 comes 1.2 s late (4 warning times, within the timeout of 3 s): the job
    finishes with the right sums, and each of ranks 0 and 1 has warned (at 0.3 s; the next
    would come a minute later), naming the layer, the step, rank 2 alone as missing, the
    time left and the settings; rank 2 warns nothing."""
    caplog.set_level(logging.WARNING, "hvd_syncbn")
    with collective_timeout(3.0):
        assert results(run(3, late(2, 1.2))) == [6.0, 6.0, 6.0]
    warned = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    for rank in (0, 1):
        mine = [m for m in warned if m.startswith(f"hvd_syncbn: rank {rank} has waited")]
        assert mine, warned
        text = mine[0]
        assert "in layer 'body.bn1' forward, step 3 (4 channels, 4D float32): rank 2 has not come." in text, text
        assert "this rank waits 3 s more (HVD_SYNCBN_TIMEOUT=3 s)" in text or "waits 2 s more" in text, text
        assert "Set HVD_SYNCBN_TIMEOUT to wait longer, HVD_SYNCBN_WARN to warn later." in text, text
    assert not [m for m in warned if m.startswith("hvd_syncbn: rank 2 ")], warned


def test_warnings_come_at_growing_intervals_never_twice_a_minute(monkeypatch):
    """The times of one wait's warnings: the warning time, then each time the wait has
    doubled, a minute apart at least; none after the timeout."""
    monkeypatch.setenv(settings.WARN_ENV, "20")

    class Timed(waiting.Waiting):  # the times of the warnings only
        def warn(self, now):
            times.append(now)

    times: list = []
    w = Timed(comm.LocalCommunicator(2), call(), since=0.0, timeout=600.0)
    for now in np.arange(0.0, 700.0, 0.5):
        w.check(float(now))
    assert times == [20.0, 80.0, 160.0, 320.0], times


def test_a_wait_that_ends_in_time_marks_nothing_and_a_bad_setting_is_named_first(warn_soon, monkeypatch):
    """A wait shorter than its first check leaves nothing on the side channel; a bad
    HVD_SYNCBN_WARN is refused before the collective starts, naming the variable."""
    comms = world(2)
    assert results(run(2, lambda r, c: float(comm.allreduce(c, np.array([1.0]), call(rank=r))[0]), comms)) == [2.0] * 2
    assert not [k for k in comms[0].side_comm.shared if isinstance(k, tuple) and k[0] == "waiting"]
    monkeypatch.setenv(settings.WARN_ENV, "soon")
    with pytest.raises(ValueError, match="HVD_SYNCBN_WARN: expected a positive number of seconds, got 'soon'"):
        comm.allreduce(comm.LocalCommunicator(2), np.array([1.0]), call())


def test_where_the_side_channel_is_one_collective_the_warning_says_it_cannot_tell(warn_soon, caplog):
    caplog.set_level(logging.WARNING, "hvd_syncbn")
    with collective_timeout(3.0):
        results(run(2, late(1, 0.8), comms=world(2, partial_gather=False)))
    text = next(r.getMessage() for r in caplog.records if "rank 0 has waited" in r.getMessage())
    assert "which ranks have not come threads cannot tell without a collective" in text, text


def test_a_blocking_wait_is_warned_by_the_watchdog(warn_soon, caplog):
    """A wait inside a library call that blocks (torch.distributed's): the watchdog thread
    warns while it lasts, naming what the side channel knows."""
    caplog.set_level(logging.WARNING, "hvd_syncbn")
    c = world(2)[0]
    w = waiting.blocking(c, call(), time.monotonic(), 5.0)
    try:
        time.sleep(1.6)
    finally:
        waiting.unblocked(w)
    texts = [r.getMessage() for r in caplog.records if "rank 0 has waited" in r.getMessage()]
    assert texts and "rank 1 has not come" in texts[0], texts


def test_settings_defaults_and_validation(monkeypatch):
    """10 minutes to raise, a minute to warn, a diagnosis grace of half the timeout up to
    30 s; bad values named."""
    for name in (settings.TIMEOUT_ENV, settings.WARN_ENV):
        monkeypatch.delenv(name, raising=False)
    settings._timeout = None
    assert (settings.get_timeout(), settings.warn_after(), settings.grace()) == (600.0, 60.0, 30.0)
    monkeypatch.setenv(settings.TIMEOUT_ENV, "4")
    assert settings.grace() == 2.0
    monkeypatch.setenv(settings.WARN_ENV, "0")
    with pytest.raises(ValueError, match="HVD_SYNCBN_WARN: expected a positive number of seconds, got '0'"):
        settings.warn_after()


class Shutdown(comm.Communicator):
    """A transport whose collective fails as Horovod's does when a worker left under
    elastic (Horovod shuts down), recovering as Horovod's communicators do."""

    kind, size = "horovod", 2

    def start(self, buf, name):
        return buf

    def done(self, handle):
        return True

    def result(self, handle):
        from horovod.common.exceptions import HorovodInternalError

        raise HorovodInternalError("Horovod has been shut down. This was caused by an exception on one of the ranks")

    def reset_error(self, error):
        from hvd_syncbn.elastic import reset_error

        return reset_error(error)


def test_horovods_shutdown_reaches_the_caller_as_a_recoverable_error_at_once():
    """Under Horovod elastic: an error hvd.elastic.run resets on (HorovodInternalError),
    which is also SyncBatchNormError, chained to Horovod's, at once (no diagnosis)."""
    pytest.importorskip("horovod")
    from horovod.common.exceptions import HorovodInternalError

    start = time.monotonic()
    with collective_timeout(5.0), pytest.raises(HorovodInternalError) as raised:
        comm.allreduce(Shutdown(), np.zeros(3), call())
    assert time.monotonic() - start < 1.0
    assert isinstance(raised.value, comm.SyncBatchNormError), type(raised.value).__mro__
    assert isinstance(raised.value.__cause__, HorovodInternalError)
    assert "in layer 'body.bn1' forward, step 3" in str(raised.value) and "Horovod has been shut down" in str(
        raised.value), raised.value


def test_a_new_horovod_world_gets_new_communicators():
    """The registry builds a communicator per Horovod size and rank: after an elastic reset
    to one rank, the layers' next step is over the new world."""
    registry = transports.Registry("test")
    built = []

    class Fake(transports.Transport):
        name = "horovod"

        def build(self, request, registry):
            built.append(request.horovod)
            return comm.LocalCommunicator(request.horovod[0], request.horovod[1])

    registry.register(Fake())
    before = registry.resolve("horovod", transports.Request("bn", horovod=(2, 1), key="all"))
    after = registry.resolve("horovod", transports.Request("bn", horovod=(1, 0), key="all"))
    assert before.size == 2 and after is None and built == [(2, 1), (1, 0)]


def test_a_restarted_jobs_diagnosis_reads_its_own_attempt(rendezvous, monkeypatch):
    """torchrun keeps its store across restarts: rows that attempt 0 wrote are not attempt
    1's, whose silent rank is named as silent."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = [store_rows.rendezvous_rows(r, 2, "g") for r in range(2)]
    for side in first:
        side.start_gather(np.full(3, side.rank + 1.0))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = store_rows.rendezvous_rows(0, 2, "g")
    handle = again.start_gather(np.zeros(3))
    assert set(again.gathered(handle)) == {0}, "attempt 1 read attempt 0's row"
    assert again.scope.endswith("job7.1") and first[0].scope.endswith("job7.0")
