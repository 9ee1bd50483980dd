"""Rank side of ``test_failures.py``'s XLA case: rank 1 never joins the allreduce.

    HVD_SYNCBN_TIMEOUT=3 mpirun -np 2 python tests/xla_missing_peer.py [xla|graph]

The step is ``jit_compile=True`` (``xla``, the default: the XLA custom call) or a plain
``tf.function`` (``graph``: the library's TensorFlow kernel). Both ranks trace and run the
step once; then rank 1 sleeps while rank 0 runs it again.
Rank 0 prints ``RESULT rank=0 elapsed=S error=TYPE`` and the error's message (or
``RESULT rank=0 finished``) and exits 1; the pending collective cannot be cancelled, so
:mod:`hvd_syncbn.tensorflow.xla` aborts MPI at exit, which ends rank 1 too.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hvd_syncbn.tensorflow import xla  # noqa: E402

NAME = "hvd_syncbn.test.missing_peer"
rank = MPI.COMM_WORLD.Get_rank()
step = tf.function(lambda x: xla.allreduce(x, NAME), jit_compile=sys.argv[1:2] != ["graph"])
x = tf.constant(np.ones(4))
step(x)  # both ranks: compiled, and one sum
if rank == 1:
    time.sleep(600)
    sys.exit(0)
start = time.monotonic()
try:
    step(x)
except tf.errors.OpError as e:
    print(f"RESULT rank={rank} elapsed={time.monotonic() - start:.2f} error={type(e).__name__}\n{e.message}",
          flush=True)
    sys.exit(1)
print(f"RESULT rank={rank} finished", flush=True)
sys.exit(1)
