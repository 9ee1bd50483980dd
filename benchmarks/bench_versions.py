"""A CPU training step at 2 ranks with this tree's hvd_syncbn against another checkout's,
timed alternately in one run.

    python benchmarks/bench_versions.py --baseline DIR [--rounds 5] [--steps 20]

``DIR`` is another checkout of the project (``git worktree add DIR <commit>``). Each round
launches, for each tree in turn, one 2-rank job per launcher: ``mpirun`` (statistics over
MPI) and ``torchrun`` (over Gloo). A job trains two nets, each converted with
``convert_sync_batchnorm`` and its defaults, 1 thread per rank, freed memory kept
(``jobs.base_env``): a ResNet-18-like net (``e2e_torch.ResNet18ish``, 4×3×64×64 per rank,
20 BN layers) and the demo's SegNet (width 16, 2×3×64×64 per rank, 8 BN layers), and
reports rank 0's median of ``--steps`` SGD steps after 3 unmeasured ones. Printed: per
launcher and net, each tree's median over the rounds of its jobs' medians, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NETS = ("ResNet-18-like", "SegNet")


def job(steps: int, out: str) -> None:
    """One 2-rank job (under mpirun or torchrun): rank 0 writes ``{net: median s}`` to ``out``."""
    import torch
    import torch.distributed as dist

    sys.path[:0] = [str(HERE), str(ROOT / "examples")]
    from e2e_torch import ResNet18ish
    from torch_segmentation import SegNet

    from hvd_syncbn.torch import convert_sync_batchnorm

    torch.set_num_threads(1)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun: over Gloo
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:  # mpirun: over MPI
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    result = {}
    for name, net, shape in (("ResNet-18-like", ResNet18ish, (4, 3, 64, 64)), ("SegNet", SegNet, (2, 3, 64, 64))):
        torch.manual_seed(rank)
        model = convert_sync_batchnorm(net() if name != "SegNet" else net(16, classes=4))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(shape)
        times = []
        for i in range(3 + steps):
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model(x).float().square().mean().backward()
            opt.step()
            times.append(time.perf_counter() - start)
        result[name] = statistics.median(times[3:])
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def launch(tree: Path, launcher: str, steps: int, tmp: Path) -> dict:
    from jobs import BIN, base_env

    out = tmp / f"{launcher}-{time.monotonic_ns()}.json"
    env = base_env({"PYTHONPATH": str(tree)})
    script = [str(HERE / "bench_versions.py"), "--job", "--steps", str(steps), "--out", str(out)]
    if launcher == "mpirun":
        opts = ["--mca", "mpi_yield_when_idle", "1"] + [a for n in ("OMP_NUM_THREADS", "GLIBC_TUNABLES", "PYTHONPATH")
                                                          for a in ("-x", n)]
        cmd = ["bash", str(ROOT / "launch/mpirun.sh"), "-np", "2", *opts, "--", sys.executable, *script]
    else:
        cmd = [str(BIN / "torchrun"), "--nproc-per-node", "2", *script]
    proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{launcher} job over {tree} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another checkout of the project")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args.steps, args.out)
        return
    sys.path.insert(0, str(HERE))
    trees = {"baseline": args.baseline.resolve(), "this tree": ROOT}
    seconds: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for launcher in ("mpirun", "torchrun"):
                for tree_name, tree in trees.items():
                    for net, s in launch(tree, launcher, args.steps, Path(tmp)).items():
                        seconds.setdefault((launcher, net, tree_name), []).append(s)
    commit = subprocess.run(["git", "-C", str(trees["baseline"]), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    print(f"bench_versions: a CPU training step at 2 ranks, this tree against {commit or trees['baseline']}, "
          f"{args.rounds} rounds of {args.steps} steps, medians of the jobs' medians, {time.strftime('%Y-%m-%d')}")
    print("| launcher | net | baseline, ms | this tree, ms | ratio |\n|---|---|---|---|---|")
    for launcher in ("mpirun", "torchrun"):
        for net in NETS:
            base, mine = (statistics.median(seconds[launcher, net, t]) for t in trees)
            print(f"| {launcher} | {net} | {base * 1e3:.1f} | {mine * 1e3:.1f} | {mine / base:.2f}x |")


if __name__ == "__main__":
    main()
