"""When ranks disagree, send bad input, die, stop or fail outside SyncBN, every rank stops
with a message, in time.

Runs ``tests/fail_scenarios.py`` under horovodrun (Gloo, Horovod transport) and mpirun
(MPI transport) with ``HVD_SYNCBN_TIMEOUT=T``: every surviving rank must exit non-zero
within 2·T of the step that goes wrong, each with a message naming the layers involved.
Then the demo is killed mid-training at 3 ranks and resumed from its last checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from test_demo import DEMO, epochs
from launching import BIN, ROOT, clean_env, launch_command

pytestmark = pytest.mark.failures

T = 5.0
EXTRA = ["layer 'head.extra' forward, step 0", "layer 'body.bn1' forward, step 2"]
ORDER = ["layer 'body.bn2' forward, step 2", "layer 'body.bn1' forward, step 2"]
# Each scenario once per framework; each framework under each launcher (and so over the
# Horovod and the MPI transport) in two scenarios or more.
CASES = [  # framework, scenario, launcher, world, what every rank's message must contain
    ("torch", "extra_layer", "horovodrun-gloo", 2, EXTRA),
    ("keras", "extra_layer", "mpirun", 2, EXTRA),
    ("torch", "order", "mpirun", 2, ORDER),
    ("keras", "order", "mpirun", 3, ORDER),
    ("torch", "channels", "mpirun", 3, ["(4 channels, 3D float32)", "(8 channels, 3D float32)"]),
    ("keras", "channels", "horovodrun-gloo", 3, ["(4 channels, 3D float32)", "(8 channels, 3D float32)"]),
    ("torch", "dtype", "horovodrun-gloo", 2, ["3D float32)", "3D float64)"]),
    ("keras", "dtype", "mpirun", 2, ["3D float32)", "3D float64)"]),
    ("torch", "bad_input", "mpirun", 3, ["rank 1: body.bn1: expected 4 channels on axis 1, got 3"]),
    ("keras", "bad_input", "horovodrun-gloo", 3, ["rank 1: body.bn1: expected 4 channels on axis 1, got 3"]),
]
RESULT = re.compile(r"RESULT rank=(\d+) elapsed=([\d.]+) error=(\w+)\n(.*?)(?=\nRESULT|\Z)", re.S)


def launch(args: list, launcher: str, world: int, timeout: float = 120, seconds: float = T,
           launcher_args: tuple = (), env_extra: Optional[dict] = None) -> tuple:
    """Run ``args`` at ``world`` ranks with ``HVD_SYNCBN_TIMEOUT=seconds`` and ``env_extra``
    (and the launcher's own ``launcher_args``); ``(exit code, {rank: its output})``, ranks'
    outputs kept apart (horovodrun prefixes lines, mpirun writes a file per rank)."""
    env = clean_env()
    env["HVD_SYNCBN_TIMEOUT"] = str(seconds)
    env.update(env_extra or {})
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"hvd_syncbn_fail_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = launch_command(launcher, world) + list(launcher_args)
    if launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), "--nproc-per-node", str(world), "--tee", "3", *launcher_args]
    if launcher == "mpirun":
        cmd += ["-x", "HVD_SYNCBN_TIMEOUT", *(a for k in (env_extra or {}) for a in ("-x", k)),
                "--output-filename", str(tmp)]
    python = [] if launcher == "torchrun" else [sys.executable]  # torchrun runs the script with its own
    out = subprocess.run(cmd + [*python, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    logs = {}
    if launcher == "mpirun":
        for f in tmp.glob("*/rank.*/stdout"):
            logs[int(f.parent.name.split(".")[1])] = f.read_text()
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        for line in out.stdout.splitlines():
            m = re.match(r"\[(?:default)?(\d+)\](?:<stdout>)?:(.*)", line)  # horovodrun's, torchrun's
            if m:
                logs.setdefault(int(m.group(1)), []).append(m.group(2))
        logs = {r: "\n".join(lines) for r, lines in logs.items()}
    return out.returncode, logs, out.stdout + out.stderr


@pytest.mark.parametrize("framework, scenario, launcher, world, expected", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_every_rank_stops_in_time_naming_the_layers(framework, scenario, launcher, world, expected):
    rc, logs, raw = launch(["tests/fail_scenarios.py", framework, scenario], launcher, world)
    assert rc != 0, f"the job exited 0:\n{raw[-4000:]}"
    for rank in range(world):
        found = RESULT.findall(logs.get(rank, ""))
        assert found, f"rank {rank} reported no error:\n{logs.get(rank, raw)[-3000:]}"
        _, elapsed, error, message = found[0]
        assert "SyncBatchNorm" in error, f"rank {rank}: {error}: {message[:2000]}"
        assert float(elapsed) <= 2 * T, f"rank {rank} took {elapsed} s (timeout {T} s)"
        for text in expected:
            assert text in message, f"rank {rank}'s message lacks {text!r}:\n{message[:3000]}"
        assert "missing there: ranks" in message or scenario == "bad_input", message[:3000]


def test_keras_bad_input_alone_raises_plain_value_error():
    """One process, no peers: the same checks, as ValueError."""
    check = ("import numpy as np, hvd_syncbn.tensorflow as h; bn = h.SyncBatchNormalization(axis=1, name='b');"
             "bn(np.ones((2, 4, 3), 'float32'), training=True)\n"
             "try: bn(np.ones((2, 3, 3), 'float32'), training=True)\n"
             "except ValueError as e: print(e)")
    out = subprocess.run([sys.executable, "-c", check], env=clean_env(), capture_output=True, text=True,
                         timeout=120)
    assert "b: expected 4 channels on axis 1, got 3" in out.stdout, out.stdout + out.stderr[-2000:]


@pytest.mark.parametrize("where", ["xla", "graph"])
def test_xla_allreduce_without_a_peer_fails_in_time_naming_it(where):
    """Rank 1 never joins, inside jit_compile=True (the custom call) or a plain
    tf.function (the kernel): rank 0 raises within 2·T naming the collective, and the job
    ends (rank 1 would sleep 600 s)."""
    seconds, start = 3.0, time.monotonic()
    rc, logs, raw = launch(["tests/xla_missing_peer.py", where], "mpirun", 2, seconds=seconds)
    took = time.monotonic() - start
    assert rc != 0, raw[-3000:]
    found = RESULT.findall(logs.get(0, ""))
    assert found, f"rank 0 reported no error:\n{logs.get(0, raw)[-3000:]}"
    _, elapsed, error, message = found[0]
    assert error == "DeadlineExceededError", f"{error}: {message[:2000]}"
    assert "hvd_syncbn.test.missing_peer: the other ranks did not join within 3 s" in message, message[:2000]
    assert float(elapsed) <= 2 * seconds, f"rank 0 took {elapsed} s (timeout {seconds} s)"
    assert took < 90, f"the job took {took:.0f} s to end"


# ------------------------------------- the device path over torch.distributed

# launcher, world, scenario, mode, what every live rank's message must say. torchrun
# (Gloo) and mpirun (comm='torch': a private Gloo group over MPI); eager and compiled.
DEVICE_CASES = [
    ("mpirun", 2, "stop", "eager", "missing there: ranks [1]"),
    ("mpirun", 3, "stop", "compiled", "missing there: ranks [2]"),
    ("torchrun", 2, "exit", "compiled", "missing there: ranks [1]"),
    ("torchrun", 3, "raise", "eager", "rank 2: body.bn1: expected 4 channels on axis 1, got 3"),
]


@pytest.mark.parametrize("launcher, world, scenario, mode, expected", DEVICE_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in DEVICE_CASES])
def test_device_path_over_torch_distributed_names_the_fault_in_time(launcher, world, scenario, mode, expected):
    """On the device path over torch.distributed (Gloo), the last rank stops, exits or
    sends bad input at step 2: every live rank raises SyncBatchNormError naming the layer,
    the direction, the step and the missing rank (or the bad input) within 2·T, and the
    job ends within 2·T + 5 s. (Under torchrun a stopped rank ends 30 s later: torchrun
    waits that long after its SIGTERM, which a stopped process does not take, before SIGKILL.)"""
    seconds = 3.0
    rc, logs, raw = launch(["tests/device_faults.py", scenario, mode], launcher, world, seconds=seconds)
    assert rc != 0, raw[-3000:]
    bad_at = re.search(r"BAD-STEP rank=0 t=([\d.]+)", logs.get(0, ""))
    assert bad_at, f"rank 0 never reached step 2:\n{raw[-3000:]}"
    ended = time.time() - float(bad_at.group(1))
    assert ended <= 2 * seconds + 5, f"the job ended {ended:.1f} s after step 2 began:\n{raw[-3000:]}"
    for rank in range(world - (scenario != "raise")):
        found = RESULT.findall(logs.get(rank, ""))
        assert found, f"rank {rank} reported no error:\n{logs.get(rank, raw)[-3000:]}"
        _, elapsed, error, message = found[0]
        assert error.startswith("SyncBatchNorm") and float(elapsed) <= 2 * seconds, f"rank {rank}: {error} {elapsed} s"
        for text in ("layer 'body.bn1' forward, step 2", expected):
            assert text in message, f"rank {rank}'s message lacks {text!r}:\n{message[:3000]}"




def test_device_path_a_skipped_layer_ends_the_job():
    """The last of 2 ranks skips layer body.bn1 at step 2 (eager, mpirun, comm='torch'):
    its collectives pair with its peer's others, of another size, and Gloo ends the
    process that receives the larger one (SIGABRT, 'Is there a distributed collective
    mismatch in your code?'): not named, but the job ends within 2·T + 5 s instead of
    training on with NaN (which buffers of one size would give: see docs/failures.md)."""
    seconds = 3.0
    rc, logs, raw = launch(["tests/device_faults.py", "skip", "eager"], "mpirun", 2, seconds=seconds)
    assert rc != 0, raw[-3000:]
    bad_at = re.search(r"BAD-STEP rank=0 t=([\d.]+)", logs.get(0, ""))
    assert bad_at, f"rank 0 never reached step 2:\n{raw[-3000:]}"
    ended = time.time() - float(bad_at.group(1))
    assert ended <= 2 * seconds + 5, f"the job ended {ended:.1f} s after step 2 began:\n{raw[-3000:]}"
    assert "collective mismatch" in raw, raw[-3000:]


# Keras's device path under mpirun: the library's allreduce (its TensorFlow kernel, or its
# XLA custom call), whose failure runs the host path's diagnosis.
# model.fit compiled by XLA: the custom call; its step outside XLA is the tf.function's kernel.
KERAS_DEVICE_CASES = [("stuck", "function"), ("exit", "xla")]


@pytest.mark.parametrize("scenario, mode", KERAS_DEVICE_CASES, ids=[f"{s}-{m}" for s, m in KERAS_DEVICE_CASES])
def test_keras_device_path_over_mpi_names_the_fault_in_time(scenario, mode):
    """On the Keras device path under mpirun (2 ranks), rank 1 gets stuck or exits at
    step 2 of a tf.function, model.fit or model.fit under XLA: rank 0's step raises TF's
    DeadlineExceededError carrying the SyncBatchNormError diagnosis (the layer, the
    direction, the step, the missing rank) within 2·T, and the job ends within 2·T + 5 s."""
    seconds = 3.0
    rc, logs, raw = launch(["tests/keras_device_faults.py", scenario, mode], "mpirun", 2, seconds=seconds)
    assert rc != 0, raw[-3000:]
    bad_at = re.search(r"BAD-STEP rank=0 t=([\d.]+)", logs.get(0, ""))
    assert bad_at, f"rank 0 never reached step 2:\n{raw[-3000:]}"
    ended = time.time() - float(bad_at.group(1))
    assert ended <= 2 * seconds + 5, f"the job ended {ended:.1f} s after step 2 began:\n{raw[-3000:]}"
    found = RESULT.findall(logs.get(0, ""))
    assert found, f"rank 0 reported no error:\n{logs.get(0, raw)[-3000:]}"
    _, elapsed, error, message = found[0]
    assert error == "DeadlineExceededError" and float(elapsed) <= 2 * seconds, f"{error} {elapsed} s"
    for text in ("SyncBatchNormError: ", "layer 'probe_bn' forward, step 2", "missing there: ranks [1]",
                 "rank 1 did not answer"):
        assert text in message, f"rank 0's message lacks {text!r}:\n{message[:3000]}"



def test_keras_device_path_over_mpi_names_the_layers_on_each_side():
    """Forced onto the device path under mpirun, rank 1's layer has 8 channels where rank
    0's has 4 (buffers of two lengths: MPI_ERR_TRUNCATE on one rank, the deadline on the
    other): both raise within 2·T with the diagnosis naming each rank's layer."""
    seconds = 3.0
    rc, logs, raw = launch(["tests/fail_scenarios.py", "keras", "channels"], "mpirun", 2, seconds=seconds,
                           launcher_args=("-x", "HVD_SYNCBN_STATS=device"))
    assert rc != 0, raw[-3000:]
    for rank in (0, 1):
        found = RESULT.findall(logs.get(rank, ""))
        assert found, f"rank {rank} reported no error:\n{logs.get(rank, raw)[-3000:]}"
        _, elapsed, error, message = found[0]
        assert error in ("InternalError", "DeadlineExceededError") and float(elapsed) <= 2 * seconds, \
            f"rank {rank}: {error} {elapsed} s"
        for text in ("SyncBatchNormError: ", "ranks [0] are waiting in layer 'body.bn1' forward, step 2 (4 channels",
                     "ranks [1] are waiting in layer 'body.bn1' forward, step 2 (8 channels"):
            assert text in message, f"rank {rank}'s message lacks {text!r}:\n{message[:3000]}"


# -------------------------------------------- a rank killed; the demo resumes

# Each launcher (the launcher ends the job) and each framework once.
DIE_CASES = [("torch", "mpirun"), ("keras", "horovodrun-gloo")]


@pytest.mark.parametrize("framework, launcher", DIE_CASES, ids=[f"{f}-{l}" for f, l in DIE_CASES])
def test_peers_of_a_killed_rank_exit_nonzero_in_time(framework, launcher):
    start = time.monotonic()
    rc, logs, raw = launch(["tests/fail_scenarios.py", framework, "die"], launcher, 3)
    assert rc != 0, raw[-3000:]
    bad = [re.search(r"BAD-STEP rank=(\d) t=([\d.]+)", logs.get(r, "")) for r in range(3)]
    killed_at = float(bad[2].group(2)) if bad[2] else None
    assert killed_at, f"rank 2 never reached the step where it dies:\n{raw[-3000:]}"
    # Within the timeout, as the issue asks (measured: 0.1-1.1 s; the launchers end the job).
    assert time.time() - killed_at <= T, f"the job ended {time.time() - killed_at:.1f} s after the kill"
    for rank in (0, 1):
        assert f"RESULT rank={rank} finished" not in logs.get(rank, ""), f"rank {rank} finished despite a dead peer"
    assert time.monotonic() - start < 120


STOP_CASES = [("torch", "mpirun"), ("keras", "horovodrun-gloo")]  # the diagnosis point to point; through the store


@pytest.mark.parametrize("framework, launcher", STOP_CASES, ids=[f"{f}-{l}" for f, l in STOP_CASES])
def test_the_peers_of_a_stopped_rank_name_it(framework, launcher):
    """Rank 2 of 3 stops (SIGSTOP, as a hung node) in the step that goes wrong: ranks 0
    and 1 each say where both of them wait and that rank 2 did not answer, within 2·T,
    and the job ends. Under horovodrun, Horovod's shutdown would wait out Gloo's receive
    timeout (30 s) for the stopped rank: the ranks exit hard after T/2 instead, and
    horovodrun stops rank 2 (SIGTERM, 5 s, SIGKILL)."""
    start = time.monotonic()
    rc, logs, raw = launch(["tests/fail_scenarios.py", framework, "stop"], launcher, 3)
    assert rc != 0, raw[-3000:]
    bad_at = re.search(r"BAD-STEP rank=0 t=([\d.]+)", logs.get(0, ""))
    ended = time.time() - float(bad_at.group(1))
    # 2·T and the ranks' LINGER_S, then horovodrun's stop of rank 2 (measured 21.6 s in all)
    print(f"{launcher}: the job ended {ended:.1f} s after the step where rank 2 stopped (T = {T:g} s)")
    assert ended <= 2 * T + 13, f"the job ended {ended:.1f} s after the step that went wrong:\n{raw[-3000:]}"
    for rank in (0, 1):
        found = RESULT.findall(logs.get(rank, ""))
        assert found, f"rank {rank} reported no error:\n{logs.get(rank, raw)[-3000:]}"
        _, elapsed, error, message = found[0]
        assert "SyncBatchNorm" in error and float(elapsed) <= 2 * T, f"rank {rank}: {error} after {elapsed} s"
        for text in ("ranks [0, 1] are waiting in layer 'body.bn1' forward, step 2",
                     "missing there: ranks [2]", "rank 2 did not answer within the diagnosis time"):
            assert text in message, f"rank {rank}'s message lacks {text!r}:\n{message[:3000]}"
    assert time.monotonic() - start < 120


def test_a_rank_stopped_for_less_than_the_timeout_holds_its_peers_back_and_all_finish():
    """Rank 2 of 3 stops (SIGSTOP) for 0.6·T in the step that goes wrong and is continued:
    its peers wait for it, no rank raises and the job exits 0."""
    rc, logs, raw = launch(["tests/fail_scenarios.py", "torch", "pause"], "mpirun", 3)
    assert rc == 0, raw[-3000:]
    for rank in range(3):
        took = re.search(rf"RESULT rank={rank} finished, ([\d.]+) s after", logs.get(rank, ""))
        assert took, f"rank {rank} did not finish:\n{logs.get(rank, raw)[-3000:]}"
        assert float(took.group(1)) >= 0.5 * T, f"rank {rank} was not held back: {took.group(0)}"


@pytest.mark.parametrize("framework", ["torch", "keras"])
def test_a_rank_failing_outside_syncbn_leaves_no_mpi_call_after_finalize(framework):
    """Under mpirun with Horovod initialised first, rank 2 raises outside SyncBN (as on a
    full disk) while its peers wait in SyncBN over MPI: Horovod finalizes MPI under their
    wait; they raise, saying so, and never call MPI after MPI_Finalize (Open MPI's abort)."""
    rc, logs, raw = launch(["tests/fail_scenarios.py", framework, "exit"], "mpirun", 3)
    assert rc != 0, raw[-3000:]
    assert "after MPI_FINALIZE" not in raw, raw[-3000:]
    for rank in (0, 1):
        found = RESULT.findall(logs.get(rank, ""))
        assert found, f"rank {rank} reported no error:\n{logs.get(rank, raw)[-3000:]}"
        _, elapsed, error, message = found[0]
        assert "SyncBatchNorm" in error and float(elapsed) <= 2 * T, f"rank {rank}: {error} after {elapsed} s"
        assert "layer 'body.bn1' forward, step 2" in message, message[:3000]


def _rank_pid(rank: int, script: str) -> int | None:
    """PID of the process running ``script`` as Horovod/MPI rank ``rank``."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
            env = (proc / "environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if script in cmd and "python" in cmd and ("HOROVOD_RANK=%d" % rank in env or
                                                 "OMPI_COMM_WORLD_RANK=%d" % rank in env):
            return int(proc.name)
    return None


DEMO_ARGS = ["--train-size", "96", "--val-size", "6", "--image-size", "16", "--width", "4", "--epochs", "2"]


def deterministic_env() -> dict:
    """Without tensor fusion Horovod reduces each gradient on its own, so the summation
    order, hence every bit of the weights, no longer depends on timing."""
    return {**clean_env(), "HOROVOD_FUSION_THRESHOLD": "0"}


@pytest.mark.slow
def test_demo_killed_mid_training_resumes_like_uninterrupted(tmp_path):
    whole = subprocess.run(
        launch_command("horovodrun-gloo", 3) + [sys.executable, str(DEMO), *DEMO_ARGS,
                                                "--checkpoint-dir", str(tmp_path / "whole")],
        cwd=ROOT, env=deterministic_env(), capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]

    ckpt = tmp_path / "crash" / "segmentation_sync.pt"
    env = deterministic_env()
    env["HVD_SYNCBN_TIMEOUT"] = str(T)
    job = subprocess.Popen(
        launch_command("horovodrun-gloo", 3) + [sys.executable, str(DEMO), *DEMO_ARGS,
                                                "--checkpoint-dir", str(ckpt.parent)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ckpt.exists() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.05)
        assert ckpt.exists(), "no checkpoint after epoch 1"
        pid = _rank_pid(2, DEMO.name)
        assert pid, "rank 2's process not found"
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        out, _ = job.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0, out[-3000:]
    assert took <= T, f"the surviving ranks took {took:.1f} s to exit, more than the timeout"
    assert torch.load(ckpt)["epoch"] == 1, "the kill came too late: epoch 2 had finished"

    resumed = subprocess.run(
        launch_command("horovodrun-gloo", 3) + [sys.executable, str(DEMO), *DEMO_ARGS, "--resume",
                                                "--checkpoint-dir", str(ckpt.parent)],
        cwd=ROOT, env=deterministic_env(), capture_output=True, text=True, timeout=600)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0 and "resumed from epoch 1" in log, log[-3000:]
    assert epochs(log, "sync")[2] == epochs(whole.stdout + whole.stderr, "sync")[2]
    a, b = torch.load(tmp_path / "whole" / "segmentation_sync.pt"), torch.load(ckpt)
    for key, value in a["model"].items():  # parameters and BN running statistics, bitwise
        assert torch.equal(value, b["model"][key]), f"{key} differs after resuming"
