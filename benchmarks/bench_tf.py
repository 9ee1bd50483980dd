"""Per-layer forward+backward time of the Keras SyncBatchNormalization at 2 ranks, against
local Keras BN, Horovod's own Keras 2 layer and Keras 3's ``synchronized=True``.

    python benchmarks/bench_tf.py            # runs every configuration, prints one table

One invocation runs four 2-process jobs on this machine, one after another, each with
1 thread per process: ours and local ``keras.layers.BatchNormalization`` (interleaved,
horovodrun), ``hvd.SyncBatchNormalization`` under Keras 2 (``TF_USE_LEGACY_KERAS=1``
with ``tf_keras`` installed ``--no-deps`` into a cache folder beside, so tensorflow-cpu
stays), and ``BatchNormalization(synchronized=True)`` under
``MultiWorkerMirroredStrategy`` with two localhost workers.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = [(8, 56, 56, 64), (2, 64, 64, 256), (8, 28, 28, 512), (4, 7, 7, 2048), (2, 128, 128, 64)]
TF_KERAS = "tf_keras==2.21.0"
HERE = Path(__file__).resolve()
BIN = Path(sys.executable).parent


def worker(impl: str, out: str, iters: int) -> None:
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
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

            return {"ours": SyncBatchNormalization(name=f"bench_{channels}"),
                    "local": keras.layers.BatchNormalization()}
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

    rng = np.random.default_rng(rank)
    results = {}
    for shape in SHAPES:
        x = tf.constant(rng.standard_normal(shape), tf.float32)
        dy = tf.constant(rng.standard_normal(shape), tf.float32)
        fns = {name: step_fn(layer) for name, layer in layers(shape[-1]).items()}
        samples = {name: [] for name in fns}
        names = list(fns)
        for i in range(3 + iters):
            for name in names[i % len(names):] + names[: i % len(names)]:
                start = time.perf_counter()
                tf.nest.map_structure(lambda t: t.numpy(), fns[name](x, dy))  # wait for the result
                if i >= 3:
                    samples[name].append((time.perf_counter() - start) * 1e3)
        results[str(shape)] = {name: statistics.median(s) for name, s in samples.items()}
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_jobs(iters: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "HOROVOD_"))}
    env.update(OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3", PATH=f"{BIN}:{env.get('PATH', '')}")
    cache = Path(os.environ.get("HVD_SYNCBN_CACHE", Path.home() / ".cache" / "hvd_syncbn")) / "tf_keras-2.21.0"
    if not (cache / "tf_keras").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(cache), TF_KERAS],
                       check=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        horovodrun = [str(BIN / "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2"]
        for impl, extra in (("ours", {}), ("hvd_keras2", {"TF_USE_LEGACY_KERAS": "1", "PYTHONPATH": str(cache)})):
            out = f"{tmp}/{impl}.json"
            subprocess.run(horovodrun + [sys.executable, str(HERE), "--worker", impl, "--out", out,
                                         "--iters", str(iters)], env={**env, **extra}, check=True,
                           stdout=subprocess.DEVNULL)
            results[impl] = json.loads(Path(out).read_text())
        out, ports = f"{tmp}/keras3_sync.json", [free_port(), free_port()]
        procs = []
        for rank in range(2):
            tf_config = {"cluster": {"worker": [f"localhost:{p}" for p in ports]}, "task": {"type": "worker", "index": rank}}
            procs.append(subprocess.Popen([sys.executable, str(HERE), "--worker", "keras3_sync", "--out", out,
                                           "--iters", str(iters)], env={**env, "TF_CONFIG": json.dumps(tf_config)},
                                          stdout=subprocess.DEVNULL))
        if any(p.wait() for p in procs):
            raise SystemExit("the MultiWorkerMirroredStrategy job failed")
        results["keras3_sync"] = json.loads(Path(out).read_text())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.out, args.iters)
    r = run_jobs(args.iters)
    print("2 ranks, 1 thread each; per-layer forward+backward, median ms")
    print("| shape (per rank, NHWC) | ours | local Keras BN | hvd Keras 2 layer | Keras 3 synchronized "
          "| ours / hvd Keras 2 | ours / Keras 3 sync |")
    print("|---|---|---|---|---|---|---|")
    for shape in map(str, SHAPES):
        ours, local = r["ours"][shape]["ours"], r["ours"][shape]["local"]
        k2, k3 = r["hvd_keras2"][shape]["hvd_keras2"], r["keras3_sync"][shape]["keras3_sync"]
        print(f"| {shape} | {ours:.2f} | {local:.2f} | {k2:.2f} | {k3:.2f} | {ours / k2:.2f}x | {ours / k3:.2f}x |")


if __name__ == "__main__":
    main()
