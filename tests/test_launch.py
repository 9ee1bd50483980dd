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
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SUITES = ["tests/ranks_torch.py", "tests/ranks_tf.py", "tests/ranks_props.py", "tests/ranks_models.py"]
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_suite(launcher: str, np_: int, suite: str, comm: str = "") -> str:
    """Run ``suite`` at ``np_`` ranks; ``comm`` sets HVD_SYNCBN_COMM (default: auto)."""
    env = clean_env()
    if comm:
        env.update(HVD_SYNCBN_COMM=comm, HVD_SYNCBN_TEST_INIT=f"tcp://127.0.0.1:{free_port()}")
    with tempfile.TemporaryDirectory() as outputs:
        # mpirun forwards output in chunks, so one rank's summary can land mid-line between
        # another's progress dots: under mpirun each rank writes a file of its own.
        files = ["--output-filename", outputs] if launcher == "mpirun" else []
        passed = [a for k in ("HVD_SYNCBN_COMM", "HVD_SYNCBN_TEST_INIT") if comm and launcher == "mpirun"
                  for a in ("-x", k)]
        cmd = launch_command(launcher, np_) + files + passed + [
            sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--color=no", suite,
        ]
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        logs = [f.read_text() for f in sorted(Path(outputs).glob("*/rank.*/stdout"))] if files else []
    log = "\n".join([out.stdout, out.stderr])
    summaries = re.findall(SUMMARY, "\n".join(logs) if files else log, re.M)  # mpirun also echoes
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}:\n{log[-6000:]}"
    assert len(summaries) == np_, f"expected {np_} rank summaries, got {summaries}:\n{log[-3000:]}"
    for line in summaries:
        assert re.search(r"\d+ passed", line) and not re.search(r"failed|error|skipped", line), line
    return log


# The layers' transport is automatic: Horovod under horovodrun, MPI (mpi4py) under mpirun.
RUNS = [("plain", 1), ("horovodrun-gloo", 2), ("mpirun", 2), ("horovodrun-gloo", 3), ("mpirun", 3)]
# The other transports: Horovod's MPI controller under mpirun, torch.distributed (Gloo).
OTHER_PATHS = [("tests/ranks_torch.py", "mpirun", 2, "horovod"), ("tests/ranks_tf.py", "mpirun", 2, "horovod"),
               ("tests/ranks_torch.py", "horovodrun-gloo", 2, "torch"),
               ("tests/ranks_props.py", "mpirun", 2, "horovod"),
               # Keras's own BN tests with our layer swapped in, at 2 ranks on both default transports.
               ("tests/ranks_keras_bn.py", "mpirun", 2, ""), ("tests/ranks_keras_bn.py", "horovodrun-gloo", 2, ""),
               # The device path, eager and compiled: functional collectives on a private group bootstrapped
               # over MPI, then on the user's Gloo group (one launch each at 2 and 3 ranks); the custom op
               # over MPI/Horovod (and a private group over each, as CUDA statistics would take).
               ("tests/ranks_compile.py", "mpirun", 2, "torch"), ("tests/ranks_compile.py", "mpirun", 3, "torch"),
               ("tests/ranks_compile.py", "mpirun", 2, "mpi"), ("tests/ranks_compile.py", "mpirun", 3, "horovod")]


# Every suite at every run, but the real models run alone and under mpirun only: each run
# takes minutes, and they test the layer, not the transport (Horovod's Gloo at 2 and 3
# ranks is covered by the other suites).
SUITE_RUNS = [(s, l, n) for l, n in RUNS for s in SUITES
              if not (s == "tests/ranks_models.py" and l == "horovodrun-gloo")]


@pytest.mark.parametrize("suite, launcher, np_", SUITE_RUNS, ids=[f"{l}-{n}-{s}" for s, l, n in SUITE_RUNS])
def test_suite(launcher, np_, suite):
    run_suite(launcher, np_, suite)


@pytest.mark.parametrize("suite, launcher, np_, comm", OTHER_PATHS,
                         ids=[f"{s.split('/')[-1][:-3]}-{l}-{n}-{c or 'auto'}" for s, l, n, c in OTHER_PATHS])
def test_suite_over_other_transports(suite, launcher, np_, comm):
    run_suite(launcher, np_, suite, comm)  # each suite asserts that its layers use ``comm`` (if set)


NO_HOROVOD = """
import sys
sys.modules["horovod"] = None  # as if Horovod were not installed
import numpy as np, keras
import hvd_syncbn.tensorflow as h
from mpi4py import MPI
rank, world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
x_all = np.random.default_rng(0).standard_normal((7, 3)).astype("float32")
y = h.SyncBatchNormalization(name="bn")(np.array_split(x_all, world)[rank], training=True)
want = np.array_split(keras.layers.BatchNormalization(dtype="float64")(x_all, training=True), world)[rank]
assert np.abs(np.asarray(y) - want).max() < 1e-5, np.abs(np.asarray(y) - want).max()
try:
    h.DistributedOptimizer(keras.optimizers.SGD())
except ImportError as e:
    assert "DistributedOptimizer needs Horovod" in str(e), e
else:
    raise AssertionError("DistributedOptimizer without Horovod did not raise")
print(f"rank {rank}: ok")
"""


def test_keras_layer_runs_over_mpi_without_horovod():
    """hvd_syncbn.tensorflow imports and synchronises over MPI where Horovod is missing;
    what needs Horovod says so."""
    cmd = launch_command("mpirun", 2) + [sys.executable, "-c", NO_HOROVOD]
    out = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    log = out.stdout + out.stderr
    assert out.returncode == 0 and log.count(": ok") == 2, log[-4000:]


TRACED = """
import logging, io
import numpy as np, keras, tensorflow as tf
import horovod.tensorflow as hvd
import hvd_syncbn.tensorflow as h
hvd.init()
log = io.StringIO()
tf.get_logger().addHandler(logging.StreamHandler(log))
x = tf.random.normal([3, 4, 4, 2])
for comm in ("auto", "horovod"):
    layer = h.SyncBatchNormalization(comm=comm, name=f"bn_{comm}")

    @tf.function
    def step(t):
        return layer(t, training=True), h.sync_batch_normalization(t, None, None, 1e-3, name=f"op_{comm}", comm=comm)

    step(x)
model = h.convert_sync_batchnorm(keras.Sequential([keras.Input((4, 4, 2)), keras.layers.Conv2D(2, 3),
                                                  keras.layers.BatchNormalization(), keras.layers.Flatten()]))
model.compile(optimizer=h.DistributedOptimizer(keras.optimizers.SGD()), loss="mse")
model.fit(np.ones((4, 4, 4, 2), "float32"), np.ones((4, 8), "float32"), batch_size=2, verbose=0)
assert "AutoGraph" not in log.getvalue(), log.getvalue()
print(f"rank {hvd.rank()}: ok")
"""


def test_traced_layers_log_no_autograph_warning(tmp_path):
    """Tracing the layer, the functional op and a converted model's ``fit`` under mpirun
    (Horovod initialised, over MPI and over Horovod) logs nothing from AutoGraph about our
    code (it used to warn that it could not transform mpi4py's ``Get_size``). The script
    is a file: AutoGraph converts only functions whose source it can read."""
    script = tmp_path / "traced.py"
    script.write_text(TRACED)
    cmd = launch_command("mpirun", 2) + [sys.executable, str(script)]
    env = dict(clean_env(), PYTHONPATH=str(ROOT))  # a script's folder, not ROOT, heads sys.path
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    log = out.stdout + out.stderr
    assert out.returncode == 0 and log.count(": ok") == 2 and "AutoGraph could not" not in log, log[-4000:]


def test_gpu_check_dry_run_checks_its_plumbing():
    """``benchmarks/gpu_check.py --dry-run`` on the CPU: every check runs, and each way 2
    processes sum (Gloo; under mpirun the private group, the custom op over MPI and over
    Horovod), and the private group at 1 rank, equals one process on the whole batch, so
    the GPU check is not first run on a GPU."""
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run"], cwd=ROOT, env=clean_env(),
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, f"gpu_check exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    assert not [r for r in rows if any(bad in r for bad in ("FAILED", "MISMATCH", "skipped"))], rows
    summed = [r.split(" | ")[1] for r in rows if "| ok: max diff" in r]
    assert len(summed) == 5 and any("Horovod" in s for s in summed) and any("private group" in s for s in summed), rows
    assert any(r.startswith("| private group, 1 rank | ") for r in rows), rows
