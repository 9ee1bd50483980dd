"""The fake-CUDA tier (``fake_cuda_tier.py``: the PyTorch GPU path checked without a GPU), in
a process of its own: fake CUDA is booted before torch is imported, which this process
did long ago. ``pytest -m fake_cuda`` runs it alone (about 30 s on a 2-core CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.fake_cuda
def test_fake_cuda_tier():
    pytest.importorskip("torch")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-W",
                          "ignore::DeprecationWarning", str(ROOT / "tests" / "fake_cuda_tier.py")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, f"the fake-CUDA tier failed:\n{run.stdout[-12000:]}\n{run.stderr[-3000:]}"
