"""Per-layer forward+backward time of the Keras SyncBatchNormalization against local
Keras BN, Horovod's own Keras 2 layer and Keras 3's ``synchronized=True``.

    python benchmarks/bench_tf.py              # 2 ranks, every configuration, one table
    python benchmarks/run.py                   # the full report (calls jobs() below)

Each configuration is its own job on this machine, 1 intra-op and 2 inter-op threads per
process (``BENCH_TF_INTER_OP``):

- ``ours``: ours and local ``keras.layers.BatchNormalization``, interleaved, under
  ``launch/mpirun.sh``, once per ``HVD_SYNCBN_COMM`` value asked for;
- ``hvd_keras2``: ``hvd.SyncBatchNormalization`` under Keras 2 (``TF_USE_LEGACY_KERAS=1``
  with ``tf_keras`` installed ``--no-deps`` into a cache folder beside, so tensorflow-cpu
  stays), under mpirun;
- ``keras3_sync``: ``BatchNormalization(synchronized=True)`` under
  ``MultiWorkerMirroredStrategy``, one localhost worker per rank (``--mwms N``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = [(8, 56, 56, 64), (2, 64, 64, 256), (8, 28, 28, 512), (4, 7, 7, 2048), (2, 128, 128, 64)]
TF_KERAS = "tf_keras==2.21.0"
HERE = Path(__file__).resolve()


def nhwc(shape) -> tuple:
    """An NCHW shape as NHWC."""
    n, c, h, w = shape
    return (n, h, w, c)


def worker(impl: str, out: str, iters: int, shapes: list, count_steps: int, local_again: bool = False) -> None:
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    # 2, not 1: with one inter-op thread the Keras layer's Horovod transport (a
    # tf.numpy_function that runs Horovod's eager allreduce) waits for itself and times out.
    tf.config.threading.set_inter_op_parallelism_threads(int(os.environ.get("BENCH_TF_INTER_OP", "2")))
    hvd = None
    if impl == "keras3_sync":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        rank = strategy.cluster_resolver.task_id
    else:
        import horovod.tensorflow as hvd

        hvd.init()
        rank = hvd.rank()
    import keras

    def layers(channels):
        if impl == "ours":
            from hvd_syncbn.tensorflow import SyncBatchNormalization

            both = {"ours": SyncBatchNormalization(name=f"bench_{channels}"),
                    "local": keras.layers.BatchNormalization()}
            if local_again:  # the A/A control: what noise alone makes of two identical layers
                both["local_again"] = keras.layers.BatchNormalization()
            return both
        if impl == "hvd_keras2":
            return {impl: hvd.SyncBatchNormalization()}
        with strategy.scope():
            return {impl: keras.layers.BatchNormalization(synchronized=True)}

    def step_fn(layer):
        def fwd_bwd(x, dy):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
            return tape.gradient(y, [x] + layer.trainable_variables, output_gradients=dy)

        if impl == "keras3_sync":
            return tf.function(lambda x, dy: strategy.run(fwd_bwd, args=(x, dy)))
        return tf.function(fwd_bwd)

    def run(fn, x, dy):
        tf.nest.map_structure(lambda t: t.numpy(), fn(x, dy))  # wait for the result

    from common import make_barrier, timed

    if hvd is not None:
        barrier = make_barrier(hvd)
    else:  # MultiWorkerMirroredStrategy: no MPI here; its collectives line the workers up
        barrier = lambda: None  # noqa: E731
    rng = np.random.default_rng(rank)
    results = {"ranks": hvd.size() if hvd else strategy.num_replicas_in_sync,
               "comm": os.environ.get("HVD_SYNCBN_COMM", "(unset)"), "shapes": {}}
    tmp = Path(tempfile.mkdtemp())
    for shape in shapes:
        x = tf.constant(rng.standard_normal(shape), tf.float32)
        dy = tf.constant(rng.standard_normal(shape), tf.float32)
        fns = {name: step_fn(layer) for name, layer in layers(shape[-1]).items()}
        times = timed({name: (lambda f=fn: run(f, x, dy)) for name, fn in fns.items()}, iters, barrier) if iters else {}
        counts = {}
        if count_steps and hvd is not None:
            from common import count_collectives

            counts = {name: count_collectives(lambda f=fn: run(f, x, dy), count_steps, hvd, f"{name}.{shape[-1]}", tmp,
                                                all_threads=True)
                      for name, fn in fns.items()}
        results["shapes"][json.dumps(list(nhwc_to_nchw(shape)))] = {"times": times, "counts": counts}
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def nhwc_to_nchw(shape) -> tuple:
    n, h, w, c = shape
    return (n, c, h, w)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tf_keras_path() -> Path:
    """A folder holding ``tf_keras`` (installed there on first use, without dependencies)."""
    cache = Path(os.environ.get("HVD_SYNCBN_CACHE", Path.home() / ".cache" / "hvd_syncbn")) / "tf_keras-2.21.0"
    if not (cache / "tf_keras").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(cache), TF_KERAS],
                       check=True)
    return cache


def mwms(ranks: int, worker_args: list) -> int:
    """Run ``ranks`` keras3_sync workers as one MultiWorkerMirroredStrategy cluster."""
    ports = [free_port() for _ in range(ranks)]
    procs = []
    for rank in range(ranks):
        tf_config = {"cluster": {"worker": [f"localhost:{p}" for p in ports]}, "task": {"type": "worker", "index": rank}}
        procs.append(subprocess.Popen([sys.executable, str(HERE), "--worker", "keras3_sync", *worker_args],
                                      env={**os.environ, "TF_CONFIG": json.dumps(tf_config)}))
    return max(p.wait() for p in procs)


def jobs(runner, shapes: list, iters: int, ranks: int = 2, comms=("horovod", "mpi"), count_steps: int = 2) -> dict:
    """Ours at 1 rank and every TF configuration at ``ranks`` ranks, as ``{config: worker
    result}``; with ``count_steps`` a second, counting job per Horovod configuration.
    ``runner`` is a :class:`jobs.Runner`; ``shapes`` are NCHW."""
    args = ["--shapes", json.dumps([nhwc(s) for s in shapes]), "--iters", str(iters)]
    # One rank first: no peer, so no transport; ours against local BN alone.
    out = {"ours 1 rank": runner.mpirun(1, "bench_tf.py", ["--worker", "ours", "--local-again", *args])}
    for comm in comms:
        out[f"ours[{comm}]"] = runner.mpirun(ranks, "bench_tf.py", ["--worker", "ours", *args],
                                             env={"HVD_SYNCBN_COMM": comm})
        if count_steps:
            out[f"count ours[{comm}]"] = runner.mpirun(
                ranks, "bench_tf.py", ["--worker", "ours", *args[:2], "--iters", "0", "--count-steps", str(count_steps)],
                env={"HVD_SYNCBN_COMM": comm}, count=True)
    legacy = {"TF_USE_LEGACY_KERAS": "1", "PYTHONPATH": str(tf_keras_path())}
    out["hvd_keras2"] = runner.mpirun(ranks, "bench_tf.py", ["--worker", "hvd_keras2", *args], env=legacy)
    if count_steps:
        out["count hvd_keras2"] = runner.mpirun(
            ranks, "bench_tf.py", ["--worker", "hvd_keras2", *args[:2], "--iters", "0", "--count-steps", str(count_steps)],
            env=legacy, count=True)
    result = runner.tmp / f"mwms{ranks}.json"
    out["keras3_sync"] = runner.local([sys.executable, str(HERE), "--mwms", str(ranks), *args, "--out", str(result)],
                                      {}, result)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--shapes", default=json.dumps(SHAPES),
                        help="JSON list of NHWC shapes (workers)")
    parser.add_argument("--count-steps", type=int, default=0)
    parser.add_argument("--local-again", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--mwms", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes = [tuple(s) for s in json.loads(args.shapes)]
    if args.worker:
        return worker(args.worker, args.out, args.iters, shapes, args.count_steps, args.local_again)
    if args.mwms:
        sys.exit(mwms(args.mwms, ["--shapes", args.shapes, "--iters", str(args.iters), "--out", args.out]))
    from jobs import Runner

    with tempfile.TemporaryDirectory() as tmp:
        r = jobs(Runner(Path(tmp), Path(tmp) / "log.txt", None), [nhwc_to_nchw(s) for s in shapes], args.iters,
                 count_steps=0)
    print("2 ranks, 1 thread each; per-layer forward+backward, median ms")
    configs = [k for k in r if "error" not in r[k]]
    print("| shape (per rank, NCHW) | " + " | ".join(configs) + " |\n|---" + "|---" * len(configs) + "|")
    for shape in r[configs[0]]["shapes"]:
        cells = [" / ".join(f"{v['median']:.2f}" for v in r[k]["shapes"][shape]["times"].values()) for k in configs]
        print(f"| {shape} | " + " | ".join(cells) + " |")
    for k in r:
        if "error" in r[k]:
            print(f"{k}: failed: {r[k]['error']}")


if __name__ == "__main__":
    main()
