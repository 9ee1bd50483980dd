"""What every benchmark worker shares: shapes, interleaved timing, collective counting.

Counting is measured, never assumed: Horovod's own timeline (``HOROVOD_TIMELINE=DYNAMIC``
at launch, then ``hvd.start_timeline``/``stop_timeline`` around the counted steps) lists
each Horovod collective with its dtype and shape; MPI calls made from the Python thread
(mpi4py) are counted by the PMPI shim ``mpi_count.c``, preloaded by ``run.py``.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import random
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, Optional

# Per-rank NCHW shapes: ResNet-50 stages (conv1 output, layer1, layer2, layer4) and a
# segmentation decoder's full-resolution head.
SHAPES = [(8, 64, 56, 56), (2, 256, 64, 64), (8, 512, 28, 28), (4, 2048, 7, 7), (2, 64, 128, 128)]
QUICK_SHAPES = [(4, 256, 14, 14), (4, 2048, 7, 7)]
SHAPE_ORIGIN = {
    (8, 64, 56, 56): "ResNet-50 layer1 (bn1 of a bottleneck)",
    (2, 256, 64, 64): "decoder, 256 ch at 1/4 scale",
    (8, 512, 28, 28): "ResNet-50 layer2 output",
    (4, 2048, 7, 7): "ResNet-50 layer4 output",
    (2, 64, 128, 128): "decoder head, 64 ch at full scale",
    (4, 256, 14, 14): "ResNet-50 layer3 (quick)",
}
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1}
MPI_KINDS = ("allreduce", "allgather", "bcast", "other", "send")


def timed(fns: Dict[str, Callable[[], object]], iters: int, barrier: Callable[[], None],
          warmup: int = 2) -> Dict[str, dict]:
    """Median (and quartiles) in ms of each ``fn()``.

    Each timed call follows an untimed call of the same ``fn``, so that it meets that
    call's cache and allocator state: interleaved in a fixed rotation, each ``fn`` would
    always follow the same other one and inherit its state (1.3× on one layer, measured).
    The order of the ``fns`` is shuffled every round, the same on every rank, so that
    drift hits all alike; ``barrier()`` lines the ranks up before each call.
    """
    names = list(fns)
    samples = {n: [] for n in names}
    order = random.Random(0)
    for i in range(warmup + iters):
        for name in order.sample(names, len(names)):
            barrier()
            fns[name]()
            barrier()
            start = time.perf_counter()
            fns[name]()
            if i >= warmup:
                samples[name].append((time.perf_counter() - start) * 1e3)
    out = {}
    for name, s in samples.items():
        q = statistics.quantiles(s, n=4) if len(s) > 1 else [s[0]] * 3
        out[name] = {"median": statistics.median(s), "q1": q[0], "q3": q[2], "n": len(s)}
    return out


def make_barrier(hvd) -> Callable[[], None]:
    """A barrier that lines the ranks up before each timed call: a 1-element Horovod
    allreduce. Its wait sleeps; ``MPI_Barrier`` would spin, and with more threads than
    cores (Horovod's loop, other work, oversubscribed ranks) spinning ranks take the
    time slices their peers need."""
    zero = _zero(hvd)
    return lambda: hvd.allreduce(zero, name="bench.barrier")


class MpiCounter:
    """MPI collectives made by this (the main) thread, from the preloaded ``mpi_count.so``;
    inert (``None`` counts) when the shim is not loaded.

    With ``all_threads`` (TensorFlow runs ops on threads of its own) every thread counts
    but those that call MPI during a 50 ms idle window first: Horovod's background loop.
    """

    def __init__(self, all_threads: bool = False) -> None:
        path = next((p for p in os.environ.get("LD_PRELOAD", "").split(":") if p.endswith("mpi_count.so")), None)
        self.lib = ctypes.CDLL(path) if path else None
        self.all_threads = all_threads

    def start(self) -> None:
        if not self.lib:
            return
        if not self.all_threads:
            return self.lib.mpi_count_start()
        self.lib.mpi_count_learn(1)
        time.sleep(0.05)
        self.lib.mpi_count_learn(0)
        self.lib.mpi_count_start_all()

    def stop(self) -> Optional[dict]:
        if not self.lib:
            return None
        self.lib.mpi_count_stop()
        out = {}
        for k, kind in enumerate(MPI_KINDS):
            c, b = ctypes.c_longlong(), ctypes.c_longlong()
            self.lib.mpi_count_get(k, ctypes.byref(c), ctypes.byref(b))
            if c.value:
                out[kind] = {"calls": c.value, "bytes": b.value}
        return out


def parse_timeline(path: Path, skip: str = "bench.barrier") -> list:
    """``[(op, tensor name, bytes)]`` for every Horovod collective completed in a timeline
    file (Chrome trace JSON, possibly without its closing bracket), in order."""
    text = path.read_text().strip().rstrip(",")
    if not text:
        return []
    if not text.endswith("]"):
        text += "]"
    events = json.loads(text)
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {})}
    done = []
    for e in events:
        args = e.get("args", {})
        if e.get("ph") == "E" and "shape" in args:
            full = names.get(e["pid"], "?.?")
            if skip in full or skip.replace(".", "_") in full:
                continue
            op, _, tensor = full.partition(".") if "." in full else ("HorovodOp", "", full.split("/")[0])
            elems = 1
            for d in re.findall(r"\d+", args["shape"]):
                elems *= int(d)
            done.append((op, tensor, elems * DTYPE_BYTES.get(args["dtype"], 4)))
    return done


def count_collectives(step: Callable[[], object], steps: int, hvd, tag: str, tmp: Path,
                      all_threads: bool = False) -> dict:
    """Horovod and MPI collectives per call of ``step``, counted over ``steps`` calls.

    Returns ``{"horovod": {"<op> <group>": {"calls", "bytes"}}, "mpi": {kind: {...}} or
    None, "tensors": [first names]}``, per step, as seen by this rank (rank 0 writes the
    timeline); ``group`` is :func:`tensor_group` of the tensor's name.
    """
    counter = MpiCounter(all_threads)
    step()  # negotiation and caches settle outside the count
    hvd.allreduce(_zero(hvd), name="bench.barrier")
    path = tmp / f"timeline.{tag}.json"
    timeline = hasattr(hvd, "start_timeline") and os.environ.get("HOROVOD_TIMELINE") == "DYNAMIC"
    if timeline:
        hvd.start_timeline(str(path), mark_cycles=False)
    counter.start()
    for _ in range(steps):
        step()
    mpi = counter.stop()
    if timeline and hvd.__name__.startswith("horovod.torch"):
        # A named collective that parse_timeline skips, last: the file is never empty, so
        # _settle sees it settle instead of waiting out its 2 s where a step made none.
        hvd.allreduce(_zero(hvd), name="bench.barrier")
    if timeline:  # before the barrier: TF's eager collectives do not keep their names
        hvd.stop_timeline()
    hvd.allreduce(_zero(hvd), name="bench.barrier")
    out = {"horovod": None, "mpi": None if mpi is None else
           {k: {f: v[f] / steps for f in v} for k, v in mpi.items()}, "tensors": []}
    if timeline and hvd.rank() == 0:  # only rank 0 writes a timeline: the others have none to wait for
        _settle(path)
    if timeline and path.exists():
        per_op: dict = {}
        for op, tensor, nbytes in parse_timeline(path):
            d = per_op.setdefault(f"{op} {tensor_group(tensor)}", {"calls": 0, "bytes": 0})
            d["calls"] += 1 / steps
            d["bytes"] += nbytes / steps
            if tensor not in out["tensors"]:
                out["tensors"].append(tensor)
        out["horovod"] = per_op
        out["tensors"] = out["tensors"][:8]
    return out


def _settle(path: Path, wait: float = 2.0) -> None:
    """Wait (up to ``wait`` s) until Horovod's timeline writer thread has stopped growing
    the file."""
    last, deadline = -1, time.time() + wait
    while time.time() < deadline:
        size = path.stat().st_size if path.exists() else -1
        if size == last and size > 0:
            return
        last = size
        time.sleep(0.1)


def tensor_group(name: str) -> str:
    """What a collective belongs to, from its name: ``hvd_syncbn`` (our layers), a
    benchmark part (``bench.hand``), or a model's gradients (``resnet18ish``)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "bench" else parts[0]


def _zero(hvd):
    """A 1-element zero tensor of the framework ``hvd`` belongs to."""
    if hvd.__name__.startswith("horovod.torch"):
        import torch

        return torch.zeros(1)
    import tensorflow as tf

    return tf.zeros([1])


def write_json(path: str, obj: object) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1))
