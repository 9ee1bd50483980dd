"""One benchmark run, one report: results/bench/REPORT.md, its plots, and results.json.

    python benchmarks/run.py                  # everything, about 15-25 minutes on 2 cores
    python benchmarks/run.py --quick          # smoke test of every part: 2 shapes, few iterations
    python benchmarks/report.py results/bench/results.json     # redo the report only

Parts (each a series of jobs launched from here, one after another; a job that fails
leaves its error in the report):

1. per-layer forward+backward, PyTorch at 1, 2 and 4 ranks (4 oversubscribe this
   machine's cores; ``--quick``: 1 and 2) with ``HVD_SYNCBN_COMM=horovod`` and ``=mpi``;
   Keras at 2 ranks;
2. an end-to-end training step, ResNet-18-like and the demo U-Net, at 2 ranks; Keras's,
   ResNet-18-like and MobileNetV2, on each path of our layer and local BN with and
   without XLA (``e2e_tf.py``);
3. collectives and bytes per step, counted (Horovod timeline, MPI call shim);
4. allreduce latency/bandwidth at 1-4 ranks (``--quick``: 1, 2 and 4, so that the fit
   still meets oversubscribed ranks), on loopback and between network-namespace hosts,
   and the scaling model fitted to it (``scaling.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_tf
import e2e_tf
from common import QUICK_SHAPES, SHAPES
from jobs import MALLOC, ROOT, Runner, build_shim

COMMS = ("horovod", "mpi")
ALL_IMPLS = "ours,local,floor_hvd,floor_mpi,hand"


def torch_layers(runner: Runner, shapes: list, iters: int, ranks_list: list, count_steps: int,
                 quick: bool) -> dict:
    out = {}
    args = ["--shapes", json.dumps(shapes), "--iters", str(iters)]
    for ranks in ranks_list:
        for comm in COMMS if ranks == 2 or not quick else COMMS[:1]:
            impls = ALL_IMPLS if comm == "horovod" else "ours,local,floor_mpi"
            impls += ",local_again" if ranks == 1 else ""
            extra = ["--refusals"] if comm == "horovod" and ranks == 2 else []
            out[f"{ranks}/{comm}"] = runner.mpirun(ranks, "bench_torch.py", [*args, "--impls", impls, *extra],
                                                   env={"HVD_SYNCBN_COMM": comm})
            if ranks == 2 and count_steps:
                out[f"count {ranks}/{comm}"] = runner.mpirun(
                    ranks, "bench_torch.py", [*args[:2], "--iters", "0", "--impls", impls,
                                              "--count-steps", str(count_steps)],
                    env={"HVD_SYNCBN_COMM": comm}, count=True)
    return out


def e2e(runner: Runner, iters: int, nets: str, count_steps: int, quick: bool) -> dict:
    out = {}
    for comm in COMMS[:1] if quick else COMMS:
        out[comm] = runner.mpirun(2, "e2e_torch.py", ["--iters", str(iters), "--nets", nets, "--count-steps", "0"],
                                  env={"HVD_SYNCBN_COMM": comm})
        if count_steps:
            out[f"count {comm}"] = runner.mpirun(
                2, "e2e_torch.py", ["--iters", "0", "--nets", nets, "--count-steps", str(count_steps)],
                env={"HVD_SYNCBN_COMM": comm}, count=True)
    return out


def netns_reason() -> str:
    """Why namespace hosts cannot run here ('' if they can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    missing = [t for t in ("ip", "unshare", "mpirun") if not shutil.which(t)]
    if missing:
        return f"missing {', '.join(missing)}"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"ip netns unusable: {probe.stderr.strip()[:200]}"


def alphabeta(runner: Runner, iters: int, sizes: list, netns: bool, quick: bool) -> dict:
    out = {"loopback": {}, "netns": {}}
    args = ["--iters", str(iters), "--sizes", json.dumps(sizes)]
    for ranks in (1, 2, 4) if quick else (1, 2, 3, 4):
        out["loopback"][str(ranks)] = runner.mpirun(ranks, "alphabeta.py", [*args, "--label", "loopback"])
    reason = netns_reason() if netns else "skipped (--no-netns)"
    if reason:
        out["netns_skipped"] = reason
        return out
    for hosts, slots in ((2, 1),) if quick else ((2, 1), (2, 2)):
        out["netns"][str(hosts * slots)] = runner.mpirun(hosts * slots, "alphabeta.py", [*args, "--label", "netns"],
                                                         netns=(hosts, slots))
    return out


def git_commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "hvd_syncbn"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return r.stdout.strip() + (" (hvd_syncbn/ has uncommitted changes)" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 shapes, tiny iteration counts")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench")
    parser.add_argument("--no-tf", action="store_true", help="skip the Keras jobs")
    parser.add_argument("--no-netns", action="store_true", help="skip the namespace-hosts fit")
    parser.add_argument("--wait-quiet", type=float, default=0, metavar="S",
                        help="first wait up to S seconds for the 1-minute load average to drop below 1")
    args = parser.parse_args()
    deadline = time.time() + args.wait_quiet
    while time.time() < deadline and os.getloadavg()[0] >= 1.0:
        time.sleep(10)
    q = args.quick
    shapes = [list(s) for s in (QUICK_SHAPES if q else SHAPES)]
    conf = {
        "layer_iters": 3 if q else 30, "tf_iters": 2 if q else 20, "e2e_iters": 2 if q else 15,
        "ab_iters": 5 if q else 40, "count_steps": 1 if q else 2,
        "ab_sizes": [1, 512, 32768] if q else [1, 8, 64, 512, 4096, 32768, 262144],
        "e2e_nets": "unet_demo" if q else "resnet18ish,unet_demo", "ranks": [1, 2] if q else [1, 2, 4],
        "malloc": MALLOC,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "jobs.log"
    log.write_text("")
    start = time.time()
    res = {"quick": q, "conf": conf, "shapes": shapes, "commit": git_commit(), "cores": os.cpu_count(),
           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": " ".join(sys.argv),
           "load_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        runner = Runner(Path(tmp), log, build_shim(Path(tmp)))
        res["counting_shim"] = runner.shim is not None
        res["torch_layers"] = torch_layers(runner, shapes, conf["layer_iters"], conf["ranks"], conf["count_steps"], q)
        res["e2e"] = e2e(runner, conf["e2e_iters"], conf["e2e_nets"], conf["count_steps"], q)
        res["alphabeta"] = alphabeta(runner, conf["ab_iters"], conf["ab_sizes"], not args.no_netns, q)
        if args.no_tf:
            res["tf_layers"] = res["tf_e2e"] = {"skipped": "--no-tf"}
        else:
            tf_shapes = shapes[:1] if q else shapes
            res["tf_layers"] = bench_tf.jobs(runner, tf_shapes, conf["tf_iters"], 2, COMMS,
                                             0 if q else conf["count_steps"])
            res["tf_e2e"] = e2e_tf.jobs(runner, conf["e2e_iters"], "mobilenetv2" if q else ",".join(e2e_tf.NETS))
    res["seconds"] = time.time() - start
    res["load_end"] = os.getloadavg()
    (args.out / "results.json").write_text(json.dumps(res, indent=1))
    from report import write_report

    path = write_report(res, args.out)
    print(f"[bench] {res['seconds'] / 60:.1f} min; wrote {path} (jobs' output: {log})", file=sys.stderr)


if __name__ == "__main__":
    main()
