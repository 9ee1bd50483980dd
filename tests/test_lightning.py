""":class:`hvd_syncbn.lightning.SyncBatchNormPlugin` at 2 ranks, under Lightning's DDP on
CPU and under mpirun (``tests/lightning_fit.py``): ``fit`` equals one process training on
the concatenated batch, the model is plain BN again after ``fit``, and the checkpoint
saved during ``fit`` loads into the unconverted model."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
from vision import import_vision  # noqa: E402

import_vision()
pytest.importorskip("lightning", reason="bash launch/test.sh installs Lightning")

import fit_case  # noqa: E402
import lightning_fit as fit  # noqa: E402
from fit_case import assert_states_equal  # noqa: E402
from hvd_syncbn import launchers  # noqa: E402
from launching import ROOT, clean_env, launch_command  # noqa: E402

pytestmark = pytest.mark.ranks


@pytest.fixture(scope="module")
def reference() -> dict:
    return fit_case.reference()


@pytest.mark.parametrize("launch", ["ddp", "mpirun"])
def test_fit_at_2_ranks_equals_one_process_on_the_concatenated_batch(launch, reference, tmp_path):
    # This tree's hvd_syncbn, not an installed one (mpirun forwards the variable with -x).
    cmd = launch_command("plain", 2) if launch == "ddp" else launch_command("mpirun", 2) + ["-x", "PYTHONPATH"]
    cmd += [sys.executable, str(ROOT / "tests" / "lightning_fit.py"), str(tmp_path)] + (["mpi"] if cmd else [])
    out = subprocess.run(cmd, cwd=ROOT, env={**clean_env(), "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["during"] == ["SyncBatchNorm"], f"rank {rank} trained with {result['during']}"
        assert result["after"] == ["BatchNorm2d", "BatchNorm1d"], f"rank {rank} after fit: {result['after']}"
        launcher = launchers.WORLD_SIZE_LAUNCHER if launch == "ddp" else "mpirun (Open MPI)"
        assert result["launch"] == (launcher, 2), f"rank {rank} saw the launch as {result['launch']}"
        assert_states_equal(result["state"], reference, f"rank {rank} after fit under {launch}")

    # The checkpoint saved during fit (converted layers) loads into the plain model, strictly.
    checkpoint, = (tmp_path / "ckpt").glob("*.ckpt")
    loaded = fit.Module.load_from_checkpoint(checkpoint, map_location="cpu")
    assert fit.norm_classes(loaded.net) == ["BatchNorm2d", "BatchNorm1d"]
    assert_states_equal(loaded.net.state_dict(), reference, f"checkpoint of {launch}")
