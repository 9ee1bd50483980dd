"""The engines users train with, each a 2-worker CPU job (``tests/engine_train.py``):
Lightning Fabric, Accelerate (``accelerate launch``) and Ray Train's ``TorchTrainer``.
Each worker's trained model (running statistics included) equals one process with plain
BN on the concatenated batch, and :mod:`hvd_syncbn.launchers` names the engine. Ray runs
where it is installed (``HVD_SYNCBN_TEST_RAY=1 bash launch/test.sh`` installs it: 600 MB)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import fit_case  # noqa: E402
from hvd_syncbn import launchers  # noqa: E402
from launching import ROOT, clean_env  # noqa: E402

pytestmark = pytest.mark.ranks
SCRIPT = str(ROOT / "tests" / "engine_train.py")
ACCELERATE = ["accelerate-launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
              "no", "--dynamo_backend", "no", SCRIPT, "accelerate"]
ENGINES = {
    "fabric": (["fabric"], launchers.WORLD_SIZE_LAUNCHER),
    "accelerate": (ACCELERATE, "accelerate launch (torchrun)"),
    "ray": (["ray"], launchers.RAY_TRAIN),
}


@pytest.fixture(scope="module")
def reference() -> dict:
    return fit_case.reference()


@pytest.mark.parametrize("engine", list(ENGINES))
def test_two_workers_equal_one_process_on_the_concatenated_batch(engine, reference, tmp_path):
    if engine == "ray" and importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed (HVD_SYNCBN_TEST_RAY=1 bash launch/test.sh installs it)")
    if engine == "accelerate" and importlib.util.find_spec("accelerate") is None:
        pytest.fail("Accelerate is not installed: bash launch/test.sh installs it")
    args, launcher = ENGINES[engine]
    out = subprocess.run([sys.executable, SCRIPT, *args, str(tmp_path)], cwd=ROOT,
                         env={**clean_env(), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    for rank in range(fit_case.WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["launch"] == (launcher, fit_case.WORLD), f"rank {rank} saw the launch as {result['launch']}"
        fit_case.assert_states_equal(result["state"], reference, f"rank {rank} under {engine}")
