"""Runs the rank-side suites (``tests/ranks_*.py``) at 1 rank, and at 2 and 3 ranks under
horovodrun (Gloo) and mpirun (MPI).

Each rank runs the same pytest file, which computes its expectations from the world
size (mpi4py style); a run passes only if every rank reports all of
its tests passed, none skipped. Ranks stop at their first failure (``-x``), so the
launcher ends the job instead of the others waiting in a collective.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SUITES = ["tests/ranks_torch.py", "tests/ranks_tf.py"]
TIMEOUT_S = 600
# A rank whose assertion fails skips collectives its peers wait in: let Horovod's stall
# inspector shut the job down quickly instead of hanging until TIMEOUT_S.
STALL = dict(HOROVOD_STALL_CHECK_TIME_SECONDS="5", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="30")


def clean_env() -> dict:
    """This process's environment without the MPI/Horovod state an in-process
    ``hvd.init()`` may have left, which would confuse a nested launcher."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "HOROVOD_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", **STALL)
    return env


def launch_command(launcher: str, np_: int) -> list:
    if launcher == "plain":
        return []
    if launcher == "horovodrun-gloo":
        return [str(BIN / "horovodrun"), "--gloo", "-np", str(np_), "-H", f"localhost:{np_}"]
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun not found: run launch/install.sh"
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [mpirun, *root, "--oversubscribe", "-np", str(np_), "-bind-to", "none", "-map-by", "slot",
            *(arg for name in ["PATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", *STALL] for arg in ("-x", name))]


SUMMARY = r"^(?:\[[\d,]+\]<stdout>:)?(=* ?\d+ (?:passed|failed).*)$"


def run_suite(launcher: str, np_: int, suite: str) -> str:
    with tempfile.TemporaryDirectory() as outputs:
        # mpirun forwards output in chunks, so one rank's summary can land mid-line between
        # another's progress dots: under mpirun each rank writes a file of its own.
        files = ["--output-filename", outputs] if launcher == "mpirun" else []
        cmd = launch_command(launcher, np_) + files + [
            sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--color=no", suite,
        ]
        out = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
        logs = [f.read_text() for f in sorted(Path(outputs).glob("*/rank.*/stdout"))] if files else []
    log = "\n".join([out.stdout, out.stderr])
    summaries = re.findall(SUMMARY, "\n".join(logs) if files else log, re.M)  # mpirun also echoes
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}:\n{log[-6000:]}"
    assert len(summaries) == np_, f"expected {np_} rank summaries, got {summaries}:\n{log[-3000:]}"
    for line in summaries:
        assert re.search(r"\d+ passed", line) and not re.search(r"failed|error|skipped", line), line
    return log


RUNS = [("plain", 1), ("horovodrun-gloo", 2), ("mpirun", 2), ("horovodrun-gloo", 3), ("mpirun", 3)]


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("launcher, np_", RUNS, ids=[f"{l}-{n}" for l, n in RUNS])
def test_suite(launcher, np_, suite):
    run_suite(launcher, np_, suite)
