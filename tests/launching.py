"""Launching ranks from a test: the launchers' command lines, a clean environment for
them, and running rank-side pytest suites (``tests/ranks_*.py``) at N ranks.

Every test file that starts ranks (``horovodrun``, ``mpirun``, ``launch/*.sh``) imports
these helpers from here.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence, Union

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TIMEOUT_S = 600
# A rank whose assertion fails skips collectives its peers wait in: let Horovod's stall
# inspector shut the job down quickly instead of hanging until TIMEOUT_S.
STALL = dict(HOROVOD_STALL_CHECK_TIME_SECONDS="5", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="30")
# In a rank-side suite, one rank once came 30 s late to a Keras fit's first broadcast, and
# at times one rank traces a Keras step ~20 s slower than its peer, which waits (seen with
# faulthandler; intermittent, cause not found): a late rank is not a failure of the suite,
# which waits up to 120 s before the shutdown.
SUITE_STALL = dict(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="120")


def clean_env() -> dict:
    """This process's environment without the MPI/Horovod state an in-process
    ``hvd.init()`` may have left, which would confuse a nested launcher."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "HOROVOD_"))}
    # Open MPI's waiting ranks yield their core, as launch/mpirun.sh and the image set it
    # (spinning, they take the cores from the ranks that compute: up to 1.5x the time here).
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
               OMPI_MCA_mpi_yield_when_idle="1", **STALL)
    return env


def launch_command(launcher: str, np_: int) -> list:
    """The launcher's part of a command line for ``np_`` ranks on this machine: ``plain``
    (none), ``horovodrun-gloo``, ``horovodrun-mpi`` (horovodrun running mpirun, which
    exports the whole environment) or ``mpirun``."""
    if launcher == "plain":
        return []
    if launcher.startswith("horovodrun-"):
        return [str(BIN / "horovodrun"), "--" + launcher.split("-")[1], "-np", str(np_), "-H", f"localhost:{np_}"]
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun not found: run launch/install.sh"
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [mpirun, *root, "--oversubscribe", "-np", str(np_), "-bind-to", "none", "-map-by", "slot",
            *(arg for name in ["PATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", *STALL] for arg in ("-x", name))]


SUMMARY = r"^(?:\[[\d,]+\]<stdout>:)?(=* ?\d+ (?:passed|failed).*)$"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_suite(launcher: str, np_: int, suites: Union[str, Sequence[str]], comm: str = "", select: str = "",
              **extra: str) -> str:
    """Run the pytest files ``suites`` at ``np_`` ranks, one pytest process per rank over
    all of them (one start-up for several files); ``comm`` sets HVD_SYNCBN_COMM (default:
    auto); ``select``, a pytest ``-k`` expression (default: every test); ``extra``, more
    variables of the ranks' environment. Passes only if every rank
    reports all its tests passed, none skipped; ranks stop at their first failure
    (``-x``), so the launcher ends the job instead of the others waiting in a collective."""
    suites = [suites] if isinstance(suites, str) else list(suites)
    env = dict(clean_env(), **SUITE_STALL, **extra)
    forwarded = list(extra)
    if comm:
        env.update(HVD_SYNCBN_COMM=comm, HVD_SYNCBN_TEST_INIT=f"tcp://127.0.0.1:{free_port()}")
        forwarded += ["HVD_SYNCBN_COMM", "HVD_SYNCBN_TEST_INIT"]
    with tempfile.TemporaryDirectory() as outputs:
        # mpirun (also under horovodrun --mpi) forwards output in chunks, so one rank's summary
        # can land mid-line between another's progress dots: each rank writes a file of its own
        # (mpirun: <dir>/1/rank.N/stdout; horovodrun --gloo: <dir>/rank.N/stdout).
        files = ["--output-filename", outputs] if launcher != "plain" else []
        passed = [a for k in forwarded if launcher == "mpirun" for a in ("-x", k)]
        cmd = launch_command(launcher, np_) + files + passed + [
            sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--color=no", *suites,
        ] + (["-k", select] if select else [])
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        logs = [f.read_text() for f in sorted(Path(outputs).rglob("rank.*/stdout"))] if files else []
    log = "\n".join([out.stdout, out.stderr])
    summaries = re.findall(SUMMARY, "\n".join(logs) if files else log, re.M)  # mpirun also echoes
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}:\n{log[-6000:]}"
    assert len(summaries) == np_, f"expected {np_} rank summaries, got {summaries}:\n{log[-3000:]}"
    for line in summaries:
        assert re.search(r"\d+ passed", line) and not re.search(r"failed|error|skipped", line), line
    return log
