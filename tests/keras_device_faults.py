"""Rank-side faults on the Keras layer's device path (``stats="device"``) under mpirun,
for ``test_failures.py``: at step 2 the last rank gets stuck (sleeps) or exits (status
0, as a rank that returned early); the step is a ``tf.function``, ``model.fit``'s, or
``model.fit``'s compiled by XLA (``xla``: the library's XLA custom call).

    HVD_SYNCBN_TIMEOUT=3 mpirun -np 2 python tests/keras_device_faults.py stuck fit

Every rank that raises prints ``RESULT rank=R elapsed=S error=TYPE`` and the message
(``elapsed``: seconds since step 2 began), as ``device_faults.py`` does.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hvd_syncbn.tensorflow import SyncBatchNormalization  # noqa: E402

SCENARIO, MODE = sys.argv[1], sys.argv[2]
STEPS, BAD_STEP = 4, 2
rank, world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
started = [time.monotonic()]


def at_step(step: int) -> None:
    if step != BAD_STEP:
        return
    started[0] = time.monotonic()
    print(f"BAD-STEP rank={rank} t={time.time():.3f}", flush=True)
    if rank == world - 1:
        if SCENARIO == "stuck":
            time.sleep(600)
        if SCENARIO == "exit":
            sys.exit(0)  # finalizes MPI, as a rank that returned early


class AtStep(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        at_step(batch)


def main() -> None:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              SyncBatchNormalization(name="probe_bn", stats="device"), keras.layers.Dense(1)])
    x = np.random.default_rng(rank).normal(size=(4 * STEPS, 3)).astype("float32")
    try:
        if MODE in ("fit", "xla"):
            model.compile("sgd", "mse", jit_compile=MODE == "xla")
            model.fit(x, x[:, :1], batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[AtStep()])
        else:
            @tf.function
            def step(batch):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(model(batch, training=True))
                return tape.gradient(loss, model.trainable_variables)

            for s in range(STEPS):
                at_step(s)
                step(x[4 * s:4 * s + 4])
    except Exception as e:  # noqa: BLE001 - reported, then re-raised
        print(f"RESULT rank={rank} elapsed={time.monotonic() - started[0]:.2f} error={type(e).__name__}\n{e}",
              flush=True)
        raise
    print(f"RESULT rank={rank} finished", flush=True)


if __name__ == "__main__":
    main()
