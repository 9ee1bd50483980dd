"""Launching benchmark workers: mpirun jobs (through ``launch/mpirun.sh``), jobs across
network-namespace hosts (``launch/netns_hosts.sh``), and the counting shim.

A job is a worker script plus its arguments; it writes rank 0's results to a JSON file
whose contents :func:`run` returns. A failed job returns ``{"error": last lines}`` so
that one broken configuration leaves a hole in the report, not a crashed run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent
CORES = os.cpu_count() or 1


# glibc's malloc hands large freed blocks back to the kernel (mmap, heap trimming), so the
# next activation-sized allocation faults its pages in again: about 3 ms on an 8 MB
# tensor, landing on whichever layer allocates at that moment. Two identical
# nn.BatchNorm2d layers measured 0.64-1.42x of each other that way, 0.99-1.01x without
# it. Every job keeps freed memory (as the caching allocators of GPUs, jemalloc and
# tcmalloc do); tensors up to 32 MB stay on the heap.
MALLOC = "glibc.malloc.trim_threshold=4294967295:glibc.malloc.mmap_threshold=33554432"


def base_env(extra: Optional[dict] = None) -> dict:
    """This environment without any launcher's per-job variables, 1 thread per rank,
    freed memory kept (:data:`MALLOC`)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "HOROVOD_", "HVD_SYNCBN_")) and k != "LD_PRELOAD"}
    env.update(OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1", GLIBC_TUNABLES=MALLOC,
               PATH=f"{BIN}:{env.get('PATH', '')}")
    env.update(extra or {})
    return env


def build_shim(tmp: Path) -> Optional[str]:
    """Compile ``mpi_count.c`` into ``tmp``; ``None`` (and counting of MPI calls off) when
    ``mpicc`` is missing or fails."""
    out = tmp / "mpi_count.so"
    try:
        subprocess.run(["mpicc", "-shared", "-fPIC", "-O2", "-o", str(out), str(HERE / "mpi_count.c")],
                       check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"[bench] no MPI call counting: mpicc failed ({e})", file=sys.stderr)
        return None
    return str(out)


class Runner:
    """Runs jobs one after another, logging each command line and its time to ``log``."""

    def __init__(self, tmp: Path, log: Path, shim: Optional[str], timeout: float = 900) -> None:
        self.tmp, self.log, self.shim, self.timeout = tmp, log, shim, timeout
        self.seq = 0

    def mpirun(self, ranks: int, script: str, args: list, env: Optional[dict] = None, count: bool = False,
               netns: Optional[tuple] = None) -> dict:
        """Run ``python benchmarks/<script> args --out F`` on ``ranks`` ranks; returns F's JSON.

        ``count``: with Horovod's dynamic timeline and the MPI counting shim.
        ``netns``: ``(hosts, slots)`` to run across network-namespace hosts instead.
        """
        env = base_env(env)
        names = ["OMP_NUM_THREADS", "TF_CPP_MIN_LOG_LEVEL", "PYTHONUNBUFFERED", "GLIBC_TUNABLES"]
        names += [k for k in env if k.startswith(("HVD_SYNCBN_", "TF_USE_LEGACY", "BENCH_")) or k == "PYTHONPATH"]
        if count:
            env["HOROVOD_TIMELINE"] = "DYNAMIC"
            if self.shim:
                env["LD_PRELOAD"] = self.shim
                names.append("LD_PRELOAD")
        # Waiting ranks yield their core: Open MPI spins by default unless it sees more ranks
        # than slots, and on a machine shared with other work a spinning rank holds a core
        # its peer needs (2-rank allreduces took 12-24 ms instead of 1 ms under load).
        opts = ["--mca", "mpi_yield_when_idle", "1"] + [a for n in names for a in ("-x", n)]
        if netns:
            hosts, slots = netns
            launcher = ["bash", str(ROOT / "launch/netns_hosts.sh"), "--prefix", "hvdbench", "--subnet", "10.202.0",
                        "--hosts", str(hosts), "--slots", str(slots)]
            if hosts * slots > CORES:
                opts.append("--oversubscribe")
        else:
            launcher = ["bash", str(ROOT / "launch/mpirun.sh"), "-np", str(ranks)]
            if ranks > CORES:
                opts.append("--oversubscribe")
        self.seq += 1
        out = self.tmp / f"job{self.seq}.json"
        cmd = launcher + opts + ["--", sys.executable, str(HERE / script), *map(str, args), "--out", str(out)]
        return self._run(cmd, env, out)

    def local(self, cmd: list, env: dict, out: Path) -> dict:
        """Run a command that starts its own processes (e.g. TF's multi-worker jobs)."""
        return self._run(cmd, base_env(env), out)

    def _run(self, cmd: list, env: dict, out: Path) -> dict:
        start = time.time()
        desc = " ".join(str(c) for c in cmd)
        extra = " ".join(f"{k}={env[k]}" for k in env if k.startswith(("HVD_SYNCBN_", "HOROVOD_TIMELINE")))
        print(f"[bench] {extra} {desc}", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=self.timeout)
            rc, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = -1, f"timed out after {self.timeout:.0f} s\n{_text(e.stdout)}{_text(e.stderr)}"
        took = time.time() - start
        with self.log.open("a") as f:
            f.write(f"$ {extra} {desc}\n# rc={rc}, {took:.1f} s\n{text[-4000:]}\n\n")
        if rc != 0 or not out.exists():
            lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("[")]
            errs = [ln for ln in lines if "Error" in ln or "error:" in ln]
            err = (errs[-1] if errs else " / ".join(lines[-3:]))[-600:] or f"exit status {rc}"
            print(f"[bench]   FAILED ({took:.0f} s): {err}", file=sys.stderr, flush=True)
            return {"error": err}
        print(f"[bench]   done in {took:.0f} s", file=sys.stderr, flush=True)
        return json.loads(out.read_text())


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
