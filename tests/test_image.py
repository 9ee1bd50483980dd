"""Builds the image with launch/image.sh (a debootstrapped Debian base, buildah, no Docker
Hub) and runs in it, as its non-root user, what a cluster job runs: ``horovodrun
--check-build``, the torch demo at 2 ranks under ``mpirun`` and the Keras demo likewise,
one short epoch each.
"""

from __future__ import annotations

import os
import re
import subprocess
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


@pytest.fixture(scope="module")
def container():
    """A working container of a freshly built image; its name."""
    start = time.monotonic()
    built = sh("bash", "launch/image.sh", timeout=BUILD_TIMEOUT_S)
    assert built.returncode == 0, f"launch/image.sh exited {built.returncode}:\n{built.stderr[-6000:]}"
    print(f"image {TAG} built in {time.monotonic() - start:.0f} s")
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
