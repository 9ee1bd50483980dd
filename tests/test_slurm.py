"""Submits ``launch/slurm/train.sbatch``, the file users submit, to a real two-node Slurm
cluster that ``launch/slurm/local_cluster.sh`` brings up on this machine (network
namespaces) for the session and takes down after it, also when a test fails.

Each job runs on 2 nodes x 2 ranks, started by ``srun --mpi=pmix`` or by mpirun inside the
allocation, with the PyTorch or the Keras demo; each test checks the job's exit code and
state and its output (every BN statistic identical on the 4 ranks, the mIoU line). Then a
node's ranks are killed mid-epoch: the job must fail within 2x ``HVD_SYNCBN_TIMEOUT``, and
a resubmitted ``--resume`` job continue from the last checkpoint and end where an
uninterrupted job does, bit for bit. Skipped only where the script says it cannot run
(not root, no namespaces, Slurm not installed: ``launch/test.sh`` installs it as root).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launching import clean_env

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "launch" / "slurm" / "local_cluster.sh"
SBATCH = ROOT / "launch" / "slurm" / "train.sbatch"
GPU_SBATCH = ROOT / "launch" / "slurm" / "train_gpu.sbatch"
SCRIPTS = {"torch": "examples/torch_segmentation.py", "keras": "examples/keras_segmentation.py"}
DEMO_ARGS = ["--train-size", "96", "--val-size", "8", "--image-size", "16", "--width", "4"]
RANKS, NODES = 4, ("node1", "node2")
T = 60  # HVD_SYNCBN_TIMEOUT of the job that loses a node: 15 s fired by itself under load (nice 10)
JOB_TIMEOUT_S = 300
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")


class Cluster:
    def __init__(self, state: Path) -> None:
        self.state, self.jobs = state, state / "jobs"  # state is visible on every node
        # PYTHONPATH: this checkout's hvd_syncbn, whichever one .venv has installed.
        self.env = {**clean_env(), "SLURM_CONF": str(state / "slurm.conf"), "PYTHONPATH": str(ROOT),
                    "HOROVOD_FUSION_THRESHOLD": "0"}  # each gradient reduced alone: bitwise repeatable

    def submit(self, name: str, *args, wait: bool = True, recipe: Path = SBATCH, options: tuple = (), **env) -> str:
        """``sbatch options train.sbatch DEMO_ARGS args`` (another ``recipe``: without
        DEMO_ARGS); with ``wait``, until the job has ended. Its id."""
        self.jobs.mkdir(exist_ok=True)
        cmd = ["sbatch", "--parsable", f"--output={self.jobs / name}.out", f"--job-name={name}", *options,
               str(recipe), *(DEMO_ARGS if recipe == SBATCH else ()), *map(str, args)]
        out = subprocess.run(cmd, cwd=ROOT, env={**self.env, **env}, capture_output=True, text=True, timeout=60)
        job = re.search(r"^(\d+)", out.stdout, re.M)
        assert out.returncode == 0 and job, f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout}{out.stderr}"
        # Polled here: `sbatch --wait` checks after 2, 10, 42, 74... s, which rounded every job up.
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while wait and self.job(job.group(1))["JobState"] in ACTIVE:
            assert time.monotonic() < deadline, f"job {name} still {self.job(job.group(1))['JobState']} " \
                                                f"after {JOB_TIMEOUT_S} s:\n{self.log(name)[-3000:]}"
            time.sleep(0.2)
        return job.group(1)

    def job(self, job: str) -> dict:
        """``scontrol show job``'s fields (Slurm keeps a finished job for MinJobAge, 300 s)."""
        for attempt in range(5):  # a busy slurmctld may time out a query: ask again
            out = subprocess.run(["scontrol", "-o", "show", "job", job], env=self.env, capture_output=True, text=True)
            if out.returncode == 0:
                return dict(re.findall(r"(\w+)=(\S*)", out.stdout))
            time.sleep(1)
        raise AssertionError(f"scontrol show job {job} exited {out.returncode}: {out.stderr}")

    def log(self, name: str) -> str:
        return (self.jobs / f"{name}.out").read_text()

    def run(self, name: str, *args, **env) -> str:
        """Submits and waits; checks the exit code and state; returns the job's output."""
        start = time.monotonic()
        job = self.submit(name, *args, **env)
        info, log = self.job(job), self.log(name)
        print(f"job {name}: {info.get('JobState')} after {time.monotonic() - start:.1f} s")
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", \
            f"job {name}: {info.get('JobState')}, exit code {info.get('ExitCode')}:\n{log[-4000:]}"
        assert info["NodeList"] == "node[1-2]" and info["NumTasks"] == str(RANKS), info
        return log


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(["bash", str(CLUSTER), "up", "--dir", str(state)], capture_output=True, text=True,
                        timeout=120)
    if up.returncode == 3:
        pytest.skip(up.stderr.strip().splitlines()[0])
    try:
        assert up.returncode == 0, f"local_cluster.sh up exited {up.returncode}:\n{up.stderr}"
        assert f"export SLURM_CONF={state}/slurm.conf" in up.stdout, up.stdout
        yield Cluster(state)
    finally:
        down = subprocess.run(["bash", str(CLUSTER), "down", "--dir", str(state)], capture_output=True, text=True,
                              timeout=120)
        assert down.returncode == 0 and not state.exists(), f"local_cluster.sh down:\n{down.stderr}"


def epoch_lines(log: str) -> dict:
    """``{epoch: its line}`` from the demo's 'sync BN epoch E/N: train loss ... val mIoU ...' lines."""
    return {int(e): line for line, e in re.findall(r"^(sync BN epoch (\d+)/\d+: train loss [\d.]+ +val mIoU [\d.]+.*)$",
                                                   log, re.M)}


def check_demo(log: str, epochs: int, what: str) -> None:
    identical = re.findall(rf"^BN (?:running|moving) statistics identical on all {RANKS} ranks: (\S+)$", log, re.M)
    assert identical == ["yes"] * epochs, f"{what}: {identical}\n{log[-4000:]}"
    assert sorted(epoch_lines(log)) == list(range(1, epochs + 1)), f"{what}: no mIoU line per epoch:\n{log[-4000:]}"
    assert f"global batch = {RANKS} ranks" in log, log[-4000:]


@pytest.fixture(scope="session")
def uninterrupted(cluster):
    """The PyTorch demo, 2 epochs under srun: one of the four jobs, and the run a resumed job must match."""
    ckpt = cluster.jobs / "whole"
    log = cluster.run("torch-srun-whole", "--epochs", 2, "--checkpoint-dir", ckpt)
    return log, ckpt / "segmentation_sync.pt"


@pytest.mark.parametrize("framework", ["torch", "keras"])
@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_sbatch_runs_the_demo_on_two_nodes(cluster, uninterrupted, launcher, framework):
    if (launcher, framework) == ("srun", "torch"):
        log, epochs = uninterrupted[0], 2
    else:
        name, epochs = f"{framework}-{launcher}", 1
        log = cluster.run(name, "--epochs", epochs, "--train-size", 48, "--checkpoint-dir", cluster.jobs / name,
                          LAUNCHER=launcher, SCRIPT=SCRIPTS[framework])  # 48: 6 steps of 4 x 2 images
    check_demo(log, epochs, f"{framework} under {launcher}")


def node_ranks(node: str, script: str) -> list:
    """Pids of the processes running ``script`` on ``node`` (its network namespace)."""
    ns = f"hvdsl{NODES.index(node) + 1}"
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            if script.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:  # ended meanwhile
            pass
    return found


def test_lost_node_fails_in_time_and_resume_matches(cluster, uninterrupted):
    import torch

    whole_log, whole_ckpt = uninterrupted
    ckpt = cluster.jobs / "lost" / "segmentation_sync.pt"
    job = cluster.submit("lost", "--epochs", 2, "--checkpoint-dir", ckpt.parent, wait=False,
                            HVD_SYNCBN_TIMEOUT=str(T))
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not ckpt.exists() and time.monotonic() < deadline and cluster.job(job)["JobState"] in ACTIVE:
            time.sleep(0.1)
        assert ckpt.exists(), \
            f"no checkpoint after epoch 1 ({cluster.job(job)['JobState']}):\n{cluster.log('lost')[-3000:]}"
        ranks = node_ranks("node2", SCRIPTS["torch"])
        assert len(ranks) == RANKS // len(NODES), f"expected {RANKS // len(NODES)} ranks on node2, found {ranks}"
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while cluster.job(job)["JobState"] in ACTIVE and time.monotonic() - killed < 4 * T:
            time.sleep(0.2)
        took, info, log = time.monotonic() - killed, cluster.job(job), cluster.log("lost")
        assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", \
            f"{info['JobState']} {info['ExitCode']}:\n{log[-3000:]}"
        assert took <= 2 * T, f"the survivors on node1 took {took:.1f} s to end, more than 2 x {T} s:\n{log[-3000:]}"
        assert re.search(r"node2: tasks? [\d,-]+: Killed", log), f"the job did not fail for the kill:\n{log[-3000:]}"
    finally:  # a job left running would hold the nodes from the tests after this one
        subprocess.run(["scancel", job], env=cluster.env, capture_output=True)
    print(f"lost node: the job ended {took:.1f} s after node2's ranks were killed (HVD_SYNCBN_TIMEOUT={T})")
    state = torch.load(ckpt, map_location="cpu")  # the last complete checkpoint loads
    assert state["epoch"] == 1, f"the kill came too late: epoch {state['epoch']} had finished:\n{log[-3000:]}"

    resumed = cluster.run("resumed", "--epochs", 2, "--checkpoint-dir", ckpt.parent, "--resume")
    assert "resumed from epoch 1" in resumed, resumed[-3000:]
    assert epoch_lines(resumed)[2] == epoch_lines(whole_log)[2], (resumed[-2000:], whole_log[-2000:])
    a, b = torch.load(whole_ckpt, map_location="cpu"), torch.load(ckpt, map_location="cpu")
    assert b["epoch"] == 2
    for key, value in a["model"].items():  # parameters and BN running statistics, bitwise
        assert torch.equal(value, b["model"][key]), f"{key} differs from the uninterrupted job after resuming"


def test_gpu_recipe_runs_the_readme_torchrun_script_with_a_torchrun_per_node(cluster):
    """``train_gpu.sbatch``'s torchrun variant on the 2 nodes, its GPU line overridden
    (``--gpus-per-node=0``: the nodes have none) and ``NPROC_PER_NODE=2``: one torchrun per
    node, a c10d rendezvous on node1, and the README's torchrun script (on CPUs with Gloo,
    as tests/test_docs.py runs it; a line added to print each rank's world) on 4 ranks."""
    import test_docs

    script = cluster.jobs / "readme_torchrun.py"
    cluster.jobs.mkdir(exist_ok=True)
    readme = next(s for line, s in test_docs.quick_starts() if line.startswith("torchrun"))
    script.write_text(test_docs.on_cpu(readme).replace("dist.destroy_process_group()", (
        'print(f"rank {dist.get_rank()} of {dist.get_world_size()} on {os.uname().nodename}", flush=True)\n'
        "dist.destroy_process_group()")))
    job = cluster.submit("gpu-recipe", script, recipe=GPU_SBATCH, options=("--gpus-per-node=0", "--cpus-per-task=2"),
                         NPROC_PER_NODE="2", GLOO_SOCKET_IFNAME="eth0")
    info, log = cluster.job(job), cluster.log("gpu-recipe")
    assert info["JobState"] == "COMPLETED" and info["NumTasks"] == "2", f"{info}:\n{log[-4000:]}"
    ranks = sorted(re.findall(r"^rank (\d) of (\d) on (node\d)$", log, re.M))
    assert ranks == [("0", "4", "node1"), ("1", "4", "node1"), ("2", "4", "node2"), ("3", "4", "node2")], log[-4000:]
    assert "ranks started by torchrun" in log and len(re.findall(r"^step \d loss", log, re.M)) == 2, log[-4000:]


def test_refuses_without_root_saying_why(tmp_path):
    """Where it cannot run, ``up`` exits 3 with the reason (the fixture then skips) and
    starts nothing; run here as an unprivileged user."""
    if os.geteuid() != 0:
        pytest.skip("runs `up` as another user, which needs root")
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", str(CLUSTER), "up",
                          "--dir", str(tmp_path / "state")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and "cannot run here: needs root" in out.stderr and "uid 65534" in out.stderr, \
        f"exit {out.returncode}: {out.stderr}"
    assert not (tmp_path / "state").exists()


PROBE = """
import os, sys
from hvd_syncbn import launchers
with open(os.path.join(sys.argv[1], str(os.getpid())), "w") as f:  # a file each: mpirun interleaves stdout
    f.write(f"{launchers.launcher()} {launchers.world_size()}")
"""


@pytest.mark.parametrize("launch, expected", [
    (["srun", "--mpi=pmix"], "srun --mpi=pmix 4"),
    (["salloc", "--quiet", "mpirun", "--allow-run-as-root", "-np", str(RANKS)], "mpirun (Open MPI) 4"),
], ids=["srun-pmix", "salloc-mpirun"])
def test_launchers_named_under_slurm(cluster, launch, expected):
    """hvd_syncbn.launchers on ranks started by srun and by mpirun in an allocation."""
    found = cluster.jobs / f"launch-{launch[0]}"
    found.mkdir(parents=True)
    cmd = [launch[0], "-N2", f"-n{RANKS}", *launch[1:], sys.executable, "-c", PROBE, str(found)]
    out = subprocess.run(cmd, cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=120)
    named = [f.read_text() for f in found.iterdir()]
    assert out.returncode == 0 and named == [expected] * RANKS, f"{named}\n{out.stdout}{out.stderr[-3000:]}"
