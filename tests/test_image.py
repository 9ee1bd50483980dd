"""Builds the image with launch/image.sh (a debootstrapped Debian base, buildah, no Docker
Hub) and runs in it, as its non-root user, what a cluster job runs: ``horovodrun
--check-build``, the torch demo at 2 ranks under ``mpirun`` and the Keras demo likewise,
one short epoch each.

The build starts in the background as soon as these tests are collected (``conftest.py``
calls :func:`start_build`): on a fresh machine most of it waits on downloads and the
disk (debootstrap, apt, pip, the layer's commit), so the test files before this one run
meanwhile, and the fixture only waits for what is left. Tests that time how fast ranks
stop (marked ``failures``) wait for the build to end instead of sharing the cores with it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from launching import clean_env

ROOT = Path(__file__).resolve().parents[1]
TAG = "hvd-syncbn:cpu"
BUILD_TIMEOUT_S = 40 * 60
RUN_TIMEOUT_S = 600
TINY = ["--epochs", "1", "--train-size", "16", "--val-size", "8", "--image-size", "16", "--width", "4",
        "--checkpoint-dir", "/tmp/checkpoints"]

pytestmark = [pytest.mark.image, pytest.mark.slow, pytest.mark.skipif(
    os.geteuid() != 0, reason="launch/image.sh builds as root (debootstrap, buildah --isolation chroot); "
                              "run the tests as root, as CI does, to build and run the image")]


def sh(*cmd, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout)


_build: dict = {}  # launch/image.sh running in the background: its process, log and start


def start_build() -> None:
    """Starts ``launch/image.sh`` in the background, once (as root only: it builds as root)."""
    if os.geteuid() == 0 and not _build:
        log = tempfile.TemporaryFile("w+")
        _build.update(log=log, start=time.monotonic(), proc=subprocess.Popen(
            ["bash", "launch/image.sh"], cwd=ROOT, env=clean_env(), stdout=log, stderr=subprocess.STDOUT, text=True,
            start_new_session=True))


def wait_build() -> None:
    """Waits for a background build to end (it fails or passes in the fixture below)."""
    if _build:
        _build["proc"].wait(timeout=max(1.0, BUILD_TIMEOUT_S - (time.monotonic() - _build["start"])))


def stop_build() -> None:
    """At the session's end: ends a background build still running (the image tests did not
    run), and closes its log."""
    if _build and _build["proc"].poll() is None:
        os.killpg(_build["proc"].pid, signal.SIGTERM)  # bash and the buildah under it, which cleans up
        try:
            _build["proc"].wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(_build["proc"].pid, signal.SIGKILL)
    if _build:
        _build["log"].close()


@pytest.fixture(scope="module")
def container():
    """A working container of a freshly built image; its name."""
    start_build()
    wait_build()
    proc, log = _build["proc"], _build["log"]
    log.seek(0)
    assert proc.returncode == 0, f"launch/image.sh exited {proc.returncode}:\n{log.read()[-6000:]}"
    print(f"image {TAG} built in {time.monotonic() - _build['start']:.0f} s since it started")
    made = sh("buildah", "from", "--pull-never", f"localhost/{TAG}")
    assert made.returncode == 0, made.stderr
    name = made.stdout.strip().splitlines()[-1]
    yield name
    sh("buildah", "rm", name)


def in_image(container: str, *cmd) -> str:
    """Runs ``cmd`` in the container as the image's user; its output, after checking it exited 0."""
    out = sh("buildah", "run", "--isolation", "chroot", container, "--", *cmd)
    log = out.stdout + out.stderr
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode} in the image:\n{log[-6000:]}"
    return log


def test_image_is_set_up_for_a_cluster(container):
    assert in_image(container, "id", "-u").strip() == "1000"
    env = dict(line.split("=", 1) for line in in_image(container, "env").splitlines() if "=" in line)
    assert env["OMP_NUM_THREADS"] == "1", env
    for name, value in [("hwloc_base_binding_policy", "none"), ("rmaps_base_mapping_policy", "slot"),
                        ("pml", "ob1"), ("btl", "^openib"), ("oob_tcp_keepalive_time", "5"),
                        ("oob_tcp_keepalive_intvl", "20"), ("oob_tcp_keepalive_probes", "6")]:
        assert env.get(f"OMPI_MCA_{name}") == value, f"OMPI_MCA_{name}: {env.get(f'OMPI_MCA_{name}')}"
    missing = in_image(container, "bash", "-c", "for t in g++ cmake make; do command -v $t || echo no-$t; done")
    assert missing.split() == ["no-g++", "no-cmake", "no-make"], f"build tools left in the image: {missing}"
    check = in_image(container, "horovodrun", "--check-build")
    for want in ["TensorFlow", "PyTorch", "MPI", "Gloo"]:
        assert f"[X] {want}" in check, check


@pytest.mark.parametrize("demo, same", [("torch_segmentation.py", "BN running statistics identical on all 2 ranks: yes"),
                                        ("keras_segmentation.py", "BN moving statistics identical on all 2 ranks: yes")],
                         ids=["torch", "keras"])
def test_demo_under_mpirun_in_image(container, demo, same):
    log = in_image(container, "mpirun", "-np", "2", "python", f"examples/{demo}", *TINY)
    assert "global batch = 2 ranks x 2 images" in log, log[-3000:]
    assert re.search(r"sync BN epoch 1/1: train loss \d+\.\d+\s+val mIoU \d\.\d{4} ", log), log[-3000:]
    assert log.count(same) == 1, log[-3000:]
