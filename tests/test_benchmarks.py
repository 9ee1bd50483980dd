"""The benchmarks the docs cite, in a short mode: they run and print every row, so a
figure in the docs can be measured again (what they measure is not asserted: timings
belong in the benchmarks' own runs, not in tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launching import clean_env

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str) -> str:
    """Run ``args`` (a script under this Python, or a launcher's command line) from the root."""
    command = ["bash", *args] if args[0].endswith(".sh") else [sys.executable, *args]
    out = subprocess.run(command, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{args} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def table(out: str) -> list:
    """The first cell of every row of the printed tables (their headers left out)."""
    lines = out.splitlines()
    return [line.split(" | ")[0].lstrip("| ") for i, line in enumerate(lines)
            if line.startswith("| ") and not (i + 1 < len(lines) and lines[i + 1].startswith("|---"))]


def test_bench_device_prints_both_tables():
    """Host time per layer step: ours on both kernel sets beside BN and torch's own SyncBN
    Function, collectives as identities and over 1-rank Gloo."""
    out = bench("benchmarks/bench_device.py", "--iters", "2", "--steps", "2")
    settings = ["BN", "BN again", "torch's SyncBatchNorm Function", "ours, native (kernels stubbed)", "ours, composite"]
    assert table(out) == settings * 2 and "Collectives as identities" in out and "1-rank Gloo" in out, out


def test_bench_compile_first_compiles_resnet18_on_both_kernel_sets():
    """The first compile of a converted ResNet-18 (aot_eager) against plain BN's, each in a
    fresh process (all three at once: the seconds are not asserted)."""
    out = bench("benchmarks/bench_compile.py", "--first", "--repeats", "1", "--backend", "aot_eager", "--jobs", "3")
    assert table(out) == ["plain", "composite", "native"], out


def test_bench_versions_times_two_trees_alternately():
    """A CPU training step at 2 ranks under mpirun and torchrun, this tree against a
    baseline checkout (this tree again), each net in each."""
    out = bench("benchmarks/bench_versions.py", "--baseline", str(ROOT), "--rounds", "1", "--steps", "2")
    assert table(out) == ["mpirun", "mpirun", "torchrun", "torchrun"], out


def errors(results) -> list:
    """Every job's ``error`` in a ``run.py`` results tree (a failed job leaves one)."""
    if isinstance(results, dict):
        return ([results["error"]] if "error" in results else []) + [e for v in results.values() for e in errors(v)]
    return [e for v in results for e in errors(v)] if isinstance(results, list) else []


def test_run_quick_reports_every_pytorch_part(tmp_path):
    """``benchmarks/run.py --quick`` without the Keras jobs and the network-namespace hosts:
    per layer at 1, 2 and 4 ranks, the training steps, the counts and the scaling fit run,
    and the report is written, with no job's error in it."""
    bench("benchmarks/run.py", "--quick", "--no-tf", "--no-netns", "--out", str(tmp_path))
    results = json.loads((tmp_path / "results.json").read_text())
    assert not errors(results), errors(results)
    assert {"torch_layers", "e2e", "alphabeta"} <= set(results) and (tmp_path / "REPORT.md").is_file(), sorted(results)


def test_bench_comm_times_each_transport():
    """``benchmarks/bench_comm.py`` at 2 ranks under mpirun (PyTorch): a row per shape, each
    transport a column, and the ResNet-50 summary."""
    out = bench("launch/mpirun.sh", "-np", "2", "--", sys.executable, "benchmarks/bench_comm.py", "--framework",
                "torch", "--iters", "2")
    assert len(table(out)) == 5 and "| mpi | mpi excess | horovod |" in out and "ResNet-50's 53 BN layers" in out, out
