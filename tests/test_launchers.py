"""hvd_syncbn.launchers names what started a process, and the world size it declares,
from the variables the launchers set.

The environments in ``launcher_envs.json`` were printed by ranks the real launchers
started (Slurm 22.05 srun with pmix, pmi2 and none, sbatch and salloc shells, Open MPI
4.1's mpirun alone and inside an allocation, horovodrun --gloo and --mpi, torchrun, MPICH
4.0's Hydra), each recorded with the command that ran it; mpirun, horovodrun and torchrun
are also run here. srun is run for real in ``test_slurm.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_syncbn import launchers
from launching import BIN, clean_env, launch_command

ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads((Path(__file__).parent / "launcher_envs.json").read_text())


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_recorded_environments(case):
    rec = RECORDED[case]
    assert launchers.launcher(rec["env"]) == rec["launcher"], rec["launched with"]
    assert launchers.world_size(rec["env"]) == rec["size"], rec["launched with"]


@pytest.mark.parametrize("inner", ["torchrun", "hvdrun-gloo"])
@pytest.mark.parametrize("outer", ["srun-pmix", "salloc-mpirun"])
def test_the_innermost_launcher_wins(inner, outer):
    """``srun torchrun ...`` or ``mpirun horovodrun --gloo ...``: each rank carries both
    launchers' variables, and was started by the inner one."""
    env = {**RECORDED[outer]["env"], **RECORDED[inner]["env"]}
    assert (launchers.launcher(env), launchers.world_size(env)) == (RECORDED[inner]["launcher"],
                                                                    RECORDED[inner]["size"])


def test_alone_and_defaults():
    assert (launchers.launcher({}), launchers.world_size({})) == (None, None)
    assert (launchers.launcher({"PATH": "/usr/bin", "HOROVOD_CYCLE_TIME": "0.1"}),
            launchers.world_size({"HOROVOD_CYCLE_TIME": "0.1"})) == (None, None)
    # A PMIx launcher that states no size (the rank alone), and the default environment.
    assert (launchers.launcher({"PMIX_RANK": "0"}), launchers.world_size({"PMIX_RANK": "0"})) == \
        ("a PMIx launcher", None)
    assert launchers.launcher() == launchers.launcher(dict(__import__("os").environ))


def test_a_bare_world_size_is_a_launch_and_other_launchers_come_first():
    """Lightning's own launcher sets WORLD_SIZE (and LOCAL_RANK, NODE_RANK, MASTER_*) in its
    processes; a WORLD_SIZE exported for torch's env:// under another launcher is that
    launcher's (tests/test_lightning.py records what real Lightning ranks see)."""
    lightning = {"WORLD_SIZE": "2", "LOCAL_RANK": "1", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29500"}
    assert (launchers.launcher(lightning), launchers.world_size(lightning)) == (launchers.WORLD_SIZE_LAUNCHER, 2)
    for outer in ("srun-pmix", "salloc-mpirun"):
        env = {**RECORDED[outer]["env"], "WORLD_SIZE": "99"}
        assert (launchers.launcher(env), launchers.world_size(env)) == (RECORDED[outer]["launcher"],
                                                                        RECORDED[outer]["size"])
    with pytest.raises(ValueError, match=r"expected WORLD_SIZE to be a positive integer, got '0'"):
        launchers.world_size({"WORLD_SIZE": "0"})


def test_engines_are_named_before_the_launchers_they_run_under():
    """Ray Train's workers (``RAY_RAYLET_PID``, and the WORLD_SIZE Ray Train sets), also
    where Ray itself was started by srun; ``accelerate launch``, which runs torchrun's
    agent (tests/test_engines.py checks what real workers see)."""
    ray = {**RECORDED["srun-pmix"]["env"], "RAY_RAYLET_PID": "4242", "WORLD_SIZE": "8", "RANK": "3"}
    assert (launchers.launcher(ray), launchers.world_size(ray)) == (launchers.RAY_TRAIN, 8)
    accelerate = {**RECORDED["torchrun"]["env"], "ACCELERATE_MIXED_PRECISION": "no"}
    assert (launchers.launcher(accelerate), launchers.world_size(accelerate)) == (
        "accelerate launch (torchrun)", RECORDED["torchrun"]["size"])


def test_a_bad_size_says_which_variable():
    env = {**RECORDED["srun-pmix"]["env"]}
    env.pop("SLURM_STEP_NUM_TASKS")
    assert launchers.world_size(env) == 4  # SLURM_NTASKS, as older Slurm sets
    env["SLURM_NTASKS"] = "many"
    with pytest.raises(ValueError, match=r"launched by srun --mpi=pmix: expected SLURM_STEP_NUM_TASKS "
                                         r"to be a positive integer, got 'many'"):
        launchers.world_size(env)


PROBE = """
import os, sys
from hvd_syncbn import launchers
with open(os.path.join(sys.argv[1], str(os.getpid())), "w") as f:  # a file each: mpirun interleaves stdout
    f.write(f"{launchers.launcher()} {launchers.world_size()}")
"""


@pytest.mark.ranks
@pytest.mark.parametrize("cmd, expected", [
    (launch_command("mpirun", 2) + [sys.executable], ["mpirun (Open MPI) 2"] * 2),
    (launch_command("horovodrun-gloo", 2) + [sys.executable], ["horovodrun --gloo 2"] * 2),
    ([str(BIN / "torchrun"), "--nproc-per-node", "2"], ["torchrun 2"] * 2),
    ([sys.executable], ["None None"]),
], ids=["mpirun", "horovodrun-gloo", "torchrun", "alone"])
def test_real_launchers(cmd, expected, tmp_path):
    probe, found = tmp_path / "probe.py", tmp_path / "found"
    probe.write_text(PROBE)
    found.mkdir()
    out = subprocess.run(cmd + [str(probe), str(found)], cwd=ROOT, env={**clean_env(), "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120)
    named = [f.read_text() for f in found.iterdir()]
    assert out.returncode == 0 and named == expected, f"{named}\n{out.stdout}{out.stderr[-3000:]}"


ALONE = """
import torch
from hvd_syncbn.torch import SyncBatchNorm
SyncBatchNorm(4)(torch.randn(8, 4))  # training, no init_process_group: no transport
SyncBatchNorm(4)(torch.randn(8, 4))  # a second layer: no second warning
"""


@pytest.mark.ranks
def test_torchrun_without_a_process_group_warns_once_on_every_rank(tmp_path):
    """The silent failure of torch.nn.SyncBatchNorm users know: torchrun, no
    init_process_group, each rank normalising alone. Each rank warns, once."""
    probe = tmp_path / "alone.py"
    probe.write_text(ALONE)
    out = subprocess.run([str(BIN / "torchrun"), "--nproc-per-node", "2", str(probe)], cwd=ROOT,
                         env={**clean_env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    warned = out.stderr.count("this process is one of 2 started by torchrun")
    assert out.returncode == 0 and warned == 2, f"{warned} warnings\n{out.stdout}{out.stderr[-3000:]}"
    assert "init_process_group()" in out.stderr and "HVD_SYNCBN_STRICT=1" in out.stderr, out.stderr[-3000:]
