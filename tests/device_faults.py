"""Rank-side faults on the PyTorch device path over ``torch.distributed`` (Gloo), for
``test_failures.py``: at step 2 the last rank stops (SIGSTOP), exits (status 0, as a
rank that returned early), sends a layer bad input, or skips layer ``body.bn1``; eager or
under ``torch.compile``.

    torchrun --nproc-per-node 2 tests/device_faults.py stop compiled
    mpirun -np 3 python tests/device_faults.py exit eager      # comm='torch': a private group over MPI

Every rank that raises prints ``RESULT rank=R elapsed=S error=TYPE`` and the message
(``elapsed``: seconds since step 2 began), as ``fail_scenarios.py`` does.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from hvd_syncbn.torch import SyncBatchNorm

SCENARIO, MODE = sys.argv[1], sys.argv[2]
STEPS, BAD_STEP = 4, 2


def main() -> None:
    if "OMPI_COMM_WORLD_RANK" in os.environ:  # mpirun: no process group; the layers build a private one
        rank, world = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    else:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    bn1, bn2 = (SyncBatchNorm(4, name=n, stats="device", comm="torch") for n in ("body.bn1", "body.bn2"))
    step_fn = (lambda x: bn2(bn1(x)).sum())
    if MODE == "compiled":
        step_fn = torch.compile(step_fn, backend="aot_eager")
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(rank))
    start = time.monotonic()
    for step in range(STEPS):
        bad = step == BAD_STEP and rank == world - 1
        if step == BAD_STEP:
            start = time.monotonic()
            print(f"BAD-STEP rank={rank} t={time.time():.3f}", flush=True)
        try:
            if bad and SCENARIO == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if bad and SCENARIO == "exit":
                os._exit(0)
            xs = (x[:, :3] if bad and SCENARIO == "raise" else x).clone().requires_grad_(True)
            (bn2(xs).sum() if bad and SCENARIO == "skip" else step_fn(xs)).backward()
        except Exception as e:  # noqa: BLE001 - reported, then re-raised
            print(f"RESULT rank={rank} elapsed={time.monotonic() - start:.2f} error={type(e).__name__}\n{e}",
                  flush=True)
            time.sleep(1.0)  # let the peers print theirs before the launcher ends the job
            raise
    print(f"RESULT rank={rank} finished", flush=True)


if __name__ == "__main__":
    main()
