"""Runs the rank-side suites (``tests/ranks_*.py``) at 1 rank, and at 2 and 3 ranks under
horovodrun (Gloo) and mpirun (MPI), over every transport.

Each rank runs the same pytest files, which compute their expectations from the world
size (mpi4py style); a launch passes only if every rank reports all of its tests passed,
none skipped (:func:`launching.run_suite`). Files of one framework that can share a
process share one launch: its start-up (launcher, imports, ``hvd.init()``) is paid once.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from launching import ROOT, TIMEOUT_S, clean_env, free_port, launch_command, run_suite

pytestmark = pytest.mark.ranks

TORCH = ["tests/ranks_torch.py"]
REPLICAS = "tests/ranks_replicas.py"  # DataParallel's replicas in each process, SyncBN across them
# What the split over ranks changes, not the transport: hypothesis's random cases run at 1
# rank and under mpirun at 2 and 3 (under horovodrun's Gloo, 200 examples took 3.4x and
# 4.7x as long as under mpirun: Horovod's cycle per collective).
PROPS = "tests/ranks_props.py"
MODELS = "tests/ranks_models.py"
TF = "tests/ranks_tf.py"
KERAS_BN = "tests/ranks_keras_bn.py"
KERAS_DEFAULTS = "tests/ranks_keras_defaults.py"
KERAS_MODELS = "tests/ranks_keras_models.py"
XLA = "tests/ranks_xla.py"  # the XLA allreduce: over MPI, so plainly and under mpirun
SLOW = (MODELS, KERAS_MODELS)
# What a transport or world size changes in the Keras suite: the oracle cases on both
# paths and inside XLA, unequal shards in a fit, a single global row, the transport rule
# (the rest checks the layer, and runs in the launches at 1 and 2 ranks).
TRANSPORT_TF = "global_batch or unequal_shards or fit_inside_xla or single_global_row or transport"
# At 2 ranks under mpirun, also what the device path's sum over MPI changes (the XLA
# allreduce outside XLA: its flags, a traced step without a host hop), and the other files
# whole: Keras's own tests on the device path, the Keras models, the XLA allreduce. The
# rest of ranks_tf.py runs at 2 ranks under horovodrun.
MPI_TF = (f"{TRANSPORT_TF} or device_path or check_callback or xla_optimizer or ranks_keras_bn or ranks_keras_models "
          "or ranks_xla")
# At 3 ranks under mpirun, also what an odd world with an empty rank changes beyond that:
# the renorm fit's empty tower, the mismatch naming two waiting ranks, the converted
# MobileNetV2 on the host path (its one world size), the XLA allreduce; the optimizers'
# fits (equal shards) and the rest of the layer's checks run at 2 ranks.
ODD_WORLD_TF = f"{TRANSPORT_TF} or renorm_model or mismatch or converted_keras_application or ranks_xla"
COMPILE = "tests/ranks_compile.py"
# ranks_torch.py and ranks_models.py make process sets, which Horovod allows only when
# asked for before hvd.init(), whichever file of the launch calls it first.
SETS = dict(HOROVOD_DYNAMIC_PROCESS_SETS="1")
# Horovod's dynamic timeline, for the tests that count collectives in it (ranks_torch.py,
# ranks_tf.py define them only with it on): in one launch each, as while it is on, rank 0's
# timeline writer thread spins in sched_yield for the whole process (a third of a core here).
TIMELINE = dict(HOROVOD_TIMELINE="DYNAMIC")

# (files, launcher, ranks, HVD_SYNCBN_COMM, more of run_suite's arguments: the ranks'
# environment, and ``select``, a -k expression where a launch only changes the transport
# or the world size). Every file runs at every launcher, world size and transport, the
# tests that launch changes (``select``), except the real models (``SLOW``) and the random
# cases (``PROPS``), which test the layers in training and on the split, not the transport.
# The layers' transport is automatic (""): Horovod under horovodrun, MPI under mpirun.
LAUNCHES = [
    # The PyTorch suite, at 1 rank plainly, 2 and 3 under horovodrun (Gloo) and mpirun;
    # the random cases at 1, 2 and 3 (PROPS); the real models (slow) at 1 and at 3 ranks
    # under mpirun only (unequal shards, an odd world): they test the layer in training,
    # not the transport (Horovod's Gloo at 2 and 3 ranks is covered by ranks_torch.py).
    (TORCH + [PROPS, MODELS, REPLICAS], "plain", 1, "", SETS),
    (TORCH, "horovodrun-gloo", 2, "", dict(SETS, **TIMELINE)),
    (TORCH + [PROPS, REPLICAS], "mpirun", 2, "", SETS),
    (TORCH, "horovodrun-gloo", 3, "", SETS),
    (TORCH + [PROPS, MODELS, REPLICAS], "mpirun", 3, "", SETS),
    # The Keras suite likewise, whole at 1 rank and at 2 under horovodrun, the README's
    # launcher; elsewhere what the launch changes (MPI_TF, TRANSPORT_TF, ODD_WORLD_TF). Its
    # real models under mpirun at 2 and 3; Keras's own BN tests with our layer swapped in at
    # 2 ranks on both default transports (the host path under horovodrun, the device path
    # under mpirun); Keras's defaults on a GPU machine under horovodrun (ranks_tf.py has the
    # default compile on a GPU machine); the XLA allreduce (MPI only) at 1 rank and under
    # mpirun.
    ([TF, XLA], "plain", 1, "", {}),
    ([TF, KERAS_BN, KERAS_DEFAULTS], "horovodrun-gloo", 2, "", TIMELINE),
    ([TF, KERAS_BN, KERAS_MODELS, XLA], "mpirun", 2, "", dict(select=MPI_TF)),
    ([TF], "horovodrun-gloo", 3, "", dict(select=TRANSPORT_TF)),
    ([TF, KERAS_MODELS, XLA], "mpirun", 3, "", dict(select=ODD_WORLD_TF)),
    # The other transports: Horovod's MPI controller under mpirun (for Keras under
    # horovodrun --mpi, which runs mpirun: its XLA cases sum over MPI), torch.distributed (Gloo).
    (TORCH, "mpirun", 2, "horovod", SETS),
    ([TF], "horovodrun-mpi", 2, "horovod", dict(select=TRANSPORT_TF + " or default_compile")),
    (["tests/ranks_torch.py", REPLICAS], "horovodrun-gloo", 2, "torch", SETS),
    # The device path, eager and compiled: functional collectives on a private group
    # bootstrapped over MPI, then on the user's Gloo group (one launch each at 2 and 3
    # ranks); the custom op over MPI/Horovod (and a private group over each, as CUDA
    # statistics would take). ranks_compile.py reads its transport at import: one each.
    ([COMPILE], "mpirun", 2, "torch", {}),
    ([COMPILE], "mpirun", 3, "torch", {}),
    ([COMPILE], "mpirun", 2, "mpi", {}),
    ([COMPILE], "mpirun", 3, "horovod", {}),
]


def launch_id(files, launcher, np_, comm, env) -> str:
    names = "+".join(f.split("/")[-1][len("ranks_"):-3] for f in files)
    return f"{launcher}-{np_}-{comm or 'auto'}-{names}"


@pytest.mark.parametrize("files, launcher, np_, comm, env", [
    pytest.param(*launch, marks=[pytest.mark.slow] if set(SLOW) & set(launch[0]) else [], id=launch_id(*launch))
    for launch in LAUNCHES])
def test_suites(files, launcher, np_, comm, env):
    run_suite(launcher, np_, files, comm, **env)  # each suite asserts that its layers use ``comm`` (if set)


def test_bn_groups_at_4_ranks_over_every_transport():
    """BN groups of 2 and by host, each equal plain BN on its batch, over MPI, Horovod and
    torch.distributed (ranks_groups_torch.py), and over MPI and Horovod in Keras
    (ranks_groups_tf.py), at 4 ranks under mpirun."""
    run_suite("mpirun", 4, "tests/ranks_groups_torch.py", HVD_SYNCBN_TEST_INIT=f"tcp://127.0.0.1:{free_port()}",
              **SETS)
    run_suite("mpirun", 4, "tests/ranks_groups_tf.py", **SETS)


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
if rank == world - 1:  # a process set of ranks over MPI: here this rank alone, plain BN on its rows
    x = np.array_split(x_all, world)[rank]
    y = h.SyncBatchNormalization(name="solo", process_set=[rank])(x, training=True)
    want = keras.layers.BatchNormalization(dtype="float64")(x, training=True)
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
    """hvd_syncbn.tensorflow imports and synchronises over MPI where Horovod is missing,
    within a process set of ranks too; what needs Horovod says so."""
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
    Horovod), and the private group at 1 rank, equals one process on the whole batch, and
    the profiler counts a layer step's launches, and torch's own SyncBN Function runs in
    its columns (through the CPU stand-ins), so the GPU check is not first run on a GPU."""
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run"], cwd=ROOT, env=clean_env(),
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, f"gpu_check exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    assert not [r for r in rows if any(bad in r for bad in ("FAILED", "MISMATCH", "skipped"))], rows
    summed = [r.split(" | ")[1] for r in rows if "| ok: max diff" in r]
    assert len(summed) == 5 and any("Horovod" in s for s in summed) and any("private group" in s for s in summed), rows
    assert any(r.startswith("| private group, 1 rank | ") for r in rows), rows
    assert any(r.startswith("| launches per layer step | ") and all(f"{k} " in r for k in ("native", "composite", "torch"))
               for r in rows), rows
    assert any(r.startswith("| training step vs torch's SyncBN | ") and "torch's" in r for r in rows), rows
