"""What started this process, and how many processes its launch declares.

Read from the variables each launcher sets in its ranks' environment (what the real
launchers set is recorded in ``tests/launcher_envs.json``). Standard library only.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Tuple

# Innermost first: torchrun and horovodrun --gloo may run under srun or mpirun (their
# ranks then carry the outer launcher's variables too), and mpirun under srun (Open MPI
# and Hydra start their daemons with srun inside an allocation, and the ranks inherit that
# step's SLURM_* variables). The sbatch/salloc shell itself has SLURM_NTASKS but no step.
# A bare WORLD_SIZE comes last: Lightning's own launcher (``Trainer(strategy="ddp")`` or
# ``Fabric(...).launch()`` started by ``python``) sets it in its processes and nothing
# else of the above, while users also export it for torch's ``env://`` under the
# launchers above. Ray Train's workers, which Ray's raylet starts (``RAY_RAYLET_PID``),
# come first: Ray may itself run under srun or mpirun.
WORLD_SIZE_LAUNCHER = "a launcher that sets WORLD_SIZE (Lightning's)"
RAY_TRAIN = "Ray Train"


def _detect(env: Mapping[str, str]) -> Tuple[Optional[str], Optional[str]]:
    """``(launcher, the variable holding the world size)``; ``(None, None)`` when none."""
    if "RAY_RAYLET_PID" in env and "WORLD_SIZE" in env:
        return RAY_TRAIN, "WORLD_SIZE"
    if "TORCHELASTIC_RUN_ID" in env:  # accelerate launch runs torchrun's
        return ("accelerate launch (torchrun)" if "ACCELERATE_MIXED_PRECISION" in env else "torchrun"), "WORLD_SIZE"
    if "HOROVOD_RANK" in env and "HOROVOD_SIZE" in env:  # horovodrun --gloo; --mpi runs mpirun
        return f"horovodrun --{env.get('HOROVOD_CONTROLLER', 'gloo')}", "HOROVOD_SIZE"
    if "OMPI_COMM_WORLD_SIZE" in env:
        return "mpirun (Open MPI)", "OMPI_COMM_WORLD_SIZE"
    if "PMI_SIZE" in env and "MPI_LOCALNRANKS" in env:
        return "mpirun (MPICH Hydra)", "PMI_SIZE"
    if "SLURM_STEP_ID" in env:
        plugin = env.get("SLURM_MPI_TYPE", "none")
        return ("srun" if plugin == "none" else f"srun --mpi={plugin}"), "SLURM_STEP_NUM_TASKS"
    if "PMIX_RANK" in env:
        return "a PMIx launcher", None
    if "PMI_SIZE" in env:
        return "a PMI launcher", "PMI_SIZE"
    if "WORLD_SIZE" in env:
        return WORLD_SIZE_LAUNCHER, "WORLD_SIZE"
    return None, None


def launcher(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The launcher that started this process, from ``env`` (default ``os.environ``).

    One of ``"srun --mpi=pmix"`` (or another of srun's MPI plugins; plain ``"srun"``
    without one), ``"mpirun (Open MPI)"`` (also under ``horovodrun --mpi``, which runs
    it), ``"mpirun (MPICH Hydra)"``, ``"horovodrun --gloo"``, ``"torchrun"`` (``"accelerate
    launch (torchrun)"`` under Accelerate's), ``"Ray Train"`` (its workers), ``"a PMIx
    launcher"`` or ``"a PMI launcher"`` (another launcher of those interfaces), ``"a
    launcher that sets WORLD_SIZE (Lightning's)"`` (``WORLD_SIZE`` and none of the above,
    as Lightning's ``Trainer(strategy="ddp")`` and Fabric start their processes), or
    ``None`` (started alone; a batch script's own shell is alone too).
    """
    return _detect(os.environ if env is None else env)[0]


def world_size(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """How many processes the launch of this one declares (``WORLD_SIZE``,
    ``HOROVOD_SIZE``, ``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE`` or srun's step size), from
    ``env`` (default ``os.environ``); ``None`` when no launcher started this process or
    it declares no size (a PMIx launcher other than Open MPI's and srun's).

    Raises ``ValueError`` when the variable is not a positive integer.
    """
    env = os.environ if env is None else env
    name, var = _detect(env)
    if var is None:
        return None
    value = env.get(var) if var != "SLURM_STEP_NUM_TASKS" else env.get(var, env.get("SLURM_NTASKS"))
    try:
        size = int(value or "")
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"launched by {name}: expected {var} to be a positive integer, got {value!r}")
    return size


def attempt(env: Optional[Mapping[str, str]] = None) -> str:
    """Which attempt of a restarted job this process is in: under torchrun, its run id and
    restart count (``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``); ``""``
    elsewhere. torchrun's agent keeps its store across restarts: what one attempt writes
    there, the next must not read as its own."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env:
        return ""
    return f"{env['TORCHELASTIC_RUN_ID']}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
