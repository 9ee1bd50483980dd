"""Rank-side scenarios of a job's whole life, for ``test_life.py``, at 2 ranks.

    HVD_SYNCBN_WARN=1 HVD_SYNCBN_TIMEOUT=10 torchrun --nproc-per-node 2 tests/life_scenarios.py torch pause
    HVD_SYNCBN_TIMEOUT=3 mpirun -np 2 python tests/life_scenarios.py torch update_bn

- ``pause``: rank 0 works alone for 3 warning times between steps 1 and 2 (a rank-0-only
  validation); rank 1 waits in step 2 and warns; the job finishes. ``torch`` (the
  transport ``auto`` picks: torch.distributed under torchrun, MPI under mpirun, Horovod
  under horovodrun), ``keras`` (the host path) or ``keras-xla`` (the device path's XLA
  allreduce, ``jit_compile=True``, under mpirun).
- ``update_bn``, ``eval``: the first synchronized SyncBN call of the job runs on rank 0
  alone (``torch.optim.swa_utils.update_bn``; a ``track_running_stats=False`` layer in
  eval mode, which still synchronizes); rank 1 is elsewhere (asleep). Rank 0 must raise
  the named diagnosis.

Logging goes to stdout. Each rank prints ``RESULT rank=R finished`` or ``RESULT rank=R
elapsed=S error=TYPE`` and the message (``elapsed``: since the call that went wrong).
"""

from __future__ import annotations

import logging
import os
import sys
import time

import numpy as np

FRAMEWORK, SCENARIO = sys.argv[1], sys.argv[2]
STEPS, PAUSE_STEP = 4, 2
logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")


def ranks() -> tuple:
    for rank, size in (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                       ("HOROVOD_RANK", "HOROVOD_SIZE")):
        if rank in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    raise RuntimeError("expected a launcher")


def torch_model():
    import torch
    from torch import nn

    from hvd_syncbn.torch import convert_sync_batchnorm

    if "RANK" in os.environ:  # torchrun: the default group's transport
        import torch.distributed as dist

        dist.init_process_group("gloo")
    elif "OMPI_COMM_WORLD_RANK" in os.environ:  # as a script under mpirun starts MPI (Open MPI's init waits for all)
        from mpi4py import MPI  # noqa: F401
    elif "HOROVOD_RANK" in os.environ:
        import horovod.torch as hvd

        hvd.init()
    torch.manual_seed(0)
    track = SCENARIO != "eval"
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, track_running_stats=track), nn.ReLU())
    model = convert_sync_batchnorm(model)
    model[1].layer_name = "body.bn1"

    def step(x: np.ndarray) -> None:
        model(torch.from_numpy(x)).square().mean().backward()

    return model, step


def keras_step():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    from hvd_syncbn.tensorflow import SyncBatchNormalization

    xla = FRAMEWORK == "keras-xla"
    bn = SyncBatchNormalization(axis=-1, name="body.bn1", stats="device" if xla else "host")

    @tf.function(jit_compile=xla)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = bn(x, training=True)
        return tape.gradient(tf.reduce_sum(y * y), x)

    return lambda x: step(tf.constant(x.transpose(0, 2, 3, 1)))


def main() -> None:
    rank, world = ranks()
    x = np.random.RandomState(rank).randn(2, 3, 6, 6).astype(np.float32)
    if SCENARIO == "pause":
        step = torch_model()[1] if FRAMEWORK == "torch" else keras_step()
        for i in range(STEPS):
            if i == PAUSE_STEP and rank == 0:  # validation on rank 0 alone
                time.sleep(3 * float(os.environ["HVD_SYNCBN_WARN"]))
            step(x)
        print(f"RESULT rank={rank} finished", flush=True)
        return
    model, _ = torch_model()
    if rank != 0:  # elsewhere, until the launcher ends the job
        time.sleep(600)
        return
    import torch

    start = time.monotonic()
    try:
        if SCENARIO == "update_bn":
            loader = [torch.from_numpy(x) for _ in range(2)]
            torch.optim.swa_utils.update_bn(loader, model)
        else:
            model.eval()
            with torch.no_grad():
                model(torch.from_numpy(x))
    except Exception as e:  # noqa: BLE001 - reported, then re-raised
        print(f"RESULT rank={rank} elapsed={time.monotonic() - start:.2f} error={type(e).__name__}\n{e}", flush=True)
        raise
    print(f"RESULT rank={rank} finished", flush=True)


if __name__ == "__main__":
    main()
