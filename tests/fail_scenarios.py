"""Rank-side failure scenarios for ``test_failures.py``: ranks that disagree, bad input on
one rank, a rank that dies, stops (for good, or for less than the timeout) or fails
outside SyncBN. Every rank prints one ``RESULT`` line, then exits.

    horovodrun -np 2 python tests/fail_scenarios.py torch extra_layer

A rank prints ``RESULT rank=R elapsed=S error=TYPE`` and the error's message when a
SyncBN call raised (``elapsed``: seconds since the step that goes wrong began), or
``RESULT rank=R finished, S s after ...`` if it got through (a failure, except where a
rank only pauses).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import numpy as np

FRAMEWORK, SCENARIO = sys.argv[1], sys.argv[2]
STEPS, BAD_STEP = 4, 2
LINGER_S = 1.0


def torch_layers(rank: int):
    import torch

    from hvd_syncbn.torch import SyncBatchNorm

    def layer(c: int, name: str, dtype=torch.float32):
        bn = SyncBatchNorm(c, name=name, dtype=dtype)

        def run(x: np.ndarray) -> None:
            t = torch.from_numpy(x).to(bn.weight.dtype).requires_grad_(True)
            bn(t).sum().backward()

        return run

    return layer


def keras_layers(rank: int):
    import tensorflow as tf

    from hvd_syncbn.tensorflow import SyncBatchNormalization

    def layer(c: int, name: str, dtype="float32"):
        bn = SyncBatchNormalization(axis=1, name=name, dtype=dtype)

        def run(x: np.ndarray) -> None:
            t = tf.constant(x)
            with tf.GradientTape() as tape:
                tape.watch(t)
                y = bn(t, training=True)
            tape.gradient(y, t)

        return run

    return layer


def _float64():
    import torch

    return torch.float64


def pause_for(seconds: float) -> None:
    """Stops this process for ``seconds``: a helper continues it, at real-time priority
    where allowed, as the waiting ranks keep the cores busy and would delay it."""
    rt = ["chrt", "-f", "50"] if os.geteuid() == 0 else []
    subprocess.Popen([*rt, "sh", "-c", f"sleep {seconds:g}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    if FRAMEWORK == "torch":
        import horovod.torch as hvd
    else:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import horovod.tensorflow as hvd
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    layer = (torch_layers if FRAMEWORK == "torch" else keras_layers)(rank)
    rows = np.random.RandomState(rank).randn(3, 4, 5).astype(np.float32)
    bn1, bn2, extra = layer(4, "body.bn1"), layer(4, "body.bn2"), layer(4, "head.extra")
    if rank == 1 and SCENARIO == "channels":  # the same layer built wider on one rank
        bn1_bad, wide = layer(8, "body.bn1"), np.concatenate([rows, rows], axis=1)
    if rank == 1 and SCENARIO == "dtype":  # the same layer in float64 on one rank
        bn1_bad, wide = layer(4, "body.bn1", "float64" if FRAMEWORK == "keras" else _float64()), rows
    start = time.monotonic()
    for step in range(STEPS):
        bad = step == BAD_STEP
        if bad:
            start = time.monotonic()
            print(f"BAD-STEP rank={rank} t={time.time():.3f}", flush=True)
        try:
            x = rows
            if bad and SCENARIO == "die" and rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if bad and SCENARIO == "stop" and rank == world - 1:  # a hung node: stopped until killed
                os.kill(os.getpid(), signal.SIGSTOP)
            if bad and SCENARIO == "pause" and rank == world - 1:  # stopped for 0.6 timeouts, then continued
                pause_for(0.6 * float(os.environ["HVD_SYNCBN_TIMEOUT"]))
            if bad and SCENARIO == "exit" and rank == world - 1:  # fails outside SyncBN, as a full disk does
                raise OSError(errno.ENOSPC, "No space left on device (writing a checkpoint, outside SyncBN)")
            if bad and SCENARIO == "extra_layer" and rank == 0:
                extra(x)
            if bad and SCENARIO == "bad_input" and rank == 1:
                x = rows[:, :3]
            order = (bn2, bn1) if bad and SCENARIO == "order" and rank == 0 else (bn1, bn2)
            if bad and SCENARIO in ("channels", "dtype") and rank == 1:
                bn1_bad(wide)
                order = (bn2,)
            for run in order:
                run(x)
        except Exception as e:  # noqa: BLE001 - reported, then re-raised
            print(f"RESULT rank={rank} elapsed={time.monotonic() - start:.2f} error={type(e).__name__}\n{e}",
                  flush=True)
            # Under mpirun the first rank to exit non-zero ends the job; its peers raise
            # at the same moment (they leave the same diagnosis exchange) but may be a few
            # ms behind on 2 shared cores: let them print theirs (once, in CI, one did not).
            time.sleep(LINGER_S)
            raise
        if SCENARIO == "die":
            time.sleep(0.2)  # let the dying rank's peers wait in the next step
    print(f"RESULT rank={rank} finished, {time.monotonic() - start:.2f} s after the step that goes wrong began",
          flush=True)


if __name__ == "__main__":
    main()
